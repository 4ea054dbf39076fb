"""Cost of layout-invariant initial weights against Megatron-Core's own init, side by side.

Builds the same GPTModel twice in one process (one rank, gloo, CPU): once as Megatron-Core draws
it (``torch.nn.init`` per parameter, on the rank's generator), and then the redraw of
``launcher.engines.seeded_init`` on that model (every matrix from seeded 1024 x 1024 tiles).
Prints both times, the ratio, and elements per second of the redraw.

    .venv/bin/python bench/seeded_init.py [--model llama3_1b] [--layers 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _median(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from launcher.compose import compose_config, to_object
    from launcher.engines import compat
    from launcher.engines.model import build_gpt_model, init_parallel_state
    from launcher.engines.seeded_init import seed_chunks
    from launcher.parallel.distributed import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    cfg = to_object(compose_config([f"model={args.model}", f"model.num_layers={args.layers}",
                                    "trainer.precision=fp32"]))
    compat.install()
    init_distributed()
    try:
        init_parallel_state(cfg.parallelism, seed=cfg.trainer.seed)
        build_s, gpt = _median(lambda: build_gpt_model(cfg.model, cfg.parallelism, cfg.trainer),
                               args.repeats)
        redraw_s, written = _median(lambda: seed_chunks([gpt], seed=cfg.trainer.seed),
                                    args.repeats)
    finally:
        destroy_distributed()
    params = sum(p.numel() for p in gpt.parameters())
    row = {"model": args.model, "layers": args.layers, "parameters": params,
           "megatron_build_s": round(build_s, 3), "redraw_s": round(redraw_s, 3),
           "redraw_over_build": round(redraw_s / build_s, 3),
           "redraw_elements_per_s": round(written / redraw_s)}
    print(f"{args.model} with {args.layers} layers: {params / 1e6:.1f}M parameters; Megatron-Core "
          f"build + own init {build_s:.2f} s, layout-invariant redraw {redraw_s:.2f} s "
          f"({redraw_s / build_s:.2f} x), {written / redraw_s / 1e6:.0f}M elements/s on one "
          "CPU thread")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
