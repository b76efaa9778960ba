"""One peer of the main job (``main.py --rendezvous URL ...``): preflight, the mesh of its local
devices, training with overlapped outer rounds, checkpoints, JSON events for the launcher, and
Ctrl+C / SIGTERM handling."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from char_lm.data import check_text, eval_batches, load_corpus, sample_batch
from char_lm.model import ModelConfig, build_model, inner_optimizer, make_evaluator, make_loss, outer_optimizer
from char_lm.report import json_safe


def force_cpu_devices(n: int) -> None:
    """Lets the CPU backend show ``n`` devices (for ``--devices n`` without accelerators). Must
    run before any jax use; without effect on GPU/TPU backends, and once jax has started."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend is already up (for example in a test process)
        pass


def peer_mesh(n: int):
    """The peer's local device mesh: ``n`` devices on one ``"data"`` axis (automatic axes: XLA
    partitions the model code as it is), or ``None`` for one device.

    Raises:
      ValueError: fewer than ``n`` local devices.
    """
    import jax
    from jax.sharding import AxisType

    if n == 1:
        return None
    devices = jax.local_devices()
    if len(devices) < n:
        raise ValueError(f"--devices {n}: this process has {len(devices)} local {jax.default_backend()} devices")
    return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=devices[:n])


def place_on_mesh(mesh, layout: str, params, state):
    """Lays params and optimizer state out on the peer's mesh and returns ``(params, state,
    put_batch)``; ``put_batch(tokens)`` splits a batch over the devices (data parallel).

    ``layout="replicated"``: every device holds all params; ``"fsdp"``: every leaf is split along
    its first axis when that divides evenly (else replicated), and XLA gathers it where used.
    Without a mesh everything stays where it is.
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if mesh is None:
        return params, state, lambda tokens: tokens
    n = mesh.size

    def spec(x):
        if layout == "fsdp" and x.ndim and x.shape[0] % n == 0:
            return NamedSharding(mesh, P("data"))
        return NamedSharding(mesh, P())

    params = jax.device_put(params, jax.tree.map(spec, params))
    # the optimizer state like the params (moments, anchor, outer momentum); scalars replicated
    state = jax.device_put(state, jax.tree.map(spec, state))
    data = NamedSharding(mesh, P("data"))
    return params, state, lambda tokens: jax.device_put(tokens, data)


def _emit(args: argparse.Namespace, **event) -> None:
    """One JSON line on stdout for the launcher (``--json-events``)."""
    if args.json_events:
        print(json.dumps({**event, "t": round(time.time(), 3)}), flush=True)


def warnings_as_log_lines() -> None:
    """Python warnings (a corrupt checkpoint skipped, say) as one log line each, ``... WARNING
    CorruptCheckpointWarning: ...``, not the two lines (message, source line) Python prints."""
    import logging
    import warnings

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        logging.getLogger("py.warnings").warning("%s: %s", category.__name__, message)

    warnings.showwarning = show


def _watch_parent(parent_pid: int) -> None:
    """Stops this peer when the launcher dies (no orphans after a crash or kill -9)."""
    import _thread
    import threading

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                _thread.interrupt_main()
                time.sleep(15)
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def preflight_peer(args: argparse.Namespace) -> tuple[str, str]:
    """Everything a peer can get wrong that is cheap to check, before loading jax or compiling:
    the token, the text, the listen port, the rendezvous and whether it accepts the token.
    Returns ``(token, peer_id)``.

    Raises:
      ValueError, SwarmError: one line naming the problem.
    """
    from ravnest_jax import checkpoint, swarm

    token = swarm.read_token(args.token_file)
    check_text(args.text)
    if not args.no_inbound:
        swarm.check_listen(args.listen)
    swarm.check_rendezvous(args.rendezvous, run_id=args.run_id, token=token)
    if args.peer_id:
        peer_id = args.peer_id
    elif args.checkpoint_dir:  # the same peer after a restart on the same directory
        peer_id = checkpoint.persistent_peer_id(args.checkpoint_dir)
    else:
        import secrets

        peer_id = secrets.token_hex(8)
    return token, peer_id


def run_peer(args: argparse.Namespace) -> dict:
    """One swarm peer: trains ``--max-steps`` inner steps with overlapped outer rounds.

    Ctrl+C (or SIGTERM) stops it within seconds: it saves a checkpoint when no round is in
    flight (with ``--checkpoint-dir``), leaves the swarm and returns its summary so far
    (``"interrupted": true``)."""
    token, peer_id = preflight_peer(args)
    if args.parent_pid:
        _watch_parent(args.parent_pid)
    if args.devices > 1:
        force_cpu_devices(args.devices)
    _emit(args, event="compiling", peer=peer_id)

    import jax
    import optax

    import ravnest_jax as rj
    from ravnest_jax.swarm import Timeouts
    from ravnest_jax.sync import device_digest, digest_hex

    cfg = ModelConfig(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq_len)
    tx = rj.diloco(
        inner_optimizer(args.lr, args.schedule_steps or args.max_steps, args.inner),
        outer_optimizer(args.outer_lr, args.outer_momentum),
        sync_every=args.sync_every,
        fragments=args.fragments,
    )
    timeouts = Timeouts(part=args.part_timeout, round=max(4 * args.part_timeout, 30.0), heartbeat=1.0, eviction=5.0)
    data_seed = args.data_seed if args.data_seed is not None else int(peer_id.encode().hex(), 16) % (1 << 31)
    rounds_log: list[dict] = []
    last_logged_loss: list = [None]

    def on_round(m) -> None:
        rec = dataclasses.asdict(m)
        rec["train_loss"] = last_logged_loss[0]  # this peer's last logged train loss
        rounds_log.append(rec)
        _emit(
            args,
            event="round",
            **{
                k: rec[k]
                for k in (
                    "round",
                    "swarm_round",
                    "step",
                    "ok",
                    "group_size",
                    "bytes_sent",
                    "exchange_seconds",
                    "stall_seconds",
                    "state_digest",
                    "error",
                )
            },
        )

    codec = rj.Codec(
        args.codec,
        block_size=args.block_size,
        fraction=args.topk_fraction,
        mean=args.mean_codec,
        mean_ef=args.mean_ef == "on",
        error_feedback_decay=args.ef_decay,
    )
    # the swarm joins the run only once this peer is compiled and ready: a registered peer is in
    # every round's group, and one still compiling would cost the others a timeout
    swarm_class = rj.Swarm if args.adversary is None else _adversary_swarm(args.adversary)
    swarm = swarm_class(
        args.rendezvous,
        run_id=args.run_id,
        token=token,
        codec=codec,
        listen=None if args.no_inbound else args.listen,
        advertise=args.advertise,
        timeouts=timeouts,
        peer_id=peer_id,
        algorithm=rj.AllReduce(
            aggregator=args.aggregator,
            clip_multiple=None if args.aggregator == "mean" else args.clip_multiple,
        ),
    )
    sync = rj.OuterSync(
        tx,
        swarm,
        eager=args.mode == "eager",
        overlap_steps=0 if args.mode == "blocking" else args.overlap_steps,
        staleness_budget=args.staleness_budget,
        alpha=args.alpha,
        samples_per_step=args.batch_size,
        on_round=on_round,
    )

    def build():
        # settings that differ from the run's (width, codec, H, fragments, ...) are refused now, in
        # one line, before the text is read or the model built (its shapes only: jax.eval_shape)
        sync.declare_manifest(jax.eval_shape(lambda: build_model(cfg, seed=args.seed)[1]))
        train, evald = load_corpus(args.text)
        graphdef, params = build_model(cfg, seed=args.seed)  # identical on every peer
        evaluate = make_evaluator(
            graphdef, eval_batches(evald, batch=32, seq_len=cfg.seq_len, num_batches=args.eval_batches)
        )
        mesh = peer_mesh(args.devices)
        params, state, put_batch = place_on_mesh(mesh, args.layout, params, tx.init(params))
        return train, graphdef, params, evaluate, mesh, state, put_batch

    # the model's eager initialisation compiles op by op: a Ctrl+C there stops at once too
    train, graphdef, params, evaluate, mesh, state, put_batch = interruptible(build)
    loss_fn = make_loss(graphdef)

    def step(params, state, tokens):
        value, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    # on a mesh the step keeps the layouts of params and state (XLA would otherwise choose)
    layouts = (
        None
        if mesh is None
        else (jax.tree.map(lambda x: x.sharding, params), jax.tree.map(lambda x: x.sharding, state), None)
    )
    train_step = jax.jit(step, donate_argnums=(0, 1), out_shardings=layouts)

    n_params = sum(x.size for x in jax.tree.leaves(params))
    save_every = args.checkpoint_every or args.sync_every

    def open_checkpointer():
        # saves happen between rounds (no exchange in flight), at most every `save_every` steps;
        # with overlapped rounds that is once the round merged (tau steps after its boundary)
        meta = {"run_id": args.run_id, "peer": peer_id, "example": "char_lm"}
        return rj.Checkpointer(
            args.checkpoint_dir, max_to_keep=3, save_interval_steps=1, metadata=meta, fresh=args.fresh
        )

    # opened before compiling, so that a directory in use is refused at once; but a peer compiled
    # ahead of its cue (--join-when-exists) takes over a directory whose owner may still run
    ckpt = open_checkpointer() if args.checkpoint_dir and not args.join_when_exists else None

    def compile_all():
        tokens0 = put_batch(sample_batch(train, np.random.default_rng([data_seed, 0]), args.batch_size, cfg.seq_len))
        train_step.lower(params, state, tokens0).compile()
        sync.warmup(params, state)
        return evaluate(state.global_params)

    eval_start = interruptible(compile_all)
    if args.join_when_exists:
        _emit(args, event="ready")
        while not Path(args.join_when_exists).exists():
            time.sleep(0.05)
    if args.checkpoint_dir and ckpt is None:
        ckpt = open_checkpointer()
    wall = 0.0
    interrupted = False
    start_step = int(state.count)
    with swarm, sync:
        listen = "none (client-only)" if swarm.client_only else f"{args.listen.rpartition(':')[0]}:{swarm.port}"
        # join a running swarm (its state), resume this peer's checkpoint, or restart a whole
        # swarm from the checkpoint step every peer has; the driver serves our state to joiners
        if args.min_peers > 1:
            print(
                f"waiting until {args.min_peers} peers have registered (--min-peers, up to 300 s)...", file=sys.stderr
            )
        got = rj.sync.join_or_resume(swarm, sync, params, state, checkpointer=ckpt, min_peers=args.min_peers)
        params, state = got.params, got.state
        joined, resumed_from = got.how == "joined", got.resumed_from
        if got.how in ("resumed", "restarted"):
            print(
                f"{'whole-swarm restart: ' if got.how == 'restarted' else ''}resumed from {args.checkpoint_dir} "
                f"at step {resumed_from}",
                file=sys.stderr,
            )
        start_step = int(state.count)
        if joined:
            print(
                f"joined the running swarm at step {start_step} (its state, from a live peer"
                + (f"; not this peer's checkpoint of step {resumed_from})" if resumed_from is not None else ")"),
                file=sys.stderr,
            )
        if joined or resumed_from is not None:  # the loss where this process takes over
            eval_start = evaluate(state.global_params)
        _emit(
            args,
            event="start",
            peer=swarm.peer_id,
            step=start_step,
            eval_loss=eval_start,
            params=int(n_params),
            joined=joined,
        )
        bar = None
        if not args.json_events and not args.no_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=args.max_steps, initial=start_step, desc=f"peer {swarm.peer_id}", dynamic_ncols=True)
        t0 = t_step = time.perf_counter()
        last_loss = None
        t = last_saved = start_step

        def save(at: int) -> None:
            ckpt.save(at, params=params, opt_state=state, extra=rj.sync.checkpoint_extra(sync, params), force=True)
            swarm.set_info({**swarm.info, "checkpoint_steps": ckpt.saved_steps()})

        consistent = True  # params, state and sync agree (not in the middle of a step)
        try:
            while t < args.max_steps:
                if _LOOP["stop"]:
                    raise KeyboardInterrupt
                consistent = False
                tokens = put_batch(
                    sample_batch(train, np.random.default_rng([data_seed, t]), args.batch_size, cfg.seq_len)
                )
                params, state, value = train_step(params, state, tokens)
                params, state = sync(params, state)
                sync.report(train_loss=value)  # the status page's loss (read at the next round)
                t_prev, t = t, sync.step  # steps done; a resync may move this peer to the swarm's step
                consistent = True
                if ckpt is not None and sync.pending == 0 and t - last_saved >= save_every:
                    save(t)
                    last_saved = t
                if args.min_step_seconds > 0:
                    value.block_until_ready()
                    time.sleep(max(0.0, args.min_step_seconds - (time.perf_counter() - t_step)))
                t_step = time.perf_counter()
                if t // args.log_every > t_prev // args.log_every:
                    # read the loss of the previous log point: long computed, so no stall here
                    shown = None if last_loss is None else float(last_loss)
                    last_loss = value
                    last_logged_loss[0] = shown
                    _emit(args, event="progress", step=t, loss=shown)
                    if bar is not None:
                        bar.update(t - bar.n)
                        if shown is not None:
                            bar.set_postfix(loss=f"{shown:.3f}", rounds=sum(r["ok"] for r in rounds_log))
            consistent = False
            params, state = sync.flush(params, state)
            consistent = True
        except KeyboardInterrupt:
            # stop within seconds: a round in flight is abandoned (the last checkpoint stands)
            interrupted = True
        # from here a first signal no longer raises (a second one does): the report comes
        _LOOP["defer"] = True
        if interrupted:
            print(f"\npeer {peer_id}: interrupted at step {t}", file=sys.stderr)
        wall = time.perf_counter() - t0
        if ckpt is not None:
            if consistent and sync.pending == 0 and t > last_saved:
                save(t)  # Ctrl+C between steps and rounds: nothing done since is lost
            ckpt.close()
        if bar is not None:
            bar.close()
        eval_end, eval_interrupted = None, False
        try:  # the final eval: Ctrl+C ends it (its figure is then marked interrupted)
            _LOOP["defer"] = False
            if _LOOP["stop"] and not interrupted:  # a signal came in the save just above
                raise KeyboardInterrupt
            if consistent and not interrupted:  # a Ctrl+C in training skips it (its flag stays set)
                _emit(args, event="final_eval", step=t)
                # in a worker thread: a Ctrl+C ends it at once, not after the whole jitted eval
                eval_end = interruptible(lambda: evaluate(state.global_params))
        except KeyboardInterrupt:
            interrupted = eval_interrupted = True
            print(f"\npeer {peer_id}: interrupted in the final eval (training done to step {t})", file=sys.stderr)
        finally:
            _LOOP["defer"] = True
        summary = sync.summary()
        # the digest of the last merge (no compilation at exit); computed only after a resync
        final_digest = sync.global_state_digest or (
            digest_hex(device_digest((state.global_params, state.outer_state))) if consistent else None
        )
    return json_safe(
        {
            "peer": peer_id,
            "run_id": args.run_id,
            "listen": listen,
            "address": swarm.address,
            "interrupted": interrupted,
            "devices": 1 if mesh is None else mesh.size,
            "layout": "single" if mesh is None else args.layout,
            "joined_running_swarm": joined,
            "resumed_from_step": resumed_from,
            "start_step": start_step,
            "end_step": t,
            "steps": t - start_step,
            "params": int(n_params),
            "eval_loss_start": eval_start,
            "eval_loss_end": eval_end,
            "eval_interrupted": eval_interrupted,
            "rounds": summary["rounds"],
            "failed_rounds": summary["failed_rounds"],
            "resyncs": summary["resyncs"],
            "bytes_sent": summary["bytes_sent"],
            "bytes_received": summary["bytes_received"],
            "stall_seconds": summary["stall_seconds"],
            "mean_overlap_steps": summary["mean_overlap_steps"],
            "compute_utilisation": summary["compute_utilisation"],
            "wall_seconds": wall,
            "final_global_digest": final_digest,
            "round_digests": [r["state_digest"] for r in rounds_log if r["ok"]],
            "checkpoint_steps": ckpt.saved_steps() if ckpt is not None else [],
            "round_log": rounds_log,
        }
    )


_STOPPED_BY: list[int] = []
# a stop asked for: the training loop checks it every step, because a KeyboardInterrupt raised
# at an arbitrary point can land in a callback whose exceptions Python ignores (jax's gc
# callback) and be lost (seen in the restart soak test under load)
# "defer": after training, while the peer writes its report: a first signal is only recorded
_LOOP = {"stop": False, "defer": False}


def interruptible(fn):
    """``fn()`` in a daemon thread, the main thread waiting on it in 50 ms joins: Python runs a
    signal handler only between the main thread's bytecodes, so Ctrl+C during an XLA compile
    (seconds on a loaded machine: a CI runner's two cores shared by two peers) would otherwise
    wait for the compile to end, and the launcher kills a peer that has not stopped within
    :data:`char_lm.local.STOP_SECONDS`. Here :func:`_stop`'s KeyboardInterrupt comes at once;
    the thread is left to the process's hard exit (``__main__`` ends with ``os._exit`` after an
    interrupt). Returns ``fn()``'s value; raises what it raised."""
    import threading

    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="char_lm-compile")
    worker.start()
    while worker.is_alive():
        worker.join(0.05)
        if _LOOP["stop"]:  # an interrupt lost in a callback that swallows exceptions
            raise KeyboardInterrupt
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _stop(signum, frame):
    """SIGINT (Ctrl+C) and SIGTERM (``kill``, a scheduler, ``docker stop``) stop like Ctrl+C: a
    peer leaves the swarm at once instead of being evicted after a timeout, and a launcher
    stops its peers. While the peer finishes its report (``_LOOP["defer"]``) only a second
    signal raises."""
    _STOPPED_BY.append(signum)
    first = not _LOOP["stop"]
    _LOOP["stop"] = True
    if not (_LOOP.get("defer") and first):
        raise KeyboardInterrupt


