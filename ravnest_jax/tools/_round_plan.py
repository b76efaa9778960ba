"""``ravnest-jax plan``: what a link needs before a day is spent finding out.

From the model's parameter count, the codec, the number of peers, the link (Mbit/s up and
down, RTT) and the inner step time, predict for a range of H (inner steps per round): the bytes
each peer sends per round, the round's time, the overlap tau (steps) that hides it, and the
compute utilisation blocking and overlapped; then recommend H, codec, tau and fragments.

The model of a round is the one ``benchmarks/bench_utilization.py`` measured (a butterfly
all-reduce over throttled TCP links, :data:`CALIBRATION` fitted from its cells by
:func:`calibrate`):

- bytes: every peer sends and receives ``2 (n - 1) / n`` of the codec's message of the whole
  vector (the reduce-scatter parts, then the all-gather results), exact from the wire format;
- round time ``T = c_round + k_rtt * RTT + bytes * 8 / min(up, down) + codec``: a fixed cost
  (request handling, the rendezvous' begin and vote exchanges, the pseudo-gradient's copies),
  ``k_rtt`` round trips (begin, two votes, two data phases), the transfer at the slower
  direction's rate, and the host's encode and decode time (measured on this machine for the
  codec, per parameter, unless given);
- a round window of ``H`` steps takes ``H * t_step + stall + overhead``: blocking stalls ``T``;
  an overlap of ``tau`` steps stalls ``max(0, T - tau * t_step)``; ``F`` fragments run ``F``
  rounds of ``1/F`` of the vector per window; ``overhead`` is the measured host cost of a
  round's ``sync`` calls (per mode family). Utilisation = ``H * t_step`` over the window.
- data-parallel training, for comparison: an fp32 all-reduce of the gradient after every step,
  not overlapped (``t / (t + T_dp)``).

References: DiLoCo, https://arxiv.org/abs/2311.08105; Streaming DiLoCo (fragments, overlap),
https://arxiv.org/abs/2501.18512.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from ravnest_jax.compress import CODECS as WIRE_CODECS
from ravnest_jax.compress import DEFAULT_BLOCK_SIZE, DEFAULT_TOPK_FRACTION, payload_nbytes

__all__ = [
    "CALIBRATION",
    "Calibration",
    "RoundPlan",
    "PlanRow",
    "calibrate",
    "codec_seconds_per_param",
    "message_bytes",
    "plan_rounds",
    "predict_utilisation",
    "validate",
]

CODECS = ("fp32", "bf16", "int8", "int4")
"""The codecs a plan recommends among (most precise first)."""
PLAN_CODECS = (*CODECS, "int2", "sign")
"""The codecs a plan predicts for (``codec=`` and ``mean_codec=``). The coarse two (2 bits, 1 bit
a value) are never recommended: they need error feedback and enough rounds to stay close to fp32
(docs/algorithm.md), a choice the link alone cannot make."""
DEFAULT_H = (10, 25, 50, 100, 200, 500, 1000)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Constants of the round model (seconds unless noted), from :func:`calibrate`.

    Attributes:
      c_round: fixed cost of one DiLoCo round's exchange.
      k_rtt: round trips one round (or one data-parallel all-reduce) costs.
      c_dp: fixed cost of one data-parallel all-reduce.
      overhead: host cost of a round's ``sync`` calls per mode family (``blocking``,
        ``delayed``, ``eager``, ``fragments``; the last per fragment round).
      codec_s_per_param: encode + decode seconds per parameter of the calibration host, by codec.
      source: what it was fitted from.
    """

    c_round: float
    k_rtt: float
    c_dp: float
    overhead: dict[str, float]
    codec_s_per_param: dict[str, float]
    source: str = ""


# fitted by calibrate() from benchmarks/results/utilization.json (2 peers, 0.86M params, int4,
# H=50, 0.15 s steps, 16 links of 10-1000 Mbit/s and 0-200 ms); see docs/planning.md
CALIBRATION = Calibration(
    c_round=0.1219,
    k_rtt=2.312,
    c_dp=0.0244,
    overhead={"blocking": 0.219, "delayed": 0.1265, "eager": 0.1266, "fragments": 0.0627},
    # int2 and sign: int4's constant times their ratio to int4 measured on this project's
    # 2-core VM on 2026-12-04 (codec_seconds_per_param: 5.8, 5.1 and 3.85 ns: 1.51, 1.34)
    codec_s_per_param={
        "fp32": 4.0e-9,
        "bf16": 8.5e-9,
        "int8": 11.4e-9,
        "int4": 15.0e-9,
        "int2": 22.7e-9,
        "sign": 20.1e-9,
    },
    source="benchmarks/results/utilization.json",
)


