"""Throughput and size of every pseudo-gradient codec, next to a plain memory copy.

For one float32 array of ``--size`` elements (normal values times 1e-3, like a pseudo-gradient)
and each codec it measures, in GB/s of float32 *input* (4 bytes per element):

- ``host_encode``: ``rj.compress.encode`` (numpy), to message bytes;
- ``device_encode``: the jitted ``device_encode`` on the jax CPU backend (XLA), arrays ready;
- ``to_bytes``: ``packed_to_bytes`` of the fetched device result (header, CRC, one copy);
- ``to_chunks``: ``packed_to_chunks`` (header, CRC, no copy: the message as buffers);
- ``decode``: ``rj.compress.decode`` (numpy), message bytes to a float32 array;
- ``stream_decode``: ``StreamDecoder`` fed those chunks, then ``finish`` (the receiving side);
- ``pipeline``: ``device_encode -> device_get -> packed_to_bytes -> decode`` timed end to end
  as one call (the message as one ``bytes``), ``stream_pipeline``:
  ``device_encode -> device_get -> packed_to_chunks -> StreamDecoder`` end to end (what
  ``OuterSync`` does with its own contribution, and a sender writing the chunks to a receiver
  that feeds them), and ``host_pipeline``: ``encode + decode``;
- references in the same run: ``memcpy`` (``np.copyto`` into a preallocated array),
  ``fresh_copy`` (``x.copy()``: numpy's new buffer, with its page faults), ``jit_copy`` (a
  jitted ``x * 1`` on the jax CPU backend: a new XLA output buffer of the input's size, which
  every device encode of a dense codec also materialises) and ``bytes_copy`` (a new ``bytes``
  of the input, as ``packed_to_bytes`` makes);
- the message size over the float32 size (``ratio``) and the round-trip error.

By default the process pins itself to ONE core (``os.sched_setaffinity``) and asks XLA for one
thread (``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``),
before numpy and jax are imported. The stages of one codec take turns (one call of each per
round, ``--repeats`` rounds). Each time is the minimum over the repeats of the wall
clock (``*_gbps``) and, separately, of the process CPU time (``cpu.*``: all threads, user +
system, so page faults count; on one core CPU time <= wall time, and the difference is time the
core spent on other processes of a shared machine). Medians are stored too, and the load
average before and after, because the numbers depend on it.

New buffers matter at this size: glibc serves allocations above its mmap threshold with fresh
``mmap``s, faulted in 4 KiB pages on every call (numpy asks for transparent huge pages itself),
which ``jit_copy`` and ``bytes_copy`` (one 64 MiB buffer each) show. ``device_encode`` therefore
hands large parts out as slices of at most ``SEGMENT_BYTES`` (8 MiB), and, as every peer does
(``OuterSync`` and ``Swarm`` call ``rj.host_memory.tune_host_allocator``), this benchmark fixes
glibc's mmap threshold at 32 MiB and its trim threshold at 256 MiB so that those slices are
reused from the heap; ``--keep-malloc`` measures with glibc's defaults instead.
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc >= 2.35, THP in ``madvise`` mode) makes malloc
ask for huge pages too; the JSON records both settings.

Usage:
  python benchmarks/bench_codecs.py                 # 2**24 elements (64 MiB), one core
  python benchmarks/bench_codecs.py --keep-malloc --out results/codecs_keep_malloc.json
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/bench_codecs.py --out results/x.json
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
    p.add_argument("--codecs", default="fp32,bf16,int8,int4,fp4,topk")
    p.add_argument(
        "--keep-malloc",
        action="store_true",
        help="leave glibc malloc as it is (a peer calls rj.host_memory.tune_host_allocator)",
    )
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
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    ).strip()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ravnest_jax.compress as C  # noqa: E402
from ravnest_jax import host_memory  # noqa: E402

# what every peer does when it creates its OuterSync / Swarm (round buffers reused from the heap)
ALLOCATOR = None if ARGS.keep_malloc else host_memory.tune_host_allocator()


class _Timing:
    """Minimum and median over repeats of wall time and of process CPU time (seconds)."""

    def __init__(self) -> None:
        self.walls: list[float] = []
        self.cpus: list[float] = []

    def run(self, fn) -> None:
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        self.walls.append(time.perf_counter() - t0)
        self.cpus.append(time.process_time() - c0)

    @property
    def wall(self) -> float:
        return min(self.walls)

    @property
    def cpu(self) -> float:
        return min(self.cpus)

    @property
    def wall_median(self) -> float:
        return statistics.median(self.walls)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpus)


def _time_round_robin(fns: dict, repeats: int) -> dict:
    """Times every function ``repeats`` times, taking turns (one call of each per round), after
    one warm-up call each: on a shared machine whose speed drifts, every stage then samples the
    same stretch of time."""
    timings = {k: _Timing() for k in fns}
    for fn in fns.values():
        fn()  # warm-up (compilation, lookup tables)
    for _ in range(repeats):
        for k, fn in fns.items():
            timings[k].run(fn)
    return timings


def _stream_decode(chunks):
    dec = C.StreamDecoder()
    for c in chunks:
        dec.feed(c)
    return dec.finish()


def main() -> None:
    n = ARGS.size
    gb = 4 * n / 1e9
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    xd = jax.device_put(x)
    load_before = os.getloadavg()
    R = ARGS.repeats

    dst = np.empty_like(x)
    refs = _time_round_robin(
        {
            "memcpy": lambda: np.copyto(dst, x),
            "fresh_copy": lambda: x.copy(),
            "jit_copy": functools.partial(lambda f: jax.block_until_ready(f(xd)), jax.jit(lambda v: v * 1)),
            "bytes_copy": lambda: b"".join([b"", x.view(np.uint8)]),
        },
        R,
    )
    rows = []
    for codec in ARGS.codecs.split(","):
        enc = jax.jit(functools.partial(C.device_encode, codec=codec))
        data = C.encode({"w": x}, codec)
        packed = jax.device_get(enc({"w": xd})[0])
        assert C.packed_to_bytes(packed) == data, codec
        chunks = C.packed_to_chunks(packed)
        assert b"".join(chunks) == data, codec
        np.testing.assert_array_equal(_stream_decode(chunks)["w"], C.decode(data)["w"])
        t = _time_round_robin(
            {
                "host_encode": lambda: C.encode({"w": x}, codec),
                "device_encode": lambda: jax.block_until_ready(enc({"w": xd})),
                "to_bytes": lambda: C.packed_to_bytes(packed),
                "to_chunks": lambda: C.packed_to_chunks(packed),
                "decode": lambda: C.decode(data),
                "stream_decode": lambda: _stream_decode(chunks),
                "pipeline": lambda: C.decode(C.packed_to_bytes(jax.device_get(enc({"w": xd})[0]))),
                "stream_pipeline": lambda: _stream_decode(C.packed_to_chunks(jax.device_get(enc({"w": xd})[0]))),
                "host_pipeline": lambda: C.decode(C.encode({"w": x}, codec)),
            },
            R,
        )
        out = C.decode(data)["w"]
        err = out.astype(np.float64) - x
        row = {"codec": codec, "message_bytes": len(data), "ratio": len(data) / (4 * n)}
        row.update({f"{k}_gbps": gb / v.wall for k, v in t.items()})
        # the same pipelines as the sum of their stages' minimum times (optimistic: each stage's
        # luckiest run; the end-to-end figures above pay every new buffer of one real call)
        stages = {
            "pipeline_sum": ("device_encode", "to_bytes", "decode"),
            "stream_pipeline_sum": ("device_encode", "to_chunks", "stream_decode"),
        }
        for k, parts in stages.items():
            row[f"{k}_gbps"] = gb / sum(t[p].wall for p in parts)
        row["cpu_gbps"] = {k: gb / v.cpu for k, v in t.items()}
        row["median_s"] = {k: v.wall_median for k, v in t.items()}
        row["cpu_median_s"] = {k: v.cpu_median for k, v in t.items()}
        row["max_abs_err"] = float(np.abs(err).max())
        row["rel_rms_err"] = float(np.sqrt(np.mean(err**2)) / np.sqrt(np.mean(x.astype(np.float64) ** 2)))
        rows.append(row)
        print(
            f"{codec:5s} ratio {row['ratio']:.4f}  dev enc {row['device_encode_gbps']:6.2f}  "
            f"to_bytes {row['to_bytes_gbps']:6.2f}  to_chunks {row['to_chunks_gbps']:7.2f}  "
            f"dec {row['decode_gbps']:5.2f}  stream dec {row['stream_decode_gbps']:5.2f}  "
            f"pipeline {row['pipeline_gbps']:5.2f} (cpu {row['cpu_gbps']['pipeline']:5.2f})  "
            f"stream pipeline {row['stream_pipeline_gbps']:5.2f} (cpu {row['cpu_gbps']['stream_pipeline']:5.2f})  "
            f"host pipeline {row['host_pipeline_gbps']:5.2f} GB/s  rel rms err {row['rel_rms_err']:.2e}",
            flush=True,
        )
    from ravnest_jax.compress import _wire

    result = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "one_core": not ARGS.all_cores,
        "pinning": (
            "os.sched_setaffinity(0, {core}) before importing numpy/jax; XLA_FLAGS="
            f"{os.environ.get('XLA_FLAGS', '')!r}; OMP/BLAS threads 1"
            if not ARGS.all_cores
            else "none"
        ),
        "size_elements": n,
        "input_bytes": 4 * n,
        "repeats": R,
        "timing": (
            "stages of a codec timed round-robin (one call each per round, after a warm-up call); "
            "*_gbps = float32 input bytes / min wall time over repeats; cpu_gbps = the same with "
            "the min process CPU time (all threads, user + system); medians in median_s / "
            "cpu_median_s. pipeline and stream_pipeline are timed end to end as one call."
        ),
        "crc32": _wire.CRC32_IMPL,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_model": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "jax": jax.__version__,
            "jax_backend": jax.default_backend(),
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            "host_allocator": ALLOCATOR or "glibc defaults (--keep-malloc)",
            "transparent_hugepage": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        **{f"{k}_gbps": gb / v.wall for k, v in refs.items()},
        "reference_cpu_gbps": {k: gb / v.cpu for k, v in refs.items()},
        "goal": "encode+decode >= 1.25 GB/s on one core (pipeline_gbps / stream_pipeline_gbps)",
        "codecs": rows,
    }
    print(
        "references: "
        + ", ".join(f"{k} {gb / v.wall:.2f} (cpu {gb / v.cpu:.2f})" for k, v in refs.items())
        + f" GB/s; load {load_before} -> {result['machine']['loadavg_after']}"
    )
    os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
    with open(ARGS.out, "w") as f:
        json.dump(result, f, indent=2)
    png = os.path.splitext(ARGS.out)[0] + ".png"
    plot(result, png)
    print("wrote", ARGS.out, "and", png)


def plot(result: dict, path: str) -> None:
    """Grouped bars per codec (GB/s of float32 input, min wall time) with the goal and the
    references of the same run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["codecs"]
    series = [
        ("device_encode_gbps", "device encode"),
        ("decode_gbps", "decode"),
        ("stream_decode_gbps", "stream decode"),
        ("pipeline_gbps", "pipeline (bytes)"),
        ("stream_pipeline_gbps", "pipeline (chunks)"),
    ]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    w = 0.8 / len(series)
    xs = np.arange(len(rows))
    for i, (key, label) in enumerate(series):
        ax.bar(xs + (i - (len(series) - 1) / 2) * w, [r[key] for r in rows], w, label=label)
    ax.axhline(1.25, color="k", ls="--", lw=1, label="goal 1.25 GB/s (encode + decode)")
    ax.axhline(result["memcpy_gbps"], color="grey", ls=":", lw=1, label=f"memcpy {result['memcpy_gbps']:.1f} GB/s")
    ax.axhline(
        result["jit_copy_gbps"],
        color="tab:red",
        ls=":",
        lw=1,
        label=f"jitted copy (new XLA buffer) {result['jit_copy_gbps']:.1f} GB/s",
    )
    ax.set_yscale("log")
    ax.set_ylim(top=max(40.0, 4 * result["memcpy_gbps"]))
    ax.set_xticks(xs, [f"{r['codec']}\n{r['ratio']:.3f}x" for r in rows])
    ax.set_ylabel("GB/s of float32 input (log)")
    m = result["machine"]
    tun = m.get("glibc_tunables") or (
        "tune_host_allocator" if isinstance(m.get("host_allocator"), dict) else "default glibc malloc"
    )
    ax.set_title(
        f"codecs on one core ({m['cpu_model']}), 2^{int(np.log2(result['size_elements']))} float32, "
        f"min of {result['repeats']}; {tun}; load {m['loadavg_before'][0]:.1f}",
        fontsize=9,
    )
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
