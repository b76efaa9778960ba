"""Fine-tuning records: jsonl (or parquet, when ``pyarrow`` imports) in the dataset formats TRL
documents (https://huggingface.co/docs/trl/dataset_formats) and alpaca's, read and checked record
by record, so that a malformed one stops the run with a one-line error naming the file, the line
and the field before any model loads.
"""

from __future__ import annotations

import glob as _glob
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = ("auto", "text", "prompt_completion", "messages", "alpaca")
_SUFFIXES = (".jsonl", ".json", ".parquet")

# Stanford Alpaca's prompt (https://github.com/tatsu-lab/stanford_alpaca), with and without an input
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


@dataclass(frozen=True)
class Record:
    """One checked example.

    Attributes:
      where: ``"file:line"`` (1-based line of a jsonl file, 1-based row of a parquet file), or
        ``"file[index]"`` (0-based, a .json file holding one array of records).
      format: ``"text"``, ``"prompt_completion"``, ``"messages"`` or ``"alpaca"``.
      data: the record's fields (a ``prompt``/``completion`` pair is either two strings or two
        lists of messages, see :attr:`conversational`).
    """

    where: str
    format: str
    data: Mapping[str, Any]

    @property
    def conversational(self) -> bool:
        """Whether the record is chat messages (needs the checkpoint's chat template)."""
        return self.format == "messages" or (
            self.format == "prompt_completion" and isinstance(self.data.get("prompt"), list)
        )


def _fail(where: str, message: str) -> ValueError:
    return ValueError(f"{where}: {message}")


def detect_format(record: Mapping[str, Any]) -> str | None:
    """The format of one record from its keys, or None: ``messages`` > ``prompt`` + ``completion``
    > ``instruction`` + ``output`` (alpaca) > ``text``."""
    if "messages" in record:
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "text" in record:
        return "text"
    return None


def _check_messages(where: str, name: str, messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _fail(where, f'"{name}" must be a non-empty list of messages, got {_kind(messages)}')
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _fail(where, f'"{name}"[{i}] must be an object {{"role", "content"}}, got {_kind(m)}')
        if "role" not in m:
            raise _fail(where, f'"{name}"[{i}] has no "role"')
        if not isinstance(m["role"], str) or not m["role"]:
            raise _fail(where, f'"{name}"[{i}]["role"] must be a non-empty string, got {_kind(m["role"])}')
        if "content" not in m:
            raise _fail(where, f'"{name}"[{i}] has no "content"')
        c = m["content"]
        if not (isinstance(c, str) or (c is None and m["role"] == "assistant" and m.get("tool_calls"))):
            if not (isinstance(c, list) and all(isinstance(p, dict) for p in c)):
                raise _fail(where, f'"{name}"[{i}]["content"] must be a string, got {_kind(c)}')


def _no_key(where: str, record: Mapping[str, Any], key: str, format: str) -> ValueError:
    """The record has no ``key``: says which keys it has, and their format when it is another."""
    other = detect_format(record)
    keys = sorted(record)[:8]
    also = f": the {other} format (data.format: {other}, or auto)" if other and other != format else ""
    return _fail(where, f'no "{key}" ({format} format); the record has keys {keys}{also}')


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null", bool: "a boolean"}.get(
        type(v), type(v).__name__
    )


def check_record(where: str, record: Any, format: str) -> Record:
    """Checks one record of format ``format`` (not ``"auto"``).

    Raises:
      ValueError: ``"<where>: <what is wrong, naming the field>"``, one line.
    """
    if not isinstance(record, dict):
        raise _fail(where, f"a record must be a JSON object, got {_kind(record)}")

    def string(key: str, *, empty: bool = False) -> None:
        if key not in record:
            raise _no_key(where, record, key, format)
        if not isinstance(record[key], str):
            raise _fail(where, f'"{key}" must be a string, got {_kind(record[key])}')
        if not empty and not record[key]:
            raise _fail(where, f'"{key}" is empty')

    if format == "text":
        string("text")
    elif format == "alpaca":
        string("instruction")
        string("output")
        if record.get("input") is not None and not isinstance(record["input"], str):
            raise _fail(where, f'"input" must be a string, got {_kind(record["input"])}')
    elif format == "messages":
        if "messages" not in record:
            raise _no_key(where, record, "messages", format)
        _check_messages(where, "messages", record["messages"])
    elif format == "prompt_completion":
        for key in ("prompt", "completion"):
            if key not in record:
                raise _no_key(where, record, key, format)
        p, c = record["prompt"], record["completion"]
        if isinstance(p, list) or isinstance(c, list):
            if not (isinstance(p, list) and isinstance(c, list)):
                raise _fail(
                    where, f'"prompt" is {_kind(p)} but "completion" is {_kind(c)}: both strings or both messages'
                )
            _check_messages(where, "prompt", p)
            _check_messages(where, "completion", c)
        else:
            string("prompt", empty=True)
            string("completion")
    else:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    return Record(where, format, record)


