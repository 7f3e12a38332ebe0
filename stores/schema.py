"""The on-disk contract shared by the writer and the reader.

A store is a zarr v3 group on the local file system::

    run.zarr/                 attrs: schema_version, rankkit_version, created + the caller's run metadata
                                     + "manifest" (a digest of each run metadata key)
      examples/<id>/          attrs: the caller's example attrs + "complete" and "manifest"
                                     (+ "oracle_complete" and "oracle_manifest", + "added_groups")
        capture.zip           a zarr group: tokens int32 [T], scores/<probe> float32 [layers, heads, T]
                              (KV heads; query heads for last_token_heads)
        oracle.zip            oracle float32 [T], oracle_layers float32 [layers, T]
        <group>.zip           later additions (add_arrays), listed with their attrs in "added_groups"

so an example is three or four files however many probes it holds, which keeps large stores
quick to list, copy and sync. Each zip is written beside its final name and renamed into
place, then the example's flag is set. Schema version 1 stores (before 0.2) held the same
arrays as plain zarr directories under ``examples/<id>/`` (``tokens``, ``scores/<probe>``,
``oracle``, ``oracle_layers``, ``<group>/<name>`` with its own "complete" flag); they still
read, and a resumed capture adds new examples in this layout.

Every name below ``examples/`` is an encoded id (see ``encode_name``).
"""

from __future__ import annotations

import glob
import itertools
import json
import math
import os
import uuid
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from numcodecs import blosc
from zarr.codecs import BloscCodec, BloscShuffle
from zarr.errors import GroupNotFoundError
from zarr.storage import LocalStore, ZipStore

from rankkit.errors import RankkitError
from rankkit.names import encode_name
from rankkit.outputs import STORE_SCHEMA_KEY, os_reason

from .manifest import MANIFEST, ORACLE_COMPLETE, ORACLE_MANIFEST, ROOT_MANIFEST_SINCE

SCHEMA_VERSION = ROOT_MANIFEST_SINCE
# The version of the examples' layout (one zip per write), which schema version 3 kept. A resume
# raises an older store to it, not to 3: it adds no root manifest, vouching for no metadata it did not write.
LAYOUT_VERSION = 2

# Root attributes the store sets itself; callers' run metadata never overrides them
# and they are not part of the resume compatibility check.
SCHEMA_VERSION_KEY = STORE_SCHEMA_KEY
RANKKIT_VERSION_KEY = "rankkit_version"
CREATED_KEY = "created"
# The root's manifest holds a digest of each key of the run metadata (``manifest.attrs_digests``), so
# an edit made since the store was created is refused as an example's is.
STORE_MANAGED_KEYS = frozenset({SCHEMA_VERSION_KEY, RANKKIT_VERSION_KEY, CREATED_KEY, MANIFEST})

# Run metadata naming how scores are stored: "float16" halves a store (capture
# --score-dtype); absent means float32. Part of the run's identity, so a resume keeps it.
SCORE_DTYPE_KEY = "score_dtype"
SCORE_DTYPES = ("float32", "float16")

EXAMPLES = "examples"
TOKENS = "tokens"
SCORES = "scores"
ORACLE = "oracle"
ORACLE_LAYERS = "oracle_layers"
EXAMPLE_NODES = frozenset({TOKENS, SCORES, ORACLE, ORACLE_LAYERS})
CAPTURE_FILE = "capture.zip"
ORACLE_FILE = "oracle.zip"
ADDED_GROUPS = "added_groups"

COMPLETE = "complete"
# The flags and what each completed write holds (rankkit.stores.manifest) are the store's own.
EXAMPLE_FLAGS = frozenset({COMPLETE, ORACLE_COMPLETE, MANIFEST, ORACLE_MANIFEST, ADDED_GROUPS})

# Whole-array chunks up to this size: one file per array keeps writes and full reads
# fast (4k tokens x 30 layers x 3 heads is 1.5 MB). Longer contexts split along layers.
TARGET_CHUNK_BYTES = 8 * 2**20