def default_cap(sync_every: int) -> int:
    """The default cap of ``overlap_steps="auto"``: the largest tau within ``OuterSync``'s
    default staleness budget (1 % eval loss), below H."""
    from ravnest_jax._staleness import overlap_cap

    return overlap_cap(sync_every, sync_every, 0.01)


def message_bytes(params: int, codec: str, block_size: int | None = None) -> int:
    """Bytes of the codec's message of a float32 vector of ``params`` elements (payload; the
    header's few hundred bytes left out). ``block_size``: of a block codec (values per bf16
    scale; default the codec's, 64 for int8/int4/int2/sign); ignored by the others.

    Raises:
      ValueError: an unknown codec.
    """
    if codec not in WIRE_CODECS:
        raise ValueError(f"unknown codec {codec!r}")
    k = max(1, math.ceil(params * DEFAULT_TOPK_FRACTION))
    default = DEFAULT_BLOCK_SIZE.get(codec, 0)
    return payload_nbytes(codec, int(params), default if block_size is None or not default else block_size, k)


def codec_seconds_per_param(codec: str, size: int = 1 << 21, repeats: int = 3) -> float:
    """Encode + decode seconds per parameter of ``codec`` on this host (the swarm's own codec on
    a float32 vector of ``size`` elements; best of ``repeats``)."""
    from ravnest_jax.swarm import decode_part, encode_part

    v = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        decode_part(encode_part("p", v, codec), name="p", length=size, codec=codec)
        best = min(best, time.perf_counter() - t0)
    return best / size


def _transfer_s(nbytes: float, peers: int, mbit: float) -> float:
    return 2 * (peers - 1) / peers * nbytes * 8 / (mbit * 1e6)


def pair_bytes(params: int, codec: str, mean_codec: str | None = None, block_size: int | None = None) -> float:
    """The bytes of "one message of the whole vector" when the contributions go in ``codec`` and
    the mean comes back in ``mean_codec`` (default: ``codec``): the average of the two messages,
    since a peer sends half its traffic as parts and half as results."""
    down = codec if mean_codec is None else mean_codec
    return (message_bytes(params, codec, block_size) + message_bytes(params, down, block_size)) / 2


def round_seconds(
    params: int,
    codec: str,
    peers: int,
    mbit: float,
    rtt_s: float,
    cal: Calibration,
    codec_s: float | None = None,
    mean_codec: str | None = None,
    block_size: int | None = None,
) -> float:
    """Predicted seconds of one round's exchange (see the module docstring). ``codec_s``:
    encode + decode seconds per parameter (default: the calibration's, the mean of the pair's);
    ``block_size``: of the block codecs (default: each codec's)."""
    down = codec if mean_codec is None else mean_codec
    if codec_s is None:
        codec_s = (cal.codec_s_per_param.get(codec, 0.0) + cal.codec_s_per_param.get(down, 0.0)) / 2
    wire = _transfer_s(pair_bytes(params, codec, mean_codec, block_size), peers, mbit)
    return cal.c_round + cal.k_rtt * rtt_s + wire + params * codec_s


def dp_step_seconds(params: int, peers: int, mbit: float, rtt_s: float, cal: Calibration) -> float:
    """Predicted seconds of one data-parallel fp32 all-reduce of the gradient."""
    return cal.c_dp + cal.k_rtt * rtt_s + _transfer_s(4 * params, peers, mbit)


