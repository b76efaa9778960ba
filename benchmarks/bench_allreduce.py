"""All-reduce benchmark: N real peer processes on 127.0.0.1, against raw TCP of the same bytes.

    python benchmarks/bench_allreduce.py            # N in {2,4,8}, payload in {16,64} MB
    python benchmarks/bench_allreduce.py --full     # also 256 MB
    python benchmarks/bench_allreduce.py --rss-rounds 200   # memory check length
    python benchmarks/bench_allreduce.py --wan-rounds 0     # skip the emulated-link runs

For each (N, payload): one rendezvous and N peer processes, each averaging a float32 vector of
``payload`` bytes with ``Swarm.all_reduce`` (codec fp32). Reported per config: median round time
(s), goodput = payload bytes / round time (MB/s, "algorithm bandwidth"), bus goodput = payload
* 2(n-1)/n / round time (the bytes each peer must receive at least, NCCL's "bus bandwidth"), and
the same payload sent once over a raw TCP socket between two processes, measured in the same run
(the physical limit of this machine). The emulated-link part also sends the payload once through
the same throttling proxy line (same rate and RTT) and reports bus goodput / that raw rate.
A second part runs ``--rss-rounds`` rounds and records every peer's RSS after each round.

Writes ``benchmarks/results/allreduce.json`` and ``allreduce.png``. All processes share this
machine's cores: with N peers on C cores the numbers measure CPU contention as much as the
protocol (see the ``machine`` field).
"""

from __future__ import annotations

