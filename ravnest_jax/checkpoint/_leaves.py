"""Leaf encoding between user pytrees and what orbax stores.

Orbax's standard handlers store arrays (``jax.Array``, ``np.ndarray``). Users also keep
new-style typed PRNG keys (``jax.random.key``), numpy scalars and Python scalars in their
training state. Each leaf is given a *kind*; the stored form and the value given back on restore
follow it:

- ``array`` (``jax.Array``, any dtype): stored as is; restored as ``jax.Array`` with the
  target's dtype and sharding.
- ``key`` (typed PRNG key): stored as ``jax.random.key_data`` (uint32); restored with
  ``jax.random.wrap_key_data`` and the saved impl.
- ``numpy`` (``np.ndarray``): stored and restored as ``np.ndarray``.
- ``npscalar`` (``np.int64(3)`` ...): stored as a 0-d array; restored as the target's numpy type.
- ``int`` / ``float`` / ``bool`` (Python): stored as 0-d int64 / float64 / bool arrays; restored
  as ``int`` / ``float`` / ``bool``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

ARRAY, KEY, NUMPY, NPSCALAR, INT, FLOAT, BOOL = "array", "key", "numpy", "npscalar", "int", "float", "bool"


def is_key_dtype(dtype: Any) -> bool:
    try:
        return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    except TypeError:
        return False


def kind_of(x: Any, path: str) -> str:
    """The kind of one leaf (see the module docstring).

    Raises:
      TypeError: the leaf is of a type that cannot be checkpointed (for example a string).
    """
    if isinstance(x, bool):
        return BOOL
    if isinstance(x, int):
        return INT
    if isinstance(x, float):
        return FLOAT
    if isinstance(x, np.generic):
        return NPSCALAR
    if isinstance(x, np.ndarray):
        return NUMPY
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return KEY if is_key_dtype(x.dtype) else ARRAY
    raise TypeError(
        f"cannot checkpoint leaf {path or '<root>'} of type {type(x).__name__}: leaves must be "
        "jax arrays (typed PRNG keys included), numpy arrays or scalars, or Python int/float/bool"
    )


def describe(tree: PyTree) -> tuple[list[tuple[str, Any]], list[dict[str, Any]], Any]:
    """Flattens ``tree`` and describes each leaf.

    Returns:
      ``(path_leaves, records, treedef)``: the ``(keystr, leaf)`` pairs, one JSON-able record
      per leaf ``{"path", "kind", "shape", "dtype"}`` (shape and dtype of the *stored* form;
      ``"impl"`` too for keys), and the treedef.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    pairs, records = [], []
    for keypath, leaf in flat:
        path = jax.tree_util.keystr(keypath)
        kind = kind_of(leaf, path)
        rec: dict[str, Any] = {"path": path, "kind": kind}
        if kind == KEY:
            impl = jax.random.key_impl(leaf) if isinstance(leaf, jax.Array) else None
            if impl is not None:
                rec["impl"] = str(impl)
            data = jax.eval_shape(jax.random.key_data, leaf)
            rec["shape"], rec["dtype"] = list(data.shape), str(data.dtype)
        elif kind in (ARRAY, NUMPY):
            rec["shape"], rec["dtype"] = list(leaf.shape), str(np.dtype(leaf.dtype))
        else:
            arr = np.asarray(leaf)
            rec["shape"], rec["dtype"] = [], str(arr.dtype)
        pairs.append((path, leaf))
        records.append(rec)
    return pairs, records, treedef


@jax.jit
def _device_snapshot(leaves: list[jax.Array]) -> list[jax.Array]:
    # A real on-device copy (never an alias): the caller's buffers may be donated to the next
    # training step while the background thread still reads this snapshot. Keys become key_data.
    out = []
    for x in leaves:
        if is_key_dtype(x.dtype):
            x = jax.random.key_data(x)
        out.append(jnp.array(x, copy=True))
    return out


