"""Loads a checkpoint directory (config.json, safetensors, tokenizer.json, tokenizer_config.json;
what examples/finetune/train.py --export writes), optionally folds in LoRA adapters in PEFT's
format (--export-adapters), and prints the completion of --prompt (raw text) or --chat (one user
message in the checkpoint's chat template). Stops at EOS / the turn end or --max-new-tokens
(docs/finetuning.md)."""

from __future__ import annotations

import argparse

from ._args import errors, fail, non_negative_float, positive_int, unit_interval

NAME = "generate"
HELP = "generate text from a Hugging Face checkpoint (and PEFT adapters) to look at what a run made"


def run(args: argparse.Namespace) -> int:
    """Prints the completion; exit status 2 with one error line on a bad input."""
    from ravnest_jax.tools import generate_problems, generate_text

    problems = generate_problems(args.model, chat=args.chat, adapters=args.adapters)
    if problems:
        return fail(problems[0])
    with errors(ImportError, prefix="generate needs the llm extra (pip install 'ravnest-jax[llm]'): "), errors():
        text = generate_text(
            args.model,
            prompt=args.prompt,
            chat=args.chat,
            adapters=args.adapters,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            dtype=args.dtype,
        )
    print(text)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``ravnest-jax generate``."""
    p.add_argument("--model", required=True, metavar="DIR", help="the checkpoint directory")
    p.add_argument("--adapters", default=None, metavar="DIR", help="a PEFT LoRA adapter directory to merge in")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", default=None, metavar="TEXT", help="raw text to continue (after the BOS)")
    what.add_argument("--chat", default=None, metavar="TEXT", help="a user message, in the chat template")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N", help="at most N new tokens")
    p.add_argument(
        "--temperature", type=non_negative_float, default=0.0, metavar="T", help="0 (default): greedy; > 0 samples"
    )
    p.add_argument("--top-p", type=unit_interval, default=1.0, metavar="P", help="nucleus sampling mass (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute and parameter dtype")