def resolve_files(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The data files of ``paths``: each a file, a glob, or a directory (its ``*.jsonl``, ``*.json``
    and ``*.parquet`` files, recursively), sorted within each entry, duplicates removed. A
    ``.json`` file holds one record a line, or one JSON array of records.

    Raises:
      ValueError: an entry matches no file, or a file is not .jsonl/.json/.parquet.
    """
    entries = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not entries:
        raise ValueError("no data files given")
    out: list[Path] = []
    for e in entries:
        p = Path(e)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in _SUFFIXES)
        elif p.is_file():
            found = [p]
        else:
            found = sorted(Path(f) for f in _glob.glob(str(e), recursive=True) if Path(f).is_file())
        if not found:
            raise ValueError(f"no data files match {str(e)!r}")
        for f in found:
            if f.suffix not in _SUFFIXES:
                raise ValueError(f"{f}: a data file must be .jsonl, .json or .parquet")
            if f not in out:
                out.append(f)
    return out


def _raw_records(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"{path}:{i}", row
        return
    if path.suffix == ".json":
        with open(path, encoding="utf-8") as fh:
            head = fh.read(4096).lstrip()
        if head.startswith("["):  # one JSON array of records; "where" is the record's index
            try:
                rows = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise _fail(f"{path}:{e.lineno}", f"not JSON ({e.msg} at column {e.colno})") from None
            for i, row in enumerate(rows):
                yield f"{path}[{i}]", row
            return
    with open(path, encoding="utf-8") as fh:
        try:
            for i, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{i}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise _fail(f"{path}:{i}", f"not JSON ({e.msg} at column {e.colno})") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None


def iter_records(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, format: str = "auto"
) -> Iterator[Record]:
    """Reads and checks the records of ``paths`` (see :func:`resolve_files`), one file after the
    other in order. ``format="auto"`` takes each file's format from its first record's keys (one
    format per file: a record of another format is an error).

    Raises:
      ValueError: one line, ``"<file>:<line>: <what>"``: not JSON, not an object, no known format,
        a format other than the file's, a missing or mistyped field (e.g.
        ``data/train.jsonl:17: "messages"[2] has no "content"``).
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    for path in resolve_files(paths):
        file_format, first = (None, "") if format == "auto" else (format, "")
        for where, raw in _raw_records(path):
            if format == "auto":
                if not isinstance(raw, dict):
                    raise _fail(where, f"a record must be a JSON object, got {_kind(raw)}")
                found = detect_format(raw)
                if found is None:
                    raise _fail(
                        where,
                        f'no known format in keys {sorted(raw)}: expected "text", "prompt"+"completion", '
                        f'"messages" or "instruction"+"output"',
                    )
                if file_format is None:
                    file_format, first = found, where
                elif found != file_format:
                    raise _fail(
                        where, f"a {found} record in a {file_format} file (first record {first}): one format a file"
                    )
            yield check_record(where, raw, file_format)


def read_records(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, format: str = "auto"
) -> list[Record]:
    """All records of ``paths`` (:func:`iter_records`), checked.

    Raises:
      ValueError: a malformed record (see :func:`iter_records`), or no record at all.
    """
    records = list(iter_records(paths, format=format))
    if not records:
        raise ValueError(f"no records in {_describe(paths)}")
    return records


def scan(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, format: str = "auto") -> dict[str, Any]:
    """The cheap check to run before any model loads: reads and checks every record, keeps none.

    Returns:
      ``{"files": [str], "records": int, "formats": {format: count}, "conversational": int}``
      (``conversational``: records that need a chat template).

    Raises:
      ValueError: as :func:`read_records`.
    """
    files = [str(f) for f in resolve_files(paths)]
    n, formats, chat = 0, {}, 0
    for r in iter_records(paths, format=format):
        n += 1
        formats[r.format] = formats.get(r.format, 0) + 1
        chat += r.conversational
    if not n:
        raise ValueError(f"no records in {_describe(paths)}")
    return {"files": files, "records": n, "formats": formats, "conversational": chat}


def _describe(paths: Any) -> str:
    return str(paths) if isinstance(paths, str | os.PathLike) else ", ".join(map(str, paths))


def alpaca_prompt(record: Mapping[str, Any]) -> str:
    """The Stanford Alpaca prompt of an ``{"instruction", "input", "output"}`` record."""
    if record.get("input"):
        return ALPACA_PROMPT.format(instruction=record["instruction"], input=record["input"])
    return ALPACA_PROMPT_NO_INPUT.format(instruction=record["instruction"])


def as_records(items: Iterable[Mapping[str, Any]], *, format: str = "auto", name: str = "<records>") -> list[Record]:
    """Checks in-memory records (e.g. rows of a ``datasets.Dataset``) as :func:`read_records` does
    a file; ``where`` is ``"<name>:<index from 1>"``.

    Raises:
      ValueError: as :func:`iter_records`; or no records.
    """
    out, file_format, first = [], None if format == "auto" else format, ""
    for i, raw in enumerate(items, start=1):
        where = f"{name}:{i}"
        f = file_format
        if format == "auto":
            if not isinstance(raw, Mapping):
                raise _fail(where, f"a record must be an object, got {_kind(raw)}")
            found = detect_format(raw)
            if found is None:
                raise _fail(where, f"no known format in keys {sorted(raw)}")
            if file_format is None:
                file_format, first = found, where
            elif found != file_format:
                raise _fail(where, f"a {found} record among {file_format} records (first {first}): one format")
            f = file_format
        out.append(check_record(where, dict(raw) if isinstance(raw, Mapping) else raw, f))
    if not out:
        raise ValueError(f"no records in {name}")
    return out
