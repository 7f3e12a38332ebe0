"""Read a store: examples as numpy arrays on demand, and tidy polars frames built one example at a time.

Only complete examples (and only flagged oracles and groups) are trusted. Nothing is
cached across calls, so a store that another process is still writing reads as of
each call. Example and probe columns are ``pl.Categorical`` in every frame, so frames
from one store join and concatenate without casts.
"""

from __future__ import annotations

import os
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import polars as pl
import zarr
from zarr.storage import LocalStore

from rankkit.errors import RankkitError
from rankkit.names import decode_name, encode_name

from . import manifest
from .manifest import MANIFEST, ORACLE_MANIFEST
from .schema import (
    ADDED_GROUPS,
    COMPLETE,
    EXAMPLE_FLAGS,
    EXAMPLE_NODES,
    EXAMPLES,
    ORACLE,
    ORACLE_COMPLETE,
    ORACLE_LAYERS,
    SCORES,
    STORE_MANAGED_KEYS,
    TOKENS,
    example_path,
    example_state,
    list_example_dirs,
    one_line,
    open_node,
    open_root,
    open_zip,
    read_zip_arrays,
    unreadable_metadata,
)

Reduce = Literal["sum", "mean", "max"] | None
_HEAD_REDUCERS = {"sum": np.sum, "mean": np.mean, "max": np.max}

_STORE_ATTRS = (MANIFEST, ORACLE_MANIFEST, ADDED_GROUPS)
_EXAMPLE_COLUMNS = ("id", "complete", "task", "num_tokens", "has_oracle", "correct")


