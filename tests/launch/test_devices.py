"""``ravnest-jax local``'s per-peer devices and compilation cache: pure functions of a GPU list
(no GPU needed), the command line's errors, and the environment reaching the peers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ravnest_jax._compile_cache import default_compilation_cache_dir
from ravnest_jax._launch_env import assign_devices, compile_cache_env, describe_devices, visible_gpus

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "ravnest_jax.cli", "local"]


def _cvd(envs):
    return [e.get("CUDA_VISIBLE_DEVICES") for e in envs]


@pytest.mark.parametrize(
    ("peers", "gpus", "k", "want"),
    [
        (2, 4, None, ["0,1", "2,3"]),  # an even split
        (3, 8, None, ["0,1", "2,3", "4,5"]),  # 8 // 3 = 2 each, 2 unused
        (4, 4, None, ["0", "1", "2", "3"]),
        (2, 4, 1, ["0", "1"]),
        (1, 8, 8, ["0,1,2,3,4,5,6,7"]),
        (3, 6, 2, ["0,1", "2,3", "4,5"]),
    ],
)
def test_each_peer_gets_its_own_slice_of_the_gpus(peers, gpus, k, want):
    envs = assign_devices(peers, [str(i) for i in range(gpus)], k, env={})
    assert _cvd(envs) == want
    assert [e["LOCAL_RANK"] for e in envs] == [str(i) for i in range(peers)]
    assert [e["RAVNEST_LOCAL_RANK"] for e in envs] == [str(i) for i in range(peers)]
    assert all("XLA_PYTHON_CLIENT_MEM_FRACTION" not in e for e in envs)  # no sharing


def test_an_existing_cuda_visible_devices_list_is_what_is_split():
    gpus = visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5, 7,GPU-ab12"})
    assert gpus == ["3", "5", "7", "GPU-ab12"]
    assert _cvd(assign_devices(2, gpus, None, env={})) == ["3,5", "7,GPU-ab12"]


@pytest.mark.parametrize(("value", "want"), [("", []), ("-1", []), ("0,-1,1", ["0"]), ("2", ["2"])])
def test_cuda_visible_devices_hides_what_cuda_hides(value, want):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": value}) == want


@pytest.mark.parametrize(
    ("peers", "gpus", "cvd", "frac"),
    [
        (3, 1, ["0", "0", "0"], ["0.30", "0.30", "0.30"]),
        (2, 1, ["0", "0"], ["0.45", "0.45"]),
        (3, 2, ["0", "1", "0"], ["0.45", "0.90", "0.45"]),  # GPU 0 holds two peers, GPU 1 one
    ],
)
def test_more_peers_than_gpus_share_them_round_robin_with_a_memory_share(peers, gpus, cvd, frac):
    envs = assign_devices(peers, [str(i) for i in range(gpus)], None, env={})
    assert _cvd(envs) == cvd
    assert [e["XLA_PYTHON_CLIENT_MEM_FRACTION"] for e in envs] == frac
    assert all(e["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" for e in envs)


def test_what_the_user_set_for_the_allocator_wins():
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    envs = assign_devices(4, ["0"], None, env=env)
    assert all("XLA_PYTHON_CLIENT_MEM_FRACTION" not in e and "XLA_PYTHON_CLIENT_PREALLOCATE" not in e for e in envs)


@pytest.mark.parametrize("k", [None, 1, 4])
def test_without_a_gpu_only_the_local_rank_is_set_and_said_once(k):
    envs = assign_devices(3, [], k, env={})
    assert envs == [{"LOCAL_RANK": str(i), "RAVNEST_LOCAL_RANK": str(i)} for i in range(3)]
    line = describe_devices(envs, [], k)
    assert "no GPU" in line and ("changes nothing" in line) == (k is not None)


@pytest.mark.parametrize(
    ("peers", "gpus", "k", "match"),
    [
        (3, 4, 2, r"--peers 3 x --devices-per-peer 2 needs 6 GPUs, 4 visible"),
        (2, 1, 1, r"needs 2 GPUs, 1 visible"),
        (2, 4, 0, r"--devices-per-peer must be an integer >= 1, got 0"),
        (0, 4, None, r"--peers must be an integer >= 1, got 0"),
    ],
)
def test_asking_for_too_much_is_a_one_line_error(peers, gpus, k, match):
    with pytest.raises(ValueError, match=match):
        assign_devices(peers, [str(i) for i in range(gpus)], k, env={})


def test_the_compile_cache_defaults_to_the_xdg_cache_dir(tmp_path):
    assert default_compilation_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "ravnest_jax" / "xla"
    assert default_compilation_cache_dir({"XDG_CACHE_HOME": "", "HOME": "/h"}) == Path("/h/.cache/ravnest_jax/xla")
    env = compile_cache_env({"XDG_CACHE_HOME": str(tmp_path)})
    assert env == {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "ravnest_jax" / "xla"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
    }
    user = {"JAX_COMPILATION_CACHE_DIR": "/c", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "3"}
    assert compile_cache_env(user) == {"JAX_COMPILATION_CACHE_DIR": "/c"}
    assert compile_cache_env(user, path="/d") == {"JAX_COMPILATION_CACHE_DIR": "/d"}


def _local(args, env=None, timeout=60):
    """The launcher with ``env`` over this process' environment less the variables it sets."""
    mine = ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")
    mine += ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "RAVNEST_COMPILE_CACHE")
    base = {k: v for k, v in os.environ.items() if k not in mine}
    return subprocess.run(
        [*LAUNCH, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, **(env or {})},
    )


