#!/usr/bin/env python3
"""LoRA fine-tuning over a local swarm, offline by default.

Without ``--checkpoint`` it first makes a tiny Llama-style checkpoint in Hugging Face format
(``config.json``, ``model.safetensors``, a byte-level BPE ``tokenizer.json``; pretrained for a few
seconds on the standard library's Python code; ``tiny.py``) in a temporary directory, then runs
``--local-peers`` peers of ``train.py`` (``ravnest-jax local``) that fine-tune adapters on English
text (``--text``, default: the documentation topics in the standard library), and prints each
peer's summary. Every other option goes to ``train.py`` (``train.py --help`` lists them):

    python examples/finetune/main.py --local-peers 4
    python examples/finetune/main.py --local-peers 2 --quantize int4 --lora-rank 16 --export merged/
    python examples/finetune/main.py --local-peers 2 --checkpoint ~/models/Qwen3-0.6B --text notes.txt --dtype bfloat16
    python examples/finetune/main.py --local-peers 2 --devices 2 --quantize int4   # each peer on 2 devices
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):
    sys.path.insert(0, str(HERE.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
        epilog="Every other option goes to each peer's train.py (--lora-rank, --quantize, --dtype, --devices,\n"
        "--export, --max-steps, ...): see python examples/finetune/train.py --help",
    )
    p.add_argument("--local-peers", type=int, default=4, help="peer processes (default 4)")
    p.add_argument("--checkpoint", default=None, help="a Hugging Face checkpoint directory (default: make a tiny one)")
    p.add_argument("--text", nargs="+", default=None, help="UTF-8 text files (default: the stdlib's docs topics)")
    p.add_argument("--vocab-size", type=int, default=512, help="the tiny checkpoint's BPE vocabulary (default 512)")
    p.add_argument("--codec", default="int4", help="the rounds' wire codec (default int4)")
    p.add_argument("--summary-json", default=None, help="also write the peers' summaries here")
    args, rest = p.parse_known_args(argv)
    if args.local_peers < 1:
        p.error("--local-peers must be >= 1")
    import subprocess

    from finetune.tiny import text_documents
    from finetune.train import parse_args as train_args
    from ravnest_jax.launch import run_local
    from ravnest_jax.models import TransformerConfig

    # train.py's options, checked here once before the tiny checkpoint is made (not after it, by every peer)
    world = os.environ.get("RAVNEST_WORLD_SIZE")
    os.environ["RAVNEST_WORLD_SIZE"] = str(args.local_peers)
    try:
        train_args(["--checkpoint", args.checkpoint or "tiny-llama", *rest])
    finally:
        if world is None:
            del os.environ["RAVNEST_WORLD_SIZE"]
        else:
            os.environ["RAVNEST_WORLD_SIZE"] = world
    try:
        text_documents(args.text)  # checked before anything starts
        if args.checkpoint:
            TransformerConfig.from_hf(args.checkpoint)
    except ValueError as e:
        sys.exit(f"error: {e}")
    text = ["--text", *args.text] if args.text else []
    with tempfile.TemporaryDirectory(prefix="rj-finetune-") as tmp:
        ckpt = args.checkpoint
        if ckpt is None:
            ckpt = str(Path(tmp) / "tiny-llama")
            # in a child: this process forks the peers and must not have started jax's threads
            make = [sys.executable, str(HERE / "tiny.py"), ckpt, "--vocab-size", str(args.vocab_size)]
            if subprocess.run(make, stdout=subprocess.DEVNULL).returncode != 0:  # errors still on stderr
                return 1
            print(
                f"made a tiny Llama-style checkpoint (pretrained briefly on Python code, BPE tokenizer) in {ckpt} "
                "(removed at the end)",
                file=sys.stderr,
            )
        cmd = [str(HERE / "train.py"), "--checkpoint", ckpt, *text, *rest]
        return run_local(cmd, peers=args.local_peers, codec=args.codec, summary_json=args.summary_json)


if __name__ == "__main__":
    sys.exit(main())
