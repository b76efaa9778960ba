"""The rendezvous: membership, round groups and the per-phase votes of every run.

It keeps its state in memory. After a restart it has a new ``epoch``; peers re-register with
their next heartbeat, a vote for a round of an old epoch is answered ``fail`` with the new epoch
(its members then begin the same round again here) and the next round starts after the highest
round any peer reports.

HTTP API (every ``/v1`` request is signed, see :mod:`..wire._auth`; answers are signed too):

``GET  /health``                                   ``{"ok": true, "epoch": ...}`` (no auth)
``POST /v1/runs/{run}/join``       ``{peer_id, address, last_round, info?}``
``POST /v1/runs/{run}/heartbeat``  ``{peer_id, address, last_round, info?}`` (registers if unknown)
``POST /v1/runs/{run}/leave``      ``{peer_id}``
``POST /v1/runs/{run}/ready``      ``{peer_id, address, last_round}`` (standby over: it trains)
``POST /v1/runs/{run}/manifest``   ``{peer_id, manifest, check?, init?}`` -> ``{refused, init, init_from}`` (:mod:`..wire._manifest`)
``GET  /v1/runs/{run}/peers``                      live peers
``GET  /v1/runs/{run}/status``                     peers, membership version, recent rounds
``POST /v1/runs/{run}/rounds/begin`` ``{peer_id, address, after, part_s, grace_s, max_attempts,
wait_s}`` -> ``{epoch, round, attempt, group}``
``POST /v1/runs/{run}/rounds/{r}/vote`` ``{peer_id, epoch, attempt, phase, data}`` -> decision

The status page (``/``, ``/runs/{run}``, their ``/data``; read token, not signed): :mod:`._status`.
The relay of client-only peers, and the reachability probe of a join (its answer's
``reachable``): :mod:`._relay`. :func:`serve` runs it as a server.

A process that joins a run which has had rounds is on *standby* until it first asks for a round:
it is in no new round's group meanwhile (it is downloading the swarm's state, or restoring a
checkpoint), so a join costs the others no part deadline. When the first to ask after joining
finds no other peer ready (the whole swarm restarted), every live peer is in the round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import ssl as _ssl
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
from aiohttp import web

from ..wire import _auth
from ..wire._http import json_response, read_json_body, verify_request
from ..wire._manifest import check_manifest, refusal_line
from ..wire._relay import is_relay_address
from ..wire._types import check_info
from ._relay import Relay, probe
from ._rounds import MAX_PEERS_PER_RUN, MAX_RUNS, RoundHandlers, _Attempt, _Peer, _Round, _Run
from ._status import StatusPage, note_stats

log = logging.getLogger("ravnest_jax.swarm.rendezvous")


class Rendezvous(RoundHandlers):
    """The rendezvous service as an aiohttp application.

    Args:
      token: the run token every request must prove (str or bytes, non-empty).
      heartbeat_s: the heartbeat interval peers are told to use, seconds.
      eviction_s: a peer silent for longer than this is dropped, seconds.
      read_token: a token that grants read access to the status page only (see :mod:`._status`).
      probe_s: how long the reachability probe of a joining peer may take, seconds (0: no probe).
      relay_rate_bytes_s: bytes per second the relay carries at most (``None``: unbounded).
      relay_max_queued_bytes: request bodies the relay holds at once at most, bytes.
    """

    def __init__(
        self,
        token: str | bytes,
        *,
        heartbeat_s: float = 2.0,
        eviction_s: float = 10.0,
        read_token: str | bytes = b"",
        probe_s: float = 2.0,
        relay_rate_bytes_s: float | None = None,
        relay_max_queued_bytes: int = 1 << 30,
    ):
        if eviction_s <= heartbeat_s:
            raise ValueError("eviction_s must be longer than heartbeat_s")
        self.token = token.encode() if isinstance(token, str) else bytes(token)
        if not self.token:
            raise ValueError("the token must not be empty")
        self.heartbeat_s, self.eviction_s = heartbeat_s, eviction_s
        self.epoch, self.boot = secrets.token_hex(8), time.monotonic()
        self.runs: dict[str, _Run] = {}
        self.nonces = _auth.NonceCache()
        self._refused_at: dict[str, float] = {}  # address -> when its bad signature was last logged
        self.status = StatusPage(self, (read_token.encode() if isinstance(read_token, str) else read_token) or None)
        self.probe_s = float(probe_s)
        self._session: aiohttp.ClientSession | None = None
        self.relay = Relay(
            self.token, self._is_relayed, max_queued_bytes=relay_max_queued_bytes, rate_bytes_s=relay_rate_bytes_s
        )

    def _is_relayed(self, run_id: str, peer_id: str) -> bool:
        run = self.runs.get(run_id)
        e = run.peers.get(peer_id) if run is not None else None
        return e is not None and is_relay_address(e.address, run_id, peer_id)

    # -- application ---------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_get("/health", self._health)
        self.status.add_routes(app)
        self.relay.add_routes(app)
        p = "/v1/runs/{run_id}"
        app.router.add_post(p + "/join", self._join)
        app.router.add_post(p + "/heartbeat", self._heartbeat)
        app.router.add_post(p + "/leave", self._leave)
        app.router.add_post(p + "/ready", self._ready)
        app.router.add_post(p + "/manifest", self._manifest)
        app.router.add_get(p + "/peers", self._peers)
        app.router.add_get(p + "/status", self._status)
        app.router.add_post(p + "/rounds/begin", self._begin)
        app.router.add_post(p + "/rounds/{round}/vote", self._vote)
        app.cleanup_ctx.append(self._background)
        return app

    async def _background(self, app: web.Application) -> AsyncIterator[None]:
        """While the app runs: the evictor and the probes' client session."""
        evictor = asyncio.create_task(self._evict_loop())
        self._session = aiohttp.ClientSession()
        yield
        evictor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await evictor
        await self._session.close()

    async def _evict_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.heartbeat_s))
            now = time.monotonic()
            for run in self.runs.values():
                for p in [p for p, e in run.peers.items() if now - e.last_seen > self.eviction_s]:
                    log.info("run %s: evicting %s", run.run_id, p)
                    self._drop(run, p)
                    run.note_evicted(p)  # if it comes back (it hung): standby until ready

    # -- helpers -------------------------------------------------------------------------
    async def _auth(self, request: web.Request, create: bool = True) -> tuple[_Run, str, Any]:
        """The run, the signer and the JSON body of a signed request (the run made on its first
        request, unless not ``create``).

        Raises:
          web.HTTPUnauthorized: a bad signature (logged once a minute per address: a peer with
          another token is named in the rendezvous' log, not only in its own). web.HTTPNotFound:
          no such run and not ``create``.
        """
        run_id = request.match_info["run_id"]
        try:
            peer, body_sha = verify_request(request, self.token, run_id, self.nonces)
        except web.HTTPUnauthorized as e:
            now, who = time.monotonic(), request.remote or "?"
            if now - self._refused_at.get(who, -60.0) >= 60.0:
                if len(self._refused_at) >= 1024:  # bounded: forget the addresses logged over a minute ago
                    self._refused_at = {a: t for a, t in self._refused_at.items() if now - t < 60.0}
                self._refused_at[who] = now
                log.warning("refused a request from %s for run %s: %s (another token?)", who, run_id, e.text)
            raise
        payload = await read_json_body(request, body_sha)
        if payload is not None and not isinstance(payload, dict):
            raise web.HTTPBadRequest(text="body must be a JSON object")
        if payload is not None and payload.get("peer_id", peer) != peer:
            raise web.HTTPBadRequest(text="peer_id does not match the signer")
        run = self.runs.get(run_id)
        if run is None and not create:
            raise web.HTTPNotFound(text=f"no run {run_id!r} at this rendezvous: no peer has joined it since it started")
        if run is None:
            if len(self.runs) >= MAX_RUNS or len(run_id) > 128:
                raise web.HTTPBadRequest(text="too many runs or run id too long")
            run = self.runs[run_id] = _Run(run_id)
        return run, peer, payload or {}

    def _reply(self, request: web.Request, run: _Run, payload: Any) -> web.Response:
        return json_response(request, self.token, run.run_id, "rendezvous", payload)

    def _refused(self, run: _Run, peer: str, manifest: Any, *, check: bool = False, init: Any = None) -> list[str]:
        """The differences of ``peer``'s ``manifest`` from the run's (``[]``: admitted, and the
        run's now unless ``check``).

        Raises:
          web.HTTPBadRequest: not a manifest.
        """
        try:
            check_manifest(manifest)
        except ValueError as e:
            raise web.HTTPBadRequest(text=str(e)) from None
        live = {e.peer_id for e in self._live(run)}
        return run.refusal(peer, manifest, live) if check else run.admit(peer, manifest, live, init)

    def _touch(self, run: _Run, peer: str, p: dict[str, Any], *, joining: bool = False) -> tuple[_Peer, bool]:
        address = p.get("address")
        if not isinstance(address, str) or not address.startswith(("http://", "https://")):
            raise web.HTTPBadRequest(text="address must be an http(s) URL")
        if p.get("manifest") is not None and (diffs := self._refused(run, peer, p["manifest"])):
            # a refused peer's heartbeats (they carry its manifest) never register it again
            raise web.HTTPConflict(text=refusal_line(diffs))
        info = p.get("info")
        try:
            check_info({} if info is None else info)
        except ValueError as e:
            raise web.HTTPBadRequest(text=str(e)) from None
        now = time.monotonic()
        e = run.peers.get(peer)
        new = e is None
        if new:
            if len(run.peers) >= MAX_PEERS_PER_RUN:
                raise web.HTTPServiceUnavailable(text="run is full")
            e = run.peers[peer] = _Peer(peer, address, now, now)
            run.version += 1
            log.info("run %s: %s joined at %s", run.run_id, peer, address)
            # evicted (it hung) and beating again: still in its old exchange, without the swarm's
            # state; in no round's group until it is ready (after its resync), as a joiner
            e.standby = e.fresh = run.back_from_eviction(peer) and run.latest is not None
        elif e.address != address:
            e.address = address
            run.version += 1
        if joining:
            if not new:
                # a new process of a known peer id: it takes no part in a round created before
                # now (that round's work of its previous process is lost), and the previous
                # process is gone: no running attempt waits for it
                e.joined = now
                run.version += 1
                self._forget(run, peer)
            e.standby = e.fresh = run.latest is not None
        e.last_seen = now
        if info is not None:
            e.info = info
            note_stats(run, peer, info)
        lr = p.get("last_round")
        if isinstance(lr, int):
            e.last_round = lr if joining else max(e.last_round, lr)
            run.max_reported_round = max(run.max_reported_round, lr)
        return e, new

    def _live(self, run: _Run) -> list[_Peer]:
        now = time.monotonic()
        return sorted((e for e in run.peers.values() if now - e.last_seen <= self.eviction_s), key=lambda e: e.peer_id)

    @staticmethod
    def _running(run: _Run, peer: str) -> Iterator[tuple[_Round, _Attempt]]:
        """``(round, its latest attempt)`` of each running round whose latest attempt has ``peer``."""
        for rnd in run.rounds.values():
            att = rnd.attempts[max(rnd.attempts)]
            if rnd.outcome == "running" and peer in att.group:
                yield rnd, att

    def _membership(self, run: _Run) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "epoch": self.epoch,
            "version": run.version,
            "heartbeat_s": self.heartbeat_s,
            "eviction_s": self.eviction_s,
            "peers": [
                {
                    "peer_id": e.peer_id,
                    "address": e.address,
                    "last_round": e.last_round,
                    "standby": e.standby,
                    "relayed": is_relay_address(e.address, run.run_id, e.peer_id),
                    "seconds_since_heartbeat": round(now - e.last_seen, 3),
                    "info": e.info,
                }
                for e in self._live(run)
            ],
        }

    # -- membership ----------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "epoch": self.epoch, "runs": len(self.runs)})

    async def _join(self, request: web.Request) -> web.Response:
        run, peer, p = await self._auth(request)
        await self._refuse_a_second_process(run, peer, p)
        # a join is a (re)started peer process: its last round is what it says now, not what an
        # earlier process of the same id reported
        e, _ = self._touch(run, peer, p, joining=True)
        out = self._membership(run)
        if not is_relay_address(e.address, run.run_id, peer):
            why_not = await probe(self._session, e.address, peer, self.probe_s)
            out["reachable"] = why_not is None
            if why_not is not None:
                out["unreachable_because"] = why_not
                log.info("run %s: %s is not reachable at %s (%s)", run.run_id, peer, e.address, why_not)
        return self._reply(request, run, out)

    async def _refuse_a_second_process(self, run: _Run, peer: str, p: dict[str, Any]) -> None:
        """A join under the id of a live peer at another address: a restart of that peer (its
        old process is dead, not yet evicted) unless the old address still answers as ``peer``
        (a probe of its ``/health``): then two live processes would share one id (a copied
        checkpoint directory, a reused ``--peer-id``), and the rounds of both would fail.

        Raises:
          web.HTTPConflict: the old process answers; one line that says what to change.
        """
        e, address = run.peers.get(peer), p.get("address")
        if e is None or e.address == address or time.monotonic() - e.last_seen > self.eviction_s:
            return
        if is_relay_address(e.address, run.run_id, peer) or self.probe_s <= 0:
            return  # a client-only peer cannot be asked: taken as a restart
        if await probe(self._session, e.address, peer, min(self.probe_s, 2.0)) is None:
            log.warning("run %s: refused a second process as %s (the first answers at %s)", run.run_id, peer, e.address)
            raise web.HTTPConflict(
                text=f"peer id {peer!r} is in use by a live peer at {e.address}: each process needs its own "
                "(another --peer-id, or a checkpoint directory of its own: the id is saved there)"
            )

    async def _heartbeat(self, request: web.Request) -> web.Response:
        run, peer, p = await self._auth(request)
        _, new = self._touch(run, peer, p)
        # members that left (or were evicted from) the running attempts this peer is in: it
        # stops waiting for their parts at once instead of at the part deadline
        left = [[r.number, a.number, g] for r, a in self._running(run, peer) for g in sorted(a.left)]
        return self._reply(request, run, {"epoch": self.epoch, "version": run.version, "registered": new, "left": left})

    async def _leave(self, request: web.Request) -> web.Response:
        run, peer, _ = await self._auth(request)
        if self._drop(run, peer):
            log.info("run %s: %s left", run.run_id, peer)
        return self._reply(request, run, {"version": run.version})

    def _drop(self, run: _Run, peer: str) -> bool:
        """Removes ``peer`` from the run's membership (and its running attempts); False if it
        was not a member."""
        if run.peers.pop(peer, None) is None:
            return False
        run.version += 1
        self._forget(run, peer)
        self.relay.drop(run.run_id, peer)
        return True

    async def _manifest(self, request: web.Request) -> web.Response:
        run, peer, p = await self._auth(request)
        if p.get("check") is True:  # a peer not yet started asks (it registers later, manifest in hand)
            return self._reply(request, run, {"refused": self._refused(run, peer, p.get("manifest"), check=True)})
        diffs = self._refused(run, peer, p.get("manifest"), init=p.get("init"))
        if diffs:
            log.warning("run %s: refused %s: %s", run.run_id, peer, "; ".join(diffs))
            self._drop(run, peer)  # the run is untouched: as if it had never joined
        return self._reply(request, run, {"refused": diffs, **run.init})

    async def _ready(self, request: web.Request) -> web.Response:
        run, peer, p = await self._auth(request)
        me, _ = self._touch(run, peer, p)
        me.standby = False  # it trains: in the next round that is created
        return self._reply(request, run, {"version": run.version})

    def _forget(self, run: _Run, peer: str) -> None:
        """``peer`` left (or was evicted): no running attempt waits for its votes any longer. A
        phase whose other members have all voted is decided now (a retry without it), instead
        of at the phase deadline."""
        for rnd, att in self._running(run, peer):
            att.left.add(peer)
            for phase in ("gather", "commit"):
                if phase == "commit" and "gather" not in att.decisions:
                    break
                if phase not in att.decisions and set(att.votes.get(phase, {})) | att.left >= set(att.group):
                    self._decide(run, rnd, att, phase)

    async def _peers(self, request: web.Request) -> web.Response:
        run, _, _ = await self._auth(request)
        return self._reply(request, run, self._membership(run))

    async def _status(self, request: web.Request) -> web.Response:
        run, _, _ = await self._auth(request, create=False)
        out = self._membership(run)
        out["run_id"] = run.run_id
        out["last_round"] = run.latest
        out["relay"] = self.relay.run_stats(run.run_id)
        out["rounds"] = [
            {
                "round": r.number,
                "outcome": r.outcome,
                "attempts": len(r.attempts),
                "group": list(r.attempts[max(r.attempts)].group),
                "contributors": list(r.contributors),
                "digest": r.digest,
            }
            for r in sorted(run.rounds.values(), key=lambda r: r.number)
        ]
        return self._reply(request, run, out)


async def serve(
    host: str,
    port: int,
    token: str | bytes,
    *,
    ssl_context: _ssl.SSLContext | None = None,
    ready: Any = None,
    stop: asyncio.Event | None = None,
    **options: Any,
) -> None:
    """Runs a :class:`Rendezvous` (``token``, ``options``: its keyword arguments) as an aiohttp
    server on ``host:port`` until ``stop`` is set (or SIGINT/SIGTERM when ``stop`` is None); the
    ``ravnest-jax rendezvous`` command, the launchers and the tests use it. ``ready(bound_port)``
    is called once the socket listens (``port=0`` picks a free port)."""
    app = Rendezvous(token, **options).make_app()
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_address=True)
        await site.start()
        if ready is not None:
            ready(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        if stop is None:
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
