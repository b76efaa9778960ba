"""An optional Prometheus endpoint for a peer's round metrics (prometheus-client)."""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from ._outer_sync import RoundMetrics

__all__ = ["PrometheusExporter"]


class PrometheusExporter:
    """Serves a peer's outer-round metrics at ``http://addr:port/metrics``.

    Use it as (or from) the ``on_round`` callback of :class:`rj.OuterSync`::

        with rj.sync.PrometheusExporter(9100) as prom:
            sync = rj.OuterSync(tx, swarm, on_round=prom)

    Metrics (prefix ``ravnest_``): ``rounds_total``, ``failed_rounds_total``,
    ``bytes_sent_total`` / ``bytes_received_total`` (bytes), ``stall_seconds_total`` (seconds),
    and gauges of the last round: ``round``, ``group_size``, ``exchange_seconds``,
    ``codec_ratio``, ``compute_utilisation``, ``step``.

    Args:
      port: TCP port (0 picks a free one; see :attr:`port`).
      addr: address to bind; default loopback (expose it deliberately).

    Raises:
      OSError: the port cannot be bound.
    """

    def __init__(self, port: int = 0, addr: str = "127.0.0.1"):
        self.registry = r = CollectorRegistry()
        self.rounds = Counter("ravnest_rounds", "outer rounds merged", registry=r)
        self.failed = Counter("ravnest_failed_rounds", "outer rounds that failed on this peer", registry=r)
        self.sent = Counter("ravnest_bytes_sent", "body bytes sent in rounds", registry=r)
        self.received = Counter("ravnest_bytes_received", "body bytes received in rounds", registry=r)
        self.stall = Counter("ravnest_stall_seconds", "seconds the training loop waited for rounds", registry=r)
        self.round = Gauge("ravnest_round", "last round number on this peer", registry=r)
        self.step = Gauge("ravnest_step", "inner step of the last round boundary", registry=r)
        self.group = Gauge("ravnest_group_size", "contributors of the last round", registry=r)
        self.exchange = Gauge("ravnest_exchange_seconds", "seconds the last exchange took", registry=r)
        self.ratio = Gauge("ravnest_codec_ratio", "encoded bytes / float32 bytes of the last round", registry=r)
        self.util = Gauge("ravnest_compute_utilisation", "1 - stall / wall since the previous round", registry=r)
        self.clipped = Counter(
            "ravnest_clipped_contributions",
            "contributions scaled down by the clipped mean, by peer",
            ["peer"],
            registry=r,
        )
        self.clipped_now = Gauge("ravnest_clipped_last_round", "contributions clipped in the last round", registry=r)
        self._server, self._thread = start_http_server(port, addr=addr, registry=r)
        self.port: int = self._server.server_port

    def __call__(self, m: RoundMetrics) -> None:
        self.stall.inc(m.stall_seconds)
        if not m.ok:
            self.failed.inc()
            return
        self.rounds.inc()
        self.sent.inc(m.bytes_sent)
        self.received.inc(m.bytes_received)
        self.round.set(m.round)
        self.step.set(m.step)
        self.group.set(m.group_size)
        self.exchange.set(m.exchange_seconds)
        if not math.isnan(m.codec_ratio):
            self.ratio.set(m.codec_ratio)
        self.util.set(m.compute_utilisation)
        self.clipped_now.set(len(m.clipped))
        for peer in m.clipped:
            self.clipped.labels(peer=peer).inc()

    def close(self) -> None:
        """Stops the HTTP server and frees the port. Idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None

    def __enter__(self) -> PrometheusExporter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
