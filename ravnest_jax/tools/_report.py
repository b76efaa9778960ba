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

A pipelined run (``main.py --stages S``: peers with a ``stage`` and a ``cluster``, and the
``stage_param_bytes`` of their stage instead of ``params``) is plotted per stage group (the peers
that hold one stage, one per cluster, average with DiLoCo among themselves): a column per stage
in the utilisation and bytes plots, and each cluster's loss (its last stage's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["load_summary", "write_report"]


def load_summary(path: str | Path) -> dict[str, Any]:
    """The summary at ``path``, checked to have per-peer round logs: ``peers`` (a local swarm's),
    or one peer's ``peer_result`` (a peer of a swarm on separate machines; taken as ``peers`` of
    one).

    Raises:
      ValueError: the file is missing, not JSON, or has no ``peers`` (or ``peer_result``) with a
      ``round_log``.
    """
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    one = d.get("peer_result") if isinstance(d, dict) and "peers" not in d else None
    if isinstance(one, dict):  # one peer's summary (the main job's --rendezvous --summary-json)
        d = {**d, "peers": [one]}
    peers = d.get("peers") if isinstance(d, dict) else None
    if not isinstance(peers, list) or not any(isinstance(x, dict) and x.get("round_log") for x in peers):
        raise ValueError(
            f"{path}: no per-round logs (expected 'peers': [{{'peer': ..., 'round_log': [...]}}], as the main job's "
            "--summary-json writes; ravnest-jax local --summary-json holds only exit codes)"
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


def _groups(peers: list[dict]) -> list[tuple[str, list[dict]]]:
    """The stage groups of a pipelined run (``--stages``: the peers that hold one stage, one per
    cluster, are a DiLoCo run of their own), by stage; else one group of every peer."""
    by: dict[int, list[dict]] = {}
    for p in peers:
        if isinstance(p.get("stage"), int) and not isinstance(p.get("stage"), bool):
            by.setdefault(int(p["stage"]), []).append(p)
    if not by:
        return [("", peers)]
    return [(f"stage {s}", by[s]) for s in sorted(by)]


def _label(p: dict) -> str:
    name = str(p.get("peer", "?"))
    return f"{name} (cluster {p['cluster']})" if isinstance(p.get("cluster"), int) else name


def _named(peers: list[dict]) -> list[dict]:
    return [{**p, "peer": _label(p)} for p in peers]


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def write_report(summary: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Writes the three PNGs of ``summary`` (see the module docstring); returns their paths.

    A pipelined run's summary (``--stages``: peers with a ``stage`` and a ``cluster``) is plotted
    per stage group: one column of the utilisation and bytes plots per stage, and the loss of
    each cluster (its last stage reports it).

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
    groups = _groups(peers)
    staged = groups[0][0] != ""
    paths = []

    # loss per round
    fig, ax = plt.subplots(figsize=(8, 4.5))
    train = _series(_named(peers), "train_loss")
    for name, (x, y) in sorted(train.items()):
        ax.plot(x, y, marker=".", lw=1, alpha=0.6, label=f"{name} train")
    if len(train) > 1:
        steps = sorted({s for x, _ in train.values() for s in x})
        mean = [np.mean([y[x.index(s)] for x, y in train.values() if s in x]) for s in steps]
        ax.plot(steps, mean, color="black", lw=2.2, label="mean train")
    evals = _series(_named(peers), "eval_loss")
    for name, (x, y) in sorted(evals.items()):
        ax.plot(x, y, ls="--", marker="o", lw=1.2, label=f"{name} eval")
    ends: dict[tuple, list[str]] = {}  # a pipelined cluster: its eval loss at the start and the end
    for p in _named(peers):
        if p["peer"] not in evals and _num(p.get("eval_loss_start")) and _num(p.get("eval_loss_end")):
            end = p.get("end_step") if _num(p.get("end_step")) else max(train.get(p["peer"], ([0],))[0])
            key = (int(end), float(p["eval_loss_start"]), float(p["eval_loss_end"]))
            ends.setdefault(key, []).append(p["peer"])
    for (end, start, last), names in sorted(ends.items()):  # clusters that agree (the global model): one line
        evals[", ".join(names)] = ([0, end], [start, last])
        ax.plot([0, end], [start, last], ls="--", marker="o", lw=1.2, label=f"{', '.join(names)} eval")
    if not train and not evals:
        ax.text(0.5, 0.5, "no loss in the round logs", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("inner step of the round")
    ax.set_ylabel("loss")
    ax.set_title("Loss per outer round" + (" (each cluster's last stage)" if staged else ""))
    ax.grid(alpha=0.3)
    if train or evals:
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    paths.append(out / f"{stem}.loss.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # utilisation and stalls per peer: a column per stage group
    fig, axes = plt.subplots(2, len(groups), figsize=(max(8, 5 * len(groups)), 6), sharex=True, squeeze=False)
    for col, (group, members) in enumerate(groups):
        a1, a2 = axes[0][col], axes[1][col]
        for name, (x, y) in sorted(_series(_named(members), "compute_utilisation").items()):
            a1.plot(x, [100 * v for v in y], marker=".", label=name)
        for name, (x, y) in sorted(_series(_named(members), "stall_seconds").items()):
            a2.plot(x, y, marker=".", label=name)
        if staged:
            pipe = [float(p["utilisation"]) for p in members if _num(p.get("utilisation"))]
            a1.set_title(
                f"{group}: {len(members)} peers"
                + (f", pipeline utilisation {100 * np.mean(pipe):.0f}%" if pipe else ""),
                fontsize=10,
            )
        a1.set_ylabel("compute utilisation (%)")
        a2.set_ylabel("stall (s)")
        a2.set_xlabel("inner step of the round")
        for a in (a1, a2):
            a.grid(alpha=0.3)
            if a.get_lines():
                a.legend(fontsize=8, ncol=2 if staged else 4)
    fig.suptitle("Utilisation and stalls per round, per peer" + (", per stage group" if staged else ""))
    fig.tight_layout()
    paths.append(out / f"{stem}.utilisation.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # bytes per round against data-parallel: a column per stage group
    fig, axes = plt.subplots(1, len(groups), figsize=(max(8, 5 * len(groups)), 4.5), squeeze=False)
    ratios = []
    for col, (group, members) in enumerate(groups):
        ax = axes[0][col]
        sent = _series(_named(members), "bytes_sent")
        n = max(len(members), 2)
        dp_line = None
        for name, (x, y) in sorted(sent.items()):
            ax.plot(x, y, marker=".", label=f"{name} sent")
        params = next((4 * int(p["params"]) for p in members if _num(p.get("params"))), None)
        params = params or next(
            (int(p["stage_param_bytes"]) for p in members if _num(p.get("stage_param_bytes"))), None
        )
        if params and sent:
            x0, _ = next(iter(sent.values()))
            h = int(np.median(np.diff(x0))) if len(x0) > 1 else int(x0[0]) or 1
            dp_line = 2 * (n - 1) / n * params * h
            ax.axhline(dp_line, color="red", ls="--", label=f"data-parallel, {h} steps (fp32 every step)")
            ratios.append(dp_line / max(np.mean([v for _, y in sent.values() for v in y]), 1))
        act = [float(p["activation_bytes_sent"]) for p in members if _num(p.get("activation_bytes_sent"))]
        if staged:
            ax.set_title(
                f"{group}: outer rounds"
                + (f" (activations: {np.mean(act) / 1e6:,.2f} MB out per peer)" if act else ""),
                fontsize=10,
            )
        ax.set_yscale("log")
        ax.set_xlabel("inner step of the round")
        ax.set_ylabel("bytes sent per round")
        ax.grid(alpha=0.3, which="both")
        if sent:
            ax.legend(fontsize=8)
    title = "Bytes per round" + (" per stage group" if staged else "")
    if ratios:
        lo, hi = min(ratios), max(ratios)
        title += (
            f" ({lo:,.0f}x fewer than data-parallel)"
            if hi < 1.05 * lo
            else f" ({lo:,.0f}-{hi:,.0f}x fewer than data-parallel)"
        )
    (fig.suptitle if staged else axes[0][0].set_title)(title)
    fig.tight_layout()
    paths.append(out / f"{stem}.bytes.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
