"""Attention (``ravnest_jax.models.attention``): every implementation equals XLA's reference in
float32 (outputs, gradients w.r.t. q, k, v, and the tiny model's logits, loss and LoRA
gradients), for grouped-query and multi-head attention, sequences that do and do not divide by
the chunk, with and without segment ids; segment ids keep packed documents apart; the chunked
kernel's compiled plan holds no ``seq x seq`` scores; bad settings are one-line errors."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ravnest_jax.models import ATTENTION_IMPLEMENTATIONS, Transformer, TransformerConfig, attention, load_pretrained
from ravnest_jax.models._attention import _no_cudnn_reason

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "llm" / "llama"
TOL = 1e-5
NO_CUDNN = _no_cudnn_reason(jnp.bfloat16)

# (seq, chunk): divisible (24 = 3 x 8) and not (24 = 3 x 7 + 3: the last chunk padded)
SEQ_CHUNKS = [(24, 8), (24, 7)]


def _qkv(batch, seq, heads, kv_heads, head_dim=16, dtype=jnp.float32, seed=0):
    """q, k, v and an output cotangent, standard normal (numpy: nothing to compile)."""
    rng = np.random.default_rng(seed)
    shapes = [(batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim), (batch, seq, kv_heads, head_dim)]
    shapes.append(shapes[0])
    return [jnp.asarray(rng.standard_normal(sh, np.float32), dtype) for sh in shapes]


def _packed_segments(batch, seq):
    """Row 0: three documents (5, 11, rest); row 1: one document, then another (13, rest) with
    non-contiguous labels."""
    rows = [np.repeat([0, 1, 2], [5, 11, seq - 16]), np.repeat([7, 3], [13, seq - 13])]
    return jnp.asarray(np.stack(rows[:batch]), jnp.int32)


def _positions(segment_ids):
    """Positions restarting at 0 where the segment id changes (int32, like the ids)."""
    ids = np.asarray(segment_ids)
    out = np.zeros_like(ids)
    for r, row in enumerate(ids):
        for t in range(1, len(row)):
            out[r, t] = 0 if row[t] != row[t - 1] else out[r, t - 1] + 1
    return jnp.asarray(out, jnp.int32)


def _out_and_grads(fn, q, k, v, do):
    """``fn(q, k, v)`` and its vjp with ``do``, in one jitted program."""

    def both(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(do))

    return jax.jit(both)(q, k, v, do)


def _assert_close(got, want, what):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
        assert err < TOL, f"{what}: max |{name} - xla| = {err:.2e}"


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("seq, chunk", SEQ_CHUNKS)
@pytest.mark.parametrize("segments", [False, True], ids=["one-segment", "packed"])
def test_chunked_outputs_and_gradients_equal_xla(heads, kv_heads, seq, chunk, segments):
    q, k, v, do = _qkv(2, seq, heads, kv_heads)
    seg = _packed_segments(2, seq) if segments else None
    got = _out_and_grads(
        lambda q, k, v: attention(q, k, v, segment_ids=seg, implementation="chunked", chunk_size=chunk), q, k, v, do
    )
    _assert_close(got, _xla_out_and_grads(heads, kv_heads, seq, segments), f"chunked, chunk {chunk}")


@functools.cache
def _xla_out_and_grads(heads, kv_heads, seq, segments):
    """XLA's attention and its gradients on the inputs above (no chunks: once for both chunk sizes)."""
    q, k, v, do = _qkv(2, seq, heads, kv_heads)
    seg = _packed_segments(2, seq) if segments else None
    return _out_and_grads(lambda q, k, v: attention(q, k, v, segment_ids=seg, implementation="xla"), q, k, v, do)


@pytest.mark.skipif(bool(NO_CUDNN), reason=NO_CUDNN or "cuDNN present")
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("segments", [False, True], ids=["one-segment", "packed"])
def test_cudnn_outputs_and_gradients_are_close_to_xla(heads, kv_heads, segments):
    """bfloat16 on both sides (cuDNN takes no float32): a loose check, as jax's own tests."""
    q, k, v, do = _qkv(2, 64, heads, kv_heads, head_dim=64, dtype=jnp.bfloat16)
    seg = _packed_segments(2, 64) if segments else None
    got, want = (
        _out_and_grads(lambda q, k, v, i=i: attention(q, k, v, segment_ids=seg, implementation=i), q, k, v, do)
        for i in ("cudnn", "xla")
    )
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=5e-2, rtol=5e-2)


