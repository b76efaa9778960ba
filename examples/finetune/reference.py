"""The single-process reference for the fine-tuning swarm: the same adapters trained on the same
tokens with synchronous data-parallel steps (every step averages the gradients of all peers'
batches, as one process with their union as its batch), and the same eval set as ``train.py``.
What the tests and ``benchmarks/bench_finetune.py`` compare a swarm's eval loss with."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Setup:
    """The options of ``train.py`` that decide the math (the same defaults)."""

    checkpoint: str
    text: list[str] | None = None
    peers: int = 4
    max_steps: int = 300
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    lora_rank: int = 8
    lora_alpha: float | None = None
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    train_a: bool = True
    quantize: str | None = None
    dtype: str = "float32"  # train.py's --dtype auto on CPU
    eval_batches: int = 4
    seed: int = 0
    extra: dict = field(default_factory=dict)


def load(setup: Setup):
    """``(lm, shards, eval_set, loss_fn)`` exactly as ``train.py`` builds them; ``loss_fn(adapters,
    frozen, windows)`` is the mean loss per token of ``windows`` int32 ``(batch, seq + 1)``, with
    the library's chunked cross-entropy (``rj.models.chunked_cross_entropy``), as the step."""
    import jax.numpy as jnp
    import numpy as np

    from finetune.tiny import text_documents
    from ravnest_jax.data import PackedTokens, eos_token_id, load_tokenizer, split_held_out, tokenize
    from ravnest_jax.models import LoraConfig, TokenBatch, chunked_cross_entropy, load_pretrained, split_lora

    lora = LoraConfig(
        rank=setup.lora_rank,
        alpha=setup.lora_alpha or 2.0 * setup.lora_rank,
        targets=tuple(setup.lora_targets),
        train_a=setup.train_a,
        seed=setup.seed,
    )
    tokens = tokenize(
        text_documents(setup.text), load_tokenizer(setup.checkpoint), eos_id=eos_token_id(setup.checkpoint)
    )
    train_tokens, held_out = split_held_out(tokens)
    shards = [
        PackedTokens(
            train_tokens,
            seq_len=setup.seq_len,
            batch=setup.batch_size,
            shard=k,
            num_shards=setup.peers,
            seed=setup.seed,
        )
        for k in range(setup.peers)
    ]
    evals = PackedTokens(held_out, seq_len=setup.seq_len, batch=setup.batch_size, seed=setup.seed)
    eval_set = np.stack([evals.batch_at(i) for i in range(setup.eval_batches)])
    dtype = jnp.bfloat16 if setup.dtype == "bfloat16" else jnp.float32
    lm = split_lora(load_pretrained(setup.checkpoint, dtype=dtype, quantize=setup.quantize, lora=lora))

    def loss_fn(adapters, frozen, windows):
        b = TokenBatch.from_windows(windows)
        model = lm.model(adapters, frozen)
        hidden = model(b.tokens, b.positions, b.segment_ids, head=False)
        nll, count = chunked_cross_entropy(model, hidden, b.targets, b.loss_mask)
        return nll / count

    return lm, shards, eval_set, loss_fn


def train_data_parallel(setup: Setup) -> dict:
    """Trains the adapters for ``max_steps`` synchronous steps on all shards' batches.

    Returns:
      ``{"eval_loss_start", "eval_loss_end", "tokens"}`` (nats per token; tokens seen).
    """
    import jax.numpy as jnp
    import numpy as np
    import optax

    from ravnest_jax.models import TokenBatch, make_eval_loss, make_train_step

    lm, shards, eval_set, _ = load(setup)
    tx = optax.adamw(setup.lr, weight_decay=0.0)
    adapters, opt = lm.adapters, tx.init(lm.adapters)
    step = make_train_step(lm, tx)  # train.py's step, on the union of the peers' batches
    eval_loss = make_eval_loss(lm)
    evals = TokenBatch(*(np.stack(x) for x in zip(*(TokenBatch.from_windows(w) for w in eval_set))))

    start = float(eval_loss(adapters, lm.frozen, evals))
    for i in range(setup.max_steps):
        batch = TokenBatch.from_windows(np.concatenate([s.next() for s in shards]))
        adapters, opt, _ = step(adapters, opt, lm.frozen, batch, jnp.int32(i))
    return {
        "eval_loss_start": start,
        "eval_loss_end": float(eval_loss(adapters, lm.frozen, evals)),
        "tokens": setup.max_steps * setup.peers * setup.batch_size * setup.seq_len,
    }
