"""rj.data: tokenising real text with a tokenizer.json, packing, per-peer shards and an exact,
checkpointable position."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from ravnest_jax.data import PackedTokens, eos_token_id, load_tokenizer, split_held_out, tokenize  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TEXTS = [(STDLIB / name).read_text() for name in ("json/__init__.py", "argparse.py", "textwrap.py")]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS, trainer=trainer)
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text(json.dumps({"eos_token_id": [tok.token_to_id("<eos>"), 7]}))
    return d / "tokenizer.json"


def test_tokenize_round_trips_and_separates_documents(tokenizer_file):
    tok = load_tokenizer(tokenizer_file.parent)  # a checkpoint directory works too
    eos = eos_token_id(tokenizer_file.parent)
    assert eos == tok.token_to_id("<eos>")
    ids = tokenize(TEXTS, tok, eos_id=eos)
    assert ids.dtype == np.int32 and ids.ndim == 1
    docs = np.split(ids, np.flatnonzero(ids == eos) + 1)[:-1]
    assert len(docs) == len(TEXTS)
    for d, text in zip(docs, TEXTS):
        assert tok.decode(d[:-1].tolist()) == text
    assert len(ids) < 0.8 * sum(len(t) for t in TEXTS)  # BPE merges: fewer tokens than bytes


def test_bad_tokenizer_files_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer file"):
        load_tokenizer(tmp_path)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not a tokenizers tokenizer.json"):
        load_tokenizer(bad)
    assert eos_token_id(tmp_path) is None


def test_shards_are_disjoint_and_cover_every_sequence():
    tokens = np.arange(10 * 16 + 1, dtype=np.int32)
    seen = []
    for shard in range(3):
        d = PackedTokens(tokens, seq_len=16, batch=1, shard=shard, num_shards=3, seed=5)
        rows = np.concatenate([d.next() for _ in range(len(d.windows))])  # one epoch
        assert rows.shape[1] == 17
        np.testing.assert_array_equal(rows[:, 1:], rows[:, :-1] + 1)  # targets are the next tokens
        seen += [int(r[0]) // 16 for r in rows]
    assert sorted(seen) == list(range(10)), sorted(seen)


def test_position_resumes_the_same_batches_across_epochs():
    tokens = np.random.default_rng(0).integers(0, 300, 2000).astype(np.int32)
    a = PackedTokens(tokens, seq_len=32, batch=4, shard=1, num_shards=2, seed=3)
    first = [a.next() for _ in range(25)]  # 25 batches of 4 from 31 windows: past one epoch
    assert a.epoch > 1
    b = PackedTokens(tokens, seq_len=32, batch=4, shard=1, num_shards=2, seed=3)
    for _ in range(10):
        b.next()
    state = json.loads(json.dumps(b.state()))  # what a checkpoint keeps
    c = PackedTokens(tokens, seq_len=32, batch=4, shard=1, num_shards=2, seed=3)
    c.load_state(state)
    for i in range(10, 25):
        np.testing.assert_array_equal(c.next(), first[i])
    other = PackedTokens(tokens, seq_len=32, batch=4, shard=1, num_shards=2, seed=4)
    assert not np.array_equal(other.batch_at(0), first[0])
    with pytest.raises(ValueError, match="seed=3, this loader 4"):
        other.load_state(state)


def test_bad_sizes_are_rejected(tokenizer_file):
    with pytest.raises(ValueError, match="fewer than one batch"):
        PackedTokens(np.arange(100, dtype=np.int32), seq_len=32, batch=8)
    with pytest.raises(ValueError, match="shard must be in"):
        PackedTokens(np.arange(1000, dtype=np.int32), seq_len=8, batch=2, shard=2, num_shards=2)
    with pytest.raises(ValueError, match="1-d integer"):
        PackedTokens(np.zeros((4, 4)), seq_len=2, batch=1)
    with pytest.raises(ValueError, match="no tokens"):
        tokenize([""], load_tokenizer(tokenizer_file))
    train, held = split_held_out(np.arange(100))
    assert len(train) == 95 and len(held) == 5
