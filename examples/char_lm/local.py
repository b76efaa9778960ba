"""The main job's local swarm (``main.py --local-peers N``): a rendezvous and N peer processes
on 127.0.0.1, one progress display, and the summary table and JSON of their results."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from char_lm.data import check_text
from char_lm.report import machine_info, run_config

_FORWARD = (
    "text",
    "sync_every",
    "max_steps",
    "batch_size",
    "seq_len",
    "d_model",
    "layers",
    "heads",
    "lr",
    "inner",
    "outer_lr",
    "outer_momentum",
    "codec",
    "topk_fraction",
    "block_size",
    "mean_codec",
    "mean_ef",
    "ef_decay",
    "overlap_steps",
    "staleness_budget",
    "mode",
    "aggregator",
    "clip_multiple",
    "alpha",
    "fragments",
    "eval_batches",
    "seed",
    "part_timeout",
    "log_every",
    "min_step_seconds",
    "checkpoint_every",
    "schedule_steps",
    "devices",
    "layout",
    "log_level",
    "stages",
    "micro_batches",
    "in_flight",
    "pipeline_mode",
    "activation_codec",
    "standbys",
)
#: seconds the peers get to stop and report after Ctrl+C, before they are killed (the whole
#: job then ends within about 5 s: the table and the summary JSON with what the peers reported)
STOP_SECONDS = 3.5
_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\S+) (WARNING|ERROR|CRITICAL) (.*)$")
_WARNING_LINE = re.compile(r"^\S.*:\d+: \w*Warning: ")


def console_line(line: str) -> str | None:
    """What of a peer's stderr line the console shows: its WARNING / ERROR / CRITICAL log
    records (``LEVEL logger: message``), Python warnings and ``error:`` lines; else None."""
    line = line.rstrip()
    m = _LOG_LINE.match(line)
    if m:
        name, level, msg = m.groups()
        return f"{level} {msg}" if name == "py.warnings" else f"{level} {name}: {msg}"
    if line.startswith("error: ") or _WARNING_LINE.match(line):
        return line
    return None


def _forward_flags(args: argparse.Namespace) -> list[str]:
    out = []
    for name in _FORWARD:
        value = getattr(args, name)
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    return out + (["--fresh"] if getattr(args, "fresh", False) else [])


def print_peer_table(results: list[dict], dp_bytes: float | None, missing: dict[str, str] | None = None) -> bool:
    """The summary table: a row per peer that reported, and a row per peer of ``missing`` (its
    name: why it has no report); returns whether the reported global states are identical
    (final digest and every round's digest)."""
    digests = {r["final_global_digest"] for r in results}
    same_rounds = len({tuple(r["round_digests"]) for r in results}) == 1

    def num(x, fmt):
        return format(x, fmt) if x is not None else format("-", fmt.split(".")[0].rstrip("f") + "s")

    print()
    print(
        f"| {'peer':<16} | {'eval start':>10} | {'eval end':>8} | {'rounds':>6} | {'failed':>6} | {'sent MB':>8} | "
        f"{'DP would send MB':>16} | {'utilisation':>11} | {'stall s':>7} | {'mean tau':>8} |"
    )
    print(
        f"|{'-' * 18}|{'-' * 12}|{'-' * 10}|{'-' * 8}|{'-' * 8}|{'-' * 10}|{'-' * 18}|{'-' * 13}|{'-' * 9}|{'-' * 10}|"
    )
    for r in results:
        print(
            f"| {r['peer']:<16} | {num(r['eval_loss_start'], '10.4f')} | {num(r['eval_loss_end'], '8.4f')} | "
            f"{r['rounds']:6d} | {r['failed_rounds']:6d} | {r['bytes_sent'] / 1e6:8.2f} | "
            f"{num(None if dp_bytes is None else dp_bytes / 1e6, '16.1f')} | "
            f"{num(r['compute_utilisation'], '11.3f')} | {r['stall_seconds']:7.2f} | {num(r['mean_overlap_steps'], '8.1f')} |"
        )
    for name, why in (missing or {}).items():
        print(f"| {name:<16} | {why}")
    cut = [r["peer"] for r in results if r.get("eval_interrupted")]
    if cut:
        print(f"eval end: interrupted (Ctrl+C during the final eval) on {', '.join(cut)}")
    if not results:
        print("\nno peer reported: no global state to compare")
    elif len(results) > 1:
        print(
            f"\nglobal state (params and outer optimizer state) identical on all peers: "
            f"{'yes' if len(digests) == 1 else 'NO'} (digest {str(sorted(map(str, digests))[0])[:16]}...); "
            f"per-round digests identical: {'yes' if same_rounds else 'NO'}"
        )
    elif results:
        d = results[0]["final_global_digest"]
        print(f"\nglobal state digest {d[:16]}..." if d else "\nglobal state digest: none (no round merged)")
    return len(digests) == 1 and same_rounds


def data_parallel_bytes(n: int, params: int, steps: int) -> float:
    """Bytes one peer would send with data-parallel training: a ring all-reduce of float32
    gradients every step sends 2 (N - 1) / N * 4 * params bytes per peer per step."""
    return 2 * (n - 1) / n * 4 * params * steps


def data_parallel_bytes_for(n: int, results: list[dict]) -> float:
    """:func:`data_parallel_bytes` for the inner steps the peers took (fewer than --max-steps
    when the run was interrupted): what data-parallel training at equal tokens would send."""
    steps = max(int(r.get("steps") or 0) for r in results)
    return data_parallel_bytes(n, results[0]["params"], steps)


def run_local_swarm(args: argparse.Namespace) -> dict:
    """Starts a rendezvous and ``--local-peers`` peer processes on 127.0.0.1 and waits for them.

    Nothing but the summary touches the disk (the token travels in the environment, results and
    logs through pipes), so neither Ctrl+C nor a crash of this process leaves files behind; the
    processes (``ravnest_jax.launch.Launcher``'s) stop by themselves when this process dies. The
    peers' WARNING and ERROR log lines and ``error:`` lines are shown on the console, prefixed
    with the peer's name.

    Ctrl+C (SIGINT to this process; the peers get exactly one each, forwarded) at any moment
    stops the peers: each reports what it did (eval figures marked interrupted where its final
    eval did not finish), a peer that has not stopped after :data:`STOP_SECONDS` is killed, and
    the summary so far is returned with ``"interrupted": true``: a table row per peer, the ones
    without a report saying why (``"peers_without_report"``). Sets ``args.summary_json`` (default
    ``runs/RUN_ID/summary.json``) first, so the caller writes the summary whatever happens.
    """
    import queue
    import secrets
    import signal
    import threading

    from tqdm.auto import tqdm

    from char_lm.peer import _STOPPED_BY
    from ravnest_jax.launch import Launcher

    run_id = f"char-lm-{secrets.token_hex(3)}"
    if not args.summary_json:
        args.summary_json = str(Path("runs") / run_id / "summary.json")
    check_text(args.text)  # before anything starts
    machine: dict = {}
    staged = getattr(args, "stages", 1) > 1
    n = args.local_peers + (args.standbys if staged else 0)  # processes: the clusters' peers and the standbys
    launcher = Launcher(run_id, tail=60)
    events: queue.Queue = queue.Queue()

    def on_line(name: str, line: str, err: bool) -> None:
        if not err:  # --json-events: a JSON object a line
            try:
                events.put((name, json.loads(line)))
            except ValueError:
                pass
        elif (shown := console_line(line)) is not None:
            tqdm.write(f"[{name}] {shown}", file=sys.stderr)  # above the bar

    steps = [0] * n
    results: dict[int, dict] = {}
    peers: list = []
    interrupted = False
    bar = None
    rounds = 0

    def handle(name: str, ev: dict) -> None:
        nonlocal rounds
        if not name.startswith("peer"):
            return
        i = int(name[4:])
        kind = ev.get("event")
        if kind == "compiling" and bar is not None:
            compiling.add(i)
            bar.set_description_str(f"{n} peers (compiling {len(compiling)}/{n})")
            if args.no_progress and len(compiling) == n:
                print(f"all {n} peers compiling", flush=True)
        elif kind == "final_eval":
            evaluating.add(i)
            if args.no_progress and len(evaluating) == n:
                print(f"final eval on all {n} peers", flush=True)
        elif kind == "start":
            started.add(i)
            steps[i] = ev.get("step", 0)
            if bar is not None:
                bar.set_description_str(
                    f"{n} peers" if len(started) == n else f"{n} peers ({len(started)}/{n} training)"
                )
                bar.update(max(sum(steps) - bar.n, 0))
        elif kind == "progress":
            steps[i] = ev["step"]
            if bar is not None:
                bar.update(max(sum(steps) - bar.n, 0))
            if ev.get("loss") is not None:
                losses[i] = ev["loss"]
                if bar is not None:
                    bar.set_postfix(loss=f"{np.mean(list(losses.values())):.3f}", rounds=rounds)
        elif kind == "round" and i == 0:
            rounds += bool(ev["ok"])
            if bar is not None and losses:
                bar.set_postfix(loss=f"{np.mean(list(losses.values())):.3f}", rounds=rounds)
            if args.no_progress:  # a line per round for logs (the bar shows it otherwise)
                loss = f", mean train loss {np.mean(list(losses.values())):.3f}" if losses else ""
                print(
                    f"round {ev['round']} at step {ev['step']}: {'ok' if ev['ok'] else 'failed: ' + str(ev.get('error'))}, "
                    f"{ev['group_size']} peers{loss}",
                    flush=True,
                )
        elif kind == "placed" and staged and args.no_progress:
            where = "standby" if ev["role"] == "standby" else f"cluster {ev['cluster']}"
            print(f"peer{i}: stage {ev['stage']} ({where})", flush=True)
        elif kind == "result":
            results[i] = ev["result"]

    compiling: set[int] = set()
    evaluating: set[int] = set()
    started: set[int] = set()
    losses: dict[int, float] = {}
    url = None
    try:
        url = launcher.start_rendezvous(heartbeat=1.0, eviction=5.0)
        print(
            f"rendezvous {url}, run {run_id}; starting {n} peers "
            f"(codec {args.codec}{'' if args.mean_codec in (None, args.codec) else ', mean ' + args.mean_codec}"
            f", H={args.sync_every}, overlap {args.overlap_steps}, mode {args.mode})"
        )
        if staged:
            print(
                f"pipeline: {args.stages} stages, {args.local_peers // args.stages} clusters, {args.standbys} standbys, "
                f"{args.micro_batches} micro-batches, {args.pipeline_mode} schedule, {args.activation_codec} activations"
            )
        print(f"status page: {url}/runs/{run_id}?token={launcher.token}", flush=True)
        main_py = str(Path(__file__).resolve().with_name("main.py"))
        for i in range(n):
            # the launcher's RAVNEST_* variables give each peer its rendezvous, run, id, data seed
            # (rank), --min-peers (world size) and --listen; --checkpoint-dir gets a subfolder per peer
            cmd = [sys.executable, main_py, "--json-events", "--parent-pid", str(os.getpid()), *_forward_flags(args)]
            if args.checkpoint_dir:
                cmd += ["--checkpoint-dir", str(Path(args.checkpoint_dir).resolve())]
            if args.adversary is not None and i < args.adversary_peers:
                cmd += ["--adversary", args.adversary]
            peers.append(launcher.start(f"peer{i}", cmd, env=launcher.peer_env(f"peer{i}", i, n), on_line=on_line))
        # jax's import and backend take this process seconds: read while the peers start, not
        # after a Ctrl+C (which has 5 s for everything); only once every process is started
        # (a start with jax's backend up warns "os.fork() was called ... JAX is multithreaded")
        threading.Thread(target=lambda: machine.update(machine_info()), name="machine-info", daemon=True).start()
        total = (args.local_peers if staged else n) * args.max_steps
        bar = tqdm(total=total, desc=f"{n} peers (starting)", disable=args.no_progress, dynamic_ncols=True)
        if args.no_progress:
            print(f"compiling on {n} peers (a minute or so on a small CPU machine)...", flush=True)
        while any(p.poll() is None for p in peers) or not events.empty():
            try:
                handle(*events.get(timeout=0.5))
            except queue.Empty:
                pass
            crashed = [i for i, p in enumerate(peers) if p.poll() not in (None, 0) and i not in started]
            if crashed and len(started) < n:
                # a peer that failed before it trained: the others would wait for it (--min-peers)
                # until their join deadline; stop them now (the failure is reported below)
                print(f"peer{crashed[0]} failed during start-up: stopping the other peers", file=sys.stderr, flush=True)
                break
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: stopping the peers and the rendezvous", file=sys.stderr, flush=True)
    finally:
        # from here on a signal only hurries the stop: the table and the summary still come
        more: list[int] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda signum, frame: (more.append(signum), _STOPPED_BY.append(signum)))
        killed = launcher.stop_peers(STOP_SECONDS if interrupted else 20.0, hurry=lambda: bool(more))
        interrupted = interrupted or bool(more)
        launcher.close(2.0)  # then the rendezvous; 2 s for the readers to take the peers' last lines
        while not events.empty():
            handle(*events.get())
        if bar is not None:
            bar.set_postfix(
                loss=f"{np.mean(list(losses.values())):.3f}" if losses else "-",
                rounds=results.get(0, {}).get("rounds", rounds),
            )
            bar.close()
    failed, missing = {}, {}
    for i in range(n):
        p = peers[i] if i < len(peers) else None
        rc = None if p is None else p.wait()
        if (interrupted or rc == 0) and i in results:
            continue
        err = [ln.rstrip() for ln in launcher.tails.get(f"peer{i}:err", []) if ln.strip()]
        missing[f"peer{i}"] = _why_no_report(rc, f"peer{i}" in killed, interrupted, i in started, steps[i], err)
        if not interrupted:
            failed[f"peer{i}"] = missing[f"peer{i}"] + "".join(f"\n    {ln}" for ln in err[-5:])
    for name, why in failed.items():
        print(f"{name}: {why}", file=sys.stderr)
    done = [results[i] for i in range(len(peers)) if i in results and f"peer{i}" not in missing]
    if failed:
        print(f"\n{len(failed)} of {n} peers did not finish (above); the {len(done)} that did:")
    if staged:
        from char_lm.pipe_peer import print_stage_table

        equal = print_stage_table(done) if done else False
        return {
            "mode": "local_swarm",
            "pipeline": True,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine or _machine_without_jax(),
            "config": run_config(args, run_id=run_id, rendezvous=url, min_peers=n),
            "interrupted": interrupted,
            "peers": done,
            "stages": _stage_summary(done),
            "round_digests_equal": equal,
            "failed_peers": failed,
            "peers_without_report": missing,
        }
    dp_bytes = data_parallel_bytes_for(n, done) if done else 0.0
    equal = print_peer_table(done, dp_bytes, missing)
    return {
        "mode": "local_swarm",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine or _machine_without_jax(),
        "config": run_config(args, run_id=run_id, rendezvous=url, min_peers=n),
        "interrupted": interrupted,
        "peers": done,
        "data_parallel_bytes_per_peer": dp_bytes,
        "global_digests_equal": bool(done) and len({r["final_global_digest"] for r in done}) == 1,
        "round_digests_equal": equal,
        "failed_peers": failed,
        "peers_without_report": missing,
    }


