"""DiLoCo as an optax gradient transformation.

Pure, jittable math only: no I/O, no asyncio. Everything here runs under ``jax.jit``,
``jax.vmap`` and ``jax.shard_map``.

References:
  Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
  https://arxiv.org/abs/2311.08105
  Douillard et al., "Streaming DiLoCo with overlapping communication",
  https://arxiv.org/abs/2501.18512
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "DiLoCo",
    "DiLoCoState",
    "RoundSnapshot",
    "SimulatedCodec",
    "diloco",
    "default_outer",
]

PyTree = Any


@runtime_checkable
class SimulatedCodec(Protocol):
    """A pseudo-gradient codec as the in-process simulation (``axis_name`` mode) applies it.

    The real swarm encodes each peer's pseudo-gradient, averages the decoded parts in float32 and
    encodes the mean again for the all-gather. The simulation does the same on one machine:
    ``compress`` before the mean (with its state, for example an error-feedback residual), then
    ``requantize`` after it. ``ravnest_jax.compress.simulated(...)`` builds one from a codec
    name.
    """

    def init(self, params: PyTree) -> PyTree:
        """Codec state for params shaped like ``params`` (``optax.EmptyState()`` if none)."""
        ...

    def compress(self, delta: PyTree, state: PyTree, key: jax.Array) -> tuple[PyTree, PyTree]:
        """Encode-then-decode of one replica's float32 pseudo-gradient; returns (decoded, state)."""
        ...

    def requantize(self, mean: PyTree, key: jax.Array) -> PyTree:
        """Encode-then-decode of the averaged pseudo-gradient (what the all-gather carries)."""
        ...


class DiLoCoState(NamedTuple):
    """State of :func:`diloco`.

    Attributes:
      inner_state: state of the inner optimizer (for example AdamW moments and its step count,
        which drives the learning-rate schedule). Kept across rounds, as in DiLoCo.
      outer_state: state of the outer optimizer (for example Nesterov momentum), a pytree shaped
        like the params.
      global_params: the anchor: params all peers agree on after the last outer step. Same tree
        structure, shapes and dtypes as the params; never aliases them.
      count: int32 scalar, inner steps taken so far (all rounds).
      rounds: int32 scalar, outer steps applied so far. Round ``r`` (from 0) is the one whose
        result is applied when ``rounds`` goes from ``r`` to ``r + 1``.
      codec_state: state of the pseudo-gradient transform in simulation (for example the
        error-feedback residual of a codec); ``optax.EmptyState()`` when unused.
    """

    inner_state: optax.OptState
    outer_state: optax.OptState
    global_params: optax.Params
    count: jax.Array
    rounds: jax.Array
    codec_state: PyTree = optax.EmptyState()


class RoundSnapshot(NamedTuple):
    """What :meth:`DiLoCo.round_start` hands to the host for one round.

    Attributes:
      pseudo_gradient: ``global_params - params`` at the round boundary, a pytree shaped like the
        params, float32 leaves.
      params: the local params at the round boundary (a copy, never aliasing the live params);
        :meth:`DiLoCo.round_merge` uses it to keep the local progress made since.
      round: int32 scalar, the round number (``state.rounds`` at the boundary).
    """

    pseudo_gradient: optax.Params
    params: optax.Params
    round: jax.Array


def default_outer() -> optax.GradientTransformation:
    """Outer optimizer of DiLoCo: Nesterov SGD, learning rate 0.7, momentum 0.9 (arXiv 2311.08105)."""
    return optax.sgd(learning_rate=0.7, momentum=0.9, nesterov=True)


def _copy(tree: PyTree) -> PyTree:
    # A real copy: global params and snapshots must never alias the (possibly donated) params.
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _f32(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _sub(a: PyTree, b: PyTree) -> PyTree:
    return jax.tree.map(lambda x, y: jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32), a, b)


def _cast_like(tree: PyTree, like: PyTree) -> PyTree:
    return jax.tree.map(lambda x, y: jnp.asarray(x, y.dtype), tree, like)


