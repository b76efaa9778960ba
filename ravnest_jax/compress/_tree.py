"""jax-free flattening of nested dict/list/tuple pytrees with path names.

The structure is kept as a hashable descriptor (usable as static jit data and as wire header):
a leaf is its index (int); ``("d", ((key, node), ...))`` a dict (keys sorted, str only);
``("l", (node, ...))`` a list; ``("t", (node, ...))`` a tuple (NamedTuples flatten as tuples).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_DEPTH = 64


def flatten(tree: Any) -> tuple[list[Any], list[str], Any]:
    """Returns ``(leaves, names, structure)``; names are ``/``-joined paths (``"layer0/w"``).

    Raises:
      ValueError: a dict key that is not a str, nesting deeper than 64, or two leaves with the
        same path name (for example keys containing ``/``).
    """
    leaves: list[Any] = []
    names: list[str] = []
    structure = _flatten_rec(tree, (), 0, leaves, names)
    if len(set(names)) != len(names):
        seen: set[str] = set()
        dup = next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]
        raise ValueError(f"two leaves share the path name {dup!r} (a dict key contains '/'?)")
    return leaves, names, structure


# The recursions are module-level functions that get the output lists as arguments: a nested
# ``def rec`` that calls itself is a reference cycle (function -> closure cell -> function) that
# keeps the lists, and so every leaf array, alive until the cyclic garbage collector runs (a
# decoded 64 MiB leaf then outlived its last user, and the next decode paid fresh page faults).


def _flatten_rec(node: Any, path: tuple[str, ...], depth: int, leaves: list[Any], names: list[str]) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"pytree nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, Mapping):
        for key in node:
            if not isinstance(key, str):
                raise ValueError(f"dict keys must be str, got {key!r} at {'/'.join(path) or '<root>'}")
        return ("d", tuple((k, _flatten_rec(node[k], path + (k,), depth + 1, leaves, names)) for k in sorted(node)))
    if isinstance(node, (list, tuple)):
        kind = "l" if isinstance(node, list) else "t"
        return (kind, tuple(_flatten_rec(v, path + (str(i),), depth + 1, leaves, names) for i, v in enumerate(node)))
    if node is None:
        raise ValueError(f"None leaf at {'/'.join(path) or '<root>'}; pseudo-gradient leaves must be arrays")
    leaves.append(node)
    names.append("/".join(path))
    return len(leaves) - 1


def unflatten(structure: Any, leaves: list[Any]) -> Any:
    """Inverse of :func:`flatten`: dicts, lists and tuples around ``leaves``."""
    if isinstance(structure, int):
        return leaves[structure]
    kind, children = structure
    if kind == "d":
        return {k: unflatten(v, leaves) for k, v in children}
    vals = [unflatten(v, leaves) for v in children]
    return vals if kind == "l" else tuple(vals)


def structure_to_wire(structure: Any) -> Any:
    """Hashable descriptor -> msgpack-friendly (``{"d": {..}}``, ``{"l": [..]}``, ``{"t": [..]}``)."""
    if isinstance(structure, int):
        return structure
    kind, children = structure
    if kind == "d":
        return {"d": {k: structure_to_wire(v) for k, v in children}}
    return {kind: [structure_to_wire(v) for v in children]}


def structure_from_wire(obj: Any, num_leaves: int) -> Any:
    """Validates a wire structure; returns the hashable descriptor.

    Raises:
      ValueError: anything malformed: wrong node types, depth above 64, leaf indices that are not
        exactly ``0 .. num_leaves - 1`` each once.
    """
    seen: list[int] = []

    def rec(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"tree structure nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, int) and not isinstance(node, bool):
            if not 0 <= node < num_leaves:
                raise ValueError(f"tree structure refers to leaf {node}, but there are {num_leaves}")
            seen.append(node)
            return node
        if not isinstance(node, dict) or len(node) != 1:
            raise ValueError("tree structure node must be a leaf index or a one-key map")
        ((kind, children),) = node.items()
        if kind == "d":
            if not isinstance(children, dict):
                raise ValueError("tree structure 'd' node must hold a map")
            if not all(isinstance(k, str) for k in children):
                raise ValueError("tree structure dict keys must be strings")
            return ("d", tuple((k, rec(children[k], depth + 1)) for k in sorted(children)))
        if kind in ("l", "t"):
            if not isinstance(children, list):
                raise ValueError(f"tree structure {kind!r} node must hold an array")
            return (kind, tuple(rec(v, depth + 1) for v in children))
        raise ValueError(f"unknown tree structure node kind {kind!r}")

    structure = rec(obj, 0)
    if sorted(seen) != list(range(num_leaves)):
        raise ValueError("tree structure does not refer to every leaf exactly once")
    return structure


def structure_names(structure: Any, num_leaves: int) -> list[str]:
    """Path names of the leaves of a (validated) structure, by leaf index.

    Raises:
      ValueError: two leaves share a path name (as :func:`flatten`).
    """
    order, paths, _ = flatten(unflatten(structure, list(range(num_leaves))))
    return [name for _, name in sorted(zip(order, paths))]  # order: a permutation of the indices
