"""The house's layering, read from the source (every ``import``, at module level or inside a
function, resolved to a module of ``ravnest_jax``): no import circles, and each package imports
only packages of a lower layer (docs/architecture.md, "Layers"). The checks are tested too: an
added forbidden import or circle is reported.

``swarm`` is cut into rooms (subpackages), with imports one way: ``swarm.wire`` (what both sides
share) imports neither ``swarm.peer`` nor ``swarm.rendezvous``; each of those imports the wire
only, never the other; no room imports the ``swarm`` package itself (its ``__init__`` is the
surface above the rooms). For the private-module rule ``swarm`` stays one package: a room may
import the private modules of a room it may import (``swarm.peer._butterfly`` imports
``swarm.wire._auth``), because the room rule already fixes the direction and the wire's modules
are used as namespaces (``_auth.sign``); from outside ``swarm`` the rooms are private too: other
packages import ``ravnest_jax.swarm`` only, never ``ravnest_jax.swarm.peer`` nor its modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "ravnest_jax"

#: a package (or top-level module) may import its own modules and those of lower layers only
LAYER = {
    "_version": 0,
    "_staleness": 0,
    "_compile_cache": 0,
    "host_memory": 0,  # glibc mallopt; the one import-time effect (import ravnest_jax)
    "data": 0,
    "compress": 0,  # the wire formats and the codec math
    "_launch_env": 1,
    "swarm": 1,  # the peer mesh: rendezvous, transport, rounds
    "optim": 1,  # DiLoCo's math
    "checkpoint": 1,
    "sync": 2,  # the outer loop: optim over swarm
    "testing": 2,  # LocalSwarm: the sync contract in memory (compress, swarm)
    "models": 2,
    "launch": 2,
    "_recipe_schema": 2,
    "pipeline": 3,
    "": 4,  # ravnest_jax/__init__.py: the public names
    "recipe": 5,
    "tools": 6,
    "cli": 7,
}
#: third-party packages a package must not import
NEVER = {"swarm": {"jax", "flax", "optax"}, "compress": {"aiohttp"}}
#: the rooms of ``swarm`` and the other rooms each may import
ROOMS = {"wire": set(), "rendezvous": {"wire"}, "peer": {"wire"}}


def modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _targets(mods: dict[str, Path], module: str, node: ast.AST) -> list[str]:
    """The modules of ``ravnest_jax`` (or, prefixed ``!``, third-party top-level packages) that
    ``node`` imports from ``module``."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        assert isinstance(node, ast.ImportFrom)
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            if mods[module].name != "__init__.py":
                parts = parts[:-1]
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out = []
    for name in names:
        if not name.startswith("ravnest_jax"):
            out.append("!" + name.split(".")[0])
            continue
        while name not in mods:
            name = name.rpartition(".")[0]
        out.append(name)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                graph[m].update(t for t in _targets(mods, m, node) if t != m)
    return graph


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def room(module: str) -> str | None:
    """The room of a module of ``swarm`` (``ravnest_jax.swarm.peer._peer``: ``peer``); None for
    the ``swarm`` package itself and for modules of other packages."""
    parts = module.split(".")
    return parts[2] if package(module) == "swarm" and len(parts) > 2 else None


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next((w for w in it if w in graph), None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, targets in sorted(graph.items()):
        pm = package(m)
        for t in sorted(targets):
            if t.startswith("!"):
                if t[1:] in NEVER.get(pm, set()):
                    bad.append(f"{m} imports {t[1:]}")
                continue
            pt = package(t)
            if pt != pm and LAYER[pt] >= LAYER[pm]:
                bad.append(f"{m} (layer {LAYER[pm]}) imports {t} (layer {LAYER[pt]})")
    return bad


def room_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports between the rooms of ``swarm`` against :data:`ROOMS`, and a room's import of the
    ``swarm`` package itself."""
    bad = []
    for m, targets in sorted(graph.items()):
        rm = room(m)
        if rm is None:
            continue
        for t in sorted(targets):
            if t.startswith("!") or package(t) != "swarm":
                continue
            rt = room(t)
            if rt is None or (rt != rm and rt not in ROOMS[rm]):
                bad.append(f"{m} (room {rm}) imports {t} (room {rt})")
    return bad


def private_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of another package's private module (``ravnest_jax.swarm.wire._http`` from
    outside ``swarm``) or of one of its subpackages (a room of ``swarm``, even its
    ``__init__``): a package is used through its ``__init__`` names only. The root's own private
    modules (``ravnest_jax._version``) are the house's shared leaves."""
    subpackages = {".".join(m.split(".")[:3]) for m in graph if len(m.split(".")) > 3}
    bad = []
    for m, targets in sorted(graph.items()):
        for t in sorted(targets):
            if t.startswith("!") or package(t) in ("", package(m)):
                continue
            inside = ".".join(t.split(".")[:3]) in subpackages
            if inside or any(part.startswith("_") for part in t.split(".")[2:]):
                bad.append(f"{m} imports {t}")
    return bad


def test_every_package_has_a_layer():
    assert {package(m) for m in modules()} == set(LAYER), set(LAYER) ^ {package(m) for m in modules()}


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, f"import circles: {found}"


def test_packages_import_only_lower_layers():
    bad = layer_violations(import_graph())
    assert not bad, "\n".join(bad)


def test_every_swarm_module_is_in_a_room():
    loose = [m for m in modules() if package(m) == "swarm" and m != "ravnest_jax.swarm" and room(m) not in ROOMS]
    assert not loose, f"swarm modules outside the rooms {sorted(ROOMS)}: {loose}"


def test_swarm_rooms_import_one_way():
    bad = room_violations(import_graph())
    assert not bad, "\n".join(bad)


def test_no_package_imports_another_packages_private_module():
    bad = private_imports(import_graph())
    assert not bad, "\n".join(bad)


def test_the_checks_report_an_added_forbidden_import_and_circle():
    graph = import_graph()
    graph["ravnest_jax.compress._bits"].add("ravnest_jax.swarm.wire._http")  # downward layer broken
    graph["ravnest_jax.swarm.wire._http"].add("!jax")
    assert layer_violations(graph) == [
        "ravnest_jax.compress._bits (layer 0) imports ravnest_jax.swarm.wire._http (layer 1)",
        "ravnest_jax.swarm.wire._http imports jax",
    ]
    before = set(private_imports(graph))
    graph["ravnest_jax.sync._pipeline"].add("ravnest_jax.compress._wire")  # private, of another package
    graph["ravnest_jax.sync._pipeline"].add("ravnest_jax.sync._digest")  # its own package's: allowed
    graph["ravnest_jax.sync._pipeline"].add("ravnest_jax._version")  # the root's shared leaf: allowed
    graph["ravnest_jax.sync._pipeline"].add("ravnest_jax.swarm.peer")  # a room of another package
    graph["ravnest_jax.sync._pipeline"].add("ravnest_jax.swarm")  # the package's surface: allowed
    graph["ravnest_jax.swarm.peer._butterfly"].add("ravnest_jax.swarm.wire._types")  # swarm is one package here
    added = set(private_imports(graph)) - before
    assert added == {
        "ravnest_jax.sync._pipeline imports ravnest_jax.compress._wire",
        "ravnest_jax.sync._pipeline imports ravnest_jax.swarm.peer",
    }, added
    graph["ravnest_jax.compress._bits"].add("ravnest_jax.compress._formats")  # _formats imports _bits
    pair = {"ravnest_jax.compress._bits", "ravnest_jax.compress._formats"}
    assert any(pair <= set(c) for c in circles(graph)), circles(graph)


def test_the_room_check_reports_an_added_import_against_the_rooms():
    graph = import_graph()
    before = set(room_violations(graph))
    graph["ravnest_jax.swarm.wire._http"].add("ravnest_jax.swarm.peer._transport")  # wire -> peer
    graph["ravnest_jax.swarm.wire._types"].add("ravnest_jax.swarm.rendezvous._rounds")  # wire -> rendezvous
    graph["ravnest_jax.swarm.rendezvous._rounds"].add("ravnest_jax.swarm.peer._attempt")  # rendezvous -> peer
    graph["ravnest_jax.swarm.peer._rounds"].add("ravnest_jax.swarm.rendezvous._relay")  # peer -> rendezvous
    graph["ravnest_jax.swarm.peer._rounds"].add("ravnest_jax.swarm")  # a room -> the package above it
    graph["ravnest_jax.swarm.peer._rounds"].add("ravnest_jax.swarm.wire._relay")  # peer -> wire: allowed
    graph["ravnest_jax.swarm.rendezvous._rounds"].add("ravnest_jax.swarm.wire._types")  # rendezvous -> wire: allowed
    graph["ravnest_jax.swarm"].add("ravnest_jax.swarm.rendezvous._rounds")  # the surface -> a room: allowed
    added = set(room_violations(graph)) - before
    assert added == {
        "ravnest_jax.swarm.wire._http (room wire) imports ravnest_jax.swarm.peer._transport (room peer)",
        "ravnest_jax.swarm.wire._types (room wire) imports ravnest_jax.swarm.rendezvous._rounds (room rendezvous)",
        "ravnest_jax.swarm.rendezvous._rounds (room rendezvous) imports ravnest_jax.swarm.peer._attempt (room peer)",
        "ravnest_jax.swarm.peer._rounds (room peer) imports ravnest_jax.swarm.rendezvous._relay (room rendezvous)",
        "ravnest_jax.swarm.peer._rounds (room peer) imports ravnest_jax.swarm (room None)",
    }, added
