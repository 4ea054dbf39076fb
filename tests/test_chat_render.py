"""launcher.core.chat_render: conversations into ids and loss masks, under every shipped template.

The tokenizer is a byte-level BPE trained here (tests/helpers/data_prep.py) with the special
tokens the templates need added; the expected texts are written out by hand from each format.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer

from launcher.core.chat_render import (TEMPLATE_DIR, ChatError, ChatTokenizer, MaskPolicy, Rendered,
                                   messages_of)
from tests.helpers.data_prep import train_hf_tokenizer

ROLE_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
               "<|im_start|>", "<|im_end|>", "<s>", "</s>", "[INST]", "[/INST]", "<|system|>",
               "<|user|>", "<|assistant|>", "<|end|>", "<bos>", "<start_of_turn>",
               "<end_of_turn>", "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
               "<｜end▁of▁sentence｜>"]
EOS = "<|endoftext|>"
END_OF_TURN = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>", "plain": EOS, "mistral": "</s>",
               "phi3": "<|end|>", "olmo2": EOS, "gemma": "<end_of_turn>",
               "deepseek_v3": "<｜end▁of▁sentence｜>"}
LEAD = {"mistral": " "}
"""What a format writes between the prompt and the reply that is part of the assistant turn."""
CONVERSATION = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris, on the Seine."},
    {"role": "user", "content": "And a word in Japanese?"},
    {"role": "assistant", "content": "東京 means Tokyo 🙂, naïve café.\n"},
]
REPLIES = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]


def golden(name: str, messages: list, generation_prompt: bool = False) -> str:
    """The rendered text of each format, written out from its description."""
    if name in FAMILY_GOLDEN:
        return FAMILY_GOLDEN[name](messages, generation_prompt)
    if name == "llama3":
        text = "<|begin_of_text|>" + "".join(
            f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in messages)
        return text + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if generation_prompt else "")
    if name == "chatml":
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if generation_prompt else "")
    header = {"system": "### System:\n", "user": "### User:\n", "assistant": "### Assistant:\n"}
    text = "".join(header[m["role"]] + m["content"] + (EOS if m["role"] == "assistant" else "") + "\n\n"
                   for m in messages)
    return text + ("### Assistant:\n" if generation_prompt else "")


def _with_system_first(messages: list) -> list:
    """(role, content) pairs with a system message's text put before the next user message's,
    a blank line between (formats without a system role)."""
    out, system = [], ""
    for m in messages:
        if m["role"] == "system":
            system = m["content"] + "\n\n"
        else:
            out.append((m["role"], (system if m["role"] == "user" else "") + m["content"]))
            system = "" if m["role"] == "user" else system
    return out


def _mistral(messages, prompt):
    return "<s>" + "".join(f"[INST] {c} [/INST]" if role == "user" else f" {c}</s>"
                           for role, c in _with_system_first(messages))


def _phi3(messages, prompt):
    text = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)
    return text + ("<|assistant|>\n" if prompt else "")


def _olmo2(messages, prompt):
    text = EOS + "".join(f"<|assistant|>\n{m['content']}{EOS}\n" if m["role"] == "assistant"
                         else f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + ("<|assistant|>\n" if prompt else "")


def _gemma(messages, prompt):
    text = "<bos>" + "".join(
        f"<start_of_turn>{'model' if role == 'assistant' else 'user'}\n{c}<end_of_turn>\n"
        for role, c in _with_system_first(messages))
    return text + ("<start_of_turn>model\n" if prompt else "")


def _deepseek_v3(messages, prompt):
    parts = {"system": "{}", "user": "<｜User｜>{}", "assistant": "<｜Assistant｜>{}<｜end▁of▁sentence｜>"}
    text = "<｜begin▁of▁sentence｜>" + "".join(parts[m["role"]].format(m["content"])
                                               for m in messages)
    return text + ("<｜Assistant｜>" if prompt else "")


FAMILY_GOLDEN = {"mistral": _mistral, "phi3": _phi3, "olmo2": _olmo2, "gemma": _gemma,
                 "deepseek_v3": _deepseek_v3}
"""The instruct formats of the model families (launcher.core.chat_render.FAMILY_TEMPLATES)."""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """tok: the trained tokenizer with the role tokens (eos in tokenizer_config.json, no chat
    template); own: the same with a chat_template; bare: as trained (no role tokens)."""
    root = tmp_path_factory.mktemp("chat_tokenizers")
    bare = root / "bare"
    bare.mkdir()
    tokenizer = Tokenizer.from_file(str(train_hf_tokenizer(bare, 1200)))
    tokenizer.add_special_tokens(ROLE_TOKENS)
    out = {"bare": bare}
    for name, config in (("tok", {"eos_token": EOS}),
                         ("own", {"eos_token": EOS,
                                  "chat_template": (TEMPLATE_DIR / "chatml.jinja").read_text()})):
        out[name] = root / name
        out[name].mkdir()
        tokenizer.save(str(out[name] / "tokenizer.json"))
        (out[name] / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def decoder(dirs):
    return Tokenizer.from_file(str(dirs["tok"] / "tokenizer.json"))


@pytest.fixture(scope="module")
def chats(dirs):
    return {name: ChatTokenizer(str(dirs["tok"]), name) for name in END_OF_TURN}


def decode(decoder, ids) -> str:
    return decoder.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


def target_runs(decoder, rendered: Rendered) -> list:
    """The text of each contiguous run of masked-in tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], rendered.mask, [0]])))
    return [decode(decoder, rendered.ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("name", list(END_OF_TURN))
def test_each_reply_and_its_end_of_turn_are_the_targets(chats, decoder, name):
    rendered = chats[name].render(CONVERSATION)
    assert rendered.ids.dtype == np.int32 and rendered.mask.dtype == np.uint8
    assert len(rendered.ids) == len(rendered.mask)
    assert decode(decoder, rendered.ids) == golden(name, CONVERSATION)
    assert target_runs(decoder, rendered) == [LEAD.get(name, "") + r + END_OF_TURN[name]
                                              for r in REPLIES]
    headers = {decoder.token_to_id(t) for t in ROLE_TOKENS if t != END_OF_TURN[name]}
    assert not headers & set(rendered.ids[rendered.mask == 1].tolist())
    assert chats[name].template_name == name
    assert chats[name].eot_ids == [decoder.token_to_id(END_OF_TURN[name])]


@pytest.mark.parametrize("name", list(END_OF_TURN))
def test_prompt_completion_record(chats, decoder, name):
    record = {"system": "Be terse.", "prompt": "2 + 2 =", "completion": " 4"}
    messages = messages_of(record)
    assert messages == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2 + 2 ="},
                        {"role": "assistant", "content": " 4"}]
    rendered = chats[name].render(messages)
    assert decode(decoder, rendered.ids) == golden(name, messages)
    assert target_runs(decoder, rendered) == [LEAD.get(name, "") + " 4" + END_OF_TURN[name]]
    without_system = messages_of({"prompt": "2 + 2 =", "completion": " 4", "system": None})
    assert [m["role"] for m in without_system] == ["user", "assistant"]


@pytest.mark.parametrize("name", list(END_OF_TURN))
def test_last_and_all_policies(chats, decoder, name):
    every = chats[name].render(CONVERSATION, MaskPolicy.assistant)
    last = chats[name].render(CONVERSATION, "last")
    assert target_runs(decoder, last) == [LEAD.get(name, "") + REPLIES[-1] + END_OF_TURN[name]]
    assert np.array_equal(last.ids, every.ids) and np.all(last.mask <= every.mask)
    everything = chats[name].render(CONVERSATION, MaskPolicy.all)
    assert np.array_equal(everything.ids, every.ids)
    assert everything.mask.dtype == np.uint8 and everything.mask.all()


@pytest.mark.parametrize("name", list(END_OF_TURN))
def test_render_prompt_opens_an_assistant_turn(chats, decoder, name):
    ids = chats[name].render_prompt(CONVERSATION[:4])
    assert ids.dtype == np.int32
    assert decode(decoder, ids) == golden(name, CONVERSATION[:4], generation_prompt=True)
    # the same tokens as in training, but perhaps the last: the generation prompt's trailing
    # whitespace ("\n\n" for llama3) may merge differently when no reply follows it
    assert np.array_equal(ids[:-1], chats[name].render(CONVERSATION).ids[:len(ids) - 1])


def test_the_tokenizers_own_template(dirs, chats):
    own = ChatTokenizer(str(dirs["own"]))
    assert own.template_name == "tokenizer"
    ours, theirs = own.render(CONVERSATION), chats["chatml"].render(CONVERSATION)
    assert np.array_equal(ours.ids, theirs.ids) and np.array_equal(ours.mask, theirs.mask)
    assert own.eot_ids == chats["chatml"].eot_ids


def test_a_chat_template_jinja_file_beside_the_tokenizer(dirs, chats, tmp_path):
    """transformers' newer layout: the template in chat_template.jinja, not tokenizer_config.json."""
    shutil.copy(dirs["tok"] / "tokenizer.json", tmp_path / "tokenizer.json")
    shutil.copy(dirs["tok"] / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    shutil.copy(TEMPLATE_DIR / "llama3.jinja", tmp_path / "chat_template.jinja")
    own = ChatTokenizer(str(tmp_path / "tokenizer.json"))
    assert own.template_name == "tokenizer"
    assert np.array_equal(own.render(CONVERSATION).mask, chats["llama3"].render(CONVERSATION).mask)


def test_a_tokenizer_json_file_and_its_eos(dirs, decoder, tmp_path):
    """A bare tokenizer.json (no tokenizer_config.json): eos is data_prep's end-of-document token."""
    path = tmp_path / "my_tokenizer.json"
    shutil.copy(dirs["tok"] / "tokenizer.json", path)
    plain = ChatTokenizer(str(path), "plain")
    assert plain.eot_ids == [decoder.token_to_id(EOS)]
    assert target_runs(decoder, plain.render(CONVERSATION)) == [r + EOS for r in REPLIES]


def test_no_template_names_the_fix(dirs):
    with pytest.raises(ChatError, match=r"no chat template.*chat\.template=llama3, chatml, plain"):
        ChatTokenizer(str(dirs["tok"]))
    with pytest.raises(ChatError, match=r"chat\.template='vicuna': not a shipped template"):
        ChatTokenizer(str(dirs["tok"]), "vicuna")
    with pytest.raises(ChatError, match="no such tokenizer.json"):
        ChatTokenizer(str(dirs["tok"] / "missing"), "chatml")


def test_a_template_the_tokenizer_lacks_tokens_for(dirs):
    with pytest.raises(ChatError, match=r"writes <\|im_start\|>, <\|im_end\|>, which .* single tokens"):
        ChatTokenizer(str(dirs["bare"]), "chatml")


GENERATION_MARKED = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\n' -}}{% generation %}{{- m['content'] + '<|im_end|>' -}}{% endgeneration %}"
    "{{- '\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")


def test_a_jinja_file_agrees_with_transformers_generation_markers(dirs, tmp_path):
    """On a template with {% generation %} markers, the prefix-derived mask is transformers' own."""
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "marked.jinja"
    path.write_text(GENERATION_MARKED)
    chat = ChatTokenizer(str(dirs["tok"]), str(path))
    assert chat.template_name == str(path)
    rendered = chat.render(CONVERSATION)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(dirs["tok"] / "tokenizer.json"))
    out = hf.apply_chat_template(CONVERSATION, chat_template=GENERATION_MARKED, tokenize=True,
                                 return_dict=True, return_assistant_tokens_mask=True)
    assert list(out["input_ids"]) == rendered.ids.tolist()
    assert list(out["assistant_masks"]) == rendered.mask.tolist()
    assert rendered.mask.sum() > 0


