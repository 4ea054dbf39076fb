"""Scoring's forward passes with rows packed several to a sequence, against one row a sequence,
side by side in one process (issue 47).

    .venv/bin/python bench/eval_packing.py [--packs 0 56 72 112 152] [--repeat 2] [--json out]

A Llama-style model as bench/eval_cost.py's (4 layers, hidden 256, ffn 688, 4 heads, seq 2,048,
fp32, random weights) built with Megatron-Core's local layers on this CPU (one thread), and 480
rows of 10-26 tokens (a multiple-choice task's). Each pack length (0: one row a sequence,
length-sorted micro-batches) scores the rows through the Megatron engine's scoring
(``launcher.engines.megatron.scoring.score_batches``: the schedule, the explicit attention mask,
the per-row sums), micro-batch 4 (8,192 tokens a micro-batch), the lengths taking turns
``--repeat`` times; printed: seconds, the tokens computed against the rows' own, and each
pack's median time against the unpacked median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rows_and_lengths(count: int):
    import numpy as np

    from launcher.evals.rows import row_length

    rng = np.random.default_rng(0)
    rows = [(list(rng.integers(1, 2000, int(n))), [5, 6]) for n in rng.integers(8, 24, count)]
    return rows, [row_length(c, x, 2048) for c, x in rows]


def timed_scoring(gpt, rows, lengths, pack: int) -> tuple[float, float]:
    """(seconds, computed tokens / the rows' tokens) of scoring ``rows`` packed at ``pack``."""
    import torch

    from launcher.engines.megatron.scoring import score_batches
    from launcher.evals.rows import Packing, computed_tokens, replica_batches, score_plan

    plan = score_plan(lengths, dp=1, seq=2048, micro_batch=4, packing=Packing(pack))
    batches = [{k: torch.from_numpy(v) for k, v in b.items()}
               for b in replica_batches(rows, plan, 0)]
    start = time.perf_counter()
    score_batches([gpt], batches, device=torch.device("cpu"), vocab_size=2048)
    return time.perf_counter() - start, computed_tokens(plan, 1) / sum(lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, nargs="+", default=[0, 56, 72, 112, 152])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    import torch

    from launcher.config import ModelConfig, ParallelismConfig, Precision, TrainerConfig
    from launcher.engines import compat
    from launcher.engines.model import build_gpt_model, init_parallel_state

    compat.install()  # as a rank does: Megatron-Core on the CPU
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    init_parallel_state(ParallelismConfig(), seed=1234)
    model = ModelConfig(name="bench", num_layers=4, hidden_size=256, ffn_hidden_size=688,
                        num_attention_heads=4, vocab_size=2048, seq_length=2048)
    gpt = build_gpt_model(model, ParallelismConfig(),
                          TrainerConfig(precision=Precision.fp32)).eval()
    rows, lengths = rows_and_lengths(480)
    seconds: dict = {pack: [] for pack in args.packs}
    ratios: dict = {}
    for turn in range(args.repeat):
        for pack in args.packs:
            took, ratios[pack] = timed_scoring(gpt, rows, lengths, pack)
            seconds[pack].append(took)
            print(f"turn {turn}: pack {pack:>4}: {took:.2f} s, tokens {ratios[pack]:.2f}x the "
                  "rows'", flush=True)
    base = statistics.median(seconds[args.packs[0]])
    summary = {pack: {"median_s": statistics.median(times), "vs_first": statistics.median(
        times) / base, "tokens_vs_real": ratios[pack], "seconds": times}
        for pack, times in seconds.items()}
    for pack, row in summary.items():
        print(f"pack {pack:>4}: median {row['median_s']:.2f} s = {row['vs_first']:.2f}x pack "
              f"{args.packs[0]}; tokens {row['tokens_vs_real']:.2f}x the rows'")
    if args.json:
        from launcher.plan.machine import cpu_info

        Path(args.json).write_text(json.dumps({
            "host": {"cpu": cpu_info().model, "cores": os.cpu_count()},
            "started": time.strftime("%Y-%m-%d %H:%M"), "packs": summary}, indent=1) + "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
