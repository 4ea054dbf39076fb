"""Time ``launcher.search`` end to end on this machine: Llama 3 405B on 16,384 H100 (2,048 nodes
x 8), 2,048 x 8,192-token sequences per step, every engine.

    .venv/bin/python bench/search_speed.py [repeats]

Prints the layouts searched and kept, the median wall time of ``search()`` (composition
excluded) and of the whole ``python -m launcher.search`` process. The issue asks for under 10 s.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OVERRIDES = ["model=llama3_405b", "cluster=slurm_h100", "cluster.nodes=2048",
             "trainer.micro_batch_size=1", "trainer.global_batch_size=2048"]


def main(repeats: int = 3) -> None:
    from launcher.compose import compose_config, to_object
    from launcher.search.search import search

    cfg = to_object(compose_config(OVERRIDES))
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = search(cfg)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "launcher.search", *OVERRIDES, "search.format=json"],
                   cwd=REPO, check=True, capture_output=True)
    process = time.perf_counter() - start
    best = result.ranked[0]
    print(f"searched {result.searched:,} layouts, {result.valid:,} valid and fitting")
    print(f"search(): median {statistics.median(times):.2f} s over {repeats} runs")
    print(f"python -m launcher.search process: {process:.2f} s")
    print(f"best: {' '.join(best.candidate.overrides())} -> {best.step.total:.2f} s/step, "
          f"MFU {best.mfu:.1%}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
