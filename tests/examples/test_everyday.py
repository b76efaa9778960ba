"""The everyday cases of the main job, as a new user meets them: a lone peer, a lone run resumed
from its checkpoint, a strict-JSON summary, and one-line errors before any compiling."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _cluster import Cluster, Proc, cluster_of

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "char_lm" / "main.py")
TINY = [
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
    "--lr",
    "1e-2",
    "--no-progress",
]


def _strict(text: str) -> dict:
    """json.loads that refuses NaN / Infinity, as strict parsers (JavaScript, jq, Go) do."""

    def refuse(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _run(args: list[str], timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}
    return subprocess.run(
        [sys.executable, EXAMPLE, *args], capture_output=True, text=True, timeout=timeout, env=env, **kw
    )


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_lone_peer_has_every_round_ok_and_a_strict_json_summary(tmp_path):
    out = tmp_path / "s.json"
    r = _run(["--local-peers", "1", "--max-steps", "80", "--sync-every", "10", *TINY, "--summary-json", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    summary = _strict(out.read_text())
    peer = summary["peers"][0]
    oks = [(m["round"], m["ok"], m["error"]) for m in peer["round_log"]]
    assert len(oks) == 8 and all(ok for _, ok, _ in oks), oks
    assert [m["swarm_round"] for m in peer["round_log"]] == list(range(8)), peer["round_log"]
    assert peer["failed_rounds"] == 0 and peer["rounds"] == 8, peer
    # what the user sees is what ran: the real run id, no launcher internals, the peer's id
    cfg = summary["config"]
    assert cfg["run_id"].startswith("char-lm-") and cfg["run_id"] == peer["run_id"], cfg
    for internal in ("parent_pid", "json_events", "join_when_exists", "listen"):
        assert internal not in cfg, cfg
    assert peer["peer"] == "peer0" and peer["listen"].startswith("127.0.0.1:"), peer
    assert peer["listen"] != "127.0.0.1:0", peer
    assert peer["eval_loss_end"] < peer["eval_loss_start"], peer
    # the table says what the JSON says
    assert "|      8 |      0 |" in r.stdout, r.stdout
    # and it says where the run's plots are (ravnest-jax report, next to the summary)
    plots = [ln for ln in r.stdout.splitlines() if ln.startswith("plots: ")]
    assert plots, r.stdout
    paths = [Path(x) for x in plots[0][len("plots: ") :].split(", ")]
    assert [x.name for x in paths] == ["s.loss.png", "s.utilisation.png", "s.bytes.png"], paths
    assert all(x.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for x in paths), paths


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_a_lone_run_resumed_from_its_checkpoint_equals_one_run(tmp_path):
    common = ["--local-peers", "1", "--sync-every", "10", "--overlap-steps", "0", "--schedule-steps", "40", *TINY]
    one, a, b = tmp_path / "one.json", tmp_path / "a.json", tmp_path / "b.json"
    r = _run([*common, "--max-steps", "40", "--checkpoint-dir", str(tmp_path / "c1"), "--summary-json", str(one)])
    assert r.returncode == 0, r.stderr
    r = _run([*common, "--max-steps", "20", "--checkpoint-dir", str(tmp_path / "c2"), "--summary-json", str(a)])
    assert r.returncode == 0, r.stderr
    r = _run([*common, "--max-steps", "40", "--checkpoint-dir", str(tmp_path / "c2"), "--summary-json", str(b)])
    assert r.returncode == 0, r.stderr
    whole, first, second = (_strict(p.read_text())["peers"][0] for p in (one, a, b))
    assert second["start_step"] == 20 and second["resumed_from_step"] == 20, second
    assert all(m["ok"] for m in first["round_log"] + second["round_log"]), (first["round_log"], second["round_log"])
    # bit-exact: the global params and outer state, round by round and at the end
    assert first["round_digests"] + second["round_digests"] == whole["round_digests"], (first, second, whole)
    assert second["final_global_digest"] == whole["final_global_digest"]
    assert second["eval_loss_end"] == whole["eval_loss_end"]
    # the checkpoints named by the steps they hold
    assert second["checkpoint_steps"] == [20, 30, 40], second["checkpoint_steps"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster(tmp_path):
    """The shared cluster (``tests/_cluster.py``) with a real rendezvous on 127.0.0.1 that reads its
    token from a file (``cluster.token_file``)."""
    token = tmp_path / "token"
    token.write_text("right-token\n")
    token.chmod(0o600)
    with cluster_of(Cluster(tmp_path, token="right-token")) as c:
        c.token_file = token
        c.rendezvous(heartbeat=None, eviction=None, extra=("--token-file", str(token), "--quiet"), timeout=60)
        yield c


@pytest.fixture
def rendezvous(cluster):
    """The URL of ``cluster``'s rendezvous and its token file."""
    return cluster.url, cluster.token_file


