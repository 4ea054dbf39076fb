"""Live progress bar (documents/s, tokens/s, MB/s, ETA) and the final summary table."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from data_prep.records import BAD_REASONS, NEUTRAL_REASONS, REPAIRS
from data_prep.stats import Stats


class RatesColumn(ProgressColumn):
    """documents/s, tokens/s and input MB/s since the start of this run."""

    def __init__(self, owner: "RunProgress") -> None:
        super().__init__()
        self.owner = owner

    def render(self, task) -> Text:
        elapsed = max(1e-9, time.perf_counter() - self.owner.started)
        done = self.owner.done
        return Text(f"{done.documents / elapsed:,.0f} docs/s {done.tokens / elapsed / 1e6:,.2f}M tok/s "
                    f"{done.input_bytes / elapsed / 1e6:,.1f}MB/s", style="cyan")


def in_unit_of(count: float, total: float) -> str:
    """``45.6 GB``: ``count`` in the unit that suits ``total`` (MB below a gigabyte)."""
    unit, scale = ("GB", 1e9) if total >= 1e9 else ("MB", 1e6)
    return f"{count / scale:,.1f} {unit}"


def _size(count: float, total: float) -> str:
    """``45.6 of 370.0 GB``."""
    return f"{in_unit_of(count, total).split()[0]} of {in_unit_of(total, total)}"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class RunProgress:
    """Progress over input bytes on stderr: a live rich bar on a terminal; elsewhere (a Slurm
    log, a pipe) a plain line every ``every_s`` seconds (none with 0). Silent when disabled."""

    def __init__(self, total_bytes: int, already_done_bytes: int, enabled: bool,
                 every_s: float = 30.0) -> None:
        self.done = Stats()
        self.started = time.perf_counter()
        self.enabled = enabled
        self.total = max(1, total_bytes)
        self.initial = min(already_done_bytes, self.total)
        self.progress = None
        self.every_s = every_s
        self.next_line = None  # when the next plain line is due (plain lines only)

    def __enter__(self) -> "RunProgress":
        console = Console(stderr=True)
        if self.enabled and console.is_terminal:
            self.progress = Progress(TextColumn("[bold]data_prep"), BarColumn(bar_width=24),
                                     TextColumn("{task.percentage:>5.1f}%"),
                                     RatesColumn(self), TimeRemainingColumn(),
                                     console=console, transient=False)
            self.progress.__enter__()
            self.task = self.progress.add_task("tokenize", total=self.total, completed=self.initial)
        elif self.enabled and self.every_s > 0:
            kept = (f" ({in_unit_of(self.initial, self.total)} already in kept shards)"
                    if self.initial else "")
            self.warn(f"data_prep: tokenizing {in_unit_of(self.total - self.initial, self.total)} "
                      f"of input{kept}; a progress line every {self.every_s:g} s")
            self.next_line = self.started + self.every_s
        return self

    def advance(self, stats: Stats) -> None:
        self.done.merge(stats, 0)
        if self.progress is not None:
            self.progress.update(self.task, advance=stats.input_bytes)
        elif self.next_line is not None and time.perf_counter() >= self.next_line:
            self.next_line = time.perf_counter() + self.every_s
            self.warn(self.line())

    def line(self) -> str:
        """``data_prep: 12.3% (45.6 of 370.0 GB), 1,234,567 docs, 210.5M tok/s, 480.2 MB/s,
        0:42:10 left``: rates over this run so far; time left at the rate of this run."""
        elapsed = max(1e-9, time.perf_counter() - self.started)
        done = self.initial + self.done.input_bytes
        rate = self.done.input_bytes / elapsed
        left = _clock((self.total - done) / rate) if rate else "?"
        return (f"data_prep: {done / self.total:.1%} ({_size(done, self.total)}), "
                f"{self.done.documents:,} docs, {self.done.tokens / elapsed / 1e6:,.1f}M tok/s, "
                f"{rate / 1e6:,.1f} MB/s, {left} left")

    def warn(self, text: str) -> None:
        """Print ``text`` on stderr above the live bar (or plainly when there is none)."""
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)


def summary_table(manifest: dict) -> Table:
    totals = manifest["totals"]
    wall = max(1e-9, manifest.get("wall_time_s", 0.0))
    table = Table(title=f"data_prep: {manifest['name']} (task {manifest['task']['index'] + 1}"
                        f"/{manifest['task']['count']})", show_header=True)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [("documents", f"{totals['documents']:,}"), ("tokens", f"{totals['tokens']:,}"),
            ("shards", f"{totals['shards']}"), ("dtype", manifest["dtype"]),
            ("tokenizer", f"{manifest['tokenizer']['kind']} via {manifest['tokenizer']['backend']}"),
            ("input MB", f"{totals['input_bytes'] / 1e6:,.1f}"), ("wall time s", f"{wall:,.2f}"),
            ("tokens/s", f"{totals['tokens'] / wall:,.0f}"), ("MB/s", f"{totals['input_bytes'] / wall / 1e6:,.1f}")]
    memory = manifest.get("memory") or {}
    if memory.get("peak_rss_bytes"):
        rows.append(("peak RSS MB, all processes", f"{memory['peak_rss_bytes'] / 2**20:,.0f} "
                     f"(bound {memory['rss_bound_bytes'] / 2**20:,.0f})"))
    rows += timing_rows(manifest.get("timing") or {})
    for reason in BAD_REASONS + NEUTRAL_REASONS:
        if totals["skipped"].get(reason):
            rows.append((f"skipped: {reason}", f"{totals['skipped'][reason]:,}"))
    for reason in REPAIRS:
        if totals["repaired"].get(reason):
            rows.append((f"repaired: {reason}", f"{totals['repaired'][reason]:,}"))
    for name, value in rows:
        table.add_row(name, value)
    return table


def timing_rows(timing: dict) -> list:
    """Where the time went (data_prep.run_timing): phases, then CPU seconds by kind of process."""
    if "tokenize_s" not in timing:
        return []
    hashing = (f"{timing['hash_cpu_s']:.2f} in {timing['hash_processes']} process(es)"
               if timing.get("hash_processes") else "off")
    return [("seconds: plan, tokenize, wait for hashes",
             f"{timing.get('plan_s', 0):.2f}, {timing['tokenize_s']:.2f}, {timing.get('hash_wait_s', 0):.2f}"),
            ("CPU s: main process while tokenizing", f"{timing.get('main_tokenize_cpu_s', 0):.2f}"),
            ("CPU s: workers, hashing", f"{timing.get('worker_cpu_s', 0):.2f}, {hashing}")]


def print_summary(manifest: dict, stream=None) -> None:
    console = Console(file=stream or sys.stdout, width=120)
    console.print(summary_table(manifest))
    for reason, examples in manifest["totals"].get("examples", {}).items():
        console.print(f"[yellow]{reason}[/yellow] first examples:", highlight=False)
        for example in examples:
            console.print(f"  {example}", highlight=False, markup=False)


def small_shard_warnings(manifest: dict, split: str) -> list:
    """Megatron splits every prefix on its own; a shard too small to give each non-zero split at
    least one document makes that split empty (GPTDataset cannot sample from it)."""
    try:
        parts = [float(x) for x in str(split).split(",")]
    except ValueError:
        return [f"split={split!r} is not a comma-separated list of numbers"]
    shares = [p / sum(parts) for p in parts if p > 0] if sum(parts) > 0 else []
    smallest = min(shares) if shares else 0.0
    tiny = [s["prefix"] for s in manifest["shards"] if smallest and s["documents"] * smallest < 1]
    if not tiny:
        return []
    return [f"{len(tiny)} shard(s) (e.g. {tiny[0]}) hold too few documents for split={split}: "
            "some splits of those shards are empty; use larger shards (shard_bytes/shard_tokens) "
            "or a split without tiny shares"]