class _Part:
    """The arrays one write put down (the capture, the oracle, or an added group), read with checks.

    ``recorded`` is the write's manifest; None for schema version 1 examples, whose arrays live
    in the zarr group ``legacy()`` opens, of the example's directory (opened only for them).
    """

    def __init__(
        self,
        example: ExampleRecord,
        recorded: dict[str, Any] | None,
        legacy: Callable[[], zarr.Group],
        redo: str,
    ):
        self.example = example
        self.recorded = recorded
        self._open_legacy = legacy
        self._redo = redo

    @property
    def _legacy(self) -> zarr.Group:
        return self._open_legacy()

    def array_names(self, prefix: str = "") -> list[str]:
        """Encoded names of the arrays under ``prefix`` ("" or e.g. "scores/")."""
        if self.recorded is not None:
            names = (name[len(prefix) :] for name in self.recorded["arrays"] if name.startswith(prefix))
            return sorted(name for name in names if "/" not in name)
        group = self._legacy[prefix.rstrip("/")] if prefix else self._legacy
        return sorted(group.array_keys())

    def shape(self, name: str) -> tuple[int, ...]:
        if self.recorded is not None:
            return tuple(self.recorded["arrays"][name]["shape"])
        return self.read(name, lambda array: array.shape)

    def read(self, name: str, read: Any = None) -> Any:
        """``read(zarr_array)`` of array ``name``, or the whole array without ``read``; RankkitError
        naming the example, the array and the fix when the file holding it is missing, truncated
        or no longer decodes."""
        if read is None:
            return self.read_whole([name])[name]
        self._check(name)
        try:
            if self.recorded is None:
                return read(self._legacy[name])
            (file_name,) = self.recorded["files"]
            with open_zip(self.example.directory / file_name) as root:
                return read(root[name])
        except Exception as error:  # zip, zarr, blosc and json raise many types for damaged bytes
            raise self._damaged(name, f"does not decode: {one_line(error)}") from None

    def read_whole(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """The whole arrays ``names``, their file opened once; checked as ``read`` checks them."""
        self._check(names[0])
        try:
            if self.recorded is None:
                return {name: self._legacy[name][...] for name in names}
            (file_name,) = self.recorded["files"]
            return read_zip_arrays(self.example.directory / file_name, names)
        except Exception as error:  # zip, zarr, blosc and json raise many types for damaged bytes
            if len(names) > 1:  # one at a time, to name the array that does not decode
                return {name: self.read_whole([name])[name] for name in names}
            raise self._damaged(names[0], f"does not decode: {one_line(error)}") from None

    def _check(self, name: str) -> None:
        """RankkitError naming ``name`` when the part's file is missing or truncated (its manifest)."""
        if self.recorded is not None:
            found = manifest.damage(self.example.directory, self.recorded, checksum=False)
            if found:
                raise self._damaged(name, found[0][1])

    def _damaged(self, name: str, detail: str) -> RankkitError:
        shown = "/".join(decode_name(part) for part in name.split("/"))
        store = self.example.store_path
        return RankkitError(
            f"example {self.example.id!r} in {store}: array {shown} is damaged ({detail}); "
            f"run `rankkit store verify {store} --reset`, then {self._redo}"
        )


class ArrayGroup:
    """A complete group of arrays added to an example after capture (``add_arrays``)."""

    def __init__(self, name: str, attrs: dict[str, Any], part: _Part):
        self.name = name
        self.attrs = attrs
        self._part = part

    @property
    def names(self) -> list[str]:
        return [decode_name(key) for key in self._part.array_names()]

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.names:
            raise RankkitError(
                f"group {self.name!r} has no array {name!r} (it has {', '.join(self.names) or 'none'})"
            )
        return self._part.read(encode_name(name))


class ExampleRecord:
    """One complete example; arrays are read from disk when asked for, each checked against
    what its write recorded (``rankkit.stores.manifest``)."""

    def __init__(self, example_id: str, store: LocalStore, attrs: dict[str, Any], store_path: Path):
        self.id = example_id
        self.attrs = {key: value for key, value in attrs.items() if key not in _STORE_ATTRS}
        self.store_path = store_path
        self.directory = store_path / example_path(example_id)
        self._store = store
        self._added = attrs.get(ADDED_GROUPS, {})
        self._capture = _Part(
            self, attrs.get(MANIFEST), lambda: self._example_group, f"rerun the capture into {store_path}"
        )
        self._oracle = _Part(
            self, attrs.get(ORACLE_MANIFEST), lambda: self._example_group, f"`rankkit oracle {store_path}`"
        )

    @cached_property
    def _example_group(self) -> zarr.Group:
        """The example's zarr group, opened once when first needed: what schema version 1 examples
        keep their arrays in."""
        return open_node(self._store, example_path(self.id))

    def __repr__(self) -> str:
        return f"ExampleRecord({self.id!r}, tokens={self.num_tokens}, probes={self.probes})"

    @cached_property
    def tokens(self) -> np.ndarray:
        return self._capture.read(TOKENS)

    @property
    def num_tokens(self) -> int:
        return self._capture.shape(TOKENS)[0]

    @cached_property
    def probes(self) -> list[str]:
        return [decode_name(name) for name in self._capture.array_names(f"{SCORES}/")]

    def score_shape(self, probe: str) -> tuple[int, int, int]:
        """[layers, kv_heads, tokens] of a probe's scores, without reading them."""
        return self._capture.shape(self._score_name(probe))

    def score_layout(self, probe: str) -> dict[str, Any]:
        """The attributes of a probe's score array: how its positions are laid out (``Probe.layout``)."""
        return self._capture.read(self._score_name(probe), lambda array: dict(array.attrs))

    def scores(self, probe: str, layers: Sequence[int] | None = None) -> np.ndarray:
        """float32 [layers, kv_heads, T] (whatever the stored dtype); ``layers`` picks (and orders) a subset."""
        return self._read_scores(probe, layers)[0]

    def all_scores(self) -> dict[str, np.ndarray]:
        """Every probe's ``scores``, read in one opening of the capture's file."""
        names = {probe: self._score_name(probe) for probe in self.probes}
        found = self._capture.read_whole(list(names.values()))
        return {probe: _as_scores(found[name]) for probe, name in names.items()}

    @property
    def has_oracle(self) -> bool:
        return self.attrs.get(ORACLE_COMPLETE) is True

    @property
    def oracle(self) -> np.ndarray | None:
        """float32 [T], or None until ``add_oracle`` completed for this example."""
        return self._oracle.read(ORACLE) if self.has_oracle else None

    @property
    def oracle_layers(self) -> np.ndarray | None:
        """float32 [layers, T], or None until ``add_oracle`` completed for this example."""
        return self._oracle.read(ORACLE_LAYERS) if self.has_oracle else None

    @cached_property
    def groups(self) -> list[str]:
        """Names of the complete groups added with ``add_arrays``."""
        names = list(self._added)
        if self._capture.recorded is None:  # schema version 1: groups are directories
            for key, member in self._example_group.groups():
                if key not in EXAMPLE_NODES and member.attrs.get(COMPLETE) is True:
                    names.append(decode_name(key))
        return sorted(names)

    def group(self, name: str) -> ArrayGroup:
        if name not in self.groups:
            raise RankkitError(
                f"example {self.id!r} has no complete group {name!r} (it has {', '.join(self.groups) or 'none'})"
            )
        redo = f"rerun the command that added group {name!r}"
        if name in self._added:
            return ArrayGroup(
                name,
                self._added[name]["attrs"],
                _Part(self, self._added[name][MANIFEST], lambda: self._example_group, redo),
            )
        legacy = self._example_group[encode_name(name)]
        attrs = {key: value for key, value in legacy.attrs.asdict().items() if key != COMPLETE}
        return ArrayGroup(name, attrs, _Part(self, None, lambda: legacy, redo))

    def _read_scores(self, probe: str, layers: Sequence[int] | None) -> tuple[np.ndarray, np.ndarray]:
        """The scores of ``layers`` (all when None) and those layers' indices."""
        name = self._score_name(probe)
        layer_ids = _checked_layers(
            layers, self._capture.shape(name)[0], f"probe {probe!r} of example {self.id!r}"
        )
        values = self._capture.read(name, None if layers is None else lambda array: array.oindex[layer_ids])
        return _as_scores(values), layer_ids

    def _score_name(self, probe: str) -> str:
        if probe not in self.probes:
            raise RankkitError(
                f"example {self.id!r} has no scores for probe {probe!r} (it has {', '.join(self.probes)})"
            )
        return f"{SCORES}/{encode_name(probe)}"


def _as_scores(values: np.ndarray) -> np.ndarray:
    # float16 stores (capture --score-dtype float16) read back as float32 like any other
    return values.astype(np.float32, copy=False)


class ReadOnce:
    """An example whose whole arrays are read from disk once, for a unit of analysis that asks for
    the same scores several times (compare ranks a probe and the methods built on it). Hold one
    only while working on its example: it keeps what it read. Every caller gets the same score
    arrays, read-only: copy one to write into it."""

    def __init__(self, record: ExampleRecord):
        self.record = record
        self._scores: dict[str, np.ndarray] = {}

    def scores(self, probe: str, layers: Sequence[int] | None = None) -> np.ndarray:
        if layers is not None or probe not in self.record.probes:
            return self.record.scores(probe, layers)
        if not self._scores:  # every probe at once: analyses that read one read them all
            self._scores = self.record.all_scores()
            for values in self._scores.values():
                values.flags.writeable = False
        return self._scores[probe]

    @cached_property
    def _oracle(self) -> np.ndarray | None:
        return self.record.oracle

    @property
    def oracle(self) -> np.ndarray | None:
        return None if self._oracle is None else self._oracle.copy()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.record, name)


