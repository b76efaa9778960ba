"""Workarounds for orbax's and tensorstore's per-save memory growth in a long-running peer.

1. Each orbax array save asks tensorstore for its process-wide kvstore byte counters
   (``ts.experimental_collect_matching_metrics``) before and after writing, only to log a raw
   throughput line at INFO level. The collected metric objects are kept alive: measured with
   ``tracemalloc`` (orbax-checkpoint 0.12, tensorstore 0.1), 200 saves of a 2 MB state grew the
   Python heap by 5.4 MB, about 28 KB a save, or some 12 MB an hour for a peer saving every 10
   seconds. :func:`skip_raw_io_metrics` makes that query return ``None``, which orbax already
   treats as "no metric" (it skips the log line); nothing else reads it.
2. ``tensorstore.KvStore.Spec.to_json()`` leaks one reference to every string of the JSON it
   returns (tensorstore 0.1.86: about 220 bytes a call for a ``{"driver": "file", "path": ...}``
   spec, never freed). Orbax calls it once per saved array (and a few times more per item, when
   it merges the OCDBT files) only to look at the local base spec, so a save of a state of N
   arrays kept about N x 220 bytes: 28 KB a save of a 125-array state, linear forever
   (``tracemalloc``: all of the Python heap a save kept was allocated on that line). Python's
   allocator put the leaked strings in fresh pages, so RSS grew with them.
   :func:`avoid_kvstore_spec_to_json` answers that call in Python for the plain local-file spec
   orbax builds (the answer is the spec itself; tensorstore still parses and validates it).

And one that is not about memory:

3. With ``cleanup_tmp_directories``, orbax's ``CheckpointManager`` starts removing the temporary
   directories of unfinished saves in a background thread when it opens, and waits for that
   thread only in its first ``save`` (``close`` does not). A process that exits before saving
   (a directory refused because it holds only unreadable checkpoints, a restore-only tool) could
   end while the thread still walked the directory: at interpreter exit its
   ``asyncio.to_thread`` raised "cannot schedule new futures after shutdown", which orbax logged
   as an ERROR with a 40-line traceback (seen once in CI, under load, after the one-line
   refusal). :func:`await_tmp_cleanup` waits for that thread right after the manager opens.
"""

from __future__ import annotations

import threading
import types
from typing import Any

_lock = threading.Lock()
_done = False
_spec_shim_done = False


def skip_raw_io_metrics() -> bool:
    """Turns off orbax's raw-bytes IO metric query (see the module docstring), once per process.

    Returns:
      True if orbax has the query and it is now off; False if this orbax has no such function
      (then nothing is changed).
    """
    global _done
    with _lock:
        if _done:
            return True
        try:
            from orbax.checkpoint._src.serialization import tensorstore_utils
        except ImportError:  # pragma: no cover - another orbax layout
            return False
        if not callable(getattr(tensorstore_utils, "get_tensorstore_raw_bytes", None)):  # pragma: no cover
            return False

        def no_raw_bytes(*args, **kwargs):
            return None

        tensorstore_utils.get_tensorstore_raw_bytes = no_raw_bytes
        _done = True
        return True


def plain_file_spec(json_spec: Any) -> dict[str, str] | None:
    """``json_spec`` as a new dict if it is a plain local-file kvstore spec (exactly the keys
    ``driver`` = ``"file"`` and ``path``, a string), else None."""
    if (
        type(json_spec) is dict
        and json_spec.keys() == {"driver", "path"}
        and json_spec["driver"] == "file"
        and type(json_spec["path"]) is str
    ):
        return {"driver": "file", "path": json_spec["path"]}
    return None


class _FileSpec:
    """A ``tensorstore.KvStore.Spec`` of a plain local-file spec whose ``to_json()`` is answered
    in Python (what tensorstore returns for it, without the leak); everything else is the real
    spec's."""

    __slots__ = ("_json", "spec")

    def __init__(self, spec: Any, json_spec: dict[str, str]):
        self.spec, self._json = spec, json_spec

    def to_json(self, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:  # include_defaults and friends: tensorstore's own answer
            return self.spec.to_json(*args, **kwargs)
        return dict(self._json)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.spec, name)

    def __repr__(self) -> str:
        return repr(self.spec)


def _real(spec: Any) -> Any:
    return spec.spec if isinstance(spec, _FileSpec) else spec


class _KvStore:
    """``tensorstore.KvStore`` for orbax's tensorstore helpers: ``Spec`` of a plain local-file
    spec is a :class:`_FileSpec`, which ``open`` takes like the real spec."""

    def __init__(self, real: Any):
        self._real = real

    def Spec(self, json_spec: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - tensorstore's name
        spec = self._real.Spec(json_spec, *args, **kwargs)  # parses and validates, as before
        plain = None if args or kwargs else plain_file_spec(json_spec)
        if plain is None or spec.path != plain["path"]:
            return spec
        return _FileSpec(spec, plain)

    def open(self, spec: Any, *args: Any, **kwargs: Any) -> Any:
        return self._real.open(_real(spec), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Tensorstore(types.ModuleType):
    """The ``tensorstore`` module as orbax's tensorstore helpers see it: itself, but for
    ``KvStore`` (:class:`_KvStore`)."""

    def __init__(self, real: types.ModuleType):
        super().__init__(real.__name__, real.__doc__)
        self._rj_real = real
        self.KvStore = _KvStore(real.KvStore)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rj_real, name)


def avoid_kvstore_spec_to_json() -> bool:
    """Stops orbax's per-array ``KvStore.Spec.to_json()`` call from leaking (see the module
    docstring), once per process: orbax's tensorstore helpers get a ``tensorstore`` whose
    ``KvStore.Spec`` answers ``to_json()`` of a plain local-file spec in Python. Other specs
    (cloud storage, extra options) go to tensorstore as before.

    Returns:
      True if the helpers now use it; False if this orbax has no such helpers (then nothing is
      changed).
    """
    global _spec_shim_done
    with _lock:
        if _spec_shim_done:
            return True
        try:
            from orbax.checkpoint._src.serialization import tensorstore_utils
        except ImportError:  # pragma: no cover - another orbax layout
            return False
        real = getattr(tensorstore_utils, "ts", None)
        if not isinstance(real, types.ModuleType) or not hasattr(real, "KvStore"):  # pragma: no cover
            return False
        if not isinstance(real, _Tensorstore):
            tensorstore_utils.ts = _Tensorstore(real)
        _spec_shim_done = True
        return True


def await_tmp_cleanup(manager: Any) -> bool:
    """Waits until ``manager`` (an ``ocp.CheckpointManager``) has removed the temporary
    directories of unfinished saves it found when it opened (see the module docstring, 3).
    Re-raises what that cleanup raised.

    Returns:
      True if it waited; False if this orbax keeps no such background cleanup (nothing to do).
    """
    wait = getattr(manager, "_maybe_await_cleanup_tmp_directory", None)
    if wait is None:  # pragma: no cover - another orbax version
        return False
    wait()
    return True
