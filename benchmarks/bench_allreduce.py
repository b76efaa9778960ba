"""All-reduce benchmark: N real peer processes on 127.0.0.1, against raw TCP of the same bytes.

    python benchmarks/bench_allreduce.py            # N in {2,4,8}, payload in {16,64} MB
    python benchmarks/bench_allreduce.py --full     # also 256 MB
    python benchmarks/bench_allreduce.py --rss-rounds 200   # memory check length

For each (N, payload): one rendezvous and N peer processes, each averaging a float32 vector of
``payload`` bytes with ``Swarm.all_reduce`` (codec fp32). Reported per config: median round time
(s), goodput = payload bytes / round time (MB/s), and the same payload sent once over a raw TCP
socket between two processes, measured in the same run (the physical limit of this machine).
A second part runs ``--rss-rounds`` rounds and records every peer's RSS after each round.

Writes ``benchmarks/results/allreduce.json`` and ``allreduce.png``. All processes share this
machine's cores: with N peers on C cores the numbers measure CPU contention as much as the
protocol (see the ``machine`` field).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TOKEN = "bench-token"
MB = 1_000_000


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------- child modes
def worker(args: argparse.Namespace) -> None:
    from ravnest_jax.swarm import Swarm, Timeouts

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    n = args.payload // 4
    rng = np.random.default_rng(args.seed)
    x = {"g": rng.standard_normal(n, dtype=np.float32)}
    t = Timeouts(connect=5, part=300, grace=2, round=900, heartbeat=2, eviction=30)
    with Swarm(args.url, run_id=args.run_id, token=TOKEN, listen="127.0.0.1:0", timeouts=t,
               peer_id=args.peer_id, codec=args.codec, algorithm=args.algorithm) as sw:
        sw.wait_for_peers(args.peers, timeout=120)
        for i in range(args.rounds):
            out, rec = sw.all_reduce(x, weight=1.0)
            del out
            print(json.dumps({"i": i, "ok": rec.ok, "seconds": rec.seconds,
                              "sent": rec.bytes_sent, "received": rec.bytes_received,
                              "contributors": len(rec.contributors), "digest": rec.digest,
                              "rss": rss_bytes()}), flush=True)


def tcp_receiver(args: argparse.Namespace) -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        print(srv.getsockname()[1], flush=True)
        conn, _ = srv.accept()
        with conn:
            buf = bytearray(1 << 20)
            left = args.payload
            while left:
                k = conn.recv_into(buf, min(len(buf), left))
                if not k:
                    raise SystemExit("short read")
                left -= k
            conn.sendall(b"k")


def tcp_sender(args: argparse.Namespace) -> None:
    data = np.random.default_rng(0).integers(0, 255, args.payload, dtype=np.uint8).tobytes()
    with socket.create_connection(("127.0.0.1", args.port)) as s:
        t0 = time.perf_counter()
        s.sendall(data)
        assert s.recv(1) == b"k"
        print(time.perf_counter() - t0, flush=True)


# ----------------------------------------------------------------------------- emulated WAN
def wan_rounds(mbit: float, rtt_ms: float, params: int, rounds: int, codec: str = "int4",
               algorithm: str = "butterfly", peers: int = 2) -> dict:
    """``peers`` Swarm objects (threads of this process) whose every byte, to each other and to
    the rendezvous, crosses the throttling TCP proxy of ``benchmarks/_common.py``: each peer's
    inbound traffic is its own line of ``mbit`` Mbit/s and ``rtt_ms / 2`` one-way delay, and so
    is its outbound traffic; the rendezvous has its own pair of lines. Returns the round times."""
    import threading

    sys.path.insert(0, str(HERE))
    from _common import LinkEmulator, free_port, rendezvous_thread

    from ravnest_jax.swarm import Swarm, Timeouts

    ports = [free_port() for _ in range(peers)]
    rv_port = free_port()
    # line 2i: into peer i, line 2i+1: out of peer i's server; last two: the rendezvous
    routes = [(ports[i], 2 * i, 2 * i + 1) for i in range(peers)]
    routes.append((rv_port, 2 * peers, 2 * peers + 1))
    emu = LinkEmulator(routes, n_lines=2 * peers + 2)
    emu.set_all(mbit, rtt_ms)
    t = Timeouts(connect=10, part=60, grace=1, round=300, heartbeat=1, eviction=20)
    rng = np.random.default_rng(0)
    xs = [{"g": rng.standard_normal(params, dtype=np.float32) * 1e-3} for _ in range(peers)]
    times: list[list[float]] = [[] for _ in range(peers)]
    digests: list[list[str]] = [[] for _ in range(peers)]
    errors: list[BaseException] = []
    try:
        with rendezvous_thread(TOKEN, port=rv_port, heartbeat=1, eviction=20):
            url = f"http://127.0.0.1:{emu.ports[-1]}"
            swarms = [Swarm(url, run_id="wan", token=TOKEN, codec=codec, algorithm=algorithm,
                            listen=f"127.0.0.1:{ports[i]}", peer_id=f"p{i:02d}", timeouts=t,
                            advertise=f"http://127.0.0.1:{emu.ports[i]}") for i in range(peers)]
            try:
                for s in swarms:
                    s.start()
                swarms[0].wait_for_peers(peers, timeout=60)
                barrier = threading.Barrier(peers)

                def run(i: int) -> None:
                    try:
                        for _ in range(rounds + 1):
                            barrier.wait(timeout=600)
                            _, rec = swarms[i].all_reduce(xs[i])
                            times[i].append(rec.seconds)
                            digests[i].append(rec.digest)
                    except BaseException as e:  # noqa: BLE001
                        errors.append(e)
                        barrier.abort()

                th = [threading.Thread(target=run, args=(i,)) for i in range(peers)]
                for x in th:
                    x.start()
                for x in th:
                    x.join(timeout=1800)
            finally:
                for s in swarms:
                    s.close()
    finally:
        emu.close()
    if errors:
        raise errors[0]
    per_round = [max(t_[i] for t_ in times) for i in range(1, rounds + 1)]  # skip the warm-up
    return {"peers": peers, "mbit": mbit, "rtt_ms": rtt_ms, "params": params, "codec": codec,
            "algorithm": algorithm, "round_s": statistics.median(per_round),
            "round_s_all": per_round, "round_s_over_rtt": statistics.median(per_round) / (rtt_ms / 1e3) if rtt_ms else None,
            "digests_equal": all(len({d[i] for d in digests}) == 1 for i in range(rounds + 1))}


# ----------------------------------------------------------------------------- driver
def run_child(mode: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, "--mode", mode, *extra],
                            stdout=subprocess.PIPE, text=True)


def raw_tcp(payload: int, repeats: int = 3) -> float:
    """Best of ``repeats`` one-way transfers of ``payload`` bytes between two processes (s)."""
    times = []
    for _ in range(repeats):
        rx = run_child("tcp-rx", "--payload", str(payload))
        try:
            port = rx.stdout.readline().strip()  # type: ignore[union-attr]
            tx = run_child("tcp-tx", "--payload", str(payload), "--port", port)
            out, _ = tx.communicate(timeout=600)
            times.append(float(out.strip()))
            rx.wait(timeout=60)
        finally:
            for p in (rx,):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return min(times)


def start_rendezvous(tmp: Path) -> tuple[subprocess.Popen[str], str]:
    import tempfile

    pf = Path(tempfile.mkdtemp(prefix="ravnest-bench-")) / "rv.port"
    env = {**os.environ, "RAVNEST_TOKEN": TOKEN}
    rv = subprocess.Popen([sys.executable, "-m", "ravnest_jax.cli", "rendezvous", "--host",
                           "127.0.0.1", "--port", "0", "--port-file", str(pf), "--quiet",
                           "--heartbeat", "2", "--eviction", "30"], env=env, text=True)
    deadline = time.monotonic() + 30
    while not pf.exists():
        if time.monotonic() > deadline or rv.poll() is not None:
            raise RuntimeError("rendezvous did not start")
        time.sleep(0.05)
    return rv, f"http://127.0.0.1:{pf.read_text()}"


def swarm_run(n: int, payload: int, rounds: int, codec: str, tmp: Path,
              algorithm: str = "butterfly") -> list[list[dict]]:
    rv, url = start_rendezvous(tmp)
    procs = []
    try:
        for i in range(n):
            procs.append(run_child("worker", "--url", url, "--run-id", f"b{n}-{payload}",
                                   "--peer-id", f"p{i:02d}", "--seed", str(i), "--peers",
                                   str(n), "--payload", str(payload), "--rounds", str(rounds),
                                   "--codec", codec, "--algorithm", algorithm))
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise RuntimeError(f"peer exited with {p.returncode}")
            results.append([json.loads(line) for line in out.splitlines() if line.strip()])
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        rv.send_signal(signal.SIGTERM)
        rv.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="driver", choices=["driver", "worker", "tcp-rx", "tcp-tx"])
    ap.add_argument("--full", action="store_true", help="also 256 MB payloads")
    ap.add_argument("--peers-list", default="2,4,8")
    ap.add_argument("--payloads-mb", default="")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per config (first is warm-up)")
    ap.add_argument("--rss-rounds", type=int, default=200)
    ap.add_argument("--rss-payload-mb", type=int, default=16)
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--algorithms", default="butterfly,ring")
    ap.add_argument("--algorithm", default="butterfly", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results"))
    # child arguments
    ap.add_argument("--url")
    ap.add_argument("--run-id")
    ap.add_argument("--peer-id")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--payload", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    if args.mode == "worker":
        return worker(args)
    if args.mode == "tcp-rx":
        return tcp_receiver(args)
    if args.mode == "tcp-tx":
        return tcp_sender(args)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payloads = ([int(x) for x in args.payloads_mb.split(",")] if args.payloads_mb
                else [16, 64] + ([256] if args.full else []))
    peers_list = [int(x) for x in args.peers_list.split(",")]
    table = []
    for mb in payloads:
        payload = mb * MB
        tcp_s = raw_tcp(payload)
        print(f"raw TCP {mb} MB: {tcp_s:.3f} s = {payload / tcp_s / MB:.0f} MB/s", flush=True)
        for n, algorithm in [(n, a) for a in args.algorithms.split(",") for n in peers_list]:
            res = swarm_run(n, payload, args.rounds, args.codec, out, algorithm)
            # a round's time = the slowest peer's; skip the warm-up round
            per_round = [max(r[i]["seconds"] for r in res) for i in range(1, args.rounds)]
            digests_equal = all(len({r[i]["digest"] for r in res}) == 1
                                for i in range(args.rounds))
            rs = statistics.median(per_round)
            row = {"algorithm": algorithm, "peers": n, "payload_mb": mb, "round_s": rs, "round_s_all": per_round,
                   "goodput_mbps": payload / rs / MB, "raw_tcp_s": tcp_s,
                   "raw_tcp_mbps": payload / tcp_s / MB,
                   "goodput_vs_raw_tcp": tcp_s / rs,
                   "bytes_sent_per_peer": res[0][-1]["sent"],
                   "bytes_received_per_peer": res[0][-1]["received"],
                   "digests_equal": digests_equal,
                   "all_ok": all(e["ok"] for r in res for e in r)}
            table.append(row)
            print(json.dumps(row), flush=True)
    for mb in payloads:
        for algorithm in args.algorithms.split(","):
            rows = {r["peers"]: r for r in table
                    if r["payload_mb"] == mb and r["algorithm"] == algorithm}
            for r in rows.values():
                r["round_s_vs_fewest_peers"] = r["round_s"] / rows[min(rows)]["round_s"]

    rss = None
    if args.rss_rounds:
        res = swarm_run(2, args.rss_payload_mb * MB, args.rss_rounds, args.codec, out)
        series = [[e["rss"] for e in r] for r in res]
        half = len(series[0]) // 2
        rss = {"peers": 2, "payload_mb": args.rss_payload_mb, "rounds": args.rss_rounds,
               "rss_bytes_per_round": series,
               "rss_max_mb_rounds_10_to_half": [max(s[min(10, half // 2):half]) / MB
                                                for s in series],
               "rss_max_mb_second_half": [max(s[half:]) / MB for s in series],
               "rss_last_mb": [s[-1] / MB for s in series]}
        print("RSS max MB, rounds 10..half:", rss["rss_max_mb_rounds_10_to_half"],
              "second half:", rss["rss_max_mb_second_half"], flush=True)

    result = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(),
                    "note": "all peers, the rendezvous and the TCP baseline share this one "
                            "machine over loopback; with more peers than cores the round time "
                            "measures CPU contention (copy, hashing, encode) as much as the "
                            "protocol. Not a measurement of a real network."},
        "codec": args.codec,
        "definitions": {"round_s": "median over rounds (after one warm-up) of the slowest "
                                   "peer's all_reduce wall time",
                        "goodput_mbps": "payload bytes / round_s / 1e6",
                        "raw_tcp_mbps": "payload bytes / best one-way transfer time of the "
                                        "same bytes between two processes over loopback TCP"},
        "table": table, "rss": rss,
    }
    (out / "allreduce.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "allreduce.png")
    print(f"wrote {out / 'allreduce.json'} and {out / 'allreduce.png'}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    table = result["table"]
    styles = {"butterfly": "o-", "ring": "s:"}
    for mb in sorted({r["payload_mb"] for r in table}):
        color = None
        for algorithm in sorted({r["algorithm"] for r in table}):
            rows = sorted((r for r in table if r["payload_mb"] == mb
                           and r["algorithm"] == algorithm), key=lambda r: r["peers"])
            ns = [r["peers"] for r in rows]
            line, = axes[0].plot(ns, [r["round_s"] for r in rows], styles.get(algorithm, "o-"),
                                 color=color, label=f"{algorithm} {mb} MB")
            color = line.get_color()
            axes[1].plot(ns, [r["goodput_mbps"] for r in rows], styles.get(algorithm, "o-"),
                         color=color, label=f"{algorithm} {mb} MB")
        axes[1].axhline(rows[0]["raw_tcp_mbps"], color=color, ls="--",
                        label=f"raw TCP {mb} MB")
    axes[1].set_yscale("log")
    axes[0].set(xlabel="peers", ylabel="round time (s)", title="round time", xticks=[2, 4, 8])
    axes[1].set(xlabel="peers", ylabel="MB/s (log)", title="goodput (payload / round time)",
                xticks=[2, 4, 8])
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    if result.get("rss"):
        for i, s in enumerate(result["rss"]["rss_bytes_per_round"]):
            axes[2].plot(np.asarray(s) / MB, label=f"peer {i}")
        axes[2].set(xlabel="round", ylabel="RSS (MB)",
                    title=f"RSS, 2 peers, {result['rss']['payload_mb']} MB payload")
        axes[2].legend()
    fig.suptitle(f"ravnest_jax swarm all-reduce ({result['codec']}), "
                 f"{result['machine']['cpus']} CPUs, loopback, all processes on one machine",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