class Store:
    """A read-only view of one store; get one from ``rankkit.stores.open``."""

    def __init__(self, path: Path, meta: dict[str, Any]):
        self.path = path
        self.meta = meta
        self._store = LocalStore(path, read_only=True)

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, examples={len(self)})"

    def __len__(self) -> int:
        return len(self.example_ids())

    def example_ids(self, complete_only: bool = True) -> list[str]:
        return [example_id for example_id, _ in self._example_attrs(complete_only)]

    def example(self, example_id: str) -> ExampleRecord:
        encoded = encode_name(example_id)
        if not (self.path / example_path(example_id)).is_dir():
            raise RankkitError(
                f"store {self.path} has no example {example_id!r}; list them with `rankkit store info`"
            )
        state, attrs = self._state(encoded)
        if state != "complete":
            raise RankkitError(
                f"example {example_id!r} in {self.path} is incomplete (interrupted capture); rerun the capture to redo it"
            )
        return self._record(example_id, attrs)

    def examples(self, *, skip_unreadable: bool = False) -> Iterator[ExampleRecord]:
        """Every complete example, in id order. An unreadable one (``example_state``) is refused, as
        its figures would be missing from the store's unsaid, unless ``skip_unreadable``: for a
        resumed capture, which redoes it."""
        for example_id, attrs in self._example_attrs(complete_only=True, skip_unreadable=skip_unreadable):
            yield self._record(example_id, attrs)

    def skipped(self) -> Counter[str]:
        """How many examples ``examples()`` and the frames leave out: "incomplete" ones (capture
        unfinished); an unreadable one is refused as ``examples()`` refuses it."""
        attrs = self._example_attrs(complete_only=False)
        return Counter("incomplete" for _, example in attrs if example.get(COMPLETE) is not True)

    def warn_skipped(self) -> None:
        """Warn (one line) of the examples left out, for commands that read the complete ones."""
        counts = self.skipped()
        if counts:
            listed = " and ".join(f"{count} {state}" for state, count in sorted(counts.items()))
            warnings.warn(
                f"left out {listed} example(s) of {self.path}; `rankkit store verify {self.path}` lists them",
                stacklevel=2,
            )

    def examples_frame(self, complete_only: bool = True) -> pl.DataFrame:
        """One row per example: id, complete, task, num_tokens, has_oracle, correct, then every
        other attribute whose values are scalars of one kind (e.g. prediction, question)."""
        rows = []
        for example_id, attrs in self._example_attrs(complete_only):
            complete = attrs.get(COMPLETE) is True
            rows.append(
                {
                    **{key: value for key, value in attrs.items() if key not in EXAMPLE_FLAGS},
                    "id": example_id,
                    "complete": complete,
                    "num_tokens": self._record(example_id, attrs).num_tokens if complete else None,
                    "has_oracle": complete and attrs.get(ORACLE_COMPLETE) is True,
                }
            )
        columns = {
            "id": pl.Series("id", [row["id"] for row in rows], dtype=pl.Categorical),
            "complete": pl.Series("complete", [row["complete"] for row in rows], dtype=pl.Boolean),
            "task": pl.Series("task", [_as_text(row.get("task")) for row in rows], dtype=pl.String),
            "num_tokens": pl.Series("num_tokens", [row["num_tokens"] for row in rows], dtype=pl.Int32),
            "has_oracle": pl.Series("has_oracle", [row["has_oracle"] for row in rows], dtype=pl.Boolean),
        }
        correct = _scalar_column("correct", rows)
        columns["correct"] = (
            correct if correct is not None else pl.Series("correct", [None] * len(rows), pl.Boolean)
        )
        for key in sorted({key for row in rows for key in row} - set(_EXAMPLE_COLUMNS)):
            column = _scalar_column(key, rows)
            if column is not None:
                columns[key] = column
        return pl.DataFrame(list(columns.values()))

    def iter_scores_frames(
        self,
        probe: str | None = None,
        reduce: Reduce = "sum",
        *,
        examples: Sequence[str] | None = None,
        layers: Sequence[int] | None = None,
    ) -> Iterator[pl.DataFrame]:
        """``scores_frame`` one example at a time, to keep memory to one example's scores."""
        if reduce is not None and reduce not in _HEAD_REDUCERS:
            raise RankkitError(f"reduce must be one of {', '.join(_HEAD_REDUCERS)} or None, got {reduce!r}")
        found_probe = False
        for record in self._records(examples):
            probes = record.probes if probe is None else [name for name in record.probes if name == probe]
            found_probe = found_probe or bool(probes)
            frames = [_scores_frame(record, name, reduce, layers) for name in probes]
            if frames:
                yield pl.concat(frames)
        if probe is not None and not found_probe:
            raise RankkitError(
                f"no example in {self.path} has scores for probe {probe!r}; see `rankkit store info`"
            )

    def scores_frame(
        self,
        probe: str | None = None,
        reduce: Reduce = "sum",
        *,
        examples: Sequence[str] | None = None,
        layers: Sequence[int] | None = None,
    ) -> pl.DataFrame:
        """Tidy scores: example, probe, layer, [head,] token, score.

        ``reduce`` combines the KV heads ("sum", "mean", "max"); None keeps a head column.
        ``probe``, ``examples`` and ``layers`` restrict what is read.
        """
        frames = list(self.iter_scores_frames(probe, reduce, examples=examples, layers=layers))
        if not frames:
            return pl.DataFrame(schema=_scores_schema(with_head=reduce is None))
        return pl.concat(frames)

    def oracle_frame(self, *, examples: Sequence[str] | None = None) -> pl.DataFrame:
        """example, token, oracle for every example with a complete oracle."""
        frames = [
            _token_frame(record.id, {"oracle": record.oracle})
            for record in self._records(examples)
            if record.has_oracle
        ]
        schema = {"example": pl.Categorical, "token": pl.Int32, "oracle": pl.Float32}
        return pl.concat(frames) if frames else pl.DataFrame(schema=schema)

    def oracle_layers_frame(
        self, *, examples: Sequence[str] | None = None, layers: Sequence[int] | None = None
    ) -> pl.DataFrame:
        """example, layer, token, oracle: the per-layer oracle of every example that has one."""
        frames = []
        for record in self._records(examples):
            if not record.has_oracle:
                continue
            values = record.oracle_layers
            layer_ids = _checked_layers(layers, values.shape[0], f"oracle_layers of example {record.id!r}")
            frames.append(_layered_frame(record.id, values[layer_ids], layer_ids, "oracle"))
        schema = {"example": pl.Categorical, "layer": pl.Int32, "token": pl.Int32, "oracle": pl.Float32}
        return pl.concat(frames) if frames else pl.DataFrame(schema=schema)

    def describe(self) -> dict[str, Any]:
        """What the store holds, as plain JSON values: run metadata, example counts, tasks,
        probes with their shapes, oracles and added groups."""
        example_attrs = self._example_attrs(complete_only=False)
        complete = [(example_id, attrs) for example_id, attrs in example_attrs if attrs.get(COMPLETE) is True]
        probes: dict[str, dict[str, Any]] = {}
        groups: Counter[str] = Counter()
        for example_id, attrs in complete:
            record = self._record(example_id, attrs)
            for probe in record.probes:
                layers, heads, tokens = record.score_shape(probe)
                summary = probes.setdefault(
                    probe, {"examples": 0, "layers": set(), "kv_heads": set(), "tokens": set()}
                )
                summary["examples"] += 1
                summary["layers"].add(layers)
                summary["kv_heads"].add(heads)
                summary["tokens"].add(tokens)
            groups.update(record.groups)
        return {
            "path": str(self.path),
            **{key: self.meta.get(key) for key in sorted(STORE_MANAGED_KEYS - {MANIFEST})},
            "run_meta": {key: value for key, value in self.meta.items() if key not in STORE_MANAGED_KEYS},
            "examples": {
                "complete": len(complete),
                "incomplete": len(example_attrs) - len(complete),
                "with_oracle": sum(attrs.get(ORACLE_COMPLETE) is True for _, attrs in complete),
            },
            "tasks": dict(
                sorted(
                    Counter(_as_text(attrs.get("task")) for _, attrs in complete).items(),
                    key=lambda item: str(item[0]),
                )
            ),
            "probes": {
                probe: {
                    "examples": summary["examples"],
                    "layers": sorted(summary["layers"]),
                    "kv_heads": sorted(summary["kv_heads"]),
                    "tokens_min": min(summary["tokens"]),
                    "tokens_max": max(summary["tokens"]),
                }
                for probe, summary in sorted(probes.items())
            },
            "groups": dict(sorted(groups.items())),
        }

    def _example_attrs(
        self, complete_only: bool, skip_unreadable: bool = False
    ) -> list[tuple[str, dict[str, Any]]]:
        """(id, attrs) per example in id order; an unreadable one refused, or left out when
        ``skip_unreadable``."""
        found = []
        for encoded in list_example_dirs(self.path):
            state, attrs = (
                example_state(self.path / EXAMPLES / encoded) if skip_unreadable else self._state(encoded)
            )
            if state != "complete" and (complete_only or state == "unreadable"):
                continue
            found.append((decode_name(encoded), attrs))
        return sorted(found, key=lambda item: _natural_key(item[0]))

    def _state(self, encoded: str) -> tuple[str, dict[str, Any]]:
        """``example_state`` of an example, refused in one line naming the fix when unreadable: a
        damaged zarr.json, which no write leaves behind (each replaces it whole)."""
        directory = self.path / EXAMPLES / encoded
        state, attrs = example_state(directory)
        if state == "unreadable":
            raise RankkitError(
                f"example {decode_name(encoded)!r} in {self.path} is unreadable ({unreadable_metadata(directory)}); "
                f"rerun the capture into {self.path} to redo it"
            )
        return state, attrs

    def _records(self, examples: Sequence[str] | None) -> Iterator[ExampleRecord]:
        if examples is None:
            yield from self.examples()
        else:
            for example_id in examples:
                yield self.example(example_id)

    def _record(self, example_id: str, attrs: dict[str, Any]) -> ExampleRecord:
        """The example, refused when it does not belong here (``manifest.mismatch``): its numbers
        would be mixed into the store's as if the same model had made them."""
        problem = manifest.mismatch(example_id, attrs, self.meta)
        if problem is not None:
            raise RankkitError(
                f"store {self.path}: {problem}; `rankkit store verify {self.path}` lists every such example"
            )
        return ExampleRecord(example_id, self._store, attrs, self.path)


