"""``ravnest-jax report SUMMARY.json``: PNGs of a run from its summary.

The summary is the main job's (``examples/char_lm/main.py --summary-json``, also written by
default under ``runs/``) or any JSON of the same shape: ``{"peers": [{"peer": id, "params":
n (optional), "round_log": [RoundMetrics as a dict, plus "train_loss" / "eval_loss" when
known], ...}], "data_parallel_bytes_per_peer": bytes (optional)}``.

Writes, next to the summary (or into ``out_dir``):

- ``SUMMARY.loss.png``: train (and eval) loss per round, per peer and their mean;
- ``SUMMARY.utilisation.png``: compute utilisation and stall seconds per round, per peer;
- ``SUMMARY.bytes.png``: bytes each peer sent per round against what data-parallel training
  (an fp32 all-reduce of the gradient every step) sends over the same steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["load_summary", "write_report"]


def load_summary(path: str | Path) -> dict[str, Any]:
    """The summary at ``path``, checked to have per-peer round logs.

    Raises:
      ValueError: the file is missing, not JSON, or has no ``peers`` with a ``round_log``.
    """
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    peers = d.get("peers") if isinstance(d, dict) else None
    if not isinstance(peers, list) or not any(isinstance(x, dict) and x.get("round_log") for x in peers):
        raise ValueError(
            f"{path}: no per-round logs (expected 'peers': [{{'peer': ..., 'round_log': [...]}}], as the main job's "
            "--summary-json writes)"
        )
    return d


def _series(peers: list[dict], key: str) -> dict[str, tuple[list[int], list[float]]]:
    out = {}
    for p in peers:
        log = p.get("round_log")
        rows = [
            r
            for r in (log if isinstance(log, list) else [])
            if isinstance(r, dict)
            and r.get("ok")
            and isinstance(r.get(key), (int, float))
            and not isinstance(r.get(key), bool)
            and isinstance(r.get("step"), int)
        ]
        if rows:
            out[str(p.get("peer", "?"))] = ([int(r["step"]) for r in rows], [float(r[key]) for r in rows])
    return out


def write_report(summary: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Writes the three PNGs of ``summary`` (see the module docstring); returns their paths.

    Raises:
      ValueError: see :func:`load_summary`.
      ImportError: matplotlib is not installed.
    """
    d = load_summary(summary)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    src = Path(summary)
    out = Path(out_dir) if out_dir is not None else src.parent
    out.mkdir(parents=True, exist_ok=True)
    stem = src.name[: -len(".json")] if src.name.endswith(".json") else src.name
    peers = [p for p in d["peers"] if isinstance(p, dict)]
    paths = []

    # loss per round
    fig, ax = plt.subplots(figsize=(8, 4.5))
    train = _series(peers, "train_loss")
    for name, (x, y) in sorted(train.items()):
        ax.plot(x, y, marker=".", lw=1, alpha=0.6, label=f"{name} train")
    if train:
        steps = sorted({s for x, _ in train.values() for s in x})
        mean = [np.mean([y[x.index(s)] for x, y in train.values() if s in x]) for s in steps]
        ax.plot(steps, mean, color="black", lw=2.2, label="mean train")
    evals = _series(peers, "eval_loss")
    for name, (x, y) in sorted(evals.items()):
        ax.plot(x, y, ls="--", marker="o", lw=1.2, label=f"{name} eval")
    if not train and not evals:
        ax.text(0.5, 0.5, "no loss in the round logs", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("inner step of the round")
    ax.set_ylabel("loss")
    ax.set_title("Loss per outer round")
    ax.grid(alpha=0.3)
    if train or evals:
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    paths.append(out / f"{stem}.loss.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # utilisation and stalls per peer
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, (x, y) in sorted(_series(peers, "compute_utilisation").items()):
        a1.plot(x, [100 * v for v in y], marker=".", label=name)
    for name, (x, y) in sorted(_series(peers, "stall_seconds").items()):
        a2.plot(x, y, marker=".", label=name)
    a1.set_ylabel("compute utilisation (%)")
    a1.set_title("Utilisation and stalls per round, per peer")
    a2.set_ylabel("stall (s)")
    a2.set_xlabel("inner step of the round")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    paths.append(out / f"{stem}.utilisation.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # bytes per round against data-parallel
    fig, ax = plt.subplots(figsize=(8, 4.5))
    sent = _series(peers, "bytes_sent")
    n = max(len(peers), 2)
    dp_line = None
    for name, (x, y) in sorted(sent.items()):
        ax.plot(x, y, marker=".", label=f"{name} sent")
    params = next((int(p["params"]) for p in peers if isinstance(p.get("params"), (int, float))), None)
    if params and sent:
        x0, _ = next(iter(sent.values()))
        h = int(np.median(np.diff(x0))) if len(x0) > 1 else int(x0[0]) or 1
        dp_line = 2 * (n - 1) / n * 4 * params * h
        ax.axhline(dp_line, color="red", ls="--", label=f"data-parallel, {h} steps (fp32 every step)")
    ax.set_yscale("log")
    ax.set_xlabel("inner step of the round")
    ax.set_ylabel("bytes sent per round")
    title = "Bytes per round"
    if dp_line and sent:
        mean_sent = np.mean([v for _, y in sent.values() for v in y])
        title += f" ({dp_line / max(mean_sent, 1):,.0f}x fewer than data-parallel)"
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    if sent:
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / f"{stem}.bytes.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
