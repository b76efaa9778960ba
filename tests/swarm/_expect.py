"""Expected results of the worker's deterministic inputs (shared by the tests)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

_spec = importlib.util.spec_from_file_location("_swarm_worker", Path(__file__).parent / "_worker.py")
_worker = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(_worker)  # type: ignore[union-attr]


def flat_input(seed: int, i: int, size: int) -> np.ndarray:
    t = _worker.make_tree(seed, i, size)
    return np.concatenate([np.reshape(t["b"]["s"], 1), t["b"]["x"], t["w"]]).astype(np.float64)


def expected_mean(seeds_weights: list[tuple[int, float]], i: int, size: int) -> np.ndarray:
    num = sum(w * flat_input(s, i, size) for s, w in seeds_weights)
    return num / sum(w for _, w in seeds_weights)


def check_round(
    peers: dict[str, tuple[int, float]],
    events: dict[str, dict],
    i: int,
    size: int,
    contributors: list[str],
    rtol: float = 1e-6,
    atol: float = 1e-6,
) -> None:
    """All ``events`` (peer -> round event) are ok, agree, and match the numpy mean."""
    digests = {e["digest"] for e in events.values()}
    assert all(e["ok"] for e in events.values()), events
    assert len(digests) == 1, f"digests differ: {digests}"
    for e in events.values():
        assert e["contributors"] == sorted(contributors)
    exp = expected_mean([peers[c] for c in contributors], i, size)
    if all(e.get("result_file") for e in events.values()):  # bit-identical everywhere
        blobs = {np.load(e["result_file"]).tobytes() for e in events.values()}
        assert len(blobs) == 1, "results differ although digests agree"
    e = next(iter(events.values()))
    got = (np.load(e["result_file"]) if e.get("result_file") else np.asarray(e["result"], dtype=np.float32)).astype(
        np.float64
    )
    np.testing.assert_allclose(got, exp, rtol=rtol, atol=atol)
