#!/usr/bin/env python3
"""Opens the rendezvous' status page in headless Chromium while the main job runs, and saves a
screenshot.

    python benchmarks/screenshot_status.py [--out docs/status-page.png] [--peers 4] [--rounds 4]

Starts ``examples/char_lm/main.py --local-peers N`` (the README's first command, shorter),
reads the status page's address from its output, waits until the page's data shows every peer
and ``--rounds`` ok rounds, then runs Debian's ``chromium --headless --screenshot`` on the page
(no network beyond 127.0.0.1: the flags keep Chromium from calling home) and stops the job with
Ctrl+C (SIGINT). Needs ``/usr/bin/chromium`` (``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def _data(page: str) -> dict:
    """The page's data; no peers and no rounds until the run exists (404)."""
    base, query = page.split("?", 1)
    try:
        with urllib.request.urlopen(f"{base}/data?{query}", timeout=5) as r:  # noqa: S310 - 127.0.0.1 only
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise
        return {"peers": [], "rounds": [], "last_round": None}


def screenshot(url: str, out: Path, size: str = "1500,1150", budget_ms: int = 6000) -> None:
    """Chromium's screenshot of ``url`` after ``budget_ms`` of virtual time (the page's first
    data fetch and render)."""
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            chromium,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            f"--virtual-time-budget={budget_ms}",
            f"--screenshot={out}",
            url,
        ]
        subprocess.run(cmd, check=True, timeout=120, capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "status-page.png"))
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4, help="ok rounds to wait for before the screenshot")
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--sync-every", type=int, default=20)
    args = ap.parse_args()
    if not (shutil.which("chromium") or Path("/usr/bin/chromium").exists()):
        print("error: no chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    job = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "examples" / "char_lm" / "main.py"),
            "--local-peers",
            str(args.peers),
            "--max-steps",
            str(args.max_steps),
            "--sync-every",
            str(args.sync_every),
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tempfile.mkdtemp(prefix="rj-shot-"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    page = None
    try:
        deadline = time.monotonic() + 120
        while page is None and time.monotonic() < deadline:
            line = job.stdout.readline()
            if not line and job.poll() is not None:
                raise RuntimeError("the main job ended before it printed the status page")
            print(line, end="")
            if line.startswith("status page: "):
                page = line.split(": ", 1)[1].strip()
        if page is None:
            raise RuntimeError("no status page line within 120 s")
        threading.Thread(target=lambda: [print(ln, end="") for ln in job.stdout], daemon=True).start()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            d = _data(page)
            ok = [r for r in d["rounds"] if r["outcome"] == "ok"]
            if len(d["peers"]) == args.peers and len(ok) >= args.rounds and ok[-1]["train_loss"] is not None:
                break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"the page never showed {args.peers} peers and {args.rounds} ok rounds")
        out = Path(args.out)
        screenshot(page, out)
        print(f"\nwrote {out}: {len(d['peers'])} peers, {len(ok)} ok rounds, last round {d['last_round']}")
        (out.with_suffix(".json")).write_text(json.dumps(d, indent=1) + "\n")
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGINT)
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