@pytest.mark.timeout(60)
def test_too_many_devices_is_one_line_before_anything_starts(tmp_path):
    script = tmp_path / "peer.py"
    script.write_text("raise SystemExit('started')\n")
    r = _local(
        ["--peers", "3", "--devices-per-peer", "2", "--", "python", str(script)], {"CUDA_VISIBLE_DEVICES": "0,1"}
    )
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == ["error: --peers 3 x --devices-per-peer 2 needs 6 GPUs, 2 visible (0,1)"], (
        r.stderr
    )
    assert "rendezvous" not in r.stdout and "started" not in r.stderr
    r = _local(["--peers", "2", "--devices-per-peer", "0", "--", "python", str(script)])
    assert r.returncode == 2 and "--devices-per-peer" in r.stderr, r.stderr


_ENV_SCRIPT = (
    "import json, os\n"
    "keys = ('LOCAL_RANK', 'RAVNEST_LOCAL_RANK', 'CUDA_VISIBLE_DEVICES', 'XLA_PYTHON_CLIENT_MEM_FRACTION',\n"
    "        'XLA_PYTHON_CLIENT_PREALLOCATE', 'JAX_COMPILATION_CACHE_DIR', 'RAVNEST_COMPILE_CACHE',\n"
    "        'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS')\n"
    "print(json.dumps({k: os.environ.get(k) for k in keys}))\n"
)


def _envs(stdout):
    out = {}
    for line in stdout.splitlines():
        name, _, rest = line.partition("] ")
        if name.startswith("[peer") and rest.startswith("{"):
            out[name[1:]] = json.loads(rest)
    return out


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_the_peers_get_their_devices_and_the_compile_cache(tmp_path):
    """3 peers on 2 (pretended) GPUs: round-robin with a memory share, the local ranks, and
    the compilation cache under $XDG_CACHE_HOME; --no-compile-cache turns it off."""
    script = tmp_path / "peer.py"
    script.write_text(_ENV_SCRIPT)
    env = {"CUDA_VISIBLE_DEVICES": "4,6", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    r = _local(["--peers", "3", "--no-progress", "--", "python", str(script)], env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "devices (2 GPUs): peer0: GPU 4 (mem fraction 0.45), peer1: GPU 6 (mem fraction 0.90)" in r.stdout
    got = _envs(r.stdout)
    assert sorted(got) == ["peer0", "peer1", "peer2"], r.stdout
    for i, (_, e) in enumerate(sorted(got.items())):
        assert e["LOCAL_RANK"] == e["RAVNEST_LOCAL_RANK"] == str(i), e
        assert e["CUDA_VISIBLE_DEVICES"] == ["4", "6", "4"][i], e
        assert e["XLA_PYTHON_CLIENT_MEM_FRACTION"] == ["0.45", "0.90", "0.45"][i], e
        assert e["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false", e
        assert e["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "xdg" / "ravnest_jax" / "xla"), e
        assert e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0.5" and e["RAVNEST_COMPILE_CACHE"] is None, e
    r = _local(
        ["--peers", "1", "--devices-per-peer", "2", "--no-compile-cache", "--no-progress", "--", "python", str(script)],
        {**env, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine")},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (e,) = _envs(r.stdout).values()
    assert e["CUDA_VISIBLE_DEVICES"] == "4,6" and e["XLA_PYTHON_CLIENT_MEM_FRACTION"] is None, e
    assert e["JAX_COMPILATION_CACHE_DIR"] is None and e["RAVNEST_COMPILE_CACHE"] == "0", e
