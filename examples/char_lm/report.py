"""What every mode of the main job reports: the machine, the run's settings as the user stated
them, and strict JSON."""

from __future__ import annotations

import argparse
import os
import platform

import numpy as np


def machine_info() -> dict:
    import jax

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }


def json_safe(value):
    """``value`` with every non-finite float replaced by ``None``: the summary is strict JSON
    (``json.dumps(..., allow_nan=False)``; ``NaN`` is refused by strict parsers)."""
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, (np.floating, np.integer)):
        return json_safe(value.item())
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


_SIMULATION_ONLY = ("replicas", "sync_every_list", "steps")
_INTERNAL = (
    "json_events",
    "join_when_exists",
    "parent_pid",
    "local_peers",
    "rendezvous",
    "simulate",
    "summary_json",
    "no_progress",
    "token_file",
    "peer_id",
    "data_seed",
    "listen",
    "advertise",
)


def run_config(args: argparse.Namespace, **actual) -> dict:
    """The settings of a run as the user would state them: no launcher internals, and the
    values that were actually used (``actual``: the run id, the peers' addresses...); a swarm
    run without the simulation's own settings, with the aggregator it used."""
    out = {k: v for k, v in vars(args).items() if k not in _INTERNAL}
    if getattr(args, "local_peers", None) or getattr(args, "rendezvous", None):
        for k in _SIMULATION_ONLY:
            out.pop(k, None)
        if out.get("aggregator") is None:
            out["aggregator"] = "clipped_mean"  # rj.Swarm's default with the butterfly
    return {**out, **actual}