def predict_utilisation(
    mode: str,
    *,
    params: int,
    codec: str,
    peers: int,
    mbit: float,
    rtt_s: float,
    step_s: float,
    sync_every: int,
    tau: int | str = 0,
    fragments: int = 1,
    max_tau: int | None = None,
    cal: Calibration = CALIBRATION,
    codec_s: float | None = None,
    mean_codec: str | None = None,
    block_size: int | None = None,
) -> tuple[float, float, int]:
    """``(utilisation, round seconds, tau)`` of one configuration.

    Args:
      mode: ``"blocking"``, ``"delayed"``, ``"eager"`` or ``"data_parallel"``.
      tau: overlap steps, or ``"auto"`` (``ceil(1.25 * round / step)`` steps, at most
        ``max_tau``, default the cap of the default staleness budget, as
        ``OuterSync(overlap_steps="auto")``: ``ravnest_jax._staleness.overlap_cap``).
      fragments: rounds per window, each of ``1/fragments`` of the vector.
      mean_codec: the codec of the mean (default: ``codec``; see :func:`pair_bytes`).
      block_size: of the block codecs (default: each codec's).
    """
    if mode == "data_parallel":
        s = dp_step_seconds(params, peers, mbit, rtt_s, cal)
        return step_s / (step_s + s), s, 0
    if mode not in ("blocking", "delayed", "eager"):
        raise ValueError(f"unknown mode {mode!r}")
    f = max(1, int(fragments))
    t_round = round_seconds(math.ceil(params / f), codec, peers, mbit, rtt_s, cal, codec_s, mean_codec, block_size)
    cap = default_cap(sync_every) if max_tau is None else max_tau
    cap = max(1, min(cap, sync_every // f - 1))  # tau < the steps between round starts
    if mode == "blocking":
        steps = 0
    elif tau == "auto":  # as OuterSync's AutoTau: 1.25 x the exchange, in steps
        steps = min(max(1, math.ceil(1.25 * t_round / step_s)), cap)
    else:
        steps = int(tau)
    stall = max(0.0, t_round - steps * step_s)
    family = "fragments" if f > 1 else mode
    window = sync_every * step_s
    return window / (window + f * (stall + cal.overhead[family])), t_round, steps


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One H of a plan: ``sync_every`` (H, steps), ``bytes_per_round`` (each peer sends, and
    receives, bytes), ``round_s`` (seconds), ``tau`` (overlap steps that hide the round, as
    ``overlap_steps="auto"`` would choose them: ``ceil(1.25 * round_s / step_s)``),
    ``tau_within_cap`` (``tau <=`` the default cap, :func:`default_cap`), ``utilisation_blocking``,
    ``utilisation`` (overlapped with ``min(tau, cap)``), ``mbytes_per_hour`` (sent per
    peer per hour of wall time, overlapped: stalls included)."""

    sync_every: int
    bytes_per_round: int
    round_s: float
    tau: int
    tau_within_cap: bool
    utilisation_blocking: float
    utilisation: float
    mbytes_per_hour: float


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """What :func:`plan_rounds` predicts: ``rows`` (one :class:`PlanRow` per H, for the codec
    asked), ``data_parallel`` utilisation and bytes per step, and the recommendation
    (``sync_every``, ``codec``, ``overlap_steps``, ``fragments``, ``utilisation``, ``why``)."""

    inputs: dict[str, Any]
    rows: list[PlanRow]
    data_parallel: dict[str, float]
    recommendation: dict[str, Any]

    def table(self) -> str:
        """The rows as a fixed-width text table."""
        head = f"{'H':>6} {'MB/round':>10} {'round s':>8} {'tau':>6} {'blocking':>9} {'overlapped':>11} {'MB/hour':>9}"
        lines = [head]
        for r in self.rows:
            tau = str(r.tau) + ("" if r.tau_within_cap else "*")
            lines.append(
                f"{r.sync_every:>6} {r.bytes_per_round / 1e6:>10.2f} {r.round_s:>8.2f} {tau:>6} "
                f"{100 * r.utilisation_blocking:>8.1f}% {100 * r.utilisation:>10.1f}% {r.mbytes_per_hour:>9.1f}"
            )
        if any(not r.tau_within_cap for r in self.rows):
            lines.append(
                "* tau needed exceeds the default cap (0.116 H: overlap_steps='auto' caps it there for a 1% "
                "staleness budget; the rest stalls)"
            )
        return "\n".join(lines)


PLAN_BLOCK_CODECS = tuple(c for c in PLAN_CODECS if c in DEFAULT_BLOCK_SIZE)
"""The planned codecs with blocks (a bf16 scale per ``block_size`` values): int8, int4, int2, sign."""


def check_codecs(codec: str, mean_codec: str | None = None, block_size: int | None = None) -> None:
    """The codecs and block size of a plan checked as ``rj.Swarm`` would check them.

    Raises:
      ValueError: a codec that is not in :data:`PLAN_CODECS`, a mean codec of its own that does
        not pair with ``codec`` (both must be in :data:`PLAN_BLOCK_CODECS`), a block size with a
        codec without blocks or one the codec cannot take.
    """
    for name, c in (("codec", codec), ("mean_codec", codec if mean_codec is None else mean_codec)):
        if c not in PLAN_CODECS:
            raise ValueError(f"{name} must be one of {', '.join(PLAN_CODECS)}, got {c!r}")
    blocks = ", ".join(PLAN_BLOCK_CODECS)
    if mean_codec is not None and mean_codec != codec:
        if codec not in PLAN_BLOCK_CODECS or mean_codec not in PLAN_BLOCK_CODECS:
            raise ValueError(
                f"mean_codec {mean_codec} with codec {codec}: a mean codec of its own pairs block codecs only ({blocks})"
            )
    if block_size is not None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if codec not in PLAN_BLOCK_CODECS:
            raise ValueError(f"block_size applies to block codecs ({blocks}), not {codec!r}")
        from ravnest_jax.swarm import check_codec

        for c in {codec, codec if mean_codec is None else mean_codec}:
            check_codec(c, {"block_size": block_size})  # ValueError: one the codec cannot take


def plan_rounds(
    params: int,
    *,
    codec: str = "int4",
    mean_codec: str | None = None,
    block_size: int | None = None,
    peers: int = 2,
    mbit_up: float,
    mbit_down: float | None = None,
    rtt_ms: float = 50.0,
    step_s: float,
    sync_every: tuple[int, ...] = DEFAULT_H,
    target: float = 0.95,
    cal: Calibration = CALIBRATION,
    codec_s: dict[str, float] | None = None,
) -> RoundPlan:
    """Predicts rounds on a link and recommends H, codec, tau and fragments.

    Args:
      params: parameters exchanged (the trained ones: adapters only with LoRA), int > 0.
      codec: the codec of the rows' contributions (:data:`PLAN_CODECS`: ``fp32``, ``bf16``,
        ``int8``, ``int4``, ``int2``, ``sign``).
      mean_codec: the codec of the rows' mean (default ``codec``); another one must pair with
        ``codec`` as ``rj.Codec(mean=...)`` requires (both block codecs, e.g. ``sign`` up
        and ``int2`` down, the 1000x mode of docs/algorithm.md).
      block_size: values per scale of the rows' block codecs (default: each codec's, 64; the
        1000x mode uses 512). The recommendation keeps each codec's default.
      peers: peers in a round (int >= 2).
      mbit_up, mbit_down: the link's rates, Mbit/s (down defaults to up).
      rtt_ms: round-trip time between peers (and to the rendezvous), milliseconds.
      step_s: one inner step, seconds.
      sync_every: the H values of the rows.
      target: the utilisation the recommendation aims for (0..1).
      cal: the model's constants.
      codec_s: encode + decode seconds per parameter by codec (default: the calibration
        host's; ``ravnest-jax plan`` measures this host's).

    Returns:
      A :class:`RoundPlan`. The recommendation is the smallest H (fewest inner steps between
      rounds: closest to synchronous training) that reaches ``target`` with tau <= the default cap; among
      codecs that reach it at that H, the most precise; fragments when they let a smaller H
      reach it. Without any, the configuration of the highest utilisation.

    Raises:
      ValueError: a value out of range (one line naming it).
    """
    if not isinstance(params, int) or params <= 0:
        raise ValueError(f"params must be a positive int, got {params!r}")
    if not isinstance(peers, int) or peers < 2:
        raise ValueError(f"peers must be an int >= 2, got {peers!r}")
    mbit_down = mbit_up if mbit_down is None else mbit_down
    for name, v in (("mbit_up", mbit_up), ("mbit_down", mbit_down), ("step_s", step_s)):
        if not (isinstance(v, (int, float)) and 0 < v < math.inf):
            raise ValueError(f"{name} must be a number > 0, got {v!r}")
    if not (isinstance(rtt_ms, (int, float)) and 0 <= rtt_ms < math.inf):
        raise ValueError(f"rtt_ms must be a number >= 0, got {rtt_ms!r}")
    if not (isinstance(target, (int, float)) and 0 < target <= 1):
        raise ValueError(f"target must be a utilisation in (0, 1], got {target!r}")
    check_codecs(codec, mean_codec, block_size)
    if not sync_every or any(not isinstance(h, int) or h < 1 for h in sync_every):
        raise ValueError(f"sync_every must be ints >= 1, got {sync_every!r}")
    mbit, rtt = min(mbit_up, mbit_down), rtt_ms / 1e3
    cs = dict(cal.codec_s_per_param, **(codec_s or {}))

    def util(
        h: int,
        c: str,
        f: int = 1,
        mode: str = "delayed",
        tau: int | str = "auto",
        mean: str | None = None,
        block: int | None = None,
    ) -> tuple[float, float, int]:
        down = c if mean is None else mean
        return predict_utilisation(
            mode,
            params=params,
            codec=c,
            peers=peers,
            mbit=mbit,
            rtt_s=rtt,
            step_s=step_s,
            sync_every=h,
            tau=tau,
            fragments=f,
            cal=cal,
            codec_s=(cs[c] + cs[down]) / 2,
            mean_codec=mean,
            block_size=block,
        )

    sent = int(2 * (peers - 1) / peers * pair_bytes(params, codec, mean_codec, block_size))  # a peer, a round
    rows = []
    for h in sorted(sync_every):
        ub, t_round, _ = util(h, codec, mode="blocking", mean=mean_codec, block=block_size)
        uo, _, tau = util(h, codec, mean=mean_codec, block=block_size)
        needed = math.ceil(1.25 * t_round / step_s)
        rows.append(
            PlanRow(
                sync_every=h,
                bytes_per_round=sent,
                round_s=t_round,
                tau=needed,
                tau_within_cap=needed <= default_cap(h),
                utilisation_blocking=ub,
                utilisation=uo,
                mbytes_per_hour=sent / 1e6 * 3600 * uo / (h * step_s),  # per hour of wall time
            )
        )
    best: dict[str, Any] | None = None
    fallback: dict[str, Any] | None = None
    for h in sorted(sync_every):
        for f in (1, 2, 4):
            for c in CODECS:  # most precise first
                if f > 1 and h % f:
                    continue
                u, t_round, tau = util(h, c, f)
                cand = {"sync_every": h, "codec": c, "overlap_steps": tau, "fragments": f, "utilisation": u}
                cand["round_s"] = t_round
                if fallback is None or u > fallback["utilisation"]:
                    fallback = cand
                if u >= target and best is None:
                    best = cand
            if best is not None:
                break
        if best is not None:
            break
    rec = dict(best or fallback or {})
    if best is not None:
        rec["why"] = (
            f"the smallest H of {list(sync_every)} whose rounds reach {100 * target:.0f}% utilisation "
            f"overlapped by tau={rec['overlap_steps']} (within the 1% staleness budget), with the most precise codec that does"
        )
    else:
        rec["why"] = (
            f"no H of {list(sync_every)} reaches {100 * target:.0f}% on this link: the highest predicted utilisation"
            + ("; the link is too slow for this model" if rec.get("utilisation", 0.0) < 0.5 else "")
        )
    ud, t_dp, _ = util(1, "fp32", mode="data_parallel")
    inputs = {
        "params": params,
        "codec": codec,
        "mean_codec": codec if mean_codec is None else mean_codec,
        "block_size": block_size,
        "peers": peers,
        "mbit_up": mbit_up,
        "mbit_down": mbit_down,
        "rtt_ms": rtt_ms,
        "step_s": step_s,
        "target": target,
        "codec_s_per_param": cs,
    }
    dp = {"utilisation": ud, "step_allreduce_s": t_dp, "bytes_per_step": int(2 * (peers - 1) / peers * 4 * params)}
    return RoundPlan(inputs=inputs, rows=rows, data_parallel=dp, recommendation=rec)


# ----------------------------------------------------------------------------- calibration
def _cells(results: dict) -> dict[tuple[str, float, float], list[dict]]:
    cells: dict[tuple[str, float, float], list[dict]] = {}
    for r in results["runs"]:
        cells.setdefault((r["mode"], float(r["bandwidth_mbit"]), float(r["rtt_ms"])), []).append(r)
    return cells


def _mode_of(name: str) -> tuple[str, int | str, int]:
    """bench_utilization's mode name -> (mode, tau, fragments)."""
    if name == "data_parallel":
        return "data_parallel", 0, 1
    if name == "blocking":
        return "blocking", 0, 1
    tau: int | str = "auto" if name.endswith("_auto") else 1
    if name.startswith("fragments"):
        return "delayed", tau, 2
    return name.split("_")[0], tau, 1


