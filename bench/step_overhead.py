"""Step-time overhead of ``python -m launcher.train`` over a bare Megatron-Core + DeepSpeed loop.

Both sides train the same model with the same DeepSpeed config, batch shapes and number of
processes, one after the other in this run:

* launcher: ``python -m launcher.train <overrides>``; per-step ``step_time`` and ``time/<phase>``
  are read from the run's ``metrics.jsonl``;
* bare: this file under ``torch.distributed.run``: ``GPTModel`` (the same TransformerConfig and
  layer spec), ``torch.optim.AdamW``, ``deepspeed.initialize`` with the launcher run's own
  ``ds_config.json``, random tokens, and a loop of forward / masked-mean loss / ``engine.backward``
  / ``engine.step``, timed per phase with ``time.perf_counter`` (no metrics, no health checks, no
  stop agreement, no data loader).

Steady state: the first ``--warmup`` steps of each side are dropped; the ratio is launcher median
step time / bare median step time (target <= 1.02).

    python bench/step_overhead.py [--steps 60] [--warmup 10] [--json] [override ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
FIXED = ["trainer.eval_interval=0", "trainer.save_interval=0", "logger=none",
         "optimizer.warmup_steps=4"]
"""Applied before the user's overrides (which win): no evaluation or checkpoint inside the timing."""
PHASES = ("data", "forward", "loss", "backward", "optimizer")


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
            "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run_launcher(out: Path, overrides: list, steps: int) -> Path:
    args = [sys.executable, "-m", "launcher.train", *overrides, f"run.output_root={out}",
            "run.name=launcher", f"trainer.train_steps={steps}", "trainer.log_interval=1"]
    subprocess.run(args, cwd=REPO, env=env(), check=True, stdout=subprocess.DEVNULL)
    return out / "launcher"


def launcher_times(run_dir: Path, warmup: int) -> dict:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r and r["step"] > warmup]
    phase = {p: statistics.mean(r.get(f"time/{p}", 0.0) + (r.get("time/backward+grad_sync", 0.0)
                                                           if p == "backward" else 0.0)
                                for r in rows) for p in PHASES}
    return {"steps": len(rows), "median": statistics.median(r["step_time"] for r in rows),
            "mean": statistics.mean(r["step_time"] for r in rows), "phases": phase}


def run_bare(out: Path, run_dir: Path, overrides: list, steps: int, warmup: int,
             nprocs: int) -> dict:
    spec = {"ds_config": str(run_dir / "ds_config.json"), "overrides": overrides, "steps": steps,
            "warmup": warmup, "result": str(out / "bare.json")}
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nprocs}", str(Path(__file__).resolve()), "--bare-worker",
            json.dumps(spec)]
    subprocess.run(args, cwd=REPO, env=env(), check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "bare.json").read_text())


def build_bare_engine(cfg, ds_config: dict):
    """GPTModel + AdamW (decay groups as in the launcher) + deepspeed.initialize."""
    import deepspeed
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from launcher.engines import compat
    from launcher.engines.deepspeed.mpu import DeepSpeedMPU
    from launcher.config import Arch
    from launcher.engines.model import transformer_config, use_transformer_engine
    from launcher.shape.model import padded_vocab_size

    compat.install()  # CUDA-only calls of Megatron-Core redirected on a CPU machine
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(cfg.trainer.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.trainer.seed)
    config = transformer_config(cfg.model, cfg.parallelism, cfg.trainer)
    vocab = padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, 1)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_transformer_engine(),
        normalization=config.normalization),
        vocab_size=vocab, max_sequence_length=cfg.model.seq_length,
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        position_embedding_type="rope" if cfg.model.arch == Arch.llama else "learned_absolute",
        rotary_base=cfg.model.rotary_base)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim > 1],
               "weight_decay": cfg.optimizer.weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=cfg.optimizer.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw, config=ds_config,
                                           mpu=DeepSpeedMPU())
    return engine, vocab


def bare_steps(engine, vocab: int, ds_config: dict, seq: int, steps: int) -> list:
    """Per-step {"step": seconds, phase: seconds} of the bare loop."""
    import torch

    mbs, accum = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    gen, out = torch.Generator().manual_seed(torch.distributed.get_rank()), []
    for _ in range(steps):
        times, start = dict.fromkeys(PHASES, 0.0), time.perf_counter()
        for _ in range(accum):
            t0 = time.perf_counter()
            ids = torch.randint(0, vocab, (mbs, seq + 1), generator=gen)
            batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(mbs, seq),
                     "position_ids": torch.arange(seq).expand(mbs, seq)}
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            sync(); t1 = time.perf_counter()
            losses = engine(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            sync(); t2 = time.perf_counter()
            loss = (losses.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
            sync(); t3 = time.perf_counter()
            engine.backward(loss)
            sync(); t4 = time.perf_counter()
            engine.step()
            sync(); t5 = time.perf_counter()
            for name, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                times[name] += dt
        out.append({"step": time.perf_counter() - start, **times})
    return out


def bare_worker(spec: dict) -> None:
    from launcher.compose import compose_or_exit, to_object

    cfg = to_object(compose_or_exit(spec["overrides"]))
    ds_config = json.loads(Path(spec["ds_config"]).read_text())
    engine, vocab = build_bare_engine(cfg, ds_config)
    rows = bare_steps(engine, vocab, ds_config, cfg.model.seq_length, spec["steps"])
    import torch

    if torch.distributed.get_rank() == 0:
        steady = rows[spec["warmup"]:]
        Path(spec["result"]).write_text(json.dumps({
            "steps": len(steady), "median": statistics.median(r["step"] for r in steady),
            "mean": statistics.mean(r["step"] for r in steady),
            "phases": {p: statistics.mean(r[p] for r in steady) for p in PHASES}}))
    torch.distributed.barrier()


def table(result: dict) -> str:
    la, ba = result["launcher"], result["bare"]
    lines = [f"{'':18}{'launcher.train':>16}{'bare loop':>12}{'ratio':>8}"]
    for key, label in (("median", "step (median)"), ("mean", "step (mean)")):
        lines.append(f"{label:18}{la[key] * 1e3:13.1f} ms{ba[key] * 1e3:9.1f} ms"
                     f"{la[key] / ba[key]:8.3f}")
    for p in PHASES:
        name = "backward+grad_sync" if p == "backward" else p
        lines.append(f"  {name:16}{la['phases'][p] * 1e3:13.1f} ms{ba['phases'][p] * 1e3:9.1f} ms")
    lines.append(f"steady-state steps: launcher {la['steps']}, bare {ba['steps']}; ratio "
                 f"{result['ratio']:.3f} (target <= 1.02)")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--bare-worker":
        bare_worker(json.loads(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("overrides", nargs="*", help="config overrides for both sides")
    args = ap.parse_args()
    from launcher.compose import compose_or_exit, to_object

    overrides = [*FIXED, *args.overrides]
    cfg = to_object(compose_or_exit(overrides))
    with tempfile.TemporaryDirectory(prefix="step_overhead_") as tmp:
        run_dir = run_launcher(Path(tmp), overrides, args.steps)
        launcher = launcher_times(run_dir, args.warmup)
        bare = run_bare(Path(tmp), run_dir, overrides, args.steps, args.warmup,
                        cfg.cluster.gpus_per_node)
    result = {"overrides": overrides, "nprocs": cfg.cluster.gpus_per_node,
              "steps": args.steps, "warmup": args.warmup, "launcher": launcher, "bare": bare,
              "ratio": launcher["median"] / bare["median"]}
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
