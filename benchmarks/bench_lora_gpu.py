#!/usr/bin/env python3
"""LoRA / QLoRA fine-tuning on one GPU: our training step against transformers + peft, on the
same random-init Llama weights and the same tokens.

    python benchmarks/bench_lora_gpu.py --out DIR             # the GPU run: at most ~8 minutes
    python benchmarks/bench_lora_gpu.py --overlap --out DIR   # two peers share the GPU: ~4 minutes
    python benchmarks/bench_lora_gpu.py --dry-run --out DIR   # tiny shapes on CPU: ~1-2 minutes
    python benchmarks/bench_lora_gpu.py --dry-run --overlap --out DIR

**The main run** writes random-init checkpoints of the Llama-3.2-1B and Llama-3.1-8B shapes once
(``transformers.LlamaForCausalLM(config)`` in bf16, ``save_pretrained`` safetensors; our own
``save_pretrained`` where transformers is missing; no tokenizer: token ids are random with a fixed
seed) and trains them, sequence 2048, micro-batch 4, LoRA rank 16 / alpha 32 on all 7
projections, AdamW, one case per subprocess under one global deadline:

- ours: ``load_pretrained(dtype=bfloat16, quantize=..., lora=LoraConfig(16, 32), remat=True)``,
  ``split_lora``, ``make_train_step(lm, rj.diloco(optax.adamw(...)), ...)`` on
  ``TokenBatch.from_windows`` (the library's step, nothing of it re-implemented): bf16 LoRA, int4
  and nf4 QLoRA on the 1B shape, and QLoRA on the 8B shape inside a 22 GiB allocator pool (a
  24 GB card: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` set so the pool is 22 GiB on the GPU in use,
  ``XLA_PYTHON_CLIENT_PREALLOCATE=false``). The step is traced, lowered and compiled ahead of
  time (``jit(...).trace(...).lower().compile()``), each timed;
- theirs: transformers + peft bf16 LoRA (SDPA attention, gradient checkpointing, non-reentrant),
  ``torch.optim.AdamW``; NF4 QLoRA only where bitsandbytes imports, else ``skipped``.

Each case then runs warm-up steps (the first one's loss is ``loss0``, the step-0 loss: both sides
must agree on the same weights) and N timed steps closed with ``block_until_ready`` /
``torch.cuda.synchronize``. Results go to ``DIR/lora_gpu.json`` as each case finishes (fields:
``FIELDS``), with ``lora_gpu.png`` (tokens/s and peak GiB per case) and ``lora_gpu.md`` (the
table). ``flops`` per step is XLA's cost analysis of the compiled step where it has one
(``flops_source``), else the formula of :func:`model_flops`; ``mfu`` always uses the formula
(model FLOPs without recomputation, PaLM's definition, arXiv 2204.02311, so both sides count
the same work) over the card's dense bf16 peak (:data:`PEAK_BF16`; null for unknown devices).

**The overlap run** (``--overlap``): two peers of the 1B bf16 LoRA fine-tune share the one GPU
(``XLA_PYTHON_CLIENT_MEM_FRACTION=0.45`` each), their rounds (int4 adapters, DiLoCo) cross the
benchmarks' throttling proxy (``_common.LinkEmulator``) at 100 Mbit/s and 50 ms RTT, and each
trains ``--overlap-rounds`` rounds of H steps blocking (``overlap_steps=0``) and then with
``overlap_steps="auto"``; each peer's ``sync.summary()`` (compute utilisation, stall seconds)
goes to ``DIR/lora_overlap.json``.

See docs/benchmarks-lora-gpu.md for the numbers and how to run it on the lent GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

RESULT = "RESULT "  # a child's last line: RESULT {json}
GIB = 1 << 30
CAP_BYTES = 22 * GIB  # a 24 GB card's usable pool
TOKEN = "bench-lora-gpu-token"
SEED = 0

#: dense bf16 tensor-core peaks (FLOP/s) by device-name substring, first match wins
PEAK_BF16 = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)

#: every case's JSON fields (null where a field does not apply or the case did not get there)
FIELDS = (
    "case",
    "side",
    "model",
    "quantize",
    "load_s",
    "trace_s",
    "compile_s",
    "step_s",
    "tokens_per_s",
    "peak_bytes",
    "peak_source",
    "flops",
    "flops_source",
    "model_flops",
    "mfu",
    "loss0",
    "status",
)

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
#: Hugging Face config.json of each shape (the real models' sizes; weights are random)
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
    ),
    # --dry-run's stand-ins: the same layout (tied and untied), CPU-sized
    "tiny-1b": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 32},
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    ),
    "tiny-8b": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 32},
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    ),
}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA, LR = 16, 32.0, 1e-4


def hf_config(shape: str) -> dict[str, Any]:
    """The ``config.json`` dict of ``shape`` (a key of :data:`SHAPES`), Llama architecture."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16", **SHAPES[shape]}


