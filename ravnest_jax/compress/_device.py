"""Device-side (jax, jittable) encoding, error feedback and the simulated codec.

Imports jax; reached lazily from :mod:`ravnest_jax.compress` so that the host API stays jax-free.
The quantisation math is the one in :mod:`._formats`, evaluated with ``xp = jax.numpy``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental.buffer_callback import buffer_callback  # zero-copy host callback
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _formats as F
from . import _tree
from ._codec_value import Codec
from ._host import pack_leaves
from ._wire import Packed

# children: the parts and the ok flags; static aux: codec, specs, structure
jax.tree_util.register_pytree_node(
    Packed, lambda p: ((p.parts, p.ok), (p.codec, p.specs, p.structure)), lambda aux, ch: Packed(*aux, *ch)
)


def _lax_topk_indices(x: jax.Array, k: int) -> jax.Array:
    """Ascending indices of the k largest ``|x|`` with ``lax.top_k`` (ties toward lower indices,
    as :func:`F.np_topk_indices`): the accelerator implementation."""
    return jnp.sort(jax.lax.top_k(jnp.abs(x), k)[1])


def _host_topk_indices(x: jax.Array, k: int) -> jax.Array:
    """The same selection computed by :func:`F.np_topk_indices` in a host callback.

    Used on the CPU backend, where XLA has no fast stream compaction: ``lax.top_k`` of 1 % of
    16M elements takes ~0.8 s on one core, the numpy selection ~25 ms. Same indices, so device
    and host encodes stay byte-identical on every backend. With
    ``jax.experimental.buffer_callback`` (jax >= 0.7) numpy reads the operand's XLA buffer in
    place and writes the indices into the output buffer: ~30 ms for 2**24 elements, where
    ``jax.pure_callback`` first copies the operand into a new 64 MiB array (~100 ms).
    """

    def select(ctx: Any, dst: Any, a: Any) -> None:
        np.asarray(dst)[...] = F.np_topk_indices(np.asarray(a), k)

    idx = buffer_callback(select, jax.ShapeDtypeStruct((k,), jnp.int32), vmap_method="sequential")(x)
    # + an exact 0 computed from x: inside shard_map the indices then vary over the same mesh
    # axes as x (as lax.top_k's do), so both branches of platform_dependent have one type
    return idx + (jax.lax.bitcast_convert_type(x[:1], jnp.int32) & 0)


def _topk_indices(x: jax.Array, k: int) -> jax.Array:
    if x.shape[0] > np.iinfo(np.int32).max:  # pragma: no cover - 8 GiB leaves
        return _lax_topk_indices(x, k)
    return jax.lax.platform_dependent(
        x, cpu=lambda v: _host_topk_indices(v, k), default=lambda v: _lax_topk_indices(v, k).astype(jnp.int32)
    )


def _quantize(cfg: F.CodecConfig, x: jax.Array, key: jax.Array | None) -> tuple[jax.Array, tuple]:
    noise = (lambda shape: jax.random.uniform(key, shape, jnp.float32)) if cfg.stochastic else None
    return F.quantize(jnp, cfg, x, noise=noise, topk_indices=_topk_indices)


def _roundtrip(cfg: F.CodecConfig, x: jax.Array, key: jax.Array | None) -> tuple[jax.Array, tuple, jax.Array]:
    """Flat float32 ``x`` -> (ok, parts, decoded flat float32)."""
    ok, parts = _quantize(cfg, x, key)
    return ok, parts, F.dequantize(jnp, cfg, parts, x.shape[0])


def _split(key: jax.Array | None, n: int) -> list:
    return [None] * n if key is None else list(jax.random.split(key, max(n, 1)))[:n]


def device_encode(
    tree: Any,
    codec: str = "int4",
    *,
    key: jax.Array | None = None,
    residual: Any = None,
    **options: Any,
) -> tuple[Packed, Any]:
    """Encodes a pytree on the accelerator (jittable): the small packed arrays leave the device.

    With error feedback (``residual`` given) the encoded value is ``x + residual`` and the new
    residual is ``(x + residual) - decode(encode(x + residual))``, computed on the device.

    Use under ``jax.jit`` with the codec options static, e.g.
    ``jax.jit(functools.partial(device_encode, codec="int4", block_size=64))``; then
    ``packed_to_bytes(packed)`` on the host (jax-free) gives the message, which equals
    ``encode(tree, codec, ...)`` byte for byte for the deterministic codecs.

    Leaves sharded over a device mesh (``NamedSharding``) are encoded where they lie: blocks are
    cut per leaf, so each device encodes the blocks of its own shard (a leaf whose shard is not a
    whole number of blocks is re-laid out between the devices by XLA; ``topk`` sorts whole
    leaves). The bytes are those of the unsharded leaves. On a mesh with explicit axes the codec
    math runs with the axes made automatic, the packed parts come back spread over the devices
    along their only axis (replicated when their length does not divide by the device count) and
    the new residual with the layout of its leaf.

    Args:
      tree: nested dicts (str keys), lists, tuples of float arrays (float32, bfloat16, float16).
      codec: one of ``CODECS``.
      key: PRNG key, required with ``stochastic=True`` (split per leaf).
      residual: error-feedback residual (from :func:`init_error_feedback` or the previous call),
        same structure and shapes as ``tree``, float32; ``None`` for no error feedback.
      **options: ``block_size``, ``fraction``, ``stochastic`` as in ``encode``.

    Returns:
      ``(packed, new_residual)``: a :class:`~ravnest_jax.compress.Packed` pytree (uint8/uint16/
      uint32 payloads and scales, a per-leaf bool ``ok`` flag that is False for NaN/Inf/
      ``|x| > 2**127`` inputs: ``packed_to_bytes`` then raises ``NonFiniteError``), and the new
      residual tree (float32) or ``None`` without error feedback.

    Raises:
      ValueError: bad codec/option, ``stochastic`` without ``key``, a residual of another
        structure, a non-float leaf.
    """
    cfg = F.resolve(codec, **options)
    if cfg.stochastic and key is None:
        raise ValueError("stochastic=True needs a PRNG key: device_encode(..., key=jax.random.key(0))")
    mesh = _explicit_mesh(jax.tree.leaves(tree))
    if mesh is not None:
        return _encode_explicit(mesh, cfg, tree, key, residual)
    return _encode(cfg, tree, key, residual)


def _explicit_mesh(leaves: list) -> Any:
    """The mesh of the first leaf sharded over a mesh with explicit axes, else ``None``."""
    for x in leaves:
        try:
            s = jax.typeof(x).sharding
        except TypeError:
            continue
        if isinstance(s, NamedSharding) and s.mesh.explicit_axes:
            return s.mesh
    return None


def _encode_explicit(mesh: Any, cfg: F.CodecConfig, tree: Any, key: Any, residual: Any) -> tuple[Packed, Any]:
    """:func:`_encode` of leaves sharded over a mesh with explicit axes (see :func:`device_encode`):
    the blockwise reshapes of the codec math have no explicit sharding rule, so XLA partitions it
    with the axes made automatic."""
    leaves, _, structure = _tree.flatten(tree)
    enc = lambda t, r: _encode(cfg, t, key, r)

    def plain(t: Any) -> Any:
        return None if t is None else jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), t)

    def spread(s: Any) -> NamedSharding:  # a packed part: over the devices when its length divides
        return NamedSharding(mesh, P(tuple(mesh.axis_names)) if s.shape and s.shape[0] % mesh.size == 0 else P())

    def layout(x: Any) -> NamedSharding:  # a new residual: its leaf's
        s = jax.typeof(x).sharding
        return NamedSharding(mesh, s.spec if isinstance(s, NamedSharding) else P())

    packed_sh = jax.tree.map(spread, jax.eval_shape(enc, plain(tree), plain(residual))[0])
    res_sh = None if residual is None else _tree.unflatten(structure, [layout(x) for x in leaves])
    return jax.sharding.auto_axes(enc, out_sharding=(packed_sh, res_sh))(tree, residual)


def _encode(cfg: F.CodecConfig, tree: Any, key: Any, residual: Any) -> tuple[Packed, Any]:
    _, names, structure = _tree.flatten(tree)
    res, new_res = None, []
    if residual is not None:
        res, _, rstructure = _tree.flatten(residual)
        if rstructure != structure:
            raise ValueError("residual must have the same tree structure as the input")
    keys = _split(key if cfg.stochastic else None, len(names))

    def leaf(i: int, name: str, a: jax.Array) -> tuple[jax.Array, tuple]:
        x = a.astype(jnp.float32).reshape(-1)
        if res is None:
            ok, p = _quantize(cfg, x, keys[i])
        else:
            x = x + jnp.asarray(res[i], jnp.float32).reshape(-1)
            ok, p, dec = _roundtrip(cfg, x, keys[i])
            new_res.append((x - dec).reshape(a.shape))
        return ok, tuple(_segments(f) for f in p)

    packed = pack_leaves(cfg, tree, jnp.asarray, leaf)
    return packed, (_tree.unflatten(structure, new_res) if res is not None else None)


SEGMENT_BYTES = 8 << 20
"""Encoded parts above this size (bytes) leave the jitted encode as a tuple of consecutive 1-D
slices of at most this size. Each output is its own buffer: glibc serves allocations above its
mmap threshold (32 MiB at most) with fresh ``mmap``s, faulted in 4 KiB pages on every call, while
buffers of a few MiB are reused from the heap. On the jax CPU backend a whole 32 MiB part
(measured with the 2-byte fp16 codec, since dropped) costs about 26 ms per call, the same part as
four 8 MiB slices 4.6 ms (the XLA fusion writes each slice directly). The message bytes are the
same (:func:`packed_to_chunks` writes the slices in order)."""


def _segments(f: jax.Array) -> Any:
    n, step = int(f.size), SEGMENT_BYTES // f.dtype.itemsize
    return f if n <= step else tuple(f.reshape(-1)[i : i + step] for i in range(0, n, step))


def init_error_feedback(params: Any) -> Any:
    """Zero error-feedback residual for ``params``: a pytree of float32 zeros of the same shapes."""
    return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)


class ErrorFeedbackState(NamedTuple):
    """State of a simulated codec with error feedback.

    Attributes:
      residual: pytree shaped like the params, float32: what quantisation dropped last round,
        added to the next round's pseudo-gradient before encoding (Seide et al. 2014; Karimireddy
        et al. 2019, https://arxiv.org/abs/1901.09847).
      mean_residual: with ``mean_error_feedback``, the same for the mean (what the owners'
        encode of the mean dropped; equal on every replica), else ``None``.
    """

    residual: Any
    mean_residual: Any = None


class SimulatedCodecImpl:
    """A codec as the in-process DiLoCo simulation applies it (``SimulatedCodec`` protocol).

    ``compress``: per replica, ``decode(encode(delta + residual))`` with error feedback;
    ``requantize``: ``decode(encode(mean))`` with the mean's codec (what the all-gather of the
    mean carries; the contributions' codec unless ``codec.mean`` is set). All jittable and
    vmappable; non-finite inputs cannot raise inside jit and simply propagate.
    """

    def __init__(self, codec: Codec):
        self.cfg = F.resolve(codec.name, **codec.options)
        self.mean_cfg = self.cfg
        if codec.mean is not None:
            self.mean_cfg = F.resolve(codec.mean, **F.mean_codec_options(codec.name, codec.mean, codec.options))
        self.error_feedback = codec.error_feedback and self.cfg.codec != "fp32"
        self.decay = codec.error_feedback_decay
        self.mean_error_feedback = codec.mean_ef and self.mean_cfg.codec != "fp32"

    def __repr__(self) -> str:
        mean = "" if self.mean_cfg is self.cfg else f", mean_codec={self.mean_cfg.codec!r}"
        return (
            f"simulated({self.cfg.codec!r}{mean}, error_feedback={self.error_feedback}, "
            f"mean_error_feedback={self.mean_error_feedback}, {self.cfg})"
        )

    def init(self, params: Any) -> Any:
        if not (self.error_feedback or self.mean_error_feedback):
            return optax.EmptyState()
        on = (self.error_feedback, self.mean_error_feedback)
        return ErrorFeedbackState(*(init_error_feedback(params) if x else None for x in on))

    @staticmethod
    def _apply(cfg: F.CodecConfig, tree: Any, residual: Any, key: jax.Array, decay: float = 1.0) -> tuple[Any, Any]:
        leaves, treedef = jax.tree.flatten(tree)
        res = treedef.flatten_up_to(residual) if residual is not None else [None] * len(leaves)
        keys = _split(key if cfg.stochastic else None, len(leaves))
        out, new_res = [], []
        for leaf, r, k in zip(leaves, res, keys):
            x = jnp.asarray(leaf, jnp.float32).reshape(-1)
            if r is not None:
                x = x + (r.reshape(-1) if decay == 1.0 else decay * r.reshape(-1))
            _, _, dec = _roundtrip(cfg, x, k)
            out.append(dec.reshape(jnp.shape(leaf)))
            new_res.append((x - dec).reshape(jnp.shape(leaf)))
        return treedef.unflatten(out), treedef.unflatten(new_res)

    def compress(self, delta: Any, state: Any, key: jax.Array) -> tuple[Any, Any]:
        if self.cfg.codec == "fp32":
            return delta, state
        if not self.error_feedback:
            return self._apply(self.cfg, delta, None, key)[0], state
        dec, res = self._apply(self.cfg, delta, state.residual, key, self.decay)
        return dec, state._replace(residual=res)

    def requantize(self, mean: Any, key: jax.Array) -> Any:
        return mean if self.mean_cfg.codec == "fp32" else self._apply(self.mean_cfg, mean, None, key)[0]

    def requantize_with_state(self, mean: Any, state: Any, key: jax.Array) -> tuple[Any, Any]:
        """:meth:`requantize` with the owners' error feedback on the mean (``mean_error_feedback``:
        the residual of the mean's encode is added to the next round's mean before encoding, as
        each part's owner does in the swarm; DoubleSqueeze, arXiv 1905.05957). ``mean`` is the
        same on every replica, so is the residual."""
        if not self.mean_error_feedback:
            return self.requantize(mean, key), state
        dec, res = self._apply(self.mean_cfg, mean, state.mean_residual, key)
        return dec, state._replace(mean_residual=res)


def simulated(codec: Codec | str = "int4") -> SimulatedCodecImpl:
    """A codec for ``rj.diloco(..., axis_name=..., codec=...)`` simulations: the same
    :class:`~ravnest_jax.compress.Codec` value a real swarm takes (``rj.Swarm(codec=...)``), on
    one machine.

    Applies the codec as the real swarm does: each replica's pseudo-gradient is encoded and
    decoded (with ``codec.error_feedback``: the residual, times ``codec.error_feedback_decay``,
    lives in ``DiLoCoState.codec_state``), the decoded values are averaged (``pmean``), and the
    mean is encoded and decoded again in ``codec.mean_name`` (with ``codec.mean_ef``: the mean's
    residual carried too; DoubleSqueeze, arXiv 1905.05957). Stochastic rounding
    (``codec.stochastic``) uses the round key of diloco. ``"fp32"`` is the identity (bit-exact
    with no codec).

    Args:
      codec: an ``rj.Codec``, or a codec name for ``Codec(name)``.

    Returns:
      An object with ``init``, ``compress``, ``requantize`` (the ``SimulatedCodec`` protocol).

    Raises:
      ValueError: an unknown codec name (a ``Codec`` is checked when made).
      TypeError: neither a Codec nor a name.
    """
    return SimulatedCodecImpl(Codec.of(codec))
