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
from ._wire import ALLOWED_DTYPES, LeafSpec, Packed

__all__ = ["ErrorFeedbackState", "SimulatedCodecImpl", "device_encode", "init_error_feedback", "simulated"]


def _packed_flatten(p: Packed):
    return (p.parts, p.ok), (p.codec, p.specs, p.structure)


def _packed_unflatten(aux, children):
    parts, ok = children
    return Packed(aux[0], aux[1], aux[2], parts, ok)


jax.tree_util.register_pytree_node(Packed, _packed_flatten, _packed_unflatten)


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


def _noise_fn(cfg: F.CodecConfig, key: jax.Array | None):
    if not cfg.stochastic:
        return None
    return lambda shape: jax.random.uniform(key, shape, jnp.float32)


def _roundtrip(cfg: F.CodecConfig, x: jax.Array, key: jax.Array | None) -> tuple[jax.Array, tuple, jax.Array]:
    """Flat float32 ``x`` -> (ok, parts, decoded flat float32)."""
    ok, parts = F.quantize(jnp, cfg, x, noise=_noise_fn(cfg, key), topk_indices=_topk_indices)
    return ok, parts, F.dequantize(jnp, cfg, parts, x.shape[0])


def _split(key: jax.Array | None, n: int) -> list:
    if key is None:
        return [None] * n
    return list(jax.random.split(key, max(n, 1)))[:n] if n else []


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
    """Leaves sharded over a mesh with explicit axes: the blockwise reshapes of the codec math
    have no explicit sharding rule, so it runs with the axes made automatic (XLA partitions it:
    each device encodes the blocks of its own shard). The packed parts come back spread over the
    devices along their only axis (replicated when their length does not divide evenly), the new
    residual with the layout of its leaf."""
    leaves, _, structure = _tree.flatten(tree)

    def plain(t: Any) -> Any:
        return None if t is None else jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), t)

    packed_shape, _ = jax.eval_shape(lambda t, r: _encode(cfg, t, key, r), plain(tree), plain(residual))
    axes = tuple(mesh.axis_names)

    def spread(s: Any) -> NamedSharding:
        even = s.shape and s.shape[0] % mesh.size == 0
        return NamedSharding(mesh, P(axes) if even else P())

    packed_sh = jax.tree.map(spread, packed_shape)
    res_sh = None
    if residual is not None:
        specs = []
        for x in leaves:
            s = jax.typeof(x).sharding
            specs.append(NamedSharding(mesh, s.spec if isinstance(s, NamedSharding) else P()))
        res_sh = _tree.unflatten(structure, specs)
    fn = jax.sharding.auto_axes(lambda t, r: _encode(cfg, t, key, r), out_sharding=(packed_sh, res_sh))
    return fn(tree, residual)


