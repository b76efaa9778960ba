#!/usr/bin/env python3
"""Memory of a long-running peer, suspect by suspect (not run in CI: minutes).

Each case repeats one thing a peer does many times and samples, every ``--every`` repetitions:
RSS (``/proc``), the Python heap (``sys.getallocatedblocks()``: allocated blocks, and
``gc.get_objects()``: tracked objects) and glibc's heap (``mallinfo2``: ``arena`` = heap
mapped from the system, ``in_use`` = allocated). A true leak grows ``in_use`` or the Python
blocks linearly; allocator behaviour grows ``arena`` and RSS with flat ``in_use``, and levels off.

- ``checkpoint``: ``rj.Checkpointer`` saves of a DiLoCo state of ``--leaves`` arrays (in this
  process); ``--without-workaround``: without the checkpointer's workaround of tensorstore's
  ``KvStore.Spec.to_json`` leak (docs/checkpointing.md), for comparison.
- ``churn``: a survivor ``rj.Swarm`` (and a second long-lived peer) in this process, a
  rendezvous process, and a stream of visitor swarms with new peer ids: each joins, downloads
  a ``--state-mb`` state from the survivor, takes part in a round and leaves. Also samples the
  rendezvous' RSS and the survivor's round, nonce and task containers.
- ``peer``: a rendezvous and one peer of the char-LM main job (``examples/char_lm/main.py``)
  as processes, checkpointing every ``--checkpoint-every`` steps; its RSS by saves done.

Writes ``benchmarks/results/memory.json`` (machine, command, every sample).

    python benchmarks/bench_memory.py checkpoint --n 1000
    python benchmarks/bench_memory.py checkpoint --n 1000 --without-workaround
    python benchmarks/bench_memory.py churn --n 120
    python benchmarks/bench_memory.py peer --n 1500 --checkpoint-every 2
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import free_port, machine_info  # noqa: E402


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def rss_mb(pid: int | str = "self") -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def sample(**extra) -> dict:
    """This process' memory now (after a young-generation-free full collection)."""
    gc.collect()
    out = {"rss_mb": rss_mb(), "python_blocks": sys.getallocatedblocks(), "gc_objects": len(gc.get_objects())}
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        m = libc.mallinfo2()
        out.update({"glibc_arena_mb": m.arena / 2**20, "glibc_in_use_mb": m.uordblks / 2**20})
    except (OSError, AttributeError):  # not glibc
        pass
    return {**out, **extra}


def show(rec: dict) -> None:
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()), flush=True)


