"""Stage peers as real processes on 127.0.0.1: the synchronous pipeline trains exactly the
unsplit model (loss and gradients after 5 steps, float32)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import batches, build, flat, optimizer  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_stage_worker.py"
STEPS, LR = 5, 0.1
RTOL = 1e-5


def reference(model: str, steps: int = STEPS):
    """The unsplit model trained ``steps`` steps (full batches) with the stages' optimizer: the
    losses of all steps, the gradient of the last, the params after it."""
    import jax
    import jax.numpy as jnp
    import optax

    _, params, loss_fn, vocab = build(model)
    data = batches(vocab)
    tx = optimizer(LR)
    state = tx.init(params)
    losses = []
    for t in range(steps):
        loss, grads = jax.value_and_grad(loss_fn)(params, jnp.asarray(data(t)))
        losses.append(float(loss))
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return np.asarray(losses), flat(grads), flat(params)


def assert_matches(name: str, got: np.ndarray, want: np.ndarray) -> None:
    """Element-wise ``rtol`` 1e-5; entries below 1e-6 of the leaf's largest magnitude are held to
    that floor instead (float32 sums in another order)."""
    atol = 1e-6 * float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=atol, err_msg=name)


@pytest.mark.integration
@pytest.mark.parametrize("model,stages", [("char", 2), ("char", 3), ("llama", 2), ("llama", 3)])
def test_sync_pipeline_equals_unsplit_model(pipe_cluster, tmp_path, model, stages):
    pipe_cluster.rendezvous()
    procs = []
    for s in range(stages):
        out = tmp_path / f"stage{s}.npz"
        procs.append(
            (
                out,
                pipe_cluster.start(
                    f"stage{s}", WORKER, "--model", model, "--stages", str(stages), "--stage", str(s), "--out", str(out)
                ),
            )
        )
    ref_losses, ref_grads, ref_params = reference(model)
    for _, p in procs:
        p.expect("done", timeout=240)
        assert p.wait(30) == 0, p.stderr()
    results = [dict(np.load(out)) for out, _ in procs]
    # the loss lives on the last stage
    np.testing.assert_allclose(results[-1]["losses"], ref_losses, rtol=RTOL, err_msg="losses")
    seen = set()
    for r in results:
        for key, got in r.items():
            kind, _, name = key.partition("/")
            if kind == "grad":
                assert_matches(f"gradient of {name}", got, ref_grads[name])
            elif kind == "param":
                assert_matches(f"param {name}", got, ref_params[name])
            seen.add(name)
    assert seen - {""} == set(ref_grads), f"stages hold {sorted(seen)}, the model {sorted(ref_grads)}"


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["async", pytest.param("2bw", marks=pytest.mark.slow)])  # 2bw: not the default
def test_async_pipeline_of_processes_equals_its_simulation(pipe_cluster, tmp_path, mode):
    """The asynchronous modes are deterministic (each stage's op order is fixed): the peer
    processes compute exactly what the one-process simulation does."""
    import jax

    import ravnest_jax as rj

    pipe_cluster.rendezvous()
    stages = 3
    procs = []
    for s in range(stages):
        out = tmp_path / f"stage{s}.npz"
        args = ["--stages", str(stages), "--stage", str(s), "--mode", mode, "--steps", "4", "--out", str(out)]
        procs.append((out, pipe_cluster.start(f"stage{s}", WORKER, *args)))
    split, _, _, vocab = build("char")
    sim = rj.pipeline.simulate(
        split,
        rj.pipeline.plan_stages(split, stages),
        optimizer(LR),
        batches(vocab),
        steps=4,
        micro_batches=4,
        mode=mode,
    )
    for _, p in procs:
        p.expect("done", timeout=240)
        assert p.wait(30) == 0, p.stderr()
    results = [dict(np.load(out)) for out, _ in procs]
    np.testing.assert_allclose(results[-1]["losses"], sim.losses, rtol=RTOL, err_msg="losses")
    for r, w in zip(results, sim.workers):
        want = flat(jax.device_get(w.params))
        for name, v in want.items():
            assert_matches(f"param {name}", r[f"param/{name}"], v)
