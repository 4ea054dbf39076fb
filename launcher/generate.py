"""``python -m launcher.generate checkpoint=<dir> generate.prompt="..." [overrides]``

Continues a prompt with a checkpoint's model (a trainwright run / step directory of either
engine, or a Hugging Face directory), greedy (``generate.temperature=0``) or sampled
(temperature, top-p, seed), at any layout the weights load into: ``parallelism.*`` with
``cluster.gpus_per_node`` processes (e.g. TP=2 on two processes). The model comes from the
checkpoint (an explicit model that disagrees exits 2). Each new token re-runs the forward pass
over the whole sequence through Megatron-Core's schedule (no KV cache: a tool to look at a
model and to prove its forward pass, not a server). ``generate.format=json`` prints
``{"prompt_ids": [...], "output_ids": [...], "text": "..."}`` (output_ids = the new tokens).
Exit codes: 0 done, 2 config error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from launcher.compose import compose_or_exit, to_object
from launcher.core.exits import CONFIG_ERROR_EXIT


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
    """The tokenizer.json to use: generate.tokenizer, the HF directory's, or the run's."""
    for candidate in (gen.tokenizer, checkpoint):
        if not candidate:
            continue
        p = Path(candidate)
        if p.is_file() and p.suffix == ".json":
            return p
        if (p / "tokenizer.json").is_file():
            return p / "tokenizer.json"
    from launcher.engines.weights.sources import checkpoint_meta, step_dir_of
    from launcher.convert.to_hf import tokenizer_files

    if (Path(checkpoint) / "config.json").is_file():
        return None
    return tokenizer_files(checkpoint_meta(step_dir_of(Path(checkpoint))))


def prompt_ids(gen, tokenizer: Optional[Path]) -> list[int]:
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


def run(argv: Sequence[str], checkpoint: str) -> int:
    """Body of every generation process."""
    import torch

    from launcher.engines import compat
    from launcher.engines.megatron.engine import build_model_chunks
    from launcher.engines.model import init_parallel_state
    from launcher.engines.weights.fill import fill_chunks
    from launcher.parallel.distributed import destroy_distributed, init_distributed
    from launcher.engines.megatron.generation import Generator

    cfg = to_object(compose_or_exit(argv))
    compat.install()
    init_distributed(ranks_per_gpu=cfg.cluster.ranks_per_gpu)
    try:
        tokenizer = tokenizer_path(cfg.generate, checkpoint)
        ids = prompt_ids(cfg.generate, tokenizer)
        parallelism = _for_inference(cfg.parallelism)
        init_parallel_state(parallelism, seed=cfg.trainer.seed)
        chunks = build_model_chunks(cfg.model, parallelism, cfg.trainer)
        fill_chunks(chunks, checkpoint)
        generator = Generator(chunks, vocab_size=cfg.model.vocab_size)
        with torch.no_grad():
            new, logits = generator.generate(ids, cfg.generate)
        _report(cfg.generate, ids, new, logits, tokenizer, generator)
        return 0
    finally:
        destroy_distributed()


def _for_inference(parallelism):
    """No sequence parallelism (the prompt need not divide by TP); the rest as given."""
    import dataclasses

    return dataclasses.replace(parallelism, sequence_parallel=False)


def _report(gen, ids, new, logits, tokenizer, generator) -> None:
    if gen.logits_file and logits is not None and generator.writes_logits():
        import numpy as np

        from launcher.core.atomic import atomic_write_bytes
        import io

        buffer = io.BytesIO()
        np.save(buffer, logits.float().numpy())
        atomic_write_bytes(gen.logits_file, buffer.getvalue())
    if not generator.prints():
        return
    text = decode(new, tokenizer)
    if gen.format == "json":
        print(json.dumps({"prompt_ids": ids, "output_ids": new, "text": text}), flush=True)
    else:
        print(text if tokenizer else " ".join(map(str, new)), flush=True)


def _entry(argv: list, checkpoint: str) -> None:
    code = run(argv, checkpoint)
    if code:
        raise SystemExit(code)


def main(argv: Sequence[str] | None = None) -> int:
    import uuid

    from launcher.convert.model_source import adopt_model
    from launcher.launch.local import launch_local_world
    from launcher.parallel.distributed import in_distributed_launch

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    checkpoint, rest = split_checkpoint(argv)
    if not checkpoint:
        print("generate: missing checkpoint=<run, step or Hugging Face directory>",
              file=sys.stderr)
        return CONFIG_ERROR_EXIT
    argv = adopt_model(rest, "checkpoint", path=checkpoint)
    cfg = to_object(compose_or_exit(argv))
    if cfg.generate.format not in ("text", "json"):
        print(f"generate: generate.format={cfg.generate.format}: use text or json",
              file=sys.stderr)
        return CONFIG_ERROR_EXIT
    nprocs = cfg.cluster.gpus_per_node * cfg.cluster.ranks_per_gpu
    if in_distributed_launch() or nprocs == 1:
        return run(argv, checkpoint)
    launch_local_world(_entry, (argv, checkpoint), nprocs, run_id=f"tw-{uuid.uuid4().hex[:8]}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
