"""One conversation into token ids and a per-token loss mask, for supervised fine-tuning.

The conversation is rendered to text with a Jinja chat template through transformers'
chat-template machinery (``apply_chat_template(..., tokenize=False)``), then tokenized once with
the ``tokenizers`` library (``add_special_tokens=False``: the template itself writes BOS).

The mask works for any template, with or without ``{% generation %}`` markers. For assistant
message *i*, ``prompt`` is the conversation up to *i* rendered with the generation prompt and
``full`` the conversation up to and including *i* without it; ``full`` must start with ``prompt``
and the whole rendered conversation with ``full`` (a template for which this fails is not
prefix-stable and is refused: the mask would be guesswork). The turn's characters are
``[len(prompt), len(full))`` less trailing whitespace, so the end-of-turn token (``<|eot_id|>``,
``<|im_end|>``, eos) is trained and the newline a template writes after it is not. A token is a
target when its characters overlap such a span: a token that straddles the start of a turn
(``"Assistant: Hi"`` tokenized ``" Hi"``) carries the reply's first word, which the model must
learn to produce. A turn that gets no token is an error, never an untrained turn.

Templates shipped in ``launcher/core/chat_templates/`` (llama3, chatml, plain, and the formats of
the Mistral, Phi-3, OLMo 2, Gemma and DeepSeek-V3 instruct models: :data:`FAMILY_TEMPLATES`) were
written for trainwright from the formats' descriptions; no template file was copied from
anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Optional


TEMPLATE_DIR = Path(__file__).with_name("chat_templates")
SHIPPED_TEMPLATES = ("llama3", "chatml", "plain", "mistral", "phi3", "olmo2", "gemma",
                     "deepseek_v3")
TEMPLATE_TOKENS = {
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "plain": (),
    "mistral": ("<s>", "</s>"),  # [INST] is a control token from v0.3 on, text before
    "phi3": ("<|user|>", "<|assistant|>", "<|end|>"),
    "olmo2": ("<|endoftext|>", "<|user|>", "<|assistant|>"),
    "gemma": ("<bos>", "<start_of_turn>", "<end_of_turn>"),
    "deepseek_v3": ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<｜end▁of▁sentence｜>"),
}
"""The strings each shipped template writes that the tokenizer must hold as single tokens."""
FAMILY_TEMPLATES = {"llama": "llama3", "qwen2": "chatml", "qwen3": "chatml",
                    "qwen3_moe": "chatml", "mistral": "mistral", "mixtral": "mistral",
                    "phi3": "phi3", "olmo2": "olmo2", "gemma3_text": "gemma",
                    "deepseek_v3": "deepseek_v3", "gpt2": "plain"}
"""The shipped template in the chat format of each Hugging Face family's instruct models."""
ROLES = ("system", "user", "assistant")
_PROBE_REPLY = "trainwright probe reply 7"


class MaskPolicy(StrEnum):
    """Which tokens of a conversation are training targets."""

    assistant = "assistant"
    """Every assistant turn, its end-of-turn token(s) included."""
    last = "last"
    """Only the last assistant turn (and its end-of-turn)."""
    all = "all"
    """Every token."""


@dataclass
class Rendered:
    """A rendered conversation."""

    ids: np.ndarray
    """int32 token ids of the whole rendered conversation."""
    mask: np.ndarray
    """uint8, same length: 1 = this token is a training target."""


class ChatError(ValueError):
    """A record that cannot be rendered (or a template that cannot render); the message names the
    problem and the fix."""


