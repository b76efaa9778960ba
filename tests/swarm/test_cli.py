"""The ``ravnest-jax`` command line and clean shutdown on SIGINT / SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from .conftest import port_is_free

pytestmark = pytest.mark.integration  # real swarms (processes or threads): minutes in all


def test_help_explains_rendezvous():
    out = subprocess.run(
        [sys.executable, "-m", "ravnest_jax.cli", "rendezvous", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for word in ("--token-file", "RAVNEST_TOKEN", "--port", "--heartbeat", "--eviction", "--certfile"):
        assert word in out.stdout


def test_missing_token_is_an_error(monkeypatch):
    monkeypatch.delenv("RAVNEST_TOKEN", raising=False)
    env = {k: v for k, v in __import__("os").environ.items() if k != "RAVNEST_TOKEN"}
    out = subprocess.run(
        [sys.executable, "-m", "ravnest_jax.cli", "rendezvous", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode != 0 and "token" in out.stderr


@pytest.mark.parametrize(
    "args,words",
    [
        (["--token-file", "/nonexistent/token"], ["--token-file", "No such file"]),
        (["--token-file", "EMPTY"], ["--token-file", "empty"]),
        (["--heartbeat", "-1"], ["--heartbeat", "number > 0"]),
        (["--heartbeat", "nan"], ["--heartbeat", "number > 0"]),
        (["--heartbeat", "5", "--eviction", "2"], ["--eviction", "--heartbeat"]),
        (["--port", "99999"], ["--port", "0-65535"]),
        (["--certfile", "/nonexistent/cert.pem"], ["--certfile"]),
    ],
)
def test_bad_rendezvous_flags_give_one_clear_line(tmp_path, capsys, args, words):
    from ravnest_jax.cli import main

    empty = tmp_path / "empty"
    empty.write_text("  \n")
    token = tmp_path / "token"
    token.write_text("t0k3n")
    args = [str(empty) if a == "EMPTY" else a for a in args]
    if "--token-file" not in args:
        args = ["--token-file", str(token), *args]
    with pytest.raises(SystemExit) as e:
        main(["rendezvous", "--port", "0", *args] if "--port" not in args else ["rendezvous", *args])
    msg = str(e.value.code) + capsys.readouterr().err
    assert e.value.code != 0 and "Traceback" not in msg
    for w in words:
        assert w in msg, msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_rendezvous_and_peer_cleanly(cluster, sig):
    cluster.rendezvous()
    peer = cluster.peer("a", 1, rounds=1000, size=11, round_sleep=0.05)
    cluster.ready([peer])
    peer.expect("round", 20)
    if sig == signal.SIGTERM:  # the status command sees the peer and its rounds
        out = subprocess.run(
            [sys.executable, "-m", "ravnest_jax.cli", "status", cluster.url, "--run-id", "test"],
            capture_output=True,
            text=True,
            timeout=60,
            env=cluster.env,
        )
        assert out.returncode == 0, out.stderr
        status = __import__("json").loads(out.stdout)
        assert [p["peer_id"] for p in status["peers"]] == ["a"]
        assert status["peers"][0]["address"] == f"http://127.0.0.1:{peer.port}"
        assert status["last_round"] >= 0 and status["rounds"][0]["outcome"] == "ok"
    peer.p.send_signal(sig)
    assert peer.wait(15) in (0, -sig, 128 + sig)
    assert port_is_free(peer.port)
    cluster.rv.p.send_signal(sig)
    assert cluster.rv.wait(15) == 0
    assert port_is_free(cluster.rv.port)
