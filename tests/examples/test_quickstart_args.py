"""examples/quickstart_peer.py's flags: a bad value is argparse's one usage error (exit 2), never a
traceback from the training loop (``--steps -5`` ended in a ``NameError``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "quickstart_peer.py"


@pytest.mark.parametrize(
    "flag,value",
    [("--steps", "-5"), ("--steps", "0"), ("--steps", "ten"), ("--sync-every", "0"), ("--sync-every", "2.5")],
)
def test_a_bad_count_is_one_usage_error(flag, value):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, str(SCRIPT), flag, value], capture_output=True, text=True, timeout=120, env=env)
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
    assert errors == [f"quickstart_peer.py: error: argument {flag}: expected a whole number >= 1, got '{value}'"], (
        r.stderr
    )
