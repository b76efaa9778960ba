"""The rendezvous' status page: who is in a run, who stalls, what each link carries, the rounds.

Served by the rendezvous itself (aiohttp; one HTML file with a little JavaScript, no build step,
nothing from a CDN):

``GET  /``                          the runs (or a login form)
``GET  /runs/{run}``                one run's page, refreshed every 2 s by polling its data
``GET  /data``                      ``{"runs": [{run_id, peers, last_round}]}``
``GET  /runs/{run}/data``           the run's peers and rounds (see :meth:`StatusPage.run_data`)
``POST /login``                     form field ``token``: sets a cookie, redirects to ``/``
``POST /logout``                    clears it

Read access needs the run token or the rendezvous' read-only token (which grants nothing
else): ``Authorization: Bearer TOKEN``, ``?token=TOKEN``, or the cookie the login form sets
(an HMAC of the token, never the token itself). Without it every page is the login form and
every data endpoint answers 401: nothing of a run is shown.

The per-peer numbers are what each peer's ``rj.OuterSync`` publishes after its rounds (the
``"stats"`` of its info, see ``ravnest_jax.sync._stats``); losses appear when peers report them
(``sync.report(train_loss=..., eval_loss=...)``).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from importlib import resources
from typing import Any

from aiohttp import web

from ._rounds import KEEP_ROUNDS, _Run, is_int, is_number

__all__ = ["StatusPage", "note_stats"]

COOKIE = "ravnest_status"
LOSS_NAMES = ("train_loss", "eval_loss")
#: a peer's row: what the rendezvous' membership says of it, and the stats it published after its last round
MEMBER_FIELDS = ("peer_id", "address", "standby", "relayed", "seconds_since_heartbeat", "last_round")
PEER_FIELDS = (
    "step",
    "round",
    "rounds_ok",
    "rounds_failed",
    "resyncs",
    "utilisation",
    "stall_s",
    "bytes_sent",
    "bytes_received",
    "exchange_s",
    "link_mbit",
    "last_error",
    *LOSS_NAMES,
)

_LOGIN = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>ravnest_jax swarm</title>
<style>body{{font:15px system-ui,sans-serif;margin:4em auto;max-width:26em;color:#222}}
input{{font:inherit;padding:.4em;width:100%;box-sizing:border-box;margin:.4em 0}}
button{{font:inherit;padding:.4em 1.2em}}.err{{color:#b00}}</style></head><body>
<h1>ravnest_jax swarm</h1>{message}
<form method="post" action="/login"><label>Run token or read-only token
<input type="password" name="token" autocomplete="current-password" autofocus></label>
<button type="submit">Show the swarm</button></form></body></html>"""


def note_stats(run: _Run, peer: str, info: dict[str, Any] | None) -> None:
    """Keeps the losses a peer published in its stats, by the swarm round they follow (the last
    :data:`KEEP_ROUNDS` rounds), for the per-round means of the page."""
    stats = (info or {}).get("stats")
    if not isinstance(stats, dict):
        return
    rnd = stats.get("round")
    losses = {k: float(v) for k in LOSS_NAMES if is_number(v := stats.get(k))}
    if not is_int(rnd) or rnd < 0 or not losses:
        return
    run.reports.setdefault(rnd, {})[peer] = losses
    for old in sorted(run.reports)[:-KEEP_ROUNDS]:
        del run.reports[old]


def _mac(token: bytes) -> str:
    return hmac.new(token, b"ravnest-status-cookie-v1", hashlib.sha256).hexdigest()