def open(path: str | os.PathLike | Store) -> Store:
    """Open a store read-only; RankkitError if it is missing, corrupt or from a newer rankkit.

    An already open ``Store`` is returned as it is, so a command opens its store once and
    hands it to every function that takes a store path.
    """
    if isinstance(path, Store):
        return path
    store_path = Path(path)
    _, meta = open_root(store_path, read_only=True)
    manifest.check_meta(store_path, meta)
    return Store(store_path, meta)


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """``open(path).describe()``: what a store holds, for ``rankkit store info``."""
    return open(path).describe()


def _natural_key(example_id: str) -> tuple[str | int, ...]:
    """Sort "niah:2" before "niah:10": digit runs compare as numbers."""
    # re.split with a capture group puts the digit runs at the odd positions.
    parts = re.split(r"(\d+)", example_id)
    return tuple(int(part) if position % 2 else part for position, part in enumerate(parts))


def _checked_layers(layers: Sequence[int] | None, num_layers: int, what: str) -> np.ndarray:
    if layers is None:
        return np.arange(num_layers)
    chosen = np.asarray(layers, dtype=np.int64).reshape(-1)
    if chosen.size and (chosen.min() < 0 or chosen.max() >= num_layers):
        raise RankkitError(f"layers {list(layers)} out of range for {what}, which has {num_layers} layers")
    return chosen


