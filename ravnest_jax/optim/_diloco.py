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

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import optax

if TYPE_CHECKING:  # pragma: no cover
    from ravnest_jax.compress import Codec

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


def default_outer(learning_rate: float = 0.7, momentum: float = 0.9) -> optax.GradientTransformation:
    """Outer optimizer of DiLoCo: Nesterov SGD, learning rate 0.7, momentum 0.9 (arXiv 2311.08105).

    Args:
      learning_rate: the outer learning rate (> 0).
      momentum: Nesterov momentum in ``[0, 1)``; 0 gives plain SGD (with ``learning_rate=1``,
        plain averaging of the replicas).

    Raises:
      ValueError: a learning rate <= 0 or a momentum outside ``[0, 1)``.
    """
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not learning_rate > 0:
        raise ValueError(f"learning_rate must be a number > 0, got {learning_rate!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
    if momentum == 0:
        return optax.sgd(learning_rate=learning_rate)
    return optax.sgd(learning_rate=learning_rate, momentum=momentum, nesterov=True)


def _copy(tree: PyTree) -> PyTree:
    # A real copy: global params and snapshots must never alias the (possibly donated) params.
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _f32(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _sub(a: PyTree, b: PyTree) -> PyTree:
    return jax.tree.map(lambda x, y: jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32), a, b)


def _cast_like(tree: PyTree, like: PyTree) -> PyTree:
    return jax.tree.map(lambda x, y: jnp.asarray(x, y.dtype), tree, like)


def _select(tree: PyTree, leaf_ids: tuple[int, ...]) -> list:
    leaves = jax.tree.leaves(tree)
    return [leaves[i] for i in leaf_ids]


def _scatter(tree: PyTree, leaf_ids: tuple[int, ...], new_leaves: list) -> PyTree:
    leaves, treedef = jax.tree.flatten(tree)
    leaves = list(leaves)
    for i, x in zip(leaf_ids, new_leaves):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


class DiLoCo(optax.GradientTransformationExtraArgs):
    """The transformation returned by :func:`diloco`.

    It is an ``optax.GradientTransformationExtraArgs`` (``init``, ``update``) and can be used
    anywhere one is accepted (``flax.nnx.Optimizer``, a linen ``TrainState``, plain ``jax.jit``).
    It also carries the round functions used when the host drives rounds
    (``axis_name=None``): :meth:`round_start`, :meth:`outer_step`, :meth:`speculate` (eager
    updates) and :meth:`round_merge`, all pure and jittable, and the fragment schedule
    (:meth:`fragment_leaf_ids`, :meth:`fragment_leaves`, :meth:`fragment_offset`,
    :meth:`due_fragments`). Its static configuration is available as
    ``inner``, ``outer``, ``sync_every``, ``axis_name`` and ``fragments``.

    The round functions are elementwise in every leaf, so they take params laid out over a
    local device mesh (``jax.sharding.NamedSharding``: replicated, FSDP-style, any spec) as
    they are: each device computes its own shards, no collective runs, the results keep the
    input layouts and are bit-identical to a single-device run (docs/multi-device.md).
    """

    # NamedTuple subclasses without __slots__ get a __dict__: it holds the static config.
    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    sync_every: int
    axis_name: Any
    fragments: int

    # ------------------------------------------------------------------ fragment schedule
    def fragment_leaf_ids(self, fragment: int, num_leaves: int) -> tuple[int, ...]:
        """Leaf indices (in ``jax.tree.leaves`` order) of a fragment: ``i % fragments == fragment``.

        Strided groups, the same on every peer, so all peers reduce fragments in the same order
        (Streaming DiLoCo, arXiv 2501.18512).
        """
        return tuple(range(fragment, num_leaves, self.fragments))

    def fragment_offset(self, fragment: int) -> int:
        """Steps by which a fragment's rounds are shifted: ``fragment * sync_every // fragments``."""
        return (fragment * self.sync_every) // self.fragments

    def due_fragments(self, step: int) -> tuple[int, ...]:
        """Fragments whose round boundary is inner step ``step`` (host-side, plain ints).

        Fragment ``f`` synchronises at steps ``k * H + offset(f)`` for ``k >= 1``; with one
        fragment that is ``H, 2H, ...``.
        """
        h = self.sync_every
        return tuple(
            f
            for f in range(self.fragments)
            if step >= h + self.fragment_offset(f) and (step - self.fragment_offset(f)) % h == 0
        )

    def fragment_leaves(self, tree: PyTree, fragment: int | None = None) -> list:
        """The leaves of ``tree`` (in ``jax.tree.leaves`` order) that ``fragment`` synchronises:
        all of them with ``fragments == 1``, else those of :meth:`fragment_leaf_ids`.

        Raises:
          ValueError: ``fragment`` does not match the configuration.
        """
        ids = self._ids(tree, fragment)
        return list(jax.tree.leaves(tree)) if ids is None else _select(tree, ids)

    def _check_fragment(self, fragment: int | None) -> None:
        if self.fragments == 1:
            if fragment not in (None, 0):
                raise ValueError(f"fragment must be None or 0 with fragments=1, got {fragment!r}")
        elif not isinstance(fragment, int) or not 0 <= fragment < self.fragments:
            raise ValueError(
                f"fragment must be an int in [0, {self.fragments}) with fragments={self.fragments}, got {fragment!r}"
            )

    def _ids(self, tree: PyTree, fragment: int | None) -> tuple[int, ...] | None:
        self._check_fragment(fragment)
        if self.fragments == 1:
            return None
        return self.fragment_leaf_ids(fragment, len(jax.tree.leaves(tree)))

    # ---------------------------------------------------------------------- round functions
    def round_start(self, params: optax.Params, state: DiLoCoState, fragment: int | None = None) -> RoundSnapshot:
        """Takes the pseudo-gradient of the current round (host-driven mode).

        Args:
          params: local params at the round boundary (after ``sync_every`` inner steps).
          state: the :class:`DiLoCoState`.
          fragment: with ``fragments > 1``, the fragment (static int) whose round this is; the
            snapshot then holds lists of that fragment's leaves.

        Returns:
          A :class:`RoundSnapshot`: ``pseudo_gradient = global_params - params`` (float32 leaves),
          a copy of ``params`` and the round number. Pure and jittable; send
          ``pseudo_gradient`` to the other peers, average it, and give the mean to
          :meth:`round_merge`.

        Raises:
          ValueError: ``fragment`` does not match the configuration.
        """
        ids = self._ids(params, fragment)
        g, p = state.global_params, params
        if ids is not None:
            g, p = _select(g, ids), _select(p, ids)
        return RoundSnapshot(
            pseudo_gradient=_sub(g, p),
            params=_copy(p),
            round=jnp.asarray(state.rounds, jnp.int32),
        )

    def outer_step(
        self, state: DiLoCoState, mean_pseudo_gradient: optax.Params, fragment: int | None = None
    ) -> DiLoCoState:
        """Applies the outer optimizer to the anchor with an averaged pseudo-gradient.

        ``global_params <- global_params + outer.update(mean_pseudo_gradient)``; increments
        ``rounds``. The local params are not touched (see :meth:`round_merge`). Pure, jittable;
        every peer that applies the same mean to the same state gets bit-identical results on
        the same hardware.

        Args:
          state: the :class:`DiLoCoState`.
          mean_pseudo_gradient: pytree shaped like the params (any float dtype; cast to the
            params' dtype), or with ``fragments > 1`` the list of the fragment's leaves.
          fragment: the fragment (static int) with ``fragments > 1``.

        Returns:
          The new state.
        """
        ids = self._ids(state.global_params, fragment)
        if ids is None:
            global_params = state.global_params
            outer_state = state.outer_state
        else:
            global_params = _select(state.global_params, ids)
            outer_state = state.outer_state[fragment]
        mean = _cast_like(_f32(mean_pseudo_gradient), global_params)
        outer_updates, outer_state = self.outer.update(mean, outer_state, global_params)
        new_global = optax.apply_updates(global_params, outer_updates)
        if ids is not None:
            new_global = _scatter(state.global_params, ids, new_global)
            outer_state = tuple(outer_state if f == fragment else s for f, s in enumerate(state.outer_state))
        return state._replace(
            outer_state=outer_state,
            global_params=new_global,
            rounds=state.rounds + 1,
        )

    def speculate(
        self, params: optax.Params, state: DiLoCoState, snapshot: RoundSnapshot, fragment: int | None = None
    ) -> tuple[optax.Params, list]:
        """Eager updates (Kale et al., arXiv 2502.12996): at a round boundary, the local
        pseudo-gradient stands in for the average that is still on the wire.

        The outer step is applied to the anchor with ``snapshot.pseudo_gradient`` (this peer's
        own); the params restart from that speculative anchor at once. When the true mean
        arrives, :meth:`round_merge` with ``snapshot._replace(params=anchor)`` recomputes the
        anchor from the mean and rebases the local progress made since onto it, so the global
        state stays identical on all peers. Pure and jittable.

        Args:
          params: local params at the boundary.
          state: the :class:`DiLoCoState` the snapshot was taken from.
          snapshot: the round's :class:`RoundSnapshot` (:meth:`round_start`).
          fragment: the fragment (static int) with ``fragments > 1``; only its leaves change.

        Returns:
          ``(new_params, anchor)``: the params with the fragment's leaves replaced by the
          speculative anchor (the params' dtypes), and a copy of that anchor shaped like
          ``snapshot.params`` (a separate buffer: the params may be donated by the next train
          step).

        Raises:
          ValueError: a wrong ``fragment``.
        """
        ids = self._ids(params, fragment)
        spec = self.outer_step(state, snapshot.pseudo_gradient, fragment)
        if ids is None:
            anchor = spec.global_params
            new_params = jax.tree.map(lambda a, p: a.astype(p.dtype), anchor, params)
        else:
            anchor = _select(spec.global_params, ids)
            new_params = _scatter(params, ids, [a.astype(p.dtype) for a, p in zip(anchor, _select(params, ids))])
        return new_params, jax.tree.map(lambda a: a + jnp.zeros_like(a), anchor)

    def round_merge(
        self,
        params: optax.Params,
        state: DiLoCoState,
        mean_pseudo_gradient: optax.Params,
        snapshot: RoundSnapshot,
        *,
        fragment: int | None = None,
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
          state: the :class:`DiLoCoState` whose anchor the round's pseudo-gradients were taken
            against (its inner state may have moved on).
          mean_pseudo_gradient: the weighted mean of all peers' pseudo-gradients for the
            snapshot's round, shaped like ``snapshot.pseudo_gradient``.
          snapshot: the :class:`RoundSnapshot` of that round.
          fragment: the fragment (static int) with ``fragments > 1``; only its leaves change.
          alpha: mixing weight of the local params, in ``[0, 1]`` (static float or traced
            scalar).
          keep_local_progress: static bool, see above.

        Returns:
          ``(new_params, new_state)``; new_params has the dtypes of ``params``.

        Raises:
          ValueError: a static ``alpha`` outside ``[0, 1]``; a wrong ``fragment``.
        """
        if isinstance(alpha, (int, float)) and not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        ids = self._ids(params, fragment)
        state = self.outer_step(state, mean_pseudo_gradient, fragment)
        new_global = state.global_params
        local = params
        if ids is not None:
            new_global, local = _select(new_global, ids), _select(params, ids)

        def merge(p, g, s):
            merged = g + (p - s) if keep_local_progress else g
            if isinstance(alpha, (int, float)) and float(alpha) == 0.0:
                out = merged
            else:
                a = jnp.asarray(alpha, jnp.float32)
                out = a * p.astype(jnp.float32) + (1.0 - a) * merged.astype(jnp.float32)
            return jnp.asarray(out, p.dtype)

        merged = jax.tree.map(merge, local, new_global, snapshot.params)
        if ids is not None:
            merged = _scatter(params, ids, merged)
        return merged, state


def _make(init_fn, update_fn, **config) -> DiLoCo:
    tx = DiLoCo(init_fn, update_fn)
    for k, v in config.items():
        object.__setattr__(tx, k, v)
    return tx


def _check_transform(name: str, tx: Any) -> None:
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise ValueError(
            f"{name} must be an optax.GradientTransformation (with .init and .update), got {type(tx).__name__}"
        )


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
    *,
    sync_every: int,
    axis_name: Any = None,
    codec: SimulatedCodec | Codec | str | None = None,
    rng_key: jax.Array | None = None,
    fragments: int = 1,
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
        does (encode, decode, mean, encode, decode), to study compression on one machine: the
        ``rj.Codec`` value a real swarm would take, a codec name (``"int4"``; both built with
        ``ravnest_jax.compress.simulated``) or a :class:`SimulatedCodec`. Its state (for example the error-feedback residual) lives in
        ``DiLoCoState.codec_state``. For a real swarm, give the codec to ``rj.Swarm``.
      rng_key: PRNG key for stochastic rounding in ``codec`` (folded with the round number and
        the replica index each round); default ``jax.random.key(0)``.
      fragments: F, number of strided groups of parameter leaves synchronised on their own
        schedule (streaming DiLoCo, arXiv 2501.18512): leaf ``i`` belongs to fragment
        ``i % F``, and fragment ``f`` has its rounds at steps ``k * H + f * H // F``
        (``k >= 1``). With ``F > 1`` the outer state (and the codec state) is a tuple of F
        states, one per fragment. ``1 <= F <= sync_every``.

    Returns:
      A :class:`DiLoCo` (an ``optax.GradientTransformationExtraArgs``). Its ``update`` requires
      ``params``. State: :class:`DiLoCoState`.

    Raises:
      ValueError: ``sync_every`` is not an int ``>= 1``; ``inner`` or ``outer`` is not a
        gradient transformation; ``codec`` is given without ``axis_name`` or is not a codec;
        ``fragments`` is not an int in ``[1, sync_every]``.

    References:
      Douillard et al., DiLoCo, https://arxiv.org/abs/2311.08105
      Douillard et al., Streaming DiLoCo, https://arxiv.org/abs/2501.18512
    """
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
    if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= sync_every:
        raise ValueError(f"fragments must be an int in [1, sync_every={sync_every}], got {fragments!r}")
    _check_transform("inner", inner)
    if outer is None:
        outer = default_outer()
    _check_transform("outer", outer)
    if codec is not None and axis_name is None:
        raise ValueError(
            "codec applies in diloco only with axis_name set (in-process rounds); "
            "for a real swarm pass the codec to rj.Swarm"
        )
    from ravnest_jax.compress import Codec, simulated  # optim -> compress is a downward dependency

    if isinstance(codec, (str, Codec)):
        codec = simulated(codec)
    if codec is not None and not isinstance(codec, SimulatedCodec):
        raise ValueError(
            "codec must be an rj.Codec, a codec name or a SimulatedCodec (init/compress/requantize), got "
            f"{type(codec).__name__}"
        )
    inner = optax.with_extra_args_support(inner)
    outer_tx = outer
    base_key = rng_key

    def per_fragment(init, params):
        if fragments == 1:
            return init(params)
        n = len(jax.tree.leaves(params))
        return tuple(init(_select(params, tuple(range(f, n, fragments)))) for f in range(fragments))

    def init_fn(params: optax.Params) -> DiLoCoState:
        codec_state = per_fragment(codec.init, params) if codec is not None else optax.EmptyState()
        return DiLoCoState(
            inner_state=inner.init(params),
            outer_state=per_fragment(outer_tx.init, params),
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

        n_leaves = len(jax.tree.leaves(params))

        def round_fn(fragment):
            ids = None if fragments == 1 else tuple(range(fragment, n_leaves, fragments))

            def pick(tree):
                return tree if ids is None else _select(tree, ids)

            def do_round(args):
                updates, state = args
                local = optax.apply_updates(pick(params), pick(updates))
                delta = _sub(pick(state.global_params), local)
                codec_state = state.codec_state
                if codec is not None:
                    key = base_key if base_key is not None else jax.random.key(0)
                    key = jax.random.fold_in(jax.random.fold_in(key, state.rounds), fragment)
                    key, mean_key = jax.random.split(key)
                    key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
                    frag_state = codec_state if ids is None else codec_state[fragment]
                    delta, frag_state = codec.compress(delta, frag_state, key)
                    if hasattr(codec, "requantize_with_state"):  # the owners' error feedback on the mean
                        mean, frag_state = codec.requantize_with_state(
                            jax.lax.pmean(delta, axis_name), frag_state, mean_key
                        )
                    else:
                        mean = codec.requantize(jax.lax.pmean(delta, axis_name), mean_key)
                    if ids is None:
                        codec_state = frag_state
                    else:
                        codec_state = tuple(frag_state if f == fragment else c for f, c in enumerate(codec_state))
                else:
                    mean = jax.lax.pmean(delta, axis_name)
                new_state = tx.outer_step(
                    state._replace(codec_state=codec_state), mean, None if ids is None else fragment
                )
                # updates that take these params onto the new anchor
                jump = jax.tree.map(
                    lambda g, p, u: (g.astype(jnp.float32) - p.astype(jnp.float32)).astype(u.dtype),
                    pick(new_state.global_params),
                    pick(params),
                    pick(updates),
                )
                if ids is not None:
                    jump = _scatter(updates, ids, jump)
                return jump, new_state

            return do_round

        def no_round(args):
            return args

        carry = (inner_updates, state)
        for f in range(fragments):
            off = (f * sync_every) // fragments
            is_boundary = (count >= sync_every + off) & ((count - off) % sync_every == 0)
            carry = jax.lax.cond(is_boundary, round_fn(f), no_round, carry)
        return carry

    tx = _make(
        init_fn,
        update_fn,
        inner=inner,
        outer=outer_tx,
        sync_every=sync_every,
        axis_name=axis_name,
        fragments=fragments,
    )
    return tx
