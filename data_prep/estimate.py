"""``dry_run=true``: what a run would read and write, before committing hours of a cluster to it.

The plan is made as for a run (inputs, array task, workers, tokenizer; the same config errors),
then a sample is tokenized in this process on one core: one block at each of up to
:data:`MAX_SAMPLE_POINTS` points spread evenly over the input's bytes, about
:data:`SAMPLE_BYTES` in all. From the sample come tokens and output bytes per input byte (the ``.idx``
included), scaled to the whole input, set against the free space of the output's filesystem;
and the sample's input bytes per CPU second, times the cores the run tokenizes on, for its time
(on the 2-core machine 2 workers reach 1.8x one core, so this is about 10% optimistic there).
Nothing is written: no output directory, no lock, no manifest.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator, List, Optional

import numpy as np

from data_prep import worker
from data_prep.blocks import Block, iter_blocks
from data_prep.output_space import INDEX_BYTES_PER_DOCUMENT
from data_prep.plan import RunPlan, make_plan
from data_prep.progress import in_unit_of
from launcher.core.diskspace import filesystem_usage

SAMPLE_BYTES = 64 * 2**20
"""About how many input bytes the sample reads: one block at each of up to MAX_SAMPLE_POINTS
points spread evenly over the input's bytes."""
MAX_SAMPLE_POINTS = 16


