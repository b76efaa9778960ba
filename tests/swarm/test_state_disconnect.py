"""A joiner that goes away mid-download of the state costs the serving peer one log line: no
aiohttp traceback (it was 20 lines of ``Error handling request``), and the peer serves the next
joiner as before."""

from __future__ import annotations

import io
import logging
import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sync._local import TOKEN, local_swarm  # noqa: E402

from ravnest_jax.swarm.wire import _auth  # noqa: E402

STATE = bytes(range(256)) * (128 << 10)  # 32 MiB: far more than the sockets' buffers hold


def _read_part_then_close(port: int, run_id: str, nbytes: int) -> bytes:
    """A raw HTTP client: a signed GET of the state, ``nbytes`` of the answer, then a close with
    the rest unread (the kernel answers the server's next writes with a reset)."""
    path = f"/v1/runs/{run_id}/state"
    headers = _auth.sign(TOKEN, method="GET", path=path, run_id=run_id, peer="joiner")
    req = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall((req + "\r\n").encode())
        while len(got) < nbytes:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    return got


@pytest.mark.timeout(120)
def test_a_joiner_leaving_mid_download_is_one_log_line():
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    # an earlier test in this process may have set the package's level (an example's main())
    ours = logging.getLogger("ravnest_jax")
    ours_level = ours.level
    ours.setLevel(logging.INFO)
    try:
        with local_swarm(2) as (a, b):
            a.serve_state(lambda: STATE)
            got = _read_part_then_close(a.port, "sync-test", 1 << 20)
            assert got.startswith(b"HTTP/1.1 200") and len(got) >= 1 << 20, got[:200]
            deadline = time.monotonic() + 20
            while "mid-download" not in buf.getvalue() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # anything the server would log after the line has come by now
            log = buf.getvalue()
            assert b.fetch_state(timeout=30) == STATE  # the next joiner is served as before
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        ours.setLevel(ours_level)
    assert "Traceback" not in log and "Error handling request" not in log, log
    gone = [ln for ln in log.splitlines() if "mid-download" in ln]
    assert len(gone) == 1 and gone[0].startswith(("INFO ", "WARNING ")), log
    assert "joiner went away" in gone[0] and "(33554432 bytes)" in gone[0], gone
