"""The ``generate`` command of ``ravnest-jax`` (registered by ``ravnest_jax.cli``): prints what a
checkpoint (and PEFT adapters) generates from a prompt or one chat message, to look at what a run
made (docs/finetuning.md, "Look at what the run made")."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ravnest_jax.tools._argtypes import checked as _checked
from ravnest_jax.tools._argtypes import positive_int as _positive_int


def _unit_interval(value: str) -> float:
    return _checked(value, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def _non_negative_float(value: str) -> float:
    return _checked(value, float, lambda v: 0 <= v < float("inf"), "a number >= 0")


def _generate_stop_ids(model_dir: Path, tokenizer, tokenizer_config) -> list[int]:
    """The ids that end a generation: the tokenizer config's ``eos_token`` (an instruct
    checkpoint's turn end), and ``eos_token_id`` of ``config.json`` and ``generation_config.json``."""
    import json

    stops = []
    if tokenizer_config.eos_token is not None and tokenizer.token_to_id(tokenizer_config.eos_token) is not None:
        stops.append(tokenizer.token_to_id(tokenizer_config.eos_token))
    for name in ("config.json", "generation_config.json"):
        f = model_dir / name
        eos = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and i not in stops:
                stops.append(i)
    return stops


def _generate_prompt_ids(args: argparse.Namespace, model_dir: Path, tokenizer, tokenizer_config) -> list[int]:
    """``--chat``: the user message in the chat template with the generation prompt, tokenised
    without special tokens (the template writes the BOS); ``--prompt``: the text, after the
    config's ``bos_token`` unless ``tokenizer_config.json`` sets ``add_bos_token`` false."""
    import json

    if args.chat is not None:
        text = tokenizer_config.chat_template().render(
            [{"role": "user", "content": args.chat}], add_generation_prompt=True
        )
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    ids = list(tokenizer.encode(args.prompt, add_special_tokens=False).ids)
    f = model_dir / "tokenizer_config.json"
    add_bos = json.loads(f.read_text()).get("add_bos_token", True) if f.is_file() else True
    bos = tokenizer.token_to_id(tokenizer_config.bos_token) if tokenizer_config.bos_token else None
    if add_bos is not False and bos is not None and ids[:1] != [bos]:
        ids.insert(0, bos)
    return ids


def _cmd_generate(args: argparse.Namespace) -> int:
    model_dir = Path(args.model)
    problems = [
        f"--model {model_dir}: no {f}" for f in ("config.json", "tokenizer.json") if not (model_dir / f).is_file()
    ]
    if not model_dir.is_dir():
        problems = [f"--model {model_dir}: no such directory"]
    if (
        args.chat is not None
        and model_dir.is_dir()
        and not any((model_dir / f).is_file() for f in ("tokenizer_config.json", "chat_template.jinja"))
    ):
        problems.append(f"--chat: {model_dir} has no tokenizer_config.json (copy the base checkpoint's there)")
    if args.adapters is not None and not Path(args.adapters).is_dir():
        problems.append(f"--adapters {args.adapters}: no such directory")
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    try:
        import jax.numpy as jnp

        from ravnest_jax.data import load_tokenizer, load_tokenizer_config
        from ravnest_jax.models import generate, load_pretrained, merge_peft_adapters, read_peft_adapters

        tokenizer, tokenizer_config = load_tokenizer(model_dir), load_tokenizer_config(model_dir)
        if args.adapters is not None:
            read_peft_adapters(args.adapters)  # checked before the model loads
        prompt_ids = _generate_prompt_ids(args, model_dir, tokenizer, tokenizer_config)
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        stops = _generate_stop_ids(model_dir, tokenizer, tokenizer_config)
        dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
        model = load_pretrained(model_dir, dtype=dtype, remat=False, scan_layers=False)
        if args.adapters is not None:
            merge_peft_adapters(model, args.adapters)
        ids = generate(
            model,
            prompt_ids,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop_ids=stops,
        )
    except ImportError as e:
        print(f"error: generate needs the llm extra (pip install 'ravnest-jax[llm]'): {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tokenizer.decode(ids, skip_special_tokens=True))
    return 0


def add_generate(sub) -> None:
    """Registers ``generate`` on the ``ravnest-jax`` subparsers ``sub``."""
    g = sub.add_parser(
        "generate",
        help="generate text from a Hugging Face checkpoint (and PEFT adapters) to look at what a run made",
        description="Loads a checkpoint directory (config.json, safetensors, tokenizer.json, tokenizer_config.json; "
        "what examples/finetune/train.py --export writes), optionally folds in LoRA adapters in PEFT's format "
        "(--export-adapters), and prints the completion of --prompt (raw text) or --chat (one user message in "
        "the checkpoint's chat template). Stops at EOS / the turn end or --max-new-tokens (docs/finetuning.md).",
    )
    g.add_argument("--model", required=True, metavar="DIR", help="the checkpoint directory")
    g.add_argument("--adapters", default=None, metavar="DIR", help="a PEFT LoRA adapter directory to merge in")
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", default=None, metavar="TEXT", help="raw text to continue (after the BOS)")
    what.add_argument("--chat", default=None, metavar="TEXT", help="a user message, in the chat template")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128, metavar="N", help="at most N new tokens")
    g.add_argument(
        "--temperature", type=_non_negative_float, default=0.0, metavar="T", help="0 (default): greedy; > 0 samples"
    )
    g.add_argument("--top-p", type=_unit_interval, default=1.0, metavar="P", help="nucleus sampling mass (0, 1]")
    g.add_argument("--seed", type=int, default=0, help="the sampling seed")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute and parameter dtype")
    g.set_defaults(func=_cmd_generate)