def _adversary_swarm(spec: str) -> type:
    """A swarm peer that misbehaves (``--adversary``, for testing aggregators): it sends its
    pseudo-gradient times F (``"scale:F"``) or Gaussian noise of the pseudo-gradient's norm
    (``"noise"``) in every round, and merges the round's result like any other peer."""
    import ravnest_jax as rj

    kind, _, factor = spec.partition(":")
    rng = np.random.default_rng()

    def spoil(pg: np.ndarray) -> np.ndarray:
        pg = np.asarray(pg, np.float32)
        if kind == "scale":
            return pg * np.float32(float(factor))
        norm = float(np.linalg.norm(pg.astype(np.float64)))
        return (rng.standard_normal(pg.shape) * (norm / max(1.0, pg.size) ** 0.5)).astype(np.float32)

    class Adversary(rj.Swarm):
        def all_reduce_packed_async(self, packed, **kw):  # type: ignore[no-untyped-def]
            # what OuterSync sends: its device-encoded pseudo-gradient (one packed leaf per
            # leaf); decoded, spoiled leaf by leaf and encoded again with the swarm's codec
            import jax

            dec = rj.compress.StreamDecoder()
            for c in rj.compress.packed_to_chunks(packed):
                dec.feed(c)
            leaves = [spoil(x) for x in jax.tree.leaves(dec.finish())]
            bad, _ = rj.compress.device_encode(leaves, self.codec.name, **self.codec.options)
            return super().all_reduce_packed_async(jax.device_get(bad), **kw)

        def all_reduce_async(self, tree, **kw):  # type: ignore[no-untyped-def]
            return super().all_reduce_async({**tree, "pg": spoil(tree["pg"])}, **kw)

    return Adversary