def encode(trees: list[tuple[PyTree, list[dict[str, Any]]]], *, copy_device: bool) -> list[PyTree]:
    """The stored form of each ``(tree, records)``: trees of the same structure with array leaves.

    The device leaves of all trees are copied on device with one jitted call that is only
    dispatched (it does not wait for the computation producing them), so this does not block the
    training loop.
    """
    flat = [jax.tree.flatten(tree) for tree, _ in trees]
    dev_pos = [
        (t, i)
        for t, ((leaves, _), (_, records)) in enumerate(zip(flat, trees))
        for i, rec in enumerate(records)
        if rec["kind"] in (ARRAY, KEY)
    ]
    outs: list[list[Any]] = [list(leaves) for leaves, _ in flat]
    if dev_pos:
        dev = [flat[t][0][i] for t, i in dev_pos]
        if copy_device:
            dev = _device_snapshot(dev)
        else:
            dev = [jax.random.key_data(x) if is_key_dtype(x.dtype) else x for x in dev]
        for (t, i), x in zip(dev_pos, dev):
            outs[t][i] = x
    for t, (_, records) in enumerate(trees):
        leaves, out = flat[t][0], outs[t]
        for i, rec in enumerate(records):
            kind = rec["kind"]
            if kind == NUMPY:
                out[i] = np.array(leaves[i], copy=True)
            elif kind == NPSCALAR:
                out[i] = np.asarray(leaves[i])
            elif kind == INT:
                out[i] = np.asarray(leaves[i], dtype=np.int64)
            elif kind == FLOAT:
                out[i] = np.asarray(leaves[i], dtype=np.float64)
            elif kind == BOOL:
                out[i] = np.asarray(leaves[i], dtype=np.bool_)
    return [jax.tree.unflatten(treedef, out) for (_, treedef), out in zip(flat, outs)]


def _default_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def abstract(target: PyTree, saved: list[dict[str, Any]], item: str) -> tuple[PyTree, list[dict[str, Any]]]:
    """The orbax restore target for a user target, checked against the saved records.

    Raises:
      ValueError: the target's leaves (paths, kinds or shapes) differ from what was saved.
    """
    pairs, records, treedef = describe(target)
    saved_paths = [r["path"] for r in saved]
    target_paths = [r["path"] for r in records]
    if saved_paths != target_paths:
        missing = [p for p in saved_paths if p not in target_paths][:5]
        unexpected = [p for p in target_paths if p not in saved_paths][:5]
        raise ValueError(
            f"restore target {item!r} does not match the checkpoint: {len(target_paths)} leaves vs "
            f"{len(saved_paths)} saved; saved but not in target: {missing}; in target but not "
            f"saved: {unexpected}"
        )
    out = []
    for (path, leaf), rec, srec in zip(pairs, records, saved):
        if (rec["kind"] == KEY) != (srec["kind"] == KEY):
            raise ValueError(
                f"restore target {item}{path}: saved kind {srec['kind']!r}, target kind {rec['kind']!r} "
                "(typed PRNG keys must be restored into typed keys)"
            )
        if list(rec["shape"]) != list(srec["shape"]):
            raise ValueError(
                f"restore target {item}{path}: saved shape {tuple(srec['shape'])}, target shape {tuple(rec['shape'])}"
            )
        kind = rec["kind"]
        if kind in (ARRAY, KEY):
            sharding = getattr(leaf, "sharding", None) or _default_sharding()
            dtype = np.dtype(srec["dtype"]) if kind == KEY else leaf.dtype
            out.append(jax.ShapeDtypeStruct(tuple(srec["shape"]), dtype, sharding=sharding))
        elif kind == NUMPY:
            out.append(np.empty(leaf.shape, leaf.dtype))
        elif kind == NPSCALAR:
            out.append(np.empty((), leaf.dtype))
        else:
            out.append(np.empty((), np.dtype(srec["dtype"])))
    return jax.tree.unflatten(treedef, out), records


def _like_target(x: jax.Array, t: Any) -> jax.Array:
    """``x`` uncommitted when the target array is: orbax places every restored array on its
    sharding (committed), and jit keys its compilation cache on committedness, so a train step
    compiled for fresh (uncommitted) arrays would compile again after a resume."""
    if isinstance(t, jax.Array) and not t.committed and isinstance(x, jax.Array) and x.committed:
        return jnp.asarray(np.asarray(x))  # one host copy: only for single-device, uncommitted targets
    return x


def decode(restored: PyTree, target: PyTree, records: list[dict[str, Any]], saved: list[dict[str, Any]]) -> PyTree:
    """Turns orbax's restored tree back into the kinds of ``target`` (same treedef)."""
    leaves = jax.tree.leaves(restored)
    tleaves, treedef = jax.tree.flatten(target)
    out = []
    for x, t, rec, srec in zip(leaves, tleaves, records, saved):
        kind = rec["kind"]
        if kind == KEY:
            impl = srec.get("impl") or rec.get("impl")
            out.append(jax.random.wrap_key_data(x, impl=impl) if impl else jax.random.wrap_key_data(x))
        elif kind == ARRAY:
            out.append(_like_target(x, t))
        elif kind == NUMPY:
            out.append(np.asarray(x, dtype=t.dtype))
        elif kind == NPSCALAR:
            out.append(np.dtype(t.dtype).type(np.asarray(x)[()]))
        elif kind == INT:
            out.append(int(np.asarray(x)[()]))
        elif kind == FLOAT:
            out.append(float(np.asarray(x)[()]))
        else:
            out.append(bool(np.asarray(x)[()]))
    return jax.tree.unflatten(treedef, out)
