"""Recipes (``ravnest_jax.recipe``, ``ravnest-jax finetune``): every kind of bad recipe is one
line naming the key, before anything loads; the example recipes validate; the tiny recipe runs
end to end (integration)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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
optim: {{steps: 300}}
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
    load_recipe(
        write(tmp_path, "model: {checkpoint: nowhere}\ndata: {files: x.jsonl}\noptim: {epochs: 1}\n"), check_files=False
    )


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
    assert err == [  # in the file's order of sections (GOOD's optim first)
        "error: optim.stesp: unknown key; did you mean 'steps'?",
        "error: lora.rank: expected an int >= 1, got 'x'",
    ]
    fresh = ["--set", f"export.merged={tmp_path / 'm'}", "--set", f"export.adapters={tmp_path / 'a'}"]
    assert cli_main(["finetune", str(RECIPES / "tiny.yaml"), "--check", "--set", "optim.steps=3", *fresh]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recipe"]["optim"]["steps"] == 3 and out["train_argv"][out["train_argv"].index("--max-steps") + 1] == "3"
    assert out["data"]["records"] == 480 and out["data"]["formats"] == {"messages": 480}, out["data"]
    # --check reads every record: a bad one is its file:line, before anything would load
    bad = tmp_path / "bad.jsonl"
    bad.write_text(DATA.read_text().splitlines()[0] + '\n{"prompt": "p", "completoin": "c"}\n')
    assert cli_main(["finetune", str(write(tmp_path, GOOD.replace(str(DATA), str(bad)))), "--check"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f'error: {bad}:2: no "completion"'), err


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


# --- pipeline stages (the pipeline section) ---


def test_pipeline_section_maps_to_train_py_options(tmp_path, monkeypatch):
    from ravnest_jax.recipe import _example_train

    text = GOOD + "pipeline: {stages: 2, in_flight: 3, mode: async, activation_codec: bf16}\n"
    r = load_recipe(
        write(tmp_path, text + "optim: {steps: 300, micro_batch: 2, micro_batches: 4}\n"), ["data.packing=false"]
    )
    argv = train_argv(r)
    assert argv[argv.index("--stages") :][:8] == [
        "--stages",
        "2",
        "--pipeline-mode",
        "async",
        "--activation-codec",
        "bf16",
        "--in-flight",
        "3",
    ]
    monkeypatch.setenv("RAVNEST_WORLD_SIZE", "2")  # train.py checks the launcher's peers against --stages
    args = _example_train().parse_args(argv)
    got = (args.stages, args.in_flight, args.pipeline_mode, args.activation_codec, args.micro_batches)
    assert got == (2, 3, "async", "bf16", 4) and args.batch_size == 8 and args.no_packing
    assert "--stages" not in train_argv(load_recipe(write(tmp_path, GOOD)))  # stages: 1, the default


def test_bad_pipeline_values_one_line_each(tmp_path):
    text = GOOD + "pipeline: {stages: 0, in_flight: two, mode: fast, activation_codec: int16, stagse: 2}\n"
    assert problems(tmp_path, text) == [
        "pipeline.stages: expected an int >= 1, got 0",
        "pipeline.in_flight: expected an int >= 1, got 'two'",
        "pipeline.mode: expected one of sync, async, stash, predict, 2bw, got 'fast'",
        "pipeline.activation_codec: expected one of fp32, bf16, int8, int4, fp4, got 'int16' (did you mean 'int8'?)",
        "pipeline.stagse: unknown key; did you mean 'stages'?",
    ]


def test_what_stages_cannot_run_with_is_refused_before_any_load(tmp_path, capsys, monkeypatch):
    """The settings train.py refuses with --stages: one line each from the recipe check, before
    train.py (or jax) is loaded; a swarm whose peers are not a multiple of the stages is refused
    by the recipe's run before train.py starts."""
    from ravnest_jax.recipe import _example_train, run

    text = GOOD + (
        "pipeline: {stages: 4, in_flight: 9, mode: 2bw}\noptim: {steps: 9, micro_batch: 2, micro_batches: 2}\n"
        "lora: {dropout: 0.1}\nexport: {merged: m, adapters: a}\nruntime: {devices: 2, attention: xla}\n"
    )
    why = "with pipeline.stages > 1 (4)"
    no_merged = (
        "no peer holds the whole model; set export.adapters (each stage writes its part, assembled into PEFT's "
        "files) and merge afterwards on one machine with ravnest-jax merge-adapters --model CHECKPOINT --adapters "
        "DIR --out OUT (one shard at a time)"
    )
    assert problems(tmp_path, text) == [
        "pipeline.in_flight: expected in [pipeline.stages, optim.micro_batches + 1] = [4, 4], got 9",
        "optim.micro_batches: expected >= pipeline.stages - 1 (3) with mode 2bw, got 2",
        f"data.packing: expected false {why}: the stages carry no segment ids (one document a row)",
        f"export.merged: not supported {why}: {no_merged}",
        f"lora.dropout: expected 0 {why} (not supported yet), got 0.1",
        f"runtime.devices: expected 1 {why} (not supported yet), got 2",
        f"runtime.attention: expected auto {why} (not supported yet), got 'xla'",
    ]
    r = load_recipe(write(tmp_path, GOOD + "pipeline: {stages: 2}\n"), ["data.packing=false"])
    with pytest.raises(ValueError, match=r"^pipeline.stages: 2 stages need a multiple of 2 peers, got 1 \("):
        run(r)  # alone: a swarm of one
    # train.py itself: --data with --stages needs one document a row
    monkeypatch.setenv("RAVNEST_WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        _example_train().parse_args(["--checkpoint", str(CKPT), "--stages", "2", "--data", str(DATA)])
    assert "--data with --stages needs --no-packing" in capsys.readouterr().err


def test_70b_recipe_in_four_stages_validates(monkeypatch):
    """examples/recipes/llama-3.1-70b-4stages.yaml (weights not here: no file check): the
    settings the memory planner sized (nf4, rank 16, micro-batch 1 x 2048, 4 stages, depth 4,
    pool 0.9) and options train.py takes with 4 peers."""
    from ravnest_jax.recipe import _example_train

    r = load_recipe(RECIPES / "llama-3.1-70b-4stages.yaml", check_files=False)
    planned = (r.model.quantize, r.lora.rank, r.optim.micro_batch, r.data.seq_len, r.pipeline.stages)
    assert planned == ("nf4", 16, 1, 2048, 4) and r.pipeline.in_flight is None and r.runtime.mem_fraction == 0.9
    monkeypatch.setenv("RAVNEST_WORLD_SIZE", "4")
    args = _example_train().parse_args(train_argv(r))
    assert (args.stages, args.micro_batches, args.batch_size, args.quantize) == (4, 16, 16, "nf4")
    assert args.no_packing and args.export is None and args.data


def _base_eval_loss(argv: list[str]) -> float:
    """The masked eval loss of the tiny checkpoint without adapters on the held-out batches that
    train.py's stages evaluate (its ``example_data(args, 0, 1)``): the token mean."""
    import jax.numpy as jnp

    import ravnest_jax as rj
    from ravnest_jax.recipe import _example_train

    train = _example_train()
    _, evals = train.example_data(train.parse_args(argv), 0, 1)
    model = rj.models.load_pretrained(CKPT, dtype=jnp.float32)
    total = count = 0.0
    for b in evals:
        logits = model(jnp.asarray(b["tokens"]))
        total += float(
            rj.pipeline.token_cross_entropy(logits, (jnp.asarray(b["targets"]), jnp.asarray(b["loss_mask"])))
        )
        count += float(b["loss_mask"].sum())
    return total / count


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_tiny_recipe_in_two_stages_trains_as_a_local_swarm(tmp_path, monkeypatch):
    """``ravnest-jax local --peers 2 -- ravnest-jax finetune tiny.yaml`` with ``pipeline.stages: 2``:
    each peer one stage of the tiny model, the chat data loss-masked one conversation a row, int8
    activations between them; both run every step, each checkpoints into its own folder, the
    summary is the last stage's, and its eval loss is below the untrained model's. Each stage
    writes its adapters' part of ``export.adapters`` and the parts become one PEFT directory
    that loads onto the base (``merge_peft_adapters``) and covers every layer."""
    from ravnest_jax.models import load_pretrained, merge_peft_adapters, read_peft_adapters

    sets = {
        "pipeline.stages": 2,
        "data.packing": "false",
        "optim.steps": 4,
        "optim.warmup": 1,
        "optim.micro_batches": 2,
        "optim.lr": 0.01,
        "outer.sync_every": 2,
        "checkpoint.dir": tmp_path / "ck",
        "checkpoint.every": 2,
        "export.merged": "null",
        "export.adapters": tmp_path / "adapters",
        "export.summary": tmp_path / "summary.json",
    }
    argv = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    cmd = [sys.executable, "-m", "ravnest_jax.cli", "local", "--peers", "2", "--no-progress", "--"]
    cmd += [sys.executable, "-m", "ravnest_jax.cli", "finetune", str(RECIPES / "tiny.yaml"), *argv]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    peers = {}
    for line in done.stdout.splitlines():
        if line.startswith("[peer") and "] {" in line:
            name, _, rest = line[1:].partition("] ")
            peers[name] = json.loads(rest)
    assert sorted(peers) == ["peer0", "peer1"], done.stdout[-3000:]
    assert sorted(p["stage"] for p in peers.values()) == [0, 1], peers
    assert all(p["steps"] == 4 and p["activation_bytes_sent"] > 0 for p in peers.values()), peers
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["peer0", "peer1"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stage"] == 1 and summary["recipe"] == str(RECIPES / "tiny.yaml"), summary
    monkeypatch.setenv("RAVNEST_WORLD_SIZE", "2")
    recipe = load_recipe(RECIPES / "tiny.yaml", [f"{k}={v}" for k, v in sets.items()], check_files=False)
    base = _base_eval_loss(
        train_argv(dataclasses.replace(recipe, export=dataclasses.replace(recipe.export, adapters=None)))
    )
    assert summary["eval_loss_end"] < base, (summary["eval_loss_end"], base)
    out = tmp_path / "adapters"
    assert sorted(p["exported_adapter_part"] for p in peers.values()) == [
        str(out / f"adapter_model.stage-{k}-of-2.safetensors") for k in (0, 1)
    ], peers
    assert [p.get("exported_adapters") for p in peers.values()].count(str(out)) == 1, peers
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config, tensors = read_peft_adapters(out)
    model = load_pretrained(recipe.model.checkpoint, scan_layers=False)
    layers, targets = model.config.num_hidden_layers, len(recipe.lora.targets)
    assert (config["r"], len(tensors)) == (recipe.lora.rank, layers * targets * 2), (config, sorted(tensors))
    assert {int(n.split(".layers.")[1].split(".")[0]) for n in tensors} == set(range(layers)), sorted(tensors)
    assert min(float(np.abs(v).max()) for n, v in tensors.items() if "lora_B" in n) > 0, "B trained from zero"
    merge_peft_adapters(model, out)  # every name and shape fits the base
    # --fresh: every stage peer starts at step 0, its stage folder's checkpoints moved aside
    again = [a if not a.startswith("export.adapters=") else "export.adapters=null" for a in argv]
    again += ["--set", "optim.steps=2", "--fresh"]
    done = subprocess.run(
        cmd[: cmd.index(str(RECIPES / "tiny.yaml")) + 1] + again,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    fresh = [
        json.loads(line.partition("] ")[2])
        for line in done.stdout.splitlines()
        if line.startswith("[peer") and "] {" in line
    ]
    assert [(p["resumed_from"], p["steps"]) for p in fresh] == [(None, 2), (None, 2)], fresh
    aside = sorted(str(d.relative_to(tmp_path / "ck")) for d in (tmp_path / "ck").glob("peer*/stage*/previous-*"))
    assert len(aside) == 2 and {a.split("/")[1] for a in aside} == {"stage0", "stage1"}, aside


def test_export_merge_into(tmp_path):
    r = load_recipe(write(tmp_path, GOOD + "export: {merged: out, merge_into: dequantized}\n"))
    argv = train_argv(r)
    assert argv[argv.index("--export") :][:4] == ["--export", str(tmp_path / "out"), "--merge-into", "dequantized"]
    assert load_recipe(write(tmp_path, GOOD + "export: {merged: out}\n")).export.merge_into == "original"
    assert problems(tmp_path, GOOD + "export: {merged: out, merge_into: dequantised}\n") == [
        "export.merge_into: expected one of original, dequantized, got 'dequantised' (did you mean 'dequantized'?)"
    ]


# the tiny recipe's checkpoint and export folders are under the repository's runs/ (a developer
# who ran the docs' commands has them): a test that runs it writes nowhere
NOTHING_WRITTEN = [
    a for k in ("checkpoint.dir", "export.merged", "export.adapters", "export.summary") for a in ("--set", f"{k}=null")
]


def test_cli_at_a_rendezvous_needs_the_data_shard(tmp_path, capsys, monkeypatch):
    # without --rank/--world-size every peer at a real rendezvous would read the same rows
    for env in ("RAVNEST_RANK", "RAVNEST_WORLD_SIZE", "RAVNEST_RENDEZVOUS", "RAVNEST_RUN_ID"):
        monkeypatch.setenv(env, "x")  # recorded: restored (or removed) after the test, as the command sets them
        monkeypatch.delenv(env)
    monkeypatch.setenv("RAVNEST_TOKEN", "t")
    at = [
        "finetune",
        str(RECIPES / "tiny.yaml"),
        "--rendezvous",
        "http://127.0.0.1:9",
        "--run-id",
        "r",
        *NOTHING_WRITTEN,
    ]
    for extra, want in (
        ([], "error: --rendezvous needs --rank R --world-size N"),
        (["--rank", "1"], "error: --rank and --world-size go together"),
        (["--rank", "2", "--world-size", "2"], "error: --rank 2 must be below --world-size 2"),
    ):
        assert cli_main([*at, *extra]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(want), (extra, err)
    assert "RAVNEST_WORLD_SIZE" not in os.environ


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_finetune_refuses_a_checkpoint_dir_of_only_corrupt_steps_until_fresh(tmp_path):
    """Every step of a peer's checkpoint folder unreadable (moved to <step>.corrupt by an earlier
    run): the command refuses in one line naming --fresh, instead of silently starting over from
    step 0; ``--fresh`` moves them aside and trains."""
    (tmp_path / "ck" / "peer0" / "5.corrupt").mkdir(parents=True)
    sets = {"optim.steps": 2, "optim.warmup": 1, "outer.sync_every": 2, "checkpoint.dir": tmp_path / "ck"}
    sets |= {"export.merged": None, "export.adapters": None, "export.summary": tmp_path / "summary.json"}
    argv = [a for k, v in sets.items() for a in ("--set", f"{k}={'null' if v is None else v}")]
    cmd = [sys.executable, "-m", "ravnest_jax.cli", "finetune", str(RECIPES / "tiny.yaml"), *argv]
    refused = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    errors = [ln for ln in refused.stderr.splitlines() if "error" in ln.lower()]
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert len(errors) == 1 and "--fresh" in errors[0], refused.stderr[-3000:]
    assert not (tmp_path / "summary.json").exists()
    done = subprocess.run([*cmd, "--fresh"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    assert list((tmp_path / "ck" / "peer0").glob("previous-*/5.corrupt")), sorted((tmp_path / "ck").rglob("*"))
    # the folder now holds step 2: fewer steps, or other settings, are one line that says what to do
    # (they were a silent run of 0 steps, and a shape mismatch without a hint)
    for extra, want in (
        (["--set", "optim.steps=1", "--set", "optim.warmup=0"], "its newest checkpoint is step 2, past the 1 steps"),
        (["--set", "optim.steps=4", "--set", "lora.rank=8"], "was written with other settings: --fresh"),
        (["--set", "optim.steps=4", "--set", "lora.alpha=3"], "lora settings differ from the checkpoint's"),
    ):
        again = subprocess.run([*cmd, *extra], cwd=tmp_path, capture_output=True, text=True, timeout=240)
        errors = [ln for ln in again.stderr.splitlines() if "error" in ln.lower()]
        assert again.returncode == 2 and "Traceback" not in again.stderr, (again.returncode, again.stderr[-3000:])
        assert len(errors) == 1 and want in errors[0], (extra, again.stderr[-3000:])


@pytest.mark.timeout(120)
def test_cli_at_a_rendezvous_checks_it_before_loading_the_model(tmp_path, capsys, monkeypatch):
    """A wrong token, a rendezvous that does not answer and a busy --listen port are one line
    each, in seconds, before the model loads (they used to be a traceback from rj.Swarm() once
    the model had loaded)."""
    import socket
    import time

    from sync._local import rendezvous_thread

    for env in ("RAVNEST_RANK", "RAVNEST_WORLD_SIZE", "RAVNEST_RENDEZVOUS", "RAVNEST_RUN_ID", "RAVNEST_LISTEN"):
        monkeypatch.setenv(env, "x")  # recorded: restored (or removed) after the test, as the command sets them
        monkeypatch.delenv(env)
    monkeypatch.delenv("RAVNEST_TOKEN_FILE", raising=False)
    shard = ["--run-id", "r", "--rank", "0", "--world-size", "1", *NOTHING_WRITTEN]
    with rendezvous_thread() as url, socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        for token, extra, want in (
            ("not-the-token", ["--rendezvous", url], f"error: the rendezvous at {url} refused our token (HTTP 401)"),
            ("sync-test-token", ["--rendezvous", url, "--listen", f"127.0.0.1:{port}"], "error: cannot listen on"),
        ):
            monkeypatch.setenv("RAVNEST_TOKEN", token)
            t0 = time.monotonic()
            assert cli_main(["finetune", str(RECIPES / "tiny.yaml"), *shard, *extra]) == 2
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and err[0].startswith(want), (extra, err)
            assert time.monotonic() - t0 < 20, time.monotonic() - t0
        monkeypatch.setenv("RAVNEST_TOKEN", "sync-test-token")
        monkeypatch.delenv("RAVNEST_LISTEN")  # the command set it
        from ravnest_jax.swarm.peer import _preflight

        monkeypatch.setattr(_preflight.preflight, "__defaults__", (1.0,))  # 1 s of retries, not 10
        import signal
        import sys

        hook = sys.unraisablehook
        assert cli_main(["finetune", str(RECIPES / "tiny.yaml"), *shard, "--rendezvous", dead]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: rendezvous {dead} unreachable"), err
        # the command's stop handlers and hook are its own: gone when it returns (in-process callers)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.getsignal(signal.SIGINT)
        assert sys.unraisablehook is hook
