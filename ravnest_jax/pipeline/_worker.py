"""One stage's compute: its jitted forward and backward, gradient accumulation, the optimizer
update and the weight versions of the asynchronous modes.

The forward returns the activation already encoded on the device with the pipeline's codec
(only the compressed bytes leave the accelerator) and keeps the backward's residuals on the
device; residuals that are the stage's own parameters, its frozen base or its input are not
copied out but put back at the backward (the parameters of the version the forward used: weight
stashing costs no copy). The last stage runs forward, loss and backward in one call.

A received activation (or activation-gradient) comes in as it crossed the wire, an
``EncodedActivation`` (int8 codes and bf16 scales, bf16 bits, ...): its parts go to the device
as they are and the jitted step decodes them (``compress.dequantize`` with ``jax.numpy``, the
host decoder's math, behind an optimization barrier so that the float32 values are the host
decoder's bit for bit); a float32 array (decoded on the host) is taken as well.

Weights each micro-batch sees (``mode``):

- ``"sync"``: the schedule flushes every step; forward and backward of every micro-batch of
  step ``t`` use ``W_t``, and ``W_{t+1} = W_t - u(mean grad at W_t)``: the unsplit model's step.
- ``"stash"`` (PipeDream's weight stashing, arXiv 1806.03377, with one update per step): a
  forward uses the newest weights of its stage, its backward the same weights (stashed by
  reference), so each gradient is a true gradient at some version; a step's micro-batches may
  mix the newest and the one before (at most ``S - s - 1`` of them on stage ``s``).
- ``"predict"``: weight stashing, and a forward that runs before its stage applied the
  previous step's update uses the weights predicted for after it, ``W_t + (W_t - W_{t-1})``
  (the last update repeated: weight prediction, as SpecTrain, arXiv 1809.02839, with the
  update in place of the smoothed gradient), stashed for its backward like any version.
- ``"2bw"`` (PipeDream-2BW, arXiv 2006.09503): every micro-batch of step ``t`` uses ``W_{t-1}``
  and ``W_{t+1} = W_t - u(grad at W_{t-1})``: a uniform one-step delay; two versions are kept.

With a LoRA model only the adapters are parameters: the frozen base has one version, shared by
every micro-batch; only the adapters go stale.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ravnest_jax.compress import dequantize, device_encode, part_dtypes, part_lengths, resolve_codec, topk_count

from ._model import StageModel

__all__ = ["ASYNC_MODE", "MODES", "StageWorker"]

MODES = ("sync", "stash", "predict", "2bw")
#: what ``mode="async"`` means: the asynchronous mode benchmarks/bench_pipeline_quality.py chose
#: (char-LM, 3 stages, 600 steps, eval loss against the unsplit model: "predict" +1.12% with 4
#: micro-batches and +0.96% with 8, "stash" +2.86% and +1.05%, "2bw" +13.6%; docs/pipeline.md)
ASYNC_MODE = "predict"


@dataclasses.dataclass
class _Stashed:
    params: Any  # the weight version the forward used
    x: Any  # the forward's input (device array)
    kept: Any  # residuals that are neither params, frozen base nor input


class StageWorker:
    """The compute of one pipeline stage (no I/O).

    Args:
      stage: the :class:`StageModel` this stage holds.
      tx: the optax optimizer of this stage's parameters (an ``rj.diloco`` transformation for
        DiLoCo across clusters). Applied once per step to the mean gradient of its micro-batches.
      num_stages: S.
      micro_batches: M, micro-batches per step (each ``batch / M`` sequences).
      hidden: shape and dtype of one micro-batch's activation between stages.
      codec: activation codec (``"fp32"`` lossless, ``"bf16"``, ``"int8"``, ``"int4"``, ``"fp4"``,
        see ``docs/compression.md``), for activations and activation-gradients alike.
      codec_options: e.g. ``{"block_size": 64}``; ``int8`` and ``int4`` default to one scale per
        token (``block_size`` = the hidden width: ``4 d / (d + 2)`` times fewer bytes than fp32
        with int8, 3.92x at d = 96, 3.999x at d = 8192), see :func:`activation_codec_options`.
      mode: ``"sync"``, ``"stash"`` or ``"2bw"`` (module docstring); ``"async"``: :data:`ASYNC_MODE`.
      recompute: the backward recomputes the forward from the stashed input instead of keeping
        its residuals (less memory per micro-batch in flight, one forward more of compute).
      keep_grads: keep a copy of each step's mean gradient (:attr:`last_grads`, for tests).

    Raises:
      ValueError: an unknown mode or codec, ``micro_batches < num_stages - 1`` with ``"2bw"``.
    """

    def __init__(
        self,
        stage: StageModel,
        tx: optax.GradientTransformation,
        *,
        num_stages: int,
        micro_batches: int,
        hidden: jax.ShapeDtypeStruct,
        codec: str = "fp32",
        codec_options: dict | None = None,
        mode: str = "sync",
        recompute: bool = False,
        keep_grads: bool = False,
    ):
        mode = ASYNC_MODE if mode == "async" else mode
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} or 'async', got {mode!r}")
        codec_options = activation_codec_options(codec, codec_options, hidden.shape[-1])
        self._cfg = resolve_codec(codec, **codec_options)  # ValueError naming a bad codec or option
        if mode == "2bw" and micro_batches < num_stages - 1:
            raise ValueError(
                f"mode '2bw' needs micro_batches >= num_stages - 1, got {micro_batches} < {num_stages - 1}"
            )
        self.stage, self.tx, self.mode = stage, tx, mode
        self.first, self.last = stage.first, stage.last
        self.num_stages, self.micro_batches = num_stages, micro_batches
        self.hidden = hidden
        self.codec, self.codec_options = codec, dict(codec_options or {})
        self.recompute = bool(recompute)
        self.keep_grads = bool(keep_grads)
        # a private copy: the update donates the params, which may share buffers with the model
        self.params = jax.tree.map(lambda a: jnp.array(a, copy=True), stage.params)
        self.frozen = stage.frozen
        self.opt_state = tx.init(self.params)
        self.version = 0  # updates applied
        self._prev: Any = None  # 2bw: the version before the newest
        self._acc = self._zeros()
        self._stash: dict[int, _Stashed] = {}
        self._meta: tuple[Any, list] | None = None  # residual layout, set when the forward traces
        self.last_grads: Any = None
        self.residual_bytes = 0  # device bytes kept per micro-batch in flight (besides its input)
        self._eval: tuple[Any, Any] | None = None
        self._predicted: tuple[int, Any] | None = None
        self._predict = jax.jit(lambda p, q: jax.tree.map(lambda a, b: a + (a - b), p, q))
        self._build()

    # ------------------------------------------------------------------ jitted functions
    def _zeros(self) -> Any:
        return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), self.params)

    def _encode(self, y: jax.Array) -> Any:
        packed, _ = device_encode({"x": y}, self.codec, **self.codec_options)
        return packed

    def _decoded(self, x: Any) -> jax.Array:
        """float32 ``hidden.shape``: ``x`` itself, or decoded from its wire parts (a tuple)."""
        if not isinstance(x, tuple):
            return x
        n = int(np.prod(self.hidden.shape))
        y = dequantize(jnp, self._cfg, x, n).reshape(self.hidden.shape)
        # materialised as the host decoder's float32 (no product fused into what follows)
        return jax.lax.optimization_barrier(y)

    def _input(self, x: Any) -> jax.Array:
        return x if self.first else self._decoded(x).astype(self.hidden.dtype)

    def wire_parts(self, x: Any) -> Any:
        """What the jitted steps take for a received activation or activation-gradient: an
        ``EncodedActivation``'s parts put on the device as they are (a tuple of arrays, e.g.
        uint16 bf16 scale bits and uint8 int8 codes), or a float32 array on the device.

        Raises:
          ValueError: an encoded activation of another codec, block size or shape.
        """
        if not hasattr(x, "parts"):
            return jnp.asarray(x)
        cfg = self._cfg
        if (x.codec, int(x.block_size), tuple(x.shape)) != (cfg.codec, cfg.block_size, tuple(self.hidden.shape)):
            raise ValueError(
                f"activation in {x.codec} (block {x.block_size}) of shape {tuple(x.shape)}, this stage expects "
                f"{cfg.codec} (block {cfg.block_size}) of shape {tuple(self.hidden.shape)}"
            )
        return tuple(jax.device_put(np.asarray(p)) for p in x.parts)

    def _wire_spec(self, encoded: bool) -> Any:
        if not encoded:
            return jax.ShapeDtypeStruct(self.hidden.shape, jnp.float32)
        cfg, n = self._cfg, int(np.prod(self.hidden.shape))
        k = topk_count(n, cfg.fraction) if cfg.codec == "topk" else 0
        lens = part_lengths(cfg.codec, n, cfg.block_size, k)
        return tuple(jax.ShapeDtypeStruct((m,), dt.newbyteorder("=")) for m, dt in zip(lens, part_dtypes(cfg.codec)))

    def _vjp(self, params: Any, frozen: Any, x_in: jax.Array) -> tuple[jax.Array, Any]:
        apply = self.stage.apply
        if self.first:
            return jax.vjp(lambda p: apply(p, frozen, x_in), params)
        return jax.vjp(lambda p, h: apply(p, frozen, h), params, x_in)

    def _build(self) -> None:
        stage, first = self.stage, self.first
        donate_params = self.mode == "sync"

        def fwd(params, frozen, x):
            x_in = self._input(x)
            y, vjp = self._vjp(params, frozen, x_in)
            if self.recompute:
                return self._encode(y), ()
            leaves, tdef = jax.tree.flatten(vjp)
            p_leaves, f_leaves = jax.tree.leaves(params), jax.tree.leaves(frozen)
            srcs, kept = [], []
            for leaf in leaves:
                src = _source(leaf, p_leaves, f_leaves, x_in)
                srcs.append(src)
                if src is None:
                    kept.append(leaf)
            self._meta = (tdef, srcs)
            return self._encode(y), tuple(kept)

        def rebuild(params, frozen, x_in, kept):
            tdef, srcs = self._meta
            p_leaves, f_leaves = jax.tree.leaves(params), jax.tree.leaves(frozen)
            it = iter(kept)
            leaves = []
            for src in srcs:
                if src is None:
                    leaves.append(next(it))
                elif src[0] == "p":
                    leaves.append(p_leaves[src[1]])
                elif src[0] == "f":
                    leaves.append(f_leaves[src[1]])
                else:
                    leaves.append(x_in)
            return jax.tree.unflatten(tdef, leaves)

        def bwd(params, frozen, x, kept, g, acc):
            x_in = self._input(x)
            if self.recompute:
                _, vjp = self._vjp(params, frozen, x_in)
            else:
                vjp = rebuild(params, frozen, x_in, kept)
            cts = vjp(self._decoded(g).astype(self.hidden.dtype))
            acc = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), acc, cts[0])
            if first:
                return acc, None
            return acc, self._encode(cts[1])

        def last(params, frozen, x, targets, acc):
            x_in = self._input(x)

            def f(p, h):
                return stage.loss(stage.apply(p, frozen, h), targets)

            if first:
                loss, gp = jax.value_and_grad(lambda p: f(p, x_in))(params)
                gx = None
            else:
                loss, (gp, gh) = jax.value_and_grad(f, argnums=(0, 1))(params, x_in)
                gx = self._encode(gh)
            acc = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), acc, gp)
            return loss, acc, gx

        m = float(self.micro_batches)
        keep = self.keep_grads

        def update(params, opt_state, acc):
            grads = jax.tree.map(lambda a, p: (a / m).astype(p.dtype), acc, params)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            zeros = jax.tree.map(jnp.zeros_like, acc)
            return optax.apply_updates(params, updates), opt_state, zeros, (grads if keep else None)

        self._fwd = jax.jit(fwd)
        self._bwd = jax.jit(bwd, donate_argnums=(5,))
        self._last = jax.jit(last, donate_argnums=(4,))
        self._update = jax.jit(update, donate_argnums=(0, 1, 2) if donate_params else (1, 2))

    def compile(self, batch_rows: int, seq_len: int, *, encoded: bool = True, masked: bool = False) -> None:
        """Compiles this stage's programs for micro-batches of ``batch_rows`` sequences of
        ``seq_len`` tokens (before the pipeline starts, so no stage waits for another's
        compiler), for received activations as wire parts (``encoded``, what a stage peer
        feeds) or float32 arrays, and (the last stage) targets with loss weights (``masked``:
        ``(targets, weights)``, a loss-masked batch) or without. Runs nothing."""
        tokens = jax.ShapeDtypeStruct((batch_rows, seq_len), jnp.int32)
        x = tokens if self.first else self._wire_spec(encoded)
        acc = self._acc
        if self.last:
            targets = (tokens, jax.ShapeDtypeStruct((batch_rows, seq_len), jnp.float32)) if masked else tokens
            self._last.lower(self.params, self.frozen, x, targets, acc).compile()
        else:
            lowered = self._fwd.lower(self.params, self.frozen, x)
            lowered.compile()
            _, kept = jax.eval_shape(self._fwd, self.params, self.frozen, x)
            g = self._wire_spec(encoded)
            self._bwd.lower(self.params, self.frozen, x, kept, g, acc).compile()
            self.residual_bytes = int(sum(np.dtype(k.dtype).itemsize * int(np.prod(k.shape)) for k in kept))
        self._update.lower(self.params, self.opt_state, acc).compile()

    # ------------------------------------------------------------------ ops
    def _weights_for_forward(self, g: int) -> Any:
        if self.mode == "predict":
            if self.version >= g // self.micro_batches or self._prev is None:
                return self.params
            if self._predicted is None or self._predicted[0] != self.version:
                self._predicted = (self.version, self._predict(self.params, self._prev))
            return self._predicted[1]
        if self.mode != "2bw":
            return self.params
        want = max(g // self.micro_batches - 1, 0)
        if self.version == want:
            return self.params
        if self.version == want + 1 and self._prev is not None:
            return self._prev
        raise RuntimeError(f"2bw: micro-batch {g} needs weight version {want}, this stage is at {self.version}")

    def forward(self, g: int, x: Any, targets: Any = None) -> tuple[Any, Any]:
        """Forward of micro-batch ``g`` (the last stage: forward, loss and backward).

        Args:
          x: int32 tokens ``(rows, seq)`` on the first stage, else the activation: an
            ``EncodedActivation`` (decoded on the device) or a float32 array.
          targets: int32 ``(rows, seq)``, or ``(targets, weights)`` with float32 loss weights
          (a loss-masked batch: ``_drive.Batches``), on the last stage only.

        Returns:
          ``(packed, loss)``: the encoded activation to send forward (on the last stage: the
          encoded activation-gradient to send back, ``None`` on a single stage), and the
          micro-batch's loss (a device scalar; ``None`` except on the last stage).
        """
        params = self._weights_for_forward(g)
        x = x if self.first else self.wire_parts(x)
        if self.last:
            loss, self._acc, gx = self._last(params, self.frozen, x, targets, self._acc)
            return gx, loss
        x = jnp.asarray(x) if self.first else x
        packed, kept = self._fwd(params, self.frozen, x)
        self._stash[g] = _Stashed(params, x, kept)
        return packed, None

    def backward(self, g: int, grad: Any) -> Any:
        """Backward of micro-batch ``g`` from the activation-gradient ``grad`` (an
        ``EncodedActivation`` or float32, the activation's shape); returns the encoded gradient
        for the previous stage (``None`` on the first). The last stage's backward ran in its
        forward: returns ``None``."""
        if self.last:
            return None
        st = self._stash.pop(g)
        self._acc, gx = self._bwd(st.params, self.frozen, st.x, st.kept, self.wire_parts(grad), self._acc)
        return gx

    def update(self) -> None:
        """Applies the step's mean gradient (sum over micro-batches / M) with the optimizer."""
        if self.mode in ("2bw", "predict"):
            self._prev = self.params
        self.params, self.opt_state, self._acc, grads = self._update(self.params, self.opt_state, self._acc)
        self.last_grads = grads
        self.version += 1

    def evaluate(self, x: Any, targets: Any = None) -> tuple[Any, Any]:
        """Forward only (no gradient, nothing kept) with the newest weights: ``(packed, None)``
        for the next stage, or ``(None, loss)`` on the last stage (a device scalar)."""
        if self._eval is None:
            stage = self.stage

            def mid(params, frozen, x):
                return self._encode(stage.apply(params, frozen, self._input(x)))

            def last(params, frozen, x, targets):
                return stage.loss(stage.apply(params, frozen, self._input(x)), targets)

            self._eval = (jax.jit(mid), jax.jit(last))
        x = jnp.asarray(x) if self.first else self.wire_parts(x)
        if self.last:
            return None, self._eval[1](self.params, self.frozen, x, targets)
        return self._eval[0](self.params, self.frozen, x), None

    def set_state(self, params: Any, opt_state: Any) -> None:
        """Replaces params and optimizer state (after an outer DiLoCo round or a download);
        weight versions of the asynchronous modes restart from ``params``."""
        self.params, self.opt_state = params, opt_state
        if self._prev is not None:
            self._prev = params

    def reset_step(self) -> None:
        """Drops the micro-batches in flight and the gradient accumulated so far (a step that
        is replayed after a fault)."""
        self._stash.clear()
        self._acc = self._zeros()

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded and not yet backwarded on this stage."""
        return len(self._stash)


def activation_codec_options(codec: str, options: dict | None, width: int) -> dict:
    """The codec options of activations: ``options``, where ``int8`` and ``int4`` without a
    ``block_size`` get one scale per token (``block_size = width``, the hidden width, when it is
    even and at most 65536): the absmax of each token's activation vector scales it, at 2 bytes
    per token (benchmarks/bench_pipeline_quality.py measures it against blocks of 64)."""
    out = dict(options or {})
    if codec in ("int8", "int4") and "block_size" not in out and width % 2 == 0 and 2 <= width <= 1 << 16:
        out["block_size"] = int(width)
    return out


def _source(leaf: Any, p_leaves: list, f_leaves: list, x_in: Any) -> tuple[str, int] | None:
    """Where a residual comes from: ``("p", i)`` the i-th parameter, ``("f", i)`` the i-th
    frozen leaf, ``("x", 0)`` the input, ``None`` computed in the forward (kept)."""
    for i, p in enumerate(p_leaves):
        if leaf is p:
            return ("p", i)
    for i, f in enumerate(f_leaves):
        if leaf is f:
            return ("f", i)
    if leaf is x_in:
        return ("x", 0)
    return None
