"""Examples -> training batches: records tokenised (chat ones through the checkpoint's template)
with a loss mask over the completion / assistant tokens, packed into rows of the sequence length
without crossing documents (segment ids and positions reset per document) or padded one document
a row, one shard per peer, read in an order that depends only on (seed, shard, position).
"""

from __future__ import annotations

import bisect
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._chat import ChatTemplate, TokenizerConfig, load_tokenizer_config
from ._records import Record, alpaca_prompt, read_records

OVERLONG = ("split", "drop")
BATCH_FIELDS = ("tokens", "targets", "loss_mask", "positions", "segment_ids")  # ravnest_jax.models.TokenBatch


@dataclass(frozen=True)
class Example:
    """One tokenised document.

    Attributes:
      tokens: int32 ``(n,)``: the whole sequence (BOS, prompt, completion, EOS / turn end).
      mask: bool ``(n,)``: True where the token is learned (predicted from the ones before it);
        ``mask[0]`` is never used (nothing predicts the first token).
      where: the record's ``"file:line"``.
    """

    tokens: np.ndarray
    mask: np.ndarray
    where: str = ""


def _token_id(tokenizer: Any, token: str | None) -> int | None:
    return None if token is None else tokenizer.token_to_id(token)


def _ids(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special).ids)


_SENTINEL = "\u27e6ravnest-content\u27e7"


def _opening(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], kw: Mapping[str, Any], full: str) -> str:
    """What a template renders before the content of a first message from the assistant (BOS, a
    default system prompt, the assistant header): the conversation rendered with that content
    replaced by a sentinel, up to the sentinel; "" where that is not the start of ``full``."""
    first = {**messages[0], "content": _SENTINEL}
    try:
        text = template.render([first, *messages[1:]], **kw)
    except ValueError:
        return ""
    cut = text.find(_SENTINEL)
    return text[:cut] if cut >= 0 and full.startswith(text[:cut]) else ""


def encode_chat(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    template: ChatTemplate,
    *,
    learn_from: int = 0,
    train_on_prompt: bool = False,
    turn_end: str | None = None,
    where: str = "",
    template_kwargs: Mapping[str, Any] | None = None,
) -> Example:
    """A conversation through ``template``, tokenised as transformers' ``apply_chat_template``
    does (``add_special_tokens=False``: the template renders the BOS), with the loss on the
    assistant messages at index ``>= learn_from``.

    An assistant message's tokens are found from text prefixes: the conversation before it
    rendered with ``add_generation_prompt=True`` and the conversation through it must both be
    prefixes of the whole rendering; the tokens whose characters fall between the two are its
    own, cut after the last ``turn_end`` token among them (the template's newline after
    ``<|im_end|>`` is not learned; the turn end is); without one among them, after the last
    special token when only whitespace follows it (Gemma's ``<end_of_turn>``, whose EOS is
    ``<eos>``). ``template_kwargs`` reach the template
    (e.g. ``{"enable_thinking": False}``).

    Raises:
      ValueError: ``"<where>: ..."``: the template failed, or renders a prefix of the
        conversation differently from the whole (it rewrites earlier turns). A conversation with
        no assistant message to learn gives an all-False mask (:class:`PackedExamples` leaves it
        out and counts it).
    """
    kw = dict(template_kwargs or {})
    try:
        full = template.render(messages, **kw)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    enc = tokenizer.encode(full, add_special_tokens=False)
    tokens = np.asarray(enc.ids, np.int32)
    if train_on_prompt:
        return Example(tokens, np.ones(len(tokens), bool), where)
    mask = np.zeros(len(tokens), bool)
    starts = np.asarray([o[0] for o in enc.offsets], np.int64)
    ends = np.asarray([o[1] for o in enc.offsets], np.int64)
    end_id = _token_id(tokenizer, turn_end)
    specials = None
    for i, m in enumerate(messages):
        if i < learn_from or m.get("role") != "assistant":
            continue
        try:
            before = (
                template.render(messages[:i], add_generation_prompt=True, **kw)
                if i
                else _opening(template, messages, kw, full)
            )
            through = template.render(messages[: i + 1], **kw)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        for name, text in (("before", before), ("through", through)):
            if not full.startswith(text):
                raise ValueError(
                    f"{where}: the chat template renders the conversation {name} message {i} differently from the "
                    "whole conversation (it rewrites earlier turns): the assistant tokens cannot be located; "
                    "give one record per assistant turn, or a template that keeps earlier turns (template=)"
                )
        lo, hi = len(before), len(through)
        span = np.flatnonzero((ends > lo) & (starts < hi))
        hits = span[tokens[span] == end_id] if end_id is not None else span[:0]
        if not hits.size and span.size:  # the turn end is not the EOS (Gemma's <end_of_turn>): the last special token
            if specials is None:
                specials = np.asarray([k for k, t in tokenizer.get_added_tokens_decoder().items() if t.special])
            hits = span[np.isin(tokens[span], specials)]
            if hits.size and tokenizer.decode(tokens[span[span > hits[-1]]].tolist()).strip():
                hits = hits[:0]  # text follows it: not a turn end
        if hits.size:
            span = span[span <= hits[-1]]
        mask[span] = True
    return Example(tokens, mask, where)


