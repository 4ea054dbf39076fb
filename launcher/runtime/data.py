"""Training data: Megatron-Core GPT datasets, a resumable data-parallel sampler, DataLoaders.

:func:`build_datasets` turns a :class:`~launcher.config.DataConfig` into the train / validation /
test ``GPTDataset`` splits through megatron-core's ``BlendedMegatronDatasetBuilder`` (a blend of
indexed-dataset prefixes, or ``MockGPTDataset`` when ``prefixes`` is empty). The datasets shuffle
documents and samples from ``seed`` and cache their indices under ``cache_dir``. ``s3://``
prefixes are read from their copies in the node's shard cache (:func:`local_data`).

:class:`DataParallelSampler` walks the dataset in order, starting at ``consumed_samples``: global
micro-batch ``k`` is samples ``[k*m*dp, (k+1)*m*dp)`` and data-parallel rank ``r`` takes the
``r``-th run of ``m`` of them. The order is a pure function of (dataset seed, consumed samples), so
ranks never see the same sample and a resumed run continues exactly where the saved one stopped.

Building the datasets is collective (rank 0 writes the index caches, then all ranks read them):
call it on every rank of an initialised process group.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import torch

from launcher.config import DataConfig, DataFormat
from launcher.core.errors import TrainingAborted
from launcher.core.exits import CONFIG_ERROR_EXIT
from launcher.core.objectstore import is_remote
from launcher.core.stop import ignore_stop_signals


@dataclass
class DatasetTokenizer:
    """The three things GPTDataset asks of a tokenizer (no encoding happens at training time)."""

    vocab_size: int
    eod: int
    unique_identifiers: dict = field(default_factory=dict)

    def __post_init__(self):
        # Enters the dataset cache hash: a different vocabulary or eod gives different caches.
        self.unique_identifiers = {"class": "DatasetTokenizer", "vocab_size": self.vocab_size,
                                   "eod": self.eod, **self.unique_identifiers}


@dataclass(frozen=True)
class SplitSizes:
    """Samples (sequences) to draw per split."""

    train: int
    valid: int
    test: int


def _blend(data: DataConfig):
    """Megatron's ``(prefixes, weights)`` pair, or None for mock data."""
    if not data.prefixes:
        return None
    if data.weights and len(data.weights) != len(data.prefixes):
        raise ValueError(f"data.weights has {len(data.weights)} entries but data.prefixes has "
                         f"{len(data.prefixes)}; give one weight per prefix or none")
    for prefix in data.prefixes:
        missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.exists(p)]
        if missing:
            raise FileNotFoundError(f"data prefix {prefix!r}: missing {', '.join(missing)} "
                                    "(run data_prep, or fix data.prefixes)")
    return list(data.prefixes), list(data.weights) or None


def dataset_config(data: DataConfig, *, seq_length: int, vocab_size: int, seed: int,
                   cache_dir: str):
    """The ``GPTDatasetConfig`` of ``data`` (mock when ``data.prefixes`` is empty)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    blend = _blend(data)
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=data.split if blend else None,
        path_to_cache=cache_dir,
        tokenizer=DatasetTokenizer(vocab_size=vocab_size, eod=data.eod_token_id),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # the model builds the causal mask itself
    )


def build_datasets(data: DataConfig, *, seq_length: int, vocab_size: int, seed: int,
                   sizes: SplitSizes, cache_dir: str) -> List[Optional[torch.utils.data.Dataset]]:
    """``[train, valid, test]`` datasets (None for a split with no share). Collective call."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    config = dataset_config(data, seq_length=seq_length, vocab_size=vocab_size, seed=seed,
                            cache_dir=cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    cls = MockGPTDataset if config.mock else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        cls, [sizes.train, sizes.valid, sizes.test], lambda: True, config)
    return builder.build()


