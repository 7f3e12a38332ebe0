"""The names a store holds (example ids, probe keys, group names) as path-safe node names: one rule,
which the store applies on writing and a data file's loader on reading, so an id no store can hold
is refused where it is written, whatever command reads it."""

from __future__ import annotations

from urllib.parse import unquote

from rankkit.errors import RankkitError

# File names are at most 255 bytes on common file systems; leave room for the
# ".<uuid>.partial" suffix zarr's atomic writes add next to a file.
MAX_ENCODED_NAME_BYTES = 200

_SAFE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-.")
_SAFE_FIRST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")


def encode_name(name: str) -> str:
    """A reversible, path-safe node name for an example id, probe or group name.

    Keeps lower-case letters, digits, "_", "-", "." and percent-encodes every other
    UTF-8 byte, upper-case letters included, so ids differing only in case stay apart
    on case-insensitive file systems. The first character is always a letter, digit or
    "%": no hidden files, no "." or "..", no zarr-reserved "__" prefix.
    """
    if not isinstance(name, str) or not name:
        raise RankkitError(f"names in a store must be non-empty strings, got {name!r}; give each example an id")
    encoded = "".join(
        char if char in (_SAFE_FIRST_CHARS if position == 0 else _SAFE_CHARS) else _percent_encode(char)
        for position, char in enumerate(name)
    )
    if len(encoded.encode()) > MAX_ENCODED_NAME_BYTES:
        raise RankkitError(
            f"name {name[:40]!r}... is too long for a store path once encoded; use a shorter id"
        )
    return encoded


def _percent_encode(char: str) -> str:
    return "".join(f"%{byte:02x}" for byte in char.encode())


def decode_name(encoded: str) -> str:
    return unquote(encoded, errors="strict")
