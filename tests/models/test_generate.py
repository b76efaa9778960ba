"""Generation with a key/value cache (``ravnest_jax.models.generate``) and ``ravnest-jax
generate``: the cached forward equals the full forward, greedy decoding with the cache equals
greedy decoding by re-running the whole model, sampling repeats with its seed, the decode step
compiles once, PEFT adapters fold in as PEFT computes them, and the command end to end."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
from flax import nnx  # noqa: E402

from ravnest_jax.cli import main  # noqa: E402
from ravnest_jax.models import generate, load_pretrained, merge_peft_adapters  # noqa: E402
from ravnest_jax.models._generate import _forward, jitted_steps  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LLAMA = FIXTURES / "llm" / "llama"
CHAT = FIXTURES / "chat" / "llama3"  # tokenizer.json + tokenizer_config.json with a chat template


@pytest.fixture(scope="module")
def llama():
    return load_pretrained(LLAMA, scan_layers=False, remat=False)


def _prompt(n: int = 5, row: int = 1) -> list[int]:
    return [int(t) for t in np.load(LLAMA / "tokens.npy")[row][:n]]


def _greedy_by_full_forward(model):
    """``greedy(prompt, n)``: greedy decoding by running the whole model on the whole sequence
    for every token (one jitted forward for all prompts, compiled once per length)."""
    graphdef, state = nnx.split(model)
    last = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids)[0, -1])

    def greedy(prompt: list[int], n: int) -> list[int]:
        ids, out = list(prompt), []
        for _ in range(n):
            tok = int(jnp.argmax(last(state, jnp.asarray([ids], jnp.int32))))
            out.append(tok)
            ids.append(tok)
        return out

    return greedy


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_cached_forward_equals_full_forward_token_by_token(name):
    """Prefill of 3 tokens, then one token at a time on the cache: every position's logits equal
    the full model's on the whole sequence (attention bias: qwen2; q/k norm: qwen3)."""
    model = load_pretrained(FIXTURES / "llm" / name, scan_layers=False, remat=False)
    tokens = jnp.asarray(np.load(FIXTURES / "llm" / name / "tokens.npy")[:1, :10], jnp.int32)
    graphdef, state = nnx.split(model)
    full = np.asarray(jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))(state, tokens))
    step = jax.jit(lambda st, *a: _forward(nnx.merge(graphdef, st), *a))
    cfg = model.config
    cache = jnp.zeros((cfg.num_hidden_layers, 1, 16, cfg.num_key_value_heads, cfg.head_dim), jnp.float32)
    logits, ck, cv = step(state, tokens[:, :3], jnp.int32(0), cache, cache)
    got = [np.asarray(logits[0])]
    for i in range(3, 10):
        logits, ck, cv = step(state, tokens[:, i : i + 1], jnp.int32(i), ck, cv)
        got.append(np.asarray(logits[0]))
    np.testing.assert_allclose(np.concatenate(got), full[0], atol=1e-5)


@pytest.mark.integration  # compiles the full forward at 12 lengths
def test_greedy_with_cache_equals_greedy_by_full_forward(llama):
    greedy = _greedy_by_full_forward(llama)
    for n in (5, 9):  # greedy tokens [80 x6, 36, 36] and [40, 90, 80, ...]
        prompt = _prompt(n, 1)
        assert generate(llama, prompt, max_new_tokens=8) == greedy(prompt, 8)


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_sampling_repeats_with_its_seed_and_the_decode_step_compiles_once(llama):
    graphdef = nnx.split(llama)[0]
    prefill, decode = jitted_steps(graphdef)
    before = decode._cache_size()
    a = generate(llama, _prompt(), max_new_tokens=8, temperature=1.0, top_p=0.9, seed=1)
    assert decode._cache_size() <= max(before, 1)
    b = generate(llama, _prompt(), max_new_tokens=8, temperature=1.0, top_p=0.9, seed=1)
    c = generate(llama, _prompt(), max_new_tokens=8, temperature=1.0, top_p=0.9, seed=2)
    g = generate(llama, _prompt(7, 0), max_new_tokens=8)  # another prompt length, greedy
    assert a == b and a != c and len(a) == len(c) == len(g) == 8
    assert decode._cache_size() == 1  # 4 runs, 28 decode steps, one compilation
    assert prefill._cache_size() == 1  # prompts padded to one bucket


def test_stop_ids_end_the_generation(llama):
    free = generate(llama, _prompt(), max_new_tokens=8, temperature=1.0, seed=3)
    stop = free[3]
    out = generate(llama, _prompt(), max_new_tokens=8, temperature=1.0, seed=3, stop_ids=[stop])
    assert out == free[: free.index(stop)]


def test_tiny_top_p_is_greedy(llama):
    greedy = generate(llama, _prompt(), max_new_tokens=6)
    assert generate(llama, _prompt(), max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=4) == greedy


def test_a_scanned_model_generates_what_the_per_layer_one_does(llama):
    scanned = load_pretrained(LLAMA, remat=False)  # scan_layers=True: unstacked on a copy
    assert scanned.scan_layers
    assert generate(scanned, _prompt(9), max_new_tokens=6) == generate(llama, _prompt(9), max_new_tokens=6)
    assert scanned.scan_layers


