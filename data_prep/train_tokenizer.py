"""``python -m data_prep.train_tokenizer``: train a byte-level BPE on local text (HF ``tokenizers``).

Reads the same inputs as data_prep (JSONL, compressed JSONL, parquet, text) and writes a
``tokenizer.json`` usable with ``tokenizer.kind=hf tokenizer.path=<file>``. The vocabulary holds the
256 byte tokens, the merges and the special tokens (``<|endoftext|>`` first, so it is the EOD).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator, List

from data_prep.blocks import iter_blocks
from data_prep.errors import DataPrepError
from data_prep.inputs import expand_inputs
from data_prep.records import RecordSink
from data_prep.worker import _STATE, block_parts, parse_into
from launcher.core.atomic import atomic_write_bytes


def iter_texts(specs: List[str], text_key: str, text_unit: str) -> Iterator[str]:
    """Every accepted document of the inputs, in order (bad records are skipped silently)."""
    _STATE.update({"text_key": text_key, "part_bytes": 8 << 20})
    for block in iter_blocks(expand_inputs(specs, "auto"), text_key, text_unit, 8 << 20):
        for _, part, _ in block_parts(block):
            sink = RecordSink(0, strict=False)
            parse_into(block, part, sink)
            yield from sink.texts


def train(specs: List[str], vocab_size: int, output: str, text_key: str = "text",
          text_unit: str = "file", special_tokens: List[str] = ("<|endoftext|>",)) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(iter_texts(specs, text_key, text_unit), trainer=trainer)
    path = os.path.join(output, "tokenizer.json") if os.path.isdir(output) else output
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_bytes(path, tokenizer.to_str().encode("utf-8"))
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_prep.train_tokenizer", description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="files, globs or directories")
    parser.add_argument("--vocab-size", type=int, required=True, help="total vocabulary size (tokens)")
    parser.add_argument("--output", required=True, help="tokenizer.json path (or a directory)")
    parser.add_argument("--text-key", default="text", help="JSON key / parquet column of the text")
    parser.add_argument("--text-unit", default="file", choices=["file", "line"], help="plain-text unit")
    parser.add_argument("--special", nargs="*", default=["<|endoftext|>"], help="special tokens")
    args = parser.parse_args(argv)
    if args.vocab_size < 256 + len(args.special):
        print(f"--vocab-size must be at least {256 + len(args.special)} (bytes + specials)", file=sys.stderr)
        return 2
    try:
        path = train(args.input, args.vocab_size, args.output, args.text_key, args.text_unit, args.special)
    except DataPrepError as exc:
        print(f"data_prep.train_tokenizer: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
