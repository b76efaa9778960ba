"""rj.data packing: rows never cross documents (segment ids, positions, targets), split / drop of
long documents, padding out of the loss, TokenBatch's fields, shards, epochs and an exact resume."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from ravnest_jax.data import Example, PackedExamples

CHAT = Path(__file__).resolve().parents[1] / "fixtures" / "chat"
FIELDS = ("tokens", "targets", "loss_mask", "positions", "segment_ids")


def _examples(n=40, seed=0, max_len=50, vocab=1000) -> list[Example]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(2, max_len))
        prompt = int(rng.integers(1, length))
        mask = np.arange(length) >= prompt  # a prompt, then the completion
        out.append(Example(rng.integers(1, vocab, length).astype(np.int32), mask, f"x:{i}"))
    return out


def _pieces(examples, seq_len, overlong):
    """The (tokens + final target, loss mask) pieces each document should become."""
    want = Counter()
    for ex in examples:
        n = len(ex.tokens) - 1
        if n > seq_len and overlong == "drop":
            continue
        for a in range(0, n, seq_len):
            b = min(a + seq_len, n)
            if ex.mask[a + 1 : b + 1].any():
                want[(tuple(ex.tokens[a : b + 1].tolist()), tuple(ex.mask[a + 1 : b + 1].tolist()))] += 1
    return want


def _segments(row):
    """Checks one row's invariants; yields its documents as (tokens + final target, mask)."""
    seg, pos = row["segment_ids"], row["positions"]
    used = int((seg > 0).sum())
    assert (seg[used:] == 0).all() and (seg[:used] > 0).all(), "padding only at the end"
    assert (row["loss_mask"][used:] == 0).all(), "padding is out of the loss"
    assert (np.diff(seg[:used]) >= 0).all() and (np.diff(seg[:used]) <= 1).all() and (used == 0 or seg[0] == 1)
    for s in range(1, int(seg.max()) + 1):
        idx = np.flatnonzero(seg == s)
        assert (pos[idx] == np.arange(len(idx))).all(), "positions restart at 0 per document"
        toks, tgts = row["tokens"][idx], row["targets"][idx]
        assert (tgts[:-1] == toks[1:]).all(), "targets are the next token of the same document"
        yield tuple(toks.tolist() + [int(tgts[-1])]), tuple(bool(x) for x in row["loss_mask"][idx])


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("overlong", ["split", "drop"])
def test_rows_hold_every_document_once_and_never_cross_one(packing, overlong):
    examples = _examples()
    seq_len = 24
    p = PackedExamples(examples, seq_len=seq_len, batch=2, packing=packing, overlong=overlong)
    got = Counter()
    for r in range(p.stats["rows"]):
        row = p.row(r)
        assert set(row) == set(FIELDS) and all(v.shape == (seq_len,) for v in row.values())
        segs = list(_segments(row))
        assert packing or len(segs) == 1
        got.update(segs)
    assert got == _pieces(examples, seq_len, overlong)
    longer = sum(len(e.tokens) - 1 > seq_len for e in examples)
    assert longer > 0
    assert p.stats["dropped_overlong"] == (longer if overlong == "drop" else 0)
    assert p.stats["split"] == (longer if overlong == "split" else 0)
    assert p.stats["loss_tokens"] == sum(np.sum(m) for _, m in got.elements())
    if packing:  # packed rows are fuller than one document a row
        unpacked = PackedExamples(examples, seq_len=seq_len, batch=2, packing=False, overlong=overlong)
        assert p.stats["rows"] < unpacked.stats["rows"] and p.stats["fill"] > unpacked.stats["fill"]


def test_batches_are_token_batch_fields():
    b = PackedExamples(_examples(), seq_len=32, batch=3).next()
    assert tuple(b) == FIELDS
    assert {k: (v.dtype.name, v.shape) for k, v in b.items()} == {
        **{k: ("int32", (3, 32)) for k in FIELDS},
        "loss_mask": ("float32", (3, 32)),
    }
    models = pytest.importorskip("ravnest_jax.models")
    if not hasattr(models, "TokenBatch"):
        pytest.skip("ravnest_jax.models.TokenBatch is not on this branch yet")
    assert tuple(models.TokenBatch._fields) == FIELDS
    models.TokenBatch(**b)


def test_changing_one_document_changes_no_other_segment():
    a = _examples()
    b = list(a)
    b[7] = Example((a[7].tokens + 1) % 1000, a[7].mask, "x:7")  # same length and mask, other tokens
    pa, pb = PackedExamples(a, seq_len=24, batch=1), PackedExamples(b, seq_len=24, batch=1)
    changed = 0
    for r in range(pa.stats["rows"]):
        ra, rb = pa.row(r), pb.row(r)
        for k in ("loss_mask", "positions", "segment_ids"):  # the layout depends on lengths only
            assert (ra[k] == rb[k]).all()
        diff = np.flatnonzero((ra["tokens"] != rb["tokens"]) | (ra["targets"] != rb["targets"]))
        if diff.size:
            changed += 1
            assert len(set(ra["segment_ids"][diff].tolist())) == 1  # within one document
    assert changed >= 1


