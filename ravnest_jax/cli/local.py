"""Start a rendezvous on 127.0.0.1 and N processes of SCRIPT. Each peer gets RAVNEST_RENDEZVOUS,
RAVNEST_RUN_ID, RAVNEST_TOKEN, RAVNEST_PEER_ID (peer0, peer1, ...), RAVNEST_LISTEN, RAVNEST_RANK
and RAVNEST_WORLD_SIZE (and RAVNEST_CODEC with --codec); rj.Swarm() reads them when its
arguments are left out. The peers' output is shown prefixed with their names; at the end every
peer's OuterSync summary is printed. Ctrl+C stops every peer (a second Ctrl+C kills them). On a
machine with GPUs each peer gets its own (CUDA_VISIBLE_DEVICES, LOCAL_RANK); JAX's persistent
compilation cache is on."""

from __future__ import annotations

import argparse

from ._args import check_eviction, positive_float, positive_int

NAME = "local"
HELP = "run N peers of a training script on this machine (torchrun-style)"
USAGE = "ravnest-jax local --peers N [options] -- python SCRIPT [ARGS]"


def run(args: argparse.Namespace) -> int:
    """Starts the rendezvous and the peers; returns the launcher's exit status."""
    from ravnest_jax.launch import assign_devices, check_command, run_local, visible_gpus  # no jax import

    check_eviction(args.heartbeat, args.eviction)
    if args.codec is not None:
        from ravnest_jax.swarm import available_codecs

        if args.codec not in available_codecs():
            raise SystemExit(f"error: --codec must be one of {', '.join(available_codecs())}, got {args.codec!r}")
    try:
        check_command(args.command)
        assign_devices(args.peers, visible_gpus(), args.devices_per_peer)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return run_local(
        args.command,
        peers=args.peers,
        codec=args.codec,
        run_id=args.run_id,
        heartbeat=args.heartbeat,
        eviction=args.eviction,
        progress=not args.no_progress,
        summary_json=args.summary_json,
        devices_per_peer=args.devices_per_peer,
        compile_cache=False if args.no_compile_cache else (args.compile_cache_dir or True),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ravnest-jax local``."""
    p.add_argument("--peers", type=positive_int, required=True, metavar="N", help="peer processes to start")
    p.add_argument(
        "--codec",
        default=None,
        metavar="CODEC",
        help="sets RAVNEST_CODEC, the wire codec of a script that leaves rj.Swarm(codec=) out: fp32, bf16, "
        "int8, int4, fp4, int2, sign or topk (default: what the script sets, else fp32)",
    )
    p.add_argument("--run-id", default=None, help="run id (default: local- and 6 random hex digits)")
    p.add_argument(
        "--heartbeat", type=positive_float, default=1.0, metavar="S", help="heartbeat interval, seconds (default 1)"
    )
    p.add_argument(
        "--eviction",
        type=positive_float,
        default=5.0,
        metavar="S",
        help="drop a peer silent this long, seconds (default 5)",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress line (off anyway when stderr is no terminal)"
    )
    p.add_argument(
        "--summary-json", default=None, metavar="PATH", help="write the peers' exit codes and summaries here"
    )
    p.add_argument(
        "--devices-per-peer",
        type=positive_int,
        default=None,
        metavar="K",
        help="GPUs per peer: peer i gets GPUs [i*K, (i+1)*K) of the visible ones (default: split them "
        "evenly; more peers than GPUs share them round-robin, each with its share of the memory)",
    )
    p.add_argument(
        "--compile-cache-dir",
        default=None,
        metavar="DIR",
        help="JAX's persistent compilation cache for the peers (default: $JAX_COMPILATION_CACHE_DIR, "
        "else $XDG_CACHE_HOME/ravnest_jax/xla or ~/.cache/ravnest_jax/xla)",
    )
    p.add_argument(
        "--no-compile-cache", action="store_true", help="no persistent compilation cache: every peer compiles"
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the peer command, e.g. python train.py")
