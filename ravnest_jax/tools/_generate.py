"""What a checkpoint (and PEFT adapters) generates from a prompt or one chat message, to look at
what a run made (``ravnest-jax generate``; docs/finetuning.md, "Look at what the run made")."""

from __future__ import annotations

from pathlib import Path


def generate_problems(model: str | Path, *, chat: str | None = None, adapters: str | Path | None = None) -> list[str]:
    """The problems of the inputs of :func:`generate_text`, one line each, found before anything
    loads: the model directory, its files, and the adapter directory."""
    model_dir = Path(model)
    problems = [
        f"--model {model_dir}: no {f}" for f in ("config.json", "tokenizer.json") if not (model_dir / f).is_file()
    ]
    if not model_dir.is_dir():
        problems = [f"--model {model_dir}: no such directory"]
    if (
        chat is not None
        and model_dir.is_dir()
        and not any((model_dir / f).is_file() for f in ("tokenizer_config.json", "chat_template.jinja"))
    ):
        problems.append(f"--chat: {model_dir} has no tokenizer_config.json (copy the base checkpoint's there)")
    if adapters is not None and not Path(adapters).is_dir():
        problems.append(f"--adapters {adapters}: no such directory")
    return problems


def stop_ids(model_dir: Path, tokenizer, tokenizer_config) -> list[int]:
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


def prompt_ids(
    model_dir: Path, tokenizer, tokenizer_config, *, prompt: str | None = None, chat: str | None = None
) -> list[int]:
    """``chat``: the user message in the chat template with the generation prompt, tokenised
    without special tokens (the template writes the BOS); ``prompt``: the text, after the
    config's ``bos_token`` unless ``tokenizer_config.json`` sets ``add_bos_token`` false."""
    import json

    if chat is not None:
        text = tokenizer_config.chat_template().render([{"role": "user", "content": chat}], add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    ids = list(tokenizer.encode(prompt, add_special_tokens=False).ids)
    f = model_dir / "tokenizer_config.json"
    add_bos = json.loads(f.read_text()).get("add_bos_token", True) if f.is_file() else True
    bos = tokenizer.token_to_id(tokenizer_config.bos_token) if tokenizer_config.bos_token else None
    if add_bos is not False and bos is not None and ids[:1] != [bos]:
        ids.insert(0, bos)
    return ids


def generate_text(
    model: str | Path,
    *,
    prompt: str | None = None,
    chat: str | None = None,
    adapters: str | Path | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    dtype: str = "float32",
) -> str:
    """The completion of ``prompt`` (raw text) or ``chat`` (one user message in the checkpoint's
    chat template) by the checkpoint directory ``model``, with the PEFT LoRA ``adapters`` merged
    in; it stops at EOS / the turn end or after ``max_new_tokens``. ``temperature`` 0: greedy.

    Raises:
      ImportError: the llm extra is not installed.
      ValueError: the adapters, the checkpoint or the prompt do not do (one line).
    """
    import jax.numpy as jnp

    from ravnest_jax.data import load_tokenizer, load_tokenizer_config
    from ravnest_jax.models import generate, load_pretrained, merge_peft_adapters, read_peft_adapters

    model_dir = Path(model)
    tokenizer, tokenizer_config = load_tokenizer(model_dir), load_tokenizer_config(model_dir)
    if adapters is not None:
        read_peft_adapters(adapters)  # checked before the model loads
    ids = prompt_ids(model_dir, tokenizer, tokenizer_config, prompt=prompt, chat=chat)
    if not ids:
        raise ValueError("the prompt has no tokens")
    stops = stop_ids(model_dir, tokenizer, tokenizer_config)
    loaded = load_pretrained(
        model_dir, dtype={"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype], remat=False, scan_layers=False
    )
    if adapters is not None:
        merge_peft_adapters(loaded, adapters)
    out = generate(
        loaded, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, stop_ids=stops
    )
    return tokenizer.decode(out, skip_special_tokens=True)
