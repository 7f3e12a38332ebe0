"""The flip-top-k mutant, as a pytest plugin: every ranking in rankkit keeps the lowest scores first.

``pytest -p flip_top_k tests/test_methods.py`` (with ``tests/mutants`` on ``PYTHONPATH``) must
fail; ``make mutants`` runs it and reports how many tests catch it. It replaces the one sort every
selection and metric goes through on a CPU (``rankkit.sorting``) before any rankkit module binds it.
"""

from __future__ import annotations

import numpy as np

from rankkit import sorting

_descending_orders = sorting.descending_orders


def _lowest_first(values: np.ndarray, *, nan_first: bool) -> np.ndarray:
    return np.ascontiguousarray(np.flip(_descending_orders(values, nan_first=nan_first), axis=-1))


def _places(values: np.ndarray, *, nan_first: bool) -> np.ndarray:
    order = _lowest_first(values, nan_first=nan_first)
    places = np.empty_like(order)
    np.put_along_axis(places, order, np.arange(order.shape[-1]), axis=-1)
    return places


sorting.descending_orders = _lowest_first
sorting.descending_places = _places