def peak_bf16_flops(device_name: str | None) -> float | None:
    """The dense bf16 peak (FLOP/s) of a device by its name (``jax``'s ``device_kind`` or
    ``torch.cuda.get_device_name``), from :data:`PEAK_BF16`; None when unknown (CPUs)."""
    for key, peak in PEAK_BF16:
        if device_name and key.lower() in device_name.lower():
            return peak
    return None


def lora_params(cfg: dict[str, Any], rank: int = RANK) -> int:
    """Adapter parameters of rank ``rank`` on all 7 projections: ``rank * (in + out)`` each."""
    d, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = (d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d)
    return L * rank * per_layer


def model_flops(cfg: dict[str, Any], batch: int, seq: int, rank: int = RANK) -> float:
    """Model FLOPs of one LoRA training step (no recomputation counted, as MFU is defined in
    PaLM, arXiv 2204.02311): ``4 N T`` for the frozen matmuls (forward and the input gradients;
    a frozen weight gets no gradient), ``6 N_lora T`` for the adapters, and causal attention at
    three times its forward ``2 L b s^2 H d_head`` (the scores and the weighted sum, half of
    them masked). ``N`` counts the layers' projections and the output head (tied or not), not
    the embedding lookup; ``T = batch * seq`` tokens."""
    d, f, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    n_matmul = L * (d * q + 2 * d * kv + q * d + 3 * d * f) + V * d
    tokens = batch * seq
    attn_fwd = 2.0 * L * batch * seq * seq * q
    return 4.0 * n_matmul * tokens + 6.0 * lora_params(cfg, rank) * tokens + 3.0 * attn_fwd


