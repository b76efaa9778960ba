"""flax nnx models and optimizers as the driver's ``(params, state)`` pair.

An ``nnx.Optimizer(model, rj.diloco(...), wrt=nnx.Param)`` holds a :class:`rj.DiLoCoState` whose
leaves are wrapped in nnx variables (``OptVariable``), while ``nnx.state(model, nnx.Param)`` holds
``Param`` variables: two pytrees of different structure over the same arrays. The driver works on
the plain arrays (``nnx.as_pure``) and writes its results back into the model and optimizer in
place, so an nnx training loop reads ``sync(model, optimizer)`` with the same guarantees as the
pytree loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from ravnest_jax.optim import DiLoCoState


def is_optimizer(obj: Any) -> bool:
    """True for an ``nnx.Optimizer`` (the driver then takes ``(model, optimizer)``)."""
    return isinstance(obj, nnx.Optimizer)


def split(model: nnx.Module, optimizer: nnx.Optimizer) -> tuple[Any, Any]:
    """``(params, state)`` as plain arrays: the model's ``optimizer.wrt`` variables (an
    ``nnx.State`` of arrays) and the optimizer's :class:`rj.DiLoCoState` (same structure for its
    params-shaped parts).

    Raises:
      TypeError: ``model`` is not an ``nnx.Module`` or the optimizer's state is not a
        ``DiLoCoState`` (the optimizer was not built with ``rj.diloco``).
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"with an nnx.Optimizer, pass the nnx model first: got {type(model).__name__}")
    state = nnx.as_pure(optimizer.opt_state)
    if not isinstance(state, DiLoCoState):
        raise TypeError(
            f"the nnx.Optimizer's state is {type(state).__name__}, not a DiLoCoState: build it as "
            "nnx.Optimizer(model, rj.diloco(inner_tx, ...), wrt=nnx.Param)"
        )
    return nnx.as_pure(nnx.state(model, optimizer.wrt)), state


def write_back(model: nnx.Module, optimizer: nnx.Optimizer, params: Any, state: Any, *, step: bool = False) -> None:
    """Writes ``(params, state)`` (from :func:`split`, after the driver's work) into the model's
    variables and the optimizer's state, in place. ``step``: also set the optimizer's own step
    counter to ``state.count`` (after a state download or a checkpoint restore)."""
    nnx.update(model, params)

    def put(var: Any, value: Any) -> None:
        if isinstance(var, nnx.Variable):
            var.set_value(value)

    jax.tree.map(put, optimizer.opt_state, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if step:
        optimizer.step.set_value(state.count.astype(optimizer.step.get_value().dtype))


def through(
    fn: Callable[[Any, Any], tuple], model: nnx.Module, optimizer: nnx.Optimizer, *, step: bool = False
) -> tuple:
    """``fn(params, state) -> (params, state)`` on the arrays of ``model`` and ``optimizer``
    (:func:`split`), its results written back into them (:func:`write_back` with ``step``);
    returns ``(model, optimizer)``."""
    write_back(model, optimizer, *fn(*split(model, optimizer)), step=step)
    return model, optimizer
