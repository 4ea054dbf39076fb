"""Checkpoint save and load speed against this machine's own disk, side by side in one run.

    python bench/checkpoint_speed.py [--model gpt2_124m] [--engine megatron] [--ranks 2]
                                     [--workdir /tmp/tw_ckpt] [override ...]

1. ``launcher.train`` trains one step and saves (its full state: weights, optimizer, RNG); the
   run's own ``checkpoint`` events give the bytes and seconds of the save;
2. the same command with ``trainer.train_steps=2`` resumes: the load event, then a second save;
3. the disk: ``--ranks`` processes each write their share of the same number of bytes to their
   own file in 64 MB blocks and fsync it, as a checkpoint's writers do; the wall time of all of
   them is the machine's sequential write rate under the same discipline.

Prints save and load GB/s and their share of the disk's rate (issue targets: save >= 30% of
the disk on the 2-core CPU machine, >= 70% on a GPU node; load no slower than save).
``--convert`` also times ``python -m launcher.convert reshard`` of the last checkpoint (the
one-off step that lets the default per-rank optimizer format resume at another layout), as a
whole process.
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
BLOCK = 64 << 20


def train(workdir: Path, args, steps: int) -> list:
    """The checkpoint events of one launcher.train run of ``steps`` steps."""
    cmd = [sys.executable, "-m", "launcher.train", f"model={args.model}",
           f"engine={args.engine}", f"cluster.gpus_per_node={args.ranks}",
           f"trainer.train_steps={steps}", "trainer.micro_batch_size=1",
           f"trainer.global_batch_size={args.ranks}", "trainer.eval_interval=0",
           "model.seq_length=256", "logger=none", f"run.output_root={workdir}",
           "run.name=bench", *args.overrides]
    env = {**os.environ, "WANDB_MODE": "disabled",  # keeps PYTHONPATH's packages (device runs)
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"launcher.train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = (workdir / "bench" / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == "checkpoint" and "bytes" in e]


def convert_seconds(workdir: Path) -> float:
    """Wall seconds of ``launcher.convert reshard`` of the bench run's latest checkpoint."""
    env = {**os.environ, "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "launcher.convert", "reshard",
                           f"checkpoint={workdir / 'bench'}", f"out={workdir / 'converted'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"launcher.convert reshard failed ({proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def _write_share(path: str, nbytes: int) -> None:
    block = os.urandom(BLOCK)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[:min(left, BLOCK)])
        f.flush()
        os.fsync(f.fileno())


def disk_rate(workdir: Path, nbytes: int, ranks: int) -> float:
    """GB/s of ``ranks`` processes writing ``nbytes`` together, each file fsynced."""
    import multiprocessing

    paths = [str(workdir / f"disk_{r}.bin") for r in range(ranks)]
    procs = [multiprocessing.Process(target=_write_share, args=(p, nbytes // ranks))
             for p in paths]
    start = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    seconds = time.perf_counter() - start
    for p in paths:
        os.unlink(p)
    return nbytes / 1e9 / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2_124m")
    parser.add_argument("--engine", default="megatron")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/tw_ckpt")
    parser.add_argument("--convert", action="store_true",
                        help="also time launcher.convert reshard of the last checkpoint")
    parser.add_argument("overrides", nargs="*", help="more launcher.train overrides")
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    first = train(work, args, 1)
    second = train(work, args, 2)[len(first):]  # events.jsonl goes on in the same run dir
    saves = [e for e in first + second if " saved" in e["message"]]
    loads = [e for e in second if " loaded" in e["message"]]
    disk = disk_rate(work, saves[0]["bytes"], args.ranks)
    row = {"model": args.model, "engine": args.engine, "ranks": args.ranks,
           "overrides": args.overrides, "bytes": saves[0]["bytes"], "disk_gb_per_s": disk,
           "save_s": [e["seconds"] for e in saves], "load_s": [e["seconds"] for e in loads]}
    gb = saves[0]["bytes"] / 1e9
    print(f"{args.model}, engine={args.engine}, {args.ranks} ranks, {' '.join(args.overrides)}: "
          f"state {gb:.2f} GB; disk (fsync, {args.ranks} writers) {disk:.2f} GB/s")
    for kind, events in (("save", saves), ("load", loads)):
        for e in events:
            rate = e["bytes"] / 1e9 / e["seconds"]
            print(f"  {kind} step {e['step']}: {e['seconds']:.1f} s, {rate:.2f} GB/s = "
                  f"{rate / disk:.0%} of the disk")
    if args.convert:
        row["convert_s"] = convert_seconds(work)
        print(f"  launcher.convert reshard (whole process): {row['convert_s']:.1f} s")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
