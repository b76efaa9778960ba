"""``optim.epochs`` (recipes) and ``--epochs`` (examples/finetune/train.py): how long to train in
passes over the data instead of steps. Exactly one of ``optim.steps`` / ``optim.epochs``, checked
before anything loads; the steps are counted once the data are read (the smallest shard's rows /
the batch), the lr schedule runs over them, and the summary reports ``steps`` and ``data_epochs``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ravnest_jax.cli import main as cli_main
from ravnest_jax.recipe import _example_train, load_recipe, train_argv

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "recipes"
CKPT = ROOT / "tests" / "fixtures" / "llm" / "finetune"
CHAT = RECIPES / "data" / "tiny_chat.jsonl"
BASE = f"model: {{checkpoint: {CKPT}}}\ndata: {{files: [{CHAT}], format: messages}}\n"


def problems(tmp_path: Path, text: str, overrides=()) -> list[str]:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(ValueError) as e:
        load_recipe(p, overrides)
    return str(e.value).splitlines()


def test_exactly_one_of_steps_and_epochs(tmp_path):
    line = "optim.steps, optim.epochs: expected exactly one of them (how long to train), got {}"
    assert problems(tmp_path, BASE) == [line.format("neither")]
    assert problems(tmp_path, BASE + "optim: {steps: 10, epochs: 1}\n") == [line.format("both")]
    assert problems(tmp_path, BASE + "optim: {epochs: 0}\n") == ["optim.epochs: expected a number > 0, got 0"]
    assert problems(tmp_path, BASE + "optim: {epochs: x, steps: 0}\n") == [
        "optim.epochs: expected a number > 0, got 'x'",
        "optim.steps: expected an int >= 1, got 0",
    ]
    # the tiny recipe gives steps: --set clears them for epochs
    tiny = RECIPES / "tiny.yaml"
    fresh = ["checkpoint.dir=null", f"export.merged={tmp_path / 'm'}", f"export.adapters={tmp_path / 'a'}"]
    with pytest.raises(ValueError, match=r"^optim.steps, optim.epochs: .* got both$"):
        load_recipe(tiny, ["optim.epochs=1", *fresh])
    r = load_recipe(tiny, ["optim.steps=null", "optim.epochs=0.5", *fresh])
    assert (r.optim.steps, r.optim.epochs) == (None, 0.5)
    argv = train_argv(r)
    assert "--max-steps" not in argv and argv[argv.index("--epochs") + 1] == "0.5"


def test_check_prints_the_train_argv_with_epochs(tmp_path, capsys):
    sets = [
        "optim.steps=null",
        "optim.epochs=2",
        f"export.merged={tmp_path / 'm'}",
        f"export.adapters={tmp_path / 'a'}",
    ]
    argv = ["finetune", str(RECIPES / "tiny.yaml"), "--check", *(a for s in sets for a in ("--set", s))]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recipe"]["optim"]["epochs"] == 2.0 and out["recipe"]["optim"]["steps"] is None
    train = out["train_argv"]
    assert train[train.index("--epochs") + 1] == "2.0" and "--max-steps" not in train
    args = _example_train().parse_args(train)
    assert args.epochs == 2.0  # the steps: once train.py read the data


def test_train_py_epochs_flag(capsys):
    train = _example_train()
    base = ["--checkpoint", str(CKPT), "--data", str(CHAT)]
    assert train.parse_args(base).max_steps == 300  # neither: the default steps
    for bad, why in (
        (["--epochs", "1", "--max-steps", "3"], "not allowed with argument"),
        (["--epochs", "0"], "--epochs must be a number > 0"),
        (["--epochs", "nan"], "--epochs must be a number > 0"),
    ):
        with pytest.raises(SystemExit):
            train.parse_args(base + bad)
        assert why in capsys.readouterr().err, bad


def test_epoch_steps_and_the_lr_schedule_over_them():
    train = _example_train()
    argv = ["--checkpoint", str(CKPT), "--epochs", "1.5", "--batch-size", "8", "--lr", "0.1"]
    args = train.parse_args([*argv, "--lr-schedule", "cosine", "--warmup-steps", "2"])
    # 103 rows over 3 peers: the smallest shard's 34 rows, 1.5 passes of 8 a step
    assert train.epoch_steps(args, 103, 3) == math.ceil(1.5 * 34 / 8) == 7
    assert train.epoch_steps(args, 16, 1) == 3  # 1.5 x 16 / 8 exactly: no extra step
    args.max_steps = train.epoch_steps(args, 103, 3)
    lr = train.learning_rate(args)  # warm-up, then cosine to 0 at the resolved step count
    assert float(lr(0)) == 0.0 and abs(float(lr(2)) - 0.1) < 1e-7 and float(lr(7)) < 1e-7 < float(lr(6))
    args.warmup_steps = 7
    with pytest.raises(ValueError, match=r"^--warmup-steps \(optim.warmup\) 7 must be below the 7 steps"):
        train.epoch_steps(args, 103, 3)


def _rows(seq_len: int, batch: int) -> int:
    """The packed training rows of tiny_chat.jsonl (what train.py counts an epoch in)."""
    train = _example_train()
    args = train.parse_args(["--checkpoint", str(CKPT), "--data", str(CHAT), "--seq-len", str(seq_len)])
    args.batch_size = batch
    data, _ = train.example_data(args, 0, 1)
    return data.stats["rows"]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_tiny_recipe_in_epochs(tmp_path):
    """``optim.epochs: 1`` alone and ``0.5`` as ``local --peers 2`` on the committed chat data:
    the steps are ceil(epochs x the smallest shard's rows / the batch), and each peer's
    ``data_epochs`` is the asked epochs, up to one batch of its shard."""
    L, B = 256, 16  # long rows, big batches: an epoch is a dozen steps
    rows = _rows(L, B)
    sets = {
        "optim.steps": "null",
        "outer.sync_every": 2,
        "data.seq_len": L,
        "optim.micro_batch": B,
        "checkpoint.dir": "null",
        "export.merged": "null",
        "export.adapters": "null",
        "export.summary": tmp_path / "summary.json",
    }

    def finetune(epochs: float, peers: int) -> list[dict]:
        argv = [a for k, v in {**sets, "optim.epochs": epochs}.items() for a in ("--set", f"{k}={v}")]
        cmd = [sys.executable, "-m", "ravnest_jax.cli", "finetune", str(RECIPES / "tiny.yaml"), *argv]
        if peers > 1:
            cmd = [sys.executable, "-m", "ravnest_jax.cli", "local", "--peers", str(peers), "--no-progress", "--", *cmd]
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
        ends = [json.loads(line.partition("] ")[2]) for line in done.stdout.splitlines() if "] {" in line]
        assert len(ends) == peers, done.stdout[-3000:]
        return ends

    for epochs, peers in ((1.0, 1), (0.5, 2)):
        want = math.ceil(epochs * (rows // peers) / B)
        ends = finetune(epochs, peers)
        for end in ends:
            shard = int(end["peer"].removeprefix("peer"))  # the launcher's peer R reads shard R
            shard_rows = len(range(shard, rows, peers))
            assert end["steps"] == want and end["data_position"] == want, (epochs, end)
            assert end["data_epochs"] == round(want * B / shard_rows, 4), (epochs, shard_rows, end)
            assert epochs - B / shard_rows <= end["data_epochs"] < epochs + B / shard_rows, (epochs, end)
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["steps"] == want and summary["eval_loss_end"] < summary["eval_loss_start"], summary
