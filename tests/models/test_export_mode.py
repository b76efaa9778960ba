"""Exported files (``save_pretrained``'s ``model.safetensors`` and ``config.json``,
``save_peft_adapters``' adapter files, examples/finetune/train.py's ``--export`` with the tokenizer
files it copies) get the mode a newly created file has, ``0o666 & ~umask`` (0644 under umask 022),
not safetensors' 0600."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import pytest

pytest.importorskip("safetensors")

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "llm" / "llama"


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, str]:
    return {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in sorted(root.iterdir())}


@pytest.mark.parametrize("mask,want", [(0o022, "0o644"), (0o027, "0o640")])
def test_saved_checkpoint_and_adapters_have_a_new_files_mode(tmp_path, mask, want):
    from ravnest_jax.models import LoraConfig, load_pretrained, save_peft_adapters, save_pretrained, split_lora

    with _umask(mask):
        full = save_pretrained(load_pretrained(LLAMA), tmp_path / "full")
        lm = split_lora(load_pretrained(LLAMA, lora=LoraConfig(rank=2, alpha=4.0)))
        adapters = save_peft_adapters(lm, lm.adapters, tmp_path / "adapters")
    for root, names in ((full, {"model.safetensors", "config.json"}), (adapters, None)):
        modes = _modes(root)
        assert (names is None or set(modes) == names) and modes, modes
        assert set(modes.values()) == {want}, (root.name, oct(mask), modes)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_finetune_export_files_are_0644_even_from_a_0600_checkpoint(tmp_path, fast_compile_env):
    """examples/finetune/train.py --export / --export-adapters, one peer, 2 steps (~30 s here): the
    merged model, its config and the tokenizer files it copies (from a checkpoint whose tokenizer
    files are 0600: the copies get a new file's mode, not the source's), and the adapters."""
    import json
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "tests" / "fixtures" / "llm" / "finetune", ckpt)
    for p in ckpt.glob("tokenizer*"):
        p.chmod(0o600)
    summary = tmp_path / "s.json"
    train = [sys.executable, str(root / "examples" / "finetune" / "train.py"), "--checkpoint", str(ckpt)]
    train += ["--max-steps", "2", "--sync-every", "2", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1"]
    train += ["--lora-rank", "2", "--export", str(tmp_path / "out"), "--export-adapters", str(tmp_path / "ad")]
    local = [sys.executable, "-m", "ravnest_jax.cli", "local", "--peers", "1", "--no-progress"]
    with _umask(0o022):
        r = subprocess.run(
            [*local, "--summary-json", str(summary), "--", *train],
            capture_output=True,
            text=True,
            timeout=280,
            env=fast_compile_env,
        )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads(summary.read_text())["peers"]["peer0"]["exit"] == 0
    out, ad = _modes(tmp_path / "out"), _modes(tmp_path / "ad")
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(out), out
    assert set(out.values()) == {"0o644"} and set(ad.values()) == {"0o644"} and len(ad) == 2, (out, ad)
