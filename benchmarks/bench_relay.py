#!/usr/bin/env python3
"""What client-only peers cost: butterfly rounds of 3 peer processes on 127.0.0.1, all
reachable, then one client-only (``listen=None``: it owns no part and pulls the results), then
all three client-only (nobody reachable but the rendezvous: every part and result goes through
its relay), side by side in one run.

Per payload size (float32 elements) and case: the median round seconds, the bytes the relay
carried per round (request and answer bodies), and the client-only peer's bytes sent and
received per round. Writes ``benchmarks/results/relay.json`` (the machine, the command).

    python benchmarks/bench_relay.py                    # 1M and 16M elements, 8 rounds each
    python benchmarks/bench_relay.py --sizes 262144 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import machine_info  # noqa: E402

TOKEN = "bench-relay-token"

PEER = r"""
import json, sys, time
import numpy as np
from ravnest_jax.swarm import Swarm, Timeouts
url, pid, size, rounds, listen = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
t = Timeouts(connect=5.0, part=60.0, grace=1.0, round=300.0, heartbeat=0.5, eviction=5.0)
with Swarm(url, run_id="bench", token=sys.argv[6], listen=None if listen == "none" else listen, timeouts=t,
           peer_id=pid, codec="fp32") as s:
    s.wait_for_peers(3, timeout=60)
    rng = np.random.default_rng(int(pid[1:]))
    x = rng.standard_normal(size).astype(np.float32)
    out = []
    for r in range(rounds + 1):  # round 0 warms up (connections, buffers)
        _, rec = s.all_reduce({"x": x})
        out.append({"seconds": rec.seconds, "sent": rec.bytes_sent, "received": rec.bytes_received, "ok": rec.ok,
                    "digest": rec.digest})
    print(json.dumps({"peer": pid, "client_only": s.client_only, "rounds": out[1:], "relay": s.relay_stats}))
"""


CASES = {"direct": 0, "one client-only": 1, "all client-only": 3}  # how many of the 3 peers are client-only


def run(size: int, rounds: int, case: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        pf = Path(tmp) / "port"
        env = {**os.environ, "RAVNEST_TOKEN": TOKEN}
        rv = subprocess.Popen(
            [sys.executable, "-m", "ravnest_jax.cli", "rendezvous", "--host", "127.0.0.1", "--port", "0",
             "--port-file", str(pf), "--quiet", "--heartbeat", "0.5", "--eviction", "5"],
            env=env,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while not pf.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            url = f"http://127.0.0.1:{pf.read_text()}"
            k = CASES[case]
            listens = ["127.0.0.1:0"] * (3 - k) + ["none"] * k
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", PEER, url, f"p{i}", str(size), str(rounds), listens[i], TOKEN],
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
                for i in range(3)
            ]
            outs = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in procs]
        finally:
            rv.terminate()
            rv.wait(10)
    p2 = outs[2]
    per_round = [max(o["rounds"][r]["seconds"] for o in outs) for r in range(rounds)]
    digests_equal = all(len({o["rounds"][r]["digest"] for o in outs}) == 1 for r in range(rounds))
    relay = p2["relay"]
    return {
        "elements": size,
        "payload_bytes": 4 * size,
        "case": case,
        "median_round_seconds": statistics.median(per_round),
        "relay_bytes_per_round": (relay["bytes_in"] + relay["bytes_out"]) / (rounds + 1),
        "relay_messages_per_round": relay["messages"] / (rounds + 1),
        "client_only_peer_sent_bytes_per_round": statistics.mean(r["sent"] for r in p2["rounds"]),
        "client_only_peer_received_bytes_per_round": statistics.mean(r["received"] for r in p2["rounds"]),
        "all_ok": all(r["ok"] for o in outs for r in o["rounds"]),
        "digests_equal": digests_equal,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1048576,16777216", help="comma list of float32 elements")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/relay.json"))
    args = p.parse_args()
    results = []
    for size in [int(s) for s in args.sizes.split(",")]:
        for case in CASES:
            r = run(size, args.rounds, case)
            results.append(r)
            print(json.dumps(r), flush=True)
    doc = {
        "what": "butterfly rounds of 3 peer processes on 127.0.0.1 (fp32): all reachable, one client-only, all client-only",
        "machine": machine_info(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