def test_a_token_straddling_the_reply_start_is_a_target(dirs, decoder, tmp_path):
    """A token holding the template's space and the reply's first word (" Paris") is trained."""
    path = tmp_path / "colon.jinja"
    path.write_text("{%- for m in messages -%}{{- m['role'] + ': ' + m['content'] -}}"
                    "{%- if m['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}{{- '\n' -}}"
                    "{%- endfor -%}{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}")
    chat = ChatTokenizer(str(dirs["tok"]), str(path))
    runs = target_runs(decoder, chat.render(CONVERSATION))
    # " Paris" is one token (the space is the template's); before 東, the space is a token of its own
    assert runs == [" " + REPLIES[0] + EOS, REPLIES[1] + EOS]


BAD_RECORDS = [
    ({}, r"no 'messages' list .* no 'prompt'/'completion'"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, "ShareGPT-style"),
    ({"messages": "hello"}, "'messages' must be a list"),
    ({"messages": [{"content": "hi"}]}, r"message 0 has no 'role'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}, r"message 1 has no 'content'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                   {"role": "assistant", "content": "yo"}]}, r"content must be a string, not list"),
    ({"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     r"unknown role 'human' \(allowed: system, user, assistant"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
     "no assistant turn"),
    ({"prompt": "hi"}, r"'completion' must be a string, not null"),
    ({"prompt": "hi", "completion": 3}, r"'completion' must be a string, not int"),
    (["not", "an", "object"], "must be a JSON object"),
]


@pytest.mark.parametrize("record,message", BAD_RECORDS)
def test_bad_records_say_what_is_wrong(record, message):
    with pytest.raises(ChatError, match=message):
        messages_of(record)


def test_messages_of_keeps_role_and_content_and_prefers_messages():
    record = {"prompt": "ignored", "messages": [{"role": "user", "content": "hi", "name": "x"},
                                                {"role": "assistant", "content": "yo", "weight": 0}]}
    assert messages_of(record) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_render_checks_messages_and_their_order(chats):
    with pytest.raises(ChatError, match="unknown role 'bot'"):
        chats["chatml"].render([{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}])
    with pytest.raises(ChatError, match="no assistant turn"):
        chats["chatml"].render([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatError, match="starts with an assistant message"):
        chats["chatml"].render([{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "yo"}])
    assert chats["chatml"].render([{"role": "user", "content": "hi"}], "all").mask.all()


UNSTABLE = {
    "generation prompt": "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                         "'<|im_end|>\n' -}}{%- endfor -%}"
                         "{%- if add_generation_prompt -%}{{- '<|im_start|>bot\n' -}}{%- endif -%}",
    # marks the final message, as templates that keep only the last turn's reasoning do
    "later messages": "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] -}}"
                      "{%- if loop.last and not add_generation_prompt -%}{{- ' (final)' -}}{%- endif -%}"
                      "{{- '<|im_end|>\n' -}}{%- endfor -%}"
                      "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}",
}
UNSTABLE_SAYS = {"generation prompt": "the generation prompt renders", "later messages": "messages after"}