def test_no_loss_documents_are_left_out_and_nothing_to_learn_is_an_error():
    ex = _examples(10)
    prompt_only = Example(np.arange(1, 6, dtype=np.int32), np.zeros(5, bool), "p:1")
    p = PackedExamples([*ex, prompt_only, Example(np.ones(1, np.int32), np.ones(1, bool))], seq_len=64, batch=1)
    assert p.stats["no_loss"] == 2 and p.stats["examples"] == 12
    with pytest.raises(ValueError, match="^nothing to learn: of 1 examples 0 were longer .* 1 had no completion"):
        PackedExamples([prompt_only], seq_len=8, batch=1)
    long_only = [Example(np.arange(1, 40, dtype=np.int32), np.ones(39, bool))]
    with pytest.raises(ValueError, match="^nothing to learn: of 1 examples 1 were longer than seq_len=8"):
        PackedExamples(long_only, seq_len=8, batch=1, overlong="drop")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seq_len": 0}, "seq_len must be an int >= 1"),
        ({"batch": 1.5}, "batch must be an int >= 1"),
        ({"shard": 2, "num_shards": 2}, r"shard must be in \[0, 2\)"),
        ({"overlong": "truncate"}, "overlong must be one of"),
        ({"packing": "yes"}, "packing must be a bool"),
        ({"batch": 1000}, "shard 0 of 1 has .* rows of 16 tokens, fewer than one batch of 1000"),
    ],
)
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PackedExamples(_examples(), **{"seq_len": 16, "batch": 2, **kwargs})


def test_shards_are_disjoint_and_epochs_reshuffle():
    ex = _examples(60)
    shards = [PackedExamples(ex, seq_len=16, batch=2, shard=s, num_shards=3, seed=5) for s in range(3)]
    rows = [set(s.rows.tolist()) for s in shards]
    assert set().union(*rows) == set(range(shards[0].stats["rows"]))
    assert sum(map(len, rows)) == shards[0].stats["rows"]
    s = shards[1]
    n = len(s.rows)
    assert sorted(s._order_of(0).tolist()) == sorted(s.rows.tolist())
    assert s._order_of(0).tolist() != s._order_of(1).tolist()
    again = PackedExamples(ex, seq_len=16, batch=2, shard=1, num_shards=3, seed=5)
    assert all((again.batch_at(k)["tokens"] == s.batch_at(k)["tokens"]).all() for k in range(n))
    other = PackedExamples(ex, seq_len=16, batch=2, shard=1, num_shards=3, seed=6)
    assert any((other.batch_at(k)["tokens"] != s.batch_at(k)["tokens"]).any() for k in range(n // 2))


@pytest.mark.parametrize("stop", [1, 5, 13])
def test_resume_mid_epoch_is_exact(stop):
    ex = _examples(30)
    a = PackedExamples(ex, seq_len=20, batch=3, shard=1, num_shards=2, seed=9)
    for _ in range(stop):
        a.next()
    state = a.state()
    b = PackedExamples(ex, seq_len=20, batch=3, shard=1, num_shards=2, seed=9)
    b.load_state(state)
    assert b.position == stop and b.epoch == a.epoch
    for _ in range(2 * len(a.rows)):  # past the next epoch boundary
        x, y = a.next(), b.next()
        assert all((x[k] == y[k]).all() for k in FIELDS)


def test_a_state_of_other_data_is_refused():
    ex = _examples(30)
    state = PackedExamples(ex, seq_len=20, batch=1).state()
    with pytest.raises(ValueError, match="data state has seed=0, this loader 1"):
        PackedExamples(ex, seq_len=20, batch=1, seed=1).load_state(state)
    with pytest.raises(ValueError, match="data state has fingerprint="):
        PackedExamples(_examples(30, seed=1), seq_len=20, batch=1).load_state(state)


def test_chat_fixture_batches_learn_exactly_the_assistant_turns():
    pytest.importorskip("jinja2")
    from ravnest_jax.data import load_examples, load_tokenizer, packed_dataset, read_records

    tok = load_tokenizer(CHAT / "chatml")
    examples = load_examples(CHAT / "messages.jsonl", CHAT / "chatml")
    p = PackedExamples(examples, seq_len=256, batch=1, pad_id=tok.token_to_id("<pad>"))
    q = packed_dataset(CHAT / "messages.jsonl", CHAT / "chatml", seq_len=256, batch=1)
    assert q.fingerprint == p.fingerprint and all((q.row(0)[k] == p.row(0)[k]).all() for k in FIELDS)
    assert (p.row(0)["tokens"][p.row(0)["segment_ids"] == 0] == tok.token_to_id("<pad>")).all()
    assert p.stats["rows"] == 1 and p.stats["split"] == 0
    b = p.next()
    learned = tok.decode(b["targets"][b["loss_mask"] > 0].tolist(), skip_special_tokens=False)
    chats = [r.data["messages"] for r in read_records(CHAT / "messages.jsonl")]
    turns = Counter(m["content"] + "<|im_end|>" for c in chats for m in c if m["role"] == "assistant")
    # documents are packed longest first: compare the learned text as a multiset of turns
    assert sorted(learned.split("<|im_end|>")[:-1]) == sorted(t[: -len("<|im_end|>")] for t in turns.elements())
    assert int(b["segment_ids"].max()) == 3


def test_split_examples_holds_out_a_seeded_fraction():
    from ravnest_jax.data import split_examples

    ex = _examples(40)
    train, held = split_examples(ex, 0.1, seed=3)
    assert len(held) == 4 and len(train) == 36
    assert {e.where for e in train} | {e.where for e in held} == {e.where for e in ex}
    assert [e.where for e in split_examples(ex, 0.1, seed=3)[1]] == [e.where for e in held]
    assert [e.where for e in split_examples(ex, 0.1, seed=4)[1]] != [e.where for e in held]
    with pytest.raises(ValueError, match="fraction must be in"):
        split_examples(ex, 1.0)