def _machine_without_jax() -> dict:
    import platform

    return {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}


def _why_no_report(rc: int | None, killed: bool, interrupted: bool, trained: bool, step: int, err: list) -> str:
    """A table row's words for a peer without a report."""
    import signal

    last = next((ln for ln in reversed(err) if ln.startswith("error: ")), err[-1] if err else "")
    last = last[:160] + ("..." if len(last) > 160 else "")
    if rc is None:
        return "no report: not started (interrupted before)"
    if killed:
        return f"no report: did not stop within {STOP_SECONDS} s of Ctrl+C, killed" + (
            f" (at step {step})" if trained else " (before its first step)"
        )
    if interrupted:
        where = f"at step {step}" if trained else "before its first round (compiling or joining)"
        return f"no report: interrupted {where}"
    how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited {rc}"
    return f"{how} at step {step}" + (f": {last}" if last else "") if rc else "exited 0 without a report"


def _stage_summary(results: list[dict]) -> list[dict]:
    """Per stage: mean utilisation and bubble fraction over its active peers, activation bytes,
    outer rounds (the cross-cluster DiLoCo rounds of its group)."""
    out = []
    for s in sorted({r["stage"] for r in results if r.get("role") == "active"}):
        rs = [r for r in results if r.get("role") == "active" and r["stage"] == s]
        utils = [r["utilisation"] for r in rs if r["utilisation"] is not None]
        out.append(
            {
                "stage": s,
                "peers": [r["peer"] for r in rs],
                "utilisation": float(np.mean(utils)) if utils else None,
                "bubble_fraction": float(1 - np.mean(utils)) if utils else None,
                "activation_bytes_sent": int(sum(r["activation_bytes_sent"] for r in rs)),
                "activation_bytes_received": int(sum(r["activation_bytes_received"] for r in rs)),
                "outer_rounds": max(r["outer_rounds"] for r in rs),
                "eval_loss_end": [r["eval_loss_end"] for r in rs if r["eval_loss_end"] is not None] or None,
            }
        )
    return out