def random_windows(vocab: int, batch: int, seq: int, seed: int = SEED):
    """int32 ``(batch, seq + 1)`` token windows, the same on both sides for one seed."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq + 1), dtype=np.int32)


class Settings(NamedTuple):
    """The sizes of one run (the GPU run or ``--dry-run``'s)."""

    shapes: dict[str, str]  # "1b"/"8b" -> key of SHAPES
    seq: int
    batch: int
    warmup: int  # steps before timing (the first gives loss0)
    steps: dict[str, int]  # "1b"/"8b" -> timed steps
    timeout: dict[str, float]  # "ckpt", "ours", "theirs", "ours8b" -> seconds a subprocess may take
    deadline: float  # seconds for the whole run


GPU = Settings(
    {"1b": "llama-3.2-1b", "8b": "llama-3.1-8b"},
    2048,
    4,
    2,
    {"1b": 10, "8b": 4},
    {"ckpt": 120, "ckpt8b": 150, "ours": 120, "theirs": 90, "ours8b": 180},
    450,
)
DRY = Settings(
    {"1b": "tiny-1b", "8b": "tiny-8b"},
    64,
    2,
    1,
    {"1b": 2, "8b": 2},
    {"ckpt": 60, "ckpt8b": 60, "ours": 60, "theirs": 60, "ours8b": 60},
    170,
)


def cases(s: Settings) -> list[dict[str, Any]]:
    """The cases of a run, in the order they run (the most wanted first: a deadline cuts the
    tail). ``quantize`` "qlora" means nf4 where ``QUANTIZE`` has it, else int4."""
    base = {"seq": s.seq, "batch": s.batch, "warmup": s.warmup}
    one = {**base, "model": s.shapes["1b"], "steps": s.steps["1b"]}
    eight = {**base, "model": s.shapes["8b"], "steps": s.steps["8b"]}
    return [
        {**one, "case": "ours-1b-bf16-lora", "side": "ours", "quantize": None, "timeout": s.timeout["ours"]},
        {**one, "case": "theirs-1b-bf16-lora", "side": "theirs", "quantize": None, "timeout": s.timeout["theirs"]},
        {**one, "case": "ours-1b-int4-qlora", "side": "ours", "quantize": "int4", "timeout": s.timeout["ours"]},
        {
            **eight,
            "case": "ours-8b-qlora-22gib",
            "side": "ours",
            "quantize": "qlora",
            "cap_bytes": CAP_BYTES,
            "timeout": s.timeout["ours8b"],
        },
        {**one, "case": "ours-1b-nf4-qlora", "side": "ours", "quantize": "nf4", "timeout": s.timeout["ours"]},
        {**one, "case": "theirs-1b-nf4-qlora", "side": "theirs", "quantize": "nf4", "timeout": s.timeout["theirs"]},
    ]


# ------------------------------------------------------------------------------ the children
def _result(case: dict[str, Any], **fields: Any) -> dict[str, Any]:
    out = {k: None for k in FIELDS}
    out.update({k: case.get(k) for k in ("case", "side", "model", "quantize")})
    out.update(fields)
    return out


def _finish(case: dict[str, Any], step_s: float, cfg: dict[str, Any], device_name: str | None) -> dict[str, Any]:
    mf = model_flops(cfg, case["batch"], case["seq"])
    peak = peak_bf16_flops(device_name)
    return {
        "step_s": step_s,
        "tokens_per_s": case["batch"] * case["seq"] / step_s,
        "model_flops": mf,
        "mfu": mf / step_s / peak if peak else None,
        "device": device_name,
    }


def step_api() -> tuple[Any, Any, str]:
    """``(make_train_step, TokenBatch, where)``: the library's training step, which every case of
    ours runs (nothing of it re-implemented here)."""
    from ravnest_jax.models import TokenBatch, make_train_step

    return make_train_step, TokenBatch, "ravnest_jax.models.make_train_step"


def _init_opt_state(lm, tx, adapters=None):
    """The optimizer state laid out as the step keeps it (on one device: ``tx.init``'s own)."""
    from ravnest_jax.models import init_opt_state

    return init_opt_state(lm, tx, adapters)


def _ours_model(ckpt: str, quantize: str | None, make_train_step, sync_every: int):
    """Loads the checkpoint and builds the library's step; returns (lm, tx, opt_state, step)."""
    import jax.numpy as jnp
    import optax

    import ravnest_jax as rj
    from ravnest_jax.models import LoraConfig, load_pretrained, split_lora

    lm = split_lora(
        load_pretrained(
            ckpt, dtype=jnp.bfloat16, quantize=quantize, lora=LoraConfig(rank=RANK, alpha=ALPHA), remat=True
        )
    )
    tx = rj.diloco(optax.adamw(LR, weight_decay=0.0), sync_every=sync_every)
    opt_state = _init_opt_state(lm, tx)
    step = make_train_step(lm, tx, micro_batches=1, loss_chunk=1024)
    return lm, tx, opt_state, step


def run_ours(case: dict[str, Any]) -> dict[str, Any]:
    """One case of ours (in its own process): load, trace, compile, warm up, time."""
    import jax
    import jax.numpy as jnp

    from ravnest_jax.models import QUANTIZE

    q = case["quantize"]
    if q == "qlora":
        q = "nf4" if "nf4" in QUANTIZE else "int4"
    if q is not None and q not in QUANTIZE:
        return _result(case, status=f"skipped: {q} is not in ravnest_jax.models.QUANTIZE {QUANTIZE}")
    make_train_step, TokenBatch, where = step_api()
    dev = jax.devices()[0]
    cfg = SHAPES[case["model"]]
    t0 = time.perf_counter()
    lm, _tx, opt_state, step = _ours_model(case["ckpt"], q, make_train_step, sync_every=10**6)
    adapters, frozen = lm.adapters, lm.frozen
    jax.block_until_ready((adapters, frozen, opt_state))
    load_s = time.perf_counter() - t0
    batch = TokenBatch.from_windows(jnp.asarray(random_windows(cfg["vocab_size"], case["batch"], case["seq"])))
    args = (adapters, opt_state, frozen, batch, jnp.int32(0))
    t0 = time.perf_counter()
    traced = step.trace(*args)
    trace_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = traced.lower().compile()
    compile_s = time.perf_counter() - t0
    flops, flops_source = None, "formula"
    with contextlib.suppress(Exception):
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        if cost and float(cost.get("flops", -1)) > 0:
            flops, flops_source = float(cost["flops"]), "xla_cost_analysis"
    loss0 = None
    for i in range(case["warmup"]):
        adapters, opt_state, metrics = compiled(adapters, opt_state, frozen, batch, jnp.int32(i))
        if i == 0:
            loss0 = float(metrics["loss"])
    jax.block_until_ready(adapters)
    n = case["steps"]
    t0 = time.perf_counter()
    for i in range(n):
        adapters, opt_state, metrics = compiled(adapters, opt_state, frozen, batch, jnp.int32(case["warmup"] + i))
    jax.block_until_ready((adapters, opt_state, metrics))
    step_s = (time.perf_counter() - t0) / n
    stats = dev.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        peak, peak_source = int(stats["peak_bytes_in_use"]), "memory_stats.peak_bytes_in_use"
    else:  # CPU: XLA's own account of the step's buffers (arguments + outputs - aliased + temporaries)
        m = compiled.memory_analysis()
        peak = int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)
        peak_source = "compiled.memory_analysis"
    out = _result(
        case,
        quantize=q,
        load_s=load_s,
        trace_s=trace_s,
        compile_s=compile_s,
        peak_bytes=peak,
        peak_source=peak_source,
        flops=flops,
        flops_source=flops_source,
        loss0=loss0,
        status="ok",
        step_api=where,
        pool_bytes=stats.get("bytes_limit"),
        final_loss=float(metrics["loss"]),
        **_finish(case, step_s, cfg, dev.device_kind),
    )
    if out["flops"] is None:
        out["flops"] = out["model_flops"]
    return out


