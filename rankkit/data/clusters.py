"""Clusters of examples that share what makes their outcomes move together.

An example lists the units it is built from that other examples may share (a stretch of
haystack text, a needle, a question); examples sharing a unit, directly or through a chain
of others, are one cluster, and intervals resample clusters (``rankkit.eval.stats``).
Unit names are made from the content they stand for, so the same text gets the same
name in every file and spec.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence


def digest(text: str) -> str:
    """A short content name for a unit's text."""
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def shared_clusters(units: Sequence[Sequence[str]]) -> list[tuple[str, int]]:
    """Per example (given by its units, at least one), its cluster's name and size.

    A cluster is named by a unit its examples share (the first, in the order of its examples and
    their units), so by content they hold; an example sharing nothing by its first unit.
    """
    parent = list(range(len(units)))

    def root(item: int) -> int:
        while parent[item] != item:
            parent[item] = parent[parent[item]]
            item = parent[item]
        return item

    first_user: dict[str, int] = {}
    users: Counter[str] = Counter()
    for item, names in enumerate(units):
        for name in dict.fromkeys(names):
            users[name] += 1
            parent[root(item)] = root(first_user.setdefault(name, item))
    roots = [root(item) for item in range(len(units))]
    named: dict[int, str] = {}
    for item, found in enumerate(roots):
        shared = next((name for name in units[item] if users[name] > 1), None)
        if shared is not None and found not in named:
            named[found] = shared
    sizes = Counter(roots)
    return [(named.get(found, units[item][0]), sizes[found]) for item, found in enumerate(roots)]