# Scores are full-mantissa floats and barely compress (1.1-1.2x with byte shuffle):
# blosc-lz4 decodes them 3-6x faster than zstd for about 6% more bytes, and analysis
# decodes every score of thousands of examples. Token ids compress well: zstd level 3.
# The codec is in each chunk's header: stores written with either read the same.
FLOAT_COMPRESSORS = (BloscCodec(cname="lz4", clevel=5, shuffle=BloscShuffle.shuffle),)
INTEGER_COMPRESSORS = (BloscCodec(cname="zstd", clevel=3, shuffle=BloscShuffle.shuffle),)


def check_score_dtype(score_dtype: str) -> None:
    if score_dtype not in SCORE_DTYPES:
        raise RankkitError(f"--score-dtype must be one of {', '.join(SCORE_DTYPES)}, got {score_dtype!r}")


def example_path(example_id: str) -> str:
    return f"{EXAMPLES}/{encode_name(example_id)}"


def chunks_for(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Whole-array chunks, or blocks of leading rows (layers) when the array is large."""
    if len(shape) == 1:
        return shape
    row_bytes = math.prod(shape[1:]) * itemsize
    rows = max(1, min(shape[0], TARGET_CHUNK_BYTES // max(1, row_bytes)))
    return (rows, *shape[1:])


def group_file(name: str) -> str:
    """The zip an added group's arrays live in."""
    return f"{encode_name(name)}.zip"


def write_zip(
    path: Path,
    arrays: dict[str, np.ndarray],
    attrs: dict[str, Any] | None = None,
    array_attrs: dict[str, dict[str, Any]] | None = None,
) -> None:
    """A zarr group of ``arrays`` (keys are paths, e.g. "scores/<probe>") in one zip at ``path``,
    written beside it under a hidden name and renamed into place: readers never see half a zip.
    ``attrs`` are the group's attributes, ``array_attrs`` those of the arrays it names."""
    # what a write of this zip killed midway left: only this store's one writer (its lock) stages here
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
        stale.unlink(missing_ok=True)
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        store = ZipStore(staging, mode="w")
        root = zarr.open_group(store, mode="w", zarr_format=3, attributes=attrs or {})
        for name, data in arrays.items():
            parent, _, leaf = name.rpartition("/")
            group = root.require_group(parent) if parent else root
            write_array(group, leaf, data, (array_attrs or {}).get(name))
        store.close()
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def read_zip_arrays(path: Path, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The whole arrays ``names`` of the zarr group in the zip at ``path``, the zip opened once.

    Arrays laid out as ``write_array`` writes them (a regular chunk grid, "/" chunk keys, the
    bytes codec then blosc) are decoded here, chunk by chunk; zarr's own reader costs about
    3 ms per array in its event loop, more than decompressing a 2k-token example's scores,
    and analysis reads every array of thousands of examples. Any other layout reads through
    zarr.
    """
    with zipfile.ZipFile(path) as archive:
        members = set(archive.namelist())
        return {name: _read_member_array(archive, members, path, name) for name in names}


def _read_member_array(archive: zipfile.ZipFile, members: set[str], path: Path, name: str) -> np.ndarray:
    metadata = json.loads(archive.read(f"{name}/zarr.json"))
    if not _written_by_write_array(metadata):
        with open_zip(path) as root:
            return root[name][...]
    shape = tuple(metadata["shape"])
    chunk_shape = tuple(metadata["chunk_grid"]["configuration"]["chunk_shape"])
    dtype = np.dtype(metadata["data_type"]).newbyteorder("<")
    values = np.empty(shape, dtype)
    grid = [range(-(-size // chunk)) for size, chunk in zip(shape, chunk_shape, strict=True)]
    for index in itertools.product(*grid):
        key = "/".join((name, "c", *map(str, index))) if index else f"{name}/c"
        region = tuple(
            slice(start * chunk, min(size, (start + 1) * chunk))
            for start, chunk, size in zip(index, chunk_shape, shape, strict=True)
        )
        if key not in members:  # zarr leaves out chunks that hold only the fill value
            values[region] = _fill_value(metadata["fill_value"])
            continue
        target = values[region]
        if target.shape == chunk_shape and target.flags.c_contiguous:  # a whole chunk: no copy
            blosc.decompress(archive.read(key), target)
            continue
        chunk = np.frombuffer(blosc.decompress(archive.read(key)), dtype).reshape(chunk_shape)
        target[...] = chunk[tuple(slice(0, part.stop - part.start) for part in region)]
    return values.astype(dtype.newbyteorder("="), copy=False)


def _written_by_write_array(metadata: dict[str, Any]) -> bool:
    codecs = metadata.get("codecs") or []
    return (
        metadata.get("node_type") == "array"
        and metadata.get("chunk_grid", {}).get("name") == "regular"
        and metadata.get("chunk_key_encoding") == {"name": "default", "configuration": {"separator": "/"}}
        and [codec.get("name") for codec in codecs] == ["bytes", "blosc"]
        and codecs[0].get("configuration", {}).get("endian", "little") == "little"
        and not metadata.get("storage_transformers")
    )


def _fill_value(value: Any) -> Any:
    """A zarr v3 fill value as numpy takes it: JSON spells non-finite floats as strings."""
    return float(value) if isinstance(value, str) else value


@contextmanager
def open_zip(path: Path) -> Iterator[zarr.Group]:
    """The zarr group in a zip, read-only; the file is closed on exit, so thousands of examples
    read one after another never hold thousands of open files."""
    store = ZipStore(path, mode="r")
    try:
        yield zarr.open_group(store, mode="r", zarr_format=3, use_consolidated=False)
    finally:
        store.close()


def write_array(group: zarr.Group, name: str, data: np.ndarray, attributes: dict | None = None) -> None:
    group.create_array(
        name,
        data=data,
        chunks=chunks_for(data.shape, data.dtype.itemsize),
        compressors=FLOAT_COMPRESSORS if data.dtype.kind == "f" else INTEGER_COMPRESSORS,
        overwrite=True,
        attributes=attributes,
    )


def to_json(value: Any, what: str) -> Any:
    """``value`` as plain JSON types (numpy scalars and arrays become numbers and lists).

    Round-tripping through JSON text also turns tuples into lists, so metadata compares
    equal to what a later reopen reads back.
    """

    def numpy_to_python(item: Any) -> Any:
        if isinstance(item, np.generic | np.ndarray):
            return item.tolist()
        raise TypeError(f"{type(item).__name__} is not JSON-serializable")

    try:
        return json.loads(json.dumps(value, default=numpy_to_python))
    except (TypeError, ValueError) as error:
        raise RankkitError(
            f"{what} must hold only JSON values (str, number, bool, list, dict): {error}"
        ) from error


def open_node(store: LocalStore, node_path: str = "") -> zarr.Group:
    """Open a group read/write or read-only as ``store`` allows; no consolidated metadata,
    since concurrent writers would make it stale."""
    return zarr.open_group(
        store,
        path=node_path,
        mode="r" if store.read_only else "r+",
        zarr_format=3,
        use_consolidated=False,
    )


def update_attributes(node: zarr.Group, attrs: dict[str, Any]) -> None:
    """Merge ``attrs`` into a group's attributes in one atomic replace of its zarr.json.

    zarr's ``group.attrs.update`` writes the metadata once per key: a crash between two keys
    would leave, say, ``complete`` set without the manifest it vouches for.
    """
    node.update_attributes(attrs)


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _root_metadata_problem(metadata: Path) -> str | None:
    """What makes a store's root ``zarr.json`` unreadable as a group's metadata, in words, before
    zarr reads it: zarr's own errors for these speak of its code (``pop expected at most 1 argument``)."""
    try:
        document = json.loads(metadata.read_bytes())
    except OSError as error:
        return f"its zarr.json cannot be read: {os_reason(error)}"
    except ValueError:
        return "its zarr.json is not JSON"
    if not isinstance(document, dict):
        return "its zarr.json is not a JSON object"
    if document.get("node_type") != "group":
        return f"its zarr.json's node_type is {document.get('node_type')!r}, not 'group'"
    return None


def open_root(path: Path, *, read_only: bool) -> tuple[zarr.Group, dict[str, Any]]:
    """The root group and its attributes, checked to be a rankkit store this version reads."""
    if not path.exists():
        raise RankkitError(f"no store at {path}; check the path or capture into it first")
    if not (path / "zarr.json").is_file():
        raise RankkitError(f"{path} is not a rankkit store (no zarr.json); check the path")
    problem = _root_metadata_problem(path / "zarr.json")
    if problem is None:
        try:
            root = open_node(LocalStore(path, read_only=read_only))
            attrs = root.attrs.asdict()
        except Exception as error:  # zarr raises many types for unreadable metadata
            problem = one_line(error)
    if problem is not None:
        raise RankkitError(f"store {path} is corrupt ({problem}); recapture it with --overwrite")
    version = attrs.get(SCHEMA_VERSION_KEY)
    if version is None:
        raise RankkitError(
            f"{path} is a zarr group but not a rankkit store (no schema_version); check the path"
        )
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise RankkitError(
            f"store {path} is corrupt (schema_version {version!r}); recapture it with --overwrite"
        )
    if version > SCHEMA_VERSION:
        raise RankkitError(
            f"store {path} has schema version {version}, newer than this rankkit reads "
            f"({SCHEMA_VERSION}); upgrade rankkit (pip install -U rankkit)"
        )
    if not (path / EXAMPLES).is_dir():
        raise RankkitError(f"store {path} is corrupt (no {EXAMPLES}/ group); recapture it with --overwrite")
    return root, attrs


def list_example_dirs(path: Path) -> list[str]:
    """Encoded names of every example directory, complete or not.

    Skips hidden entries and files (e.g. zarr's ".partial" temporaries); encoded ids
    never start with ".".
    """
    with os.scandir(path / EXAMPLES) as entries:
        return sorted(entry.name for entry in entries if entry.is_dir() and not entry.name.startswith("."))


def example_state(directory: Path) -> tuple[str, dict[str, Any]]:
    """("complete" | "incomplete" | "unreadable", attrs) of an example or added group directory:
    incomplete when its write never finished, unreadable when its zarr.json no longer parses or
    is gone from beside the arrays written after it (``unreadable_metadata`` says which)."""
    metadata = directory / "zarr.json"
    if not metadata.is_file():
        # A write creates the example's zarr.json before its arrays: arrays without it are a
        # deleted zarr.json, not an interrupted write.
        return ("unreadable" if _holds_arrays(directory) else "incomplete"), {}
    try:
        attrs = json.loads(metadata.read_bytes()).get("attributes", {})
    except (ValueError, AttributeError):
        return "unreadable", {}
    if not isinstance(attrs, dict):
        return "unreadable", {}
    return ("complete" if attrs.get(COMPLETE) is True else "incomplete"), attrs


def _holds_arrays(directory: Path) -> bool:
    # zips, or schema version 1's array directories
    return any(directory.glob("*.zip")) or any((directory / node).exists() for node in (TOKENS, SCORES))


def unreadable_metadata(directory: Path) -> str:
    """Why an example ``example_state`` calls unreadable is so."""
    state = "is missing" if not (directory / "zarr.json").is_file() else "does not parse"
    return f"its zarr.json {state}"


def read_example_attrs(store: LocalStore, encoded: str) -> dict[str, Any] | None:
    """An example's attributes, or None when its metadata was never (fully) written."""
    try:
        return open_node(store, f"{EXAMPLES}/{encoded}").attrs.asdict()
    # A crash before the group's zarr.json landed leaves no group (GroupNotFoundError);
    # hand-damaged metadata fails to parse (ValueError, TypeError, KeyError).
    except (GroupNotFoundError, ValueError, TypeError, KeyError):
        return None
