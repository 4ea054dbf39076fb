"""Typed schema of ``python -m data_prep`` (primary config ``conf/prepare.yaml``).

:class:`PrepareConfig` is registered in Hydra's ConfigStore as ``prepare_schema`` and is the first
entry of ``conf/prepare.yaml``'s defaults list, so ``conf/data_prep/*.yaml`` and every command-line
override are merged into a struct-mode config: an unknown key or a value of the wrong type fails at
compose time (exit code 2). Schemas hold primitives only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import List

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class InputFormat(StrEnum):
    auto = "auto"
    """Decide per file from its name: .jsonl/.json/.ndjson (+ .gz/.zst), .parquet, anything else text."""
    jsonl = "jsonl"
    """One JSON object per line; the document is the string under ``text_key``."""
    parquet = "parquet"
    """One document per row of the string column ``text_key``."""
    text = "text"
    """Plain UTF-8 text; ``text_unit`` says whether a file or a line is one document."""
    chat = "chat"
    """Conversations for fine-tuning (JSONL or Parquet, each file's format from its name): a
    ``messages`` list of {role, content}, or ``prompt``/``completion`` strings; rendered with a chat
    template, written with a loss mask and packed (see ChatConfig, docs/fine_tuning.md)."""


class ChatMask(StrEnum):
    assistant = "assistant"
    """Every assistant turn's tokens and each one's end-of-turn token."""
    last = "last"
    """The last assistant turn only (and its end-of-turn token)."""
    all = "all"
    """Every token of the conversation."""


class Overlong(StrEnum):
    truncate = "truncate"
    """Keep a conversation's first seq_length + 1 tokens (dropped when none of them is a target)."""
    drop = "drop"
    """Leave out a conversation longer than seq_length + 1 tokens."""


class TextUnit(StrEnum):
    file = "file"
    """A whole plain-text file is one document."""
    line = "line"
    """Every non-empty line of a plain-text file is one document (line ending removed)."""


class TokenizerKind(StrEnum):
    hf = "hf"
    """A HuggingFace ``tokenizer.json`` file, or a local directory holding one."""
    tiktoken = "tiktoken"
    """A ``.tiktoken`` rank file named after its encoding, or an encoding name available offline."""
    sentencepiece = "sentencepiece"
    """A SentencePiece ``.model`` file."""
    byte = "byte"
    """UTF-8 bytes as tokens 0-255, EOD 256, BOS 257; needs no file."""


class Backend(StrEnum):
    auto = "auto"
    """gigatoken where it loads the tokenizer and matches the native library on a probe, else native."""
    gigatoken = "gigatoken"
    """Force gigatoken (fails if it cannot load the tokenizer)."""
    native = "native"
    """The tokenizer's own library: tokenizers, tiktoken or sentencepiece."""


@dataclass
class TokenizerConfig:
    kind: TokenizerKind = TokenizerKind.byte
    """Which tokenizer family ``path`` holds (see TokenizerKind)."""
    path: str = ""
    """Tokenizer file, directory or (tiktoken only) encoding name; empty only for kind=byte."""
    backend: Backend = Backend.auto
    """Which library encodes (see Backend); every backend yields the same token ids."""
    append_eod: bool = True
    """Append the end-of-document token after every document."""
    eod_token_id: int = -1
    """End-of-document token id; -1 = the tokenizer's own (<|endoftext|>, </s>, eos piece, 256)."""
    prepend_bos: bool = False
    """Put a beginning-of-sequence token before every document."""
    bos_token_id: int = -1
    """BOS token id; -1 = the tokenizer's own (<s>, <|begin_of_text|>, bos piece, 257)."""


@dataclass
class ChatConfig:
    template: str = ""
    """Chat template: empty = the tokenizer's own (tokenizer_config.json's chat_template); a
    shipped name (llama3, chatml, plain, mistral, phi3, olmo2, gemma, deepseek_v3); or a .jinja
    file."""
    mask: ChatMask = ChatMask.assistant
    """Which tokens are trained (see ChatMask)."""
    pack: bool = True
    """Pack conversations into rows of seq_length + 1 tokens (best-fit decreasing); false = one
    conversation per row (padded when trained)."""
    overlong: Overlong = Overlong.truncate
    """What becomes of a conversation longer than a row (see Overlong); either way it is counted."""
    pack_window: int = 200_000
    """Conversations packed together at a time (bounds memory; larger packs a little tighter)."""
    pack_multiple: int = 1
    """Pack each conversation as if it were rounded up to a multiple of this many tokens, into
    rows of seq_length (not seq_length + 1) tokens, so that training can pad it there: context
    parallelism over packed rows (Transformer Engine) needs 2 x context_parallel_size (or a
    multiple of it). seq_length must be a multiple of it. 1 = no rounding."""


@dataclass
class PrepareConfig:
    input: List[str] = MISSING
    """Input files, globs or directories (walked recursively), in this order; a single value works."""
    output: str = MISSING
    """Output directory for shards, manifest.json and data.yaml (created if missing); or
    ``s3://bucket/folder``: written into ``staging_dir``, then uploaded there, the manifest last
    (docs/data_prep.md, Data on object storage)."""
    staging_dir: str = ""
    """output=s3://... only: the local directory the dataset is written into before its upload
    (kept: a re-run resumes from it, and uploads unless the store holds its very commit); empty =
    $TRAINWRIGHT_CACHE/data_prep/<bucket>/<folder>, by default under ~/.cache/trainwright."""
    name: str = ""
    """Shard name stem: shards are <name>_<NNNNN>.bin/.idx; empty = the output directory's name."""
    format: InputFormat = InputFormat.auto
    """Input format of every file (see InputFormat); auto decides per file from its name."""
    text_key: str = "text"
    """JSON key (jsonl) or column (parquet) holding the document text."""
    text_unit: TextUnit = TextUnit.file
    """Plain-text inputs: one document per file or per line (see TextUnit)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer and special tokens."""
    workers: int = 0
    """Worker processes that read and tokenize; 0 = all cores; 1 = all work in this process."""
    block_bytes: int = 8 * 1024 * 1024
    """Input bytes per work unit (blocks end at a line or file boundary). Bounds memory per worker."""
    shard_tokens: int = 0
    """Close a shard at the first block boundary at or past this many tokens; 0 = no token limit."""
    shard_bytes: int = 2 * 1024**3
    """Close a shard at the first block boundary at or past this .bin size (bytes); 0 = no limit."""
    num_tasks: int = 0
    """Array tasks splitting the inputs; 0 = $SLURM_ARRAY_TASK_COUNT, or 1 when unset."""
    task_index: int = -1
    """This task's index, 0-based; -1 = $SLURM_ARRAY_TASK_ID - $SLURM_ARRAY_TASK_MIN, or 0 when unset."""
    max_bad_fraction: float = 0.001
    """Exit non-zero (code 3) when skipped records exceed this fraction of all records (0-1)."""
    strict: bool = False
    """Fail (code 3) at the first bad record, naming file and line, instead of skipping it."""
    examples_per_reason: int = 5
    """How many file:line examples of each skip reason the manifest and the summary keep."""
    overwrite: bool = False
    """Allow replacing an output directory that holds a different run (other inputs or settings)."""
    hash_inputs: bool = True
    """Record every input file's sha256 in the manifest (hashed beside the tokenizing, one process
    per 4 workers, whole files each). false leaves ``sha256`` empty and skips that second read of
    the inputs: a single file hashes at about 2 GB/s at most, so a corpus of one very large file on
    a node of many cores can make the run wait for its digest."""
    progress: bool = True
    """Show progress on stderr: a live bar on a terminal, a plain line every ``progress_every_s``
    seconds otherwise (a Slurm log, a pipe). The final summary is printed either way."""
    progress_every_s: float = 30.0
    """Seconds between the plain progress lines written when stderr is not a terminal; 0 = none
    (the summary only)."""
    dry_run: bool = False
    """Plan and estimate only: list the inputs, tokenize a sample of about 64 MiB on one core and
    print the expected tokens, output size (against the output filesystem's free space) and
    time; nothing is written."""
    split: str = "98,1,1"
    """Train, validation, test proportions written into the generated data.yaml."""
    seq_length: int = 0
    """format=chat: tokens per training sequence (a row holds seq_length + 1: the inputs and the
    labels shifted by one); 0 = not given (required with format=chat)."""
    chat: ChatConfig = field(default_factory=ChatConfig)
    """format=chat: template, loss mask and packing."""


def register_configs() -> None:
    """Register the schema; conf/prepare.yaml lists it first in its defaults."""
    ConfigStore.instance().store(name="prepare_schema", node=PrepareConfig)


register_configs()