class DiLoCo(optax.GradientTransformationExtraArgs):
    """The transformation returned by :func:`diloco`.

    It is an ``optax.GradientTransformationExtraArgs`` (``init``, ``update``) and can be used
    anywhere one is accepted (``flax.nnx.Optimizer``, a linen ``TrainState``, plain ``jax.jit``).
    It also carries the round functions used when the host drives rounds
    (``axis_name=None``): :meth:`round_start`, :meth:`outer_step` and :meth:`round_merge`, all
    pure and jittable. Its static configuration is available as ``inner``, ``outer``,
    ``sync_every`` and ``axis_name``.
    """

    # NamedTuple subclasses have no __dict__ by default; we want one for the static config.
    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    sync_every: int
    axis_name: Any

    def round_start(self, params: optax.Params, state: DiLoCoState) -> RoundSnapshot:
        """Takes the pseudo-gradient of the current round (host-driven mode).

        Args:
          params: local params at the round boundary (after ``sync_every`` inner steps).
          state: the :class:`DiLoCoState`.

        Returns:
          A :class:`RoundSnapshot`: ``pseudo_gradient = global_params - params`` (float32 leaves),
          a copy of ``params`` and the round number. Pure and jittable; send
          ``pseudo_gradient`` to the other peers, average it, and give the mean to
          :meth:`round_merge`.
        """
        return RoundSnapshot(
            pseudo_gradient=_sub(state.global_params, params),
            params=_copy(params),
            round=jnp.asarray(state.rounds, jnp.int32),
        )

    def outer_step(
        self, state: DiLoCoState, mean_pseudo_gradient: optax.Params
    ) -> DiLoCoState:
        """Applies the outer optimizer to the anchor with an averaged pseudo-gradient.

        ``global_params <- global_params + outer.update(mean_pseudo_gradient)``; increments
        ``rounds``. The local params are not touched (see :meth:`round_merge`). Pure, jittable;
        every peer that applies the same mean to the same state gets bit-identical results.

        Args:
          state: the :class:`DiLoCoState`.
          mean_pseudo_gradient: pytree shaped like the params (any float dtype; cast to float32).

        Returns:
          The new state.
        """
        global_params = state.global_params
        mean = _cast_like(_f32(mean_pseudo_gradient), global_params)
        outer_updates, outer_state = self.outer.update(mean, state.outer_state, global_params)
        new_global = optax.apply_updates(global_params, outer_updates)
        return state._replace(
            outer_state=outer_state,
            global_params=new_global,
            rounds=state.rounds + 1,
        )

    def round_merge(
        self,
        params: optax.Params,
        state: DiLoCoState,
        mean_pseudo_gradient: optax.Params,
        snapshot: RoundSnapshot,
        *,
        alpha: float | jax.Array = 0.0,
        keep_local_progress: bool = True,
    ) -> tuple[optax.Params, DiLoCoState]:
        """Applies the averaged pseudo-gradient of a round and merges it into the local params.

        The result may arrive ``tau >= 0`` inner steps after :meth:`round_start` (Streaming
        DiLoCo's overlap, arXiv 2501.18512). With ``G'`` the new anchor from
        :meth:`outer_step` and ``delta = params - snapshot.params`` the local progress since the
        snapshot:

        - ``keep_local_progress=True``: ``merged = G' + delta`` (with ``tau = 0``, exactly
          ``G'``, that is blocking DiLoCo);
        - ``keep_local_progress=False``: ``merged = G'``;

        and then ``new_params = alpha * params + (1 - alpha) * merged`` (mixing, Streaming
        DiLoCo; ``alpha = 0`` by default, ``alpha = 1`` ignores the round).

        Args:
          params: current local params.
          state: the :class:`DiLoCoState`.
          mean_pseudo_gradient: the weighted mean of all peers' pseudo-gradients for the
            snapshot's round, shaped like the params.
          snapshot: the :class:`RoundSnapshot` of that round.
          alpha: mixing weight of the local params, in ``[0, 1]`` (static float or traced
            scalar).
          keep_local_progress: static bool, see above.

        Returns:
          ``(new_params, new_state)``; new_params has the dtypes of ``params``.

        Raises:
          ValueError: if a static ``alpha`` is outside ``[0, 1]``.
        """
        if isinstance(alpha, (int, float)) and not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        state = self.outer_step(state, mean_pseudo_gradient)
        new_global = state.global_params

        def merge(p, g, s):
            if keep_local_progress:
                merged = g + (p - s)
            else:
                merged = g
            if isinstance(alpha, (int, float)) and float(alpha) == 0.0:
                out = merged
            else:
                a = jnp.asarray(alpha, jnp.float32)
                out = a * p.astype(jnp.float32) + (1.0 - a) * merged.astype(jnp.float32)
            return jnp.asarray(out, p.dtype)

        new_params = jax.tree.map(merge, params, new_global, snapshot.params)
        return new_params, state


def _make(init_fn, update_fn, **config) -> DiLoCo:
    tx = DiLoCo(init_fn, update_fn)
    for k, v in config.items():
        object.__setattr__(tx, k, v)
    return tx


