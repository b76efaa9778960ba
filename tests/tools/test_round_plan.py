"""``ravnest-jax plan``: the round model's bytes are the wire format's, its constants are the fit
of the committed bench_utilization results, its predictions hold on those cells, and the
command prints a plan (or one line naming bad input)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ravnest_jax.swarm.wire._codec import encode_part
from ravnest_jax.tools import CALIBRATION, calibrate, params_of_config, plan_rounds, validate
from ravnest_jax.tools._round_plan import message_bytes

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
LLAMA = ROOT / "tests" / "fixtures" / "llm" / "finetune"


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4", "int2", "sign"])
@pytest.mark.parametrize("n", [1000, 65_536, 100_003])
def test_message_bytes_are_the_wire_formats(codec, n):
    real = len(encode_part("p", np.ones(n, np.float32), codec))
    assert 0 <= real - message_bytes(n, codec) < 600, (codec, n, real, message_bytes(n, codec))


def test_the_constants_are_the_fit_of_the_committed_results():
    fit = calibrate(json.loads((RESULTS / "utilization.json").read_text()))
    assert fit.c_round == CALIBRATION.c_round and fit.k_rtt == CALIBRATION.k_rtt and fit.c_dp == CALIBRATION.c_dp
    assert fit.overhead == CALIBRATION.overhead, (fit, CALIBRATION)


def test_validation_on_the_measured_cells():
    """The table of docs/planning.md (benchmarks/validate_plan.py writes it): what it states
    is what the model gives on the committed measurements."""
    d = json.loads((RESULTS / "utilization.json").read_text())
    rows = validate(d)
    saved = json.loads((RESULTS / "plan_validation.json").read_text())
    assert rows == saved["fit_cells"], "benchmarks/results/plan_validation.json is stale: rerun validate_plan.py"
    errs = [abs(r["error_points"]) for r in rows]
    assert len(rows) == 128 and np.median(errs) < 1.5, sorted(errs)[-10:]
    dp = [r for r in rows if r["mode"] == "data_parallel"]
    assert max(abs(r["error_points"]) for r in dp) < 3, dp
    # a separate run on links the fit never saw: every cell within 3 points
    held = validate(json.loads((RESULTS / "utilization_heldout.json").read_text()))
    assert held == saved["heldout_cells"], "plan_validation.json is stale: rerun validate_plan.py --heldout ..."
    assert len(held) == 24 and all(abs(r["error_points"]) <= 3 for r in held), held
    # the sweep's links measured again with 3 rounds a cell (7 of its 8 cells over 3 points among them)
    again = validate(json.loads((RESULTS / "utilization_remeasured.json").read_text()))
    assert again == saved["remeasured_cells"], "plan_validation.json is stale"
    assert len(again) == 36 and all(abs(r["error_points"]) <= 3 for r in again), again


def test_a_pair_of_codecs_is_planned_with_the_swarms_bytes():
    """Sign up, int2 down (rj.Codec("sign", mean="int2")): a peer of 4 sends 3/4 of
    a sign message as parts and 3/4 of an int2 message as results, as the wire format counts."""
    n = 10_000_000
    plan = plan_rounds(n, codec="sign", mean_codec="int2", peers=4, mbit_up=100, rtt_ms=100, step_s=0.5)
    want = 0.75 * (message_bytes(n, "sign") + message_bytes(n, "int2"))
    assert all(r.bytes_per_round == int(want) for r in plan.rows), (plan.rows[0], want)
    assert plan.inputs["codec"] == "sign" and plan.inputs["mean_codec"] == "int2", plan.inputs
    int2 = plan_rounds(n, codec="int2", peers=4, mbit_up=100, rtt_ms=100, step_s=0.5)
    sign = plan_rounds(n, codec="sign", peers=4, mbit_up=100, rtt_ms=100, step_s=0.5)
    assert sign.rows[0].round_s < plan.rows[0].round_s < int2.rows[0].round_s, (sign.rows[0], plan.rows[0])
    assert plan.recommendation["codec"] in ("fp32", "bf16", "int8", "int4"), plan.recommendation  # never the coarse
    with pytest.raises(ValueError, match="block codecs"):  # a pair the swarm refuses
        plan_rounds(n, codec="fp32", mean_codec="int2", mbit_up=100, step_s=0.5)


def test_plan_rounds_is_consistent():
    plan = plan_rounds(int(1e9), codec="int4", peers=4, mbit_up=100, rtt_ms=100, step_s=0.5)
    rows = plan.rows
    assert [r.sync_every for r in rows] == sorted(r.sync_every for r in rows)
    assert all(r.bytes_per_round == int(1.5 * message_bytes(int(1e9), "int4")) for r in rows), rows[0]
    # more steps between rounds: higher utilisation; overlap never below blocking
    assert all(a.utilisation_blocking < b.utilisation_blocking for a, b in zip(rows, rows[1:])), rows
    assert all(r.utilisation >= r.utilisation_blocking for r in rows), rows
    rec = plan.recommendation
    assert rec["utilisation"] >= 0.95 and rec["sync_every"] in {r.sync_every for r in rows}, rec
    assert plan.data_parallel["utilisation"] < 0.01, plan.data_parallel  # 6 GB of fp32 a step on 100 Mbit/s
    fast = plan_rounds(int(1e9), codec="int4", peers=4, mbit_up=10_000, rtt_ms=5, step_s=0.5)
    assert fast.recommendation["sync_every"] <= rec["sync_every"], (fast.recommendation, rec)
    assert fast.rows[0].round_s < rows[0].round_s


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"mbit_up": 0}, "mbit_up"),
        ({"mbit_up": 10, "step_s": -1}, "step_s"),
        ({"mbit_up": 10, "peers": 1}, "peers"),
        ({"mbit_up": 10, "codec": "zip"}, "codec"),
        ({"mbit_up": 10, "rtt_ms": float("nan")}, "rtt_ms"),
    ],
)
def test_plan_rounds_rejects_bad_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        plan_rounds(1000, **{"step_s": 0.1, **kw})


def test_params_of_a_config_are_the_checkpoints():
    from safetensors import safe_open

    with safe_open(str(LLAMA / "model.safetensors"), "np") as f:
        real = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    assert params_of_config(str(LLAMA)) == real
    c = json.loads((LLAMA / "config.json").read_text())
    d, ff, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = 4 * (2 * (d + d) + 2 * (d + kv) + 3 * (d + ff))  # rank 4: q, o; k, v; gate, up, down
    assert params_of_config(str(LLAMA), lora_rank=4) == c["num_hidden_layers"] * per_layer


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ravnest_jax.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_the_plan_command(tmp_path):
    out = tmp_path / "plan.json"
    r = _cli(
        "plan", "--params", "1e9", "--codec", "int4", "--peers", "4", "--mbit", "100", "--rtt-ms", "100",
        "--step-s", "0.5", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("1,000.0M parameters exchanged, codec int4, 4 peers"), lines[0]
    assert any(ln.split()[:1] == ["50"] and "%" in ln for ln in lines), r.stdout
    assert any(ln.startswith("recommended: H=") for ln in lines) and "rj.diloco(inner, sync_every=" in r.stdout
    d = json.loads(out.read_text())
    assert d["recommendation"]["utilisation"] >= 0.95 and len(d["rows"]) == 7, d


def test_the_plan_command_plans_sign_up_int2_down():
    r = _cli(
        "plan", "--params", "1e9", "--codec", "sign", "--mean-codec", "int2", "--mbit", "100", "--rtt-ms", "100",
        "--step-s", "3.4", "--no-measure",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("1,000.0M parameters exchanged, codec sign up, int2 down, 2 peers"), lines[0]
    mb = 0.5 * (message_bytes(int(1e9), "sign") + message_bytes(int(1e9), "int2")) / 1e6
    assert f"{mb:.2f}" in lines[2] and "error feedback" in r.stdout, (mb, r.stdout)
    bad = _cli("plan", "--params", "1e9", "--codec", "fp32", "--mean-codec", "int2", "--mbit", "10", "--step-s", "1")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "block codecs" in bad.stderr, bad.stderr


def test_the_plan_command_names_bad_input(capsys):
    from ravnest_jax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "--params", "1e9", "--mbit", "-3", "--step-s", "0.5"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--mbit" in err and "Traceback" not in err, err
    assert main(["plan", "--config", "/nonexistent/nope.json", "--mbit", "10", "--step-s", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.json" in err, err


def test_the_plan_command_names_its_flags_and_checks_the_json_path_first(capsys, tmp_path):
    from ravnest_jax.cli import main

    base = ["plan", "--params", "1e9", "--mbit", "10", "--step-s", "0.5", "--no-measure"]
    assert main([*base, "--peers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --peers must be") and err.count("\n") == 1, err
    assert main([*base, "--json", str(tmp_path / "nope" / "plan.json")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "--json" in out.err and "no such directory" in out.err, out
    assert main([*base, "--codec", "sign", "--mean-codec", "int2", "--json", str(tmp_path / "p.json")]) == 0
    d = json.loads((tmp_path / "p.json").read_text())
    assert "error feedback" in d["note"] and d["inputs"]["mean_codec"] == "int2", d


def test_a_block_size_is_planned_with_the_wire_formats_bytes():
    """--block-size 512 (the 1000x mode of docs/algorithm.md): a sign and an int2 message of
    that block size, as the encoder writes them; refused for a codec without blocks."""
    n = 100_003
    for codec in ("sign", "int2", "int4"):
        real = len(encode_part("p", np.ones(n, np.float32), codec, block_size=512))
        assert 0 <= real - message_bytes(n, codec, 512) < 600, (codec, real, message_bytes(n, codec, 512))
    plan = plan_rounds(n, codec="sign", mean_codec="int2", block_size=512, peers=4, mbit_up=100, step_s=0.5)
    want = 0.75 * (message_bytes(n, "sign", 512) + message_bytes(n, "int2", 512))
    assert plan.rows[0].bytes_per_round == int(want) and plan.inputs["block_size"] == 512, plan.rows[0]
    default = plan_rounds(n, codec="sign", mean_codec="int2", peers=4, mbit_up=100, step_s=0.5)
    assert plan.rows[0].bytes_per_round < default.rows[0].bytes_per_round, (plan.rows[0], default.rows[0])
    for bad, msg in ((dict(codec="fp32", block_size=512), "block codecs"), (dict(codec="int4", block_size=7), "even")):
        with pytest.raises(ValueError, match=msg):
            plan_rounds(n, mbit_up=100, step_s=0.5, **bad)
    r = _cli("plan", "--params", "1e9", "--codec", "sign", "--mean-codec", "int2", "--block-size", "512",
             "--mbit", "100", "--step-s", "3.4", "--no-measure")  # fmt: skip
    assert r.returncode == 0 and "sign up, int2 down, block 512" in r.stdout.splitlines()[0], r.stdout + r.stderr
    bad = _cli("plan", "--params", "1e9", "--block-size", "7", "--mbit", "100", "--step-s", "3.4", "--no-measure")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --block-size"), bad.stderr


def test_a_closed_pipe_ends_the_command_quietly():
    """``ravnest-jax plan ... | head``: the reader gone before the table is written is no
    traceback (``true`` exits at once, long before the command has imported anything)."""
    cmd = f"{sys.executable} -m ravnest_jax.cli plan --params 1e9 --mbit 100 --step-s 1 --no-measure | true"
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120, check=False)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
