"""Recipes (``ravnest_jax.recipe``, ``ravnest-jax finetune``): every kind of bad recipe is one
line naming the key, before anything loads; the example recipes validate; the tiny recipe runs
end to end (integration)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ravnest_jax.cli import main as cli_main
from ravnest_jax.recipe import Recipe, load_recipe, train_argv

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "recipes"
CKPT = ROOT / "tests" / "fixtures" / "llm" / "finetune"
DATA = RECIPES / "data" / "tiny_instruct.jsonl"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


GOOD = f"""
model: {{checkpoint: {CKPT}}}
data: {{files: [{DATA}], format: prompt_completion}}
"""


def problems(tmp_path: Path, text: str, overrides=(), **kw) -> list[str]:
    with pytest.raises(ValueError) as e:
        load_recipe(write(tmp_path, text), overrides, **kw)
    return str(e.value).splitlines()


def test_minimal_recipe_defaults(tmp_path):
    r = load_recipe(write(tmp_path, GOOD))
    assert isinstance(r, Recipe)
    assert r.lora.rank == 8 and r.optim.steps == 300 and r.outer.sync_every == 20 and r.data.packing
    argv = train_argv(r)
    assert argv[argv.index("--checkpoint") + 1] == str(CKPT)
    assert argv[argv.index("--batch-size") + 1] == "8"
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.lora.rank = 3  # type: ignore[misc]


def test_unknown_keys_name_the_nearest(tmp_path):
    lines = problems(tmp_path, GOOD + "lora: {rnak: 4}\noptim: {stesp: 3}\noutr: {}\n")
    assert "lora.rnak: unknown key; did you mean 'rank'?" in lines
    assert "optim.stesp: unknown key; did you mean 'steps'?" in lines
    assert "outr: unknown key; did you mean 'outer'?" in lines
    assert len(lines) == 3


def test_wrong_types_and_values_one_line_each(tmp_path):
    text = GOOD + (
        "lora: {rank: x, dropout: 1.5, targets: [q, qq], frozen_a: 'yes'}\n"
        "optim: {lr: -1, micro_batch: 2.5, warmup: true}\n"
        "model2: 1\n"
    )
    lines = problems(tmp_path, text)
    assert "lora.rank: expected an int >= 1, got 'x'" in lines
    assert "lora.dropout: expected a number in [0, 1), got 1.5" in lines
    assert "lora.targets: expected names among q, k, v, o, gate, up, down, got 'qq'" in lines
    assert "lora.frozen_a: expected true or false, got 'yes'" in lines
    assert "optim.lr: expected a number > 0, got -1" in lines
    assert "optim.micro_batch: expected an int >= 1, got 2.5" in lines
    assert "optim.warmup: expected an int >= 0, got True" in lines
    assert any(line.startswith("model2: unknown key; did you mean 'model'") for line in lines)
    assert len(lines) == 8


def test_bad_choice_suggests(tmp_path):
    lines = problems(tmp_path, GOOD + "model: {checkpoint: " + str(CKPT) + ", quantize: nf5}\n")
    assert lines == ["model.quantize: expected one of int8, int4, nf4, got 'nf5' (did you mean 'nf4'?)"]


def test_cross_key_checks(tmp_path):
    lines = problems(tmp_path, GOOD + "outer: {sync_every: 4, overlap_steps: 4}\noptim: {steps: 5, warmup: 5}\n")
    assert "outer.overlap_steps: expected < outer.sync_every (4), got 4" in lines
    assert "optim.warmup: expected < optim.steps (5), got 5" in lines


def test_outer_step_settings(tmp_path):
    r = load_recipe(write(tmp_path, GOOD + "outer: {lr: 1, momentum: 0}\n"))
    argv = train_argv(r)
    assert argv[argv.index("--outer-lr") + 1] == "1.0" and argv[argv.index("--outer-momentum") + 1] == "0.0"
    assert problems(tmp_path, GOOD + "outer: {lr: 0, momentum: 1.0}\n") == [
        "outer.lr: expected a number > 0, got 0",
        "outer.momentum: expected a number in [0, 1), got 1.0",
    ]


def test_missing_required_and_missing_files(tmp_path):
    assert problems(tmp_path, "lora: {rank: 4}\n") == [
        "model.checkpoint: missing (required)",
        "data.files: missing (required)",
    ]
    lines = problems(tmp_path, "model: {checkpoint: nowhere}\ndata: {files: [none.jsonl]}\nlora: {rank: 0}\n")
    assert lines == [
        "lora.rank: expected an int >= 1, got 0",
        f"model.checkpoint: {tmp_path / 'nowhere'} is not a directory",
        f"data.files: {tmp_path / 'none.jsonl'} does not exist (and matches nothing as a glob)",
    ]
    load_recipe(write(tmp_path, "model: {checkpoint: nowhere}\ndata: {files: x.jsonl}\n"), check_files=False)


def test_export_dir_not_empty(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "f").write_text("x")
    lines = problems(tmp_path, GOOD + "export: {merged: out}\n")
    assert lines == [
        f"export.merged: {tmp_path / 'out'} exists and is not an empty directory (remove it, or --set export.merged=ANOTHER_DIR)"
    ]


def test_paths_relative_to_recipe_and_set_to_cwd(tmp_path, monkeypatch):
    sub = tmp_path / "sub"
    sub.mkdir()
    monkeypatch.chdir(sub)
    r = load_recipe(write(tmp_path, GOOD + "checkpoint: {dir: ck}\n"), ["export.adapters=ad"])
    assert r.checkpoint.dir == str(tmp_path / "ck") and r.export.adapters == str(sub / "ad")


def test_set_overrides_and_bad_set(tmp_path):
    r = load_recipe(write(tmp_path, GOOD), ["lora.rank=16", "lora.targets=[q, v]", "model.quantize=int4"])
    assert (r.lora.rank, r.lora.targets, r.model.quantize) == (16, ("q", "v"), "int4")
    assert problems(tmp_path, GOOD, ["lora.rank"]) == [
        "--set 'lora.rank': expected section.key=value (e.g. lora.rank=16)"
    ]
    assert problems(tmp_path, GOOD, ["rank=3"])[0].startswith("--set 'rank=3': expected section.key=value")
    assert problems(tmp_path, GOOD, ["lora.rnak=3"]) == ["lora.rnak: unknown key; did you mean 'rank'?"]
    assert problems(tmp_path, GOOD, ["lora.rank=x"]) == ["lora.rank: expected an int >= 1, got 'x'"]
    assert problems(tmp_path, GOOD, ["lora.rank=[1"])[0].startswith("--set lora.rank: the value is not YAML")


def test_not_yaml_and_not_a_mapping(tmp_path):
    assert "not YAML" in problems(tmp_path, "model: [1, 2\n")[0]
    assert problems(tmp_path, "- 1\n")[0].endswith("a recipe is a mapping of sections (model, data, ...), got list")
    assert problems(tmp_path, GOOD + "lora: 3\n") == ["lora: expected a mapping of keys, got 3"]


@pytest.mark.parametrize("name", ["tiny.yaml", "llama-3.1-8b-qlora.yaml", "qwen3-8b-chat.yaml"])
def test_example_recipes_validate(name, tmp_path):
    # the exports into a fresh folder: an earlier run of the recipe may have left runs/tiny
    sets = [f"export.merged={tmp_path / 'm'}", f"export.adapters={tmp_path / 'a'}"]
    r = load_recipe(RECIPES / name, sets, check_files=name == "tiny.yaml")
    assert "--data" in train_argv(r)


def test_cli_prints_lines_and_exits_2(tmp_path, capsys):
    p = write(tmp_path, GOOD + "lora: {rank: x}\noptim: {stesp: 1}\n")
    assert cli_main(["finetune", str(p)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: lora.rank: expected an int >= 1, got 'x'",
        "error: optim.stesp: unknown key; did you mean 'steps'?",
    ]
    fresh = ["--set", f"export.merged={tmp_path / 'm'}", "--set", f"export.adapters={tmp_path / 'a'}"]
    assert cli_main(["finetune", str(RECIPES / "tiny.yaml"), "--check", "--set", "optim.steps=3", *fresh]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recipe"]["optim"]["steps"] == 3 and out["train_argv"][out["train_argv"].index("--max-steps") + 1] == "3"


def test_train_lr_schedule_and_checkpoint_every():
    from ravnest_jax.recipe import _example_train

    train = _example_train()
    args = train.parse_args(
        [
            "--checkpoint",
            str(CKPT),
            "--max-steps",
            "10",
            "--lr",
            "0.1",
            "--lr-schedule",
            "cosine",
            "--warmup-steps",
            "2",
            "--sync-every",
            "5",
        ]
    )
    assert args.checkpoint_every == 5
    lr = train.learning_rate(args)
    assert float(lr(0)) == 0.0 and abs(float(lr(2)) - 0.1) < 1e-7 and float(lr(10)) < 1e-7
    assert train.learning_rate(train.parse_args(["--checkpoint", str(CKPT), "--lr", "0.1"])) == 0.1


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_tiny_recipe_as_a_local_swarm_of_three(tmp_path):
    """``ravnest-jax local --peers 3 -- ravnest-jax finetune tiny.yaml``: three peers train on the
    committed chat data, agree on the state, checkpoint each into its own folder; the first peer
    alone exports and writes the one summary; the same command with more steps resumes every peer."""
    sets = {
        "optim.steps": 4,
        "optim.warmup": 1,
        "outer.sync_every": 2,
        "checkpoint.every": 2,
        "checkpoint.dir": tmp_path / "ck",
        "export.merged": tmp_path / "merged",
        "export.adapters": tmp_path / "adapters",
        "export.summary": tmp_path / "summary.json",
    }

    def run(extra: list[str], local_json: Path) -> dict:
        """Each peer's own JSON line (train.py's summary, as the launcher prefixes it)."""
        argv = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")] + extra
        cmd = [sys.executable, "-m", "ravnest_jax.cli", "local", "--peers", "3", "--no-progress"]
        cmd += ["--summary-json", str(local_json), "--", sys.executable, "-m", "ravnest_jax.cli", "finetune"]
        done = subprocess.run(
            [*cmd, str(RECIPES / "tiny.yaml"), *argv], cwd=tmp_path, capture_output=True, text=True, timeout=360
        )
        assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
        launcher = json.loads(local_json.read_text())["peers"]
        assert sorted(launcher) == ["peer0", "peer1", "peer2"], launcher
        assert all(p["exit"] == 0 and p["summary"]["failed_rounds"] == 0 for p in launcher.values()), launcher
        got = {}
        for line in done.stdout.splitlines():
            if line.startswith("[peer") and "] {" in line:
                name, _, rest = line[1:].partition("] ")
                got[name] = json.loads(rest)
        assert sorted(got) == ["peer0", "peer1", "peer2"], done.stdout[-3000:]
        return got

    ends = run([], tmp_path / "local1.json")
    assert len({s["last_state_digest"] for s in ends.values()}) == 1, ends
    assert all(s["steps"] == 4 and s["how"] == "fresh" for s in ends.values()), ends
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["peer0", "peer1", "peer2"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["recipe"] == str(RECIPES / "tiny.yaml") and summary["steps"] == 4, summary
    assert summary["last_state_digest"] == ends["peer0"]["last_state_digest"]
    assert summary["eval_loss_end"] < summary["eval_loss_start"], summary
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert (tmp_path / "adapters" / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())["r"] == 4
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()  # the chat template travels
    # more steps: every peer resumes from its own checkpoint, and they still agree
    more = ["--set", "optim.steps=6", "--set", f"export.merged={tmp_path / 'merged2'}"]
    more += ["--set", f"export.adapters={tmp_path / 'adapters2'}"]
    again = run(more, tmp_path / "local2.json")
    assert all(s["how"] != "fresh" and s["data_position"] == 6 for s in again.values()), again
    assert len({s["last_state_digest"] for s in again.values()}) == 1, again
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 6
