"""Create or resume a store and write examples so that a crash never leaves data a reader trusts.

Every write puts the arrays down first and flips a flag in the group's attributes
last, with the manifest it vouches for, in one atomic replace of ``zarr.json``
(``schema.update_attributes``), so a reader sees either the old flag or the new one.
Processes may write different examples of one store at the same time: each example is
its own directory and nothing shared is updated per example.
Two processes must not write the same example at once: each writer holds a lock file in
the store (one per torchrun rank, ``.writer-<rank>.lock``), and a second writer of the same
store is refused with one line while the first runs. ``overwrite`` deletes only a store
rankkit wrote (its root attributes and nothing inside it but its own files).
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.storage import LocalStore

from rankkit import __version__ as rankkit_version
from rankkit.errors import RankkitError
from rankkit.names import encode_name
from rankkit.outputs import describe_differences, lock_exclusively

from . import manifest
from .manifest import MANIFEST, ORACLE_MANIFEST
from .schema import (
    ADDED_GROUPS,
    CAPTURE_FILE,
    COMPLETE,
    CREATED_KEY,
    EXAMPLE_FLAGS,
    EXAMPLE_NODES,
    EXAMPLES,
    LAYOUT_VERSION,
    ORACLE,
    ORACLE_COMPLETE,
    ORACLE_FILE,
    ORACLE_LAYERS,
    RANKKIT_VERSION_KEY,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    SCORE_DTYPE_KEY,
    SCORES,
    STORE_MANAGED_KEYS,
    TOKENS,
    check_score_dtype,
    example_path,
    group_file,
    open_node,
    open_root,
    read_example_attrs,
    to_json,
    update_attributes,
    write_zip,
)


class StoreWriter:
    """Writes examples into one store; get one from ``rankkit.stores.create``."""

    def __init__(self, path: Path, meta: dict[str, Any]):
        self.path = path
        self.meta = meta
        self._store = LocalStore(path)
        self._score_dtype = np.dtype(meta.get(SCORE_DTYPE_KEY, "float32"))

    def example_attrs(self, example_id: str) -> dict[str, Any]:
        """The attributes stored with an example (its oracle's among them); empty for one not written."""
        return read_example_attrs(self._store, encode_name(example_id)) or {}

    def is_complete(self, example_id: str) -> bool:
        return self.example_attrs(example_id).get(COMPLETE) is True

    def has_oracle(self, example_id: str) -> bool:
        attrs = self.example_attrs(example_id)
        return attrs.get(COMPLETE) is True and attrs.get(ORACLE_COMPLETE) is True

    def has_group(self, example_id: str, group: str) -> bool:
        """Whether ``add_arrays`` completed ``group`` for this example: listed in the example's
        attributes, or (schema version 1) a group directory flagged complete."""
        example = read_example_attrs(self._store, encode_name(example_id))
        if example is not None and group in example.get(ADDED_GROUPS, {}):
            return True
        legacy = read_example_attrs(self._store, f"{encode_name(example_id)}/{encode_name(group)}")
        return legacy is not None and legacy.get(COMPLETE) is True

    def write_example(
        self,
        example_id: str,
        *,
        attrs: dict[str, Any],
        tokens: np.ndarray,
        scores: dict[str, np.ndarray],
        score_attrs: dict[str, dict] | None = None,
    ) -> None:
        """Write one captured example, replacing an incomplete one; ``complete`` is set last.

        ``score_attrs`` are the attributes of each probe's score array (``Probe.layout``).
        """
        encoded = encode_name(example_id)
        example_attrs = _caller_attrs(attrs, f"attrs of example {example_id!r}")
        token_ids = _token_array(tokens, example_id)
        score_arrays = {
            encode_name(probe): _score_array(values, probe, example_id, token_ids.shape[0]).astype(
                self._score_dtype, copy=False
            )
            for probe, values in scores.items()
        }
        score_layouts = {
            encode_name(probe): _caller_attrs((score_attrs or {}).get(probe, {}), f"attrs of probe {probe!r}")
            for probe in scores
        }
        if self.is_complete(example_id):
            raise RankkitError(
                f"example {example_id!r} is already complete in {self.path}; skip it, "
                "or recreate the store with --overwrite"
            )
        _remove_directory(self.path / EXAMPLES / encoded)

        group = open_node(self._store, EXAMPLES).create_group(
            encoded, attributes={**example_attrs, COMPLETE: False}
        )
        arrays = {
            TOKENS: token_ids,
            **{f"{SCORES}/{probe}": values for probe, values in score_arrays.items()},
        }
        example_dir = self.path / EXAMPLES / encoded
        layouts = {f"{SCORES}/{probe}": layout for probe, layout in score_layouts.items()}
        write_zip(example_dir / CAPTURE_FILE, arrays, array_attrs=layouts)
        recorded = (
            manifest.record(example_dir, CAPTURE_FILE, arrays)
            | manifest.identity(example_id, self.meta)
            | manifest.attrs_digests(example_attrs)
        )
        _mark_complete(group, {COMPLETE: True, MANIFEST: recorded})

    def add_oracle(
        self,
        example_id: str,
        *,
        oracle: np.ndarray,
        oracle_layers: np.ndarray,
        attrs: dict[str, Any],
    ) -> None:
        """Add (or replace) an example's oracle; attrs are merged and ``oracle_complete`` set last.

        An interrupted add leaves the capture intact and the oracle unflagged.
        """
        group = self._captured_example(example_id, "adding its oracle")
        recorded = group.attrs.get(MANIFEST)
        # schema version 1 examples hold their tokens as a plain array
        num_tokens = recorded["arrays"][TOKENS]["shape"][0] if recorded else group[TOKENS].shape[0]
        oracle_values = _float_array(oracle, f"oracle of example {example_id!r}", ndim=1)
        layer_values = _float_array(oracle_layers, f"oracle_layers of example {example_id!r}", ndim=2)
        for name, values in ((ORACLE, oracle_values), (ORACLE_LAYERS, layer_values)):
            if values.shape[-1] != num_tokens:
                raise RankkitError(
                    f"{name} of example {example_id!r} covers {values.shape[-1]} tokens but the example "
                    f"has {num_tokens}; compute it on the stored tokens"
                )
        oracle_attrs = _caller_attrs(attrs, f"oracle attrs of example {example_id!r}")

        # Unflag a previous oracle before its arrays are rewritten: a crash midway then
        # leaves no oracle rather than a flagged mix of old and new arrays.
        if group.attrs.get(ORACLE_COMPLETE) is True:
            update_attributes(group, {ORACLE_COMPLETE: False})
        arrays = {ORACLE: oracle_values, ORACLE_LAYERS: layer_values}
        example_dir = self.path / example_path(example_id)
        write_zip(example_dir / ORACLE_FILE, arrays)
        oracle_manifest = manifest.record(example_dir, ORACLE_FILE, arrays) | manifest.attrs_digests(oracle_attrs)
        _mark_complete(group, {**oracle_attrs, ORACLE_COMPLETE: True, ORACLE_MANIFEST: oracle_manifest})

    def add_arrays(
        self,
        example_id: str,
        group: str,
        arrays: dict[str, np.ndarray],
        attrs: dict[str, Any],
    ) -> None:
        """Add (or replace) a named group of arrays under a captured example, e.g. ``draft_scores``.

        The group's own attributes carry the caller's attrs and a ``complete`` flag set last.
        """
        if group in EXAMPLE_NODES or group_file(group) in (CAPTURE_FILE, ORACLE_FILE):
            raise RankkitError(f"group name {group!r} is part of the example layout; choose another name")
        example = self._captured_example(example_id, f"adding group {group!r}")
        group_attrs = _caller_attrs(attrs, f"attrs of group {group!r}")
        encoded_arrays = {
            encode_name(name): _numeric_array(values, f"{group}/{name} of example {example_id!r}")
            for name, values in arrays.items()
        }
        added = dict(example.attrs.get(ADDED_GROUPS, {}))
        if added.pop(group, None) is not None:
            # Unlist the old group first: a crash while its zip is replaced then leaves no group.
            update_attributes(example, {ADDED_GROUPS: added})
        example_dir = self.path / example_path(example_id)
        write_zip(example_dir / group_file(group), encoded_arrays)
        group_manifest = manifest.record(example_dir, group_file(group), encoded_arrays)
        added[group] = {"attrs": group_attrs, MANIFEST: group_manifest}
        _mark_complete(example, {ADDED_GROUPS: added})

    def _captured_example(self, example_id: str, purpose: str) -> zarr.Group:
        if not self.is_complete(example_id):
            raise RankkitError(
                f"example {example_id!r} is not captured in {self.path}; capture it before {purpose}"
            )
        return open_node(self._store, example_path(example_id))


_REMOVING = ".removing"  # the suffix of a folder being deleted (``_remove_directory``)


def _remove_directory(path: Path) -> None:
    """Delete an example's folder or a whole store, renamed out of the way first: a kill midway
    through deleting it in place could leave an example's arrays without their zarr.json, which
    readers refuse as damaged (``example_state``), or a store without its own, which no command
    then reads, resumes or removes."""
    _clear_removal_leftover(path)
    if path.exists():
        hidden = _removal_name(path)
        os.rename(path, hidden)
        shutil.rmtree(hidden)


def _removal_name(path: Path) -> Path:
    # one name per folder, not a fresh one per removal: a leftover is then found without listing the
    # folder's siblings (every example of a store, once per example written); one process at a time
    # removes a given folder (the store's lock, or the rank that owns the example)
    return path.with_name(f".{path.name}{_REMOVING}")


def _clear_removal_leftover(path: Path) -> None:
    """Delete what a kill left of an earlier ``_remove_directory(path)``, out of sight but on disk."""
    leftover = _removal_name(path)
    if leftover.exists():
        shutil.rmtree(leftover)


def _mark_complete(group: zarr.Group, flags: dict[str, Any]) -> None:
    """The last write of every addition: one atomic replace of the group's zarr.json."""
    update_attributes(group, flags)


def create(
    path: str | os.PathLike, run_meta: dict[str, Any], *, overwrite: bool = False, rank: int = 0
) -> StoreWriter:
    """Create a store, or reopen one to resume it after checking it holds the same run.

    ``run_meta`` is any JSON-like dict; capture writes
    ``{"model": {"id", "config", "weights_hash"}, "tokenizer": ..., "probes": {name: params},
    "dataset": ...}``. The store adds ``schema_version``, ``rankkit_version`` and
    ``created`` itself. Resuming requires every other key to equal what the store holds
    (so put only what defines the run there, nothing per invocation); ``overwrite=True``
    deletes an existing store first, if rankkit wrote it. The process holds the store's lock of
    torchrun rank ``rank`` from then until it ends; another process holding it is refused.
    """
    store_path = Path(path)
    meta = to_json(run_meta, "run_meta")
    if not isinstance(meta, dict):
        raise RankkitError(f"run_meta must be a dict, got {type(run_meta).__name__}")
    run_meta_only = {key: value for key, value in meta.items() if key not in STORE_MANAGED_KEYS}
    check_score_dtype(meta.get(SCORE_DTYPE_KEY, "float32"))

    if overwrite:
        remove(store_path)
    if not _is_populated(store_path):
        _create_atomically(store_path, run_meta_only)
    root, stored = open_root(store_path, read_only=False)
    _check_same_run(store_path, stored, run_meta_only)
    _take_lock(store_path, rank)
    if stored[SCHEMA_VERSION_KEY] < LAYOUT_VERSION:
        # Resuming an older store adds examples in the current layout; readers of the old
        # version must then refuse the store rather than miss those examples.
        update_attributes(root, {SCHEMA_VERSION_KEY: LAYOUT_VERSION})
    return StoreWriter(store_path, stored)


def lock_file(path: Path, rank: int) -> Path:
    return path / f".writer-{rank}.lock"


_HELD_LOCKS: dict[Path, int] = {}  # lock file -> the descriptor this process locked it through


def _take_lock(path: Path, rank: int) -> None:
    """Lock ``path`` for ``rank`` until the process ends, unless this process holds that lock
    already (a capture, then its oracles); a lock held elsewhere is refused in one line."""
    file = lock_file(path, rank).resolve()
    held = _HELD_LOCKS.get(file)
    if held is not None and file.exists() and os.fstat(held).st_ino == file.stat().st_ino:
        return
    handle = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
    if not lock_exclusively(handle, file):
        os.close(handle)
        raise RankkitError(
            f"another process is writing {path} ({file.name} is locked); wait for it to finish, "
            "then rerun to resume, or choose another --out"
        )
    if held is not None:  # the lock of a store deleted and made again since
        os.close(held)
    _HELD_LOCKS[file] = handle


def _is_populated(path: Path) -> bool:
    if not path.exists():
        return False
    if not path.is_dir():
        raise RankkitError(f"{path} is a file, not a store directory; choose another --out")
    with os.scandir(path) as entries:
        return any(True for _ in entries)


def is_rankkit_store(path: Path) -> bool:
    """Whether ``path`` is a store rankkit wrote (its root attributes say so)."""
    try:
        _, stored = open_root(path, read_only=True)
    except RankkitError:
        return False
    return RANKKIT_VERSION_KEY in stored


def remove(path: str | os.PathLike) -> None:
    """Delete an existing store that rankkit wrote; anything else is refused, naming what is in the way."""
    path = Path(path)
    if not check_removable(path):
        _clear_removal_leftover(path)
        return
    _take_lock(path, 0)  # no writer may be at work in a store being deleted
    _remove_directory(path)


def check_removable(path: Path) -> bool:
    """Whether there is a store at ``path`` for ``remove`` to delete; RankkitError naming what is in the way
    where it would refuse. For a caller that removes several outputs to check each before removing any."""
    if not _is_populated(path):
        return False
    refusal = "refusing to delete it; move it away or choose another --out"
    if not is_rankkit_store(path):
        raise RankkitError(f"{path} exists and is not a rankkit store; {refusal}")
    foreign = _foreign_entry(path)
    if foreign is not None:
        raise RankkitError(f"{path} holds {foreign}, which rankkit did not write; {refusal}")
    return True


def _foreign_entry(path: Path) -> Path | None:
    """The first entry of the store at ``path`` that rankkit did not write, looked for where a file of
    one's own could be dropped: beside the store's metadata, among the examples and in each example's
    folder (the arrays of a schema version 1 example are folders of zarr's own)."""
    examples = path / EXAMPLES
    folders = [(path, _is_store_entry), (examples, _is_examples_entry)]
    folders += [
        (example, _is_example_entry)
        for example in sorted(examples.iterdir())
        if example.is_dir() and not _is_leftover(example)
    ]
    for folder, written in folders:
        for entry in sorted(folder.iterdir()):
            if not written(entry):
                return entry
    return None


def _is_store_entry(entry: Path) -> bool:
    return entry.name in ("zarr.json", EXAMPLES) or _is_lock(entry) or _is_leftover(entry)


def _is_examples_entry(entry: Path) -> bool:
    return entry.name == "zarr.json" or entry.is_dir() or _is_leftover(entry)


def _is_example_entry(entry: Path) -> bool:
    return _is_examples_entry(entry) or entry.suffix == ".zip"


def _is_lock(entry: Path) -> bool:
    return entry.name.startswith(".writer-") and entry.name.endswith(".lock")


def _is_leftover(entry: Path) -> bool:
    """What a write killed midway leaves: a zip or zarr.json staged under a temporary name
    (``write_zip``, zarr's own ``zarr.<hex>.partial``) or a folder being deleted (``_remove_directory``)."""
    # ".removing-<hex>": the name such a folder had before it had one per folder
    return entry.name.endswith(".partial") or (entry.name.startswith(".") and _REMOVING in entry.name)


def _create_atomically(path: Path, run_meta: dict[str, Any]) -> None:
    """Build the empty store beside ``path`` and rename it into place.

    Processes starting at once race only on the rename: the loser finds a complete
    store and goes on to resume it, never a half-created root.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.creating-{uuid.uuid4().hex}"
    root_attrs = {
        **run_meta,
        SCHEMA_VERSION_KEY: SCHEMA_VERSION,
        RANKKIT_VERSION_KEY: rankkit_version,
        CREATED_KEY: datetime.now(UTC).isoformat(timespec="seconds"),
        MANIFEST: manifest.attrs_digests(run_meta),
    }
    try:
        root = zarr.open_group(LocalStore(staging), mode="w", zarr_format=3, attributes=root_attrs)
        root.create_group(EXAMPLES)
        os.rename(staging, path)
    except OSError as error:
        if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_same_run(path: Path, stored: dict[str, Any], run_meta: dict[str, Any]) -> None:
    stored_run = {key: value for key, value in stored.items() if key not in STORE_MANAGED_KEYS}
    differences = describe_differences(stored_run, run_meta, "in the store")
    if differences:
        raise RankkitError(
            f"store {path} holds a different run ({differences}); rerun with --overwrite to replace it, "
            "or choose another --out"
        )


def _caller_attrs(attrs: dict[str, Any], what: str) -> dict[str, Any]:
    plain = to_json(attrs, what)
    if not isinstance(plain, dict):
        raise RankkitError(f"{what} must be a dict, got {type(attrs).__name__}")
    reserved = sorted(EXAMPLE_FLAGS & plain.keys())
    if reserved:
        raise RankkitError(f"{what} may not set {', '.join(reserved)}: the store sets those flags itself")
    return plain


def _token_array(tokens: np.ndarray, example_id: str) -> np.ndarray:
    token_ids = np.asarray(tokens)
    if token_ids.ndim != 1 or token_ids.size == 0 or not np.issubdtype(token_ids.dtype, np.integer):
        raise RankkitError(
            f"tokens of example {example_id!r} must be a non-empty 1-D integer array, "
            f"got {token_ids.dtype} of shape {token_ids.shape}"
        )
    if token_ids.min() < 0 or token_ids.max() > np.iinfo(np.int32).max:
        raise RankkitError(f"tokens of example {example_id!r} must be ids in [0, 2**31)")
    return token_ids.astype(np.int32, copy=False)


def _score_array(values: np.ndarray, probe: str, example_id: str, num_tokens: int) -> np.ndarray:
    scores = _float_array(values, f"scores of probe {probe!r} for example {example_id!r}", ndim=3)
    if scores.shape[2] != num_tokens:
        raise RankkitError(
            f"scores of probe {probe!r} for example {example_id!r} have shape {scores.shape}; "
            f"expected [layers, kv_heads, {num_tokens}] to match the tokens"
        )
    return scores


def _float_array(values: np.ndarray, what: str, *, ndim: int) -> np.ndarray:
    array = _numeric_array(values, what)
    if array.ndim != ndim:
        raise RankkitError(f"{what} must be a {ndim}-D array, got shape {array.shape}")
    return array.astype(np.float32, copy=False)


def _numeric_array(values: np.ndarray, what: str) -> np.ndarray:
    array = np.asarray(values)
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise RankkitError(f"{what} must be numeric, got dtype {array.dtype}")
    if array.ndim == 0 or array.size == 0:
        raise RankkitError(
            f"{what} must be a non-empty array of at least one dimension, got shape {array.shape}"
        )
    return array
