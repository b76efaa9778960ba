"""rj.data chat templates and loss masks: the fixture chats rendered and tokenised exactly as
transformers' apply_chat_template did when tests/fixtures/chat/make_chat_fixtures.py ran (ids
committed in expected_ids.json; transformers is not needed here), and masks that cover exactly the
completion / assistant tokens plus the turn end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from ravnest_jax.data import (  # noqa: E402
    ChatTemplate,
    encode_chat,
    encode_records,
    load_examples,
    load_tokenizer,
    load_tokenizer_config,
    read_records,
)

CHAT = Path(__file__).resolve().parents[1] / "fixtures" / "chat"
EXPECTED = json.loads((CHAT / "expected_ids.json").read_text())
TEMPLATES = ("llama3", "chatml")
TURN_END = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>"}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(CHAT / "llama3")


def _decode(tok, ids) -> str:
    return tok.decode([int(i) for i in ids], skip_special_tokens=False)


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("k", range(len(EXPECTED["chats"])))
def test_rendered_text_and_ids_equal_transformers(tok, name, k):
    chat, want = EXPECTED["chats"][k], EXPECTED["templates"][name][k]
    template = load_tokenizer_config(CHAT / name).chat_template()
    assert template.render(chat) == want["text"]
    ids = tok.encode(template.render(chat), add_special_tokens=False).ids
    assert ids == want["ids"]
    gen = tok.encode(template.render(chat, add_generation_prompt=True), add_special_tokens=False).ids
    assert gen == want["ids_generation_prompt"]
    # one BOS only: the template renders it, the tokenizer's post-processor is off for chat
    assert ids.count(tok.token_to_id("<|begin_of_text|>")) == (1 if name == "llama3" else 0)


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("k", range(len(EXPECTED["chats"])))
def test_the_mask_covers_exactly_the_assistant_tokens_and_turn_end(tok, name, k):
    chat = EXPECTED["chats"][k]
    config = load_tokenizer_config(CHAT / name)
    ex = encode_chat(chat, tok, config.chat_template(), turn_end=config.eos_token)
    assert ex.tokens.tolist() == EXPECTED["templates"][name][k]["ids"]
    want = "".join(m["content"] + TURN_END[name] for m in chat if m["role"] == "assistant")
    assert _decode(tok, ex.tokens[ex.mask]) == want
    # each assistant turn is one contiguous run ending in the turn end
    runs = np.split(np.flatnonzero(ex.mask), np.flatnonzero(np.diff(np.flatnonzero(ex.mask)) > 1) + 1)
    assert len(runs) == sum(m["role"] == "assistant" for m in chat)
    assert all(ex.tokens[r[-1]] == tok.token_to_id(TURN_END[name]) for r in runs)
    if name == "chatml":  # transformers' own assistant mask from the template's {% generation %} blocks
        assert ex.mask.astype(int).tolist() == EXPECTED["templates"][name][k]["assistant_masks"]
    everything = encode_chat(chat, tok, config.chat_template(), train_on_prompt=True, turn_end=config.eos_token)
    assert everything.mask.all() and everything.tokens.tolist() == ex.tokens.tolist()


def test_conversational_prompt_completion_learns_the_completion_only(tok):
    records = read_records(CHAT / "prompt_completion_chat.jsonl")
    config = load_tokenizer_config(CHAT / "chatml")
    for r, ex in zip(records, encode_records(records, tok, config)):
        assert _decode(tok, ex.tokens[ex.mask]) == r.data["completion"][0]["content"] + "<|im_end|>"
        assert _decode(tok, ex.tokens).startswith("<|im_start|>system\n")


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_prompt_completion_and_alpaca_strings(tok, train_on_prompt):
    bos, eot = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|eot_id|>")
    for name, prompt_of, completion_of in [
        ("prompt_completion.jsonl", lambda d: d["prompt"], lambda d: d["completion"]),
        ("alpaca.jsonl", None, lambda d: d["output"]),
    ]:
        records = read_records(CHAT / name)
        examples = load_examples(CHAT / name, CHAT / "llama3", train_on_prompt=train_on_prompt)
        for r, ex in zip(records, examples):
            assert ex.tokens[0] == bos and ex.tokens[-1] == eot
            assert _decode(tok, ex.tokens).endswith(completion_of(r.data) + "<|eot_id|>")
            if train_on_prompt:
                assert ex.mask.all()
            else:
                assert _decode(tok, ex.tokens[ex.mask]) == completion_of(r.data) + "<|eot_id|>"
                prompt = _decode(tok, ex.tokens[~ex.mask])
                if prompt_of is not None:
                    assert prompt == "<|begin_of_text|>" + prompt_of(r.data)
                else:
                    assert "### Instruction:\n" + r.data["instruction"] in prompt and prompt.endswith("### Response:\n")
                    assert ("### Input:\n" in prompt) == bool(r.data["input"])


def test_text_gets_the_tokenizers_bos_and_the_configs_eos(tok):
    for ex, r in zip(load_examples(CHAT / "text.jsonl", CHAT / "chatml"), read_records(CHAT / "text.jsonl")):
        assert _decode(tok, ex.tokens) == "<|begin_of_text|>" + r.data["text"] + "<|im_end|>"
        assert ex.mask.all()


def test_tokenizer_config_shapes(tmp_path):
    llama = load_tokenizer_config(CHAT / "llama3")
    assert llama.eos_token == "<|eot_id|>"  # an AddedToken dict in the file
    assert llama.bos_token == "<|begin_of_text|>" and llama.pad_token == "<pad>"
    chatml = load_tokenizer_config(CHAT / "chatml")
    assert sorted(chatml.chat_templates) == ["default", "llama3"] and chatml.bos_token is None
    assert chatml.chat_template("llama3").source == llama.chat_templates["default"]
    with pytest.raises(ValueError, match="no chat template named 'zephyr'"):
        chatml.chat_template("zephyr")
    # a chat_template.jinja beside the config wins, as in transformers
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": "A"}))
    (tmp_path / "chat_template.jinja").write_text("B{{ eos_token }}")
    assert load_tokenizer_config(tmp_path).chat_template().render([]) == "B</s>"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match="has no chat_template: chat records need one"):
        load_tokenizer_config(tmp_path).chat_template()


def test_a_chat_record_without_a_template_is_an_error(tmp_path, tok):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    with pytest.raises(ValueError, match="has no chat_template"):
        encode_records(read_records(CHAT / "messages.jsonl"), tok, load_tokenizer_config(tmp_path))


MSG = [{"role": "user", "content": "a<b>&'"}, {"role": "assistant", "content": "c"}]


@pytest.mark.parametrize(
    "source, want",
    [
        ("{{ messages[0] | tojson }}", '{"role": "user", "content": "a<b>&\'"}'),  # no HTML escaping
        ("{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}", "c"),
        ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}", "2"),
        ("{% generation %}{{ messages[1].content }}{% endgeneration %}", "c"),
        ("{% if true %}\n  x\n{% endif %}\n", "  x\n"),  # trim_blocks and lstrip_blocks
        ("{{ strftime_now('%Y') | length }}", "4"),
        ("{{ dict(a=1)['a'] }}{{ add_generation_prompt }}", "1False"),
    ],
)
def test_template_environment_matches_transformers(source, want):
    assert ChatTemplate(source).render(MSG) == want


@pytest.mark.parametrize(
    "source, message",
    [
        ("{{ raise_exception('no system role') }}", "chat template: no system role"),
        ("{{ ''.__class__.__mro__ }}", "chat template:"),
        ("{% set ns = namespace() %}{% set ns._x = 1 %}", "may not set '_x'"),
        ("{% for %}", "chat template line 1"),
    ],
)
def test_template_errors_and_the_sandbox(source, message):
    with pytest.raises(ValueError, match=message):
        ChatTemplate(source).render(MSG)


def test_a_template_that_rewrites_earlier_turns_is_refused_clearly(tok):
    # renders the number of messages first: no prefix of the conversation renders as a prefix
    t = ChatTemplate("{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="^x.jsonl:3: the chat template renders the conversation before message 1"):
        encode_chat(MSG, tok, t, where="x.jsonl:3")


def test_template_kwargs_reach_the_template(tok):
    t = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}{{ sep }}{% endfor %}")
    ex = encode_chat(MSG, tok, t, turn_end="<|im_end|>", template_kwargs={"sep": "<|im_end|>"})
    assert _decode(tok, ex.tokens) == "user: a<b>&'<|im_end|>assistant: c<|im_end|>"
    # no generation prompt in this template: the learned span starts at the role name
    assert _decode(tok, ex.tokens[ex.mask]) == "assistant: c<|im_end|>"


@pytest.mark.parametrize(
    "turn_end, learned",
    [
        ("<|eot_id|>", "c<|eot_id|>"),  # the EOS is the turn end
        ("<|end_of_text|>", "c<|eot_id|>"),  # it is not (Gemma): the last special token, whitespace after it cut
        (None, "c<|eot_id|>"),
    ],
)
def test_the_turn_end_is_learned_and_the_newline_after_it_is_not(tok, turn_end, learned):
    t = ChatTemplate(
        "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}<|eot_id|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
    )
    ex = encode_chat(MSG, tok, t, turn_end=turn_end)
    assert _decode(tok, ex.tokens[ex.mask]) == learned
    # text after the last special token: it belongs to the turn, nothing is cut
    text_after = ChatTemplate(t.source.replace("<|eot_id|>\n", "<|eot_id|> ok"))
    ex = encode_chat(MSG, tok, text_after, turn_end=None)
    assert _decode(tok, ex.tokens[ex.mask]) == "c<|eot_id|> ok"


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_conversation_opened_by_the_assistant(tok, name):
    config = load_tokenizer_config(CHAT / name)
    chat = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi."}]
    ex = encode_chat(chat, tok, config.chat_template(), turn_end=config.eos_token)
    assert _decode(tok, ex.tokens[ex.mask]) == "Hello." + TURN_END[name]  # not the BOS, system prompt or header
