#!/usr/bin/env python3
"""Validates ``ravnest-jax plan``'s round model against bench_utilization's measured cells.

    python benchmarks/validate_plan.py                          # the fit cells (utilization.json)
    python benchmarks/validate_plan.py --heldout benchmarks/results/utilization_heldout.json \
        --remeasured benchmarks/results/utilization_remeasured.json

The model's constants (``ravnest_jax.tools.CALIBRATION``) are fitted from
``benchmarks/results/utilization.json`` by ``calibrate``; every cell of it is then predicted
(``fit_cells``). With ``--heldout``, the cells of a separate run of bench_utilization (not used
in the fit) are predicted with the same constants (``heldout_cells``); with ``--remeasured``, the
cells of a run that measures some of the sweep's links again with more rounds
(``remeasured_cells``). Writes
``benchmarks/results/plan_validation.json`` and prints the tables of ``docs/planning.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _common import machine_info  # noqa: E402

from ravnest_jax.tools import CALIBRATION, calibrate, validate  # noqa: E402


def _table(rows: list[dict]) -> str:
    modes = sorted({r["mode"] for r in rows}, key=lambda m: [r["mode"] for r in rows].index(m))
    links = sorted({(r["mbit"], r["rtt_ms"]) for r in rows}, key=lambda x: (x[1], x[0]))
    by = {(r["mode"], r["mbit"], r["rtt_ms"]): r for r in rows}
    head = "| mode | " + " | ".join(f"{b:g}/{t:g}" for b, t in links) + " |"
    lines = [head, "|" + "---|" * (len(links) + 1)]
    for m in modes:
        cells = []
        for b, t in links:
            r = by.get((m, b, t))
            cells.append("" if r is None else f"{100 * r['measured']:.1f}/{100 * r['predicted']:.1f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _stats(rows: list[dict]) -> dict:
    e = np.abs([r["error_points"] for r in rows])
    return {
        "cells": len(rows),
        "max_error_points": float(e.max()),
        "median_error_points": float(np.median(e)),
        "within_3_points": int((e <= 3).sum()),
        "worst": sorted(rows, key=lambda r: -abs(r["error_points"]))[:8],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", default=str(HERE / "results" / "utilization.json"))
    ap.add_argument("--heldout", default=None, help="a bench_utilization JSON not used in the fit")
    ap.add_argument("--remeasured", default=None, help="a bench_utilization JSON re-measuring the sweep's links")
    ap.add_argument("--out", default=str(HERE / "results" / "plan_validation.json"))
    args = ap.parse_args()
    fit = json.loads(Path(args.fit).read_text())
    cal = calibrate(fit)
    if (cal.c_round, cal.k_rtt, cal.c_dp, cal.overhead) != (
        CALIBRATION.c_round,
        CALIBRATION.k_rtt,
        CALIBRATION.c_dp,
        CALIBRATION.overhead,
    ):
        print(f"note: the fit differs from CALIBRATION; update ravnest_jax/tools/_round_plan.py: {cal}")
    out = {
        "benchmark": "plan_validation",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "calibration": {"c_round": cal.c_round, "k_rtt": cal.k_rtt, "c_dp": cal.c_dp, "overhead": cal.overhead},
    }
    sets = [("fit", "fit cells (measured/predicted utilisation %, columns Mbit/s / RTT ms)", args.fit)]
    sets += [("heldout", "held-out cells", args.heldout), ("remeasured", "re-measured cells", args.remeasured)]
    for key, title, path in sets:
        if not path:
            continue
        out[f"{key}_source"] = str(Path(path).name)
        out[f"{key}_cells"] = validate(json.loads(Path(path).read_text()), CALIBRATION)
        out[f"{key}_stats"] = _stats(out[f"{key}_cells"])
        print(f"\n{title}:")
        print(_table(out[f"{key}_cells"]))
        print(json.dumps({k: v for k, v in out[f"{key}_stats"].items() if k != "worst"}))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
