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
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest"
ORACLE_MANIFEST = "oracle_manifest"

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
