"""Ask a rendezvous for the status of one run: live peers (addresses, last round, heartbeat age),
membership version and the outcome, contributors and digest of recent rounds."""

from __future__ import annotations

import argparse
import json

from ._args import add_token_file, fail, positive_float, run_token

NAME = "status"
HELP = "print a run's status as JSON"


def run(args: argparse.Namespace) -> int:
    """Prints the run's status as JSON, or one error line (exit status 1)."""
    from ravnest_jax.tools import describe_request_error, fetch_status

    token = run_token(args.token_file).encode()
    try:
        answer = fetch_status(args.url, args.run_id, token, timeout=args.timeout)
    except Exception as e:  # noqa: BLE001 - one line in words, exit non-zero
        return fail(describe_request_error(e, args.url, timeout=args.timeout), 1)
    print(json.dumps(answer, indent=1))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ravnest-jax status``."""
    p.add_argument("url", help="rendezvous URL, e.g. http://10.0.0.1:8765")
    p.add_argument("--run-id", required=True)
    add_token_file(p)
    p.add_argument("--timeout", type=positive_float, default=10.0, help="seconds")
