"""Data pipeline: real indexed shards (megatron-core IndexedDatasetBuilder) and MockGPTDataset
through BlendedMegatronDatasetBuilder; the sampler splits ranks disjointly and resumes exactly."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from launcher.config import DataConfig
from launcher.runtime.data import DataParallelSampler, build_datasets, make_loader, split_sizes
from tests.helpers.dist import gloo_group

SEQ = 16


def write_shard(prefix: str, first_token: int, docs: int = 200, vocab: int = 512) -> None:
    """Documents of tokens all >= first_token (so a sample's source is recognisable), eod 0."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(first_token)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(docs):
        length = int(rng.integers(5, 40))
        doc = rng.integers(first_token, first_token + vocab // 2 - 1, size=length)
        builder.add_item(torch.from_numpy(np.append(doc, 0).astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def group():
    with gloo_group():
        yield


def build(data: DataConfig, cache, train=400, seed=5):
    return build_datasets(data, seq_length=SEQ, vocab_size=512, seed=seed,
                          sizes=split_sizes(train_samples=train, eval_samples=8),
                          cache_dir=str(cache))


def test_blend_of_real_shards(group, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_shard(a, 1)
    write_shard(b, 256)
    data = DataConfig(name="ab", prefixes=[a, b], weights=[0.7, 0.3], split="90,5,5")
    train, valid, test = build(data, tmp_path / "cache")
    assert len(train) >= 400 and valid is not None and test is not None
    sample = train[0]
    assert set(sample) >= {"tokens", "labels", "loss_mask", "position_ids"}
    assert sample["tokens"].shape == (SEQ,)
    assert (sample["tokens"][1:] == sample["labels"][:-1]).all()  # labels are next tokens
    from_b = [bool((train[i]["tokens"] >= 256).any()) for i in range(400)]
    assert 0.2 < sum(from_b) / 400 < 0.4  # about 30% of samples come from the 0.3 prefix
    again = build(data, tmp_path / "cache")[0]  # from the index cache: same order
    assert all((again[i]["tokens"] == train[i]["tokens"]).all() for i in range(0, 400, 37))
    other_seed = build(data, tmp_path / "cache2", seed=6)[0]
    assert any((other_seed[i]["tokens"] != train[i]["tokens"]).any() for i in range(10))


def test_missing_prefix_names_the_file(group, tmp_path):
    data = DataConfig(name="x", prefixes=[str(tmp_path / "nope")])
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        build(data, tmp_path / "cache")


def test_mock_dataset_loader_and_resume(group, tmp_path):
    train = build(DataConfig(name="mock"), tmp_path / "cache", train=64)[0]
    assert len(train) >= 64
    kw = dict(micro_batch_size=2, dp_size=2, num_workers=2, total_samples=64)
    ranks = [list(make_loader(train, consumed_samples=0, dp_rank=r, **kw)) for r in range(2)]
    assert len(ranks[0]) == 16 and ranks[0][0]["tokens"].shape == (2, SEQ)
    # Rank 0 then rank 1 of every global micro-batch reproduces the dataset order.
    joined = [t for b0, b1 in zip(*ranks) for t in (*b0["tokens"], *b1["tokens"])]
    assert all((joined[i] == train[i]["tokens"]).all() for i in range(64))
    resumed = list(make_loader(train, consumed_samples=24, dp_rank=1, **kw))
    assert len(resumed) == 10
    assert all((x["tokens"] == y["tokens"]).all() for x, y in zip(resumed, ranks[1][6:]))


def test_sampler_disjoint_and_exact_resume():
    kw = dict(total_samples=96, micro_batch_size=3, dp_size=4)
    full = [list(DataParallelSampler(consumed_samples=0, dp_rank=r, **kw)) for r in range(4)]
    flat = [i for r in full for batch in r for i in batch]
    assert sorted(flat) == list(range(96))  # every sample once, across all ranks
    for r in range(4):
        resumed = list(DataParallelSampler(consumed_samples=36, dp_rank=r, **kw))
        assert resumed == full[r][3:]
    assert list(itertools.chain(*full[2][0:1])) == [6, 7, 8]
    with pytest.raises(ValueError, match="multiple"):
        DataParallelSampler(consumed_samples=5, dp_rank=0, **kw)
