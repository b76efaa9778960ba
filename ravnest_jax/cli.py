"""Command line: ``ravnest-jax <command>``. Commands: ``rendezvous``, ``status``, ``local``,
``plan-memory``, ``plan``, ``report``, ``finetune``, ``generate``.

Each command is a subparser registered in :func:`build_parser`, so other layers can add theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path

from ravnest_jax.tools._argtypes import port as _port
from ravnest_jax.tools._argtypes import positive_float as _positive_float
from ravnest_jax.tools._argtypes import positive_int as _positive_int

TOKEN_ENV = "RAVNEST_TOKEN"


def _read_token(args: argparse.Namespace) -> str:
    from ravnest_jax.swarm import read_token

    try:
        return read_token(args.token_file, env=TOKEN_ENV)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


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


def _cmd_rendezvous(args: argparse.Namespace) -> int:
    from ravnest_jax.swarm._rendezvous_serve import serve  # no jax import

    if args.eviction <= args.heartbeat:
        raise SystemExit(f"error: --eviction ({args.eviction}) must be longer than --heartbeat ({args.heartbeat})")
    if args.exit_with_parent:
        _exit_with_parent(os.getppid())
    token = _read_token(args)
    read_token = ""
    if args.read_token_file:
        from ravnest_jax.swarm import read_token as _read

        try:
            read_token = _read(args.read_token_file)
        except ValueError as e:
            raise SystemExit(f"error: {str(e).replace('--token-file', '--read-token-file')}") from None
        if read_token == token:
            raise SystemExit("error: --read-token-file holds the run token: a read-only token must differ")
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
            serve(
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


def _cmd_local(args: argparse.Namespace) -> int:
    from ravnest_jax.launch import assign_devices, check_command, run_local, visible_gpus  # no jax import

    if args.eviction <= args.heartbeat:
        raise SystemExit(f"error: --eviction ({args.eviction}) must be longer than --heartbeat ({args.heartbeat})")
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


def _cmd_status(args: argparse.Namespace) -> int:
    from ravnest_jax.tools._status_cli import cmd_status

    return cmd_status(args, _read_token(args).encode())


def _cmd_plan_memory(args: argparse.Namespace) -> int:
    if args.devices < 1:
        print(f"error: --devices must be >= 1, got {args.devices}", file=sys.stderr)
        return 2
    try:
        if args.devices > 1:  # CPU devices to compile the sharded step for, before jax starts
            import jax

            jax.config.update("jax_num_cpu_devices", args.devices)
        from ravnest_jax.models import LoraConfig
        from ravnest_jax.models._plan import load_config, plan_json, plan_memory

        cfg = load_config(args.config)  # checked before anything traces
        lora = LoraConfig(
            rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets=tuple(args.lora_targets), train_a=not args.frozen_a
        )
        if args.stages is not None:
            return _plan_stages(args, cfg, lora)
        plan = plan_memory(
            cfg,
            lora=lora,
            quantize=args.quantize,
            batch=args.batch,
            seq_len=args.seq_len,
            dtype=args.dtype,
            remat=args.remat,
            devices=args.devices,
            attention=args.attention,
            loss_chunk=args.loss_chunk,
            micro_batches=args.micro_batches,
        )
    except ImportError as e:
        print(f"error: plan-memory needs the llm extra (pip install 'ravnest-jax[llm]'): {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    q = args.quantize or args.dtype
    remat = "no remat" if args.remat == "none" else f"remat {args.remat}"
    remat += f", attention {args.attention}, loss chunk {args.loss_chunk}, micro-batches {args.micro_batches}"
    where = "" if args.devices == 1 else f", FSDP over {args.devices} devices (bytes of one)"
    print(
        f"{args.config}: LoRA rank {args.lora_rank}, base {q}, batch {args.batch} x {args.seq_len} tokens, "
        f"{args.dtype}, {remat}{where}"
    )
    print(plan.table())
    if args.device_gib:
        from ravnest_jax.models import allocator_pool_bytes
        from ravnest_jax.models._plan import POOL_RESERVE

        card = int(args.device_gib * 1024**3)
        pool = allocator_pool_bytes(card)
        verdict = "fits" if plan.fits(card) else "does not fit"
        each = "" if args.devices == 1 else " on each device"
        print(
            f"{verdict} in the {pool / 1024**3:.2f} GiB pool JAX's allocator takes of {args.device_gib:g} GiB{each} "
            f"(leaving {POOL_RESERVE:.0%} of it; XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 raises the pool)"
        )
    if args.json:
        Path(args.json).write_text(
            plan_json(
                plan,
                config=str(args.config),
                quantize=args.quantize,
                batch=args.batch,
                seq_len=args.seq_len,
                dtype=args.dtype,
                remat=args.remat,
                attention=args.attention,
                loss_chunk=args.loss_chunk,
                micro_batches=args.micro_batches,
            )
            + "\n"
        )
    return 0


def _size(b: float) -> str:
    return f"{b / 1024**3:.2f} GiB" if b >= 1024**3 / 10 else f"{b / 1024**2:.2f} MiB"


def _plan_stages(args: argparse.Namespace, cfg, lora) -> int:
    """``plan-memory --stages S``: each pipeline stage's bytes against a card's allocator pool."""
    import dataclasses
    import json

    from ravnest_jax.models import allocator_pool_bytes
    from ravnest_jax.pipeline._stage_memory import POOL_RESERVE, plan_stage_memory, pool_message

    if args.devices != 1:
        print("error: --stages plans one device per stage: drop --devices", file=sys.stderr)
        return 2
    try:
        plan = plan_stage_memory(
            cfg,
            stages=args.stages,
            lora=lora,
            quantize=args.quantize,
            micro_batch=args.batch,
            seq_len=args.seq_len,
            dtype=args.dtype,
            in_flight=args.in_flight,
            remat=args.remat != "none",
        )
        card = int(args.device_gib * 1024**3)
        pool = allocator_pool_bytes(card)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fraction = os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or "0.75"
    widths = ", ".join(f"{k} {v} bits" for k, v in plan.widths.items())
    print(
        f"{args.config}: {args.stages} stages, LoRA rank {args.lora_rank}, base {args.quantize or args.dtype}, "
        f"micro-batch {args.batch} x {args.seq_len} tokens, {args.dtype}, {'no remat' if args.remat == 'none' else 'remat ' + args.remat}"
    )
    print(f"device widths measured here: {widths}; pool: {args.device_gib:g} GiB x {fraction} (JAX's allocator)")
    print(plan.table(pool))
    bad = [s for s in plan.stages if not s.fits(pool)]
    worst = min(s.headroom(pool) for s in plan.stages)
    if bad:
        s = max(bad, key=lambda s: s.total)
        print(
            f"does not fit {args.stages} x {args.device_gib:g} GiB: stage {s.stage} needs {_size(s.total)} "
            f"(with {POOL_RESERVE:.0%} of the pool free), the pool is {_size(pool)}; {pool_message()}"
        )
    else:
        print(
            f"fits {args.stages} x {args.device_gib:g} GiB with {worst:.1%} headroom in the pool (the least of the stages)"
        )
    if args.json:
        rows = [{**dataclasses.asdict(s), "total": s.total, "headroom": s.headroom(pool)} for s in plan.stages]
        out = dict(config=str(args.config), quantize=args.quantize, micro_batch=args.batch, seq_len=args.seq_len)
        out.update(dtype=args.dtype, device_bytes=card, pool_bytes=pool, widths=plan.widths, stages=rows)
        Path(args.json).write_text(json.dumps(out) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ravnest-jax", description="ravnest_jax: decentralized DiLoCo training.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    r = sub.add_parser(
        "rendezvous",
        help="run the rendezvous service peers join",
        description="Run the rendezvous: the one HTTP service (one URL) where the peers of a "
        "run join, heartbeat, get the group of every round and vote on its outcome. It keeps "
        "its state in memory; if it restarts, peers re-register by themselves. Every request "
        f"must be signed with the run token, read from --token-file or ${TOKEN_ENV}. Stop it "
        "with Ctrl+C or SIGTERM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    r.add_argument("--host", default="0.0.0.0", help="address to bind (0.0.0.0: all)")
    r.add_argument("--port", type=_port, default=8765, help="TCP port (0: any free port)")
    r.add_argument("--token-file", help=f"file holding the run token (else ${TOKEN_ENV})")
    r.add_argument(
        "--read-token-file",
        help="file holding a second token that only opens the status page at / (for people who watch)",
    )
    r.add_argument(
        "--heartbeat", type=_positive_float, default=2.0, help="heartbeat interval peers are told to use, seconds"
    )
    r.add_argument("--eviction", type=_positive_float, default=10.0, help="drop a peer silent for this long, seconds")
    r.add_argument("--certfile", help="PEM certificate: serve HTTPS (with --keyfile)")
    r.add_argument("--keyfile", help="PEM private key for --certfile")
    r.add_argument("--port-file", help="write the bound port to this file once listening")
    r.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this one exits (for launchers)",
    )
    r.add_argument(
        "--probe-timeout",
        type=float,
        default=2.0,
        help="seconds to probe a joining peer's address; a peer not reachable there is relayed (0: no probe)",
    )
    r.add_argument(
        "--relay-max-mbit",
        type=_positive_float,
        default=None,
        help="bound the relay of client-only peers to this many Mbit/s (default: unbounded)",
    )
    r.add_argument(
        "--relay-max-queued-mb",
        type=_positive_float,
        default=1024.0,
        help="request bodies the relay holds at once at most, MiB (503 beyond)",
    )
    r.add_argument("--quiet", action="store_true", help="log warnings only")
    r.add_argument("--verbose", action="store_true", help="also log every vote (debug)")
    r.set_defaults(func=_cmd_rendezvous)
    st = sub.add_parser(
        "status",
        help="print a run's status as JSON",
        description="Ask a rendezvous for the status of one run: live peers "
        "(addresses, last round, heartbeat age), membership version and the "
        "outcome, contributors and digest of recent rounds.",
    )
    st.add_argument("url", help="rendezvous URL, e.g. http://10.0.0.1:8765")
    st.add_argument("--run-id", required=True)
    st.add_argument("--token-file", help=f"file holding the run token (else ${TOKEN_ENV})")
    st.add_argument("--timeout", type=_positive_float, default=10.0, help="seconds")
    st.set_defaults(func=_cmd_status)
    lo = sub.add_parser(
        "local",
        help="run N peers of a training script on this machine (torchrun-style)",
        usage="ravnest-jax local --peers N [options] -- python SCRIPT [ARGS]",
        description="Start a rendezvous on 127.0.0.1 and N processes of SCRIPT. Each peer gets "
        "RAVNEST_RENDEZVOUS, RAVNEST_RUN_ID, RAVNEST_TOKEN, RAVNEST_PEER_ID (peer0, peer1, ...), "
        "RAVNEST_LISTEN, RAVNEST_RANK and RAVNEST_WORLD_SIZE (and RAVNEST_CODEC with --codec); "
        "rj.Swarm() reads them when its arguments are left out. The peers' output is shown "
        "prefixed with their names; at the end every peer's OuterSync summary is printed. "
        "Ctrl+C stops every peer (a second Ctrl+C kills them). On a machine with GPUs each peer "
        "gets its own (CUDA_VISIBLE_DEVICES, LOCAL_RANK); JAX's persistent compilation cache is on.",
    )
    lo.add_argument("--peers", type=_positive_int, required=True, metavar="N", help="peer processes to start")
    lo.add_argument(
        "--codec",
        default=None,
        metavar="CODEC",
        help="sets RAVNEST_CODEC, the wire codec of a script that leaves rj.Swarm(codec=) out: fp32, fp16, "
        "bf16, int8, int4, fp4, int2, sign or topk (default: what the script sets, else fp32)",
    )
    lo.add_argument("--run-id", default=None, help="run id (default: local- and 6 random hex digits)")
    lo.add_argument(
        "--heartbeat", type=_positive_float, default=1.0, metavar="S", help="heartbeat interval, seconds (default 1)"
    )
    lo.add_argument(
        "--eviction",
        type=_positive_float,
        default=5.0,
        metavar="S",
        help="drop a peer silent this long, seconds (default 5)",
    )
    lo.add_argument(
        "--no-progress", action="store_true", help="no progress line (off anyway when stderr is no terminal)"
    )
    lo.add_argument(
        "--summary-json", default=None, metavar="PATH", help="write the peers' exit codes and summaries here"
    )
    lo.add_argument(
        "--devices-per-peer",
        type=_positive_int,
        default=None,
        metavar="K",
        help="GPUs per peer: peer i gets GPUs [i*K, (i+1)*K) of the visible ones (default: split them "
        "evenly; more peers than GPUs share them round-robin, each with its share of the memory)",
    )
    lo.add_argument(
        "--compile-cache-dir",
        default=None,
        metavar="DIR",
        help="JAX's persistent compilation cache for the peers (default: $JAX_COMPILATION_CACHE_DIR, "
        "else $XDG_CACHE_HOME/ravnest_jax/xla or ~/.cache/ravnest_jax/xla)",
    )
    lo.add_argument(
        "--no-compile-cache", action="store_true", help="no persistent compilation cache: every peer compiles"
    )
    lo.add_argument("command", nargs=argparse.REMAINDER, help="-- then the peer command, e.g. python train.py")
    lo.set_defaults(func=_cmd_local)
    pm = sub.add_parser(
        "plan-memory",
        help="device bytes of one LoRA/QLoRA fine-tuning peer, computed without allocating",
        description="Device bytes of one LoRA / QLoRA fine-tuning peer (base, adapters, optimizer, anchor and "
        "outer state, activations), from jax.eval_shape and XLA's plan of the compiled step; nothing is "
        "allocated. Presets: llama-3.2-1b, llama-3.1-8b, llama-3.1-70b, qwen3-8b.",
    )
    pm.add_argument("--config", required=True, help="config.json, a checkpoint directory, or a preset name")
    pm.add_argument("--lora-rank", type=int, default=16, help="adapter rank (default 16)")
    pm.add_argument("--lora-targets", nargs="+", default=["q", "k", "v", "o", "gate", "up", "down"], help="projections")
    pm.add_argument("--frozen-a", action="store_true", help="A frozen, only B trains (default: both train)")
    pm.add_argument("--quantize", choices=["int8", "int4", "nf4"], default=None, help="the frozen base's storage")
    pm.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    pm.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    pm.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype")
    pm.add_argument(
        "--remat",
        choices=["full", "dots", "offload", "none"],
        default="full",
        help="gradient checkpointing of the step (default full: recompute each block)",
    )
    pm.add_argument("--no-remat", dest="remat", action="store_const", const="none", help="the same as --remat none")
    pm.add_argument(
        "--attention",
        choices=["auto", "cudnn", "chunked", "xla"],
        default="auto",
        help="the model's attention implementation (default auto; XLA's CPU plan: cudnn is a GPU's)",
    )
    pm.add_argument("--loss-chunk", type=int, default=1024, help="tokens per cross-entropy chunk (default 1024)")
    pm.add_argument(
        "--micro-batches", type=int, default=1, help="gradient-accumulation slices of the batch (default 1)"
    )
    pm.add_argument(
        "--devices",
        type=int,
        default=1,
        help="the peer's devices: bytes of one when the model lies FSDP-style over all of them "
        "(load_pretrained(mesh=)) and the batch is split (default 1)",
    )
    pm.add_argument(
        "--stages",
        type=int,
        default=None,
        help="pipeline stages: one row per stage (base, adapters + optimizer + outer, activations of the "
        "micro-batches in flight, one block's working set) against the pool of a --device-gib card; "
        "--batch is the micro-batch",
    )
    pm.add_argument("--in-flight", type=int, default=None, help="with --stages: the schedule's depth (default S)")
    pm.add_argument(
        "--device-gib",
        type=float,
        default=24.0,
        help="say whether it fits in the pool JAX's allocator takes of a card of this much (default 24; "
        "the pool is XLA_PYTHON_CLIENT_MEM_FRACTION of it, 0.75 unless set)",
    )
    pm.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON here")
    pm.set_defaults(func=_cmd_plan_memory)
    from ravnest_jax.tools._generate_cli import add_generate

    add_generate(sub)  # generate
    from ravnest_jax.tools._cli import add_parsers

    add_parsers(sub)  # plan, report
    from ravnest_jax.tools._finetune_cli import add_finetune

    add_finetune(sub)  # finetune
    from ravnest_jax.tools._adapters_cli import add_adapters

    add_adapters(sub)  # assemble-adapters, merge-adapters
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ravnest-jax``. Returns the process exit status."""
    args = build_parser().parse_args(argv)
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return status
    except BrokenPipeError:  # stdout closed early (``... | head``): stop quietly, as ``cat`` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141


if __name__ == "__main__":
    sys.exit(main())