def encode_record(
    record: Record,
    tokenizer: Any,
    config: TokenizerConfig,
    *,
    template: ChatTemplate | None = None,
    train_on_prompt: bool = False,
    eos_id: int | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Example:
    """One record as an :class:`Example`.

    - ``text``: the tokenizer's own special tokens (its post-processor's BOS), the text, EOS;
      every token learned.
    - ``prompt_completion`` (strings) and ``alpaca`` (Stanford Alpaca's prompt): the prompt with
      the tokenizer's special tokens, then the completion tokenised on its own, then EOS; the
      completion and EOS learned (the prompt too with ``train_on_prompt``).
    - ``messages`` and conversational ``prompt_completion``: :func:`encode_chat`; the turn end is
      the config's ``eos_token``.

    The EOS is ``tokenizer_config.json``'s ``eos_token``, else ``eos_id`` (``config.json``'s), else
    none.

    Raises:
      ValueError: ``"<file:line>: ..."``: a chat record and no chat template; as :func:`encode_chat`.
    """
    eos = _token_id(tokenizer, config.eos_token)
    eos = eos_id if eos is None else eos
    tail = [] if eos is None else [eos]
    d = record.data
    if record.conversational:
        if template is None:
            raise ValueError(
                f"{record.where}: a chat record, and {config.path or 'the checkpoint'} has no chat_template"
            )
        if record.format == "messages":
            return encode_chat(
                d["messages"],
                tokenizer,
                template,
                train_on_prompt=train_on_prompt,
                turn_end=config.eos_token,
                where=record.where,
                template_kwargs=template_kwargs,
            )
        return encode_chat(
            [*d["prompt"], *d["completion"]],
            tokenizer,
            template,
            learn_from=len(d["prompt"]),
            train_on_prompt=train_on_prompt,
            turn_end=config.eos_token,
            where=record.where,
            template_kwargs=template_kwargs,
        )
    if record.format == "text":
        ids = _ids(tokenizer, d["text"], special=True)
        ids += tail if not ids or ids[-1] != eos else []
        return Example(np.asarray(ids, np.int32), np.ones(len(ids), bool), record.where)
    prompt, completion = (
        (alpaca_prompt(d), d["output"]) if record.format == "alpaca" else (d["prompt"], d["completion"])
    )
    p = _ids(tokenizer, prompt, special=True)
    c = _ids(tokenizer, completion, special=False) + tail
    mask = np.concatenate([np.full(len(p), train_on_prompt), np.ones(len(c), bool)])
    return Example(np.asarray(p + c, np.int32), mask, record.where)


def encode_records(
    records: Sequence[Record],
    tokenizer: Any,
    config: TokenizerConfig,
    *,
    template: str | None = None,
    train_on_prompt: bool = False,
    eos_id: int | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[Example]:
    """:func:`encode_record` over ``records``; chat ones through ``config``'s template named
    ``template`` (default: its default one).

    Raises:
      ValueError: as :func:`encode_record`; chat records and no such template.
    """
    chat = config.chat_template(template) if any(r.conversational for r in records) else None
    return [
        encode_record(
            r,
            tokenizer,
            config,
            template=chat,
            train_on_prompt=train_on_prompt,
            eos_id=eos_id,
            template_kwargs=template_kwargs,
        )
        for r in records
    ]


def load_examples(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    checkpoint: str | os.PathLike[str],
    *,
    format: str = "auto",
    template: str | None = None,
    train_on_prompt: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[Example]:
    """Reads ``paths`` (:func:`read_records`) and tokenises them with the checkpoint directory's
    ``tokenizer.json``, ``tokenizer_config.json`` (chat template, BOS/EOS) and ``config.json``
    (the EOS when the tokenizer config names none).

    Raises:
      ValueError: a malformed record, no records, no tokenizer, a chat record without a template.
    """
    from ._tokens import eos_token_id, load_tokenizer

    records = read_records(paths, format=format)
    config = load_tokenizer_config(checkpoint)
    return encode_records(
        records,
        load_tokenizer(checkpoint),
        config,
        template=template,
        train_on_prompt=train_on_prompt,
        eos_id=eos_token_id(checkpoint),
        template_kwargs=template_kwargs,
    )


def split_examples(examples: Sequence[Example], fraction: float = 0.05, *, seed: int = 0) -> tuple[list, list]:
    """``(train, held_out)``: a seeded random ``fraction`` of the examples (at least one) held out.

    Raises:
      ValueError: ``fraction`` outside (0, 1), or fewer than 2 examples.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
    if len(examples) < 2:
        raise ValueError(f"cannot hold out from {len(examples)} example(s)")
    held = set(np.random.default_rng(seed).permutation(len(examples))[: max(1, int(len(examples) * fraction))].tolist())
    return [e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held]


class PackedExamples:
    """Training batches of :class:`Example` s, one shard per peer, with an exact position.

    Each example of ``n`` tokens gives ``n - 1`` (input, target) pairs: inputs ``tokens[:-1]``,
    targets ``tokens[1:]``, learned where ``mask[1:]``; so no target ever lies in another
    document. A longer one than ``seq_len`` is split into consecutive pieces of ``seq_len`` pairs
    (each its own segment, positions from 0, the piece boundary's target kept) or dropped
    (``overlong``); pieces or examples with no learned token are left out. With ``packing`` the
    pieces are packed best-fit-decreasing into rows of ``seq_len`` (``segment_ids`` 1, 2, ... per
    piece in a row, 0 for padding; ``positions`` from 0 per piece); without, one piece a row,
    padded. Padding has ``loss_mask`` 0. Rows are fixed once; shard ``shard`` of ``num_shards``
    owns rows ``i % num_shards == shard`` and reads them in a fresh permutation each epoch from
    ``(seed, shard, epoch)``, so :meth:`state` / :meth:`load_state` resume exactly.

    Batches are numpy dicts with exactly the fields of ``ravnest_jax.models.TokenBatch``:
    ``tokens``, ``targets``, ``positions``, ``segment_ids`` int32 and ``loss_mask`` float32, each
    ``(batch, seq_len)``; ``TokenBatch(**batch)`` builds one. Attention must honour
    ``segment_ids`` (packing: Krell et al. 2021, arXiv:2107.02027).

    Args:
      examples: the tokenised documents (:func:`load_examples`).
      seq_len: tokens per row (the model's input length).
      batch: rows per batch.
      packing: pack several documents a row (True) or one padded document a row.
      overlong: ``"split"`` or ``"drop"`` documents of more than ``seq_len`` pairs.
      shard, num_shards: this peer's shard (0-based) of how many.
      seed: the order's seed (the same on every peer).
      pad_id: the token id of padding (its value never reaches the loss).

    Attributes:
      stats: ``{"examples", "dropped_overlong", "split", "no_loss", "rows", "tokens",
        "loss_tokens", "fill"}`` over the whole dataset (``fill``: non-padding fraction of the rows).

    Raises:
      ValueError: a bad size or option; nothing left to learn after dropping; this shard holds
        fewer rows than one batch.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        *,
        seq_len: int,
        batch: int,
        packing: bool = True,
        overlong: str = "split",
        shard: int = 0,
        num_shards: int = 1,
        seed: int = 0,
        pad_id: int = 0,
    ):
        for name, v in (("seq_len", seq_len), ("batch", batch), ("num_shards", num_shards)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(shard, int) or not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, {num_shards}), got {shard!r}")
        if overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
        if not isinstance(packing, bool):
            raise ValueError(f"packing must be a bool, got {packing!r}")
        self.seq_len, self.batch, self.shard, self.num_shards, self.seed = seq_len, batch, shard, num_shards, seed
        self.packing, self.overlong, self.pad_id = packing, overlong, pad_id

        inputs, targets, learned, lengths = [], [], [], []
        dropped = split = no_loss = 0
        for ex in examples:
            t, m = np.asarray(ex.tokens, np.int32), np.asarray(ex.mask, bool)
            if t.shape != m.shape or t.ndim != 1:
                raise ValueError(f"{ex.where}: tokens {t.shape} and mask {m.shape} must be equal 1-d shapes")
            n = len(t) - 1
            if n < 1 or not m[1:].any():
                no_loss += 1
                continue
            if n > seq_len:
                if overlong == "drop":
                    dropped += 1
                    continue
                split += 1
            for a in range(0, n, seq_len):
                b = min(a + seq_len, n)
                if m[a + 1 : b + 1].any():
                    inputs.append(t[a:b])
                    targets.append(t[a + 1 : b + 1])
                    learned.append(m[a + 1 : b + 1])
                    lengths.append(b - a)
        if not lengths:
            raise ValueError(
                f"nothing to learn: of {len(examples)} examples {dropped} were longer than seq_len={seq_len} "
                f"(overlong='drop') and {no_loss} had no completion / assistant token"
            )
        self._inputs = np.concatenate(inputs)
        self._targets = np.concatenate(targets)
        self._learned = np.concatenate(learned).astype(np.float32)
        self._lengths = np.asarray(lengths, np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self._lengths)[:-1]]).astype(np.int64)
        rows = self._pack(lengths) if packing else [[i] for i in range(len(lengths))]
        self._row_ptr = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
        self._row_units = np.asarray([u for r in rows for u in r], np.int64)
        self.stats = {
            "examples": len(examples),
            "dropped_overlong": dropped,
            "split": split,
            "no_loss": no_loss,
            "rows": len(rows),
            "tokens": int(self._lengths.sum()),
            "loss_tokens": int(self._learned.sum()),
            "fill": float(self._lengths.sum() / (len(rows) * seq_len)),
        }
        self.fingerprint = zlib.crc32(self._row_units.tobytes() + self._lengths.tobytes() + self._inputs.tobytes())
        self.rows = np.arange(shard, len(rows), num_shards, dtype=np.int64)
        if len(self.rows) < batch:
            raise ValueError(
                f"shard {shard} of {num_shards} has {len(self.rows)} rows of {seq_len} tokens, fewer than one batch of "
                f"{batch}: {len(rows)} rows in all from {len(examples)} examples"
            )
        self.position = 0  # batches taken
        self._epoch, self._order = -1, self.rows

    def _pack(self, lengths: list[int]) -> list[list[int]]:
        # best-fit decreasing: the longest piece first, each into the row it fills most tightly
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        rows: list[list[int]] = []
        free: list[tuple[int, int]] = []  # (free tokens, row), sorted; full rows leave it
        for u in order:
            k = bisect.bisect_left(free, (lengths[u], -1))
            if k == len(free):
                rows.append([u])
                room, row = self.seq_len - lengths[u], len(rows) - 1
            else:
                room, row = free.pop(k)
                rows[row].append(u)
                room -= lengths[u]
            if room:
                bisect.insort(free, (room, row))
        return rows

    def _order_of(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, self.shard, epoch])
            self._order, self._epoch = rng.permutation(self.rows), epoch
        return self._order

    def row(self, r: int) -> dict[str, np.ndarray]:
        """Row ``r`` of the whole dataset (any shard): the batch fields, each ``(seq_len,)``."""
        L = self.seq_len
        out = {
            "tokens": np.full(L, self.pad_id, np.int32),
            "targets": np.full(L, self.pad_id, np.int32),
            "loss_mask": np.zeros(L, np.float32),
            "positions": np.zeros(L, np.int32),
            "segment_ids": np.zeros(L, np.int32),
        }
        at = 0
        for seg, u in enumerate(self._row_units[self._row_ptr[r] : self._row_ptr[r + 1]], start=1):
            o, n = self._offsets[u], self._lengths[u]
            out["tokens"][at : at + n] = self._inputs[o : o + n]
            out["targets"][at : at + n] = self._targets[o : o + n]
            out["loss_mask"][at : at + n] = self._learned[o : o + n]
            out["positions"][at : at + n] = np.arange(n, dtype=np.int32)
            out["segment_ids"][at : at + n] = seg
            at += n
        return out

    def batch_at(self, position: int) -> dict[str, np.ndarray]:
        """Batch number ``position`` of this shard: the TokenBatch fields, each ``(batch, seq_len)``."""
        n = len(self.rows)
        rows = [
            self.row(int(self._order_of(g // n)[g % n]))
            for g in range(position * self.batch, (position + 1) * self.batch)
        ]
        return {k: np.stack([r[k] for r in rows]) for k in BATCH_FIELDS}

    def next(self) -> dict[str, np.ndarray]:
        """The next batch (:meth:`batch_at`); advances :attr:`position`."""
        out = self.batch_at(self.position)
        self.position += 1
        return out

    @property
    def epoch(self) -> float:
        """Passes over this shard so far."""
        return self.position * self.batch / len(self.rows)

    def state(self) -> dict[str, int]:
        """What to checkpoint: ``{"position", "shard", "num_shards", "seed", "fingerprint"}``
        (``fingerprint``: a CRC-32 of the packed rows, so resuming on other data is refused)."""
        return {
            "position": self.position,
            "shard": self.shard,
            "num_shards": self.num_shards,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continues from a :meth:`state`.

        Raises:
          ValueError: the state is of another shard layout, seed or dataset (resuming it would
            repeat or skip data).
        """
        for k in ("shard", "num_shards", "seed", "fingerprint"):
            if k in state and int(state[k]) != getattr(self, k):
                raise ValueError(f"data state has {k}={int(state[k])}, this loader {getattr(self, k)}")
        self.position = int(state["position"])


def packed_dataset(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    checkpoint: str | os.PathLike[str],
    *,
    seq_len: int,
    batch: int,
    format: str = "auto",
    template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    train_on_prompt: bool = False,
    packing: bool = True,
    overlong: str = "split",
    shard: int = 0,
    num_shards: int = 1,
    seed: int = 0,
) -> PackedExamples:
    """The whole path in one call: :func:`load_examples` then :class:`PackedExamples`, padding
    with the tokenizer config's ``pad_token`` (else id 0; padding never reaches the loss).

    Raises:
      ValueError: as :func:`load_examples` and :class:`PackedExamples`.
    """
    from ._tokens import load_tokenizer

    examples = load_examples(
        paths,
        checkpoint,
        format=format,
        template=template,
        train_on_prompt=train_on_prompt,
        template_kwargs=template_kwargs,
    )
    pad = load_tokenizer_config(checkpoint).pad_token
    pad_id = load_tokenizer(checkpoint).token_to_id(pad) if pad is not None else None
    return PackedExamples(
        examples,
        seq_len=seq_len,
        batch=batch,
        packing=packing,
        overlong=overlong,
        shard=shard,
        num_shards=num_shards,
        seed=seed,
        pad_id=0 if pad_id is None else pad_id,
    )