@pytest.mark.parametrize("kind", list(UNSTABLE))
def test_a_template_that_is_not_prefix_stable_is_refused(dirs, tmp_path, kind):
    path = tmp_path / "unstable.jinja"
    path.write_text(UNSTABLE[kind])
    chat = ChatTokenizer(str(dirs["tok"]), str(path))
    says = f"does not render a prefix-stable conversation: .*{UNSTABLE_SAYS[kind]}"
    with pytest.raises(ChatError, match=says):
        chat.render(CONVERSATION)


def test_a_template_that_drops_replies_or_fails_is_refused(dirs, tmp_path):
    path = tmp_path / "drops.jinja"
    path.write_text("{%- for m in messages if m['role'] != 'assistant' -%}{{- m['role'] + ': ' + "
                    "m['content'] + '\n' -}}{%- endfor -%}")
    with pytest.raises(ChatError, match="renders nothing for assistant message 2"):
        ChatTokenizer(str(dirs["tok"]), str(path)).render(CONVERSATION)
    path.write_text("{%- if messages | length > 2 -%}{{- raise_exception('roles must alternate') -}}"
                    "{%- endif -%}{%- for m in messages -%}{{- m['content'] + eos_token -}}{%- endfor -%}")
    with pytest.raises(ChatError, match="failed on this conversation .*roles must alternate"):
        ChatTokenizer(str(dirs["tok"]), str(path)).render(CONVERSATION)
