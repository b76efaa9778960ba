"""Chat templates: a checkpoint's ``tokenizer_config.json`` (special tokens, ``chat_template``)
and a Jinja renderer equivalent to transformers' ``apply_chat_template`` (a sandboxed, immutable
jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``{% generation %}`` block, the ``raise_exception`` / ``strftime_now`` globals and a ``tojson``
filter that does not escape HTML), written for this project on jinja2 alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

# the named special tokens transformers hands to a template (its ``special_tokens_map``)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# the names a message's reasoning may come under; templates read "reasoning_content" or "thinking"
_REASONING = ("reasoning_content", "thinking", "reasoning")


def _token_string(value: Any) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or an AddedToken dict's content."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


@dataclass(frozen=True)
class TokenizerConfig:
    """What ``tokenizer_config.json`` (and ``chat_template.jinja``) of a checkpoint says.

    Attributes:
      special_tokens: the named special tokens present (``bos_token``, ``eos_token``, ...) as strings.
      chat_templates: the chat templates by name (``"default"`` for a single string template).
      path: the directory it was read from.
    """

    special_tokens: dict[str, str] = field(default_factory=dict)
    chat_templates: dict[str, str] = field(default_factory=dict)
    path: str = ""

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token; for an instruct checkpoint the chat turn end (Llama 3.1
        Instruct ``<|eot_id|>``, Qwen ``<|im_end|>``)."""
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    def chat_template(self, name: str | None = None) -> ChatTemplate:
        """The compiled chat template ``name`` (default: the only one, or the one named
        ``"default"``).

        Raises:
          ValueError: the checkpoint has no chat template, or none of that name.
        """
        if not self.chat_templates:
            raise ValueError(f"{self.path or 'the tokenizer config'} has no chat_template: chat records need one")
        if name is None:
            if "default" in self.chat_templates:
                name = "default"
            elif len(self.chat_templates) == 1:
                name = next(iter(self.chat_templates))
            else:
                raise ValueError(
                    f"{self.path}: several chat templates {sorted(self.chat_templates)} and none named 'default': name one"
                )
        if name not in self.chat_templates:
            raise ValueError(f"{self.path}: no chat template named {name!r}; it has {sorted(self.chat_templates)}")
        return ChatTemplate(self.chat_templates[name], self.special_tokens)


def load_tokenizer_config(checkpoint: str | os.PathLike[str]) -> TokenizerConfig:
    """Reads ``tokenizer_config.json`` of a checkpoint directory (or that file itself), and
    ``chat_template.jinja`` / ``chat_template.json`` beside it as newer transformers save them.

    ``chat_template`` may be a string or a list of ``{"name", "template"}``; special tokens strings
    or AddedToken dicts. A directory without the file gives an empty config (plain text still works).

    Raises:
      ValueError: the file is not JSON or its ``chat_template`` has another shape.
    """
    p = Path(checkpoint)
    d, f = (p, p / "tokenizer_config.json") if p.is_dir() or not p.suffix else (p.parent, p)
    cfg: dict[str, Any] = {}
    if f.is_file():
        try:
            cfg = json.loads(f.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{f} is not JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{f} must hold a JSON object")
    special = {k: s for k in SPECIAL_TOKEN_NAMES if (s := _token_string(cfg.get(k))) is not None}
    raw = cfg.get("chat_template")
    if (d / "chat_template.jinja").is_file():
        raw = (d / "chat_template.jinja").read_text(encoding="utf-8")
    elif raw is None and (d / "chat_template.json").is_file():
        raw = json.loads((d / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    templates: dict[str, str] = {}
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for i, t in enumerate(raw):
            if not (isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)):
                raise ValueError(f'{f}: "chat_template"[{i}] must be {{"name": str, "template": str}}')
            templates[t["name"]] = t["template"]
    elif raw is not None:
        raise ValueError(
            f'{f}: "chat_template" must be a string or a list of named templates, got {type(raw).__name__}'
        )
    return TokenizerConfig(special, templates, str(d))


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body unchanged (transformers
        uses it to mark assistant text; we find assistant spans by prefixes instead)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        # jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class _Namespace(jinja2.utils.Namespace):
        # no underscore-prefixed attributes: a template cannot reach CPython internals through one
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for k in attrs:
                _Namespace._check(k)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    class _Dict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=_Namespace, dict=_Dict())
    return env.from_string(source)


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to a template: keys whose value is None dropped, and a
    reasoning text under both ``reasoning_content`` and ``thinking``."""
    m = {k: v for k, v in message.items() if v is not None}
    reasoning = next((m[k] for k in _REASONING if k in m), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return m


class ChatTemplate:
    """A compiled chat template with the checkpoint's special tokens.

    Args:
      source: the Jinja source (``tokenizer_config.json``'s ``chat_template``).
      special_tokens: ``{"bos_token": ..., "eos_token": ..., ...}`` handed to the template.

    Raises:
      ValueError: the source is not valid Jinja (the line and jinja2's message).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        import jinja2

        try:
            self._template = _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template line {e.lineno}: {e.message}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False, **kwargs: Any
    ) -> str:
        """The conversation as text, as ``tokenizer.apply_chat_template(messages, tokenize=False,
        add_generation_prompt=...)`` renders it (extra ``kwargs`` reach the template, e.g.
        ``tools`` or ``enable_thinking``; they override the special tokens).

        Raises:
          ValueError: the template raised (``raise_exception``) or failed; its message.
        """
        import jinja2

        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=[_plain_message(m) for m in messages], add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None