def sample_points(block_bytes: int) -> int:
    """Blocks the sample takes: as many as SAMPLE_BYTES holds, 1 to MAX_SAMPLE_POINTS."""
    return max(1, min(MAX_SAMPLE_POINTS, SAMPLE_BYTES // block_bytes))


@dataclass
class Estimate:
    plan: RunPlan
    sampled_blocks: int
    sampled_files: int
    """Input files the sampled blocks are in (or, for one-document files, are)."""
    sampled_bytes: int
    """Input bytes the sample read (compressed bytes for compressed files)."""
    sampled_tokens: int
    sampled_documents: int
    sample_cpu_s: float
    free_bytes: int
    """Free space of the output's filesystem (-1: unknown)."""

    @property
    def input_bytes(self) -> int:
        return sum(f.size for f in self.plan.files)

    def per_input_byte(self, count: float) -> float:
        return count / self.sampled_bytes if self.sampled_bytes else 0.0

    @property
    def tokens(self) -> int:
        return round(self.per_input_byte(self.sampled_tokens) * self.input_bytes)

    @property
    def output_bytes(self) -> int:
        written = (self.sampled_tokens * np.dtype(self.plan.dtype).itemsize
                   + self.sampled_documents * INDEX_BYTES_PER_DOCUMENT)
        return round(self.per_input_byte(written) * self.input_bytes)

    @property
    def one_core_bytes_per_s(self) -> float:
        return self.sampled_bytes / self.sample_cpu_s if self.sample_cpu_s > 0 else 0.0

    @property
    def cores(self) -> int:
        """Cores the run tokenizes on: one per worker; workers=1 uses all through the tokenizer."""
        return self.plan.workers if self.plan.workers > 1 else len(os.sched_getaffinity(0))

    @property
    def seconds(self) -> float:
        """The run's tokenizing time if each of its cores went at the sample's one-core rate."""
        rate = self.one_core_bytes_per_s * self.cores
        return self.input_bytes / rate if rate else 0.0


def _block_at(files, index: int, offset: int, cfg) -> Optional[Block]:
    """The block of ``files[index]`` that holds byte ``offset`` of it (for one-document text
    files: the group of files that starts there)."""
    text_unit = str(cfg.text_unit)
    chosen = None
    for block in iter_blocks(files[index:], cfg.text_key, text_unit, cfg.block_bytes):
        if block.file_index != 0:
            break
        chosen = block
        if not block.end or block.end > offset:  # parquet row groups and groups have no end
            break
    return chosen


def _sample_blocks(plan: RunPlan, cfg) -> Iterator[Block]:
    """One block at each of sample_points() points spread evenly over the input's bytes, in
    order, each block once (large files are sampled where they are large)."""
    sizes = [f.size for f in plan.files]
    points = sample_points(cfg.block_bytes)
    targets = [sum(sizes) * (i + 0.5) / points for i in range(points)]
    index, before, taken = 0, 0, set()
    for target in targets:
        while index < len(sizes) - 1 and before + sizes[index] <= target:
            before += sizes[index]
            index += 1
        block = _block_at(plan.files, index, int(target - before), cfg) if sizes else None
        if block is not None and (index + block.file_index, block.start) not in taken:
            taken.add((index + block.file_index, block.start))
            yield block


def estimate(cfg) -> Estimate:
    """Plan like a run, tokenize the sample, and measure it; writes nothing."""
    plan = make_plan(cfg)
    worker.init_worker(plan.info, plan.settings)
    blocks, files, sampled, tokens, documents = 0, set(), 0, 0, 0
    started = time.process_time()
    for block in _sample_blocks(plan, cfg):
        blocks += 1
        for number, part, last in worker.block_parts(block):
            result, texts = worker.parse_part(block, number, part, last)
            result = worker.tokenize_into(result, texts)
            sampled += result.input_bytes
            tokens += result.token_count
            documents += len(result.lengths)
        files.update([path for path, _ in block.files] or [block.path])
        if sampled >= 2 * SAMPLE_BYTES:  # blocks may outgrow block_bytes (a very long line)
            break
    usage = filesystem_usage(plan.out_dir)
    return Estimate(plan, blocks, len(files), sampled, tokens, documents, time.process_time() - started,
                    usage.free if usage is not None else -1)


def _count(files: List, attribute: str) -> str:
    kinds = {}
    for f in files:
        kind = getattr(f, attribute) or "uncompressed"
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{kind} {count:,}" for kind, count in sorted(kinds.items()))


def _size(count: float) -> str:
    return in_unit_of(count, count)


def estimate_rows(found: Estimate) -> List[tuple]:
    """(quantity, value) rows of the dry run's table."""
    plan = found.plan
    free = f"{_size(found.free_bytes)} free" if found.free_bytes >= 0 else "free space unknown"
    rows = [("inputs", f"{len(plan.files):,} file(s), {_size(found.input_bytes)} "
                       f"({_count(plan.files, 'format')}; {_count(plan.files, 'compression')})"),
            ("array task", f"{plan.task_index + 1} of {plan.num_tasks}"),
            ("workers", f"{plan.workers}"),
            ("tokenizer", f"{plan.info.kind} via {plan.info.backend}, shards of {np.dtype(plan.dtype).name}"),
            ("sample", f"{found.sampled_blocks} block(s) in {found.sampled_files:,} file(s), "
                       f"{_size(found.sampled_bytes)}: "
                       f"{found.sampled_tokens:,} tokens, {found.sampled_documents:,} documents")]
    if not found.sampled_bytes:
        return rows + [("estimate", "none: the sample held no input bytes")]
    return rows + [
        ("tokens (estimate)", f"{found.tokens:,} ({found.per_input_byte(found.sampled_tokens):.3f} "
                              "per input byte)"),
        ("output (estimate)", f"{_size(found.output_bytes)} under {plan.out_dir} ({free})"),
        ("one core", f"{found.one_core_bytes_per_s / 1e6:,.1f} MB/s of this input"),
        ("time (estimate)", f"{found.seconds:,.1f} s of tokenizing, if each of the run's "
                            f"{found.cores} cores goes at that rate")]


def warnings(found: Estimate) -> List[str]:
    """What the user should know before starting: an output that will not fit."""
    if 0 <= found.free_bytes < found.output_bytes:
        return [f"the output needs about {_size(found.output_bytes)} but {found.plan.out_dir} has "
                f"{_size(found.free_bytes)} free"]
    return []


def print_estimate(found: Estimate, stream=None) -> None:
    """The dry run's table on stdout (``stream``), its warnings on stderr."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"data_prep dry run: {found.plan.name} (nothing was written)")
    table.add_column("quantity")
    table.add_column("value")
    for row in estimate_rows(found):
        table.add_row(*row)
    Console(file=stream or sys.stdout, width=120).print(table)
    for warning in warnings(found):
        print(f"data_prep: warning: {warning}", file=sys.stderr)