def messages_of(record: dict) -> list[dict]:
    """The messages of a record: ``{"messages": [{"role", "content"}, ...]}``, or ``{"prompt": str,
    "completion": str}`` (a user and an assistant turn, after a system turn when the record has a
    ``"system"`` string). Each message comes back as ``{"role", "content"}`` only. Raises
    :class:`ChatError` naming what is wrong: no messages, a message without role or content,
    content that is not a string, an unknown role (allowed: system, user, assistant), no
    assistant turn."""
    if not isinstance(record, dict):
        raise ChatError(f"a record must be a JSON object, not {type(record).__name__}")
    if record.get("messages") is not None:
        messages = record["messages"]
    elif record.get("prompt") is not None or record.get("completion") is not None:
        messages = _prompt_completion(record)
    else:
        hint = (" (ShareGPT-style 'conversations' with from/value is not read: convert it to "
                "'messages' with role/content)" if "conversations" in record else "")
        raise ChatError(f"no 'messages' list (of {{role, content}}) and no 'prompt'/'completion' "
                        f"strings; the record's keys: {', '.join(map(str, record)) or 'none'}{hint}")
    return check_messages(messages, need_assistant=True)


def _prompt_completion(record: dict) -> list[dict]:
    messages = []
    for key, role in (("system", "system"), ("prompt", "user"), ("completion", "assistant")):
        value = record.get(key)
        if value is None and key == "system":
            continue
        if not isinstance(value, str):
            raise ChatError(f"'{key}' must be a string, not {_kind(value)} (a prompt/completion "
                            "record needs both, as strings)")
        messages.append({"role": role, "content": value})
    return messages