def run_theirs(case: dict[str, Any]) -> dict[str, Any]:
    """One case of transformers + peft (in its own process)."""
    try:
        import peft
        import torch
        import transformers
    except Exception as e:  # noqa: BLE001 - any import failure is the reason it is skipped
        return _result(case, status=f"skipped: torch/transformers/peft do not import ({type(e).__name__}: {e})")
    kwargs: dict[str, Any] = {"attn_implementation": "sdpa"}
    if case["quantize"] == "nf4":
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return _result(case, status=f"skipped: bitsandbytes does not import ({type(e).__name__}: {e})")
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    cfg = SHAPES[case["model"]]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(SEED)
    t0 = time.perf_counter()
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(case["ckpt"], **{dtype_kw: torch.bfloat16}, **kwargs)
    if case["quantize"] is None:
        model = model.to(dev)
    model.config.use_cache = False
    if case["quantize"] == "nf4":
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lcfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(PROJ), task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lcfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, **({"fused": True} if cuda else {}))
    if cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    w = torch.from_numpy(random_windows(cfg["vocab_size"], case["batch"], case["seq"])).long().to(dev)
    x, y = w[:, :-1], w[:, 1:]

    def step() -> Any:
        logits = model(input_ids=x).logits
        # the same token-mean loss as ours; transformers' own loss upcasts the logits the same way
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    loss0 = float(step())
    sync()
    first_s = time.perf_counter() - t0
    for _ in range(case["warmup"] - 1):
        step()
    sync()
    n = case["steps"]
    t0 = time.perf_counter()
    for _ in range(n):
        loss = step()
    sync()
    step_s = (time.perf_counter() - t0) / n
    if cuda:
        peak, peak_source = int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
    else:
        import resource

        peak, peak_source = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss (CPU)"
    fin = _finish(case, step_s, cfg, name)
    return _result(
        case,
        load_s=load_s,
        trace_s=None,  # eager PyTorch traces nothing
        compile_s=first_s,  # its one-off cost: the first step (kernel selection, allocator growth)
        peak_bytes=peak,
        peak_source=peak_source,
        flops=fin["model_flops"],
        flops_source="formula",
        loss0=loss0,
        status="ok",
        final_loss=float(loss),
        versions={"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        **fin,
    )


def write_checkpoint(shape: str, path: str) -> dict[str, Any]:
    """Writes a random-init bf16 checkpoint of ``shape`` at ``path`` (transformers' own init and
    ``save_pretrained`` where transformers imports, else ours); returns how."""
    root = Path(path)
    if root.exists():
        shutil.rmtree(root)
    t0 = time.perf_counter()
    try:
        import torch
        import transformers
    except Exception:  # noqa: BLE001 - no transformers here: our own writer
        torch = None
    if torch is not None:
        cfg = transformers.LlamaConfig(**copy.deepcopy(SHAPES[shape]))  # it edits the dicts it is given
        torch.manual_seed(SEED)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = transformers.LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
        model.save_pretrained(str(root))
        how = f"transformers {transformers.__version__} LlamaForCausalLM(config) random init, bf16, save_pretrained"
    else:
        import jax.numpy as jnp
        from flax import nnx

        from ravnest_jax.models import Transformer, TransformerConfig, save_pretrained

        cfg = TransformerConfig.from_hf(hf_config(shape))
        model = Transformer(cfg, nnx.Rngs(SEED), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        save_pretrained(model, root)
        (root / "config.json").write_text(json.dumps(hf_config(shape), indent=2))
        how = "ravnest_jax Transformer random init, bf16, ravnest_jax.models.save_pretrained (no transformers)"
    (root / "bench_shape.json").write_text(json.dumps({"shape": shape, "config": SHAPES[shape], "how": how}))
    return {"shape": shape, "path": str(root), "how": how, "write_s": time.perf_counter() - t0}


def probe() -> dict[str, Any]:
    """This machine: platform, jax and its devices, the reference side's package versions."""
    from importlib import metadata

    from _common import machine_info

    info = machine_info()
    with contextlib.suppress(Exception):
        import jax

        info["device_kind"] = jax.devices()[0].device_kind
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "qwix", "safetensors"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    with contextlib.suppress(Exception):
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20
        ).stdout.strip()
    return info


def _child(argv: list[str]) -> int:
    """``--_child KIND JSON``: runs one unit of work and prints ``RESULT {json}`` last."""
    kind, spec = argv[0], json.loads(argv[1])
    fn = {
        "ours": lambda: run_ours(spec),
        "theirs": lambda: run_theirs(spec),
        "ckpt": lambda: write_checkpoint(spec["shape"], spec["path"]),
        "prepare": lambda: {
            "machine": probe(),
            "checkpoints": [write_checkpoint(shape, path) for shape, path in spec["write"]],
        },
        "peer": lambda: overlap_peer(spec),
    }[kind]
    out = fn()
    print(RESULT + json.dumps(out), flush=True)
    return 0


# ------------------------------------------------------------------------------- the parent
def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln or "Exception" in ln]
    line = (errs or lines or ["no output"])[-1]
    return line[:300]