def _one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert err and err[-1].startswith("error: "), r.stderr
    for w in words:
        assert w in err[-1], (w, err[-1])


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_peer_errors_are_one_line_and_come_before_compiling(tmp_path, rendezvous):
    url, token = rendezvous
    peer = ["--rendezvous", url, "--run-id", "e", "--max-steps", "5", *TINY]
    wrong = tmp_path / "wrong"
    wrong.write_text("wrong-token")
    wrong.chmod(0o600)
    t0 = time.monotonic()
    _one_line_error(_run([*peer, "--token-file", str(wrong)]), "refused our token")
    _one_line_error(_run([*peer, "--token-file", str(tmp_path / "missing")]), "--token-file", "missing")
    _one_line_error(_run([*peer, "--token-file", str(token), "--text", str(tmp_path / "none.txt")]), "--text")
    short = tmp_path / "short.txt"
    short.write_text("too short")
    _one_line_error(_run([*peer, "--token-file", str(token), "--text", str(short)]), "--text", "4096")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        _one_line_error(
            _run([*peer, "--token-file", str(token), "--listen", f"127.0.0.1:{port}"]), f"127.0.0.1:{port}", "in use"
        )
    dead = _free_port()
    _one_line_error(
        _run(["--rendezvous", f"http://127.0.0.1:{dead}", "--run-id", "e", "--token-file", str(token), *TINY]),
        "unreachable",
    )
    import ravnest_jax as rj

    held = rj.Checkpointer(tmp_path / "ckpt")  # this process holds the directory
    try:
        _one_line_error(
            _run([*peer, "--token-file", str(token), "--checkpoint-dir", str(tmp_path / "ckpt")]), "in use by another"
        )
    finally:
        held.close()
    # all seven before compiling (the last once its model is built): seconds each, not minutes
    assert time.monotonic() - t0 < 90, time.monotonic() - t0


def test_an_open_token_file_is_warned_about(tmp_path, caplog):
    from ravnest_jax.swarm import read_token

    f = tmp_path / "token"
    f.write_text("t0k\n")
    f.chmod(0o644)
    with caplog.at_level("WARNING", logger="ravnest_jax.swarm"):
        assert read_token(str(f)) == "t0k"
    assert "chmod 600" in caplog.text, caplog.text
    caplog.clear()
    f.chmod(0o600)
    with caplog.at_level("WARNING", logger="ravnest_jax.swarm"):
        read_token(str(f))
    assert caplog.text == ""


def test_the_token_comes_from_the_file_in_the_environment_too(tmp_path, monkeypatch):
    """``read_token`` (``ravnest-jax status``, the example's peers): ``--token-file``, else
    ``$RAVNEST_TOKEN``, else the file ``$RAVNEST_TOKEN_FILE`` names, as the launcher's docs say."""
    from ravnest_jax.swarm import read_token

    f = tmp_path / "token"
    f.write_text("from-file\n")
    f.chmod(0o600)
    monkeypatch.delenv("RAVNEST_TOKEN", raising=False)
    monkeypatch.setenv("RAVNEST_TOKEN_FILE", str(f))
    assert read_token() == "from-file"
    monkeypatch.setenv("RAVNEST_TOKEN", "from-env")
    assert read_token() == "from-env"
    monkeypatch.delenv("RAVNEST_TOKEN")
    monkeypatch.setenv("RAVNEST_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="missing"):
        read_token()
    monkeypatch.delenv("RAVNEST_TOKEN_FILE")
    with pytest.raises(ValueError, match="no token"):
        read_token()


@pytest.mark.integration
def test_simulation_and_launcher_check_the_text_first(tmp_path):
    for mode in (["--local-peers", "2"], ["--simulate"]):
        t0 = time.monotonic()
        r = _run([*mode, "--text", str(tmp_path / "none.txt"), *TINY], timeout=120)
        _one_line_error(r, "--text", "no such file")
        assert time.monotonic() - t0 < 30


def test_help_shows_each_default_once():
    r = _run(["--help"], timeout=60)
    assert r.returncode == 0
    helps: dict[str, str] = {}  # option -> its help text, from the option's line to the next one
    flag = None
    for line in r.stdout.splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            helps[flag] = line
        elif flag is not None and line.startswith("    "):
            helps[flag] += " " + line.strip()
        else:
            flag = None
    for flag in ("--codec", "--peer-id", "--checkpoint-every"):
        assert helps[flag].count("default") == 1, (flag, helps[flag])
    for flag in ("--d-model", "--layers", "--heads"):
        assert len(helps[flag].split()) > 4, (flag, helps[flag])  # a help text, not only the default


def _wait_rounds(p: Proc, n: int, timeout: float = 120) -> list[dict]:
    """Its round events once it reported ``n`` of them (woken by each event)."""
    p.wait_for(lambda e: len(p.rounds()) >= n, timeout, f"{n} rounds")
    return p.rounds()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_peer_with_other_settings_is_refused_in_one_line_and_the_run_goes_on(cluster, rendezvous):
    url, token = rendezvous
    peer = ["--rendezvous", url, "--run-id", "m", "--token-file", str(token), *TINY]
    a = cluster.spawn(
        "a", [sys.executable, EXAMPLE, *peer, "--max-steps", "100000", "--sync-every", "10", "--json-events"]
    )
    try:
        _wait_rounds(a, 1)
        took = {}
        # the refusal names every setting that differs: one peer with five other settings
        # shows that each of them is checked (a process start each would cost 5 s more)
        for flags, want in (
            (["--d-model", "64"], ["params: this peer 15 leaves, 84,672 elements"]),
            (
                ["--codec", "int8", "--mean-codec", "int2", "--fragments", "2", "--sync-every", "20"]
                + ["--aggregator", "mean"],
                [
                    "codec: this peer int8, the run int4",
                    "mean_codec: this peer int2, the run int4",
                    "fragments: this peer 2, the run 1",
                    "sync_every: this peer 20, the run 10",
                    "aggregator: this peer mean, the run clipped_mean:2.0",
                ],
            ),
        ):
            t0 = time.monotonic()
            r = _run([*peer, "--max-steps", "50", "--sync-every", "10", *flags], timeout=120)
            took[flags[0]] = round(time.monotonic() - t0, 1)
            _one_line_error(r, "settings differ from the run's", *want)
            assert "compil" not in r.stderr.lower(), r.stderr
        n = len(a.rounds())
        after = _wait_rounds(a, n + 2)  # the run goes on, alone, every round ok
        assert all(e["ok"] and e["group_size"] == 1 for e in after), after
        print("seconds to the refusal:", took)
    finally:
        a.reap()