def test_bad_arguments_are_one_line_errors(llama):
    for kw, match in (
        (dict(prompt_ids=[]), "no tokens"),
        (dict(prompt_ids=[96]), "outside the vocabulary"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
    ):
        args = {"prompt_ids": [1, 2], "max_new_tokens": 2, **kw}
        with pytest.raises(ValueError, match=match):
            generate(llama, args.pop("prompt_ids"), **args)


@pytest.mark.integration  # over 2 s of compiling on 2 cores: the full suite, not the unit tier
def test_peft_adapters_merge_to_what_peft_computes():
    """The committed PEFT export (tests/fixtures/peft/llama) folded into the base: its logits
    equal those PEFT 0.21 computed with it (and differ from the base's)."""
    expected = np.load(FIXTURES / "peft" / "llama" / "expected.npz")
    model = merge_peft_adapters(load_pretrained(LLAMA, scan_layers=False, remat=False), FIXTURES / "peft" / "llama")
    logits = np.asarray(model(jnp.asarray(expected["tokens"], jnp.int32)))
    np.testing.assert_allclose(logits, expected["logits"], atol=2e-5)
    assert np.abs(logits - expected["base_logits"]).max() > 0.1


def test_bad_adapter_dirs_are_named(tmp_path, llama):
    with pytest.raises(ValueError, match="no .*adapter_config.json"):
        merge_peft_adapters(llama, tmp_path)
    shutil.copytree(FIXTURES / "peft" / "llama", tmp_path / "a")
    cfg = (tmp_path / "a" / "adapter_config.json").read_text().replace('"use_dora": false', '"use_dora": true')
    (tmp_path / "a" / "adapter_config.json").write_text(cfg)
    with pytest.raises(ValueError, match="use_dora"):
        merge_peft_adapters(llama, tmp_path / "a")


# --- the command ---


def test_command_errors_before_loading(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["generate", "--model", str(LLAMA), "--prompt", "hi"]) == 2  # no tokenizer.json
    assert "no tokenizer.json" in capsys.readouterr().err
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(LLAMA / f, ck / f)
    shutil.copy(FIXTURES / "chat" / "llama3" / "tokenizer.json", ck)
    assert main(["generate", "--model", str(ck), "--chat", "hi"]) == 2  # no tokenizer_config: no template
    assert "no tokenizer_config.json" in capsys.readouterr().err
    assert main(["generate", "--model", str(ck), "--prompt", "hi", "--adapters", str(tmp_path / "x")]) == 2
    assert "--adapters" in capsys.readouterr().err
    for bad in (["--top-p", "0"], ["--temperature", "-1"], ["--max-new-tokens", "0"], ["--chat", "x"]):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--model", str(ck), "--prompt", "hi", *bad])
        assert e.value.code == 2
    assert "not allowed with" in capsys.readouterr().err  # --prompt and --chat


def _tiny_checkpoint(tmp_path: Path) -> Path:
    """A random llama-layout model over the chat fixture's 420-token vocabulary, saved with
    ``save_pretrained``, plus that tokenizer's files."""
    from ravnest_jax.models import Transformer, TransformerConfig, save_pretrained

    cfg = TransformerConfig(
        model_type="llama",
        vocab_size=420,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = Transformer(cfg, nnx.Rngs(0))
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):  # livelier than normal(0.02)
        if var.get_value().ndim == 2:
            var.set_value(var.get_value() * 10)
    out = save_pretrained(model, tmp_path / "ck")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(CHAT / f, out / f)
    return out


def _run(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ravnest_jax.cli", "generate", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "JAX_PLATFORMS": "cpu"},
    )


@pytest.mark.integration
def test_command_end_to_end_with_and_without_adapters(tmp_path, fast_compile_env):
    from ravnest_jax.models import LoraConfig, save_peft_adapters, split_lora

    ck = _tiny_checkpoint(tmp_path)
    lm = split_lora(
        load_pretrained(ck, lora=LoraConfig(rank=2, alpha=4.0, targets=("q", "v", "down")), scan_layers=False)
    )
    leaves, tree = jax.tree.flatten(lm.adapters)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    adapters = jax.tree.unflatten(tree, [0.5 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
    ad = save_peft_adapters(lm, adapters, tmp_path / "adapters")

    # non-zero B changes the logits, and the merge computes what our LoRA model computes
    tokens = jnp.asarray([[0, 5, 9, 40, 200]], jnp.int32)
    base = np.asarray(load_pretrained(ck, scan_layers=False, remat=False)(tokens))
    merged = np.asarray(merge_peft_adapters(load_pretrained(ck, scan_layers=False, remat=False), ad)(tokens))
    lora = np.asarray(lm.model(adapters, lm.frozen)(tokens))
    np.testing.assert_allclose(merged, lora, atol=1e-4)
    assert np.abs(merged - base).max() > 1e-2

    plain = _run(fast_compile_env, "--model", str(ck), "--prompt", "hello world", "--max-new-tokens", "12")
    assert plain.returncode == 0, plain.stderr
    again = _run(fast_compile_env, "--model", str(ck), "--prompt", "hello world", "--max-new-tokens", "12")
    assert again.stdout == plain.stdout and plain.stdout.strip()
    adapted = _run(
        fast_compile_env, "--model", str(ck), "--adapters", str(ad), "--prompt", "hello world", "--max-new-tokens", "12"
    )
    assert adapted.returncode == 0, adapted.stderr
    assert adapted.stdout != plain.stdout
    chat = _run(
        fast_compile_env, "--model", str(ck), "--adapters", str(ad), "--chat", "hi", "--temperature", "0.8", "--top-p", "0.9",
        "--seed", "3", "--max-new-tokens", "8", "--dtype", "bfloat16",
    )  # fmt: skip
    assert chat.returncode == 0, chat.stderr