def run_child(kind: str, spec: dict[str, Any], timeout: float, env: dict[str, str]) -> tuple[str, Any, str]:
    """Runs ``kind`` in a fresh interpreter (its own process group, killed whole at
    ``timeout``); returns ``(status, result or None, output tail)`` with status ``ok``,
    ``timeout`` or ``error: one line``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", kind, json.dumps(spec)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    _RUNNING.add(proc.pid)
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", None, out[-2000:]
    finally:
        _RUNNING.discard(proc.pid)
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT):
            return "ok", json.loads(line[len(RESULT) :]), out[-2000:]
    return f"error: {_one_line(out)}", None, out[-2000:]


_RUNNING: set[int] = set()  # process groups of the children in flight


def _stop_children(signum: int, _frame: Any) -> None:
    """SIGTERM / SIGINT (``timeout`` around this script): the children run in their own process
    sessions, so they are ended here, not left holding the GPU."""
    for pid in list(_RUNNING):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    sys.exit(128 + signum)


def child_env(dry_run: bool, mem_fraction: float | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # compile times are measured, never cached
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    if mem_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{mem_fraction:.4f}"
    return env


def gpu_total_bytes() -> int | None:
    """Memory of the first visible GPU (nvidia-smi), None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
        return int(float(out.split()[0]) * (1 << 20))
    except Exception:  # noqa: BLE001 - no nvidia-smi, no GPU
        return None


