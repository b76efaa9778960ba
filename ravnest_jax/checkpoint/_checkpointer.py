"""``rj.Checkpointer``: exact-resume checkpoints of one peer on orbax's ``CheckpointManager``.

Knows optimizer state and sync-driver state (as pytrees); knows nothing of the network.

References:
  Orbax checkpointing, ``orbax.checkpoint.CheckpointManager``:
  https://orbax.readthedocs.io/en/latest/guides/checkpoint/api_refactor.html
"""

from __future__ import annotations

import concurrent.futures
import json
import operator
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import jax
import orbax.checkpoint as ocp

from ravnest_jax.host_memory import release_free_heap

from . import _leaves, _recovery
from ._orbax_fixes import avoid_kvstore_spec_to_json, await_tmp_cleanup, skip_raw_io_metrics
from ._util import CheckpointError as CheckpointError
from ._util import brief as _brief
from ._util import library_version as _library_version
from ._util import lock_directory as _lock_directory
from ._util import orbax_version as _orbax_version
from ._util import positive_int as _positive_int

__all__ = ["CheckpointError", "Checkpointer", "CorruptCheckpointWarning", "NoReadableCheckpointError", "Restored"]

PyTree = Any
T = TypeVar("T")

FORMAT_VERSION = 1
_TREE_ITEMS = ("params", "opt_state", "extra")
_META_ITEM = "meta"


class CorruptCheckpointWarning(UserWarning):
    """A checkpoint step could not be read; :meth:`Checkpointer.restore` fell back to an older one.

    The message names the step, the directory, the error, where the unreadable step was moved
    (``<step>.corrupt``) and the step used instead.
    """


class NoReadableCheckpointError(CheckpointError):
    """No checkpoint of the directory can be read, so a resume would silently start from step 0.

    Raised by :meth:`Checkpointer.restore` when every step fails to read (each was moved to
    ``<step>.corrupt``), and by the :class:`Checkpointer` constructor when a directory holds only
    such quarantined steps. The message is one line naming the steps, where they were moved and
    the way out: ``fresh=True`` (``--fresh`` in the examples and ``ravnest-jax finetune``).
    """


class Restored(NamedTuple):
    """What :meth:`Checkpointer.restore` gives back.

    Attributes:
      step: int, the step of the checkpoint that was restored (the ``step`` given to
        :meth:`Checkpointer.save`).
      params: the local params, in the structure, leaf types and dtypes of the ``params`` target.
      opt_state: the optimizer state (for example a whole ``rj.DiLoCoState``: inner state with
        its schedule count, outer state, global params, counters, codec state), same NamedTuple
        types as the target.
      extra: the ``extra`` pytree (sync-driver state, data position, PRNG keys, ...) in the
        structure and leaf kinds of the ``extra`` target; ``None`` if no target was given.
      metadata: dict, the JSON ``metadata`` given to the :class:`Checkpointer` that saved it.
    """

    step: int
    params: PyTree
    opt_state: PyTree
    extra: PyTree | None
    metadata: dict[str, Any]


