"""Check every example of a store in full: ``rankkit store verify STORE``.

An example is *good* when every file its manifests list (``rankkit.stores.manifest``) is
there, byte for byte (size and CRC-32); *damaged* when one is missing, truncated or
altered; *incomplete* when its capture never finished; *unreadable* when its own
``zarr.json`` no longer parses or was deleted from beside its arrays; *mismatched* when it does not belong to the store
(``manifest.mismatch``: another id in its manifest, another model's weights, layers or heads,
a span past its tokens, an attribute its manifest digested edited since). Damaged, unreadable and mismatched examples exit 2. Schema version 1 examples carry no manifest and are read
in full instead, which catches undecodable chunks and metadata but not a deleted chunk
(zarr reads it back as its fill value); they are counted as *unchecked*.

``reset`` clears the flag of every damaged part, so the command that wrote it redoes
it: the capture for tokens and scores, ``rankkit oracle`` for the oracle. A reset did what
was asked: it is reported (``reset_note``), not refused; a good example whose oracle it
unflagged is then good without an oracle, which the summary counts.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zarr
from zarr.storage import LocalStore

from rankkit.errors import RankkitError
from rankkit.names import decode_name

from . import manifest
from .manifest import MANIFEST, ORACLE_MANIFEST
from .schema import (
    ADDED_GROUPS,
    COMPLETE,
    EXAMPLES,
    ORACLE,
    ORACLE_COMPLETE,
    ORACLE_LAYERS,
    SCORES,
    TOKENS,
    example_state,
    list_example_dirs,
    one_line,
    open_node,
    open_root,
    unreadable_metadata,
    update_attributes,
)

CAPTURE = "capture"
ORACLE_PART = "oracle"


@dataclass(frozen=True)
class Problem:
    example: str
    state: str  # "damaged", "incomplete", "unreadable" or "mismatched"
    detail: str
    part: str = CAPTURE  # what rewrites it: the capture, the oracle, or the named added group


@dataclass
class VerifyReport:
    path: Path
    examples: int = 0
    good: int = 0
    unchecked: int = 0
    problems: list[Problem] = field(default_factory=list)
    reset: bool = False
    without_oracle: int = 0  # good or unchecked examples that `rankkit oracle` has yet to add to

    def counts(self) -> dict[str, int]:
        states = Counter(problem.state for problem in self.problems)
        # An example with several damaged arrays is one damaged example.
        states["damaged"] = len({problem.example for problem in self.problems if problem.state == "damaged"})
        return {"good": self.good, "unchecked": self.unchecked, **{key: states[key] for key in _STATES}}

    def summary(self) -> str:
        counts = ", ".join(f"{count} {state}" for state, count in self.counts().items())
        missing = (
            f"; {self.without_oracle} without an oracle (`rankkit oracle {self.path}` adds it)"
            if self.without_oracle
            else ""
        )
        return f"{self.examples} examples in {self.path}: {counts}{missing}"

    def reset_note(self) -> str | None:
        """What a reset did and the commands that redo it; None when nothing was reset."""
        damaged = self.counts()["damaged"]
        if not (self.reset and damaged):
            return None
        return f"reset {damaged} damaged example(s) in {self.path}; {self._redo()} to redo them"

    def raise_if_damaged(self) -> None:
        """RankkitError (exit 2) naming the fix when any example is unreadable, mismatched, or damaged
        and not reset."""
        counts = self.counts()
        damaged = counts["damaged"]
        if not damaged or self.reset:
            refused = " and ".join(f"{counts[state]} {state}" for state in _REFUSED if counts[state])
            if refused:
                raise RankkitError(
                    f"{refused} example(s) in {self.path}, listed above; recapture them "
                    "(or move a mismatched one back to its own folder or store)"
                )
            return
        raise RankkitError(
            f"{damaged} damaged example(s) in {self.path}; run `rankkit store verify {self.path} --reset`, "
            f"then {self._redo()}"
        )

    def _redo(self) -> str:
        """The commands that rewrite the damaged parts: the capture, the oracle, an added group's."""
        parts = {problem.part for problem in self.problems if problem.state == "damaged"}
        commands = [
            *([f"rerun the capture into {self.path}"] if CAPTURE in parts else []),
            *([f"run `rankkit oracle {self.path}`"] if ORACLE_PART in parts else []),
            *(
                f"rerun the command that added group {name!r}"
                for name in sorted(parts - {CAPTURE, ORACLE_PART})
            ),
        ]
        return ", then ".join(commands)


