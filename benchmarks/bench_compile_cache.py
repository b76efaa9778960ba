#!/usr/bin/env python3
"""JAX's persistent compilation cache: the compile time of the char-LM peer's jitted steps on
a cold cache (a first start) and a warm one (a restart), and the wall time of a whole
``ravnest-jax local --peers 1 -- python examples/char_lm/train.py`` run, each in a fresh
process with a fresh cache directory.

    .venv/bin/python benchmarks/bench_compile_cache.py            # about 2 minutes on 2 CPU cores

Writes ``benchmarks/results/compile_cache.json`` (the machine and the command with it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine_info  # noqa: E402

# the char-LM peer's steps (examples/char_lm/train.py), compiled and timed in a fresh process
CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
t0 = time.perf_counter()
import ravnest_jax as rj
rj.enable_compilation_cache()  # from JAX_COMPILATION_CACHE_DIR (or RAVNEST_COMPILE_CACHE=0: off)
import jax, numpy as np, optax
from char_lm.data import eval_batches, VOCAB
from char_lm.model import ModelConfig, build_model, inner_optimizer, make_loss
cfg = ModelConfig()
graphdef, params = build_model(cfg)
loss_fn = make_loss(graphdef)
tx = rj.diloco(inner_optimizer(3e-3, 300), sync_every=20)
state = tx.init(params)

@jax.jit
def train_step(params, state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

tokens = np.zeros((8, cfg.seq_len + 1), np.int32)
t1 = time.perf_counter()
train_step.lower(params, state, tokens).compile()
t2 = time.perf_counter()
print(json.dumps({"compile_s": t2 - t1, "startup_to_compiled_s": t2 - t0}))
"""


def child(cache: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION", "RAVNEST_COMPILE"))}
    env["RAVNEST_COMPILE_CACHE"] = "1" if cache else "0"
    if cache:
        env["JAX_COMPILATION_CACHE_DIR"] = cache
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT / "examples")], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def launcher(cache: str | None, steps: int) -> float:
    cmd = [sys.executable, "-m", "ravnest_jax.cli", "local", "--peers", "1", "--no-progress"]
    cmd += ["--compile-cache-dir", cache] if cache else ["--no-compile-cache"]
    cmd += ["--", "python", "examples/char_lm/train.py", "--max-steps", str(steps), "--sync-every", "10"]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2, help="warm starts measured (default 2)")
    p.add_argument("--steps", type=int, default=20, help="inner steps of the launcher run (default 20)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile_cache.json"))
    args = p.parse_args()
    res: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine_info()}
    with tempfile.TemporaryDirectory() as d:
        res["step_no_cache"] = child(None)
        res["step_cold"] = child(d)
        res["step_warm"] = [child(d) for _ in range(args.repeats)]
        res["cache_files"] = len(os.listdir(d))
    with tempfile.TemporaryDirectory() as d:
        res["launcher_run_no_cache_s"] = launcher(None, args.steps)
        res["launcher_run_cold_s"] = launcher(d, args.steps)
        res["launcher_run_warm_s"] = [launcher(d, args.steps) for _ in range(args.repeats)]
        res["launcher_cache_files"] = len(os.listdir(d))
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