class Checkpointer:
    """Saves and restores everything one peer needs for an exact resume, with orbax.

    One :meth:`save` writes, as one atomic orbax checkpoint (``<directory>/<step>/``):

    - ``params``: the local params;
    - ``opt_state``: the whole optimizer state, for ``rj.diloco`` the :class:`rj.DiLoCoState`
      (inner state with its step count, which drives the learning-rate schedule; outer state;
      global params; ``count`` and ``rounds``; codec state with error-feedback residuals);
    - ``extra``: any pytree the training loop needs besides, for example the sync driver's round
      and pending snapshot, the data position and PRNG keys (typed keys from ``jax.random.key``
      are stored as ``key_data`` and re-wrapped on restore; numpy and Python scalars come back
      as the same types);
    - ``meta``: JSON: the ``metadata`` given here (run id, config, ...), the ravnest_jax, orbax
      and jax versions, the save time and a description of every stored leaf (path, kind,
      shape, dtype).

    Saves are asynchronous (``async_save=True``): :meth:`save` dispatches an on-device copy of
    the device arrays (so the caller may donate its buffers to the next step right away) and
    hands the write to a background thread, which runs orbax's ``CheckpointManager.save`` (device
    to host copy, then orbax's own asynchronous commit into a temporary directory that is renamed
    into place when complete) and waits for it. At most one save is in flight: a :meth:`save`
    while the previous one is still being written waits for it. Errors of a background save are
    raised, as :class:`CheckpointError`, by the next :meth:`save`, :meth:`wait` or :meth:`close`;
    they are never swallowed.

    Restore fills *targets* (concrete arrays or ``jax.ShapeDtypeStruct`` trees, for example
    ``jax.eval_shape(tx.init, params)``), so NamedTuple types, dtypes and shardings come back as
    in the target. If the newest checkpoint cannot be read (files truncated or deleted after the
    commit), :meth:`restore` moves it aside to ``<directory>/<step>.corrupt``, uses the previous
    one and warns with :class:`CorruptCheckpointWarning`; if none can be read it raises
    :class:`NoReadableCheckpointError` (one line). Orbax's own log records and tensorstore's late
    callbacks of such failed reads go to the ``ravnest_jax.checkpoint`` logger at DEBUG level,
    not the console. A directory left with only ``<step>.corrupt`` steps is refused by the next
    ``Checkpointer`` (a resume would silently start from step 0) until ``fresh=True``.

    Single process only (one peer = one process); every peer of a swarm has its own directory.

    Attributes:
      set_aside_to: with ``fresh=True``, the folder the earlier checkpoints were moved into
        (a ``pathlib.Path``), or None (nothing to move, or not ``fresh``).

    Example::

        with rj.Checkpointer("ckpt", max_to_keep=3, save_interval_steps=100,
                             metadata={"run_id": "exp1"}) as ckpt:
            r = ckpt.restore(params=params, opt_state=state, extra=extra)
            if r is not None:
                start, params, state, extra = r.step, r.params, r.opt_state, r.extra
            for step in range(start, total):
                params, state = train_step(params, state, batch(step))
                ckpt.save(step + 1, params=params, opt_state=state, extra=extra)

    Args:
      directory: the checkpoint root; created if missing.
      max_to_keep: number of most recent checkpoints kept (int >= 1); older ones are deleted
        after a newer one is committed.
      save_interval_steps: :meth:`save` writes only when ``step % save_interval_steps == 0``
        (or ``force=True``); int >= 1, in steps.
      async_save: write in the background (default). ``False``: :meth:`save` returns after the
        checkpoint is committed.
      metadata: JSON-serialisable dict stored with every checkpoint (run id, config, ...).
      fresh: start from step 0: the directory's earlier checkpoints, readable or not
        (``<step>`` and ``<step>.corrupt``), are moved into ``<directory>/previous-<UTC time>/``
        (nothing is deleted), so :meth:`restore` finds none. Default False: resume from them.

    Raises:
      ValueError: ``max_to_keep`` or ``save_interval_steps`` is not an int >= 1, ``directory``
        is an existing file, or ``metadata`` is not a JSON-serialisable dict.
      CheckpointError: another open Checkpointer (this process or another) holds the directory
        (a lock, ``<directory>/.rj-lock``, released by :meth:`close` or the process' end): two
        writers would corrupt each other's saves.
      NoReadableCheckpointError: without ``fresh``, the directory holds no readable checkpoint,
        only ``<step>.corrupt`` ones (an earlier :meth:`restore` found them unreadable).
      OSError: with ``fresh``, the earlier checkpoints could not be moved.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
        metadata: dict[str, Any] | None = None,
        fresh: bool = False,
    ) -> None:
        self.max_to_keep = _positive_int("max_to_keep", max_to_keep)
        self.save_interval_steps = _positive_int("save_interval_steps", save_interval_steps)
        path = Path(directory).expanduser().absolute()
        if path.exists() and not path.is_dir():
            raise ValueError(f"directory must be a directory, but {str(path)!r} is a file")
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict):
            raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
        try:
            self._user_metadata = json.loads(json.dumps(metadata))
        except (TypeError, ValueError) as e:
            raise ValueError(f"metadata must be JSON-serialisable: {e}") from None
        self.async_save = bool(async_save)
        self._directory = path
        self._lock = _lock_directory(path)
        try:
            self.set_aside_to = _recovery.set_aside(path) if fresh else None
        except BaseException:
            self._lock.close()
            raise
        self._closed = False
        self._pending: concurrent.futures.Future[None] | None = None
        self._pending_step: int | None = None
        # Every call into the orbax manager runs on this one thread, in order. Orbax re-raises a
        # background error once per calling thread, so one thread means each error surfaces once.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rj-checkpoint")
        skip_raw_io_metrics()  # orbax's throughput log query keeps ~30 KB a save (_orbax_fixes)
        avoid_kvstore_spec_to_json()  # tensorstore's to_json leaks ~220 B per array saved (_orbax_fixes)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.max_to_keep,
            save_interval_steps=1,  # the interval is applied in save(); orbax always gets force=True
            enable_async_checkpointing=self.async_save,
            cleanup_tmp_directories=True,  # remove the temporary dirs of saves killed midway
            # Create the step's temporary directory in the blocking phase (on our thread, off the
            # training loop), so that a failure to create it raises at once instead of leaving the
            # background commit waiting for a directory-creation signal until orbax's timeout.
            async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False),
            create=True,
        )
        try:
            with _recovery.quiet_reads():  # a damaged step's metadata: orbax logs an error for each
                self._mngr = self._call(
                    lambda: ocp.CheckpointManager(path, options=options, item_names=(*_TREE_ITEMS, _META_ITEM))
                )
                self._call(lambda: await_tmp_cleanup(self._mngr))  # no orbax thread outlives a refusal
                self._known_steps: set[int] = set(self._call(self._mngr.all_steps))
            bad = [] if self._known_steps else _recovery.quarantined_steps(path)
            if bad:
                raise NoReadableCheckpointError(_recovery.refusal(path, bad))
        except BaseException:
            self._executor.shutdown(wait=False)
            self._lock.close()
            raise

    # ------------------------------------------------------------------------------ plumbing
    def _call(self, fn: Callable[[], T]) -> T:
        return self._executor.submit(fn).result()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Checkpointer is closed")

    @property
    def directory(self) -> Path:
        """The checkpoint root directory (absolute)."""
        return self._directory

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Checkpointer({str(self._directory)!r}, max_to_keep={self.max_to_keep}, "
            f"save_interval_steps={self.save_interval_steps}, async_save={self.async_save})"
        )

    # ---------------------------------------------------------------------------------- save
    def save(
        self,
        step: int,
        *,
        params: PyTree,
        opt_state: PyTree,
        extra: PyTree | None = None,
        force: bool = False,
    ) -> bool:
        """Saves one checkpoint at ``step`` (asynchronously by default).

        Returns quickly: with ``async_save`` it dispatches a jitted on-device copy of the device
        leaves (not waiting for the computation that produces them) and queues the write. If the
        previous save is still being written, waits for it first.

        Args:
          step: int >= 0, usually the number of inner steps taken; the directory name.
          params: the local params (pytree of arrays).
          opt_state: the optimizer state, for example an ``rj.DiLoCoState``.
          extra: optional pytree of jax arrays (typed PRNG keys included), numpy arrays or
            scalars, Python int/float/bool: sync-driver state, data position, keys, ...
          force: save even if ``step`` is not a multiple of ``save_interval_steps``.

        Returns:
          True if a save was started; False if skipped (``step`` is not a multiple of
          ``save_interval_steps`` and not ``force``, or a checkpoint for ``step`` already exists
          or is being written).

        Raises:
          CheckpointError: the previous background save failed (raised here, once), or, with
            ``async_save=False``, this save failed.
          TypeError: a leaf cannot be checkpointed (for example a string).
          ValueError: ``step`` is negative.
          RuntimeError: the checkpointer is closed.
        """
        self._check_open()
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not force and step % self.save_interval_steps != 0:
            return False
        if self._pending is not None and self._pending.done():
            self.wait()  # a finished save's error surfaces here, before anything is skipped
        if step in self._known_steps:
            return False
        trees = {"params": params, "opt_state": opt_state, "extra": extra}
        described = {name: _leaves.describe(tree) for name, tree in trees.items() if tree is not None}
        meta = {
            "format": FORMAT_VERSION,
            "step": step,
            "saved_at_unix": time.time(),
            "ravnest_jax_version": _library_version(),
            "orbax_version": _orbax_version(),
            "jax_version": jax.__version__,
            "metadata": self._user_metadata,
            "trees": {name: ({"leaves": described[name][1]} if name in described else None) for name in _TREE_ITEMS},
        }
        # orbax cannot store an empty tree; an empty tree's structure lives in the target
        names = [name for name, (_, records, _) in described.items() if records]
        encoded = _leaves.encode([(trees[name], described[name][1]) for name in names], copy_device=self.async_save)
        items: dict[str, Any] = {name: ocp.args.StandardSave(enc) for name, enc in zip(names, encoded)}
        items[_META_ITEM] = ocp.args.JsonSave(meta)
        args = ocp.args.Composite(**items)
        self.wait()  # back-pressure: one save in flight; raises a previous failure
        self._known_steps.add(step)
        self._pending = self._executor.submit(self._write, step, args)
        self._pending_step = step
        if not self.async_save:
            self.wait()
        return True

    def _write(self, step: int, args: ocp.args.Composite) -> None:
        # Runs on the checkpoint thread: orbax's blocking phase (device -> host copy, directory
        # creation) and then its commit (write to a temporary directory, rename into place).
        self._mngr.save(step, args=args, force=True)
        self._mngr.wait_until_finished()
        # the host copy of the whole state is freed in pieces across allocator arenas; give
        # them back, or a long run's RSS creeps up save after save (docs/checkpointing.md)
        release_free_heap()

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is committed.

        Raises:
          CheckpointError: that save failed (names the step and the directory; the orbax error
            is the ``__cause__``).
        """
        fut, step = self._pending, self._pending_step
        if fut is None:
            return
        self._pending, self._pending_step = None, None
        try:
            fut.result()
        except Exception as e:
            self._known_steps.discard(step)  # type: ignore[arg-type]
            raise CheckpointError(
                f"saving checkpoint step {step} to {self._directory} failed: {type(e).__name__}: {e}"
            ) from e

    def close(self) -> None:
        """Waits for the last save, then releases orbax's resources. Idempotent.

        Raises:
          CheckpointError: the last save failed (resources are released anyway).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            try:
                self._call(self._mngr.close)
            finally:
                self._executor.shutdown(wait=True)
                self._lock.close()  # releases the directory

    # ------------------------------------------------------------------------------- queries
    def all_steps(self) -> list[int]:
        """Steps of the committed checkpoints in the directory, ascending (waits for a save in
        flight; raises its error as :class:`CheckpointError`)."""
        self._check_open()
        self.wait()

        def steps() -> list[int]:
            with _recovery.quiet_reads():
                self._mngr.reload()
                return sorted(self._mngr.all_steps())

        return self._call(steps)

    def saved_steps(self) -> list[int]:
        """Steps saved by this checkpointer or found on disk, ascending, the newest
        ``max_to_keep``, without waiting: the newest may still be being written (use
        :meth:`all_steps` for the committed ones). Cheap enough for every save in a training
        loop, for example to publish them (``Swarm.set_info``)."""
        return sorted(self._known_steps)[-self.max_to_keep :]

    def latest_step(self) -> int | None:
        """The newest committed step, or None if the directory has no checkpoint (waits for a
        save in flight). The newest may still be unreadable; :meth:`restore` checks that."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _read_meta(self, step: int) -> dict[str, Any]:
        def read() -> Any:
            with _recovery.quiet_reads():
                return self._mngr.restore(step, args=ocp.args.Composite(**{_META_ITEM: ocp.args.JsonRestore()}))

        restored = self._call(read)
        meta = restored[_META_ITEM]
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or "trees" not in meta:
            raise CheckpointError(f"step {step}: 'meta' is not a ravnest_jax checkpoint description")
        return meta

    def metadata(self, step: int | None = None) -> dict[str, Any] | None:
        """The JSON description stored with a checkpoint (latest by default).

        Returns:
          None if there is no checkpoint; else a dict with ``"metadata"`` (the dict given to the
          constructor), ``"step"``, ``"saved_at_unix"`` (seconds), ``"ravnest_jax_version"``,
          ``"orbax_version"``, ``"jax_version"`` and ``"trees"`` (per item, the stored leaves:
          path, kind, shape, dtype).

        Raises:
          CheckpointError: that step's description cannot be read.
          FileNotFoundError: ``step`` is given and has no checkpoint.
        """
        steps = self.all_steps()
        if step is None:
            if not steps:
                return None
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self._directory}; steps: {steps}")
        try:
            return self._read_meta(step)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read checkpoint step {step} in {self._directory}: {e}") from e

    # ------------------------------------------------------------------------------- restore
    def restore(
        self,
        step: int | None = None,
        *,
        params: PyTree,
        opt_state: PyTree,
        extra: PyTree | None = None,
    ) -> Restored | None:
        """Restores a checkpoint into abstract targets (latest readable one by default).

        Args:
          step: the step to restore; None means the newest checkpoint that can be read (an
            unreadable newer one is moved to ``<directory>/<step>.corrupt``, skipped and, once
            an older one was read, reported with :class:`CorruptCheckpointWarning`).
          params: target for the params: a pytree of arrays or ``jax.ShapeDtypeStruct`` (from
            ``jax.eval_shape``); restored arrays get the target's dtype and sharding (a
            ShapeDtypeStruct without sharding means the first device).
          opt_state: target for the optimizer state (for example ``tx.init(params)`` or
            ``jax.eval_shape(tx.init, params)``); NamedTuple types come from it.
          extra: target for ``extra`` (typed PRNG keys, numpy/Python scalars and arrays come
            back as the same kinds); None: ``extra`` is not restored.

        Returns:
          A :class:`Restored`, or None if the directory has no checkpoint.

        Raises:
          ValueError: a target does not match what was saved (leaf paths, shapes, or key vs
            array), or ``extra`` is given but the checkpoint has none. Not treated as corruption.
          FileNotFoundError: ``step`` is given and has no checkpoint.
          CheckpointError: the given ``step`` cannot be read.
          NoReadableCheckpointError: ``step`` is None and no checkpoint can be read (each was
            moved to ``<step>.corrupt``; one line, no per-step warnings).
        """
        targets = {"params": params, "opt_state": opt_state, "extra": extra}
        steps = self.all_steps()
        if not steps:
            return None
        if step is not None:
            step = operator.index(step)
            if step not in steps:
                raise FileNotFoundError(f"no checkpoint for step {step} in {self._directory}; steps: {steps}")
            try:
                return self._restore_step(step, targets)
            except _Unreadable as e:
                raise CheckpointError(
                    f"checkpoint step {step} in {self._directory} cannot be read: {_brief(e.__cause__)}"
                ) from e.__cause__
        candidates = sorted(steps, reverse=True)
        errors: list[tuple[int, BaseException, str]] = []
        for s in candidates:
            try:
                restored = self._restore_step(s, targets)
            except _Unreadable as e:
                errors.append((s, e.__cause__, self._quarantine(s)))  # type: ignore[arg-type]
                continue
            for bad, cause, moved in errors:  # told once an older step was read: one line each
                warnings.warn(
                    f"checkpoint step {bad} in {self._directory} is partial or corrupt and was skipped "
                    f"({_brief(cause)}); moved to {moved}; resumed from step {s} instead",
                    CorruptCheckpointWarning,
                    stacklevel=2,
                )
            return restored
        raise NoReadableCheckpointError(
            _recovery.all_unreadable(self._directory, [(s, _brief(c), m) for s, c, m in errors])
        ) from errors[0][1]

    def _quarantine(self, step: int) -> str:
        def move() -> str:
            src = self._directory / str(step)
            dst = self._directory / f"{step}.corrupt"
            n = 1
            while dst.exists():
                dst = self._directory / f"{step}.corrupt.{n}"
                n += 1
            try:
                src.rename(dst)
            except OSError as e:  # keep going with the older steps
                return f"(not moved: {e})"
            with _recovery.quiet_reads():
                self._mngr.reload()
            return str(dst)

        out = self._call(move)
        self._known_steps.discard(step)
        return out

    def _restore_step(self, step: int, targets: dict[str, PyTree]) -> Restored:
        try:
            meta = self._read_meta(step)
        except Exception as e:
            raise _Unreadable() from e
        trees = meta["trees"]
        items: dict[str, Any] = {}
        plan: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
        for name in _TREE_ITEMS:
            target = targets[name]
            if target is None:
                continue
            saved = trees.get(name)
            if saved is None:
                raise ValueError(f"checkpoint step {step} has no {name!r}, but a target was given")
            abstract, records = _leaves.abstract(target, saved["leaves"], name)
            plan[name] = (records, saved["leaves"])
            if records:
                items[name] = ocp.args.StandardRestore(abstract)

        def read() -> Any:
            with _recovery.quiet_reads():
                return self._mngr.restore(step, args=ocp.args.Composite(**items))

        try:
            restored = self._call(read) if items else {}
            out: dict[str, Any] = {}
            for name, (records, saved_leaves) in plan.items():
                if records:
                    out[name] = _leaves.decode(restored[name], targets[name], records, saved_leaves)
                else:
                    out[name] = targets[name]
        except Exception as e:
            raise _Unreadable() from e
        return Restored(
            step=int(meta["step"]),
            params=out["params"],
            opt_state=out["opt_state"],
            extra=out.get("extra"),
            metadata=meta.get("metadata", {}),
        )


class _Unreadable(Exception):
    """Internal: a step's files could not be read (the cause is the orbax/tensorstore error)."""
