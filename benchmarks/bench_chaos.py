#!/usr/bin/env python3
"""Chaos benchmark: the main job's peers under random kill -9, a rendezvous restart and a stream
of malformed or unauthenticated requests (not run in CI: several minutes).

Starts a rendezvous (``ravnest-jax rendezvous``) and 4 peer processes of ``examples/char_lm/main.py``
(each with its own ``--checkpoint-dir``) on 127.0.0.1, trains for ``--rounds`` outer rounds and
meanwhile:

- kills (``SIGKILL``) a random peer at a random moment ``--kills`` times, and restarts it from its
  checkpoint directory (the same command: it keeps its peer id, downloads the swarm's state and
  trains on). Victims are drawn among peers 1..3 that contribute (their process has had an ok
  round), so every kill measures the time until the restarted peer contributes again; peer 0
  is never killed (the long-lived survivor whose RSS is followed, and the swarm's state lives
  on in it). The kills are spread over the run: the next one is due at a random step, and
  waits for a contributing victim when none is; none after 88 % of the steps (a restart needs
  rounds left to contribute in);
- restarts the rendezvous once (``SIGKILL``, then the same port again);
- sends ``--bad-requests`` malformed or unauthenticated requests to the rendezvous and to a
  peer, interleaved with training (unsigned, wrong token, bad signature, replayed nonce,
  malformed JSON, bad fields, oversize bodies, bad paths, garbage parts); every answer's status
  is recorded.

Writes ``benchmarks/results/chaos.json`` (the machine, the command, every event) and
``chaos.png``: per round, which peers contributed; kills and the rendezvous restart; stalls; RSS.
RSS is sampled every 2 s for every process (``rss_mb``: seconds, name, MB, process number);
``summary.rss_after_warmup`` has, per process after its warm-up (a peer: its first 3 rounds;
the rendezvous: 30 s), the median RSS of its first and last minute, its range, and fitted
slopes in MB/h (least squares and Theil-Sen, over all of it and over its second half; the
Theil-Sen slope is the one a restart's dip or a spike hardly moves).

    python benchmarks/bench_chaos.py                  # 4 peers, 100 rounds, 50 kills, 10,000 requests
    python benchmarks/bench_chaos.py --rounds 30 --kills 10 --bad-requests 2000   # a short run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import free_port, machine_info  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "char_lm" / "main.py")


class Proc:
    """A peer (or rendezvous) process; its JSON events collected with the time they came."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict):
        self.name, self.cmd = name, cmd
        self.log = open(log, "a")
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.started = time.time()
        self.events: list[dict] = []
        self.killed_at: float | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            ev.setdefault("t", time.time())
            self.events.append(ev)

    def training(self) -> bool:
        return self.p.poll() is None and any(e.get("event") == "start" for e in self.events)

    def rss_mb(self) -> float | None:
        try:
            for line in Path(f"/proc/{self.p.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None


# ------------------------------------------------------------------------------ bad requests
def _bad_requests(rng: random.Random, rv_url: str, peer_url: str, run_id: str, token: str):
    """An endless stream of (label, method, url, headers, body) that must all be refused (4xx)."""
    from ravnest_jax.swarm.wire import _auth

    key = token.encode()
    seen: list[dict] = []

    def signed(method: str, path: str, body: bytes, tok: bytes = key, peer: str = "chaos") -> dict:
        h = _auth.sign(tok, method=method, path=path, run_id=run_id, peer=peer, body_digest=_auth.body_digest(body))
        if body:
            h["Content-Type"] = "application/json"
        return h

    rv = f"/v1/runs/{run_id}"
    while True:
        kind = rng.randrange(14)
        if kind == 0:  # no auth at all
            yield "unsigned join", "POST", rv_url + rv + "/join", {}, b'{"peer_id": "x"}'
        elif kind == 1:  # the wrong token
            body = json.dumps({"peer_id": "chaos", "address": "http://127.0.0.1:1", "last_round": 0}).encode()
            yield (
                "wrong token",
                "POST",
                rv_url + rv + "/heartbeat",
                signed("POST", rv + "/heartbeat", body, b"wrong"),
                body,
            )
        elif kind == 2:  # a forged signature
            body = b'{"peer_id": "chaos"}'
            h = signed("POST", rv + "/leave", body)
            h["X-RJ-Signature"] = "0" * 64
            yield "bad signature", "POST", rv_url + rv + "/leave", h, body
        elif kind == 3:  # a replayed request
            if seen:
                r = seen[rng.randrange(len(seen))]
                yield "replayed nonce", r["method"], r["url"], r["headers"], r["body"]
            else:
                body = json.dumps({"peer_id": "chaos", "address": "ftp://nowhere"}).encode()
                h = signed("POST", rv + "/join", body)
                seen.append({"method": "POST", "url": rv_url + rv + "/join", "headers": h, "body": body})
                yield "bad address", "POST", rv_url + rv + "/join", h, body
        elif kind == 4:  # malformed JSON, correctly signed
            body = b'{"peer_id": "chaos", "after": '
            yield (
                "malformed json",
                "POST",
                rv_url + rv + "/rounds/begin",
                signed("POST", rv + "/rounds/begin", body),
                body,
            )
        elif kind == 5:  # bad fields, correctly signed
            body = json.dumps(
                {
                    "peer_id": "chaos",
                    "address": "http://127.0.0.1:1",
                    "after": rng.choice(["x", 1.5, None, [1]]),
                    "wait_s": 0,
                }
            ).encode()
            yield (
                "bad begin fields",
                "POST",
                rv_url + rv + "/rounds/begin",
                signed("POST", rv + "/rounds/begin", body),
                body,
            )
        elif kind == 6:
            body = json.dumps({"peer_id": "chaos", "epoch": "x", "attempt": "nope", "phase": "gather"}).encode()
            path = f"{rv}/rounds/{rng.randrange(10**6)}/vote"
            yield "bad vote", "POST", rv_url + path, signed("POST", path, body), body
        elif kind == 7:  # a body signed for another peer id
            body = json.dumps({"peer_id": "someone-else", "address": "http://127.0.0.1:1"}).encode()
            yield "peer id mismatch", "POST", rv_url + rv + "/join", signed("POST", rv + "/join", body), body
        elif kind == 8:  # too large
            body = b'{"peer_id": "chaos", "pad": "' + b"x" * (1 << 20) + b'"}'
            yield "oversize body", "POST", rv_url + rv + "/heartbeat", signed("POST", rv + "/heartbeat", body), body
        elif kind == 9:  # an unknown path
            yield "bad path", "GET", rv_url + "/v1/runs/" + secrets.token_hex(4) + "/nothing", {}, b""
        elif kind == 10:  # garbage part to a peer, unsigned
            path = f"{rv}/rounds/{rng.randrange(100)}/0/parts/0"
            yield (
                "unsigned part",
                "PUT",
                peer_url + path,
                {"Content-Type": "application/octet-stream"},
                os.urandom(4096),
            )
        elif kind == 11:  # a part signed with the wrong token
            path = f"{rv}/rounds/{rng.randrange(100)}/0/parts/0"
            h = _auth.sign(
                b"wrong",
                method="PUT",
                path=path,
                run_id=run_id,
                peer="chaos",
                body_digest=_auth.body_digest(b"junk"),
                extra="1.0|m",
            )
            h.update({"X-RJ-Weight": "1.0", "X-RJ-Manifest": "m"})
            yield "wrong-token part", "PUT", peer_url + path, h, b"junk"
        elif kind == 12:  # the state, unsigned
            yield "unsigned state", "GET", peer_url + rv + "/state", {}, b""
        else:  # a ring message with a bad phase, correctly signed
            path = f"{rv}/rounds/{rng.randrange(100)}/0/ring/xx/0/0"
            h = _auth.sign(
                key,
                method="PUT",
                path=path,
                run_id=run_id,
                peer="chaos",
                body_digest=_auth.body_digest(b"junk"),
                extra="nan|m",
            )
            h.update({"X-RJ-Weight": "nan", "X-RJ-Manifest": "m"})
            yield "bad ring message", "PUT", peer_url + path, h, b"junk"


def attack(
    stop: threading.Event,
    pause: threading.Event,
    n: int,
    rate: float,
    targets,
    run_id: str,
    token: str,
    out: list,
    seed: int,
) -> None:
    """Sends ``n`` bad requests at about ``rate`` per second; appends (t, label, status) to ``out``.
    Waits while ``pause`` is set (the rendezvous is being restarted: nothing listens)."""
    rng = random.Random(seed)

    async def go() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            gen = None
            sent = 0
            while sent < n and not stop.is_set():
                while pause.is_set() and not stop.is_set():
                    await asyncio.sleep(0.05)
                rv_url, peer_url = targets()
                gen = _bad_requests(rng, rv_url, peer_url, run_id, token) if gen is None else gen
                label, method, url, headers, body = next(gen)
                if not url.startswith(("http://127.0.0.1:", "http://localhost:")):
                    raise SystemExit(f"refusing to send to {url}: loopback only")
                try:
                    async with session.request(method, url, headers=headers, data=body or None) as r:
                        await r.read()
                        status = r.status
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    status = f"no answer: {type(e).__name__}"  # a target restarting (killed peer)
                out.append((time.time(), label, status))
                sent += 1
                await asyncio.sleep(rng.expovariate(rate))
                if rng.random() < 0.02:
                    gen = None  # follow the targets (a peer restarts on another port)

    asyncio.run(go())


# ------------------------------------------------------------------------------------ the run
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=100, help="outer rounds of the run (H steps each)")
    ap.add_argument("--sync-every", type=int, default=10)
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--bad-requests", type=int, default=10_000)
    ap.add_argument("--step-seconds", type=float, default=0.8, help="each inner step takes at least this long")
    ap.add_argument("--part-timeout", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos.json"))
    args = ap.parse_args(argv)
    # SIGTERM (a killed benchmark) runs the cleanup below too: peers and the rendezvous stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rng = random.Random(args.seed)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"rj-chaos-{secrets.token_hex(4)}"
    work.mkdir(parents=True)
    token = secrets.token_hex(16)
    (work / "token").write_text(token)
    (work / "token").chmod(0o600)
    # a restarted peer reuses the compiled programs (jax's persistent cache), as a user would
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
        "JAX_COMPILATION_CACHE_DIR": str(work / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    port = free_port()
    rv_url = f"http://127.0.0.1:{port}"
    run_id = "chaos"
    max_steps = args.rounds * args.sync_every
    rv_cmd = [
        sys.executable,
        "-m",
        "ravnest_jax.cli",
        "rendezvous",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--token-file",
        str(work / "token"),
        "--heartbeat",
        "1",
        "--eviction",
        "5",
    ]
    peer_flags = [
        "--rendezvous",
        rv_url,
        "--run-id",
        run_id,
        "--token-file",
        str(work / "token"),
        "--listen",
        "127.0.0.1:0",
        "--max-steps",
        str(max_steps),
        "--schedule-steps",
        str(max_steps),
        "--sync-every",
        str(args.sync_every),
        "--overlap-steps",
        "1",
        "--codec",
        "int4",
        "--part-timeout",
        str(args.part_timeout),
        "--min-step-seconds",
        str(args.step_seconds),
        "--d-model",
        "64",
        "--layers",
        "2",
        "--heads",
        "4",
        "--seq-len",
        "64",
        "--batch-size",
        "8",
        "--eval-batches",
        "2",
        "--log-every",
        str(args.sync_every),
        "--json-events",
        "--no-progress",
    ]
    rendezvous = [Proc("rendezvous", rv_cmd, work / "rendezvous.log", env)]
    peers: dict[int, list[Proc]] = {}
    kills: list[dict] = []
    rv_restart: dict = {}
    bad: list = []
    rss: list[tuple[float, str, float, int]] = []  # (seconds since start, name, MB, process number)
    ghosts: set[str] = set()  # peer ids the rendezvous listed that no peer of ours has
    stop_attack, pause_attack = threading.Event(), threading.Event()
    t_begin = time.time()

    def start_peer(i: int) -> Proc:
        cmd = [
            sys.executable,
            EXAMPLE,
            *peer_flags,
            "--checkpoint-dir",
            str(work / f"ckpt{i}"),
            "--data-seed",
            str(i),
            *(["--min-peers", str(args.peers)] if i not in peers else []),
        ]
        p = Proc(f"peer{i}", cmd, work / f"peer{i}.log", env)
        peers.setdefault(i, []).append(p)
        return p

    def targets() -> tuple[str, str]:
        return rv_url, f"http://127.0.0.1:{peers[0][-1].port}"  # peer 0 is never killed

    def contributing(i: int) -> bool:
        p = peers[i][-1]
        return p.p.poll() is None and any(e.get("event") == "round" and e.get("ok") for e in p.events)

    def progress() -> int:
        steps = [e["step"] for e in peers[0][-1].events if e.get("event") == "progress"]
        return max(steps) if steps else 0

    try:
        _wait_health(rv_url)
        for i in range(args.peers):
            start_peer(i)
        # wait for the swarm to train, then learn peer 0's port from the rendezvous
        while not all(peers[i][-1].training() for i in range(args.peers)):
            if any(peers[i][-1].p.poll() is not None for i in range(args.peers)):
                raise SystemExit("a peer died while starting; see " + str(work))
            time.sleep(0.5)
        peers[0][-1].port = _peer_port(rv_url, run_id, token, "peer", peers[0][-1])
        attacker = threading.Thread(
            target=attack,
            args=(
                stop_attack,
                pause_attack,
                args.bad_requests,
                args.bad_requests / max(0.6 * max_steps * args.step_seconds, 1),
                targets,
                run_id,
                token,
                bad,
                args.seed,
            ),
            daemon=True,
        )
        attacker.start()
        kill_steps = sorted(rng.uniform(0.05, 0.85) * max_steps for _ in range(args.kills))
        kill_after = 0.0  # a random moment once a victim is due and contributing
        rv_step = rng.uniform(0.3, 0.7) * max_steps
        last_rss = last_ghost = 0.0
        while peers[0][-1].p.poll() is None:
            step = progress()
            now = time.time()
            if now - last_rss > 2.0:
                last_rss = now
                for name, ps in [*((f"peer{i}", ps) for i, ps in peers.items()), ("rendezvous", rendezvous)]:
                    v = ps[-1].rss_mb() if ps[-1].p.poll() is None else None
                    if v is not None:
                        rss.append((now - t_begin, name, v, len(ps) - 1))
            if now - last_ghost > 10.0:
                last_ghost = now
                ours = {
                    e["peer"]
                    for ps in peers.values()
                    for p in ps
                    for e in list(p.events)
                    if e.get("event") == "compiling"
                }
                ghosts.update(_ghosts(rv_url, run_id, token, ours))
            if kill_steps and step >= 0.88 * max_steps:
                print(
                    f"[{now - t_begin:6.1f} s] step {step}: {len(kill_steps)} kills left undone (the restarts "
                    "must have rounds left to contribute in)",
                    flush=True,
                )
                kill_steps.clear()
            if kill_steps and step >= kill_steps[0]:
                n_contributing = sum(contributing(i) for i in peers)
                candidates = [i for i in range(1, args.peers) if contributing(i) and n_contributing > 1]
                if candidates and not kill_after:
                    kill_after = now + rng.uniform(0.0, args.sync_every * args.step_seconds * 1.5)
                if candidates and kill_after and now >= kill_after:
                    kill_after = 0.0
                    kill_steps.pop(0)
                    i = rng.choice(candidates)
                    victim = peers[i][-1]
                    victim.killed_at = time.time()
                    os.kill(victim.p.pid, signal.SIGKILL)
                    victim.p.wait()
                    time.sleep(rng.uniform(0.0, 3.0))
                    new = start_peer(i)
                    kills.append(
                        {
                            "peer": f"peer{i}",
                            "t": victim.killed_at - t_begin,
                            "step": step,
                            "was_training": any(e.get("event") == "start" for e in victim.events),
                            "restarted_at": new.started - t_begin,
                            "_proc": new,
                        }
                    )
                    print(
                        f"[{now - t_begin:6.1f} s] step {step}: kill -9 peer{i} ({len(kills)}/{args.kills})", flush=True
                    )
            if not rv_restart and step >= rv_step:
                old = rendezvous[-1]
                pause_attack.set()
                time.sleep(0.5)  # requests in flight are answered
                t_kill = time.time()
                os.kill(old.p.pid, signal.SIGKILL)
                old.p.wait()
                time.sleep(1.0)
                rendezvous.append(Proc("rendezvous", rv_cmd, work / "rendezvous.log", env))
                _wait_health(rv_url)
                pause_attack.clear()
                rv_restart = {"t": t_kill - t_begin, "step": step, "down_seconds": time.time() - t_kill}
                print(f"[{now - t_begin:6.1f} s] step {step}: rendezvous restarted", flush=True)
            time.sleep(0.2)
        # the survivors and the last restarted processes finish the run
        deadline = time.time() + 600
        for ps in peers.values():
            while ps[-1].p.poll() is None and time.time() < deadline:
                time.sleep(0.5)
    finally:
        stop_attack.set()
        for ps in peers.values():
            for p in ps:
                if p.p.poll() is None:
                    p.p.send_signal(signal.SIGINT)
        for ps in peers.values():
            for p in ps:
                try:
                    p.p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.p.kill()
                    p.p.wait()
        for r in rendezvous:
            if r.p.poll() is None:
                r.p.terminate()
                r.p.wait(timeout=20)
    return report(args, work, peers, kills, rv_restart, bad, rss, t_begin, ghosts, rendezvous)


def _wait_health(url: str, timeout: float = 30.0) -> None:
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.1)


def _ghosts(rv_url: str, run_id: str, token: str, ours: set[str]) -> set[str]:
    """Peer ids the rendezvous lists that are none of ours (a bad request that registered)."""
    from ravnest_jax.swarm.wire._http import signed_json

    async def ask() -> dict:
        async with aiohttp.ClientSession() as s:
            return await signed_json(
                s,
                rv_url,
                "GET",
                f"/v1/runs/{run_id}/peers",
                token=token.encode(),
                run_id=run_id,
                peer="bench",
                timeout=aiohttp.ClientTimeout(total=10),
            )

    try:
        listed = {p["peer_id"] for p in asyncio.run(ask())["peers"]}
    except Exception:  # noqa: BLE001 - the rendezvous restarting
        return set()
    return listed - ours


def _peer_port(rv_url: str, run_id: str, token: str, prefix: str, proc: Proc) -> int:
    """The listening port of ``proc`` (from the rendezvous' peer list, by the process' peer id)."""
    from ravnest_jax.swarm.wire._http import signed_json

    peer_id = next(e["peer"] for e in proc.events if e.get("event") == "compiling")

    async def ask() -> dict:
        async with aiohttp.ClientSession() as s:
            return await signed_json(
                s,
                rv_url,
                "GET",
                f"/v1/runs/{run_id}/peers",
                token=token.encode(),
                run_id=run_id,
                peer="bench",
                timeout=aiohttp.ClientTimeout(total=10),
            )

    peers = asyncio.run(ask())["peers"]
    addr = next(p["address"] for p in peers if p["peer_id"] == peer_id)
    return int(addr.rsplit(":", 1)[1])


def _slope_per_hour(pts: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(seconds, MB)`` points, in MB per hour."""
    if len(pts) < 3:
        return None
    mt = sum(t for t, _ in pts) / len(pts)
    mv = sum(v for _, v in pts) / len(pts)
    den = sum((t - mt) ** 2 for t, _ in pts)
    return 3600 * sum((t - mt) * (v - mv) for t, v in pts) / den if den else None


def _theil_sen_per_hour(pts: list[tuple[float, float]], max_points: int = 600) -> float | None:
    """Theil-Sen slope (the median of the slopes between all pairs of points), in MB per hour:
    a dip (a restart's transient, a trim) or a spike moves it far less than a least-squares fit."""
    if len(pts) > max_points:  # evenly thinned: the pairs grow with the square
        pts = [pts[round(k * (len(pts) - 1) / (max_points - 1))] for k in range(max_points)]
    slopes = sorted((b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(pts) for b in pts[i + 1 :] if b[0] > a[0])
    return 3600 * slopes[len(slopes) // 2] if slopes else None


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


RSS_WARMUP_ROUNDS = 3  # compiled, trained, a round merged and a checkpoint saved (and trimmed)
RSS_MIN_SPAN_S = 300.0  # a slope over less than this says little


def rss_of_process(pts: list[tuple[float, float]], warmup_end: float | None) -> dict:
    """One process' RSS after its warm-up: the median of its first and last minute, the
    maximum, and the slope (MB per hour: least squares over all of it and over its second half,
    and Theil-Sen) when it spans at least ``RSS_MIN_SPAN_S`` seconds. ``pts``: ``(seconds, MB)``;
    ``warmup_end``: seconds (None: the process never finished its warm-up)."""
    after = [(t, v) for t, v in pts if warmup_end is not None and t >= warmup_end]
    out: dict = {
        "warmup_end_s": warmup_end,
        "samples_after_warmup": len(after),
        "span_after_warmup_s": after[-1][0] - after[0][0] if after else 0.0,
        "max_mb_during_warmup": max((v for t, v in pts if warmup_end is None or t < warmup_end), default=None),
    }
    if not after:
        return out
    t0, t1 = after[0][0], after[-1][0]
    out.update(
        {
            "first_minute_mb": _median([v for t, v in after if t <= t0 + 60]),
            "last_minute_mb": _median([v for t, v in after if t >= t1 - 60]),
            "min_mb": min(v for _, v in after),
            "max_mb": max(v for _, v in after),
        }
    )
    if t1 - t0 >= RSS_MIN_SPAN_S:
        out.update(
            {
                "mb_per_hour_least_squares": _slope_per_hour(after),
                "mb_per_hour_least_squares_second_half": _slope_per_hour(after[len(after) // 2 :]),
                "mb_per_hour_theil_sen": _theil_sen_per_hour(after),
                "mb_per_hour_theil_sen_second_half": _theil_sen_per_hour(after[len(after) // 2 :]),
            }
        )
    return out


def rss_report(rss: list, peers: dict, rendezvous: list, t_begin: float) -> dict:
    """RSS per process after its warm-up (:func:`rss_of_process`): a peer process' warm-up ends
    at its ``RSS_WARMUP_ROUNDS``-th round, the rendezvous' 30 s after it started. Keys
    ``"peer0"`` (the survivor, one process), ``"rendezvous"`` (its first process, until the
    restart, and the second), and ``"restarted"`` (every other peer process that lived at least
    ``RSS_MIN_SPAN_S`` seconds after its warm-up)."""

    def pts(name: str, gen: int) -> list[tuple[float, float]]:
        return [(s[0], s[2]) for s in rss if s[1] == name and (s[3] if len(s) > 3 else 0) == gen]

    def warmup(p: Proc) -> float | None:
        rounds = [e["t"] for e in p.events if e.get("event") == "round"]
        return rounds[RSS_WARMUP_ROUNDS - 1] - t_begin if len(rounds) >= RSS_WARMUP_ROUNDS else None

    out: dict = {"warmup": f"a peer: until its round {RSS_WARMUP_ROUNDS}; the rendezvous: 30 s"}
    out["peer0"] = rss_of_process(pts("peer0", 0), warmup(peers[0][0]))
    out["rendezvous"] = [
        rss_of_process(pts("rendezvous", g), r.started - t_begin + 30.0) for g, r in enumerate(rendezvous)
    ]
    restarted = []
    for i, ps in peers.items():
        for g, p in enumerate(ps):
            if i == 0 and g == 0:
                continue
            r = rss_of_process(pts(f"peer{i}", g), warmup(p))
            if r["span_after_warmup_s"] >= RSS_MIN_SPAN_S:
                restarted.append({"peer": f"peer{i}", "process": g, **r})
    out["restarted"] = restarted
    return out


def report(
    args,
    work: Path,
    peers: dict,
    kills: list,
    rv_restart: dict,
    bad: list,
    rss: list,
    t_begin: float,
    ghosts: set,
    rendezvous: list,
) -> int:
    rounds = []  # every round event of every process
    for i, ps in peers.items():
        for gen, p in enumerate(ps):
            for e in p.events:
                if e.get("event") == "round":
                    rounds.append(
                        {
                            **{
                                k: e.get(k)
                                for k in ("swarm_round", "ok", "stall_seconds", "state_digest", "group_size", "error")
                            },
                            "peer": f"peer{i}",
                            "process": gen,
                            "t": e["t"] - t_begin,
                        }
                    )
    by_round: dict[int, set] = {}
    for r in rounds:
        if r["ok"]:
            by_round.setdefault(r["swarm_round"], set()).add(r["state_digest"])
    split = {k: sorted(v) for k, v in by_round.items() if len(v) > 1}
    # kill -> contributing again (wall seconds; rounds between the restarted process' start and
    # its first ok round)
    rejoin = []
    for k in kills:
        p = k.pop("_proc")
        start = next((e for e in p.events if e.get("event") == "start"), None)
        mine = [e for e in p.events if e.get("event") == "round"]
        first_ok = next((j for j, e in enumerate(mine) if e["ok"]), None)
        # swarm rounds from the restarted process' start (training) to its first ok round: the
        # rounds peer 0 finished in between
        swarm_rounds = None
        if start is not None and first_ok is not None:
            swarm_rounds = sum(
                1
                for e in peers[0][-1].events
                if e.get("event") == "round" and start["t"] <= e["t"] < mine[first_ok]["t"]
            )
        k.update(
            {
                "start_at": None if start is None else start["t"] - t_begin,
                "first_ok_round_at": None if first_ok is None else mine[first_ok]["t"] - t_begin,
                "seconds_to_contribute": None if first_ok is None else mine[first_ok]["t"] - t_begin - k["t"],
                "rounds_before_first_ok": first_ok,
                "swarm_rounds_from_start_to_first_ok": swarm_rounds,
                "seconds_restart_to_start": None if start is None else start["t"] - t_begin - k["restarted_at"],
                "killed_again_before_contributing": p.killed_at is not None and first_ok is None,
                "joined": None if start is None else start.get("joined"),
            }
        )
        rejoin.append(k)
    survivor = [r for r in rounds if r["peer"] == "peer0"]
    stalls = sorted(((r["stall_seconds"] or 0.0), r["swarm_round"]) for r in survivor)
    statuses: dict[str, int] = {}
    for _, _label, status in bad:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    refused_4xx = sum(1 for _, _, s in bad if isinstance(s, int) and 400 <= s < 500)
    answered = sum(1 for _, _, s in bad if isinstance(s, int))
    results = {}
    for i, ps in peers.items():
        for p in ps:
            res = next((e["result"] for e in p.events if e.get("event") == "result"), None)
            if res is not None:
                results.setdefault(f"peer{i}", []).append(
                    {
                        k: res[k]
                        for k in (
                            "final_global_digest",
                            "end_step",
                            "rounds",
                            "failed_rounds",
                            "resyncs",
                            "interrupted",
                        )
                    }
                )
    rss0 = [(s[0], s[2]) for s in rss if s[1] == "peer0"]
    third = max(len(rss0) // 3, 1)
    slope = _slope_per_hour(rss0[len(rss0) // 2 :])  # MB per hour over the second half (least squares)
    rss_after_warmup = rss_report(rss, peers, rendezvous, t_begin)
    contributed = [k for k in rejoin if k["rounds_before_first_ok"] is not None]
    part_plus_round = args.part_timeout + args.sync_every * args.step_seconds + 2.0
    out = {
        "benchmark": "chaos",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "config": vars(args),
        "work_dir": str(work),
        "summary": {
            "rounds_total": len(by_round),
            "round_digests_equal_every_round": not split,
            "rounds_with_differing_digests": split,
            "kills": len(kills),
            "killed_while_training": sum(k["was_training"] for k in kills),
            "kills_contributing_again": len(contributed),
            "kills_killed_again_before_contributing": sum(k["killed_again_before_contributing"] for k in rejoin),
            "max_rounds_before_contributing": max((k["rounds_before_first_ok"] for k in contributed), default=None),
            "max_swarm_rounds_from_start_to_contributing": max(
                (k["swarm_rounds_from_start_to_first_ok"] for k in contributed), default=None
            ),
            "median_seconds_restart_to_training": (
                sorted(k["seconds_restart_to_start"] for k in contributed)[len(contributed) // 2]
                if contributed
                else None
            ),
            "median_seconds_kill_to_contributing": (
                sorted(k["seconds_to_contribute"] for k in contributed)[len(contributed) // 2] if contributed else None
            ),
            "max_seconds_kill_to_contributing": max((k["seconds_to_contribute"] for k in contributed), default=None),
            "survivor_longest_stall_seconds": stalls[-1][0] if stalls else None,
            "survivor_longest_stall_round": stalls[-1][1] if stalls else None,
            "bound_part_deadline_plus_one_round_seconds": part_plus_round,
            "survivor_failed_rounds": sum(1 for r in survivor if not r["ok"]),
            "bad_requests_sent": len(bad),
            "bad_requests_answered": answered,
            "bad_requests_4xx": refused_4xx,
            "bad_request_statuses": statuses,
            "rendezvous_restart": rv_restart,
            "ghost_peers_registered": sorted(ghosts),
            "peer0_rss_mb_first_third_mean": sum(v for _, v in rss0[:third]) / third if rss0 else None,
            "peer0_rss_mb_middle_third_mean": (
                sum(v for _, v in rss0[third : 2 * third]) / third if len(rss0) >= 3 else None
            ),
            "peer0_rss_mb_last_third_mean": sum(v for _, v in rss0[-third:]) / third if rss0 else None,
            "peer0_rss_mb_per_hour_second_half": slope,
            "rss_after_warmup": rss_after_warmup,
            "final_digests_equal": len(
                {r["final_global_digest"] for v in results.values() for r in v if not r["interrupted"]}
            )
            == 1,
            "final_digests": sorted(
                {r["final_global_digest"] for v in results.values() for r in v if not r["interrupted"]}
            ),
        },
        "results": results,
        "kills": rejoin,
        "rounds": rounds,
        "rss_mb": rss,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps(out["summary"], indent=1, default=str))
    plot(out, Path(args.out).with_suffix(".png"))
    return 0


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    ax = axes[0]
    names = sorted({r["peer"] for r in out["rounds"]})
    for y, name in enumerate(names):
        ok = [r["t"] for r in out["rounds"] if r["peer"] == name and r["ok"]]
        bad = [r["t"] for r in out["rounds"] if r["peer"] == name and not r["ok"]]
        ax.scatter(ok, [y] * len(ok), s=8, c="tab:green", label="round ok" if y == 0 else None)
        ax.scatter(bad, [y] * len(bad), s=18, c="tab:red", marker="x", label="round failed" if y == 0 else None)
    for k in out["kills"]:
        ax.axvline(k["t"], color="0.6", lw=0.5)
        ax.scatter([k["t"]], [names.index(k["peer"])], marker="v", c="k", s=20)
    if out["summary"]["rendezvous_restart"]:
        for a in axes:
            a.axvline(out["summary"]["rendezvous_restart"]["t"], color="tab:purple", ls="--", lw=1)
    ax.set_yticks(range(len(names)), names)
    ax.set_title("rounds per peer (green ok, red failed); black triangles: kill -9; purple: rendezvous restart")
    ax.legend(loc="upper right", fontsize=7)
    ax = axes[1]
    for name in names:
        rs = [r for r in out["rounds"] if r["peer"] == name]
        ax.plot([r["t"] for r in rs], [r["stall_seconds"] or 0 for r in rs], ".", ms=3, label=name)
    ax.axhline(
        out["summary"]["bound_part_deadline_plus_one_round_seconds"],
        color="tab:red",
        ls=":",
        label="part deadline + one round",
    )
    ax.set_ylabel("stall per round (s)")
    ax.legend(fontsize=7, ncol=5)
    ax = axes[2]
    for name in [*names, "rendezvous"]:
        pts = [(s[0], s[2]) for s in out["rss_mb"] if s[1] == name]
        ax.plot([t for t, _ in pts], [v for _, v in pts], ".", ms=2, label=name)
    warm = (out["summary"].get("rss_after_warmup") or {}).get("peer0", {}).get("warmup_end_s")
    if warm is not None:
        ax.axvline(warm, color="0.3", ls=":", lw=1, label="peer0 warm-up end")
    ax.set_ylabel("RSS (MB)")
    ax.set_xlabel("seconds since start")
    ax.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