def _scores_frame(
    record: ExampleRecord, probe: str, reduce: Reduce, layers: Sequence[int] | None
) -> pl.DataFrame:
    values, layer_ids = record._read_scores(probe, layers)
    if reduce is not None:
        frame = _layered_frame(record.id, _HEAD_REDUCERS[reduce](values, axis=1), layer_ids, "score")
    else:
        num_layers, num_heads, num_tokens = values.shape
        frame = pl.DataFrame(
            {
                "layer": np.repeat(layer_ids.astype(np.int32), num_heads * num_tokens),
                "head": np.tile(np.repeat(np.arange(num_heads, dtype=np.int32), num_tokens), num_layers),
                "token": np.tile(np.arange(num_tokens, dtype=np.int32), num_layers * num_heads),
                "score": values.reshape(-1),
            }
        ).with_columns(pl.lit(record.id, dtype=pl.Categorical).alias("example"))
    return frame.with_columns(pl.lit(probe, dtype=pl.Categorical).alias("probe")).select(
        _scores_schema(with_head=reduce is None).keys()
    )


def _scores_schema(with_head: bool) -> dict[str, pl.DataType]:
    schema = {"example": pl.Categorical, "probe": pl.Categorical, "layer": pl.Int32}
    if with_head:
        schema["head"] = pl.Int32
    return {**schema, "token": pl.Int32, "score": pl.Float32}


