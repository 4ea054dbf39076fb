"""``python -m launcher.generate checkpoint=<dir> generate.prompt="..." [overrides]``

Continues a prompt with a checkpoint's model (a trainwright run / step directory of either
engine, or a Hugging Face directory), greedy (``generate.temperature=0``) or sampled
(temperature, top-p, seed), at any layout the weights load into: ``parallelism.*`` with
``cluster.gpus_per_node`` processes (e.g. TP=2 on two processes). The model comes from the
checkpoint (an explicit model that disagrees exits 2). Each new token re-runs the forward pass
over the whole sequence through Megatron-Core's schedule (no KV cache: a tool to look at a
model and to prove its forward pass, not a server). ``generate.format=json`` prints
``{"prompt_ids": [...], "output_ids": [...], "text": "..."}`` (output_ids = the new tokens).
``generate.chat=true`` renders the prompt as one user turn with the checkpoint's chat template
(``generate.chat_template`` to choose another) and stops at its end-of-turn token.
Exit codes: 0 done, 2 config error, 128 + N stopped by signal N (SIGTERM, SIGINT, ...) before
the output was printed.
"""

from __future__ import annotations

RANK_MODULES = ("megatron.core.models.gpt", "launcher.generate", "launcher.engines.weights.fill")
"""What a generating rank imports, imported for it before it starts
(:func:`launcher.launch.rank_preload.preload_rank_imports`)."""

if __name__ == "__main__":  # the server starts before this module's own imports
    import sys as _sys

    if not {"-h", "--help"} & set(_sys.argv[1:]):
        from launcher.launch.rank_preload import preload_rank_imports as _preload

        _preload(RANK_MODULES)

import functools
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from launcher.config import GenerateFormat
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.launch.agent import scheduler_exit
from launcher.launch.bootstrap import Rank, run_ranks
from launcher.launch.job import prepare
from launcher.launch.model_source import adopt_model
from launcher.launch.rank_preload import preload_rank_imports
from launcher.launch.remote_inputs import localized


def split_checkpoint(argv: Sequence[str]) -> tuple[str, list]:
    """(checkpoint path, the other arguments)."""
    path, rest = "", []
    for arg in argv:
        if arg.startswith("checkpoint="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return path, rest


def tokenizer_path(gen, checkpoint: str) -> Optional[Path]:
    """The tokenizer.json to use: generate.tokenizer, the HF directory's, the one kept in the
    checkpoint (from_hf's, with its chat template), or the run's."""
    for candidate in (gen.tokenizer, checkpoint):
        if not candidate:
            continue
        p = Path(candidate)
        if p.is_file() and p.suffix == ".json":
            return p
        if (p / "tokenizer.json").is_file():
            return p / "tokenizer.json"
    from launcher.engines.weights.sources import step_dir_of, step_tokenizer

    if (Path(checkpoint) / "config.json").is_file():
        return None
    return step_tokenizer(step_dir_of(Path(checkpoint)))


def chat_tokenizer(gen, tokenizer: Optional[Path], checkpoint: str):
    """generate.chat's ChatTokenizer: generate.chat_template, else the tokenizer's own template,
    else the one the checkpoint's run was prepared with; ValueError naming the fix."""
    from launcher.core.chat_render import ChatError, ChatTokenizer

    if tokenizer is None:
        raise ValueError("generate.chat needs the checkpoint's tokenizer (a Hugging Face "
                         "tokenizer.json); pass generate.tokenizer=<tokenizer directory>")
    template = gen.chat_template or run_chat_template(checkpoint)
    try:
        return ChatTokenizer(str(tokenizer), template)
    except ChatError as exc:
        raise ValueError(f"generate.chat: {exc}") from None


def run_chat_template(checkpoint: str) -> str:
    """The chat template of a trainwright checkpoint's run ('' for a Hugging Face directory,
    whose tokenizer_config.json holds its own)."""
    from launcher.engines.weights.sources import (SourceError, chat_template_text,
                                                  checkpoint_meta, step_dir_of)

    if (Path(checkpoint) / "config.json").is_file():
        return ""
    try:
        return chat_template_text(checkpoint_meta(step_dir_of(Path(checkpoint))))
    except SourceError:
        return ""


def prompt_ids(gen, tokenizer: Optional[Path], chat=None) -> list[int]:
    if chat is not None and gen.prompt:  # one user turn, then the assistant's header
        return [int(t) for t in chat.render_prompt([{"role": "user", "content": gen.prompt}])]
    if gen.prompt_ids:
        return [int(t) for t in gen.prompt_ids]
    if not gen.prompt:
        raise ValueError("give generate.prompt=\"...\" or generate.prompt_ids=[...]")
    if tokenizer is None:
        raise ValueError("generate.prompt needs a tokenizer and the checkpoint names none that "
                         "can be read (a Hugging Face tokenizer.json); pass "
                         "generate.tokenizer=<tokenizer.json> or generate.prompt_ids=[...]")
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(tokenizer)).encode(
        gen.prompt, add_special_tokens=False).ids