import argparse
import gc
import inspect
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
AGGREGATOR: str | None = None
RING_SEGMENT = 0  # --ring-segment-bytes, handed to every worker (0: the library's default)


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (``VmRSS``) or its peak since the last reset (``VmHWM``), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> None:
    """Sets the peak resident set (``VmHWM``) to the current one (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


# ----------------------------------------------------------------------------- child modes
def worker(args: argparse.Namespace) -> None:
    from ravnest_jax.swarm import AllReduce, Swarm, Timeouts

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    n = args.payload // 4
    rng = np.random.default_rng(args.seed)
    x = {"g": rng.standard_normal(n, dtype=np.float32) * np.float32(args.scale)}
    t = Timeouts(connect=5, part=300, grace=2, round=900, heartbeat=2, eviction=30)
    with Swarm(
        args.url,
        run_id=args.run_id,
        token=TOKEN,
        listen=f"127.0.0.1:{args.port}",
        timeouts=t,
        peer_id=args.peer_id,
        codec=args.codec,
        algorithm=AllReduce(
            args.algorithm,
            segment_bytes=(args.ring_segment_bytes or None) if args.algorithm == "ring" else None,
            aggregator=args.aggregator if args.algorithm == "butterfly" else None,
        ),
        advertise=args.advertise,
    ) as sw:
        sw.wait_for_peers(args.peers, timeout=120)
        # the input is not modified during the round: used in place, not copied (a library
        # without the option copies it: A/B runs against older code)
        no_copy = {"copy": False} if "copy" in inspect.signature(sw.all_reduce).parameters else {}
        for i in range(args.rounds):
            gc.collect()
            reset_peak_rss()
            before = rss_bytes()
            c0 = time.process_time()
            out, rec = sw.all_reduce(x, weight=1.0, **no_copy)
            cpu = time.process_time() - c0  # every thread of this peer process
            peak = rss_bytes("VmHWM")  # the result still held: it counts, as it would for a caller
            del out
            print(
                json.dumps(
                    {
                        "i": i,
                        "ok": rec.ok,
                        "seconds": rec.seconds,
                        "cpu_s": cpu,
                        "sent": rec.bytes_sent,
                        "received": rec.bytes_received,
                        "contributors": len(rec.contributors),
                        "digest": rec.digest,
                        "rss": rss_bytes(),
                        "rss_before": before,
                        "rss_peak": peak,
                    }
                ),
                flush=True,
            )


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


# ----------------------------------------------------------------------------- emulated links
def gloo_worker(args: argparse.Namespace) -> None:
    """One rank of torch.distributed's gloo all-reduce of a float32 vector of ``--payload``
    bytes on 127.0.0.1; prints the seconds of every round (after a barrier) as JSON."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.seed,
        world_size=args.peers,
        timeout=timedelta(seconds=300),
    )
    x = torch.from_numpy(np.random.default_rng(args.seed).standard_normal(args.payload // 4, dtype=np.float32))
    times = []
    for _ in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    print(json.dumps(times), flush=True)
    dist.destroy_process_group()


def gloo_run(n: int, payload: int, rounds: int) -> float | None:
    """Median gloo round (the slowest rank's time, warm-up round skipped), or None without torch."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--mode",
                "gloo",
                "--port",
                str(port),
                "--seed",
                str(i),
                "--peers",
                str(n),
                "--payload",
                str(payload),
                "--rounds",
                str(rounds),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for i in range(n)
    ]
    try:
        per_rank = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return statistics.median(max(r[i] for r in per_rank) for i in range(1, rounds))


def summarize(res: list[list[dict]], rounds: int) -> dict:
    """Round time = the slowest peer's, median over the rounds after the warm-up; CPU seconds =
    each peer process's CPU time (all threads) in ``all_reduce``, mean over peers."""
    per_round = [max(r[i]["seconds"] for r in res) for i in range(1, rounds)]
    cpu = [statistics.mean(r[i]["cpu_s"] for r in res) for i in range(1, rounds)]
    return {
        "round_s": statistics.median(per_round),
        "round_s_all": per_round,
        "cpu_s_per_peer": statistics.median(cpu),
        "digests_equal": all(len({r[i]["digest"] for r in res}) == 1 for i in range(rounds)),
        "all_ok": all(e["ok"] for r in res for e in r),
        "contributors_min": min(e["contributors"] for r in res for e in r),
        # host memory a round takes beyond what the peer held before it (its input included):
        # the peak resident set during the round minus the one before, the result still held;
        # the largest of the peers, median over the rounds after the warm-up, in bytes
        "extra_rss_bytes": statistics.median(
            max(r[i]["rss_peak"] - r[i]["rss_before"] for r in res) for i in range(1, rounds)
        )
        if "rss_peak" in res[0][0]
        else None,
    }


# ----------------------------------------------------------------------------- driver
def run_child(mode: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, "--mode", mode, *extra], stdout=subprocess.PIPE, text=True)


def raw_tcp(payload: int, repeats: int = 3, link: tuple[float, float] | None = None) -> float:
    """Best of ``repeats`` one-way transfers of ``payload`` bytes between two processes (s),
    from the sender's first byte to the receiver's 1-byte acknowledgement. With ``link=(mbit,
    rtt_ms)`` the connection crosses a throttling proxy of :func:`swarm_run`'s kind (the same
    ``LinkEmulator``, one line each way, both set to that rate and RTT)."""
    times = []
    for _ in range(repeats):
        rx = run_child("tcp-rx", "--payload", str(payload))
        emu = None
        try:
            port = rx.stdout.readline().strip()  # type: ignore[union-attr]
            if link is not None:
                sys.path.insert(0, str(HERE))
                from _common import LinkEmulator

                emu = LinkEmulator([(int(port), 0, 1)], n_lines=2)
                emu.set_all(*link)
                port = str(emu.ports[0])
            tx = run_child("tcp-tx", "--payload", str(payload), "--port", port)
            out, _ = tx.communicate(timeout=600)
            times.append(float(out.strip()))
            rx.wait(timeout=60)
        finally:
            for p in (rx,):
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if emu is not None:
                emu.close()
    return min(times)


def bus_factor(n: int) -> float:
    """Bytes each peer must receive (and send) at least in an all-reduce, per payload byte."""
    return 2 * (n - 1) / n


def start_rendezvous(tmp: Path) -> tuple[subprocess.Popen[str], str]:
    import tempfile

    pf = Path(tempfile.mkdtemp(prefix="rv-", dir=tmp)) / "rv.port"  # inside the caller's temp dir: removed with it
    env = {**os.environ, "RAVNEST_TOKEN": TOKEN}
    rv = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ravnest_jax.cli",
            "rendezvous",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(pf),
            "--quiet",
            "--heartbeat",
            "2",
            "--eviction",
            "30",
        ],
        env=env,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not pf.exists():
        if time.monotonic() > deadline or rv.poll() is not None:
            raise RuntimeError("rendezvous did not start")
        time.sleep(0.05)
    return rv, f"http://127.0.0.1:{pf.read_text()}"