# ------------------------------------------------------------------------------------ cases
def case_checkpoint(args) -> list[dict]:
    import jax
    import numpy as np
    import optax

    import ravnest_jax as rj

    if args.without_workaround:  # orbax's saves as they are: tensorstore's to_json leak
        import ravnest_jax.checkpoint._checkpointer as checkpointer

        checkpointer.avoid_kvstore_spec_to_json = lambda: False
    rj.host_memory.tune_host_allocator()  # as every peer (Swarm, OuterSync) does
    per = max(args.leaves // 5, 1)  # params; the DiLoCo state holds about 4 more copies
    params = {f"w{i}": jax.random.normal(jax.random.key(i), (64, 256)) for i in range(per)}
    tx = rj.diloco(optax.adamw(1e-3), sync_every=10)
    state = tx.init(params)
    n_leaves = len(jax.tree.leaves((params, state)))
    work = Path(tempfile.mkdtemp(prefix="rj-mem-ckpt-"))
    out = []
    try:
        with rj.Checkpointer(work, max_to_keep=3) as ckpt:
            for s in range(1, args.n + 1):
                ckpt.save(s, params=params, opt_state=state, extra={"step": np.int64(s)}, force=True)
                if s % args.every == 0:
                    ckpt.wait()
                    rec = sample(saves=s, leaves=n_leaves)
                    out.append(rec)
                    show(rec)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def case_churn(args) -> list[dict]:
    import numpy as np

    from ravnest_jax.swarm import Swarm, Timeouts

    token = secrets.token_hex(16)
    work = Path(tempfile.mkdtemp(prefix="rj-mem-churn-"))
    (work / "token").write_text(token)
    (work / "token").chmod(0o600)
    port = free_port()
    rv = subprocess.Popen(
        [sys.executable, "-m", "ravnest_jax.cli", "rendezvous", "--host", "127.0.0.1", "--port", str(port)]
        + ["--token-file", str(work / "token"), "--heartbeat", "0.5", "--eviction", "3"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    t = Timeouts(connect=2.0, part=5.0, grace=0.5, round=20.0, heartbeat=0.5, eviction=3.0)

    def swarm(peer: str) -> Swarm:
        return Swarm(url, run_id="churn", token=token, listen="127.0.0.1:0", timeouts=t, peer_id=peer, codec="int4")

    state = os.urandom(int(args.state_mb * 2**20))
    vec = {"pg": np.random.default_rng(0).standard_normal(150_000).astype(np.float32)}

    def rounds(peers: list[Swarm]) -> int:
        futs = [p.all_reduce_async(vec) for p in peers]
        ok = 0
        for f in futs:
            try:
                f.result(60)
                ok += 1
            except Exception:  # noqa: BLE001 - a visitor's first round may fail; counted
                pass
        return ok

    out = []
    try:
        deadline = time.monotonic() + 30
        while rss_mb(rv.pid) is None or not _health(url):
            if time.monotonic() > deadline:
                raise SystemExit("the rendezvous did not start")
            time.sleep(0.1)
        with swarm("survivor") as a, swarm("second") as b:
            a.serve_state(lambda: state)
            a.wait_for_peers(2, 20)
            rounds([a, b])
            for i in range(args.n + 1):
                if i % args.every == 0:
                    rec = sample(
                        visitors=i,
                        rendezvous_rss_mb=rss_mb(rv.pid),
                        survivor_attempts=len(a._rounds.attempts),
                        survivor_nonces=len(a.transport._nonces._seen),
                        survivor_tasks=len(a._tasks),
                    )
                    out.append(rec)
                    show(rec)
                if i == args.n:
                    break
                with swarm(f"visitor-{i}") as v:
                    got = v.fetch_state(timeout=30)
                    if got is None or len(got) != len(state):
                        raise SystemExit(f"visitor {i} did not get the state")
                    rounds([a, b, v])
                rounds([a, b])
    finally:
        rv.terminate()
        rv.wait(20)
        shutil.rmtree(work, ignore_errors=True)
    return out


def _health(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2):
            return True
    except OSError:
        return False


def case_peer(args) -> list[dict]:
    token = secrets.token_hex(16)
    work = Path(tempfile.mkdtemp(prefix="rj-mem-peer-"))
    (work / "token").write_text(token)
    (work / "token").chmod(0o600)
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}
    rv = subprocess.Popen(
        [sys.executable, "-m", "ravnest_jax.cli", "rendezvous", "--host", "127.0.0.1", "--port", str(port)]
        + ["--token-file", str(work / "token"), "--heartbeat", "1", "--eviction", "5"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    steps = args.n * args.checkpoint_every
    cmd = [sys.executable, str(ROOT / "examples" / "char_lm" / "main.py"), "--rendezvous", f"http://127.0.0.1:{port}"]
    cmd += ["--run-id", "memory", "--token-file", str(work / "token"), "--listen", "127.0.0.1:0"]
    cmd += ["--max-steps", str(steps), "--schedule-steps", str(steps), "--sync-every", "10"]
    cmd += ["--overlap-steps", "1", "--codec", "int4", "--d-model", "64", "--layers", "2", "--heads", "4"]
    cmd += ["--seq-len", "64", "--batch-size", "8", "--eval-batches", "2", "--log-every", "10"]
    cmd += ["--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", str(args.checkpoint_every)]
    cmd += ["--json-events", "--no-progress"]
    out: list[dict] = []
    peer = None
    try:
        deadline = time.monotonic() + 30
        while not _health(f"http://127.0.0.1:{port}"):
            if time.monotonic() > deadline:
                raise SystemExit("the rendezvous did not start")
            time.sleep(0.1)
        peer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(work / "peer.log", "w"), text=True, env=env)
        progress = [0]

        def read() -> None:
            for line in peer.stdout:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("event") == "progress":
                    progress[0] = int(ev["step"])

        threading.Thread(target=read, daemon=True).start()
        t0 = time.monotonic()
        last = -1
        while peer.poll() is None:
            time.sleep(1.0)
            saves = progress[0] // args.checkpoint_every
            if saves // args.every > last:
                last = saves // args.every
                rec = {
                    "seconds": time.monotonic() - t0,
                    "step": progress[0],
                    "saves": saves,
                    "rss_mb": rss_mb(peer.pid),
                }
                out.append(rec)
                show(rec)
        if peer.returncode != 0:
            raise SystemExit(f"the peer failed (exit {peer.returncode}); see {work / 'peer.log'}")
    finally:
        if peer is not None and peer.poll() is None:
            peer.terminate()
            peer.wait(30)
        rv.terminate()
        rv.wait(20)
        shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", choices=["checkpoint", "churn", "peer"])
    ap.add_argument("--n", type=int, default=None, help="saves / visitors (default 1000 / 120 / 1500)")
    ap.add_argument("--every", type=int, default=None, help="sample every this many (default 50 / 10 / 50)")
    ap.add_argument("--leaves", type=int, default=125, help="checkpoint: arrays in the saved state")
    ap.add_argument("--state-mb", type=float, default=4.0, help="churn: size of the state downloaded")
    ap.add_argument("--checkpoint-every", type=int, default=2, help="peer: steps between saves")
    ap.add_argument(
        "--without-workaround",
        action="store_true",
        help="checkpoint: without the checkpointer's workaround of tensorstore's KvStore.Spec.to_json leak",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory.json"))
    args = ap.parse_args(argv)
    args.n = args.n or {"checkpoint": 1000, "churn": 120, "peer": 1500}[args.case]
    args.every = args.every or {"checkpoint": 50, "churn": 10, "peer": 50}[args.case]
    samples = {"checkpoint": case_checkpoint, "churn": case_churn, "peer": case_peer}[args.case](args)
    path = Path(args.out)
    doc = json.loads(path.read_text()) if path.exists() else {"benchmark": "memory", "cases": {}}
    doc["cases"][args.case + ("_without_workaround" if args.without_workaround else "")] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "config": {**vars(args), "out": os.path.relpath(args.out, ROOT)},
        "samples": samples,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
