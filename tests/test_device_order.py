"""The selection rule's device path orders as its CPU path does.

On a CPU, ``descending_order`` and ``descending_ranks`` sort with rankkit's compiled sort; on any
other device (a GPU) with torch's stable sort. These tests take the device path on the CPU (the
CPU path switched off) and check it against the compiled one and against a plain sort written
here: descending score, ties to the earlier token, NaN first, every dtype a probe may give.
"""

from __future__ import annotations

import math

import pytest
import torch

from rankkit.methods import selection


def slow_order(row: list[float]) -> list[int]:
    """Tokens from the highest score down, NaN above everything, ties to the earlier token."""

    def key(token: int):
        value = row[token]
        return (0, 0.0, token) if math.isnan(value) else (1, -value, token)

    return sorted(range(len(row)), key=key)


def slow_places(row: list[float]) -> list[int]:
    places = [0] * len(row)
    for place, token in enumerate(slow_order(row)):
        places[token] = place
    return places


@pytest.fixture
def device_path(monkeypatch):
    """The order as a GPU computes it: ``_on_cpu`` says no, so torch sorts."""
    monkeypatch.setattr(selection, "_on_cpu", lambda scores: None)


SCORES = torch.tensor(
    [
        [0.5, 2.0, -1.0, 2.0, float("nan"), 0.0, -0.0, float("inf"), 2.0, float("-inf"), 0.5],
        [3.0, 1.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0],
        [1.0] * 11,
    ]
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_device_order_is_descending_with_ties_to_the_earlier_token(device_path, dtype):
    scores = SCORES.to(dtype)
    expected = [slow_order(row) for row in scores.double().tolist()]
    assert selection.descending_order(scores).tolist() == expected
    assert [selection.descending_order(row).tolist() for row in scores] == expected  # one row [T]
    places = [slow_places(row) for row in scores.double().tolist()]
    assert selection.descending_ranks(scores).tolist() == places
    assert selection.descending_ranks(scores[1]).tolist() == places[1]


def test_the_device_order_keeps_tied_tokens_in_token_order_in_long_rows(device_path):
    """torch's unstable sort reorders ties from a few dozen tokens on; the device path must not."""
    scores = torch.randint(0, 3, (2, 200), generator=torch.Generator().manual_seed(1)).float()
    assert selection.descending_order(scores).tolist() == [slow_order(row) for row in scores.tolist()]
    assert selection.descending_ranks(scores).tolist() == [slow_places(row) for row in scores.tolist()]


def test_the_device_order_of_integer_scores_is_their_order(device_path):
    row = [3.0, 1, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    scores = torch.tensor([row], dtype=torch.int64)
    assert selection.descending_order(scores).tolist() == [slow_order(row)]
    assert selection.descending_ranks(scores).tolist() == [slow_places(row)]


def test_the_device_path_keeps_what_the_cpu_path_keeps():
    """``top_k_with_forced`` and ``top_k_seen`` (a local layer's unseen keys) through both paths."""
    generator = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 6, (2, 120), generator=generator).float()  # many ties
    forced = selection.forced_mask(120, window=4, sinks=2)
    unseen = torch.zeros(2, 120, dtype=torch.bool)
    unseen[:, :50] = True
    on_cpu = (
        selection.top_k_with_forced(scores, 9, forced),
        selection.top_k_seen(scores, 9, forced, unseen),
        selection.descending_ranks(scores),
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(selection, "_on_cpu", lambda scores: None)
        on_device = (
            selection.top_k_with_forced(scores, 9, forced),
            selection.top_k_seen(scores, 9, forced, unseen),
            selection.descending_ranks(scores),
        )
    assert on_device[0].tolist() == on_cpu[0].tolist()
    assert [head.tolist() for head in on_device[1]] == [head.tolist() for head in on_cpu[1]]
    assert on_device[2].tolist() == on_cpu[2].tolist()


def test_on_a_cpu_the_compiled_sort_orders(monkeypatch):
    """The CPU path is rankkit.sorting's (7x faster than torch's stable sort there): every order and
    place of a non-empty CPU tensor comes from it, in float64 for float64 scores."""
    seen = []

    def spy(compiled):
        def sort(values, *, nan_first):
            seen.append((compiled.__name__, values.dtype, nan_first))
            return compiled(values, nan_first=nan_first)

        return sort

    monkeypatch.setattr(selection, "descending_orders", spy(selection.descending_orders))
    monkeypatch.setattr(selection, "descending_places", spy(selection.descending_places))
    selection.descending_order(SCORES.double())
    selection.descending_ranks(SCORES.half())
    assert [(name, str(dtype), nan_first) for name, dtype, nan_first in seen] == [
        ("descending_orders", "float64", True),
        ("descending_places", "float32", True),
    ]


def test_float64_scores_are_ranked_at_their_own_precision():
    """Two scores equal in float32 but not in float64 are not tied."""
    scores = torch.tensor([1.0, 1.0 + 1e-12, 1.0 - 1e-12], dtype=torch.float64)
    assert selection.descending_order(scores).tolist() == [1, 0, 2]
    assert selection.descending_ranks(scores).tolist() == [1, 0, 2]


def test_no_scores_give_an_empty_order():
    empty = torch.empty(2, 0)
    assert selection.descending_order(empty).tolist() == [[], []]
    assert selection.descending_ranks(empty).tolist() == [[], []]