def check_messages(messages, need_assistant: bool = True) -> list[dict]:
    """``messages`` checked and copied as ``{"role", "content"}`` dicts (ChatError otherwise)."""
    if not isinstance(messages, (list, tuple)):
        raise ChatError(f"'messages' must be a list of {{role, content}} objects, not {_kind(messages)}")
    out = []
    for n, message in enumerate(messages):
        where = f"message {n}"
        if not isinstance(message, dict):
            raise ChatError(f"{where} must be an object with 'role' and 'content', not {_kind(message)}")
        role, content = message.get("role"), message.get("content")
        if role is None or content is None:
            missing = "'role'" if role is None else "'content'"
            raise ChatError(f"{where} has no {missing} (every message needs 'role' and 'content')")
        if role not in ROLES:
            raise ChatError(f"{where} has the unknown role {role!r} (allowed: {', '.join(ROLES)}; "
                            "map other names, e.g. human -> user, gpt -> assistant)")
        if not isinstance(content, str):
            raise ChatError(f"{where} ({role}): content must be a string, not {_kind(content)} "
                            "(join text parts into one string; images and tool calls are not supported)")
        out.append({"role": role, "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise ChatError("no assistant turn: nothing to train on (a conversation needs at least one "
                        "message with role 'assistant', or a 'completion')")
    return out


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__


class ChatTokenizer:
    """A Hugging Face tokenizer and a chat template: conversations into ids and loss masks.

    ``tokenizer_path`` is a tokenizer directory (tokenizer.json, optionally tokenizer_config.json
    with eos/bos tokens and a ``chat_template``) or a tokenizer.json file. ``template`` is ""
    (the tokenizer's own chat template), a shipped name (llama3, chatml, plain), a path to a
    .jinja file, or the Jinja text itself (a run's recorded template).
    """

    eot_ids: list[int]
    """The end-of-turn token id(s) an assistant turn is closed with: the special tokens the
    template writes after a reply (``<|eot_id|>``, ``<|im_end|>``, eos for plain); the eos id
    when it writes none."""
    template_name: str
    """The template used: its shipped name, its file path, or "tokenizer"."""

    def __init__(self, tokenizer_path: str, template: str = "") -> None:
        self.tokenizer_path = str(tokenizer_path)
        json_file, self._hf = _load_hf(self.tokenizer_path)
        self._json_file = json_file
        self._tok = _offset_encoder(json_file)
        self.template_name, self._template = self._resolve_template(template)
        self._check_template_tokens()
        self.eot_ids = self._end_of_turn_ids()

    @property
    def template_text(self) -> str:
        """The Jinja text of the template in use."""
        return self._template or self._hf.chat_template

    @property
    def vocab_size(self) -> int:
        """Ids of the tokenizer, added tokens included (the shards' dtype follows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def json_file(self) -> str:
        """The tokenizer.json this tokenizer was read from."""
        return str(self._json_file)

    def render(self, messages: list[dict], policy: MaskPolicy = MaskPolicy.assistant) -> Rendered:
        """``messages`` rendered and tokenized, with the loss mask of ``policy``."""
        import numpy as np  # the ground stays numpy-free until something renders

        policy = MaskPolicy(policy)
        messages = check_messages(messages, need_assistant=policy != MaskPolicy.all)
        text = self._render(messages, generation_prompt=False)
        encoding = self._tok.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int32)
        if policy == MaskPolicy.all:
            return Rendered(ids, np.ones(len(ids), dtype=np.uint8))
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=bool)
        for turn, (start, end) in self._assistant_spans(messages, text, policy):
            hit = (offsets[:, 0] < end) & (offsets[:, 1] > start)
            if not hit.any():
                raise ChatError(f"assistant message {turn} got no token (characters {start}-{end} "
                                f"of the rendered text {text[start:end]!r}); template {self.template_name}")
            mask |= hit
        return Rendered(ids, mask.astype(np.uint8))

    def render_prompt(self, messages: list[dict]) -> np.ndarray:
        """int32 ids of ``messages`` followed by the generation prompt (an opened assistant turn),
        for generation."""
        import numpy as np  # the ground stays numpy-free until something renders

        text = self._render(check_messages(messages, need_assistant=False), generation_prompt=True)
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def _assistant_spans(self, messages: list[dict], text: str, policy: MaskPolicy):
        """(message index, (start, end)) of the trained characters of each assistant turn."""
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if policy == MaskPolicy.last:
            turns = turns[-1:]
        spans = []
        for i in turns:
            if i == 0:
                raise ChatError("the conversation starts with an assistant message: nothing prompts "
                                "it; put a user (or system) message before it, or drop it")
            prompt = self._render(messages[:i], generation_prompt=True)
            full = self._render(messages[:i + 1], generation_prompt=False)
            self._check_prefix(i, prompt, full, text)
            end = len(full.rstrip())
            if end <= len(prompt):
                raise ChatError(f"template {self.template_name} renders nothing for assistant message "
                                f"{i} beyond its generation prompt (empty content and no end-of-turn)")
            spans.append((i, (len(prompt), end)))
        return spans

    def _check_prefix(self, turn: int, prompt: str, full: str, text: str) -> None:
        fix = ("use a template whose generation prompt is how an assistant turn begins and that "
               "renders earlier messages the same whatever follows (chat.template=llama3, chatml, "
               "plain or a .jinja file)")
        if not full.startswith(prompt):
            at = _first_difference(prompt, full)
            raise ChatError(f"template {self.template_name} does not render a prefix-stable "
                            f"conversation: for assistant message {turn}, the generation prompt "
                            f"renders {prompt[at:at + 60]!r} where the message itself renders "
                            f"{full[at:at + 60]!r}; {fix}")
        if not text.startswith(full):
            at = _first_difference(full, text)
            raise ChatError(f"template {self.template_name} does not render a prefix-stable "
                            f"conversation: messages after assistant message {turn} change how the "
                            f"conversation up to it renders ({full[at:at + 60]!r} becomes "
                            f"{text[at:at + 60]!r}); {fix}")

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        import jinja2

        try:
            return self._hf.apply_chat_template(messages, chat_template=self._template, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise ChatError(f"chat template {self.template_name} failed on this conversation "
                            f"({type(exc).__name__}: {exc})") from exc

    def _resolve_template(self, template: str) -> tuple[str, Optional[str]]:
        """(template_name, template text; None = the tokenizer's own)."""
        if not template:
            if not self._hf.chat_template:
                raise ChatError(f"tokenizer {self.tokenizer_path} has no chat template (no "
                                "chat_template in tokenizer_config.json, no chat_template.jinja): "
                                f"choose one with chat.template={', '.join(SHIPPED_TEMPLATES)} "
                                "or a path to a .jinja file")
            return "tokenizer", None
        if "{{" in template or "{%" in template:  # the text itself (e.g. a run's recorded one)
            return "recorded", template
        if template in SHIPPED_TEMPLATES:
            return template, (TEMPLATE_DIR / f"{template}.jinja").read_text(encoding="utf-8")
        path = Path(template)
        if path.is_file():
            return template, path.read_text(encoding="utf-8")
        raise ChatError(f"chat.template={template!r}: not a shipped template "
                        f"({', '.join(SHIPPED_TEMPLATES)}) and no such .jinja file")

    def _check_template_tokens(self) -> None:
        missing = [t for t in TEMPLATE_TOKENS.get(self.template_name, ())
                   if len(self._tok.encode(t, add_special_tokens=False).ids) != 1]
        if missing:
            raise ChatError(f"chat.template={self.template_name} writes {', '.join(missing)}, which "
                            f"tokenizer {self.tokenizer_path} does not hold as single tokens: choose "
                            "the template the model was trained with (chat.template=...; plain needs "
                            "no special tokens) or add them to the tokenizer")

    def _end_of_turn_ids(self) -> list[int]:
        """The special tokens the template writes after an assistant reply, else [eos]."""
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE_REPLY}]
        prompt = self._render(probe[:1], generation_prompt=True)
        full = self._render(probe, generation_prompt=False).rstrip()
        turn = full[len(prompt):] if full.startswith(prompt) else full
        at = turn.rfind(_PROBE_REPLY)
        after = turn[at + len(_PROBE_REPLY):] if at >= 0 else ""
        added = self._tok.get_added_tokens_decoder()
        ids = [i for i in self._tok.encode(after, add_special_tokens=False).ids if i in added]
        eos = self._hf.eos_token
        if not ids and eos and self._tok.token_to_id(eos) is not None:
            ids = [self._tok.token_to_id(eos)]
        return ids


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _load_hf(tokenizer_path: str):
    """(tokenizer.json path, transformers tokenizer) for a tokenizer directory or tokenizer.json."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:
        raise ChatError("chat templates are rendered with the transformers package, which is not "
                        "installed: pip install 'transformers>=4.45'") from exc
    path = Path(tokenizer_path)
    json_file = path / "tokenizer.json" if path.is_dir() else path
    if not json_file.is_file():
        raise ChatError(f"tokenizer {tokenizer_path}: no such tokenizer.json (give a Hugging Face "
                        "tokenizer directory or its tokenizer.json)")
    try:
        if json_file.name == "tokenizer.json":  # its directory may hold tokenizer_config.json
            hf = PreTrainedTokenizerFast.from_pretrained(str(json_file.parent), local_files_only=True)
        else:
            hf = PreTrainedTokenizerFast(tokenizer_file=str(json_file))
    except (OSError, ValueError, TypeError) as exc:
        raise ChatError(f"tokenizer {tokenizer_path} cannot be loaded: {exc}") from exc
    if not hf.eos_token and (eos := _eos_candidate(hf)):
        hf.eos_token = eos
    return json_file, hf


def _eos_candidate(hf) -> Optional[str]:
    """The first of data_prep's end-of-document tokens the vocabulary holds (as data_prep does
    for pretraining), for a tokenizer whose configuration names no eos token."""
    from launcher.core.special_tokens import EOD_CANDIDATES

    vocab = hf.get_vocab()
    return next((t for t in EOD_CANDIDATES if t in vocab), None)


def _offset_encoder(json_file: Path):
    """A ``tokenizers.Tokenizer`` whose offsets are exact: no post-processor, which only adds
    special tokens (not wanted: the template writes them) and may trim whitespace off offsets;
    and no truncation or padding a tokenizer.json may carry."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(json_file))
    tokenizer.post_processor = None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer
