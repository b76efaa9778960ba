"""Text generation with a key/value cache, to look at what a run made: a jitted prefill of the
prompt and a jitted one-token decode step on a cache of fixed size, so that nothing compiles per
token; greedy decoding or sampling (temperature, nucleus / top-p, Holtzman et al., arXiv
1904.09751) from a seed. Also :func:`merge_peft_adapters`: LoRA adapters in PEFT's format
(:func:`save_peft_adapters`' output) folded into a loaded model's kernels.

The cached forward reuses each block's own modules (norms, projections, q/k norms,
:func:`apply_rope`, MLP) in the order of :class:`Transformer`'s forward; only the attention is
written here, against the cache: float32 scores ``q k^T / sqrt(head_dim)``, a causal mask by
position, a float32 softmax, as :func:`ravnest_jax.models.attention` computes them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ._hf_names import fold_peft_tensors as fold_peft_tensors
from ._transformer import Transformer, apply_rope

#: the cache length and the padded prompt length are rounded up to a multiple of this (tokens):
#: prompts and budgets within one bucket share their compiled programs
BUCKET = 64
_NEG = float(np.finfo(np.float32).min)


def _round_up(n: int, m: int = BUCKET) -> int:
    return max(m, -(-n // m) * m)


def _attend(attn: Any, x: jax.Array, positions: jax.Array, inv_freq: jax.Array, ck: jax.Array, cv: jax.Array, start):
    """One block's attention on ``x`` ``(b, t, d)`` at ``positions`` ``(b, t)``: writes the new keys and
    values into the layer's cache ``ck``, ``cv`` ``(b, max_len, kv, head_dim)`` at ``start`` and
    attends over the cache (a key at cache slot ``j`` is seen by the query at position ``p`` when
    ``j <= p``). Returns ``(out (b, t, d), ck, cv)``."""
    b, t, _ = x.shape
    h, kvh, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = attn.q_proj(x).astype(attn.dtype).reshape(b, t, h, hd)
    k = attn.k_proj(x).astype(attn.dtype).reshape(b, t, kvh, hd)
    v = attn.v_proj(x).astype(attn.dtype).reshape(b, t, kvh, hd)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, start, 0, 0))
    cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, start, 0, 0))
    qg = q.reshape(b, t, kvh, h // kvh, hd)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, ck, preferred_element_type=jnp.float32) * jnp.float32(1 / math.sqrt(hd))
    mask = jnp.arange(ck.shape[1])[None, None, :] <= positions[:, :, None]  # (b, t, max_len)
    s = jnp.where(mask[:, None, None], s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(cv.dtype), cv, preferred_element_type=jnp.float32)
    out = out.astype(attn.dtype).reshape(b, t, h * hd)
    return attn.o_proj(out).astype(attn.dtype), ck, cv


def _forward(model: Transformer, tokens: jax.Array, start, cache_k: jax.Array, cache_v: jax.Array):
    """Logits float32 ``(b, t, vocab)`` of ``tokens`` ``(b, t)`` at positions ``start..start+t-1``,
    and the caches ``(layers, b, max_len, kv, head_dim)`` with their keys and values written."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    inv_freq = jnp.asarray(np.asarray(model._inv_freq, np.float32))
    x = model.embed_tokens(tokens)
    ks, vs = [], []
    for i, block in enumerate(model.layers):
        out, ck, cv = _attend(
            block.self_attn, block.input_layernorm(x), positions, inv_freq, cache_k[i], cache_v[i], start
        )
        ks.append(ck)
        vs.append(cv)
        x = x + out
        x = x + block.mlp(block.post_attention_layernorm(x))
    x = model.norm(x)
    logits = model.embed_tokens.attend(x) if model.lm_head is None else model.lm_head(x)
    return logits.astype(jnp.float32), jnp.stack(ks), jnp.stack(vs)


def _pick(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, key: jax.Array) -> jax.Array:
    """The next token int32 ``(b,)`` from float32 logits ``(b, vocab)``: the argmax when
    ``temperature`` is 0, else a sample of ``softmax(logits / temperature)`` restricted to the
    smallest set of most likely tokens whose probability reaches ``top_p``."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
    keep = before < top_p  # the first token always stays
    choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def _prefill(graphdef, state, tokens, max_len, length, temperature, top_p, key):
    """The prompt ``tokens`` ``(1, padded)`` (its first ``length`` real) through the model: the
    first new token ``(1,)`` and the caches (slots from ``length`` on hold padding's keys, which
    the decode steps overwrite before any query can see them)."""
    model = nnx.merge(graphdef, state)
    cfg = model.config
    shape = (cfg.num_hidden_layers, tokens.shape[0], max_len, cfg.num_key_value_heads, cfg.head_dim)
    cache = jnp.zeros(shape, model.layers[0].self_attn.dtype)
    logits, ck, cv = _forward(model, tokens, jnp.int32(0), cache, cache)
    last = jax.lax.dynamic_index_in_dim(logits, length - 1, axis=1, keepdims=False)
    return _pick(last, temperature, top_p, jax.random.fold_in(key, 0)), ck, cv


def _decode(graphdef, state, token, cache_k, cache_v, position, temperature, top_p, key):
    """One token ``(1,)`` at ``position``: the next token ``(1,)`` and the updated caches."""
    model = nnx.merge(graphdef, state)
    logits, ck, cv = _forward(model, token[:, None], position, cache_k, cache_v)
    return _pick(logits[:, -1], temperature, top_p, jax.random.fold_in(key, position)), ck, cv


_JITTED: list[tuple[Any, Any, Any]] = []  # (graphdef, prefill, decode), the latest few models


def jitted_steps(graphdef: Any) -> tuple[Any, Any]:
    """``(prefill, decode)``, the jitted steps of the model of ``graphdef`` (an ``nnx.split``
    graph; equal graphs share them, so a second :func:`generate` compiles nothing new): prefill
    ``(state, tokens (1, padded) int32, max_len (static), length, temperature, top_p, key) ->
    (token (1,), cache_k, cache_v)``; decode ``(state, token (1,), cache_k, cache_v, position,
    temperature, top_p, key) -> (token, cache_k, cache_v)`` (the caches donated). Their
    ``_cache_size()`` counts their compilations."""
    for gd, prefill, decode in _JITTED:
        if gd == graphdef:
            return prefill, decode
    prefill = jax.jit(partial(_prefill, graphdef), static_argnums=(2,))
    decode = jax.jit(partial(_decode, graphdef), donate_argnums=(2, 3))
    _JITTED.insert(0, (graphdef, prefill, decode))
    del _JITTED[4:]
    return prefill, decode


def generate(
    model: Transformer,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
) -> list[int]:
    """Continues ``prompt_ids`` with up to ``max_new_tokens`` tokens.

    The prompt runs through one jitted prefill (padded to a multiple of :data:`BUCKET` tokens),
    then each token through one jitted decode step on a key/value cache of ``prompt +
    max_new_tokens`` rounded up to a multiple of :data:`BUCKET` (float in the model's compute
    dtype, ``2 x layers x max_len x kv_heads x head_dim`` values): the decode step compiles once
    per model and cache size, not per token.

    Args:
      model: a whole :class:`Transformer` (per-layer or scanned; a scanned one is unstacked on a
        copy), without LoRA interceptors (fold adapters in first: :func:`merge_peft_adapters` or
        ``LoraModel.merged``).
      prompt_ids: the prompt's token ids (at least one), each in ``[0, vocab_size)``.
      max_new_tokens: the most tokens to add, >= 1.
      temperature: 0 (default) picks the most likely token; > 0 samples from ``softmax(logits /
        temperature)``.
      top_p: in (0, 1]: sample only from the most likely tokens whose probability reaches it.
      seed: the sampling seed: the same seed, prompt and model give the same tokens.
      stop_ids: tokens that end the generation (EOS, a chat turn's end); the stop token is not
        returned.

    Returns:
      the new token ids (without the prompt), at most ``max_new_tokens``.

    Raises:
      ValueError: an empty prompt, an id outside the vocabulary, ``max_new_tokens`` < 1, a
        negative temperature, ``top_p`` outside (0, 1], or a pipeline stage's slice of a model.
    """
    ids = [int(i) for i in prompt_ids]
    vocab = model.config.vocab_size
    if not ids:
        raise ValueError("generate: the prompt has no tokens")
    if any(not 0 <= i < vocab for i in ids):
        raise ValueError(f"generate: a prompt id outside the vocabulary [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"generate: temperature must be >= 0, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p must be in (0, 1], got {top_p!r}")
    if tuple(model.stage_ends) != (True, True):
        raise ValueError("generate: needs the whole model, not a pipeline stage's slice")
    if model.scan_layers:
        from ._scan import unstack_layers

        model = unstack_layers(nnx.clone(model))
    graphdef, state = nnx.split(model)
    stops = {int(s) for s in stop_ids}
    max_len = _round_up(len(ids) + max_new_tokens)
    padded = np.zeros((1, _round_up(len(ids))), np.int32)
    padded[0, : len(ids)] = ids
    t, p, key = jnp.float32(temperature), jnp.float32(top_p), jax.random.key(seed)
    prefill, decode = jitted_steps(graphdef)
    token, ck, cv = prefill(state, jnp.asarray(padded), max_len, jnp.int32(len(ids)), t, p, key)
    out: list[int] = []
    position = len(ids)
    while True:
        tok = int(token[0])
        if tok in stops:
            break
        out.append(tok)
        if len(out) >= max_new_tokens:
            break
        token, ck, cv = decode(state, token, ck, cv, jnp.int32(position), t, p, key)
        position += 1
    return out


# --- LoRA adapters in PEFT's format, folded into the kernels ---


def read_peft_adapters(path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(adapter_config, tensors)`` of a PEFT LoRA directory (``adapter_config.json``,
    ``adapter_model.safetensors``), checked before anything is loaded.

    Raises:
      ValueError: a missing directory or file, a config that is not a plain LoRA one (``peft_type``
        other than LORA, DoRA, rsLoRA, per-module rank or alpha patterns, biases), a lora_A without
        its lora_B.
    """
    from safetensors.numpy import load_file

    root = Path(path)
    cfg_file, weights = root / "adapter_config.json", root / "adapter_model.safetensors"
    for f in (cfg_file, weights):
        if not f.is_file():
            raise ValueError(f"adapters: no {f}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"adapters: {cfg_file} is not JSON: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapters: {cfg_file} has peft_type {cfg.get('peft_type')!r}; only LORA is supported")
    for flag in ("use_dora", "use_rslora"):
        if cfg.get(flag):
            raise ValueError(f"adapters: {cfg_file} sets {flag}; only plain LoRA is supported")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if cfg.get(pattern):
            raise ValueError(f"adapters: {cfg_file} has a {pattern}; only one rank and alpha are supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"adapters: {cfg_file} has bias {cfg.get('bias')!r}; only 'none' is supported")
    if not (isinstance(cfg.get("r"), int) and cfg["r"] >= 1 and isinstance(cfg.get("lora_alpha"), int | float)):
        raise ValueError(f"adapters: {cfg_file} needs r (an int >= 1) and lora_alpha (a number)")
    tensors = load_file(str(weights))
    names = {n.removesuffix(".lora_A.weight") for n in tensors if n.endswith(".lora_A.weight")}
    names_b = {n.removesuffix(".lora_B.weight") for n in tensors if n.endswith(".lora_B.weight")}
    if names != names_b:
        raise ValueError(f"adapters: {weights}: lora_A and lora_B differ for {sorted(names ^ names_b)[:3]}")
    if not names:
        raise ValueError(f"adapters: {weights} holds no lora_A / lora_B tensors")
    return cfg, tensors


def merge_peft_adapters(model: Transformer, path: str | Path) -> Transformer:
    """Folds the PEFT LoRA adapters at ``path`` into ``model``'s float kernels, in place:
    ``W += lora_alpha / r * lora_A.T @ lora_B.T`` (our ``(in, out)`` layout; PEFT's ``lora_A``
    is ``(r, in)``, ``lora_B`` ``(out, r)``), computed in float32 and cast to the kernel's dtype.
    What PEFT's ``merge_and_unload`` does; the model then computes what ``PeftModel`` computes.

    Args:
      model: a per-layer (``scan_layers=False``), unquantised :class:`Transformer` without LoRA.
      path: a directory as :func:`save_peft_adapters` writes it.

    Returns:
      ``model``.

    Raises:
      ValueError: as :func:`read_peft_adapters`; an adapter of a module the model does not have,
        or of the wrong shape; a scanned model.
    """
    cfg, tensors = read_peft_adapters(path)
    return fold_peft_tensors(model, tensors, float(cfg["lora_alpha"]) / cfg["r"])