def test_auto_picks_xla_for_one_chunk_and_the_chunked_kernel_beyond_off_cuda():
    if not NO_CUDNN:
        pytest.skip("this machine has cuDNN: auto picks it for bfloat16")
    q, k, v, _ = _qkv(1, 24, 4, 2)
    for chunk, loops in ((32, False), (8, True)):
        jaxpr = str(jax.make_jaxpr(lambda q, k, v, c=chunk: attention(q, k, v, chunk_size=c))(q, k, v))
        assert ("while" in jaxpr) == loops, (chunk, jaxpr[:300])


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_the_chunked_kernel_in_bfloat16_is_close_to_xla():
    q, k, v, do = _qkv(1, 40, 4, 2, dtype=jnp.bfloat16)
    seg = jnp.asarray(np.repeat([[0, 1]], [17, 23], axis=1), jnp.int32)
    got, want = (
        _out_and_grads(
            lambda q, k, v, i=i: attention(q, k, v, segment_ids=seg, implementation=i, chunk_size=16), q, k, v, do
        )
        for i in ("chunked", "xla")
    )
    assert all(a.dtype == jnp.bfloat16 for a in got)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=3e-2, rtol=3e-2)


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_segment_ids_keep_documents_apart_in_the_kernel():
    """Document 2 of a packed row gives what it gives alone, whatever document 1 holds."""
    q, k, v, _ = _qkv(1, 24, 4, 2)
    seg = jnp.asarray(np.repeat([[0, 1]], [9, 15], axis=1), jnp.int32)
    for impl in ("xla", "chunked"):
        alone = attention(q[:, 9:], k[:, 9:], v[:, 9:], implementation=impl, chunk_size=4)
        packed = attention(q, k, v, segment_ids=seg, implementation=impl, chunk_size=4)
        np.testing.assert_allclose(np.asarray(packed[:, 9:]), np.asarray(alone), atol=TOL, err_msg=impl)
        k2, v2 = k.at[:, :9].multiply(-3.0), v.at[:, :9].add(5.0)
        again = attention(q, k2, v2, segment_ids=seg, implementation=impl, chunk_size=4)
        np.testing.assert_array_equal(np.asarray(again[:, 9:]), np.asarray(packed[:, 9:]), err_msg=impl)
        assert float(jnp.abs(again[:, :9] - packed[:, :9]).max()) > 0.1, impl  # document 1 did change


