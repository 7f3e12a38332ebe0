"""What a finished write holds, so that a read tells a damaged array from a good one.

Each completing write records, in the same attribute update that sets its flag, the
arrays it wrote (shape and dtype) and the file holding them (byte count and CRC-32):

    "manifest": {"arrays": {"tokens": {"shape": [2048], "dtype": "int32"},
                            "scores/window": {"shape": [30, 3, 2048], "dtype": "float32"}, ...},
                 "files": {"capture.zip": [3314802, 2765180034]}}

Every read compares the file's size (a deleted or truncated file) and relies on the zip's
own per-member CRC-32 for altered bytes, which zip readers check as they decompress;
``rankkit store verify`` also recomputes the whole file's checksum. Schema version 1
examples carry no manifest and read as before, unchecked.

The capture's manifest also names the example and the model it was captured with
(``identity``): ``"example_id"`` and ``"weights_hash"``; its score shapes give the model's
layers and heads. ``mismatch`` tells an example that does not belong where it lies (a
folder renamed or swapped, an example copied in from another model's store, spans past
its tokens); examples written before these fields existed are checked on what they have.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np

from rankkit.errors import RankkitError
from rankkit.outputs import STORE_SCHEMA_KEY, json_digest

MANIFEST = "manifest"
ORACLE_MANIFEST = "oracle_manifest"
ORACLE_COMPLETE = "oracle_complete"  # the flag set once an oracle and its manifest are written
EXAMPLE_ID = "example_id"
WEIGHTS_HASH = "weights_hash"

_READ_BYTES = 4 * 2**20


def record(directory: Path, file_name: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """The manifest of ``arrays`` (path -> data), just written to ``directory / file_name``."""
    file = directory / file_name
    return {
        "arrays": {
            name: {"shape": list(data.shape), "dtype": str(data.dtype)} for name, data in arrays.items()
        },
        "files": {file_name: [file.stat().st_size, _crc32(file)]},
    }


def damage(directory: Path, recorded: dict[str, Any], *, checksum: bool) -> list[tuple[str, str]]:
    """(file, what is wrong) for every file of the manifest that no longer matches it; the
    checksum (a full read) only when asked."""
    found = []
    for name, (size, crc) in recorded["files"].items():
        file = directory / name
        if not file.is_file():
            found.append((name, f"{name} is missing"))
        elif file.stat().st_size != size:
            found.append((name, f"{name} has {file.stat().st_size} bytes, {size} were written"))
        elif checksum and _crc32(file) != crc:
            found.append((name, f"{name} was altered (checksum differs)"))
    return found


def _crc32(file: Path) -> int:
    checksum = 0
    with file.open("rb") as handle:
        while block := handle.read(_READ_BYTES):
            checksum = zlib.crc32(block, checksum)
    return checksum


def identity(example_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    """What the capture's manifest records of where the example belongs: its id and, when the
    run metadata has one, the model's weights hash."""
    weights_hash = (meta.get("model") or {}).get(WEIGHTS_HASH)
    return {EXAMPLE_ID: example_id, **({WEIGHTS_HASH: weights_hash} if weights_hash else {})}


ATTRS = "attrs"  # a manifest's digest of each attribute written with its part
# Checked by `store verify` alone, not at every read: each token's display text labels the dashboard's
# explorer and no figure reads it; as long as the prompt, it took 105 of the 132 µs every read of a
# 2,048-token example spent on the digests.
_VERIFIED_ONLY = frozenset({"token_text"})


def attrs_digests(attrs: dict[str, Any]) -> dict[str, Any]:
    """What a part's manifest records of the attributes written with it (an example's task, spans, meta
    and token texts; an oracle's settings and answer): a digest of each, so an edit made since is found."""
    return {ATTRS: {key: json_digest(value) for key, value in attrs.items()}}


def _changed_attrs(recorded: dict[str, Any], attrs: dict[str, Any], unchecked: frozenset[str] = frozenset()) -> list[str]:
    """The attributes but ``unchecked`` whose value is not the one the manifest ``recorded`` digested
    (none for a manifest written before manifests recorded them)."""
    digests = recorded.get(ATTRS) or {}
    return [
        key
        for key, digest in digests.items()
        if key not in unchecked and (key not in attrs or json_digest(attrs[key]) != digest)
    ]


_COUNTS = ("num_layers", "num_attention_heads", "kv_heads")

