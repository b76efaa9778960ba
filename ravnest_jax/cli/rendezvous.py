"""Run the rendezvous: the one HTTP service (one URL) where the peers of a run join, heartbeat, get
the group of every round and vote on its outcome. It keeps its state in memory; if it restarts,
peers re-register by themselves. Every request must be signed with the run token, read from
--token-file or $RAVNEST_TOKEN. Stop it with Ctrl+C or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl

from ._args import add_token_file, check_eviction, port, positive_float, run_token

NAME = "rendezvous"
HELP = "run the rendezvous service peers join"
FORMATTER = argparse.ArgumentDefaultsHelpFormatter


def _exit_with_parent(parent_pid: int) -> None:
    """SIGTERM ourselves (a clean stop) once the process that started us is gone."""
    import signal
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _read_token(read_token_file: str, token: str) -> str:
    """The read-only token of ``--read-token-file``, which must differ from the run token."""
    from ravnest_jax.swarm import read_token

    try:
        read = read_token(read_token_file)
    except ValueError as e:
        raise SystemExit(f"error: {str(e).replace('--token-file', '--read-token-file')}") from None
    if read == token:
        raise SystemExit("error: --read-token-file holds the run token: a read-only token must differ")
    return read


def run(args: argparse.Namespace) -> int:
    """Serves the rendezvous until Ctrl+C or SIGTERM."""
    from ravnest_jax.swarm import serve_rendezvous  # no jax import

    check_eviction(args.heartbeat, args.eviction)
    if args.exit_with_parent:
        _exit_with_parent(os.getppid())
    token = run_token(args.token_file)
    read_token = _read_token(args.read_token_file, token) if args.read_token_file else ""
    ctx = None
    if args.certfile:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(args.certfile, args.keyfile)
        except (OSError, ssl.SSLError) as e:
            raise SystemExit(f"error: --certfile/--keyfile: {e}") from None
    level = logging.WARNING if args.quiet else (logging.DEBUG if args.verbose else logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s")
    scheme = "https" if ctx else "http"

    def ready(port: int) -> None:
        print(f"rendezvous listening on {scheme}://{args.host}:{port}", flush=True)
        if not args.quiet:
            print(f"status page: {scheme}://{args.host}:{port}/ (the run token or the read-only token)", flush=True)
        if args.port_file:
            tmp = args.port_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(port))
            os.replace(tmp, args.port_file)

    try:
        asyncio.run(
            serve_rendezvous(
                args.host,
                args.port,
                token,
                heartbeat_s=args.heartbeat,
                eviction_s=args.eviction,
                ssl_context=ctx,
                ready=ready,
                read_token=read_token,
                probe_s=args.probe_timeout,
                relay_rate_bytes_s=args.relay_max_mbit * 1e6 / 8 if args.relay_max_mbit else None,
                relay_max_queued_bytes=int(args.relay_max_queued_mb * (1 << 20)),
            )
        )
    except KeyboardInterrupt:  # pragma: no cover - signal handlers normally catch it
        pass
    except OSError as e:  # the address is taken, not ours, ...
        raise SystemExit(f"error: cannot listen on {args.host}:{args.port}: {e}") from None
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ravnest-jax rendezvous``."""
    p.add_argument("--host", default="0.0.0.0", help="address to bind (0.0.0.0: all)")
    p.add_argument("--port", type=port, default=8765, help="TCP port (0: any free port)")
    add_token_file(p)
    p.add_argument(
        "--read-token-file",
        help="file holding a second token that only opens the status page at / (for people who watch)",
    )
    p.add_argument(
        "--heartbeat", type=positive_float, default=2.0, help="heartbeat interval peers are told to use, seconds"
    )
    p.add_argument("--eviction", type=positive_float, default=10.0, help="drop a peer silent for this long, seconds")
    p.add_argument("--certfile", help="PEM certificate: serve HTTPS (with --keyfile)")
    p.add_argument("--keyfile", help="PEM private key for --certfile")
    p.add_argument("--port-file", help="write the bound port to this file once listening")
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this one exits (for launchers)",
    )
    p.add_argument(
        "--probe-timeout",
        type=float,
        default=2.0,
        help="seconds to probe a joining peer's address; a peer not reachable there is relayed (0: no probe)",
    )
    p.add_argument(
        "--relay-max-mbit",
        type=positive_float,
        default=None,
        help="bound the relay of client-only peers to this many Mbit/s (none: unbounded)",
    )
    p.add_argument(
        "--relay-max-queued-mb",
        type=positive_float,
        default=1024.0,
        help="request bodies the relay holds at once at most, MiB (503 beyond)",
    )
    p.add_argument("--quiet", action="store_true", help="log warnings only")
    p.add_argument("--verbose", action="store_true", help="also log every vote (debug)")
