"""The two models of the pipeline tests: the char-LM example's transformer and the tiny Llama
fixture, each with its split, a deterministic data stream and the unsplit reference."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "tests" / "fixtures" / "llm" / "llama"
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))

BATCH, SEQ = 8, 16


def build(name: str, layers: int = 2):
    """``(split, params, loss_fn(params, tokens), vocab)`` of ``name`` (``"char"`` or
    ``"llama"``): the unsplit model's params (nnx.State) and loss over int32 ``(B, T + 1)``."""
    from flax import nnx

    import ravnest_jax as rj

    if name == "char":
        from char_lm.model import ModelConfig, build_model, make_loss, stage_split

        gd, params = build_model(ModelConfig(d_model=32, num_layers=layers, num_heads=2, seq_len=SEQ), seed=0)
        return stage_split(gd, params), params, make_loss(gd), 256
    if name == "llama":
        from ravnest_jax.models import load_pretrained

        model = load_pretrained(LLAMA, scan_layers=False)  # the whole model in the stages' per-layer paths
        gd, params = nnx.split(model, nnx.Param)

        def loss(p, tokens):
            logits = nnx.merge(gd, p)(tokens[:, :-1])
            return rj.pipeline.token_cross_entropy(logits, tokens[:, 1:])

        return rj.pipeline.transformer_split(model), params, loss, model.config.vocab_size
    raise ValueError(name)


def batches(vocab: int, seed: int = 0):
    """``batches(step)``: int32 tokens ``(BATCH, SEQ + 1)``, a function of (seed, step) only."""

    def f(step: int) -> np.ndarray:
        return np.random.default_rng([seed, step]).integers(0, vocab, (BATCH, SEQ + 1)).astype(np.int32)

    return f


def flat(state) -> dict[str, np.ndarray]:
    """An nnx.State as ``{dotted path: numpy array}``."""
    from flax import nnx

    return {
        ".".join(map(str, k)): np.asarray(v.get_value() if hasattr(v, "get_value") else v)
        for k, v in nnx.to_flat_state(state)
    }


def optimizer(lr: float = 0.1):
    """SGD with momentum 0.9: an optimizer with state that does not amplify float32 rounding.
    (AdamW's first steps move every weight by about ``lr`` whatever the gradient's size, so a
    gradient entry that is zero up to rounding flips a weight by ``2 lr`` between any two float32
    implementations, the unsplit model's jit included: no comparison at rtol 1e-5 survives it.)"""
    import optax

    return optax.sgd(lr, momentum=0.9)
