"""What a finished write holds, so that a read tells a damaged array from a good one.

Each completing write records, in the same attribute update that sets its flag, the
arrays it wrote (shape and dtype) and every file under them (byte count and CRC-32):

    "manifest": {"arrays": {"scores/window": {"shape": [30, 3, 2048], "dtype": "float32"}, ...},
                 "files": {"scores/window/zarr.json": [412, 2765180034], "scores/window/c/0/0/0": [...]}}

Paths are relative to the group that carries the manifest. A deleted, truncated or
altered file (chunk or array ``zarr.json``) then no longer matches, where zarr alone
would read a missing chunk back as its fill value. Stores written before manifests
existed carry none and read as before, unchecked.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MANIFEST = "manifest"
ORACLE_MANIFEST = "oracle_manifest"

_READ_BYTES = 4 * 2**20


def record(directory: Path, nodes: Iterable[str]) -> dict[str, Any]:
    """The manifest of ``nodes`` (array or group paths under ``directory``), read back from disk."""
    arrays: dict[str, dict[str, Any]] = {}
    files: dict[str, list[int]] = {}
    for node in nodes:
        for file in sorted(_files_under(directory / node)):
            relative = file.relative_to(directory).as_posix()
            files[relative] = [file.stat().st_size, _crc32(file)]
            if file.name == "zarr.json":
                metadata = json.loads(file.read_bytes())
                if metadata.get("node_type") == "array":
                    array = file.parent.relative_to(directory).as_posix()
                    arrays[array] = {"shape": metadata["shape"], "dtype": metadata["data_type"]}
    return {"arrays": arrays, "files": files}


def damage(directory: Path, manifest: dict[str, Any], node: str | None = None) -> list[tuple[str, str]]:
    """(array, what is wrong) for every file of ``node`` (all nodes when None) that no longer
    matches the manifest; files outside any array are reported under their group's path."""
    found = []
    for relative, (size, crc) in manifest["files"].items():
        owner = owning_node(relative, manifest["arrays"])
        if node is not None and owner != node:
            continue
        file = directory / relative
        chunk = relative[len(owner) + 1 :] or relative
        if not file.is_file():
            found.append((owner, f"{chunk} is missing"))
        elif file.stat().st_size != size:
            found.append((owner, f"{chunk} has {file.stat().st_size} bytes, {size} were written"))
        elif _crc32(file) != crc:
            found.append((owner, f"{chunk} was altered (checksum differs)"))
    return found


def owning_node(relative: str, arrays: Iterable[str]) -> str:
    """The array a file belongs to, or the directory holding it when it is a group's metadata."""
    for array in arrays:
        if relative.startswith(f"{array}/"):
            return array
    return os.path.dirname(relative) or relative


def _files_under(path: Path) -> Iterable[Path]:
    # zarr's atomic writes leave hidden ".partial" temporaries only while a write is running.
    for root, directories, names in os.walk(path):
        directories[:] = [name for name in directories if not name.startswith(".")]
        yield from (Path(root) / name for name in names if not name.startswith("."))


def _crc32(file: Path) -> int:
    checksum = 0
    with file.open("rb") as handle:
        while block := handle.read(_READ_BYTES):
            checksum = zlib.crc32(block, checksum)
    return checksum
