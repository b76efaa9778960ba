"""``bench_convergence.py --codec-report A.json B.json ...``: compressed DiLoCo against fp32
DiLoCo, from sweep results (``--sweep``), side by side with the bytes.

Every DiLoCo cell with a codec is paired with the fp32 cell of the same length, H, inner optimizer
and learning rate and seeds, twice: the fp32 cell with the same outer step (``same_outer``: only
the codec differs) and the best fp32 cell of those (``best_fp32``: each side at its best outer
learning rate and momentum). Gaps are per seed (``100 (loss / fp32 loss - 1)``), then mean and
standard deviation. The bytes: bits per parameter per direction of the codecs' payload
(``_sweep.bits_per_round``, scales included), and the exact bytes a peer sends a round in a swarm
of 4 (:func:`round_bytes`: its parts of its own message and its result part to each other member,
message headers and the per-leaf padding of block codecs included: what the swarm counts), the
most any peer sends, against data-parallel's ring all-reduce of float32 gradients at every step,
``2 (N - 1) / N * 4 * params * H`` bytes a round. ``bench_wire_ratio.py`` measures the same on the
wire.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from _sweep import Cell, bits_per_round


def round_bytes(codec: str, peers: int = 4) -> tuple[int, int]:
    """``(bytes, params)``: the most bytes one peer of ``peers`` sends in a butterfly round of the
    char-LM (the example's model) with the sweep codec spec ``codec`` (``"fp32"``, ``"sign:mef"``,
    ``"sign:512/int2:512:mef"``), from the wire format (``ravnest_jax.compress``)."""
    import jax
    from _sweep import parse_codec

    import char_lm
    from ravnest_jax import compress as C
    from ravnest_jax.compress._wire import message_nbytes
    from ravnest_jax.swarm.wire._codec import PartLayout, part_chunks

    up_spec, _, down_spec = codec.partition("/")
    up, opts, _, _ = parse_codec(up_spec)
    down = parse_codec(down_spec)[0] if down_spec else up
    leaves = jax.tree.leaves(char_lm.build_model(char_lm.ModelConfig())[1])
    tree = {f"{i:03d}": np.ones(x.shape, np.float32) for i, x in enumerate(leaves)}
    own = C.host_pack(tree, up, **opts)
    layout = PartLayout.of(own)
    bounds = layout.bounds(peers)
    most = 0
    for k, (lo, hi) in enumerate(bounds):
        parts = sum(len(b"".join(map(bytes, part_chunks(own, layout, *bounds[j])))) for j in range(peers) if j != k)
        pieces = [np.ones(b - a, np.float32) for _, a, b in layout.pieces(lo, hi)]
        most = max(most, parts + (peers - 1) * message_nbytes(C.host_pack(pieces, down, **opts)))
    return most, int(sum(x.size for x in leaves))


def _gaps(c: dict, ref: dict) -> list[float]:
    return [100 * (a / b - 1) for a, b in zip(c["eval_loss"], ref["eval_loss"])]


def codec_rows(cells: list[dict]) -> list[dict[str, Any]]:
    """One row per compressed DiLoCo cell (see the module docstring)."""
    full = [{**c, "cell": {**Cell(c["cell"]["algo"], c["cell"]["steps"]).__dict__, **c["cell"]}} for c in cells]
    dil = [c for c in full if c["cell"]["algo"] == "diloco" and not c["cell"].get("dp_warm_steps")]

    def group(c: dict) -> tuple:
        k = c["cell"]
        return (k["steps"], k["sync_every"], k["inner"], k["inner_lr"], k["warmup"], tuple(c["seeds"]))

    fp32 = [c for c in dil if c["cell"]["codec"] == "fp32"]
    rows = []
    for c in dil:
        k = c["cell"]
        if k["codec"] == "fp32":
            continue
        refs = [f for f in fp32 if group(f) == group(c)]
        if not refs:
            continue
        outer = ("outer_lr", "outer_momentum", "nesterov")
        same = [f for f in refs if all(f["cell"][o] == k[o] for o in outer)]
        best = min(refs, key=lambda f: f["eval_loss_mean"])
        sent, n = round_bytes(k["codec"])
        bits = bits_per_round(k["codec"], n)  # up + down
        row = {
            "key": c["key"],
            "codec": k["codec"],
            "steps": k["steps"],
            "sync_every": k["sync_every"],
            "outer": f"lr {k['outer_lr']:g}, momentum {k['outer_momentum']:g}{' Nesterov' if k['nesterov'] else ''}",
            "ef_decay": k["ef_decay"],
            "seeds": c["seeds"],
            "eval_loss": c["eval_loss"],
            "eval_loss_mean": c["eval_loss_mean"],
            "bits_up_plus_down": bits,
            "bytes_per_round_4_peers": sent,
            "ratio_vs_data_parallel": 2 * 3 / 4 * 4 * n * k["sync_every"] / sent,
        }
        for name, ref in (("same_outer", same[0] if same else None), ("best_fp32", best)):
            if ref is None:
                continue
            g = _gaps(c, ref)
            row[f"{name}_key"] = ref["key"]
            row[f"{name}_eval_loss_mean"] = ref["eval_loss_mean"]
            row[f"gap_vs_{name}_pct"] = g
            row[f"gap_vs_{name}_pct_mean"] = float(np.mean(g))
            row[f"gap_vs_{name}_pct_std"] = float(np.std(g))
        rows.append(row)
    return sorted(rows, key=lambda r: (r["steps"], r["gap_vs_best_fp32_pct_mean"]))


def codec_report(paths: list[str], out: Path, machine_info) -> int:
    """Merges the cells of ``paths`` (later files win for the same key and seeds), writes ``out``
    (rows, table) and its PNG, prints the table."""
    cells: dict[tuple, dict] = {}
    sources = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        sources.append({"file": os.path.basename(p), "command": doc.get("command"), "machine": doc.get("machine")})
        for c in doc.get("cells", []):
            cells[(c["key"], tuple(c["seeds"]))] = c
    rows = codec_rows(list(cells.values()))
    lines = [
        "| cell (compressed) | bits up+down | ratio vs DP | eval loss | vs fp32, same outer | vs best fp32 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = (
            f"{r['gap_vs_same_outer_pct_mean']:+.2f}% ±{r['gap_vs_same_outer_pct_std']:.2f}"
            if "gap_vs_same_outer_pct_mean" in r
            else ""
        )
        lines.append(
            f"| {r['key']} | {r['bits_up_plus_down']:.3f} | {r['ratio_vs_data_parallel']:.0f}x | "
            f"{r['eval_loss_mean']:.4f} | {same} | "
            f"{r['gap_vs_best_fp32_pct_mean']:+.2f}% ±{r['gap_vs_best_fp32_pct_std']:.2f} |"
        )
    doc = {
        "benchmark": "convergence_codecs",
        "command": "python benchmarks/bench_convergence.py --codec-report " + " ".join(paths) + f" --out {out}",
        "machine": machine_info(),
        "merged_from": sources,
        "rows": rows,
        "table": "\n".join(lines),
    }
    out.write_text(json.dumps(doc, indent=1))
    plot_codecs(rows, out.with_suffix(".png"))
    print(doc["table"])
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot_codecs(rows: list[dict], path: Path) -> None:
    """Gap against the best fp32 DiLoCo (per-seed std as error bars) against the byte ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for steps, color in zip(sorted({r["steps"] for r in rows}), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        rs = [r for r in rows if r["steps"] == steps]
        ax.errorbar(
            [r["ratio_vs_data_parallel"] for r in rs],
            [r["gap_vs_best_fp32_pct_mean"] for r in rs],
            yerr=[r["gap_vs_best_fp32_pct_std"] for r in rs],
            fmt="o",
            capsize=3,
            color=color,
            label=f"{steps} steps",
        )
        for r in rs:
            ax.annotate(
                f"{r['codec']} H{r['sync_every']} olr{r['outer'].split()[1].rstrip(',')}"
                + (f" ef{r['ef_decay']:g}" if r["ef_decay"] != 1.0 else ""),
                (r["ratio_vs_data_parallel"], r["gap_vs_best_fp32_pct_mean"]),
                fontsize=6,
                xytext=(4, 2),
                textcoords="offset points",
            )
    ax.axhline(1.0, color="r", ls="--", lw=1, label="goal: within 1% of fp32 DiLoCo")
    ax.axvline(1000, color="k", ls=":", lw=1, label="1000x fewer bytes than data-parallel")
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes of data-parallel / bytes of DiLoCo (a peer of 4, wire format with headers)")
    ax.set_ylabel("eval loss vs the best fp32 DiLoCo, same length (%)")
    ax.set_title("compressed DiLoCo rounds: quality against bytes (mean of seeds, ± per-seed std)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
