"""``pool_tokens``: the average of the neighbours that exist, and an unknown pooling refused."""

from __future__ import annotations

import math

import pytest
import torch

from rankkit.errors import RankkitError
from rankkit.pooling import pool_tokens


def test_average_pooling_leaves_the_padding_and_unseen_keys_out():
    row = torch.tensor([1.0, 2.0, float("nan"), 6.0, 3.0])
    pooled = pool_tokens(row, "avg", 3).tolist()
    assert pooled[:2] == [1.5, 1.5] and pooled[2:] == [4.0, 4.5, 4.5]


def test_padded_average_pooling_counts_the_padding_and_unseen_keys_as_zeros():
    """avg_padded (SnapKV's pooling, count_include_pad): every window divides by the kernel; an unseen
    (NaN) key adds nothing to its neighbours and stays NaN itself."""
    row = torch.tensor([1.0, 2.0, float("nan"), 6.0, 3.0])
    pooled = pool_tokens(row, "avg_padded", 3).tolist()
    assert pooled[:2] == pytest.approx([1.0, 1.0]) and pooled[3:] == pytest.approx([3.0, 3.0])
    assert math.isnan(pooled[2])


@pytest.mark.parametrize(
    ("pooling", "kernel", "message"),
    [
        ("AVG", 1, "pooling must be one of avg, avg_padded, max, not 'AVG'"),
        ("mean", 3, "pooling must be one of avg, avg_padded, max, not 'mean'"),
        ("avg", 2, "kernel_size must be a positive odd integer"),
        ("max", 3.0, r"kernel_size must be a positive odd integer \(length-preserving pooling\), not 3.0"),
        ("max", "3", "kernel_size must be a positive odd integer .*, not '3'"),
    ],
)
def test_an_unknown_pooling_or_an_even_kernel_is_refused_even_where_nothing_pools(pooling, kernel, message):
    with pytest.raises(RankkitError, match=message):
        pool_tokens(torch.ones(4), pooling, kernel)


@pytest.mark.parametrize("pooling", ["avg", "avg_padded"])
@pytest.mark.parametrize("kernel", [3, 7])
def test_scores_known_to_hold_no_nan_pool_to_the_same_bits_in_one_operator(pooling, kernel):
    """A probe's fresh scores have no NaN: the one-operator average equals the NaN-aware one exactly,
    infinities (forced tokens) included, at the edges too."""
    scores = torch.rand(3, 2, 50, generator=torch.Generator().manual_seed(kernel)) * 10
    scores[0, 1, 7] = float("inf")
    assert torch.equal(pool_tokens(scores, pooling, kernel, scored=True), pool_tokens(scores, pooling, kernel))
    row = torch.tensor([1.0, 2.0, 4.0, 6.0, 3.0])
    expected = [1.5, 7 / 3, 4.0, 13 / 3, 4.5] if pooling == "avg" else [1.0, 7 / 3, 4.0, 13 / 3, 3.0]
    assert pool_tokens(row, pooling, 3, scored=True).tolist() == pytest.approx(expected)