def decode(ids: list[int], tokenizer: Optional[Path]) -> str:
    if tokenizer is None:
        return ""
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(tokenizer)).decode(ids)


def generate_rank(rank: Rank, checkpoint: str) -> int:
    """One rank of the generation: the checkpoint's weights into this layout's model chunks,
    then token by token (each token a point where a stop signal ends the command)."""
    import torch

    from launcher.engines.megatron.engine import build_model_chunks
    from launcher.engines.megatron.generation import Generator
    from launcher.engines.weights.fill import fill_chunks

    cfg = rank.job.cfg
    tokenizer = tokenizer_path(cfg.generate, checkpoint)
    chat = chat_tokenizer(cfg.generate, tokenizer, checkpoint) if cfg.generate.chat else None
    ids = prompt_ids(cfg.generate, tokenizer, chat)
    chunks = build_model_chunks(cfg.model, cfg.parallelism, cfg.trainer)
    fill_chunks(chunks, checkpoint)
    generator = Generator(chunks, vocab_size=cfg.model.vocab_size)
    with torch.no_grad():
        new, logits = generator.generate(ids, cfg.generate, stop=rank.stop.agree,
                                         stop_ids=frozenset(chat.eot_ids) if chat else frozenset())
    if rank.stop.decided:
        rank.console.error(f"generate: stopped by signal {rank.stop.signal_received} after "
                           f"{len(new)} token(s); nothing written")
        return rank.stopped_exit()
    _report(cfg.generate, ids, new, logits, tokenizer, generator, rank.console.out)
    return 0


def _for_inference(argv: Sequence[str]) -> list[str]:
    """No sequence parallelism (the prompt need not divide by TP); the rest as given."""
    return [*argv, "parallelism.sequence_parallel=false"]


def _report(gen, ids, new, logits, tokenizer, generator, out) -> None:
    if gen.logits_file and logits is not None and generator.writes_logits():
        import numpy as np

        from launcher.core.atomic import atomic_write_bytes
        import io

        buffer = io.BytesIO()
        np.save(buffer, logits.float().numpy())
        atomic_write_bytes(gen.logits_file, buffer.getvalue())
    if not generator.prints():
        return
    text = decode(new, tokenizer)  # an end-of-turn token is special: decoding skips it
    if gen.format == GenerateFormat.json:
        print(json.dumps({"prompt_ids": ids, "output_ids": new, "text": text}), file=out,
              flush=True)
    else:
        print(text if tokenizer else " ".join(map(str, new)), file=out, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    preload_rank_imports(RANK_MODULES)
    checkpoint, rest = split_checkpoint(localized(argv, ("checkpoint",)))  # s3://: local copy
    if not checkpoint:
        print("generate: missing checkpoint=<run, step or Hugging Face directory>",
              file=sys.stderr)
        return CONFIG_ERROR_EXIT
    job = prepare(_for_inference(adopt_model(rest, "checkpoint", path=checkpoint)), plan=False)
    if job.cfg.generate.chat:  # the template and tokenizer checked before any rank starts
        try:
            chat_tokenizer(job.cfg.generate, tokenizer_path(job.cfg.generate, checkpoint),
                           checkpoint)
        except ValueError as exc:
            print(f"generate: {exc}", file=sys.stderr)
            return CONFIG_ERROR_EXIT
    return run_ranks(job, functools.partial(generate_rank, checkpoint=checkpoint),
                     command="generate")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(scheduler_exit(main))
