"""docs/architecture.md's "data path of one round" names its hops as ``file:function`` (a
module-level function or ``Class.method``, paths relative to ``ravnest_jax/``): every one must
exist, so that the list stays true when code moves, and the count line under it must match."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOP = re.compile(r"^(\d+)\. `([\w/]+\.py):([\w.]+)`", re.M)


def _section() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("## The data path of one round")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _defined(path: Path) -> set[str]:
    """``name`` of every module-level function and ``Class.name`` of every method (a base
    class's methods are found under the base's name)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{item.name}")
    return names


def test_every_hop_names_a_function_that_exists():
    hops = HOP.findall(_section())
    assert hops, "no hop found in docs/architecture.md's data path section"
    assert [int(n) for n, _, _ in hops] == list(range(1, len(hops) + 1)), [n for n, _, _ in hops]
    missing = []
    for n, file, name in hops:
        path = REPO / "ravnest_jax" / file
        if not path.is_file() or name not in _defined(path):
            missing.append(f"hop {n}: {file}:{name}")
    assert not missing, "docs/architecture.md names what the code no longer has: " + "; ".join(missing)
    count = re.search(r"^(\d+) hops, through (\d+) files", _section(), re.M)
    assert count, "the count line ('N hops, through M files') is missing"
    files = {file for _, file, _ in hops}
    assert (int(count[1]), int(count[2])) == (len(hops), len(files)), (count[0], len(hops), len(files))