_STATES = ("damaged", "incomplete", "unreadable", "mismatched")
_REFUSED = ("unreadable", "mismatched")


def verify(path: str | os.PathLike, *, reset: bool = False) -> VerifyReport:
    """Check every example of the store at ``path``; with ``reset``, unflag each damaged part."""
    store_path = Path(path)
    _, meta = open_root(store_path, read_only=not reset)
    manifest.check_meta(store_path, meta)
    local = LocalStore(store_path, read_only=not reset)
    report = VerifyReport(store_path, reset=reset)
    for encoded in list_example_dirs(store_path):
        report.examples += 1
        example_id = decode_name(encoded)
        directory = store_path / EXAMPLES / encoded
        state, attrs = example_state(directory)
        if state != "complete":
            detail = unreadable_metadata(directory) if state == "unreadable" else "capture unfinished"
            report.problems.append(Problem(example_id, state, detail))
            continue
        mismatch = manifest.mismatch(example_id, attrs, meta, verifying=True)
        if mismatch is not None:
            report.problems.append(Problem(example_id, "mismatched", mismatch))
            continue
        found = _damaged_parts(directory, attrs)
        if not found:  # None: a schema version 1 example that reads whole
            if found is None:
                report.unchecked += 1
            else:
                report.good += 1
            report.without_oracle += attrs.get(ORACLE_COMPLETE) is not True
            continue
        report.problems += [Problem(example_id, "damaged", detail, part) for part, detail in found]
        if reset:
            _unflag(local, f"{EXAMPLES}/{encoded}", {part for part, _ in found})
    return report


def _damaged_parts(directory: Path, attrs: dict[str, Any]) -> list[tuple[str, str]] | None:
    """(part, what is wrong) per damaged file; None for a schema version 1 example that reads whole."""
    if MANIFEST not in attrs:
        return _undecodable(directory)
    parts = [(CAPTURE, attrs[MANIFEST])]
    if attrs.get(ORACLE_COMPLETE) is True:
        parts.append((ORACLE_PART, attrs[ORACLE_MANIFEST]))
    parts += [(name, added[MANIFEST]) for name, added in attrs.get(ADDED_GROUPS, {}).items()]
    return [
        (part, detail)
        for part, recorded in parts
        for _, detail in manifest.damage(directory, recorded, checksum=True)
    ]


def _undecodable(directory: Path) -> list[tuple[str, str]] | None:
    """Read a pre-manifest example in full; what zarr cannot decode, or None when all of it reads."""
    found = []
    group = zarr.open_group(LocalStore(directory, read_only=True), mode="r", use_consolidated=False)
    for node in (TOKENS, SCORES, ORACLE, ORACLE_LAYERS):
        if not (directory / node).is_dir():
            continue
        try:
            member = group[node]
            arrays = [member] if isinstance(member, zarr.Array) else [array for _, array in member.arrays()]
            for array in arrays:
                array[...]
        except Exception as error:  # zarr, blosc and json raise many types for damaged files
            found.append((ORACLE_PART if node.startswith(ORACLE) else CAPTURE, f"{node}: {one_line(error)}"))
    return found or None


def _unflag(local: LocalStore, example_node: str, parts: set[str]) -> None:
    example = open_node(local, example_node)
    flags: dict[str, Any] = {}
    if CAPTURE in parts:
        flags[COMPLETE] = False
    if ORACLE_PART in parts:
        flags[ORACLE_COMPLETE] = False
    added = example.attrs.get(ADDED_GROUPS, {})
    if parts - {CAPTURE, ORACLE_PART}:
        flags[ADDED_GROUPS] = {name: group for name, group in added.items() if name not in parts}
    update_attributes(example, flags)
