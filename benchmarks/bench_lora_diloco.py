"""LoRA-DiLoCo against one process: where 4 peers fall behind, and the outer settings that close it.

The tiny pretrained checkpoint (``tests/fixtures/llm/finetune``: 2 layers, width 64, 384-token
BPE vocabulary) fine-tuned with LoRA on chat data (``examples/recipes/data/make_tiny_chat.py``,
``--conversations`` of them, rendered with the checkpoint's chat template, loss on the
assistant's tokens, packed to 64 tokens with segment ids), AdamW at constant inner lr.

- **One process** (the reference): ``steps`` steps, each on the union of the 4 peers' batches
  of that step (4 x 4 rows): the same tokens as the swarm (equal tokens), synchronous.
- **4 peers, DiLoCo**: the library's own DiLoCo (``rj.diloco`` with ``axis_name``: the replica
  simulation, 4 replicas under ``jax.vmap``, every round's pseudo-gradients through the int4
  codec as the swarm does: encode, decode, mean, encode, decode) around the library's training
  step (``rj.models.make_train_step``, the one ``ravnest-jax finetune`` runs), each replica on its
  own shard (``PackedExamples(shard=k, num_shards=4)``, as the launcher's peers).
  Blocking rounds (the swarm overlaps one step by default; not simulated here).

Every outer setting (``--outer``: name=lr:momentum[:H]) runs over the inner-lr grid and the
seeds (each seed: the adapters' initialisation and the data order). The gap is
``(swarm - one process) / one process`` of the held-out eval loss at the end (positive: the swarm
is behind). Writes ``benchmarks/results/lora_diloco.json`` and ``lora_diloco.png``.

    python benchmarks/bench_lora_diloco.py      # the whole grid, about 10 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples" / "recipes" / "data"))

from _common import machine_info  # noqa: E402

TINY = ROOT / "tests" / "fixtures" / "llm" / "finetune"
PEERS = 4
BATCH = 4
SEQ = 64
OUTERS = {
    # name: (outer lr, Nesterov momentum, H)
    "diloco_0.7_0.9_H10": (0.7, 0.9, 10),  # DiLoCo's defaults (arXiv 2311.08105): rj.default_outer
    "average_H10": (1.0, 0.0, 10),  # plain averaging (FedAvg / local SGD)
    "nesterov_0.7_0.5_H5": (0.7, 0.5, 5),  # the fine-tuning recipes' default
}


def _data(conversations: int, seed: int, work: Path):
    from make_tiny_chat import conversations as make

    from ravnest_jax.data import PackedExamples, load_examples, split_examples

    path = work / f"chat-{conversations}.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps(c) + "\n" for c in make(conversations, seed=1)))
    examples = load_examples(path, TINY, format="messages")
    train, held = split_examples(examples, 0.05, seed=0)  # the same held-out set for every seed
    kw = dict(seq_len=SEQ, batch=BATCH, pad_id=0)
    shards = [PackedExamples(train, shard=k, num_shards=PEERS, seed=seed, **kw) for k in range(PEERS)]
    evals = PackedExamples(held, packing=False, seed=0, **kw)
    return shards, [evals.batch_at(i) for i in range(min(16, len(evals.rows) // BATCH))]


def _batch(d):
    from ravnest_jax.models import TokenBatch

    return TokenBatch(**d)


def run_one(lr: float, seed: int, steps: int, outers: dict, conversations: int, work: Path, rank: int) -> dict:
    """The reference and every outer setting at inner lr ``lr`` and ``seed``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import ravnest_jax as rj
    from ravnest_jax.models import LoraConfig, load_pretrained, make_eval_loss, make_train_step, split_lora

    lm = split_lora(load_pretrained(TINY, lora=LoraConfig(rank=rank, alpha=2.0 * rank, seed=seed)))
    eval_loss = make_eval_loss(lm)
    shards, evals = _data(conversations, seed, work)
    evals = _batch({k: np.stack([e[k] for e in evals]) for k in evals[0]})
    batches = [[s.batch_at(i) for i in range(steps)] for s in shards]  # (peer, step)
    start = float(eval_loss(lm.adapters, lm.frozen, evals))
    out = {"lr": lr, "seed": seed, "eval_loss_start": start}

    # one process, the same tokens: every step on the union of the peers' batches
    tx = optax.adamw(lr, weight_decay=0.0)
    step = make_train_step(lm, tx, donate=False)
    a, o = lm.adapters, tx.init(lm.adapters)
    for i in range(steps):
        union = {k: np.concatenate([batches[p][i][k] for p in range(PEERS)]) for k in batches[0][i]}
        a, o, _ = step(a, o, lm.frozen, _batch(union), jnp.int32(i))
    out["one_process"] = float(eval_loss(a, lm.frozen, evals))

    for name, (olr, momentum, h) in outers.items():
        t0 = time.perf_counter()
        dl = rj.diloco(
            optax.adamw(lr, weight_decay=0.0),
            rj.optim.default_outer(olr, momentum),
            sync_every=h,
            axis_name="peers",
            codec="int4",
            rng_key=jax.random.key(seed),
        )
        # the library's step (a top-level jit) under vmap: 4 replicas, rounds by lax.pmean
        vstep = jax.vmap(make_train_step(lm, dl, donate=False), (0, 0, None, 0, None), axis_name="peers")
        a = rj.optim.replicate(lm.adapters, PEERS)
        o = jax.vmap(dl.init, axis_name="peers")(a)
        per_round = []
        for i in range(steps):
            stacked = {k: np.stack([batches[p][i][k] for p in range(PEERS)]) for k in batches[0][i]}
            a, o, _ = vstep(a, o, lm.frozen, _batch(stacked), jnp.int32(i))
            if (i + 1) % h == 0:
                anchor = rj.optim.unreplicate(o.global_params)
                per_round.append(float(eval_loss(anchor, lm.frozen, evals)))
        loss = per_round[-1]  # steps is a multiple of H: the anchor after the last round
        out[name] = {
            "outer_lr": olr,
            "momentum": momentum,
            "sync_every": h,
            "eval_loss": loss,
            "gap": (loss - out["one_process"]) / out["one_process"],
            "per_round": per_round,
            "seconds": time.perf_counter() - t0,
        }
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs, names, lrs = result["runs"], list(result["outers"]), result["config"]["lrs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6))
    for name in names:
        gaps = np.array([[r[name]["gap"] for r in runs if r["lr"] == lr] for lr in lrs]) * 100
        ax1.errorbar(
            lrs,
            gaps.mean(1),
            yerr=[gaps.mean(1) - gaps.min(1), gaps.max(1) - gaps.mean(1)],
            marker="o",
            capsize=3,
            label=name,
        )
    ax1.axhline(2, ls="--", color="gray", lw=1)
    ax1.axhline(0, color="black", lw=0.6)
    ax1.set_xscale("log")
    ax1.set_xlabel("inner AdamW learning rate")
    ax1.set_ylabel("eval loss gap to one process (%), mean and range over seeds")
    ax1.set_title(f"{PEERS} peers vs one process, {result['config']['steps']} steps, equal tokens")
    ax1.legend(fontsize=8)
    lr = max(lrs)
    r0 = next(r for r in runs if r["lr"] == lr and r["seed"] == result["config"]["seeds"][0])
    for name in names:
        h = result["outers"][name][2]
        ax2.plot(
            [h * (i + 1) for i in range(len(r0[name]["per_round"]))], r0[name]["per_round"], marker=".", label=name
        )
    ax2.axhline(r0["one_process"], ls="--", color="black", lw=1, label="one process (end)")
    ax2.set_xlabel("inner step")
    ax2.set_ylabel("eval loss of the anchor (nats / token)")
    ax2.set_title(f"inner lr {lr:g}, seed {r0['seed']}")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3, 1e-2])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--conversations", type=int, default=3000)
    p.add_argument(
        "--outers",
        nargs="+",
        default=list(OUTERS),
        help=f"names of {list(OUTERS)} or NAME=LR:MOMENTUM:H (for example average_H2=1:0:2)",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lora_diloco.json"))
    args = p.parse_args(argv)
    outers = {}
    for spec in args.outers:
        name, eq, value = spec.partition("=")
        try:
            olr, momentum, h = value.split(":") if eq else OUTERS[name]
            outers[name] = (float(olr), float(momentum), int(h))
        except (KeyError, ValueError):
            p.error(f"--outers {spec}: expected one of {list(OUTERS)} or NAME=LR:MOMENTUM:H")
    if any(h < 1 or args.steps % h for _, _, h in outers.values()):
        p.error("--steps must be a multiple of every outer setting's H")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        runs = []
        for lr in args.lrs:
            for seed in args.seeds:
                r = run_one(lr, seed, args.steps, outers, args.conversations, work, args.rank)
                runs.append(r)
                print(
                    f"lr {lr:g} seed {seed}: one process {r['one_process']:.4f}; "
                    + ", ".join(f"{n} {r[n]['eval_loss']:.4f} ({100 * r[n]['gap']:+.2f}%)" for n in outers),
                    flush=True,
                )
    summary = {
        n: {
            str(lr): {
                "mean_gap": sum(r[n]["gap"] for r in runs if r["lr"] == lr) / len(args.seeds),
                "max_gap": max(r[n]["gap"] for r in runs if r["lr"] == lr),
            }
            for lr in args.lrs
        }
        for n in outers
    }
    result = {
        "machine": machine_info(),
        "command": " ".join([sys.executable, *sys.argv]),
        "seconds": time.perf_counter() - t0,
        "config": {
            "peers": PEERS,
            "batch": BATCH,
            "seq_len": SEQ,
            "steps": args.steps,
            "rank": args.rank,
            "lrs": args.lrs,
            "seeds": args.seeds,
            "conversations": args.conversations,
            "codec": "int4",
            "checkpoint": str(TINY.relative_to(ROOT)),
        },
        "outers": {n: list(v) for n, v in outers.items()},
        "summary": summary,
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for n in outers:
        print(n, {lr: f"{100 * v['mean_gap']:+.2f}% (max {100 * v['max_gap']:+.2f}%)" for lr, v in summary[n].items()})
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
