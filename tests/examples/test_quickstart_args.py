"""examples/quickstart_peer.py's flags: a bad value is argparse's one usage error (exit 2), never a
traceback from the training loop (``--steps -5`` ended in a ``NameError``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "quickstart_peer.py"


BAD = [("--steps", "-5"), ("--steps", "0"), ("--steps", "ten"), ("--sync-every", "0"), ("--sync-every", "2.5")]


@pytest.mark.integration  # starts 5 processes
def test_a_bad_count_is_one_usage_error():
    """Each bad value in its own process, all started at once (each start imports jax: seconds)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = {
        case: subprocess.Popen(
            [sys.executable, str(SCRIPT), *case], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for case in BAD
    }
    try:
        for (flag, value), p in procs.items():
            _, err = p.communicate(timeout=120)
            errors = [ln for ln in err.splitlines() if "error:" in ln]
            assert p.returncode == 2 and "Traceback" not in err, (flag, value, p.returncode, err[-2000:])
            want = f"quickstart_peer.py: error: argument {flag}: expected a whole number >= 1, got '{value}'"
            assert errors == [want], (flag, value, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
