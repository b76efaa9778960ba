"""The char-LM example end to end (tiny settings), its corpus loader and its flag validation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import char_lm  # noqa: E402


def test_stdlib_corpus_is_real_python_split_by_file():
    train, evald = char_lm.load_corpus(max_bytes=2 << 20)
    assert train.dtype == np.uint8 and evald.dtype == np.uint8
    assert train.size > 100_000 and evald.size > 10_000
    assert b"def " in train[:200_000].tobytes() and b"import" in evald.tobytes()


def test_text_file_corpus(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(b"hello world. " * 1000)
    train, evald = char_lm.load_corpus(str(text))
    assert train.size == 11700 and evald.size == 1300
    with pytest.raises(ValueError, match="--text"):
        char_lm.load_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "short.txt").write_bytes(b"x")
    with pytest.raises(ValueError, match="--text"):
        char_lm.load_corpus(str(tmp_path / "short.txt"))


@pytest.mark.parametrize(
    "bad",
    [
        ["--steps", "0"],
        ["--replicas", "-2"],
        ["--lr", "nan"],
        ["--d-model", "30", "--heads", "4"],
        ["--outer-momentum", "1.0"],
        ["--outer-lr", "0"],
        ["--inner", "sgd"],
        ["--topk-fraction", "0.01"],  # without --codec topk
        ["--codec", "topk", "--topk-fraction", "1.5"],
        ["--ef-decay", "1.2"],
        ["--codec", "int4", "--block-size", "63"],
        ["--codec", "sign", "--block-size", "48"],  # sign needs a power of two
        ["--codec", "bf16", "--block-size", "64"],  # not a block codec
        ["--mean-ef", "yes"],
        ["--codec", "sign", "--mean-codec", "topk"],  # not a block codec
        ["--codec", "fp32", "--mean-codec", "int2"],
        ["--mean-codec", "int2"],  # without --codec
        ["--local-peers", "4", "--adversary", "scale:abc"],
        ["--local-peers", "4", "--adversary", "flip"],
        ["--adversary", "noise"],  # not a swarm peer
        ["--local-peers", "2", "--adversary", "noise", "--adversary-peers", "2"],
        ["--local-peers", "2", "--clip-multiple", "0.5"],
        ["--local-peers", "2", "--aggregator", "median"],
        ["--rendezvous", "http://127.0.0.1:1", "--no-inbound", "--advertise", "http://x:1"],
        ["--rendezvous", "notaurl"],  # was: a 10 s wait, then "unreachable: notaurl/v1/runs/..."
    ],
)
def test_bad_flags_exit_with_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as e:
        char_lm.parse_args(bad)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error" in err and bad[-2] in err, err


def test_block_size_applies_to_a_swarms_default_codec(capsys):
    """In a swarm --codec defaults to int4, a block codec: --block-size alone is taken (it was
    refused as "got --codec None"); the simulation, whose default is no codec, refuses it."""
    args = char_lm.parse_args(["--local-peers", "2", "--block-size", "512"])
    assert (args.codec, args.block_size) == ("int4", 512)
    with pytest.raises(SystemExit):
        char_lm.parse_args(["--local-peers", "2", "--block-size", "63"])
    assert "--block-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        char_lm.parse_args(["--block-size", "512"])
    assert "needs a block codec" in capsys.readouterr().err


@pytest.mark.integration
def test_simulation_end_to_end_writes_summary(tmp_path):
    out = tmp_path / "summary.json"
    rc = char_lm.main(
        [
            "--steps",
            "24",
            "--sync-every-list",
            "1",
            "12",
            "--replicas",
            "2",
            "--batch-size",
            "4",
            "--seq-len",
            "32",
            "--d-model",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--eval-batches",
            "2",
            "--lr",
            "1e-2",
            "--no-progress",
            "--summary-json",
            str(out),
        ]
    )
    assert rc == 0
    summary = json.loads(out.read_text())
    results = summary["results"]
    assert set(results) == {"data_parallel", "diloco_h1", "diloco_h12"}
    assert results["diloco_h12"]["outer_rounds"] == 2
    for r in results.values():  # every run learned something at equal tokens
        assert np.isfinite(r["eval_loss"]) and r["eval_loss"] < summary["eval_loss_at_init"] - 0.5


def test_devices_flag_validation(capsys):
    assert char_lm.parse_args(["--local-peers", "2", "--devices", "2", "--batch-size", "4"]).devices == 2
    for bad in (
        ["--local-peers", "2", "--devices", "3", "--batch-size", "4"],  # batch not divisible
        ["--devices", "2"],
    ):  # the simulation has no peers
        with pytest.raises(SystemExit) as e:
            char_lm.parse_args(bad)
        assert e.value.code == 2
    assert "--devices" in capsys.readouterr().err


def test_overlap_flag(capsys):
    assert char_lm.parse_args(["--local-peers", "2"]).overlap_steps == "auto"
    assert char_lm.parse_args(["--local-peers", "2", "--overlap-steps", "3"]).overlap_steps == 3
    assert char_lm.parse_args(["--local-peers", "2", "--mode", "blocking"]).overlap_steps == 0
    for bad in (
        ["--local-peers", "2", "--overlap-steps", "soon"],
        ["--local-peers", "2", "--overlap-steps", "-1"],
        ["--local-peers", "2", "--overlap-steps", "50"],  # not below H
        ["--local-peers", "2", "--mode", "eager", "--overlap-steps", "0"],
        ["--local-peers", "2", "--codec", "int5"],
    ):
        with pytest.raises(SystemExit) as e:
            char_lm.parse_args(bad)
        assert e.value.code == 2
    assert "--overlap-steps" in capsys.readouterr().err


@pytest.mark.integration  # compiles over 4 forced devices (13 s): keeps the unit tier under 3 minutes
@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
def test_peer_mesh_layouts_and_a_kept_layout(layout):
    """The peer's mesh over 4 (forced CPU) devices: params and state laid out, the batch split,
    and one DiLoCo inner step with pinned output shardings keeps the layouts."""
    import jax
    import optax

    import ravnest_jax as rj

    cfg = char_lm.ModelConfig(d_model=32, num_layers=1, num_heads=2, seq_len=16)
    graphdef, params = char_lm.build_model(cfg)
    tx = rj.diloco(optax.adam(1e-3), sync_every=4)
    mesh = char_lm.peer_mesh(4)
    assert mesh.size == 4 and char_lm.peer_mesh(1) is None
    with pytest.raises(ValueError, match="--devices"):
        char_lm.peer_mesh(len(jax.local_devices()) + 1)
    params, state, put_batch = char_lm.place_on_mesh(mesh, layout, params, tx.init(params))
    specs = {x.sharding.spec for x in jax.tree.leaves(params)}
    if layout == "replicated":
        assert specs == {jax.sharding.PartitionSpec()}
    else:  # e.g. the (256, 32) embedding and the (16, 32) positions split over the 4 devices
        assert jax.sharding.PartitionSpec("data") in specs
    tokens = put_batch(np.zeros((8, cfg.seq_len + 1), np.int32))
    assert tokens.sharding.spec == jax.sharding.PartitionSpec("data")
    loss = char_lm.make_loss(graphdef)

    def step(p, s, t):
        g = jax.grad(loss)(p, t)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    layouts = (jax.tree.map(lambda x: x.sharding, params), jax.tree.map(lambda x: x.sharding, state))
    p2, s2 = jax.jit(step, out_shardings=layouts)(params, state, tokens)
    assert jax.tree.map(lambda x: x.sharding, (p2, s2)) == layouts


def test_data_parallel_bytes_count_the_steps_taken_not_max_steps():
    """An interrupted local swarm (395 of --max-steps 600 done) compares its bytes with what
    data-parallel training would have sent for those 395 steps (it used --max-steps: 1.5x)."""
    from char_lm.local import data_parallel_bytes, data_parallel_bytes_for

    done = [{"params": 1000, "steps": 395}, {"params": 1000, "steps": 395}]
    assert data_parallel_bytes_for(2, done) == data_parallel_bytes(2, 1000, 395) == 2 * 1 / 2 * 4 * 1000 * 395


def test_a_peer_timing_out_waiting_for_min_peers_is_one_line(monkeypatch, capsys):
    """rj.join_or_resume raises TimeoutError when fewer than --min-peers peers register in time
    (a peer restarted after the others finished): one error line and status 1, no traceback."""
    import importlib

    main_mod = importlib.import_module("char_lm.main")

    def times_out(args):
        raise TimeoutError("fewer than 2 peers after 300.0 s")

    monkeypatch.setattr(main_mod, "run_peer", times_out)
    monkeypatch.setenv("RAVNEST_TOKEN", "t")
    assert main_mod.main(["--rendezvous", "http://127.0.0.1:1", "--min-peers", "2", "--no-progress"]) == 1
    assert capsys.readouterr().err.strip() == "error: fewer than 2 peers after 300.0 s"


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_wrong_token_is_one_line_not_a_traceback(tmp_path):
    """A peer whose token the rendezvous refuses exits 1 with one error line."""
    import subprocess

    from _cluster import Cluster, cluster_of

    (tmp_path / "token").write_text("the-right-token")
    (tmp_path / "wrong").write_text("a-wrong-token")
    with cluster_of(Cluster(tmp_path, token="the-right-token")) as c:
        token_file = ("--token-file", str(tmp_path / "token"))
        url = c.rendezvous(heartbeat=None, eviction=None, extra=(*token_file, "--quiet"))
        text = tmp_path / "text.txt"
        text.write_bytes(Path(char_lm.__file__).with_name("main.py").read_bytes() * 4)
        out = subprocess.run(
            [
                sys.executable,
                str(Path(char_lm.__file__).with_name("main.py")),
                "--rendezvous",
                url,
                "--token-file",
                str(tmp_path / "wrong"),
                "--listen",
                "127.0.0.1:0",
                "--text",
                str(text),
                "--d-model",
                "32",
                "--layers",
                "1",
                "--heads",
                "2",
                "--seq-len",
                "32",
                "--batch-size",
                "4",
                "--eval-batches",
                "1",
                "--max-steps",
                "10",
                "--sync-every",
                "5",
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=100,
        )
        assert out.returncode == 1, out.stderr
        assert "Traceback" not in out.stderr and "error: " in out.stderr and "401" in out.stderr, out.stderr


def test_the_config_of_a_swarm_run_is_what_it_used():
    """A swarm run's summary config has no simulation-only settings and names the aggregator
    it used (the default is None on the command line); the simulation keeps its own."""
    from char_lm.report import run_config

    swarm = run_config(char_lm.parse_args(["--local-peers", "2"]))
    assert "replicas" not in swarm and "steps" not in swarm and swarm["aggregator"] == "clipped_mean", swarm
    assert run_config(char_lm.parse_args(["--local-peers", "2", "--aggregator", "mean"]))["aggregator"] == "mean"
    sim = run_config(char_lm.parse_args(["--steps", "7"]))
    assert sim["steps"] == 7 and sim["replicas"] == 4, sim