def _check_transform(name: str, tx: Any) -> None:
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise ValueError(
            f"{name} must be an optax.GradientTransformation (with .init and .update), got "
            f"{type(tx).__name__}"
        )


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
    *,
    sync_every: int,
    axis_name: Any = None,
    codec: SimulatedCodec | str | None = None,
    rng_key: jax.Array | None = None,
) -> DiLoCo:
    """Wraps an optax optimizer into DiLoCo (Douillard et al. 2023, arXiv 2311.08105).

    Each replica takes ``sync_every`` (H) inner steps with ``inner``; then the pseudo-gradient
    ``Delta = global_params - local_params`` is averaged over replicas, the outer optimizer
    updates the anchor ``global_params <- global_params + outer.update(mean(Delta))``, and the
    local params restart from the new anchor. The inner optimizer state is kept across rounds.

    Two ways to run rounds:

    - ``axis_name`` set: the outer step happens inside ``update`` at steps ``H, 2H, ...``, with
      ``lax.pmean`` over the named axis. Use under ``jax.vmap(..., axis_name=...)`` (replica
      simulation) or ``jax.shard_map`` over a device mesh. At those steps the returned updates
      move the params onto the new anchor (up to float32 rounding of ``p + (g - p)``).
    - ``axis_name=None``: ``update`` only takes inner steps and counts them; the host drives
      rounds with :meth:`DiLoCo.round_start` and :meth:`DiLoCo.round_merge` (used by
      ``rj.OuterSync`` over a real swarm).

    Args:
      inner: the inner optimizer, for example ``optax.adamw(3e-4)``.
      outer: the outer optimizer; ``None`` means Nesterov SGD with learning rate 0.7 and
        momentum 0.9 (the DiLoCo defaults).
      sync_every: H, inner steps per round (``>= 1``).
      axis_name: name of the replica axis for in-process rounds, or ``None``.
      codec: in the ``axis_name`` mode only, a pseudo-gradient codec applied as the real swarm
        does (encode, decode, mean, encode, decode), to study compression on one machine: a
        codec name (``"int4"``, built with ``ravnest_jax.compress.simulated``) or a
        :class:`SimulatedCodec`. Its state (for example the error-feedback residual) lives in
        ``DiLoCoState.codec_state``. For a real swarm, give the codec to ``rj.Swarm``.
      rng_key: PRNG key for stochastic rounding in ``codec`` (folded with the round number and
        the replica index each round); default ``jax.random.key(0)``.

    Returns:
      A :class:`DiLoCo` (an ``optax.GradientTransformationExtraArgs``). Its ``update`` requires
      ``params``. State: :class:`DiLoCoState`.

    Raises:
      ValueError: ``sync_every`` is not an int ``>= 1``; ``inner`` or ``outer`` is not a
        gradient transformation; ``codec`` is given without ``axis_name`` or is not a codec.

    References:
      Douillard et al., DiLoCo, https://arxiv.org/abs/2311.08105
      Douillard et al., Streaming DiLoCo, https://arxiv.org/abs/2501.18512
    """
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
    _check_transform("inner", inner)
    if outer is None:
        outer = default_outer()
    _check_transform("outer", outer)
    if codec is not None and axis_name is None:
        raise ValueError(
            "codec applies in diloco only with axis_name set (in-process rounds); "
            "for a real swarm pass the codec to rj.Swarm"
        )
    if isinstance(codec, str):
        from ravnest_jax.compress import simulated  # optim -> compress is a downward dependency

        codec = simulated(codec)
    if codec is not None and not isinstance(codec, SimulatedCodec):
        raise ValueError(
            f"codec must be a codec name or a SimulatedCodec (init/compress/requantize), got "
            f"{type(codec).__name__}"
        )
    inner = optax.with_extra_args_support(inner)
    outer_tx = outer
    base_key = rng_key

    def init_fn(params: optax.Params) -> DiLoCoState:
        codec_state = codec.init(params) if codec is not None else optax.EmptyState()
        return DiLoCoState(
            inner_state=inner.init(params),
            outer_state=outer_tx.init(params),
            global_params=_copy(params),
            count=jnp.zeros([], jnp.int32),
            rounds=jnp.zeros([], jnp.int32),
            codec_state=codec_state,
        )

    def update_fn(updates, state: DiLoCoState, params=None, **extra_args):
        if params is None:
            raise ValueError("diloco's update needs params: call tx.update(grads, state, params)")
        inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        count = optax.safe_int32_increment(state.count)
        state = state._replace(inner_state=inner_state, count=count)
        if axis_name is None:
            return inner_updates, state

        def do_round(args):
            inner_updates, state = args
            local = optax.apply_updates(params, inner_updates)
            delta = _sub(state.global_params, local)
            codec_state = state.codec_state
            if codec is not None:
                key = base_key if base_key is not None else jax.random.key(0)
                key = jax.random.fold_in(key, state.rounds)
                key, mean_key = jax.random.split(key)
                key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
                delta, codec_state = codec.compress(delta, codec_state, key)
                mean = codec.requantize(jax.lax.pmean(delta, axis_name), mean_key)
            else:
                mean = jax.lax.pmean(delta, axis_name)
            new_state = tx.outer_step(state._replace(codec_state=codec_state), mean)
            # updates that take params onto the new anchor
            jump = jax.tree.map(
                lambda g, p, u: (g.astype(jnp.float32) - p.astype(jnp.float32)).astype(u.dtype),
                new_state.global_params,
                params,
                inner_updates,
            )
            return jump, new_state

        def no_round(args):
            return args

        is_boundary = (count % sync_every) == 0
        return jax.lax.cond(is_boundary, do_round, no_round, (inner_updates, state))

    tx = _make(init_fn, update_fn, inner=inner, outer=outer_tx, sync_every=sync_every, axis_name=axis_name)
    return tx
