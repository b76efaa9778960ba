"""Exact resume after a real ``kill -9``, and a kill in the middle of an async save.

Each test runs ``_train_worker.py`` in fresh processes (``sys.executable``) and reaps them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import ravnest_jax as rj

pytestmark = pytest.mark.integration  # real processes: minutes in all

WORKER = Path(__file__).with_name("_train_worker.py")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    # A persistent compilation cache shared by the workers: later processes load the compiled
    # steps instead of compiling them again (same executables, so results are unchanged).
    e = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    e.pop("XLA_FLAGS", None)
    return e


def _start(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # never leave an orphan behind
            proc.kill()
            proc.wait()
    return proc.returncode, out


def test_exact_resume_after_kill9(tmp_path: Path, env: dict) -> None:
    k = 4  # mid-round (sync_every=3): the resumed round needs the saved global params
    d = tmp_path / "ckpt"
    # The first process runs the uninterrupted 2k-step reference from the same init, then the
    # checkpointed first half; the resumed process loads the compiled steps from the cache.
    first = _start(
        env,
        "train",
        "--ref-out",
        str(tmp_path / "ref.npz"),
        "--ref-steps",
        str(2 * k),
        "--dir",
        str(d),
        "--steps",
        str(2 * k),
        "--save-at",
        str(k),
        "--kill-after-save",
        "--out",
        str(tmp_path / "unused.npz"),
    )
    rc, out = _finish(first)
    assert rc == -signal.SIGKILL, out
    assert "reference done" in out and f"saved {k}" in out and "\ndone" not in out
    second = _start(env, "train", "--dir", str(d), "--steps", str(2 * k), "--out", str(tmp_path / "resumed.npz"))
    rc2, out2 = _finish(second)
    assert rc2 == 0, out2
    assert f"resumed {k}" in out2
    a, b = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(a.files) == sorted(b.files)
    names = set(a.files)
    # params and every optimizer-state leaf, the schedule counts, counters and the data key
    assert "opt_state.inner_state[0].count" in names and "opt_state.rounds" in names
    assert any(n.startswith("opt_state.global_params") for n in names)
    assert "extra['data_key']" in names
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert int(a["opt_state.count"]) == 2 * k and int(a["opt_state.rounds"]) == 2 * k // 3


MIB = 32


def _kill_during_save(env: dict, directory: Path, delay: float, seen: dict) -> None:
    proc = _start(env, "bigsave", "--dir", str(directory), "--mib", str(MIB))
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.strip() == "saving":
                break
        # kill while the save is being written: its temporary directory exists, the final
        # directory "2" does not yet
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("tmp" in p.name for p in directory.iterdir()):
            time.sleep(0.002)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=60)
        seen[delay] = {"rc": proc.returncode, "committed": "committed" in rest}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kill_during_async_save_keeps_previous_checkpoint(tmp_path: Path, env: dict) -> None:
    delays = [0.0, 0.05]
    seen: dict = {}
    threads = [
        threading.Thread(target=_kill_during_save, args=(env, tmp_path / f"d{i}", delay, seen))
        for i, delay in enumerate(delays)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert set(seen) == set(delays), seen
    interrupted = 0
    for i, delay in enumerate(delays):
        d = tmp_path / f"d{i}"
        assert seen[delay]["rc"] == -signal.SIGKILL
        tmp_left = [p.name for p in d.iterdir() if "tmp" in p.name]
        with rj.Checkpointer(d) as ckpt:  # a leftover temporary dir is ignored, then cleaned up
            n = MIB * (1 << 20) // 16
            target = {f"w{j}": jnp.zeros((n,), jnp.float32) for j in range(4)}
            r = ckpt.restore(params=target, opt_state={"count": jnp.int32(0)})
            assert r is not None
            print(f"delay {delay}s: {seen[delay]}, temporary dirs left: {tmp_left}, restored step {r.step}")
            if not seen[delay]["committed"]:
                assert r.step in (1, 2)  # 2 only if the rename landed just before the kill
            for j in range(4):
                np.testing.assert_array_equal(np.asarray(r.params[f"w{j}"][:: 1 << 14]), float(r.step * 10 + j))
            assert int(r.opt_state["count"]) == r.step
            if r.step == 1:
                interrupted += 1
                assert tmp_left  # the kill landed mid-write
                assert ckpt.save(2, params=target, opt_state={"count": jnp.int32(2)})  # re-save works
                ckpt.wait()
                assert ckpt.all_steps() == [1, 2]
                assert not [p.name for p in d.iterdir() if "tmp" in p.name]
    assert interrupted >= 1, f"no kill landed before the commit: {seen}"
