"""The char-LM: a decoder-only byte-level transformer in flax nnx, its loss, its inner
optimizer (AdamW, warmup + cosine) and a jitted evaluator."""

from __future__ import annotations

import dataclasses

import numpy as np

from char_lm.data import VOCAB


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int = 96
    num_layers: int = 2
    num_heads: int = 4
    seq_len: int = 64
    mlp_ratio: int = 4


def build_model(cfg: ModelConfig, seed: int = 0):
    """A decoder-only transformer (flax nnx) over bytes.

    Returns:
      ``(graphdef, params)``: the nnx graph definition and the ``nnx.State`` of its parameters
      (float32). ``apply(graphdef, params, tokens)`` gives logits.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            d = cfg.d_model
            self.ln1 = nnx.LayerNorm(d, rngs=rngs)
            self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
            self.proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(d, rngs=rngs)
            self.fc = nnx.Linear(d, cfg.mlp_ratio * d, rngs=rngs)
            self.out = nnx.Linear(cfg.mlp_ratio * d, d, rngs=rngs)

        def __call__(self, x):
            b, t, d = x.shape
            h = cfg.num_heads
            q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
            q, k, v = (z.reshape(b, t, h, d // h) for z in (q, k, v))
            att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.reshape(b, t, d))
            return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))

    class CharTransformer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(VOCAB, cfg.d_model, rngs=rngs)
            self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model)))
            self.blocks = nnx.List([Block(rngs) for _ in range(cfg.num_layers)])
            self.ln = nnx.LayerNorm(cfg.d_model, rngs=rngs)
            self.head = nnx.Linear(cfg.d_model, VOCAB, use_bias=False, rngs=rngs)

        stage_ends = (True, True)  # a pipeline stage's slice: see stage_split

        def __call__(self, tokens):
            first, last = self.stage_ends
            x = self.embed(tokens) + self.pos[...][: tokens.shape[1]] if first else tokens
            for block in self.blocks:
                if block is not None:  # None: a block another pipeline stage holds
                    x = block(x)
            return self.head(self.ln(x)) if last else x

    model = CharTransformer(nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def stage_split(graphdef, params):
    """The model as pipeline units (``rj.pipeline.LayerSplit``): the embedding with the position
    table, each block, the final norm with the head; the loss is :func:`make_loss`'s."""
    from flax import nnx

    import ravnest_jax as rj

    return rj.pipeline.LayerSplit(
        nnx.merge(graphdef, params), blocks="blocks", prologue=("embed", "pos"), epilogue=("ln", "head")
    )


def make_loss(graphdef):
    """``loss(params, tokens) -> scalar``: mean next-byte cross-entropy (nats), tokens int32 ``(B, T+1)``."""
    import optax
    from flax import nnx

    def loss(params, tokens):
        model = nnx.merge(graphdef, params)
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss


def inner_optimizer(lr: float, steps: int, kind: str = "adamw", warmup: float = 0.05):
    """The inner optimizer: linear warm-up (``warmup`` of the steps) and cosine decay to 10%.

    ``kind="adamw"``: AdamW (b1 0.9, b2 0.95, weight decay 0.1), the DiLoCo inner setup.
    ``kind="muon"``: Muon (``optax.contrib.muon``, Jordan et al. 2024; arXiv 2502.16982) at peak
    ``lr`` on the 2-D weights of the blocks, AdamW at peak 3e-3 on the rest (embedding, position
    table, output head, norms, biases), as Muon is usually run.
    """
    import optax

    def schedule(peak: float):
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, warmup_steps=max(1, int(steps * warmup)), decay_steps=steps, end_value=peak * 0.1
        )

    if kind == "adamw":
        return optax.adamw(schedule(lr), b1=0.9, b2=0.95, weight_decay=0.1)
    if kind != "muon":
        raise ValueError(f"inner optimizer must be 'adamw' or 'muon', got {kind!r}")
    import jax
    from optax.contrib import MuonDimensionNumbers, muon

    def dims(params):
        def pick(path, x):
            name = jax.tree_util.keystr(path)
            if x.ndim == 2 and "blocks" in name:
                return MuonDimensionNumbers(reduction_axis=0, output_axis=1)
            return None

        return jax.tree_util.tree_map_with_path(pick, params)

    return muon(
        schedule(lr),
        beta=0.95,
        weight_decay=0.1,
        adam_b1=0.9,
        adam_b2=0.95,
        adam_weight_decay=0.1,
        adam_learning_rate=schedule(3e-3),
        muon_weight_dimension_numbers=dims,
    )


def outer_optimizer(lr: float | None = None, momentum: float | None = None):
    """``rj.default_outer`` with ``lr`` and ``momentum`` where given (``None``: its defaults)."""
    import ravnest_jax as rj

    kw = {k: v for k, v in (("learning_rate", lr), ("momentum", momentum)) if v is not None}
    return rj.default_outer(**kw)


def make_evaluator(graphdef, eval_tokens: np.ndarray):
    """``evaluate(params) -> float``: mean eval loss over the fixed eval windows (nats/byte)."""
    import jax
    import jax.numpy as jnp

    loss = make_loss(graphdef)
    tokens = jnp.asarray(eval_tokens)

    @jax.jit
    def _eval(params):
        return jax.lax.map(lambda b: loss(params, b), tokens).mean()

    return lambda params: float(_eval(params))