# ---------------------------------------------------------------- the tiny model with LoRA
def _lora_model(kv_heads: int):
    pytest.importorskip("qwix")
    from flax import nnx

    from ravnest_jax.models import LoraConfig, apply_lora, load_pretrained, split_lora

    if kv_heads == 2:  # the fixture as Hugging Face made it (grouped-query)
        model = load_pretrained(LLAMA)
    else:  # multi-head: the fixture's shapes with as many kv heads as heads, random weights
        cfg = dataclasses.replace(TransformerConfig.from_hf(LLAMA), num_key_value_heads=kv_heads)
        model = Transformer(cfg, nnx.Rngs(0))
    lm = split_lora(apply_lora(model, LoraConfig(rank=4)))
    leaves, tree = jax.tree.flatten(lm.adapters)  # B != 0: the adapters change the output
    keys = jax.random.split(jax.random.key(1), len(leaves))
    adapters = jax.tree.unflatten(tree, [0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
    return lm, adapters


_LMS: dict = {}


def _lm(kv_heads):
    if kv_heads not in _LMS:
        _LMS[kv_heads] = _lora_model(kv_heads)
    return _LMS[kv_heads]


def _tokens(seq=23):
    return jax.random.randint(jax.random.key(2), (2, seq + 1), 0, 96, jnp.int32)


def _model_run(lm, adapters, tokens, impl, chunk, segment_ids, positions, remat=False):
    def loss(adapters, frozen):
        model = lm.model(adapters, frozen)
        model.attention, model.attention_chunk, model.remat = impl, chunk, remat
        logits = model(tokens[:, :-1], positions, segment_ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(adapters, lm.frozen)
    return logits, value, grads


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
@pytest.mark.parametrize(
    "kv_heads, chunk, segments",
    [  # each takes 5 to 20 s of compiles on 2 cores: the full suite only
        pytest.param(2, 5, True, marks=pytest.mark.integration),
        pytest.param(2, 8, False, marks=pytest.mark.integration),
        pytest.param(4, 5, False, marks=pytest.mark.integration),
        (4, 8, True),
    ],
    ids=["gqa-chunk5-packed", "gqa-chunk8", "mha-chunk5", "mha-chunk8-packed"],
)  # 23 tokens: 5 chunks of 5 or 3 chunks of 8, the last padded
def test_model_logits_loss_and_lora_gradients_equal_xla(kv_heads, chunk, segments):
    lm, adapters = _lm(kv_heads)
    tokens = _tokens()
    seg = pos = None
    if segments:
        seg = _packed_segments(2, 23)
        pos = _positions(seg)
    want = _model_run(lm, adapters, tokens, "xla", chunk, seg, pos)
    got = _model_run(lm, adapters, tokens, "chunked", chunk, seg, pos, remat=segments)  # remat threads segment ids
    assert float(jnp.abs(got[0] - want[0]).max()) < TOL, "logits"
    assert abs(float(got[1]) - float(want[1])) < TOL, ("loss", float(got[1]), float(want[1]))
    flat_want = jax.tree_util.tree_leaves_with_path(want[2])
    assert max(float(jnp.abs(g).max()) for _, g in flat_want) > 1e-3  # the gradients are not all zero
    for (path, w), g in zip(flat_want, jax.tree.leaves(got[2])):
        err = float(jnp.abs(g - w).max())
        assert err < TOL, f"LoRA gradient {jax.tree_util.keystr(path)}: max |chunked - xla| = {err:.2e}"


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_packed_documents_in_the_model_equal_each_document_alone(impl):
    """Document 2's logits in a packed row (positions restarting at 0) equal its logits run
    alone, and do not move when document 1's tokens change."""
    lm, adapters = _lm(2)
    tokens = _tokens(23)[:, :-1]
    n1 = 9
    seg = jnp.asarray(np.repeat([[0, 1]], [n1, 23 - n1], axis=1).repeat(2, 0), jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(n1), np.arange(23 - n1)])[None].repeat(2, 0), jnp.int32)

    @jax.jit
    def logits(tokens, positions, segment_ids):
        model = lm.model(adapters, lm.frozen)
        model.attention, model.attention_chunk = impl, 4
        return model(tokens, positions, segment_ids)

    packed = logits(tokens, pos, seg)
    alone = logits(tokens[:, n1:], None, None)
    err = float(jnp.abs(packed[:, n1:] - alone).max())
    assert err < TOL, f"{impl}: document 2 packed vs alone: max |logits difference| = {err:.2e}"
    other = tokens.at[:, :n1].set((tokens[:, :n1] + 7) % 96)
    again = logits(other, pos, seg)
    np.testing.assert_array_equal(np.asarray(again[:, n1:]), np.asarray(packed[:, n1:]))
    assert float(jnp.abs(again[:, :n1] - packed[:, :n1]).max()) > 1e-3  # document 1's logits did change


def test_head_false_returns_the_hidden_state_before_the_final_norm():
    from flax import nnx

    # the fixture's model as Hugging Face made it, without adapters: 15 s less of LoRA set-up in
    # the unit tier, and the same layers (head=False is the model's, not the adapters')
    graphdef, state = nnx.split(load_pretrained(LLAMA))
    tokens = _tokens(16)[:, :-1]

    @jax.jit
    def both(state):
        model = nnx.merge(graphdef, state)
        hidden = model(tokens, head=False)
        return hidden, model.lm_head(model.norm(hidden)), model(tokens)

    hidden, logits_from_hidden, logits = both(state)
    assert hidden.shape == (2, 16, 64) and hidden.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits_from_hidden), np.asarray(logits), atol=1e-6)