# The first schema version whose stores are created with a root manifest: one of it without its manifest was
# edited by hand, where an older one never had a manifest to check its metadata against.
ROOT_MANIFEST_SINCE = 3


def meta_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with the store's run metadata ``meta`` (its root attributes), or None: a key edited
    since the store was created (its manifest's digests; stores created before it had one are not
    checked so), or a malformed field every example is checked against (``mismatch``); a field may be
    absent (stores written by hand, older ones), never malformed."""
    if MANIFEST not in meta and meta.get(STORE_SCHEMA_KEY, 0) >= ROOT_MANIFEST_SINCE:
        return f"its zarr.json has no manifest, which every store of schema version {ROOT_MANIFEST_SINCE} holds"
    changed = _changed_attrs(meta.get(MANIFEST) or {}, meta)
    if changed:
        return f"its metadata was changed after it was written ({', '.join(changed)} in its zarr.json)"
    model = meta.get("model")
    if model is None:
        model = {}
    elif not isinstance(model, dict):
        return f"model is {model!r}, not a mapping"
    if "id" in model and not isinstance(model["id"], str):
        return f"model.id is {model['id']!r}, not a name"
    weights = model.get(WEIGHTS_HASH)
    if weights is not None and not (isinstance(weights, str) and weights):
        return f"model.{WEIGHTS_HASH} is {weights!r}, not a hash"
    for name in _COUNTS:
        count = meta.get(name)
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            return f"{name} is {count!r}, not a positive count"
    return None


def check_meta(store_path: Path, meta: dict[str, Any]) -> None:
    """RankkitError naming the fix when ``meta_problem`` finds one: every reader's refusal."""
    problem = meta_problem(meta)
    if problem:
        raise RankkitError(f"store {store_path} is corrupt ({problem}); recapture it with --overwrite")


def mismatch(example_id: str, attrs: dict[str, Any], meta: dict[str, Any], *, verifying: bool = False) -> str | None:
    """Why the complete example ``example_id`` (its attributes ``attrs``) does not belong to the
    store whose run metadata is ``meta``, or None: an attribute edited since it was written (its
    capture's, its oracle's; the token texts only when ``verifying``), another id in its manifest,
    another model's weights, layer or head count, or a token span outside its tokens."""
    recorded = attrs.get(MANIFEST)
    if not recorded:
        return None  # schema version 1: nothing recorded to compare
    changed = [
        *_changed_attrs(recorded, attrs, frozenset() if verifying else _VERIFIED_ONLY),
        *(_changed_attrs(attrs.get(ORACLE_MANIFEST) or {}, attrs) if attrs.get(ORACLE_COMPLETE) is True else []),
    ]
    if changed:
        return (
            f"the metadata of example {example_id!r} was changed after it was written ({', '.join(changed)} in its "
            "zarr.json)"
        )
    named = recorded.get(EXAMPLE_ID, example_id)
    if named != example_id:
        return f"the folder of example {example_id!r} holds example {named!r} (folders renamed or swapped)"
    weights = recorded.get(WEIGHTS_HASH)
    store_weights = (meta.get("model") or {}).get(WEIGHTS_HASH)
    if weights and store_weights and weights != store_weights:
        return (
            f"example {example_id!r} was captured with model weights {weights[:12]}, "
            f"the store with {store_weights[:12]} (copied in from another model's store?)"
        )
    arrays = recorded.get("arrays", {})
    heads = {meta.get("kv_heads"), meta.get("num_attention_heads")} - {None}
    for name, array in arrays.items():
        if not name.startswith("scores/"):
            continue
        layers, rows = array["shape"][0], array["shape"][1]
        if meta.get("num_layers") is not None and layers != meta["num_layers"]:
            return f"example {example_id!r} has scores of {layers} layers, the store's model {meta['num_layers']}"
        if heads and rows not in heads:
            return f"example {example_id!r} has scores of {rows} heads, the store's model {sorted(heads)}"
    num_tokens = arrays.get("tokens", {}).get("shape", [None])[0]
    return None if num_tokens is None else _span_outside(example_id, attrs.get("spans") or {}, num_tokens)


def _span_outside(example_id: str, spans: dict[str, Any], num_tokens: int) -> str | None:
    for name, value in spans.items():
        if not name.endswith("_tokens") or not value:
            continue
        for start, end in value if isinstance(value[0], list) else [value]:
            if not 0 <= start <= end <= num_tokens:
                return f"example {example_id!r} has {name} [{start}, {end}) outside its {num_tokens} tokens"
    return None
