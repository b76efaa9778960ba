"""Throughput and size of every pseudo-gradient codec, next to a plain memory copy.

For one float32 array of ``--size`` elements (normal values times 1e-3, like a pseudo-gradient)
and each codec it measures, in GB/s of float32 *input* (4 bytes per element):

- ``host_encode``: ``rj.compress.encode`` (numpy), to message bytes;
- ``device_encode``: the jitted ``device_encode`` on the jax CPU backend (XLA), arrays ready;
- ``to_bytes``: ``packed_to_bytes`` of the fetched device result (header, CRC, one copy);
- ``decode``: ``rj.compress.decode`` (numpy), message bytes to a float32 array;
- ``pipeline``: ``device_encode + to_bytes + decode`` (what a peer pays per round and peer),
  and ``host_pipeline``: ``host_encode + decode``;
- ``memcpy`` (``np.copyto`` into a preallocated array) and ``fresh_copy`` (``x.copy()``, which
  also pays the page faults of a new buffer, as every decode does) as references;
- the message size over the float32 size (``ratio``) and the round-trip error.

By default the process pins itself to ONE core (``os.sched_setaffinity``) and asks XLA for one
thread, before numpy and jax are imported. Times are the minimum over ``--repeats`` runs (the
median is stored too); the load average is recorded because the numbers depend on it.

Usage:
  python benchmarks/bench_codecs.py                 # 2**24 elements (64 MiB), one core
  python benchmarks/bench_codecs.py --size 4194304 --repeats 3 --out /tmp/codecs.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=1 << 24, help="float32 elements (default 2**24 = 64 MiB)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--all-cores", action="store_true", help="do not pin to one core")
    p.add_argument("--codecs", default="fp32,fp16,bf16,int8,int4,fp4,topk")
    p.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "codecs.json"),
    )
    return p.parse_args()


ARGS = _parse()
if not ARGS.all_cores:
    # must happen before numpy / XLA start their thread pools
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    ).strip()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ravnest_jax.compress as C  # noqa: E402


def _time(fn, repeats: int) -> tuple[float, float]:
    fn()  # warm-up (compilation, lookup tables)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts)


def main() -> None:
    n = ARGS.size
    gb = 4 * n / 1e9
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    xd = jax.device_put(x)
    load_before = os.getloadavg()

    dst = np.empty_like(x)
    memcpy = _time(lambda: np.copyto(dst, x), ARGS.repeats)
    fresh = _time(lambda: x.copy(), ARGS.repeats)
    rows = []
    for codec in ARGS.codecs.split(","):
        enc = jax.jit(functools.partial(C.device_encode, codec=codec))
        data = C.encode({"w": x}, codec)
        host_enc = _time(lambda: C.encode({"w": x}, codec), ARGS.repeats)
        dev_enc = _time(lambda: jax.block_until_ready(enc({"w": xd})), ARGS.repeats)
        packed = jax.device_get(enc({"w": xd})[0])
        to_bytes = _time(lambda: C.packed_to_bytes(packed), ARGS.repeats)
        assert C.packed_to_bytes(packed) == data, codec
        dec = _time(lambda: C.decode(data), ARGS.repeats)
        out = C.decode(data)["w"]
        err = out.astype(np.float64) - x
        row = {
            "codec": codec,
            "message_bytes": len(data),
            "ratio": len(data) / (4 * n),
            "host_encode_gbps": gb / host_enc[0],
            "device_encode_gbps": gb / dev_enc[0],
            "to_bytes_gbps": gb / to_bytes[0],
            "decode_gbps": gb / dec[0],
            "pipeline_gbps": gb / (dev_enc[0] + to_bytes[0] + dec[0]),
            "host_pipeline_gbps": gb / (host_enc[0] + dec[0]),
            "median_s": {
                "host_encode": host_enc[1],
                "device_encode": dev_enc[1],
                "to_bytes": to_bytes[1],
                "decode": dec[1],
            },
            "max_abs_err": float(np.abs(err).max()),
            "rel_rms_err": float(np.sqrt(np.mean(err**2)) / np.sqrt(np.mean(x.astype(np.float64) ** 2))),
        }
        rows.append(row)
        print(
            f"{codec:5s} ratio {row['ratio']:.4f}  host enc {row['host_encode_gbps']:6.2f}  "
            f"dev enc {row['device_encode_gbps']:6.2f}  to_bytes {row['to_bytes_gbps']:6.2f}  "
            f"dec {row['decode_gbps']:6.2f}  pipeline {row['pipeline_gbps']:5.2f}  "
            f"host pipeline {row['host_pipeline_gbps']:5.2f} GB/s  rel rms err {row['rel_rms_err']:.2e}",
            flush=True,
        )
    result = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "one_core": not ARGS.all_cores,
        "pinning": (
            "os.sched_setaffinity(0, {core}) before importing numpy/jax; XLA_FLAGS="
            "'--xla_cpu_multi_thread_eigen=false'; OMP/BLAS threads 1"
            if not ARGS.all_cores
            else "none"
        ),
        "size_elements": n,
        "input_bytes": 4 * n,
        "repeats": ARGS.repeats,
        "timing": "GB/s = float32 input bytes / min time over repeats (medians in median_s)",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "jax": jax.__version__,
            "jax_backend": jax.default_backend(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "memcpy_gbps": gb / memcpy[0],
        "fresh_copy_gbps": gb / fresh[0],
        "goal": "encode+decode >= 1.25 GB/s on one core (pipeline_gbps)",
        "codecs": rows,
    }
    print(f"memcpy {result['memcpy_gbps']:.2f} GB/s, fresh copy {result['fresh_copy_gbps']:.2f} GB/s; "
          f"load {load_before} -> {result['machine']['loadavg_after']}")
    os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
    with open(ARGS.out, "w") as f:
        json.dump(result, f, indent=2)
    print("wrote", ARGS.out)


if __name__ == "__main__":
    main()