class StatusPage:
    """The status routes of a rendezvous ``rv`` (an ``ravnest_jax.swarm.Rendezvous``).

    Args:
      rv: the rendezvous whose runs are shown (its token grants read access).
      read_token: a second token that grants read access only (bytes, non-empty), or ``None``.
    """

    def __init__(self, rv: Any, read_token: bytes | None = None):
        if read_token is not None and not read_token:
            raise ValueError("the read-only token must not be empty")
        self.rv = rv
        self.tokens = [t for t in (rv.token, read_token) if t]
        self._macs = [_mac(t) for t in self.tokens]
        self._html = resources.files(__package__).joinpath("status.html").read_text(encoding="utf-8")

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/", self._page)
        app.router.add_get("/data", self._runs_data)
        app.router.add_get("/runs/{run_id}", self._page)
        app.router.add_get("/runs/{run_id}/data", self._run_data)
        app.router.add_post("/login", self._login)
        app.router.add_post("/logout", self._logout)

    # -- access --------------------------------------------------------------------------
    def _token_ok(self, given: str) -> bool:
        g = given.encode("utf-8", "surrogateescape")  # a header's raw bytes (not UTF-8: no match)
        return any(hmac.compare_digest(g, t) for t in self.tokens)

    def authorized(self, request: web.Request) -> bool:
        """Whether ``request`` carries a read token (bearer header, ``?token=``, or cookie)."""
        auth = request.headers.get("Authorization", "")
        if auth[:7].lower() == "bearer " and self._token_ok(auth[7:].strip()):
            return True
        if "token" in request.query and self._token_ok(request.query["token"]):
            return True
        cookie = request.cookies.get(COOKIE, "")
        return bool(cookie) and any(hmac.compare_digest(cookie, m) for m in self._macs)

    def _login_page(self, message: str = "", status: int = 401) -> web.Response:
        return _html(_LOGIN.format(message=message), status)

    async def _login(self, request: web.Request) -> web.Response:
        try:
            form = await request.post()
        except Exception:  # noqa: BLE001 - not a form this page sent (bad encoding, broken multipart)
            return self._login_page('<p class="err">That request is not the login form.</p>', status=400)
        token = form.get("token")
        if not isinstance(token, str) or not self._token_ok(token):
            return self._login_page('<p class="err">That token is not this rendezvous\' run or read-only token.</p>')
        i = next(i for i, t in enumerate(self.tokens) if hmac.compare_digest(token.encode(), t))
        resp = _to_index()
        resp.set_cookie(COOKIE, self._macs[i], httponly=True, samesite="Strict", path="/")
        return resp

    async def _logout(self, request: web.Request) -> web.Response:
        resp = _to_index()
        resp.del_cookie(COOKIE, path="/")
        return resp

    # -- pages ---------------------------------------------------------------------------
    async def _page(self, request: web.Request) -> web.Response:
        """The index or a run's page (one HTML file); without access the login form (the
        index's answer, 200; a run page's, 401)."""
        if not self.authorized(request):
            return self._login_page(status=200 if request.path == "/" else 401)
        return _html(self._html)

    async def _runs_data(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return _json({"error": "unauthorized"}, 401)
        runs = sorted(self.rv.runs.values(), key=lambda r: r.run_id)
        rows = [{"run_id": r.run_id, "peers": len(self.rv._live(r)), "last_round": r.latest} for r in runs]
        return _json({"epoch": self.rv.epoch, "runs": rows})

    async def _run_data(self, request: web.Request) -> web.Response:
        run = self.rv.runs.get(request.match_info["run_id"])
        if not self.authorized(request):
            return _json({"error": "unauthorized"}, 401)
        if run is None:
            return _json({"error": "no such run"}, 404)
        return _json(self.run_data(run))

    def run_data(self, run: _Run) -> dict[str, Any]:
        """The data of one run's page.

        Returns a JSON-ready dict: ``run_id``, ``epoch``, ``time`` (unix seconds), ``version``
        (membership), ``last_round``; ``relay``: per client-only peer what the relay carried
        (``messages``, ``failed``, ``bytes_in``, ``bytes_out``, ``seconds``); ``peers``: per
        live peer ``peer_id``, ``address``, ``standby``, ``relayed`` (client-only),
        ``seconds_since_heartbeat``, ``checkpoint_steps`` and what it published
        after its last round (``step``, ``round``, ``rounds_ok``, ``rounds_failed``,
        ``resyncs``, ``utilisation`` 0..1, ``stall_s``, ``bytes_sent``, ``bytes_received``,
        ``exchange_s``, ``link_mbit``, ``last_error``, ``train_loss``, ``eval_loss``; ``None``
        where not published); ``rounds``: the last rounds, oldest first, each ``round``,
        ``outcome`` (``running``, ``ok``, ``failed``, or ``abandoned``: a round created ahead
        at the last commit that every member left before it began, as at the end of a run; the
        peers saw it fail, nothing was lost in it), ``attempts``, ``group`` (of the first
        attempt), ``contributors``, ``left_out`` (in the group, not a contributor of an ok
        round), ``diverged``, ``reason`` (of a failure), ``digest`` (result digest), and the
        mean ``train_loss`` / ``eval_loss`` the peers reported after it with ``reporting``
        (how many).
        """
        membership = self.rv._membership(run)
        peers = []
        for p in membership["peers"]:
            info = p.get("info") or {}
            stats = info.get("stats") if isinstance(info.get("stats"), dict) else {}
            row = {k: p.get(k) for k in MEMBER_FIELDS}
            row["checkpoint_steps"] = info.get("checkpoint_steps")
            row.update({k: stats.get(k) for k in PEER_FIELDS})
            peers.append(row)
        rounds = []
        for r in sorted(run.rounds.values(), key=lambda r: r.number):
            group = list(r.attempts[min(r.attempts)].group)
            got = run.reports.get(r.number, {})
            row = {
                "round": r.number,
                "outcome": "abandoned" if r.abandoned else r.outcome,
                "attempts": len(r.attempts),
                "group": group,
                "contributors": list(r.contributors),
                "left_out": [g for g in group if g not in r.contributors] if r.outcome == "ok" else [],
                "diverged": list(r.diverged),
                "reason": r.reason,
                "digest": r.digest,
                "reporting": len(got),
            }
            for k in LOSS_NAMES:
                xs = [v[k] for v in got.values() if k in v]
                row[k] = sum(xs) / len(xs) if xs else None
            rounds.append(row)
        return {
            "run_id": run.run_id,
            "epoch": self.rv.epoch,
            "time": time.time(),
            "version": membership["version"],
            "last_round": run.latest,
            "peers": peers,
            "rounds": rounds,
            "relay": self.rv.relay.run_stats(run.run_id),
        }


_NO_CACHE = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html", headers=_NO_CACHE)


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.json_response(payload, status=status, headers=_NO_CACHE)


def _to_index() -> web.Response:
    return web.Response(status=303, headers={"Location": "/", **_NO_CACHE})
