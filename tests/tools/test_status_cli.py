"""``ravnest-jax status``: the run's JSON against a real rendezvous, and every failure as one line
in words (never an exception's repr)."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from _cluster import Cluster

from ravnest_jax.cli import main
from ravnest_jax.swarm import Swarm

TOKEN = "status-token-1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("rv"), token=TOKEN)
    try:
        c.rendezvous(heartbeat=None, eviction=None, extra=("--quiet",))
        yield c
    finally:
        c.close()


@pytest.fixture
def rendezvous(cluster):
    return cluster.url


def _status(capsys, monkeypatch, url: str, token: str = TOKEN, *extra: str, run: str = "r1") -> tuple[int, str, str]:
    monkeypatch.setenv("RAVNEST_TOKEN", token)
    rc = main(["status", url, "--run-id", run, *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_line(rc: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    for leak in ("Error(", "ConnectionKey", "Traceback", "<", "HTTP 4"):
        assert leak not in lines[0], lines[0]
    return lines[0]


def test_status_prints_the_run_as_json(rendezvous, capsys, monkeypatch):
    with Swarm(rendezvous, run_id="r1", token=TOKEN, listen="127.0.0.1:0", peer_id="p0"):  # the run exists
        rc, out, err = _status(capsys, monkeypatch, rendezvous)
    assert rc == 0 and '"run_id": "r1"' in out and '"peer_id": "p0"' in out, (rc, out, err)


def test_a_run_nobody_joined_is_one_line(rendezvous, capsys, monkeypatch):
    rc, _, err = _status(capsys, monkeypatch, rendezvous, run="typo")
    assert _one_line(rc, err) == (
        f"error: the rendezvous at {rendezvous}: no run 'typo' at this rendezvous: no peer has joined it since it started"
    )


def test_wrong_token_is_one_line_here_and_in_the_rendezvous_log(cluster, capsys, monkeypatch):
    rc, _, err = _status(capsys, monkeypatch, cluster.url, "not-the-token")
    assert _one_line(rc, err) == f"error: the rendezvous at {cluster.url} refused the token (401)"
    cluster.rv.expect_log("refused a request from 127.0.0.1 for run r1: unauthorized: ", 10)


def test_nothing_listening_is_connection_refused(capsys, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    rc, _, err = _status(capsys, monkeypatch, url)
    assert _one_line(rc, err) == f"error: cannot reach the rendezvous at {url}: connection refused"


def test_a_silent_server_is_a_timeout(capsys, monkeypatch):
    with socket.socket() as s:  # accepts (the kernel's backlog) and never answers
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        rc, _, err = _status(capsys, monkeypatch, url, TOKEN, "--timeout", "0.5")
    assert time.monotonic() - t0 < 10, "the --timeout was not applied"
    assert _one_line(rc, err) == f"error: no answer from the rendezvous at {url} within 0.5 s"


class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_error(404)  # http.server's own error page: several lines of HTML

    def log_message(self, *a):  # quiet
        pass


def test_a_web_server_that_is_not_a_rendezvous(capsys, monkeypatch):
    srv = HTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        rc, _, err = _status(capsys, monkeypatch, url)
    finally:
        srv.shutdown()
        srv.server_close()
    line = _one_line(rc, err)
    # the words, not the server's HTML error page
    assert line == f"error: the rendezvous at {url} has no such page (is the URL a rendezvous?) (404)", line


def test_not_a_url(capsys, monkeypatch):
    rc, _, err = _status(capsys, monkeypatch, "127.0.0.1:8765")
    line = _one_line(rc, err)
    assert "127.0.0.1:8765" in line and "http://" in line, line


@pytest.mark.parametrize(
    "argv",
    [
        ["finetune", "recipe.yaml", "--sett", "optim.steps=3"],
        ["local", "--peers", "1", "--bogus", "--", "python", "x.py"],
        ["status", "http://127.0.0.1:9", "--run-id", "r", "--nope"],
    ],
)
def test_a_mistyped_option_is_told_by_its_command(argv, capsys):
    """``ravnest-jax COMMAND --typo``: the command's usage and name, not the top level's
    ``usage: ravnest-jax [-h] COMMAND ...`` (argparse leaves unknown options to the top parser)."""
    from ravnest_jax.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2, err
    typo = {"finetune": "--sett optim.steps=3", "local": "--bogus", "status": "--nope"}[argv[0]]
    assert err[-1] == f"ravnest-jax {argv[0]}: error: unrecognized arguments: {typo}", err
    assert err[0].startswith(f"usage: ravnest-jax {argv[0]}"), err
