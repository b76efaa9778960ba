"""LoRA adapters exported in Hugging Face PEFT's format (``save_peft_adapters``): the export of
fixed adapters equals the committed one tensor for tensor (names, shapes, dtypes, and values to
float32 rounding: the adapters are drawn by ``jax.random.normal``, whose last bit differs between
CPUs and XLA's compile settings), and our adapted model's logits equal
those PEFT computed with that export on the base checkpoint (tests/fixtures/peft/make.py, run once
with torch + transformers + peft; no torch here). With torch and peft importable, the comparison
also runs live on a fresh export."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("qwix")
pytest.importorskip("safetensors")
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from ravnest_jax.models import LoraConfig, load_pretrained, save_peft_adapters, split_lora  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PEFT = FIXTURES / "peft"
_spec = importlib.util.spec_from_file_location("peft_fixtures", PEFT / "make.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)
CASES = list(make.CASES)


@pytest.fixture(scope="module", params=CASES)
def case(request):
    """``(name, lm, adapters)``: the fixture's model and adapters (make.adapters, fixed seeds)."""
    return (request.param, *make.adapters(request.param))


def _export(tmp_path, name, lm, adapters, **kw):
    ckpt = make.CASES[name][0]
    return save_peft_adapters(lm, adapters, tmp_path / name, base_model_name_or_path=f"tests/fixtures/llm/{ckpt}", **kw)


def _logits(lm, adapters, tokens):
    return np.asarray(jax.jit(lambda a, f, t: lm.model(a, f)(t))(adapters, lm.frozen, jnp.asarray(tokens)))


@pytest.mark.integration  # 5 s (llama) and 1.5 s (qwen2, after llama) of compiling on 2 cores: the full suite, not the unit tier
def test_export_equals_the_committed_one(tmp_path, case):
    name, lm, adapters = case
    out = _export(tmp_path, name, lm, adapters)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    got, want = load_file(out / "adapter_model.safetensors"), load_file(PEFT / name / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype == np.float32, k
        # a wrong transpose, scale or layer order is off by far more than a few float32 ulps
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=0, err_msg=k)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config == json.loads((PEFT / name / "adapter_config.json").read_text())
    lora = lm.lora
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["bias"] == "none"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (lora.rank, lora.alpha, lora.dropout)
    assert config["target_modules"] == sorted(lora.targets)
    # PEFT's names and shapes: lora_A (r, in), lora_B (out, r), per layer and projection
    assert len(want) == 2 * len(lora.targets) * 2  # A and B, 2 layers
    q = "base_model.model.model.layers.1.self_attn.q_proj"
    assert want[q + ".lora_A.weight"].shape == (lora.rank, 64)
    assert want[q + ".lora_B.weight"].shape == (64, lora.rank)


def test_logits_equal_peft_within_1e_4(case):
    name, lm, adapters = case
    ref = np.load(PEFT / name / "expected.npz")
    got = _logits(lm, adapters, ref["tokens"])
    err = float(np.abs(got - ref["logits"]).max())
    assert got.shape == ref["logits"].shape and err < 1e-4, f"{name}: max |logits - PEFT| = {err:.2e}"
    # the adapters matter: a wrong scale or transpose could not pass
    assert float(np.abs(ref["logits"] - ref["base_logits"]).max()) > 0.1


def test_scanned_and_unrolled_export_the_same(tmp_path):
    ckpt, kw, scanned = make.CASES["llama"]
    assert scanned
    lm, adapters = make.adapters("llama")
    per_layer = split_lora(load_pretrained(FIXTURES / "llm" / ckpt, lora=LoraConfig(**kw), scan_layers=False))
    # the same values, unstacked: layer i of each stacked adapter
    stacked = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(adapters)}
    flat = nnx.to_flat_state(per_layer.adapters)
    for path, var in flat:
        value = stacked[(path[0], *path[2:])][path[1]]
        assert value.shape == var.get_value().shape
        var.set_value(value)
    unrolled = nnx.from_flat_state(flat)
    a = load_file(save_peft_adapters(lm, adapters, tmp_path / "scanned") / "adapter_model.safetensors")
    b = load_file(save_peft_adapters(per_layer, unrolled, tmp_path / "unrolled") / "adapter_model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_dtype_is_kept_or_given(tmp_path):
    lm, adapters = make.adapters("qwen2_frozen_a")
    out = save_peft_adapters(lm, adapters, tmp_path / "bf16", dtype=jnp.bfloat16)
    got = load_file(out / "adapter_model.safetensors")
    want = load_file(save_peft_adapters(lm, adapters, tmp_path / "f32") / "adapter_model.safetensors")
    for k in want:
        assert got[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(got[k], want[k].astype(jnp.bfloat16), err_msg=k)


def test_bad_input_is_one_line(tmp_path):
    lm, adapters = make.adapters("qwen2_frozen_a")
    with pytest.raises(ValueError, match="needs a LoraModel"):
        save_peft_adapters(lm.model(adapters, lm.frozen), adapters, tmp_path / "a")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        save_peft_adapters(lm, adapters, full)
    assert save_peft_adapters(lm, adapters, full, overwrite=True) == full
    with pytest.raises(ValueError, match="not a directory"):
        save_peft_adapters(lm, adapters, full / "x")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_peft_adapters(lm._replace(frozen=nnx.State({})), nnx.State({}), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_live_peft_loads_a_fresh_export(tmp_path, case):
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from peft import PeftModel

    name, lm, adapters = case
    out = _export(tmp_path, name, lm, adapters)
    tokens = np.load(PEFT / name / "expected.npz")["tokens"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = transformers.AutoModelForCausalLM.from_pretrained(
            FIXTURES / "llm" / make.CASES[name][0], dtype=torch.float32, attn_implementation="eager"
        )
        model = PeftModel.from_pretrained(base, out).eval()
        with torch.no_grad():
            ref = model(torch.from_numpy(tokens).long()).logits.float().numpy()
    err = float(np.abs(_logits(lm, adapters, tokens) - ref).max())
    assert err < 1e-4, f"{name}: max |logits - live PEFT| = {err:.2e}"


def test_finetune_example_checks_export_adapters_first(tmp_path, capsys, monkeypatch):
    """examples/finetune/train.py --export-adapters: an empty or new directory, with --stages too
    (each stage writes its part); refused in one usage line for a non-empty one. --export (the
    merged model) is refused with --stages, naming merge-adapters."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    from finetune.train import parse_args

    ckpt = ["--checkpoint", "ckpt"]
    assert parse_args([*ckpt, "--export-adapters", str(tmp_path / "new")]).export_adapters == str(tmp_path / "new")
    (tmp_path / "x").write_text("x")
    monkeypatch.setenv("RAVNEST_WORLD_SIZE", "2")
    staged = parse_args([*ckpt, "--export-adapters", str(tmp_path / "new"), "--stages", "2"])
    assert (staged.export_adapters, staged.stages) == (str(tmp_path / "new"), 2)
    for bad, flag, msg in (
        (["--export-adapters", str(tmp_path)], "--export-adapters", "not an empty directory"),
        (["--export", str(tmp_path / "m"), "--stages", "2"], "--export", "ravnest-jax merge-adapters"),
    ):
        with pytest.raises(SystemExit):
            parse_args([*ckpt, *bad])
        err = capsys.readouterr().err
        assert flag in err and msg in err, err
