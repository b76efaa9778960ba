"""rj.data records: each format parsed from its jsonl fixture, format detection, and one one-line
error per kind of malformed record (file, line, field), raised while reading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ravnest_jax.data import as_records, read_records, resolve_files, scan

CHAT = Path(__file__).resolve().parents[1] / "fixtures" / "chat"


@pytest.mark.parametrize(
    "name, fmt, conversational, first",
    [
        ("text.jsonl", "text", False, {"text": "The sky is blue."}),
        ("prompt_completion.jsonl", "prompt_completion", False, {"prompt": "The capital of France is"}),
        (
            "prompt_completion_chat.jsonl",
            "prompt_completion",
            True,
            {"prompt": [{"role": "user", "content": "Colour of the sky?"}]},
        ),
        ("messages.jsonl", "messages", True, {}),
        ("alpaca.jsonl", "alpaca", False, {"instruction": "Name the capital of France.", "output": "Paris."}),
    ],
)
def test_each_format_is_detected_and_parsed(name, fmt, conversational, first):
    records = read_records(CHAT / name)
    lines = (CHAT / name).read_text().splitlines()
    assert len(records) == len(lines) >= 2
    assert {r.format for r in records} == {fmt}
    assert all(r.conversational == conversational for r in records)
    assert records[0].where == f"{CHAT / name}:1"
    assert all(records[0].data[k] == v for k, v in first.items())
    # the explicit format reads the same
    assert [r.data for r in read_records(CHAT / name, format=fmt)] == [r.data for r in records]


def test_a_directory_a_glob_and_scan(tmp_path):
    for n in ("a.jsonl", "b.jsonl"):
        (tmp_path / n).write_text((CHAT / "text.jsonl").read_text())
    (tmp_path / "notes.txt").write_text("ignored in a directory")
    assert [f.name for f in resolve_files(tmp_path)] == ["a.jsonl", "b.jsonl"]
    assert len(read_records(str(tmp_path / "*.jsonl"))) == 6
    summary = scan([CHAT / "messages.jsonl", CHAT / "text.jsonl"])
    assert summary["records"] == 6 and summary["formats"] == {"messages": 3, "text": 3}
    assert summary["conversational"] == 3


def _write(tmp_path: Path, lines: list) -> Path:
    p = tmp_path / "train.jsonl"
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize(
    "bad, fmt, line, message",
    [
        ("{not json", "auto", 2, "not JSON"),
        ("[1, 2]", "auto", 2, "a record must be a JSON object, got a list"),
        ({"question": "q", "answer": "a"}, "auto", 2, "no known format in keys ['answer', 'question']"),
        ({"text": "a text"}, "auto", 2, "a text record in a messages file (first record"),
        ({"messages": []}, "auto", 2, '"messages" must be a non-empty list of messages, got a list'),
        ({"messages": "hi"}, "auto", 2, '"messages" must be a non-empty list of messages, got a string'),
        ({"messages": [{"role": "user", "content": "a"}, "b"]}, "auto", 2, '"messages"[1] must be an object'),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]},
            "auto",
            2,
            '"messages"[1] has no "content"',
        ),
        ({"messages": [{"content": "a"}]}, "auto", 2, '"messages"[0] has no "role"'),
        (
            {"messages": [{"role": 3, "content": "a"}]},
            "auto",
            2,
            '"messages"[0]["role"] must be a non-empty string, got int',
        ),
        (
            {"messages": [{"role": "user", "content": 7}]},
            "auto",
            2,
            '"messages"[0]["content"] must be a string, got int',
        ),
        ({"prompt": "p"}, "prompt_completion", 2, 'no "completion" (prompt_completion format); the record has keys'),
        # a key's typo, and another format's record: the keys it has, and which format they are
        ({"message": []}, "messages", 2, "no \"messages\" (messages format); the record has keys ['message']"),
        (
            {"prompt": "p", "completion": "c"},
            "messages",
            2,
            "keys ['completion', 'prompt']: the prompt_completion format (data.format: prompt_completion, or auto)",
        ),
        ({"prompt": "p", "completion": 3}, "prompt_completion", 2, '"completion" must be a string, got int'),
        ({"prompt": "p", "completion": ""}, "prompt_completion", 2, '"completion" is empty'),
        (
            {"prompt": [{"role": "user", "content": "p"}], "completion": "c"},
            "prompt_completion",
            2,
            '"prompt" is a list but "completion" is a string',
        ),
        (
            {"prompt": [{"role": "user", "content": "p"}], "completion": [{"role": "assistant"}]},
            "prompt_completion",
            2,
            '"completion"[0] has no "content"',
        ),
        ({"text": None}, "text", 2, '"text" must be a string, got null'),
        ({"instruction": "i"}, "alpaca", 2, "no \"output\" (alpaca format); the record has keys ['instruction']"),
        ({"instruction": "i", "input": 1, "output": "o"}, "alpaca", 2, '"input" must be a string, got int'),
    ],
)
def test_a_malformed_record_is_one_line_naming_file_line_and_field(tmp_path, bad, fmt, line, message):
    first = {
        "auto": GOOD,
        "messages": GOOD,
        "prompt_completion": {"prompt": "p", "completion": "c"},
        "text": {"text": "t"},
        "alpaca": {"instruction": "i", "output": "o"},
    }[fmt]
    p = _write(tmp_path, [first, bad])
    with pytest.raises(ValueError) as e:
        scan(p, format=fmt)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(f"{p}:{line}: "), text
    assert message in text, text


def test_blank_lines_are_skipped_and_line_numbers_stay_true(tmp_path):
    p = _write(tmp_path, [GOOD, "", GOOD, {"messages": [{"role": "user"}]}])
    with pytest.raises(ValueError, match=rf'^{p}:4: "messages"\[0\] has no "content"$'):
        read_records(p)


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_an_empty_dataset_is_an_error(tmp_path, content):
    p = tmp_path / "empty.jsonl"
    p.write_text(content)
    with pytest.raises(ValueError, match="^no records in"):
        read_records(p)
    with pytest.raises(ValueError, match="^no records in"):
        scan(p)


@pytest.mark.parametrize(
    "paths, message",
    [
        ("missing/*.jsonl", "no data files match"),
        ([], "no data files given"),
    ],
)
def test_missing_files_are_errors(paths, message):
    with pytest.raises(ValueError, match=message):
        resolve_files(paths)


def test_a_wrong_extension_and_an_unknown_format(tmp_path):
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(ValueError, match="must be .jsonl, .json or .parquet"):
        resolve_files(tmp_path / "a.csv")
    with pytest.raises(ValueError, match="format must be one of"):
        read_records(CHAT / "text.jsonl", format="sharegpt")


def test_in_memory_records():
    rs = as_records([{"text": "a"}, {"text": "b"}], name="rows")
    assert [r.where for r in rs] == ["rows:1", "rows:2"]
    with pytest.raises(ValueError, match=r"^rows:2: a messages record among text records"):
        as_records([{"text": "a"}, GOOD], name="rows")


def test_parquet_when_pyarrow_imports(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": "a b"}, {"text": "c"}]), tmp_path / "t.parquet")
    assert [r.data["text"] for r in read_records(tmp_path / "t.parquet")] == ["a b", "c"]


def test_a_json_array_file(tmp_path):
    p = tmp_path / "train.json"
    p.write_text(json.dumps([GOOD, GOOD, {"messages": [{"role": "user", "content": "x"}, {"content": "y"}]}], indent=1))
    with pytest.raises(ValueError, match=rf'^{p}\[2\]: "messages"\[1\] has no "role"$'):
        read_records(p)
    p.write_text(json.dumps([GOOD, GOOD]))
    assert [r.where for r in read_records(p)] == [f"{p}[0]", f"{p}[1]"]
    p.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")  # .json with one record a line
    assert [r.where for r in read_records(p)] == [f"{p}:1", f"{p}:2"]