def loss0_check(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model: the step-0 losses of the ok bf16 cases of both sides and their largest
    difference (same weights, same tokens: they must agree to bf16 precision)."""
    out = {}
    for model in sorted({r["model"] for r in results}):
        got = {
            r["case"]: r["loss0"]
            for r in results
            if r["model"] == model and r["status"] == "ok" and r["loss0"] is not None and r["quantize"] is None
        }
        if len(got) >= 2:
            out[model] = {"loss0": got, "max_abs_diff": max(got.values()) - min(got.values())}
    return out


def write_reports(doc: dict[str, Any], out: Path) -> None:
    """``lora_gpu.md`` (the table) and ``lora_gpu.png`` (tokens/s and peak GiB per case)."""
    rows = [
        "| case | model | status | load s | trace s | compile s | tokens/s | peak GiB | MFU | loss0 |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def f(v: Any, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    for r in doc["cases"]:
        peak = None if r["peak_bytes"] is None else r["peak_bytes"] / GIB
        status = r["status"].replace("|", "/")
        rows.append(
            f"| {r['case']} | {r['model']} | {status} | {f(r['load_s'], '.1f')} | {f(r['trace_s'], '.1f')} | "
            f"{f(r['compile_s'], '.1f')} | {f(r['tokens_per_s'], ',.0f')} | {f(peak, '.2f')} | "
            f"{f(r['mfu'], '.1%')} | {f(r['loss0'], '.4f')} |"
        )
    head = f"Machine: {doc['machine'].get('device_kind') or doc['machine'].get('backend')}; command: `{doc['command']}`\n\n"
    (out / "lora_gpu.md").write_text(head + "\n".join(rows) + "\n")
    ok = [r for r in doc["cases"] if r["status"] == "ok"]
    if not ok:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 0.5 * len(ok) + 1.8))
    names = [r["case"] for r in ok]
    colors = ["tab:blue" if r["side"] == "ours" else "tab:orange" for r in ok]
    axes[0].barh(names, [r["tokens_per_s"] for r in ok], color=colors)
    axes[0].set_xlabel("tokens / s")
    axes[1].barh(names, [r["peak_bytes"] / GIB for r in ok], color=colors)
    axes[1].set_xlabel(
        "peak memory (GiB; CPU: ours XLA's buffer account, theirs the process RSS)"
        if doc["dry_run"]
        else "peak device memory (GiB)"
    )
    axes[1].set_yticks([])
    for ax in axes:
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"LoRA / QLoRA fine-tuning step on {doc['machine'].get('device_kind') or 'cpu'} (blue: ours)")
    fig.tight_layout()
    fig.savefig(out / "lora_gpu.png", dpi=110)
    plt.close(fig)


def _save(doc: dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)


def _ckpt_ok(path: Path, shape: str) -> bool:
    meta = path / "bench_shape.json"
    with contextlib.suppress(Exception):
        return json.loads(meta.read_text())["config"] == SHAPES[shape]
    return False


def main_run(args: argparse.Namespace) -> int:
    s = DRY if args.dry_run else GPU
    deadline = time.monotonic() + (args.deadline or s.deadline)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "lora_gpu.json"
    ckpt_root = Path(args.ckpt_dir or Path(tempfile.gettempdir()) / "ravnest-bench-lora-gpu")
    env = child_env(args.dry_run)
    left = lambda: deadline - time.monotonic()  # noqa: E731

    def log(msg: str) -> None:
        print(msg, flush=True)

    # one child probes the machine and writes the first checkpoints (--dry-run: all of them; the
    # GPU run writes the 8B one when its case comes, after the 1B cases)
    first = [c["model"] for c in cases(s) if not args.cases or c["case"] in args.cases]
    first = list(dict.fromkeys(first if args.dry_run else first[:1]))
    write = [(m, str(ckpt_root / m)) for m in first if not _ckpt_ok(ckpt_root / m, m)]
    budget = sum(s.timeout["ckpt8b" if m == s.shapes["8b"] else "ckpt"] for m, _ in write) + 60
    st, prep, tail = run_child("prepare", {"write": write}, min(budget, left()), env)
    machine = prep["machine"] if st == "ok" else {"probe": st, "tail": tail[-500:]}
    written = {c["shape"]: c for c in prep["checkpoints"]} if st == "ok" else {}
    total = gpu_total_bytes()
    doc: dict[str, Any] = {
        "benchmark": "lora_gpu",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {**machine, "gpu_total_bytes": total},
        "dry_run": args.dry_run,
        "config": {
            "seq": s.seq,
            "micro_batch": s.batch,
            "lora_rank": RANK,
            "lora_alpha": ALPHA,
            "targets": list(PROJ),
            "optimizer": f"AdamW lr {LR}, weight decay 0 (ours: rj.diloco around it, no rounds)",
            "warmup_steps": s.warmup,
            "timed_steps": s.steps,
            "deadline_s": args.deadline or s.deadline,
            "shapes": {k: hf_config(v) for k, v in s.shapes.items()},
        },
        "checkpoints": {},
        "cases": [],
    }
    log(f"machine: {doc['machine'].get('device_kind')} ({doc['machine'].get('backend')}); checkpoints in {ckpt_root}")
    t_start = time.perf_counter()
    for case in cases(s):
        if args.cases and case["case"] not in args.cases:
            continue
        shape = case["model"]
        ck = ckpt_root / shape
        if shape not in doc["checkpoints"]:
            if shape in written:
                doc["checkpoints"][shape] = written[shape]
                log(f"checkpoint {shape}: {json.dumps(written[shape])}")
            elif _ckpt_ok(ck, shape):
                doc["checkpoints"][shape] = {"path": str(ck), "how": "reused"}
            else:
                budget = s.timeout["ckpt8b" if shape == s.shapes["8b"] else "ckpt"]
                st, info, tail = run_child("ckpt", {"shape": shape, "path": str(ck)}, min(budget, left()), env)
                doc["checkpoints"][shape] = info if st == "ok" else {"status": st, "tail": tail[-500:]}
                log(f"checkpoint {shape}: {st} {json.dumps(info) if info else ''}")
        spec = {**case, "ckpt": str(ck)}
        if not _ckpt_ok(ck, shape):
            res = _result(case, status=f"skipped: no checkpoint of {shape} ({doc['checkpoints'][shape].get('status')})")
        elif left() < 10:
            res = _result(case, status="skipped: the global deadline passed before it started")
        else:
            frac = None
            if case.get("cap_bytes") and total:
                frac = case["cap_bytes"] / total
            t0 = time.perf_counter()
            st, res, tail = run_child(
                case["side"], spec, min(case["timeout"], left()), child_env(args.dry_run, mem_fraction=frac)
            )
            if res is None:
                res = _result(case, status=st, log_tail=tail[-1500:])
            elif res["status"].startswith("error"):
                res["log_tail"] = tail[-1500:]
            res["wall_s"] = time.perf_counter() - t0
            res["mem_cap_bytes"] = case.get("cap_bytes")
            res["mem_fraction"] = frac
        doc["cases"].append(res)
        doc["loss0_check"] = loss0_check(doc["cases"])
        doc["seconds"] = time.perf_counter() - t_start
        _save(doc, path)
        tps, peak = res.get("tokens_per_s"), res.get("peak_bytes")
        log(
            f"{res['case']:<22} {res['status'][:90]:<12}"
            + (
                f" {tps:,.0f} tok/s  peak {peak / GIB:.2f} GiB  loss0 {res['loss0']:.4f}"
                if res["status"] == "ok"
                else ""
            )
        )
    try:
        write_reports(doc, out)
    except Exception as e:  # noqa: BLE001 - the JSON is written; the table and plot are extras
        log(f"no table/plot: {type(e).__name__}: {e}")
    log(f"wrote {path} ({doc['seconds']:.0f} s); loss0 check: {json.dumps(doc.get('loss0_check'))}")
    return 0


# ------------------------------------------------------------------------- the overlap stage
class OverlapSettings(NamedTuple):
    """The sizes of the overlap stage (the GPU's or ``--dry-run``'s)."""

    shape: str
    seq: int
    batch: int
    sync_every: int
    rounds: int  # measured per mode (one more runs so that they all merge inside the loop)
    deadline: float  # seconds for the whole stage (checkpoint, both peers)


GPU_OVERLAP = OverlapSettings("llama-3.2-1b", 2048, 4, 10, 6, 300)
DRY_OVERLAP = OverlapSettings("tiny-1b", 64, 2, 4, 5, 250)
OVERLAP_MODES = (("blocking", 0), ("auto", "auto"))


def overlap_peer(spec: dict[str, Any]) -> dict[str, Any]:
    """One peer of the overlap stage (its own process): the library's step and ``rj.diloco``,
    a real ``rj.Swarm`` through the proxy and ``rj.OuterSync``, blocking and then auto."""
    import jax
    import jax.numpy as jnp

    import ravnest_jax as rj
    from ravnest_jax.swarm import Swarm, Timeouts

    make_train_step, TokenBatch, where = step_api()
    i, h = spec["peer"], spec["sync_every"]
    lm, tx, _, step = _ours_model(spec["ckpt"], None, make_train_step, sync_every=h)
    cfg = SHAPES[spec["shape"]]
    batch = TokenBatch.from_windows(jnp.asarray(random_windows(cfg["vocab_size"], spec["batch"], spec["seq"], seed=i)))
    compiled = step.trace(lm.adapters, tx.init(lm.adapters), lm.frozen, batch, jnp.int32(0)).lower().compile()
    # every mode starts from the same adapters (the step donates its inputs: keep a copy)
    adapters0 = jax.tree.map(jnp.copy, lm.adapters)
    out = {"peer": f"peer{i}", "step_api": where, "device": jax.devices()[0].device_kind, "modes": {}}
    timeouts = Timeouts(connect=10, part=120, grace=1, round=300, heartbeat=1, eviction=20)
    for name, tau in OVERLAP_MODES:
        net = spec["net"][name]
        adapters = jax.tree.map(jnp.copy, adapters0)
        state = _init_opt_state(lm, tx, adapters)
        swarm = Swarm(
            spec["rendezvous"],
            run_id=f"lora-overlap-{name}",
            token=TOKEN,
            codec="int4",
            listen=f"127.0.0.1:{net['listen'][i]}",
            advertise=f"http://127.0.0.1:{net['advertise'][i]}",
            timeouts=timeouts,
            peer_id=f"peer{i}",
        )
        with swarm:
            swarm.wait_for_peers(2, timeout=120)
            with rj.OuterSync(tx, swarm, overlap_steps=tau, samples_per_step=spec["batch"]) as sync:
                sync.warmup(adapters, state)
                # one round more than measured: the measured rounds all merge inside the loop
                # (the summary is read before the flush, which would wait out the last one)
                steps = (spec["rounds"] + 1) * h
                t0 = time.perf_counter()
                for k in range(steps):
                    adapters, state, metrics = compiled(adapters, state, lm.frozen, batch, jnp.int32(k))
                    adapters, state = sync(adapters, state)
                jax.block_until_ready(adapters)
                wall = time.perf_counter() - t0
                summary = sync.summary()
                ms = [m for m in sync.metrics if m.ok]
                adapters, state = sync.flush(adapters, state)
                out["modes"][name] = {
                    "overlap_steps": tau,
                    "steps": steps,
                    "wall_s": wall,
                    "steps_per_s": steps / wall,
                    "tokens_per_s": steps * spec["batch"] * spec["seq"] / wall,
                    "final_loss": float(metrics["loss"]),
                    "exchange_seconds": [round(m.exchange_seconds, 3) for m in ms],
                    "round_overlap_steps": [m.overlap_steps for m in ms],
                    **summary,
                    "after_flush": sync.summary(),
                }
    return out


def overlap_run(args: argparse.Namespace) -> int:
    """``--overlap``: the rendezvous and the proxy here, two peer processes on the GPU."""
    from _common import LinkEmulator, free_port, rendezvous_thread

    s = DRY_OVERLAP if args.dry_run else GPU_OVERLAP
    deadline = time.monotonic() + (args.deadline or s.deadline)
    if args.overlap_h:
        s = s._replace(sync_every=args.overlap_h)
    if args.overlap_rounds:
        s = s._replace(rounds=args.overlap_rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "lora_overlap.json"
    ckpt_root = Path(args.ckpt_dir or Path(tempfile.gettempdir()) / "ravnest-bench-lora-gpu")
    ck = ckpt_root / s.shape
    env = child_env(args.dry_run)
    t_start = time.perf_counter()
    doc: dict[str, Any] = {
        "benchmark": "lora_overlap",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "dry_run": args.dry_run,
        "config": {
            **s._asdict(),
            "peers": 2,
            "link_mbit": args.mbit,
            "rtt_ms": args.rtt_ms,
            "codec": "int4",
            "mem_fraction_per_peer": None if args.dry_run else 0.45,
            "modes": [m for m, _ in OVERLAP_MODES],
        },
    }
    if not _ckpt_ok(ck, s.shape):
        st, info, tail = run_child("ckpt", {"shape": s.shape, "path": str(ck)}, deadline - time.monotonic(), env)
        doc["checkpoint"] = info if st == "ok" else {"status": st, "tail": tail[-500:]}
        if st != "ok":
            doc["status"] = f"error: checkpoint {st}"
            _save(doc, path)
            print(doc["status"], flush=True)
            return 1
    # lines: 0 peer0 -> peer1, 1 peer1 -> peer0, 2 peers -> rendezvous, 3 back
    listen = {m: [free_port(), free_port()] for m, _ in OVERLAP_MODES}
    rv_port = free_port()
    routes = [(listen[m][i], 1 - i, i) for m, _ in OVERLAP_MODES for i in range(2)] + [(rv_port, 2, 3)]
    emu = LinkEmulator(routes, n_lines=4)
    emu.set_all(args.mbit, args.rtt_ms)
    ports = iter(emu.ports)
    net = {m: {"listen": listen[m], "advertise": [next(ports), next(ports)]} for m, _ in OVERLAP_MODES}
    rv_proxy = emu.ports[-1]
    peer_env = child_env(args.dry_run, mem_fraction=None if args.dry_run else 0.45)
    results: list[Any] = [None, None]
    try:
        with rendezvous_thread(TOKEN, port=rv_port, heartbeat=1, eviction=20):
            import threading

            def one(i: int) -> None:
                spec = {
                    **s._asdict(),
                    "peer": i,
                    "ckpt": str(ck),
                    "rendezvous": f"http://127.0.0.1:{rv_proxy}",
                    "net": net,
                }
                results[i] = run_child("peer", spec, deadline - time.monotonic(), peer_env)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        emu.close()
    doc["peers"] = []
    status = "ok"
    for i, (st, res, tail) in enumerate(results):
        if res is None:
            status = f"peer{i} {st}"
            doc["peers"].append({"peer": f"peer{i}", "status": st, "log_tail": tail[-1500:]})
        else:
            doc["peers"].append({**res, "status": "ok"})
    doc["status"] = status
    doc["seconds"] = time.perf_counter() - t_start
    _save(doc, path)
    for p in doc["peers"]:
        for name, m in p.get("modes", {}).items():
            print(
                f"{p['peer']} {name:<8} utilisation {m['compute_utilisation']}  stall {m['stall_seconds']:.2f} s  "
                f"rounds {m['rounds']}  {m['steps_per_s']:.2f} steps/s",
                flush=True,
            )
    print(f"wrote {path} ({doc['seconds']:.0f} s): {status}", flush=True)
    return 0 if status == "ok" else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        try:
            return _child(argv[1:])
        except Exception:  # noqa: BLE001 - the parent reads the last error line
            traceback.print_exc()
            return 1
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out",
        default=None,
        help="folder of lora_gpu.json/.png/.md (default: benchmarks/results; --dry-run: a temp folder, "
        "never over the GPU results)",
    )
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: every case, the same JSON fields")
    ap.add_argument("--overlap", action="store_true", help="the overlap stage instead (lora_overlap.json)")
    ap.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds for the whole run (default 450, dry 170; --overlap 300, dry 250)",
    )
    ap.add_argument("--cases", nargs="+", default=None, help="only these cases (names as in the JSON)")
    ap.add_argument("--ckpt-dir", default=None, help="where the random checkpoints go (default: a temp folder)")
    ap.add_argument("--overlap-h", type=int, default=None, help="H of the overlap stage (default 10; dry 4)")
    ap.add_argument("--overlap-rounds", type=int, default=None, help="rounds per mode (default 6; dry 5)")
    ap.add_argument("--mbit", type=float, default=100.0, help="the overlap stage's link rate (Mbit/s)")
    ap.add_argument("--rtt-ms", type=float, default=50.0, help="the overlap stage's link RTT (ms)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = str(Path(tempfile.gettempdir()) / "bench-lora-gpu-dry") if args.dry_run else str(HERE / "results")
    signal.signal(signal.SIGTERM, _stop_children)
    signal.signal(signal.SIGINT, _stop_children)
    if args.deadline is not None and args.deadline <= 0:
        ap.error(f"--deadline must be > 0, got {args.deadline}")
    return overlap_run(args) if args.overlap else main_run(args)


if __name__ == "__main__":
    sys.exit(main())
