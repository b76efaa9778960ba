"""Quality of the quantised frozen base (QLoRA, arXiv 2305.14314): int8, int4 and nf4 against
the float base, on the tiny Llama-style test checkpoint (``tests/fixtures/llm/llama``, random
weights: 2 layers, hidden 64, vocabulary 96).

For each base (float32, bfloat16, int8, int4, nf4):

1. **kernel reconstruction error**: ``|W - dequantize(quantize(W))|_F / |W|_F`` over every
   projection kernel (the QArray the model holds, dequantised with ``qwix.dequantize``);
2. **logit error**: ``max |logits - float32 logits| / max |float32 logits|`` on the fixture's
   tokens;
3. **eval loss** of the base on the held-out half of the fixture's token rows, and after a
   short LoRA fine-tune (rank 4, Adam 1e-2, ``--steps`` full-batch steps on the other half).

Writes ``benchmarks/results/quantize_quality.json`` (with the machine and the command).

    python benchmarks/bench_quantize_quality.py     # about a minute on 2 busy CPU cores
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "tests" / "fixtures" / "llm" / "llama"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="LoRA fine-tune steps (default 30)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantize_quality.json"))
    args = p.parse_args()

    import qwix
    from flax import nnx

    from ravnest_jax.models import LoraConfig, device_bits, load_pretrained, nbytes, split_lora

    tokens = jnp.asarray(np.load(LLAMA / "tokens.npy"))
    half = tokens.shape[0] // 2
    train, held = tokens[:half], tokens[half:]
    ref_model = load_pretrained(LLAMA)
    ref_logits = np.asarray(ref_model(tokens))
    ref_kernels = {
        tuple(map(str, p[:-1])): np.asarray(v.get_value(), np.float32)
        for p, v in nnx.to_flat_state(nnx.state(ref_model))
        if str(p[-1]) == "kernel" and "proj" in str(p[-2])
    }

    def loss(lm, a, f, toks):
        logits = lm.model(a, f)(toks[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), toks[:, 1:]).mean()

    rows = {}
    for name in ("float32", "bfloat16", "int8", "int4", "nf4"):
        t0 = time.perf_counter()
        quantize = name if name in ("int8", "int4", "nf4") else None
        dtype = jnp.bfloat16 if name == "bfloat16" else jnp.float32
        lm = split_lora(load_pretrained(LLAMA, dtype=dtype, lora=LoraConfig(rank=4), quantize=quantize))
        num = den = 0.0
        for path, ref in ref_kernels.items():
            obj = lm.model(lm.adapters, lm.frozen)
            for part in path:
                obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
            k = getattr(obj, "kernel", None)
            arr = getattr(k, "array", None) if quantize else None
            w = qwix.dequantize(arr) if arr is not None else k.get_value()
            num += float(np.sum((np.asarray(w, np.float32).reshape(ref.shape) - ref) ** 2))
            den += float(np.sum(ref**2))
        logits = np.asarray(jax.jit(lambda a, f, t, lm=lm: lm.model(a, f)(t))(lm.adapters, lm.frozen, tokens))
        tx = optax.adam(1e-2)

        @jax.jit
        def step(a, opt, f, lm=lm, tx=tx):
            g = jax.grad(lambda a: loss(lm, a, f, train))(a)
            u, opt = tx.update(g, opt, a)
            return optax.apply_updates(a, u), opt

        evaluate = jax.jit(lambda a, f, lm=lm: loss(lm, a, f, held))
        before = float(evaluate(lm.adapters, lm.frozen))
        a, opt = lm.adapters, tx.init(lm.adapters)
        for _ in range(args.steps):
            a, opt = step(a, opt, lm.frozen)
        after = float(evaluate(a, lm.frozen))
        proj = [v.get_value() for p, v in nnx.to_flat_state(lm.frozen) if "proj" in "/".join(map(str, p))]
        rows[name] = dict(
            kernel_rel_error=(num / den) ** 0.5,
            logit_rel_error=float(np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()),
            eval_loss_base=before,
            eval_loss_lora=after,
            projection_bytes=nbytes(proj),
            seconds=time.perf_counter() - t0,
        )
        print(name, {k: round(v, 5) if isinstance(v, float) else v for k, v in rows[name].items()}, flush=True)
    out = dict(
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        machine=dict(platform=platform.platform(), processor=platform.processor(), backend=jax.default_backend()),
        jax=jax.__version__,
        fixture=str(LLAMA.relative_to(ROOT)),
        steps=args.steps,
        widths={d: device_bits(d) for d in ("int4", "uint4", "int8", "bfloat16", "float32")},
        results=rows,
    )
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
