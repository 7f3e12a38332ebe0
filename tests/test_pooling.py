"""``pool_tokens``: the average of the neighbours that exist, and an unknown pooling refused."""

from __future__ import annotations

import pytest
import torch

from rankkit.errors import RankkitError
from rankkit.pooling import pool_tokens


def test_average_pooling_leaves_the_padding_and_unseen_keys_out():
    row = torch.tensor([1.0, 2.0, float("nan"), 6.0, 3.0])
    pooled = pool_tokens(row, "avg", 3).tolist()
    assert pooled[:2] == [1.5, 1.5] and pooled[2:] == [4.0, 4.5, 4.5]


@pytest.mark.parametrize(
    ("pooling", "kernel", "message"),
    [
        ("AVG", 1, "pooling must be one of avg, avg_padded, max, not 'AVG'"),
        ("mean", 3, "pooling must be one of avg, avg_padded, max, not 'mean'"),
        ("avg", 2, "kernel_size must be a positive odd number"),
    ],
)
def test_an_unknown_pooling_or_an_even_kernel_is_refused_even_where_nothing_pools(pooling, kernel, message):
    with pytest.raises(RankkitError, match=message):
        pool_tokens(torch.ones(4), pooling, kernel)