def test_the_setting_is_static_and_survives_split_and_merge():
    from flax import nnx

    model = nnx.eval_shape(lambda: Transformer(TransformerConfig.from_hf(LLAMA), nnx.Rngs(0), attention="chunked"))
    model.attention_chunk = 7
    again = nnx.merge(*nnx.split(model))
    assert (again.attention, again.attention_chunk) == ("chunked", 7)
    assert {(b.self_attn.implementation, b.self_attn.chunk_size) for b in again.layers} == {("chunked", 7)}
    again.attention = "xla"
    assert {b.self_attn.implementation for b in again.layers} == {"xla"}
    assert model.attention == "chunked"  # the original is untouched


# ------------------------------------------------------------------------------- memory
def _temp_bytes(impl, batch, seq, heads, kv_heads, head_dim, chunk):
    def loss(q, k, v, seg):
        out = attention(q, k, v, segment_ids=seg, implementation=impl, chunk_size=chunk)
        return jnp.sum(out * out)

    s = jax.ShapeDtypeStruct
    args = (
        s((batch, seq, heads, head_dim), jnp.float32),
        s((batch, seq, kv_heads, head_dim), jnp.float32),
        s((batch, seq, kv_heads, head_dim), jnp.float32),
        s((batch, seq), jnp.int32),
    )
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_attention_never_holds_the_scores():
    """XLA's compiled plan of forward + backward at 4096 tokens: the chunked kernel's temporary
    bytes are well under one float32 ``seq x seq`` score matrix of a single head; XLA's own
    attention (the check's control) holds several per head."""
    seq, heads = 4096, 4
    scores = seq * seq * 4  # one head's float32 scores
    chunked = _temp_bytes("chunked", 1, seq, heads, 2, 64, 256)
    assert chunked < scores / 2, f"chunked temp {chunked / 2**20:.1f} MiB vs one score matrix {scores / 2**20:.0f} MiB"
    xla = _temp_bytes("xla", 1, seq, heads, 2, 64, 256)
    assert xla > heads * scores, f"xla temp {xla / 2**20:.1f} MiB vs {heads} score matrices"


# ------------------------------------------------------------------------------- errors
def test_bad_settings_are_one_line_value_errors():
    from flax import nnx

    q, k, v, _ = _qkv(1, 8, 4, 2)
    with pytest.raises(ValueError, match=r"implementation='flash': choose one of auto, cudnn, chunked, xla$"):
        attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match="chunk_size=0"):
        attention(q, k, v, chunk_size=0)
    with pytest.raises(ValueError, match="segment_ids"):
        attention(q, k, v, segment_ids=jnp.zeros((1, 7), jnp.int32))
    with pytest.raises(ValueError, match="heads"):
        attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
    cfg = TransformerConfig.from_hf(LLAMA)
    with pytest.raises(ValueError, match="implementation='sdpa'"):
        Transformer(cfg, nnx.Rngs(0), attention="sdpa")
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    with pytest.raises(ValueError, match="implementation=None"):
        model.attention = None
    with pytest.raises(ValueError, match="attention_chunk=0"):
        model.attention_chunk = 0
    assert model.attention == "auto" and ATTENTION_IMPLEMENTATIONS == ("auto", "cudnn", "chunked", "xla")


@pytest.mark.skipif(not NO_CUDNN, reason="this machine has cuDNN: 'cudnn' runs (the equality test covers it)")
def test_cudnn_without_an_nvidia_gpu_is_a_one_line_value_error():
    q, k, v, _ = _qkv(1, 8, 4, 2, dtype=jnp.bfloat16)
    with pytest.raises(
        ValueError, match=r"^attention implementation='cudnn': cuDNN flash attention needs an NVIDIA GPU"
    ) as e:
        attention(q, k, v, implementation="cudnn")
    assert "\n" not in str(e.value)
