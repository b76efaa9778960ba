"""Fine-tuning benchmark: what an adapters-only round costs and how adapter averaging converges.

Measured on the tiny pretrained Llama-style checkpoint of ``examples/finetune`` (made here, in a
temporary directory; fine-tuned on the standard library's English documentation topics):

1. **Bytes per round.** The int4 message of one round (``rj.compress.encode``, what the swarm
   sends; the real swarm's per-round payload is checked equal in the tests) for adapters only
   (rank 16, every projection, frozen ``A``: the ``B`` only), for full-model DiLoCo (every parameter), and for
   data-parallel training (bf16 gradients every step, H steps per round), for the tiny model
   and, by the same bytes-per-parameter, for the shapes of Llama 3.2 1B, Llama 3.1 8B and 70B
   (parameter counts from ``jax.eval_shape`` of 1 and 2 layers, extrapolated; nothing is
   allocated).
2. **Averaging adapters (FLoRA, arXiv 2409.05976).** N simulated peers start each round from
   the same adapters, train H AdamW steps on their own shards, and are averaged (plain mean,
   outer lr 1). With ``A`` and ``B`` both trained and averaged separately, the mean of the
   products is not the product of the means: the relative error of the averaged update,
   ``|mean(A_i B_i) - mean(A_i) mean(B_i)| / |mean(A_i B_i) - A_0 B_0|`` (Frobenius, over
   every adapted projection), is recorded per round; with a frozen ``A`` (FFA-LoRA, arXiv
   2403.12313) it is zero by construction (measured too). Each variant's eval loss after R rounds
   is set beside one process training the same adapters on the same tokens.
3. **QLoRA.** Eval loss after the same steps with an int4 base and with the bf16 base.
4. **The swarm.** ``examples/finetune`` with 4 real peer processes (blocking rounds, frozen
   ``A``) against one process on the same tokens: eval loss, bytes per round.

Writes ``benchmarks/results/finetune.json`` and ``finetune.png``.

    python benchmarks/bench_finetune.py            # about 12 minutes on 2 busy CPU cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine_info  # noqa: E402

SHAPES = ("llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b")


def bytes_per_round(tiny: Path, sync_every: int, rank: int) -> dict:
    import jax
    import numpy as np

    import ravnest_jax as rj
    from ravnest_jax.models import LoraConfig, load_pretrained, split_lora
    from ravnest_jax.models._plan import _static_bytes, by_layers, load_config

    lora = LoraConfig(rank=rank, train_a=False)  # B only; training A too adds the A matrices
    lm = split_lora(load_pretrained(tiny, lora=lora))
    adapters = [np.asarray(x) for x in jax.tree.leaves(lm.adapters)]
    base = [np.asarray(x, np.float32) for p, x in _plain(lm.frozen) if not str(p[-1]).endswith("_lora_a")]
    n_adapters, n_base = sum(a.size for a in adapters), sum(b.size for b in base)
    adapter_msg, full_msg = len(rj.compress.encode(adapters, "int4")), len(rj.compress.encode(base, "int4"))
    per_param = full_msg / n_base  # int4 with its block scales and the message header
    out = {
        "codec": "int4",
        "sync_every": sync_every,
        "lora_rank": rank,
        "measured_tiny": {
            "adapter_params": n_adapters,
            "model_params": n_base,
            "adapters_only_bytes": adapter_msg,
            "full_model_diloco_bytes": full_msg,
            "data_parallel_bytes": sync_every * 2 * n_base,
            "int4_bytes_per_param": per_param,
        },
        "shapes": {},
    }
    for name in SHAPES:
        cfg = load_config(name)
        # counts of the whole model from 1 and 2 layers (exact: every layer is the same; tracing
        # all 80 layers of 70B takes over 10 minutes)
        counts = by_layers(lambda c: _static_bytes(c, lora, None, jax.numpy.bfloat16), cfg)
        na, nb = counts["adapter_params"], counts["base_params"]
        out["shapes"][name] = {
            "adapter_params": na,
            "model_params": nb,
            "adapters_only_bytes": int(na * per_param),
            "full_model_diloco_bytes": int(nb * per_param),
            "data_parallel_bytes": sync_every * 2 * nb,
        }
    return out


def _plain(state):
    from flax import nnx

    return [(p, v.get_value()) for p, v in nnx.to_flat_state(state)]


def averaging(tiny: Path, *, peers: int, sync_every: int, rounds: int, rank: int, lr: float) -> dict:
    """FLoRA gap and eval loss of separate A/B averaging vs frozen A, against one process."""
    import jax
    import numpy as np
    import optax

    from finetune.reference import Setup, load

    out = {}
    for variant, train_a in (("frozen_a", False), ("train_a_separate_mean", True)):
        setup = Setup(
            checkpoint=str(tiny),
            peers=peers,
            batch_size=4,
            seq_len=32,
            eval_batches=4,
            lr=lr,
            lora_rank=rank,
            train_a=train_a,
        )
        lm, shards, eval_set, loss_fn = load(setup)
        tx = optax.adamw(lr, weight_decay=0.0)

        @jax.jit
        def step(adapters, opt, frozen, batch, tx=tx, loss_fn=loss_fn):
            grads = jax.grad(loss_fn)(adapters, frozen, batch)
            updates, opt = tx.update(grads, opt, adapters)
            return optax.apply_updates(adapters, updates), opt

        @jax.jit
        def evaluate(adapters, frozen, loss_fn=loss_fn, eval_set=eval_set):
            return jax.lax.map(lambda b: loss_fn(adapters, frozen, b), eval_set).mean()

        frozen_flat = dict(_plain(lm.frozen))
        g = lm.adapters
        opts = [tx.init(g) for _ in range(peers)]  # each peer keeps its inner optimizer state
        gaps, losses = [], [float(evaluate(g, lm.frozen))]
        for _ in range(rounds):
            results = []
            for k in range(peers):
                a = g
                for _ in range(sync_every):
                    a, opts[k] = step(a, opts[k], lm.frozen, shards[k].next())
                results.append(a)
            mean = jax.tree.map(lambda *xs: sum(xs) / len(xs), *results)
            gaps.append(_flora_gap(g, results, mean, frozen_flat, lm.lora.scale))
            g = mean
            losses.append(float(evaluate(g, lm.frozen)))
        # one process: the same adapters, the same tokens, one step per H-step of every peer
        ref_shards = load(setup)[1]
        a, opt = lm.adapters, tx.init(lm.adapters)
        for _ in range(rounds * sync_every):
            a, opt = step(a, opt, lm.frozen, np.concatenate([s.next() for s in ref_shards]))
        out[variant] = {
            "adapter_params": lm.num_adapter_params,
            "eval_loss_per_round": losses,
            "flora_relative_error_per_round": gaps,
            "one_process_eval_loss": float(evaluate(a, lm.frozen)),
        }
    return out


def _flora_gap(start, results, mean, frozen_flat, scale) -> float:
    """Relative Frobenius error of the separately averaged update against the mean update."""
    import numpy as np

    s, m = dict(_plain(start)), dict(_plain(mean))
    rs = [dict(_plain(r)) for r in results]
    num = den = 0.0
    for path, b0 in s.items():
        if not str(path[-1]).endswith("_lora_b"):
            continue
        a_path = path[:-1] + (str(path[-1])[: -len("_lora_b")] + "_lora_a",)
        a0 = s.get(a_path, frozen_flat.get(a_path))
        am = m.get(a_path, a0)
        d0 = np.asarray(a0) @ np.asarray(b0)
        exact = np.mean([np.asarray(r.get(a_path, a0)) @ np.asarray(r[path]) for r in rs], axis=0)
        approx = np.asarray(am) @ np.asarray(m[path])
        num += float(np.sum((exact - approx) ** 2)) * scale**2
        den += float(np.sum((exact - d0) ** 2)) * scale**2
    return (num / den) ** 0.5 if den > 0 else 0.0


def qlora(tiny: Path, *, steps: int, lr: float) -> dict:
    from finetune.reference import Setup, train_data_parallel

    common = dict(
        checkpoint=str(tiny),
        peers=2,
        max_steps=steps,
        batch_size=4,
        seq_len=32,
        eval_batches=4,
        lr=lr,
        dtype="bfloat16",
        train_a=False,  # as when the committed results were measured
    )
    return {
        "bf16_base": train_data_parallel(Setup(**common)),
        "int4_base": train_data_parallel(Setup(**common, quantize="int4")),
    }


def swarm(tiny: Path, work: Path, *, peers: int, steps: int, sync_every: int, lr: float) -> dict:
    from finetune.reference import Setup, train_data_parallel

    summary = work / "swarm.json"
    train = ROOT / "examples" / "finetune" / "train.py"
    flags = ["--batch-size", "4", "--seq-len", "32", "--eval-batches", "4", "--lr", str(lr), "--lora-rank", "8"]
    cmd = [sys.executable, "-m", "ravnest_jax.cli", "local", "--peers", str(peers), "--codec", "int4", "--no-progress"]
    cmd += ["--summary-json", str(summary), "--", sys.executable, str(train), "--checkpoint", str(tiny)]
    cmd += ["--max-steps", str(steps), "--sync-every", str(sync_every), "--overlap-steps", "0", "--frozen-a", *flags]
    t0 = time.time()
    p = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200)
    wall = time.time() - t0
    got = {}  # each peer's own JSON line (train.py's summary), as the launcher prefixes it
    for line in p.stdout.splitlines():
        if line.startswith("[peer") and "] {" in line:
            name, _, rest = line[1:].partition("] ")
            got[name] = json.loads(rest)
    ref = train_data_parallel(
        Setup(
            checkpoint=str(tiny),
            peers=peers,
            max_steps=steps,
            batch_size=4,
            seq_len=32,
            eval_batches=4,
            lr=lr,
            lora_rank=8,
        )
    )
    s0 = got["peer0"]
    return {
        "peers": peers,
        "steps": steps,
        "sync_every": sync_every,
        "wall_seconds": wall,
        "digests_equal": len({s["last_state_digest"] for s in got.values()}) == 1,
        "eval_loss_start": s0["eval_loss_start"],
        "swarm_eval_loss": s0["eval_loss_end"],
        "one_process_eval_loss": ref["eval_loss_end"],
        "relative_gap": abs(s0["eval_loss_end"] - ref["eval_loss_end"]) / ref["eval_loss_end"],
        "round_payload_bytes": s0["round_payload_bytes"],
        "bytes_sent_per_peer": {k: s["bytes_sent"] for k, s in got.items()},
    }


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.6))
    names = ["tiny (measured)", *SHAPES]
    rows = [out["bytes"]["measured_tiny"], *[out["bytes"]["shapes"][n] for n in SHAPES]]
    kinds = [("adapters_only_bytes", "adapters only (int4)"), ("full_model_diloco_bytes", "full-model DiLoCo (int4)")]
    kinds.append(("data_parallel_bytes", f"data-parallel (bf16, {out['bytes']['sync_every']} steps)"))
    width = 0.27
    for j, (key, label) in enumerate(kinds):
        ax1.bar([i + (j - 1) * width for i in range(len(names))], [r[key] for r in rows], width, label=label)
    ax1.set_yscale("log")
    ax1.set_xticks(range(len(names)), names, rotation=15)
    ax1.set_ylabel("bytes a peer contributes per round")
    ax1.set_title(f"one round (H = {out['bytes']['sync_every']} steps), LoRA rank {out['bytes']['lora_rank']}")
    ax1.legend(fontsize=8)
    for variant, style in (("frozen_a", "-o"), ("train_a_separate_mean", "-s")):
        v = out["averaging"][variant]
        ax2.plot(v["eval_loss_per_round"], style, label=f"{variant} (swarm of {out['config']['peers']})")
        ax2.axhline(
            v["one_process_eval_loss"], ls="--", color=ax2.lines[-1].get_color(), lw=1, label=f"{variant}: one process"
        )
        ax3.plot(
            range(1, len(v["flora_relative_error_per_round"]) + 1),
            v["flora_relative_error_per_round"],
            style,
            label=variant,
        )
    ax2.set_xlabel("round")
    ax2.set_ylabel("eval loss (nats / token)")
    ax2.set_title("averaging adapters: eval loss")
    ax2.legend(fontsize=7)
    ax3.set_xlabel("round")
    ax3.set_ylabel("|mean(AB) - mean(A) mean(B)| / |mean(AB) - A0 B0|")
    ax3.set_title("FLoRA gap of the averaged update")
    ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--sync-every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "finetune.json"))
    args = ap.parse_args(argv)
    from finetune.tiny import make_tiny_checkpoint

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="rj-bench-finetune-") as tmp:
        tiny = make_tiny_checkpoint(Path(tmp) / "tiny", vocab_size=384, pretrain_steps=300)
        out = {
            "benchmark": "finetune",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine_info(),
            "config": vars(args),
            "bytes": bytes_per_round(tiny, args.sync_every, 16),
        }
        print(json.dumps(out["bytes"]["measured_tiny"]), flush=True)
        out["averaging"] = averaging(
            tiny, peers=args.peers, sync_every=args.sync_every, rounds=args.rounds, rank=args.rank, lr=args.lr
        )
        print(json.dumps({k: v["eval_loss_per_round"][-1] for k, v in out["averaging"].items()}), flush=True)
        out["qlora"] = qlora(tiny, steps=args.rounds * args.sync_every, lr=args.lr)
        out["swarm"] = swarm(
            tiny,
            Path(tmp),
            peers=args.peers,
            steps=args.rounds * args.sync_every,
            sync_every=args.sync_every,
            lr=args.lr,
        )
    out["seconds"] = time.time() - t0
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, allow_nan=False) + "\n")
    plot(out, path.with_suffix(".png"))
    print(json.dumps({"swarm": out["swarm"], "qlora": out["qlora"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
