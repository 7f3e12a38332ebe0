"""Safe output files: every ``--out`` of rankkit is claimed, then written atomically, here.

``claim`` runs before any work, so a refused output costs nothing: a directory, an
existing file (unless ``overwrite``), a path that is, or lies inside, one of the
command's own inputs (a store's ``zarr.json``, say) and a folder that cannot be written
(read-only, not a folder, or without the space the command says it needs) are refused with
the fix named. ``write_atomic`` writes beside the target and renames into place, so a
reader (or an interrupted run) only ever sees the old file or the complete new one; a write
that fails says why in one line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

import polars as pl

from rankkit.errors import RankkitError
from rankkit.interrupts import deferred_interrupts

PathLike = str | os.PathLike


def claim(
    outputs: Sequence[PathLike],
    *,
    overwrite: bool = False,
    inputs: Iterable[PathLike | None] = (),
    needed_bytes: int = 0,
) -> list[Path]:
    """Check that ``outputs`` may be written (``needed_bytes`` of them, where the command knows);
    returns them as paths. Raises RankkitError naming the fix."""
    resolved_inputs = [Path(each).resolve() for each in inputs if each is not None]
    paths = [named_file(each) for each in outputs]
    for path in paths:
        target = path.resolve()
        for source in resolved_inputs:
            if target == source or source in target.parents:
                raise RankkitError(
                    f"--out {path} is one of this command's inputs ({source}); choose another path"
                )
        if path.is_dir():
            raise RankkitError(
                f"--out {path} is a directory; give a file path inside it, e.g. {path / 'out'}"
            )
        check_outside_stores(path)  # a file there is not the store's: its --overwrite would then refuse the store
        if path.exists() and not overwrite:
            raise RankkitError(
                f"{path} already exists; pass --overwrite to replace it, or choose another --out"
            )
        if path.exists():
            check_replaceable(path)
    for folder in dict.fromkeys(path.parent for path in paths):
        check_writable(folder, needed_bytes)
    return paths


# The root attribute that marks a folder as a rankkit store (its schema version): here, below the
# stores, so that every output can be kept out of one.
STORE_SCHEMA_KEY = "schema_version"


def enclosing_store(path: Path) -> Path | None:
    """The rankkit store (a folder whose zarr.json carries ``STORE_SCHEMA_KEY``) that holds ``path``,
    if any."""
    for folder in path.parents:
        metadata = folder / "zarr.json"
        if metadata.is_file():
            try:
                attributes = json.loads(metadata.read_text(encoding="utf-8")).get("attributes") or {}
            except (OSError, ValueError, AttributeError):
                continue
            if STORE_SCHEMA_KEY in attributes:
                return folder
    return None


def check_outside_stores(path: PathLike, *, itself: bool = False) -> None:
    """Refuse an output (a file, a store, a sweep, the demo's folder) inside a rankkit store, or with
    ``itself`` one that is a store: it would land among the store's examples, which only the
    store's writer may add to."""
    resolved = Path(path).resolve()
    store = enclosing_store(resolved / "zarr.json" if itself else resolved)
    if store is not None:
        raise RankkitError(f"--out {path} is inside the rankkit store {store}; choose a path outside it")


# What marks a file as rankkit's output: a parquet's key-value metadata, a page's generator tag.
PARQUET_MARK = {"written_by": "rankkit"}
GENERATOR_TAG = '<meta name="generator" content="rankkit">'
_PARQUET_MAGIC = b"PAR1"
_PAGE_HEAD_BYTES = 4096


_DIFFERENCES_SHOWN = 3


def describe_differences(before: object, now: object, before_where: str) -> str:
    """Where two JSON values differ, the first few: ``model.weights_hash: 'ab' in the store, 'cd' now; and 2
    more`` (``before_where`` saying where ``before`` is); empty where they are the same."""
    found = _differences(before, now, before_where)
    shown = "; ".join(found[:_DIFFERENCES_SHOWN])
    return shown + (f"; and {len(found) - _DIFFERENCES_SHOWN} more" if len(found) > _DIFFERENCES_SHOWN else "")


def _differences(before: object, now: object, before_where: str, prefix: str = "") -> list[str]:
    if isinstance(before, dict) and isinstance(now, dict):
        found = []
        for key in sorted(set(before) | set(now)):
            found += _differences(
                before.get(key, _ABSENT), now.get(key, _ABSENT), before_where, f"{prefix}{key}."
            )
        return found
    # compared as JSON text: NaN equals NaN, and key order inside lists aside
    if before is not _ABSENT and now is not _ABSENT and _json_text(before) == _json_text(now):
        return []
    return [f"{prefix.rstrip('.')}: {_short(before)} {before_where}, {_short(now)} now"]


def _json_text(value: object) -> str:
    return json.dumps(value, sort_keys=True)


class _Absent:
    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def written_by_rankkit(path: Path) -> bool:
    """Whether the file ``path`` is one rankkit wrote, which ``--overwrite`` may replace: a parquet file
    carrying ``PARQUET_MARK``, a page carrying ``GENERATOR_TAG`` in its head, or a JSONL file of
    examples as ``rankkit data export`` writes them (an object with an id and a context per line)."""
    with path.open("rb") as handle:
        head = handle.read(_PAGE_HEAD_BYTES)
    if head.startswith(_PARQUET_MAGIC):
        try:
            return all(pl.read_parquet_metadata(path).get(key) == value for key, value in PARQUET_MARK.items())
        except Exception:  # polars raises several types for a damaged file
            return False
    if GENERATOR_TAG.encode("utf-8") in head:
        return True
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        entries = [json.loads(line) for line in lines if line.strip()]
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return bool(entries) and all(isinstance(entry, dict) and {"id", "context"} <= entry.keys() for entry in entries)


def check_replaceable(path: Path) -> None:
    """Refuse to replace or remove the existing file ``path`` unless rankkit wrote it: ``--overwrite``
    only ever removes rankkit's own outputs."""
    if not written_by_rankkit(path):
        raise RankkitError(
            f"{path} was not written by rankkit, and --overwrite replaces only what rankkit wrote; "
            "move it away or choose another --out"
        )


def named_file(path: PathLike) -> Path:
    """``path`` as a Path, refused when it names no file (``--out ''`` reads as the current folder)."""
    target = Path(path)
    if not os.fspath(path).strip() or not target.name:
        raise RankkitError(
            f"--out {os.fspath(path)!r} names no file; give a file path, e.g. --out runs/out.parquet"
        )
    return target


def check_writable(folder: PathLike, needed_bytes: int = 0) -> None:
    """Refuse a folder rankkit could not write into, before any work: its nearest existing
    ancestor must be a folder that takes a file (tried with a nameless temporary file, which
    also tells a read-only disk from permissions, even for root) and has ``needed_bytes`` free."""
    folder = Path(folder)
    existing = next(path for path in (folder, *folder.parents) if path.exists() or path == Path(path.anchor))
    if not existing.is_dir():
        raise RankkitError(
            f"cannot write into {folder}: {existing} is a file, not a folder; choose another --out"
        )
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise RankkitError(
            f"cannot write into {folder}: {existing} is not writable ({error.strerror}); choose another --out"
        ) from None
    free = shutil.disk_usage(existing).free
    if needed_bytes > free:
        raise RankkitError(
            f"{folder} needs about {_size(needed_bytes)} but {existing} has {_size(free)} free; "
            "free some space or choose another --out"
        )


def _size(count: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def os_reason(error: OSError) -> str:
    """An OSError in words, without Python's exception text."""
    return error.strerror or os.strerror(error.errno or errno.EIO)


def read_failure(path: PathLike, error: OSError) -> str:
    """Why reading the input ``path`` failed, and the fix."""
    return f"cannot read {path} ({os_reason(error)}); check that it is a readable file, or give another"


def write_failure(path: PathLike, error: OSError) -> str:
    """Why writing ``path`` failed."""
    return f"cannot write {path} ({os_reason(error)})"


def write_atomic(path: PathLike, write: Callable[[Path], None], *, overwrite: bool = True) -> Path:
    """Call ``write(temporary)`` on a sibling file, then rename it to ``path``; returns ``path``.

    Without ``overwrite`` a file that reached ``path`` after the command claimed it (another run
    making the same output at the same time) is kept and this write refused: a rename would
    replace it unasked."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write(partial)
        if overwrite:
            os.replace(partial, target)
        elif not _published_new(partial, target):
            raise OutputTaken(
                f"{target} was written by another run while this one worked; pass --overwrite to replace "
                "it, or choose another --out"
            )
    except OSError as error:
        raise RankkitError(f"{write_failure(target, error)}; the old file, if any, is unchanged") from None
    finally:
        # A cleanup that fails too (the disk gone read-only) must not hide why the write failed.
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    return target


class OutputTaken(RankkitError):
    """A write without overwrite found its target made by another run meanwhile."""


# what link raises on a filesystem without hard links (FAT, some FUSE and network mounts)
NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS)


def _published_new(partial: Path, target: Path) -> bool:
    """Give the whole file ``partial`` the name ``target`` too, unless that exists (False): a hard link
    never replaces. Without hard links, the check comes just before the rename instead."""
    try:
        os.link(partial, target)
    except FileExistsError:
        return False
    except OSError as error:
        if error.errno not in NO_LINKS:
            raise
        if target.exists():
            return False
        os.replace(partial, target)
    return True


def write_parquet(frame: pl.DataFrame, path: PathLike, *, overwrite: bool = True) -> Path:
    return write_atomic(path, lambda partial: frame.write_parquet(partial, metadata=PARQUET_MARK), overwrite=overwrite)


def write_text(text: str, path: PathLike, *, overwrite: bool = True) -> Path:
    return write_atomic(path, lambda partial: partial.write_text(text, encoding="utf-8"), overwrite=overwrite)


# what flock raises on a filesystem that has no locks (some network and FUSE mounts)
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def lock_exclusively(handle: int, path: Path) -> bool:
    """Lock the open file ``handle`` (of ``path``) for this process without waiting; False when
    another process holds it. A filesystem without locks is let through, with a warning: a run
    cannot be refused for what it cannot check."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno not in NO_LOCKS:
            raise RankkitError(f"cannot lock {path} ({error.strerror}); choose another --out") from None
        warnings.warn(
            f"{path.parent} cannot lock files ({error.strerror}): a second run writing the same "
            "output at the same time is not refused there",
            stacklevel=3,
        )
    return True


def journal_path(out: PathLike) -> Path:
    """Where the rows of ``out`` are kept until it is written (``Journal``)."""
    out = Path(out)
    return out.with_name(f".{out.name}.unfinished.jsonl")


def _journal_entries(path: Path) -> tuple[list[dict], int, bool]:
    """A journal's entries up to a line cut short by a kill, the bytes they take, and whether
    there was such a line."""
    entries, kept_bytes = [], 0
    for line in path.read_bytes().splitlines(keepends=True):
        try:
            entries.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return entries, kept_bytes, True
        kept_bytes += len(line)
    return entries, kept_bytes, False


_DIGEST = "digest"  # of the rest of a journal entry, so a line changed since it was written is found


def json_digest(value) -> str:
    """The SHA-256 of a JSON value as rankkit writes it (keys sorted): what a journal line or a store's
    manifest records of what it wrote, so an edit made since is found."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode("utf-8")).hexdigest()


def _changed_line(entries: list[dict]) -> int | None:
    """The number (from 1) of the first journal entry whose digest is not that of its content, or None."""
    for number, entry in enumerate(entries, start=1):
        rest = {key: value for key, value in entry.items() if key != _DIGEST}
        if entry.get(_DIGEST) != json_digest(rest):
            return number
    return None


def _finished_units(entries: list[dict]) -> tuple[dict[str, list[dict]], dict[str, object]]:
    """(rows per finished unit, notes) of a journal's entries after its identity line."""
    units, notes = {}, {}
    for entry in entries[1:]:
        if "note" in entry:
            notes.update(entry["note"])
        else:
            units[entry["key"]] = entry["rows"]
    return units, notes


class Journal:
    """The finished rows of an output still being made, kept beside it so an interrupted run resumes.

    Rows are appended (and synced) to ``.<out>.unfinished.jsonl`` as each unit of work
    (a key, e.g. an example id) finishes; its first line is the run's ``identity`` (the
    settings that define the output). Rerunning with the same identity resumes: ``done``
    names the finished keys and ``rows`` holds their rows. Other settings are refused
    unless ``overwrite``. ``finish`` writes the output atomically and removes the journal.
    The journal stays locked until ``close`` (or the end of a ``with`` block), so a second run
    making the same output is refused while the first runs. Without ``out`` the rows live in
    memory only.

    ``owned``: ``out`` is the caller's to rewrite (the demo's folder, whose command has no
    ``--overwrite``): a journal it cannot resume is started anew instead of refused, and ``finish``
    writes over an earlier output.
    """

    def __init__(self, out: PathLike | None, identity: dict, *, overwrite: bool = False, owned: bool = False) -> None:
        self.out = None if out is None else Path(out)
        self.path = None if out is None else journal_path(self.out)
        self.identity = json.loads(json.dumps(identity))  # as it reads back from the file
        self.overwrite = overwrite
        self.owned = owned
        self.units: dict[str, list[dict]] = {}
        self.notes: dict[str, object] = {}
        self._file: BinaryIO | None = None
        if self.path is None:
            return
        self._file = self._lock()
        try:
            if overwrite:
                self._file.truncate(0)
            if os.fstat(self._file.fileno()).st_size:
                self._resume_or_start_anew()
            else:
                self._append({"identity": self.identity})
        except BaseException:
            self.close()
            raise

    def _lock(self) -> BinaryIO:
        """The journal's file, created if new and locked until ``close``: a second run making the
        same output is refused, so two runs never append to one journal or replace each other's
        output."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as error:
            raise RankkitError(write_failure(self.path, error)) from None
        locked = lock_exclusively(handle, self.path)
        # a run that finished meanwhile removed the file this one opened
        if not locked or not self.path.exists() or os.fstat(handle).st_ino != self.path.stat().st_ino:
            os.close(handle)
            raise RankkitError(
                f"another rankkit run is making {self.out} ({self.path.name} is locked); wait for it "
                "to finish, then rerun to resume, or choose another --out"
            ) from None
        return os.fdopen(handle, "ab", buffering=0)

    def close(self) -> None:
        """Release the journal's lock (kept on disk for a rerun to resume, unless ``finish`` removed it)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def _resume_or_start_anew(self) -> None:
        try:
            self._resume()
        except RankkitError:
            if not self.owned:
                raise
            self.units, self.notes = {}, {}
            self._file.truncate(0)
            self._append({"identity": self.identity})

    def _resume(self) -> None:
        entries, kept_bytes, cut = _journal_entries(self.path)
        if cut:  # a line cut short by a kill: drop it, its unit is redone
            self._file.truncate(kept_bytes)
        if not entries or entries[0].get("identity") != self.identity:
            recorded = entries[0].get("identity") if entries else None
            differences = describe_differences(recorded, self.identity, "there") if recorded else ""
            raise RankkitError(
                f"{self.out} has an unfinished run with other settings ({differences or self.path}); rerun "
                "with those settings to resume it, or pass --overwrite to discard it"
            )
        changed = _changed_line(entries)
        if changed is not None:  # its rows would be taken as measured
            raise RankkitError(
                f"line {changed} of {self.path} was changed after rankkit wrote it; pass --overwrite to "
                "discard the unfinished run and start over"
            )
        self.units, self.notes = _finished_units(entries)

    def _append(self, entry: dict) -> None:
        try:
            line = json.dumps({**entry, _DIGEST: json_digest(entry)})
            self._file.write((line + "\n").encode("utf-8"))
            os.fsync(self._file.fileno())
        except OSError as error:
            raise RankkitError(
                f"{write_failure(self.path, error)}; the {len(self.units)} units finished before are kept "
                "there: make room and rerun the same command to resume"
            ) from None

    def note(self, name: str, value) -> None:
        """Keep a value the resumed run must reuse (e.g. a calibration), so its output matches."""
        self.notes[name] = json.loads(json.dumps(value))
        if self.path is not None:
            self._append({"note": {name: value}})

    def done(self, key: str) -> bool:
        return key in self.units

    def record(self, key: str, rows: list[dict]) -> None:
        rows = json.loads(json.dumps(rows))  # the same values a resumed run reads back
        with deferred_interrupts():  # a line written is a unit kept: ``kept`` must not say one fewer
            if self.path is not None:
                self._append({"key": key, "rows": rows})
            self.units[key] = rows

    @property
    def rows(self) -> list[dict]:
        return [row for rows in self.units.values() for row in rows]

    def kept(self) -> str:
        """One line saying what an interrupted run kept and how to resume it."""
        if self.path is None:
            return f"interrupted after {len(self.units)} finished; nothing kept (no --out)"
        return (
            f"interrupted: kept {len(self.units)} finished ({len(self.rows)} rows) in {self.path}; "
            "rerun the same command to resume"
        )

    def finish(self, frame: pl.DataFrame) -> None:
        """Write the output, then drop the journal; a failed write keeps the journal to resume from."""
        if self.out is None:
            return
        try:
            write_parquet(frame, self.out, overwrite=self.overwrite or self.owned)
        except OutputTaken:
            raise RankkitError(
                f"{self.out} was written by another run while this one worked; the {len(self.units)} finished "
                f"units are kept in {self.path}: move {self.out} away and rerun the same command to write it "
                "without recomputing them"
            ) from None
        except RankkitError as error:
            raise RankkitError(
                f"{error}; the {len(self.units)} finished units are kept in {self.path}: make room and "
                "rerun the same command to write it without recomputing them"
            ) from None
        self.path.unlink(missing_ok=True)