def calibrate(results: dict, codec_s_per_param: dict[str, float] | None = None) -> Calibration:
    """Fits the round model's constants to ``bench_utilization``'s results (its JSON as a dict).

    ``c_round`` and ``k_rtt``: least squares over every measured DiLoCo round time (whole-vector
    rounds); ``c_dp``: the data-parallel cells' per-step all-reduce seconds given ``k_rtt``;
    each family's ``overhead``: the median over its cells of the window time the utilisation
    implies beyond the predicted stall.
    """
    cfg = results["config"]
    params, peers, h, t = int(cfg["params"]), int(cfg.get("peers", 2)), int(cfg["sync_every"]), cfg["step_seconds"]
    codec = "int4"
    cs = dict(CALIBRATION.codec_s_per_param, **(codec_s_per_param or {}))
    cells = _cells(results)
    xs, ys = [], []
    for (name, mbit, rtt), runs in cells.items():
        if name == "data_parallel" or name.startswith("fragments"):
            continue
        base = _transfer_s(message_bytes(params, codec), peers, mbit) + params * cs[codec]
        for r in runs:
            for ex in r.get("exchange_seconds", []):
                xs.append([1.0, rtt / 1e3])
                ys.append(ex - base)
    (c_round, k_rtt), *_ = np.linalg.lstsq(np.asarray(xs), np.asarray(ys), rcond=None)
    dp = []
    for (name, mbit, rtt), runs in cells.items():
        if name == "data_parallel":
            for r in runs:
                per_step = r["sync_seconds"] / r["steps"]
                dp.append(per_step - k_rtt * rtt / 1e3 - _transfer_s(4 * params, peers, mbit))
    c_dp = float(np.median(dp))
    cal0 = Calibration(float(c_round), float(k_rtt), c_dp, dict.fromkeys(CALIBRATION.overhead, 0.0), cs)
    implied: dict[str, list[float]] = {k: [] for k in CALIBRATION.overhead}
    for (name, mbit, rtt), runs in cells.items():
        mode, tau, f = _mode_of(name)
        if mode == "data_parallel":
            continue
        u = float(np.mean([r["utilisation"] for r in runs]))
        u0, _, _ = predict_utilisation(
            mode, params=params, codec=codec, peers=peers, mbit=mbit, rtt_s=rtt / 1e3, step_s=t, sync_every=h,
            tau=tau, fragments=f, cal=cal0,
        )  # fmt: skip
        window = h * t
        # window / u - window = f * (stall + overhead); u0 has overhead 0
        implied["fragments" if f > 1 else mode].append((window / u - window / u0) / f)
    overhead = {k: round(float(np.median(v)), 4) if v else 0.0 for k, v in implied.items()}
    return Calibration(
        round(float(c_round), 4), round(float(k_rtt), 3), round(c_dp, 4), overhead, cs, "bench_utilization results"
    )


def validate(results: dict, cal: Calibration = CALIBRATION) -> list[dict[str, Any]]:
    """Predicted against measured utilisation on every cell of ``bench_utilization``'s results:
    rows ``{mode, mbit, rtt_ms, measured, predicted, error_points}`` (points = percent of
    utilisation), sorted by mode and link."""
    cfg = results["config"]
    params, peers, h, t = int(cfg["params"]), int(cfg.get("peers", 2)), int(cfg["sync_every"]), cfg["step_seconds"]
    rows = []
    for (name, mbit, rtt), runs in sorted(_cells(results).items()):
        mode, tau, f = _mode_of(name)
        u = float(np.mean([r["utilisation"] for r in runs]))
        p, _, _ = predict_utilisation(
            mode, params=params, codec="int4", peers=peers, mbit=mbit, rtt_s=rtt / 1e3, step_s=t, sync_every=h,
            tau=tau, fragments=f, cal=cal,
        )  # fmt: skip
        rows.append(
            {
                "mode": name,
                "mbit": mbit,
                "rtt_ms": rtt,
                "measured": round(u, 4),
                "predicted": round(p, 4),
                "error_points": round(100 * (p - u), 2),
            }
        )
    return rows
