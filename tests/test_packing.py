"""Best-fit-decreasing packing (data_prep.packing): every sample placed once, no row over its
capacity, the rows best-fit decreasing makes, and at least 98% of a realistic length mix."""

from __future__ import annotations

import random

import pytest

from data_prep.packing import best_fit_decreasing


def test_every_sample_once_and_no_row_over_capacity():
    rng = random.Random(1)
    lengths = [rng.randint(1, 300) for _ in range(3000)]
    packing = best_fit_decreasing(lengths, 512)
    assert sorted(i for row in packing.rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 512 for row in packing.rows)
    assert packing.tokens == sum(lengths)


def test_the_rows_worked_by_hand():
    # longest first: 6 opens a row (room 4), 5 another (room 5), the second 5 fills that one
    # exactly, the 4 fills the first: two full rows
    packing = best_fit_decreasing([6, 5, 4, 5], 10)
    assert [sorted(row) for row in packing.rows] == [[0, 2], [1, 3]]
    assert packing.efficiency == 1.0


def test_a_realistic_length_mix_packs_above_98_percent():
    rng = random.Random(0)  # chat lengths: log-normal, median ~250 tokens, a long tail
    lengths = [max(8, min(4097, int(rng.lognormvariate(5.5, 0.9)))) for _ in range(20000)]
    packing = best_fit_decreasing(lengths, 4097)
    assert packing.efficiency >= 0.98
    lower_bound = -(-sum(lengths) // 4097)
    assert len(packing.rows) <= lower_bound * 1.01 + 1


def test_a_sample_longer_than_a_row_is_refused():
    with pytest.raises(ValueError, match="1 to 10 tokens"):
        best_fit_decreasing([11], 10)