def _encode(cfg: F.CodecConfig, tree: Any, key: Any, residual: Any) -> tuple[Packed, Any]:
    leaves, names, structure = _tree.flatten(tree)
    res = None
    if residual is not None:
        res, _, rstructure = _tree.flatten(residual)
        if rstructure != structure:
            raise ValueError("residual must have the same tree structure as the input")
    keys = _split(key if cfg.stochastic else None, len(leaves))
    specs, parts, oks, new_res = [], [], [], []
    for i, (leaf, name) in enumerate(zip(leaves, names)):
        a = jnp.asarray(leaf)
        if a.dtype.name not in ALLOWED_DTYPES:
            raise ValueError(f"pseudo-gradient leaf {name!r} has dtype {a.dtype.name}; expected a float dtype")
        x = a.astype(jnp.float32).reshape(-1)
        if res is not None:
            x = x + jnp.asarray(res[i], jnp.float32).reshape(-1)
            ok, p, dec = _roundtrip(cfg, x, keys[i])
            new_res.append((x - dec).reshape(a.shape))
        else:
            ok, p = F.quantize(jnp, cfg, x, noise=_noise_fn(cfg, keys[i]), topk_indices=_topk_indices)
        k = F.topk_count(x.shape[0], cfg.fraction) if cfg.codec == "topk" else 0
        specs.append(LeafSpec(name, tuple(int(d) for d in a.shape), a.dtype.name, cfg.block_size, k))
        parts.append(tuple(_segments(f) for f in p))
        oks.append(ok)
    packed = Packed(cfg.codec, tuple(specs), structure, tuple(parts), tuple(oks))
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
    n = int(f.size)
    step = max(SEGMENT_BYTES // max(f.dtype.itemsize, 1), 1)
    if n <= step:
        return f
    flat = f.reshape(-1)
    return tuple(flat[i : i + step] for i in range(0, n, step))


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
    mean carries; the contributions' codec unless ``mean_cfg`` is given). All jittable and
    vmappable; non-finite inputs cannot raise inside jit and simply propagate.
    """

    def __init__(
        self,
        cfg: F.CodecConfig,
        error_feedback: bool,
        error_feedback_decay: float = 1.0,
        mean_error_feedback: bool = False,
        mean_cfg: F.CodecConfig | None = None,
    ):
        self.cfg = cfg
        self.mean_cfg = cfg if mean_cfg is None else mean_cfg
        self.error_feedback = bool(error_feedback) and cfg.codec in F.LOSSY_CODECS
        self.decay = float(error_feedback_decay)
        self.mean_error_feedback = bool(mean_error_feedback) and self.mean_cfg.codec in F.LOSSY_CODECS

    def __repr__(self) -> str:
        mean = "" if self.mean_cfg is self.cfg else f", mean_codec={self.mean_cfg.codec!r}"
        return (
            f"simulated({self.cfg.codec!r}{mean}, error_feedback={self.error_feedback}, "
            f"mean_error_feedback={self.mean_error_feedback}, {self.cfg})"
        )

    def init(self, params: Any) -> Any:
        if self.error_feedback or self.mean_error_feedback:
            zeros = init_error_feedback(params)
            return ErrorFeedbackState(
                zeros if self.error_feedback else None,
                init_error_feedback(params) if self.mean_error_feedback else None,
            )
        return optax.EmptyState()

    def _apply(
        self, tree: Any, residual: Any, key: jax.Array, decay: float = 1.0, cfg: F.CodecConfig | None = None
    ) -> tuple[Any, Any]:
        cfg = self.cfg if cfg is None else cfg
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
        if self.error_feedback:
            dec, res = self._apply(delta, state.residual, key, self.decay)
            return dec, state._replace(residual=res)
        dec, _ = self._apply(delta, None, key)
        return dec, state

    def requantize(self, mean: Any, key: jax.Array) -> Any:
        if self.mean_cfg.codec == "fp32":
            return mean
        return self._apply(mean, None, key, cfg=self.mean_cfg)[0]

    def requantize_with_state(self, mean: Any, state: Any, key: jax.Array) -> tuple[Any, Any]:
        """:meth:`requantize` with the owners' error feedback on the mean (``mean_error_feedback``:
        the residual of the mean's encode is added to the next round's mean before encoding, as
        each part's owner does in the swarm; DoubleSqueeze, arXiv 1905.05957). ``mean`` is the
        same on every replica, so is the residual."""
        if not self.mean_error_feedback:
            return self.requantize(mean, key), state
        dec, res = self._apply(mean, state.mean_residual, key, cfg=self.mean_cfg)
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
    c = Codec.of(codec)
    cfg = F.resolve(c.name, **c.options)
    mean_cfg = None
    if c.mean is not None:
        opts = F.mean_codec_options(c.name, c.mean, c.options)
        mean_cfg = F.resolve(c.mean, **opts)
    return SimulatedCodecImpl(cfg, c.error_feedback, c.error_feedback_decay, c.mean_ef, mean_cfg)
