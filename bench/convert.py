"""Export and import speed of ``launcher.convert`` as whole processes.

    python bench/convert.py [--model llama3_1b] [--engine megatron] [--workdir /tmp/tw_convert]

1. builds a random-init HF model of the preset's shape with transformers (bf16, saved as
   safetensors) - the import source;
2. ``launcher.convert from_hf`` into a step-0 checkpoint (one process, cluster.gpus_per_node=1);
3. ``launcher.convert to_hf`` of that checkpoint.

Prints wall time, GB/s of tensor data and each process's own peak RSS (wait4) against the largest
tensor; from_hf's RSS includes the model and the fresh optimizer state the checkpoint is written
with, to_hf's is the streaming export alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def hf_model(model: str, out: Path, layers: int) -> tuple[int, int]:
    """(bytes of tensor data, bytes of the largest tensor) of a random HF model of ``model``
    (``layers`` of them when not 0)."""
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from launcher.compose import compose_config, to_object
    from launcher.engines.weights.hf_export import hf_config
    from launcher.runtime.rundir import to_plain

    fields = to_plain(to_object(compose_config(
        [f"model={model}", *([f"model.num_layers={layers}"] if layers else [])])).model)
    config = hf_config(fields, dtype="bfloat16")
    kind = config.pop("model_type")
    cls = transformers.AutoConfig.for_model(kind, **config)
    torch.set_default_dtype(torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_config(cls)
    hf.save_pretrained(str(out))
    # Tied embeddings are one tensor under two names: count each storage once.
    tensors = list({t.untyped_storage().data_ptr(): t for t in hf.state_dict().values()}.values())
    return sum(t.numel() * t.element_size() for t in tensors), \
        max(t.numel() * t.element_size() for t in tensors)


def timed(cmd: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS of this child alone in GB, from wait4's rusage)."""
    start = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "2"},
                             stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code "
                         f"{os.waitstatus_to_exitcode(status)}")
    return seconds, usage.ru_maxrss / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--engine", default="megatron")
    parser.add_argument("--workdir", default="/tmp/tw_convert")
    parser.add_argument("--layers", type=int, default=0,
                        help="build the preset with this many layers (0: the preset's). from_hf "
                             "holds a training state (about 18 bytes a parameter with bf16 and "
                             "Adam), so llama3_1b needs about 23 GB; --layers 8 fits 16 GB")
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    total, largest = hf_model(args.model, work / "hf", args.layers)
    print(f"{args.model}: {total / 1e9:.2f} GB of tensors, largest {largest / 1e9:.3f} GB")
    rows = []
    imp = [sys.executable, "-m", "launcher.convert", "from_hf", f"hf={work / 'hf'}",
           f"out={work / 'run'}", f"engine={args.engine}", "cluster.gpus_per_node=1",
           "model.seq_length=1024", *([f"model.num_layers={args.layers}"] if args.layers else [])]
    rows.append(("from_hf", *timed(imp)))
    exp = [sys.executable, "-m", "launcher.convert", "to_hf", f"checkpoint={work / 'run'}",
           f"out={work / 'hf_out'}"]
    rows.append(("to_hf", *timed(exp)))
    for name, seconds, rss in rows:
        print(f"{name:8s} {seconds:7.1f} s  {total / 1e9 / seconds:6.2f} GB/s  peak RSS "
              f"{rss:5.2f} GB ({rss * 1e9 / largest:.1f} x the largest tensor)")
    print(json.dumps({"model": args.model, "layers": args.layers, "bytes": total,
                      "largest": largest, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