def swarm_run(
    n: int,
    payload: int,
    rounds: int,
    codec: str,
    tmp: Path,
    algorithm: str = "butterfly",
    link: tuple[float, float] | None = None,
    scale: float = 1.0,
) -> list[list[dict]]:
    """N worker processes and a rendezvous; with ``link=(mbit, rtt_ms)`` every peer's inbound
    traffic and the rendezvous' crosses the throttling proxy (see :func:`emulated_links`)."""
    rv, url = start_rendezvous(tmp)
    procs = []
    emu = None
    try:
        ports = [0] * n
        advertise = [None] * n
        if link is not None:
            sys.path.insert(0, str(HERE))
            from _common import LinkEmulator, free_port

            ports = [free_port() for _ in range(n)]
            rv_port = int(url.rsplit(":", 1)[1])
            # line 2i: into peer i; 2i+1: its answers; the last two: to/from the rendezvous
            routes = [(ports[i], 2 * i, 2 * i + 1) for i in range(n)]
            routes.append((rv_port, 2 * n, 2 * n + 1))
            emu = LinkEmulator(routes, n_lines=2 * n + 2)
            emu.set_all(*link)
            advertise = [f"http://127.0.0.1:{emu.ports[i]}" for i in range(n)]
            url = f"http://127.0.0.1:{emu.ports[-1]}"
        for i in range(n):
            procs.append(
                run_child(
                    "worker",
                    "--url",
                    url,
                    "--run-id",
                    f"b{n}-{payload}",
                    "--peer-id",
                    f"p{i:02d}",
                    "--seed",
                    str(i),
                    "--peers",
                    str(n),
                    "--payload",
                    str(payload),
                    "--rounds",
                    str(rounds),
                    "--codec",
                    codec,
                    "--algorithm",
                    algorithm,
                    "--ring-segment-bytes",
                    str(RING_SEGMENT),
                    "--port",
                    str(ports[i]),
                    "--scale",
                    str(scale),
                    *(["--aggregator", AGGREGATOR] if AGGREGATOR else []),
                    *(["--advertise", advertise[i]] if advertise[i] else []),
                )
            )
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
        if emu is not None:
            emu.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="driver", choices=["driver", "worker", "tcp-rx", "tcp-tx", "gloo"])
    ap.add_argument(
        "--gloo",
        action="store_true",
        help="also run torch.distributed's gloo all-reduce of the same payloads side by side "
        "(needs torch: pip install -e '.[bench]')",
    )
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
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from the JSON")
    ap.add_argument(
        "--aggregator", default=None, help="AllReduce(aggregator=...) of the butterfly runs (default: its default)"
    )
    # child arguments
    ap.add_argument("--url")
    ap.add_argument("--run-id")
    ap.add_argument("--peer-id")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--payload", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--advertise", default=None)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument(
        "--wan-rounds", type=int, default=6, help="rounds (after a warm-up) of each emulated-link measurement; 0: skip"
    )
    ap.add_argument(
        "--link-mbit", type=float, default=100.0, help="per-peer inbound rate of the emulated-link scaling runs"
    )
    ap.add_argument("--link-payload-mb", type=int, default=8)
    ap.add_argument(
        "--ring-segment-bytes",
        type=int,
        default=0,
        help="AllReduce('ring', segment_bytes=...) of the ring runs (0: the default)",
    )
    args = ap.parse_args()
    global RING_SEGMENT, AGGREGATOR
    RING_SEGMENT = args.ring_segment_bytes
    AGGREGATOR = args.aggregator
    if args.mode == "worker":
        return worker(args)
    if args.mode == "tcp-rx":
        return tcp_receiver(args)
    if args.mode == "tcp-tx":
        return tcp_sender(args)
    if args.mode == "gloo":
        return gloo_worker(args)

    from ravnest_jax.swarm import AllReduce

    RING_SEGMENT_BYTES = AllReduce("ring").segment_bytes

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        return plot(json.loads((out / "allreduce.json").read_text()), out / "allreduce.png")
    payloads = (
        [int(x) for x in args.payloads_mb.split(",") if int(x)]
        if args.payloads_mb
        else [16, 64] + ([256] if args.full else [])
    )  # "0": no loopback runs
    peers_list = [int(x) for x in args.peers_list.split(",")]
    table = []
    gloo: dict[str, float | None] | None = None
    if args.gloo:
        gloo = {}
        for mb in payloads:
            for n in peers_list:
                gloo[f"{n}x{mb}"] = g = gloo_run(n, mb * MB, args.rounds)
                print(
                    f"gloo N={n} {mb} MB: "
                    + (f"{g:.3f} s" if g is not None else "torch is not installed (pip install -e '.[bench]')"),
                    flush=True,
                )
    for mb in payloads:
        payload = mb * MB
        tcp_s = raw_tcp(payload)
        print(f"raw TCP {mb} MB: {tcp_s:.3f} s = {payload / tcp_s / MB:.0f} MB/s", flush=True)
        for n, algorithm in [(n, a) for a in args.algorithms.split(",") for n in peers_list]:
            load0 = os.getloadavg()
            res = swarm_run(n, payload, args.rounds, args.codec, out, algorithm)
            # a round's time = the slowest peer's; skip the warm-up round
            sm = summarize(res, args.rounds)
            rs = sm["round_s"]
            row = {
                "algorithm": algorithm,
                "peers": n,
                "payload_mb": mb,
                **sm,
                "goodput_mbps": payload / rs / MB,
                "bus_goodput_mbps": payload * bus_factor(n) / rs / MB,
                "raw_tcp_s": tcp_s,
                "raw_tcp_mbps": payload / tcp_s / MB,
                "goodput_vs_raw_tcp": tcp_s / rs,
                "bus_goodput_vs_raw_tcp": bus_factor(n) * tcp_s / rs,
                "extra_rss_x_payload": sm["extra_rss_bytes"] / payload if sm["extra_rss_bytes"] is not None else None,
                "bytes_sent_per_peer": res[0][-1]["sent"],
                "bytes_received_per_peer": res[0][-1]["received"],
                "loadavg_before_after": [load0[0], os.getloadavg()[0]],
            }
            if gloo is not None and gloo.get(f"{n}x{mb}") is not None:
                row["gloo_round_s"] = gloo[f"{n}x{mb}"]
                row["round_s_vs_gloo"] = rs / gloo[f"{n}x{mb}"]
            table.append(row)
            print(json.dumps(row), flush=True)
    for mb in payloads:
        for algorithm in args.algorithms.split(","):
            rows = {r["peers"]: r for r in table if r["payload_mb"] == mb and r["algorithm"] == algorithm}
            for r in rows.values():
                r["round_s_vs_fewest_peers"] = r["round_s"] / rows[min(rows)]["round_s"]

    wan = links = None
    if args.wan_rounds:
        # issue #5's operating point: 2 peers, 100 Mbit/s, 100 ms RTT, the int4 pseudo-gradient
        # of the 0.86M-parameter char-LM of bench_utilization (random values of its scale)
        wan = []
        for algorithm in args.algorithms.split(","):
            load0 = os.getloadavg()
            res = swarm_run(
                2, 4 * 860_000, args.wan_rounds + 1, "int4", out, algorithm, link=(100.0, 100.0), scale=1e-3
            )
            row = {
                "algorithm": algorithm,
                "peers": 2,
                "mbit": 100.0,
                "rtt_ms": 100.0,
                "params": 860_000,
                "codec": "int4",
                **summarize(res, args.wan_rounds + 1),
                "loadavg_before_after": [load0[0], os.getloadavg()[0]],
            }
            row["round_s_over_rtt"] = row["round_s"] / 0.1
            wan.append(row)
            print(json.dumps(row), flush=True)
        # per-peer emulated links (inbound rate limited, no delay): is the round time at fixed
        # payload flat in N, as it would be with one peer per machine?
        links = []
        payload = args.link_payload_mb * MB
        link_tcp_s = raw_tcp(payload, link=(args.link_mbit, 0.0))
        print(
            f"raw TCP over the emulated link {args.link_payload_mb} MB: {link_tcp_s:.3f} s = "
            f"{payload / link_tcp_s / MB:.2f} MB/s",
            flush=True,
        )
        for algorithm in args.algorithms.split(","):
            for n in peers_list:
                load0 = os.getloadavg()
                res = swarm_run(n, payload, args.wan_rounds + 1, "fp32", out, algorithm, link=(args.link_mbit, 0.0))
                sm = summarize(res, args.wan_rounds + 1)
                # a bandwidth-optimal all-reduce moves 2 (n - 1) / n of the payload into each
                # peer: the lower bound of the round time over links of this rate
                ideal = 2 * (n - 1) / n * payload * 8 / (args.link_mbit * 1e6)
                rs = sm["round_s"]
                row = {
                    "algorithm": algorithm,
                    "peers": n,
                    "payload_mb": args.link_payload_mb,
                    "mbit_per_peer": args.link_mbit,
                    **sm,
                    "bandwidth_bound_s": ideal,
                    "round_s_vs_bound": rs / ideal,
                    "goodput_mbps": payload / rs / MB,
                    "bus_goodput_mbps": payload * bus_factor(n) / rs / MB,
                    "raw_over_link_s": link_tcp_s,
                    "raw_over_link_mbps": payload / link_tcp_s / MB,
                    "bus_goodput_vs_raw_over_link": bus_factor(n) * link_tcp_s / rs,
                    "loadavg_before_after": [load0[0], os.getloadavg()[0]],
                }
                links.append(row)
                print(json.dumps(row), flush=True)
        for algorithm in args.algorithms.split(","):
            rows = {r["peers"]: r for r in links if r["algorithm"] == algorithm}
            for r in rows.values():
                r["round_s_vs_fewest_peers"] = r["round_s"] / rows[min(rows)]["round_s"]

    rss = None
    if args.rss_rounds:
        res = swarm_run(2, args.rss_payload_mb * MB, args.rss_rounds, args.codec, out)
        series = [[e["rss"] for e in r] for r in res]
        half = len(series[0]) // 2
        rss = {
            "peers": 2,
            "payload_mb": args.rss_payload_mb,
            "rounds": args.rss_rounds,
            "rss_bytes_per_round": series,
            "rss_max_mb_rounds_10_to_half": [max(s[min(10, half // 2) : half]) / MB for s in series],
            "rss_max_mb_second_half": [max(s[half:]) / MB for s in series],
            "rss_last_mb": [s[-1] / MB for s in series],
        }
        print(
            "RSS max MB, rounds 10..half:",
            rss["rss_max_mb_rounds_10_to_half"],
            "second half:",
            rss["rss_max_mb_second_half"],
            flush=True,
        )

    result = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "loadavg_at_end": os.getloadavg(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "note": "all peers, the rendezvous and the TCP baseline share this one "
            "machine over loopback; with more peers than cores the round time "
            "measures CPU contention (copy, hashing, encode) as much as the "
            "protocol. Not a measurement of a real network.",
        },
        "codec": args.codec,
        "aggregator": args.aggregator or "the default (clipped_mean with the butterfly)",
        "definitions": {
            "round_s": "median over rounds (after one warm-up) of the slowest peer's all_reduce wall time",
            "goodput_mbps": "algorithm bandwidth: payload bytes / round_s / 1e6",
            "bus_goodput_mbps": "bus bandwidth (NCCL's busbw): payload bytes * "
            "2 (n - 1) / n / round_s / 1e6, the bytes each peer "
            "must receive at least in an all-reduce of n peers "
            "per second; comparable with a link's raw rate",
            "raw_tcp_mbps": "payload bytes / best of 3 one-way transfers of the "
            "same bytes between two processes over loopback TCP "
            "(first byte sent to a 1-byte acknowledgement)",
            "goodput_vs_raw_tcp": "goodput_mbps / raw_tcp_mbps",
            "gloo_round_s": "--gloo: median over rounds (after one warm-up) of the slowest rank's "
            "torch.distributed gloo all_reduce of the same float32 payload, after a barrier, same run",
            "round_s_vs_gloo": "round_s / gloo_round_s (<= 1: the swarm is no slower than gloo)",
            "bus_goodput_vs_raw_tcp": "bus_goodput_mbps / raw_tcp_mbps",
            "raw_over_link_mbps": "emulated links: payload bytes / best of 3 "
            "one-way transfers of the same bytes between two "
            "processes through the same throttling proxy "
            "(LinkEmulator, same rate and RTT as a peer's "
            "line), measured in the same run: the physical "
            "limit of one link",
            "bus_goodput_vs_raw_over_link": "bus_goodput_mbps / raw_over_link_mbps "
            "(1.0 = every peer's inbound link "
            "busy with useful bytes all round)",
        },
        "ring_segment_bytes": args.ring_segment_bytes or RING_SEGMENT_BYTES,
        "table": table,
        "gloo": gloo,
        "rss": rss,
        "emulated_wan": wan,
        "emulated_links": links,
        "emulated_note": "through the throttling TCP proxy of benchmarks/_common.py (its own "
        "process): each peer's inbound traffic (every request body crosses "
        "the receiver's inbound line) and the rendezvous' have a rate and a "
        "one-way delay of RTT/2; uplinks are not limited; all processes still "
        "share this machine's cores",
    }
    (out / "allreduce.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "allreduce.png")
    print(f"wrote {out / 'allreduce.json'} and {out / 'allreduce.png'}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(21, 4.8))
    table = result["table"]
    styles = {"butterfly": "o-", "ring": "s:"}
    for mb in sorted({r["payload_mb"] for r in table}):
        color = None
        for algorithm in sorted({r["algorithm"] for r in table}):
            rows = sorted(
                (r for r in table if r["payload_mb"] == mb and r["algorithm"] == algorithm), key=lambda r: r["peers"]
            )
            ns = [r["peers"] for r in rows]
            (line,) = axes[0].plot(
                ns, [r["round_s"] for r in rows], styles.get(algorithm, "o-"), color=color, label=f"{algorithm} {mb} MB"
            )
            color = line.get_color()
            axes[1].plot(
                ns,
                [r["goodput_mbps"] for r in rows],
                styles.get(algorithm, "o-"),
                color=color,
                label=f"{algorithm} {mb} MB",
            )
            if all("bus_goodput_mbps" in r for r in rows):
                axes[1].plot(
                    ns,
                    [r["bus_goodput_mbps"] for r in rows],
                    styles.get(algorithm, "o-"),
                    color=color,
                    alpha=0.35,
                    label=f"{algorithm} {mb} MB bus",
                )
        axes[1].axhline(rows[0]["raw_tcp_mbps"], color=color, ls="--", label=f"raw TCP {mb} MB")
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[0].set(
        xlabel="peers",
        ylabel="round time (s, log)",
        title="loopback: round time (slowest peer, median)",
        xticks=[2, 4, 8],
    )
    axes[1].set(
        xlabel="peers",
        ylabel="MB/s (log)",
        title="loopback: goodput (payload / round time; faint: bus)",
        xticks=[2, 4, 8],
    )
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    links = result.get("emulated_links") or []
    for algorithm in sorted({r["algorithm"] for r in links}):
        rows = sorted((r for r in links if r["algorithm"] == algorithm), key=lambda r: r["peers"])
        (line,) = axes[2].plot(
            [r["peers"] for r in rows], [r["round_s"] for r in rows], styles.get(algorithm, "o-"), label=algorithm
        )
    if links:
        rows = sorted({r["peers"]: r for r in links}.values(), key=lambda r: r["peers"])
        axes[2].plot(
            [r["peers"] for r in rows],
            [r["bandwidth_bound_s"] for r in rows],
            "k--",
            label="bound 2(n-1)/n * payload / rate",
        )
        if all("raw_over_link_s" in r for r in rows):
            axes[2].plot(
                [r["peers"] for r in rows],
                [2 * (r["peers"] - 1) / r["peers"] * r["raw_over_link_s"] for r in rows],
                "k:",
                label="2(n-1)/n * raw TCP over the same link (measured)",
            )
        r0 = links[0]
        wan = result.get("emulated_wan") or []
        wtxt = "; ".join(f"{w['algorithm']} {w['round_s']:.3f} s" for w in wan)
        axes[2].set(
            xlabel="peers",
            ylabel="round time (s)",
            xticks=[2, 4, 8],
            ylim=(0, None),
            title=f"emulated per-peer links {r0['mbit_per_peer']:g} Mbit/s in, {r0['payload_mb']} MB fp32",
        )
        axes[2].legend(
            fontsize=7, title=f"2 peers 100 Mbit/s 100 ms int4 0.86M: {wtxt}", title_fontsize=7, loc="upper left"
        )
    if result.get("rss"):
        for i, s in enumerate(result["rss"]["rss_bytes_per_round"]):
            axes[3].plot(np.asarray(s) / MB, label=f"peer {i}")
        axes[3].set(
            xlabel="round",
            ylabel="RSS (MB)",
            ylim=(0, None),
            title=f"RSS, 2 peers, {result['rss']['payload_mb']} MB payload",
        )
        axes[3].legend()
    loads = [x for r in table + links for x in r.get("loadavg_before_after", [])]
    lt = f"load avg {min(loads):.0f}-{max(loads):.0f} during the runs" if loads else ""
    fig.suptitle(
        f"ravnest_jax swarm all-reduce ({result['codec']}): "
        f"{result['machine']['cpus']} CPUs shared by all peers and other jobs ({lt})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