def _layered_frame(example_id: str, values: np.ndarray, layer_ids: np.ndarray, column: str) -> pl.DataFrame:
    """example, layer, token, <column> from a [layers, T] array."""
    num_layers, num_tokens = values.shape
    return (
        pl.DataFrame(
            {
                "layer": np.repeat(layer_ids.astype(np.int32), num_tokens),
                "token": np.tile(np.arange(num_tokens, dtype=np.int32), num_layers),
                column: values.reshape(-1).astype(np.float32, copy=False),
            }
        )
        .with_columns(pl.lit(example_id, dtype=pl.Categorical).alias("example"))
        .select("example", "layer", "token", column)
    )


def _token_frame(example_id: str, columns: dict[str, np.ndarray]) -> pl.DataFrame:
    """example, token, <columns...> from [T] arrays."""
    num_tokens = len(next(iter(columns.values())))
    return (
        pl.DataFrame({"token": np.arange(num_tokens, dtype=np.int32), **columns})
        .with_columns(pl.lit(example_id, dtype=pl.Categorical).alias("example"))
        .select("example", "token", *columns)
    )


def _as_text(value: Any) -> str | None:
    return None if value is None else str(value)


def _scalar_column(key: str, rows: list[dict[str, Any]]) -> pl.Series | None:
    """A column for attribute ``key`` when its values are all booleans, all numbers or all
    strings (missing values become null); None for lists, dicts and mixed kinds."""
    values = [row.get(key) for row in rows]
    kinds = {_scalar_kind(value) for value in values if value is not None}
    if kinds == {pl.Int64, pl.Float64}:
        return pl.Series(key, [None if value is None else float(value) for value in values], dtype=pl.Float64)
    if len(kinds) != 1 or None in kinds:
        return None
    return pl.Series(key, values, dtype=kinds.pop())


def _scalar_kind(value: Any) -> type[pl.DataType] | None:
    # bool before int: True is an int in Python.
    if isinstance(value, bool):
        return pl.Boolean
    if isinstance(value, int):
        return pl.Int64
    if isinstance(value, float):
        return pl.Float64
    if isinstance(value, str):
        return pl.String
    return None