class DataParallelSampler:
    """Index lists of this rank's micro-batches, from ``consumed_samples`` to ``total_samples``.

    ``consumed_samples`` counts samples taken by all data-parallel ranks together (the global
    batch size per optimizer step). Iterating yields lists of ``micro_batch_size`` indices.
    """

    def __init__(self, *, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside data-parallel size {dp_size}")
        stride = micro_batch_size * dp_size
        if consumed_samples % stride:
            raise ValueError(f"consumed_samples {consumed_samples} is not a multiple of "
                             f"micro_batch_size x dp_size = {stride}")
        self.total, self.consumed, self.micro = total_samples, consumed_samples, micro_batch_size
        self.rank, self.stride = dp_rank, stride

    def __len__(self) -> int:
        return max(0, (self.total - self.consumed) // self.stride)

    def __iter__(self) -> Iterator[List[int]]:
        for k in range(len(self)):
            start = self.consumed + k * self.stride + self.rank * self.micro
            yield list(range(start, start + self.micro))


def make_loader(dataset, *, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                dp_size: int, num_workers: int, total_samples: Optional[int] = None,
                stop_signal: str = "SIGUSR1"):
    """A DataLoader over this rank's micro-batches (worker processes + prefetch; pinned on GPU).

    Worker processes ignore the stop signals (:func:`launcher.core.stop.ignore_stop_signals`):
    a signal sent to the whole process group must stop the run through its ranks, which save
    first, not kill a worker mid-batch."""
    sampler = DataParallelSampler(
        total_samples=len(dataset) if total_samples is None else total_samples,
        consumed_samples=consumed_samples, micro_batch_size=micro_batch_size,
        dp_rank=dp_rank, dp_size=dp_size)
    extra = dict(prefetch_factor=2, persistent_workers=False,
                 worker_init_fn=functools.partial(ignore_stop_signals, stop_signal),
                 multiprocessing_context=worker_start_method()) if num_workers > 0 else {}
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers,
        pin_memory=torch.cuda.is_available(), **extra)


def worker_start_method() -> Optional[str]:
    """How DataLoader workers start: ``fork`` where the platform has it (None: the default).
    A rank started by torch elastic inherits its ``spawn`` start method, and a spawned worker
    imports torch, Megatron-Core and the launcher again before its first batch: 5-20 s of every
    start-up on two CPU cores, on the critical path. A forked worker only reads the dataset and
    touches no CUDA (pinning happens in the rank's own thread), PyTorch's default on Linux."""
    import multiprocessing

    return "fork" if "fork" in multiprocessing.get_all_start_methods() else None


def split_sizes(*, train_samples: int, eval_samples: int) -> SplitSizes:
    """Samples per split: the training budget, and one validation pass for valid and test."""
    return SplitSizes(train=train_samples, valid=max(1, eval_samples), test=max(1, eval_samples))


def to_device(batch: dict, device: torch.device) -> dict:
    """Move a collated micro-batch (dict of tensors) to ``device``."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()
            if isinstance(v, torch.Tensor)}


_LOCAL: dict = {}
"""``s3://`` prefix -> the local copy this process reads (what :func:`data_failure` checks)."""


def local_data(data: DataConfig) -> DataConfig:
    """``data`` with each ``s3://`` prefix replaced by its copy in the node's shard cache: found
    there (the launcher copied it before the ranks started), else downloaded now (one process of
    the node at a time; launcher.core.shard_cache). TrainingAborted (exit 2) naming what cannot
    be had."""
    if not any(is_remote(p) for p in data.prefixes):
        return data
    from launcher.core.remote_data import DataUnavailable
    from launcher.plan.data_check import shard_cache

    cache = shard_cache(data)
    try:
        local = cache.cached(data.prefixes) or cache.localize(data.prefixes, progress=False)
    except DataUnavailable as exc:
        raise TrainingAborted(f"data.prefixes: {exc}", exit_code=CONFIG_ERROR_EXIT) from None
    _LOCAL.update(zip(data.prefixes, local))
    return dataclasses.replace(data, prefixes=local)


def data_failure(prefixes, exc: BaseException) -> TrainingAborted:
    """``exc``, raised while training, as the end of the run (exit 3, one line naming the
    file) when a data shard went bad under it (truncated, replaced, removed: a DataLoader
    worker dies of SIGBUS or fails to slice the file); ``exc`` itself when every shard is
    still whole."""
    from launcher.plan.data_check import shard_problems

    problems = shard_problems([_LOCAL.get(p, p) for p in prefixes])
    if not problems:
        raise exc
    return TrainingAborted("a data shard went bad during the run: " + "; ".join(problems)
                           + f" (the rank failed with {type(exc).__name__})")


def build_data(cfg, plan, run_dir, consumed_samples: int):
    """(next_batch, eval_batches) for this rank (collective: datasets are built on all ranks)."""
    from megatron.core import parallel_state

    t, dp_size, data = cfg.trainer, plan.dims.dp, local_data(cfg.data)
    dp_rank = parallel_state.get_data_parallel_rank()
    eval_samples = t.eval_iters * t.micro_batch_size * dp_size
    train_samples = plan.batch.train_steps * plan.batch.global_batch_size
    if data.format == DataFormat.chat:  # packed conversations with their loss mask
        from launcher.runtime.chat_data import build_chat_datasets

        train, valid, _ = build_chat_datasets(data, seq_length=cfg.model.seq_length,
                                              seed=t.seed, train_samples=train_samples,
                                              eval_samples=eval_samples)
    else:
        train, valid, _ = build_datasets(
            data, seq_length=cfg.model.seq_length, vocab_size=cfg.model.vocab_size,
            seed=t.seed, cache_dir=cfg.data.cache_dir or str(run_dir / "cache"),
            sizes=split_sizes(train_samples=train_samples, eval_samples=eval_samples))
    common = dict(micro_batch_size=t.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                  stop_signal=t.stop_signal)
    iterator = iter(make_loader(train, consumed_samples=consumed_samples,
                                num_workers=cfg.data.num_workers,
                                total_samples=plan.batch.train_steps * plan.batch.global_batch_size,
                                **common))

    def eval_batches():
        loader = make_loader(valid, consumed_samples=0, num_workers=0,
                             total_samples=eval_samples, **common)
        return itertools.islice(loader, t.eval_iters)
    return (lambda: next(iterator)), (eval_batches if valid is not None and t.eval_interval
                                      else None)
