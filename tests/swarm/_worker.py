"""A swarm peer in its own process, driven by the tests (never imports jax).

Prints one JSON line per event on stdout: {"event": "ready", ...}, {"event": "round", ...}.
Inputs are deterministic from (seed, round) so the test can compute the expected mean.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np


def make_tree(seed: int, round_: int, size: int) -> dict:
    rng = np.random.default_rng([seed, round_])
    a = rng.standard_normal(size, dtype=np.float32)
    return {"w": a[: size // 2].reshape(-1), "b": {"x": a[size // 2 :], "s": np.float32(seed)}}


def _slow_swarm(send_delay: float, serve_delay: float):
    """A Swarm whose transport uploads parts slowly (``send_delay`` seconds per 256 KiB chunk)
    and delivers its reduced result parts late (``serve_delay`` seconds): a slow link, a slow
    part owner."""
    import asyncio

    from ravnest_jax.swarm import Swarm
    from ravnest_jax.swarm.peer._transport import Transport, as_buffers

    class SlowTransport(Transport):
        async def body_chunks(self, data, kind):
            if kind == "result":
                await asyncio.sleep(serve_delay)
            if kind == "result" or not send_delay:
                async for c in super().body_chunks(data, kind):
                    yield c
                return
            step = 256 * 1024
            for mv in as_buffers(data):  # a message: a list of buffers
                for off in range(0, len(mv), step):
                    await asyncio.sleep(send_delay)
                    yield mv[off : off + step]

    class SlowSwarm(Swarm):
        transport_class = SlowTransport

    return SlowSwarm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--run-id", default="test")
    p.add_argument("--token", required=True)
    p.add_argument("--peer-id", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--weight", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--size", type=int, default=1000)
    p.add_argument("--codec", default="fp32")
    p.add_argument("--part-timeout", type=float, default=3.0)
    p.add_argument("--round-timeout", type=float, default=30.0)
    p.add_argument("--send-delay", type=float, default=0.0)
    p.add_argument("--sleep-before-round", type=str, default="", help="ROUND:SECONDS straggle before that round")
    p.add_argument("--start-delay", type=float, default=0.0)
    p.add_argument("--expect-peers", type=int, default=0)
    p.add_argument("--round-sleep", type=float, default=0.0)
    p.add_argument("--out-dir", default="")
    p.add_argument("--serve-delay", type=float, default=0.0)
    p.add_argument("--advertise", default=None)
    p.add_argument("--listen", default="127.0.0.1:0", help="'none': client-only")
    p.add_argument("--algorithm", default="butterfly")
    p.add_argument("--ring-segment-bytes", type=int, default=1 << 20)
    p.add_argument("--serve-state", action="store_true", help="after the rounds, serve a state blob")
    p.add_argument(
        "--fetch-state", default="", help="after the rounds, once this file exists, download the state as a joiner"
    )
    p.add_argument("--hold-until", default="", help="after the rounds, stay in the swarm until this file exists")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the fixture dumps hung peers

    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    from ravnest_jax.swarm import AllReduce, RoundFailed, Swarm, Timeouts

    class _Events(logging.Handler):
        """The swarm's debug records that tests wait on, as events on stdout."""

        def emit(self, record: logging.LogRecord) -> None:
            name = getattr(record, "rj_event", None)
            if name:
                print(
                    json.dumps(
                        {
                            "event": name,
                            "round": record.rj_round,
                            "attempt": record.rj_attempt,
                            "decision": getattr(record, "rj_decision", None),
                        }
                    ),
                    flush=True,
                )

    swarm_log = logging.getLogger("ravnest_jax.swarm")
    swarm_log.setLevel(logging.DEBUG)
    swarm_log.addHandler(_Events(level=logging.DEBUG))
    for h in logging.getLogger().handlers:
        h.setLevel(logging.INFO)  # the stderr log stays at INFO

    t = Timeouts(connect=2.0, part=args.part_timeout, grace=0.5, round=args.round_timeout, heartbeat=0.5, eviction=3.0)
    straggle = {}
    if args.sleep_before_round:
        r, s = args.sleep_before_round.split(":")
        straggle[int(r)] = float(s)
    time.sleep(args.start_delay)
    swarm_class = Swarm
    if args.send_delay or args.serve_delay:
        swarm_class = _slow_swarm(args.send_delay, args.serve_delay)
    with swarm_class(
        args.url,
        run_id=args.run_id,
        token=args.token,
        codec=args.codec,
        listen=args.listen,
        timeouts=t,
        peer_id=args.peer_id,
        advertise=args.advertise,
        algorithm=AllReduce(
            args.algorithm, segment_bytes=args.ring_segment_bytes if args.algorithm == "ring" else None
        ),
    ) as sw:
        print(
            json.dumps(
                {
                    "event": "ready",
                    "port": sw.port,
                    "pid": os.getpid(),
                    "address": sw.address,
                    "client_only": sw.client_only,
                }
            ),
            flush=True,
        )
        if args.expect_peers:
            sw.wait_for_peers(args.expect_peers, timeout=60)
            print(json.dumps({"event": "peers"}), flush=True)
        for i in range(args.rounds):
            if i in straggle:
                time.sleep(straggle[i])
            if i and args.round_sleep:
                time.sleep(args.round_sleep)
            tree = make_tree(args.seed, i, args.size)
            try:
                out, rec = sw.all_reduce(tree, weight=args.weight)
                vec = np.concatenate([out["b"]["s"].reshape(1), out["b"]["x"], out["w"]])
                rfile = ""
                if args.out_dir:
                    rfile = os.path.join(args.out_dir, f"{args.peer_id}-{i}.npy")
                    np.save(rfile, vec)
                print(
                    json.dumps(
                        {
                            "event": "round",
                            "i": i,
                            "ok": True,
                            "round": rec.round,
                            "contributors": list(rec.contributors),
                            "digest": rec.digest,
                            "attempts": rec.attempts,
                            "algorithm": rec.algorithm,
                            "total_weight": rec.total_weight,
                            "seconds": rec.seconds,
                            "result_file": rfile,
                            "result": vec.tolist() if not rfile else None,
                        }
                    ),
                    flush=True,
                )
            except RoundFailed as e:
                print(
                    json.dumps(
                        {"event": "round", "i": i, "ok": False, "round": e.record.round, "error": e.record.error}
                    ),
                    flush=True,
                )
        if args.serve_state:
            sw.serve_state(lambda: f"state-of-{args.peer_id};".encode() * 1000)
        if args.fetch_state:
            end = time.monotonic() + 60  # the test writes the file once the servers said they serve
            while not os.path.exists(args.fetch_state) and time.monotonic() < end:
                time.sleep(0.05)
            data = sw.fetch_state(timeout=30)
            print(json.dumps({"event": "state", "bytes": len(data), "head": data[:16].decode()}), flush=True)
        if args.hold_until:
            print(json.dumps({"event": "holding"}), flush=True)
            end = time.monotonic() + 60
            while not os.path.exists(args.hold_until) and time.monotonic() < end:
                time.sleep(0.05)
    print(json.dumps({"event": "done"}), flush=True)


if __name__ == "__main__":
    main()
