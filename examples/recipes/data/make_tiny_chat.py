"""Writes ``tiny_chat.jsonl`` beside this file: 480 small chat conversations in TRL's
``{"messages": [{"role", "content"}, ...]}`` format, for the tiny offline recipe and the
LoRA-DiLoCo benchmark (``benchmarks/bench_lora_diloco.py``).

One to three user/assistant turns each, a system message in one of four, over four tasks a
2-layer model can learn in a few hundred steps: sums and differences, spelling a word
backwards, the colour of a thing, and what a Python built-in does (the first sentence of its
docstring, real English text). Deterministic (seeded); the committed file was made with
Python 3.11:

    python examples/recipes/data/make_tiny_chat.py
"""

from __future__ import annotations

import builtins
import json
import random
from pathlib import Path

WORDS = ["apple", "grass", "sky", "river", "stone", "cloud", "tiger", "lemon", "paper", "window", "garden", "planet"]
COLOURS = {
    "snow": "white",
    "grass": "green",
    "the sky": "blue",
    "a lemon": "yellow",
    "coal": "black",
    "a tomato": "red",
    "an orange": "orange",
    "a plum": "purple",
}
BUILTINS = [
    "abs", "all", "any", "bin", "callable", "chr", "divmod", "enumerate", "filter", "hash", "hex", "id",
    "isinstance", "iter", "len", "map", "max", "min", "next", "oct", "ord", "pow", "repr", "reversed",
    "round", "sorted", "sum",
]  # fmt: skip
SYSTEM = ["You answer in one sentence.", "You are a tiny assistant.", "Be brief."]


def _doc(name: str) -> str:
    doc = " ".join((getattr(builtins, name).__doc__ or "").split("\n\n")[0].split())
    if doc.startswith(f"{name}(") or doc.startswith(f"{name} ("):  # a signature line first
        rest = getattr(builtins, name).__doc__.split("\n\n")
        doc = " ".join(rest[1].split()) if len(rest) > 1 else doc
    return doc.split(". ")[0].rstrip(".") + "."


def _turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(1, 30), rng.randrange(1, 30)
        if rng.random() < 0.5:
            return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        a, b = max(a, b), min(a, b)
        return f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."
    if kind == 1:
        w = rng.choice(WORDS)
        return f"Spell {w} backwards.", w[::-1]
    if kind == 2:
        thing = rng.choice(sorted(COLOURS))
        return f"What colour is {thing}?", f"{thing[0].upper() + thing[1:]} is {COLOURS[thing]}."
    name = rng.choice(BUILTINS)
    return f"What does {name}() do in Python?", _doc(name)


def conversations(n: int = 480, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.25:
            messages.append({"role": "system", "content": rng.choice(SYSTEM)})
        for _ in range(rng.choice((1, 1, 2, 3))):
            q, a = _turn(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"messages": messages})
    return out


def main() -> None:
    path = Path(__file__).with_name("tiny_chat.jsonl")
    path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations()), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
