"""What ``ravnest-jax local`` sets in each peer's environment beside the swarm's variables: its
local rank, its GPUs (torchrun-style), its share of a shared GPU's memory, and JAX's persistent
compilation cache. Pure functions of their arguments (the GPU list is found once, without
importing jax), so they are tested without a GPU.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence

__all__ = [
    "DEVICE_ENV",
    "SHARED_MEM_FRACTION",
    "assign_devices",
    "compile_cache_env",
    "describe_devices",
    "visible_gpus",
]

#: what the launcher sets per peer beside :data:`PEER_ENV`: the local rank (torchrun's name and
#: ours) and, where GPUs exist, the peer's devices and its share of their memory
DEVICE_ENV = (
    "LOCAL_RANK",
    "RAVNEST_LOCAL_RANK",
    "CUDA_VISIBLE_DEVICES",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
)

#: of each GPU's memory, the share that peers sharing it get together (JAX alone takes 0.75)
SHARED_MEM_FRACTION = 0.9


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs this launcher may hand out, without importing jax: the entries of
    ``CUDA_VISIBLE_DEVICES`` when it is set (indices or UUIDs, as written; empty or ``-1``:
    none), else ``0 .. n-1`` for the ``n`` GPUs that ``nvidia-smi -L`` lists, or, without
    ``nvidia-smi``, the entries of ``/proc/driver/nvidia/gpus/``; ``[]`` without an NVIDIA
    driver."""
    env = os.environ if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        ids = [s.strip() for s in cvd.split(",") if s.strip()]
        # CUDA stops at the first invalid entry: "-1" (or anything negative) hides the rest
        out = []
        for s in ids:
            if s.lstrip("-").isdigit() and int(s) < 0:
                break
            out.append(s)
        return out
    n = 0
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
            if r.returncode == 0:
                n = sum(1 for line in r.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            n = 0
    if n == 0:
        try:
            n = len(os.listdir("/proc/driver/nvidia/gpus"))
        except OSError:
            n = 0
    return [str(i) for i in range(n)]


def assign_devices(
    peers: int,
    gpus: Sequence[str],
    devices_per_peer: int | None = None,
    env: Mapping[str, str] | None = None,
) -> list[dict[str, str]]:
    """The environment each of ``peers`` local peers gets for its devices (torchrun-style): a
    pure function of the GPU list, so it is testable without a GPU.

    Every peer ``i`` gets ``LOCAL_RANK`` and ``RAVNEST_LOCAL_RANK`` = ``i``. With GPUs:

    - ``devices_per_peer=K``: peer ``i`` gets ``CUDA_VISIBLE_DEVICES`` = ``gpus[i*K:(i+1)*K]``;
    - ``None`` and ``peers <= len(gpus)``: the same with ``K = len(gpus) // peers`` (an even
      split; ``len(gpus) % peers`` GPUs stay unused);
    - ``None`` and ``peers > len(gpus)``: the peers share, round-robin (peer ``i`` on
      ``gpus[i % len(gpus)]``); each gets ``XLA_PYTHON_CLIENT_MEM_FRACTION`` =
      :data:`SHARED_MEM_FRACTION` / (peers on its GPU), two decimals, and
      ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (a peer takes its memory as it needs it, up to
      that share), each unless ``env`` sets it already.

    Without GPUs (``gpus == []``) only the local ranks are set.

    Args:
      peers: local peer processes (int >= 1).
      gpus: the visible GPUs (:func:`visible_gpus`): ``CUDA_VISIBLE_DEVICES`` entries.
      devices_per_peer: GPUs per peer (int >= 1), or ``None`` for the default above.
      env: the launcher's environment (default ``os.environ``): what the user set wins.

    Returns:
      ``peers`` dicts of environment variables (names from :data:`DEVICE_ENV`).

    Raises:
      ValueError: ``peers`` or ``devices_per_peer`` < 1, or ``peers * devices_per_peer`` more
        than the GPUs there are (one line).
    """
    env = os.environ if env is None else env
    if not isinstance(peers, int) or peers < 1:
        raise ValueError(f"--peers must be an integer >= 1, got {peers!r}")
    if devices_per_peer is not None and (not isinstance(devices_per_peer, int) or devices_per_peer < 1):
        raise ValueError(f"--devices-per-peer must be an integer >= 1, got {devices_per_peer!r}")
    gpus = list(gpus)
    out = [{"LOCAL_RANK": str(i), "RAVNEST_LOCAL_RANK": str(i)} for i in range(peers)]
    if not gpus:
        return out
    if devices_per_peer is not None and peers * devices_per_peer > len(gpus):
        raise ValueError(
            f"--peers {peers} x --devices-per-peer {devices_per_peer} needs {peers * devices_per_peer} GPUs, "
            f"{len(gpus)} visible ({','.join(gpus)})"
        )
    if devices_per_peer is not None or peers <= len(gpus):
        k = devices_per_peer or len(gpus) // peers
        for i, e in enumerate(out):
            e["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * k : (i + 1) * k])
        return out
    sharing = collections.Counter(i % len(gpus) for i in range(peers))
    for i, e in enumerate(out):
        g = i % len(gpus)
        e["CUDA_VISIBLE_DEVICES"] = gpus[g]
        if "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env:
            e["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{SHARED_MEM_FRACTION / sharing[g]:.2f}"
        if "XLA_PYTHON_CLIENT_PREALLOCATE" not in env:
            e["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return out


def describe_devices(envs: Sequence[Mapping[str, str]], gpus: Sequence[str], devices_per_peer: int | None) -> str:
    """One line on how the peers' devices were assigned (for the launcher's first lines)."""
    if not gpus:
        note = ": --devices-per-peer changes nothing" if devices_per_peer is not None else ""
        return f"devices: no GPU found (CUDA_VISIBLE_DEVICES, nvidia-smi -L, /proc/driver/nvidia/gpus){note}"
    parts = []
    for i, e in enumerate(envs):
        frac = e.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        parts.append(f"peer{i}: GPU {e['CUDA_VISIBLE_DEVICES'] or '-'}" + (f" (mem fraction {frac})" if frac else ""))
    return f"devices ({len(gpus)} GPUs): " + ", ".join(parts)


# ---------------------------------------------------------------------- compilation cache
def compile_cache_env(env: Mapping[str, str] | None = None, path: str | None = None) -> dict[str, str]:
    """The environment that turns on JAX's persistent compilation cache in a peer:
    ``JAX_COMPILATION_CACHE_DIR`` (``path``, else the one ``env`` sets, else
    :func:`ravnest_jax.default_compilation_cache_dir`) and
    ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` (unless ``env`` sets it). JAX reads both
    at import. The peers of one machine share the directory: entries are keyed by the program,
    the jax version, the backend and the flags; a peer reading an entry another is still
    writing fails to decompress it, and JAX warns and compiles.
    """
    from ._compile_cache import DEFAULT_MIN_COMPILE_TIME_SECS, default_compilation_cache_dir

    env = os.environ if env is None else env
    out = {
        "JAX_COMPILATION_CACHE_DIR": path
        or env.get("JAX_COMPILATION_CACHE_DIR")
        or str(default_compilation_cache_dir(env))
    }
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in env:
        out["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(DEFAULT_MIN_COMPILE_TIME_SECS)
    return out
