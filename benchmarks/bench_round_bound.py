"""Why a butterfly round on loopback is slower than gloo's: a lower bound from measured parts.

In one run, on this machine, for 2 peer processes and each payload: gloo's all-reduce round
(``torch.distributed``), the butterfly round (``rj.Swarm.all_reduce``, fp32), a round of a tiny
payload (the rounds' fixed cost: the rendezvous' begin and two votes), and the host primitives a
butterfly round cannot skip: BLAKE3 (every body is signed: hashed by its sender and by its
receiver) and the float32 add of the owner's sum.

The bound: at N = 2 a butterfly peer sends and receives the same bytes as a gloo rank (half the
vector each way in the reduce-scatter, half in the all-gather) and adds the same half; beyond
that it hashes every byte it sends and every byte it receives (2 x the payload), and it pays the
fixed cost of a round. With one core per peer (2 processes on 2 cores, both busy through the
round) nothing of that overlaps, so

    butterfly round >= gloo round + BLAKE3(2 x payload) + fixed round cost

assuming our socket and add work costs no less than gloo's (it is Python asyncio and numpy, gloo
is C++). Written to ``benchmarks/results/round_bound.json`` with the machine and the command.

    python benchmarks/bench_round_bound.py                       # 16, 64 and 1024 MB, ~1 min here
    python benchmarks/bench_round_bound.py --payloads-mb 16,64   # gloo needs torch: pip install -e ".[bench]"
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import machine_info  # noqa: E402
from bench_allreduce import gloo_run, summarize, swarm_run  # noqa: E402

MB = 1_000_000


def _best(f, repeats: int = 5) -> float:
    f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def primitives(nbytes: int = 64 * MB) -> dict[str, float]:
    """Bytes per second of BLAKE3 (the signed body digest, one thread) and of the float32 add."""
    from ravnest_jax.swarm.wire import _auth

    a = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    b, out = a.copy(), np.empty_like(a)

    def digest() -> None:
        h = _auth.body_hasher()
        h.update(a.view(np.uint8))
        h.hexdigest()

    return {
        "blake3_bytes_per_s": nbytes / _best(digest),
        "add_float32_bytes_per_s": nbytes / _best(lambda: np.add(a, b, out=out)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--payloads-mb", default="16,64,1024")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per measurement (the first is a warm-up)")
    ap.add_argument("--out", default=str(HERE / "results" / "round_bound.json"))
    args = ap.parse_args()
    payloads = [int(float(x) * MB) for x in args.payloads_mb.split(",")]
    prim = primitives()
    print(json.dumps(prim), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rj-bound-") as tmp:
        tiny = summarize(swarm_run(2, 4096, max(args.rounds, 8), "fp32", Path(tmp)), max(args.rounds, 8))
        fixed = min(tiny["round_s_all"])
        print(f"fixed cost of a round (4 KB, fastest of {len(tiny['round_s_all'])}): {fixed:.4f} s", flush=True)
        for payload in payloads:
            rounds = args.rounds if payload < 512 * MB else 3
            gloo = gloo_run(2, payload, rounds)
            res = summarize(swarm_run(2, payload, rounds, "fp32", Path(tmp)), rounds)
            hash_s = 2 * payload / prim["blake3_bytes_per_s"]
            row = {
                "payload_mb": payload / MB,
                "gloo_round_s": gloo,
                "butterfly_round_s": res["round_s"],
                "butterfly_cpu_s_per_peer": res["cpu_s_per_peer"],
                "digests_equal": res["digests_equal"],
                "blake3_2x_payload_s": hash_s,
                "fixed_round_s": fixed,
                "lower_bound_s": None if gloo is None else gloo + hash_s + fixed,
                "lower_bound_vs_gloo": None if gloo is None else (gloo + hash_s + fixed) / gloo,
                "butterfly_vs_gloo": None if gloo is None else res["round_s"] / gloo,
                "butterfly_vs_lower_bound": None if gloo is None else res["round_s"] / (gloo + hash_s + fixed),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if any(r["gloo_round_s"] is None for r in rows):
        print("torch is not installed: no gloo rounds, no bound (pip install torch==2.13.0)", file=sys.stderr)
    out = {
        "machine": machine_info(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "peers": 2,
        "codec": "fp32",
        "primitives": prim,
        "fixed_round_s": fixed,
        "fixed_round_s_all": tiny["round_s_all"],
        "rows": rows,
        "median_note": "rounds: median of the rounds after a warm-up (1 GiB: 2 rounds)",
        "bound": "gloo round + BLAKE3 of 2 x payload (sent and received bytes, one core) + the fixed cost "
        "of a round (the fastest 4 KB round)",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    for r in rows:
        if r["gloo_round_s"] is not None:
            print(
                f"{r['payload_mb']:>6.0f} MB: gloo {r['gloo_round_s']:.3f} s, bound {r['lower_bound_s']:.3f} s "
                f"({r['lower_bound_vs_gloo']:.2f}x gloo), butterfly {r['butterfly_round_s']:.3f} s "
                f"({r['butterfly_vs_gloo']:.2f}x gloo, {r['butterfly_vs_lower_bound']:.2f}x the bound)"
            )


if __name__ == "__main__":
    main()
