"""The zarr store: round trips, crash safety, resume rules, concurrent writers, frames, CLI summary."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import zarr
from hypothesis import given
from hypothesis import strategies as st

from rankkit import stores
from rankkit.errors import RankkitError

LAYERS, HEADS = 4, 2
PROBES = ("fastkv", "gemfilter")

RUN_META = {
    "model": {"id": "tiny/llama", "weights_hash": "sha256:aaaa", "config": {"num_hidden_layers": LAYERS}},
    "tokenizer": {"id": "tiny/llama", "chat_template": True},
    "probes": {"fastkv": {"window": 8, "kernel": 7, "pool": "avg"}, "gemfilter": {"layer": 2}},
    "dataset": {"name": "ruler", "tasks": ["niah_single_1"], "lengths": [64]},
}


def example_data(index: int, num_tokens: int = 48, probes=PROBES):
    """Deterministic content for example ``index``, so any process can check what another wrote."""
    rng = np.random.default_rng(index)
    attrs = {
        "task": "niah_single_1" if index % 2 == 0 else "qa",
        "question": f"What is the magic number {index}?",
        "answers": [str(1000 + index)],
        "spans": {
            "context": {"chars": [0, 300], "tokens": [0, 40]},
            "needle": {"chars": [120, 140], "tokens": [17, 21]},
        },
    }
    tokens = rng.integers(0, 50_000, num_tokens)
    scores = {probe: rng.random((LAYERS, HEADS, num_tokens), dtype=np.float32) for probe in probes}
    return attrs, tokens, scores


def write(writer: stores.StoreWriter, example_id: str, index: int, **kwargs) -> None:
    attrs, tokens, scores = example_data(index, **kwargs)
    writer.write_example(example_id, attrs=attrs, tokens=tokens, scores=scores)


def assert_example_matches(store: stores.Store, example_id: str, index: int, **kwargs) -> None:
    attrs, tokens, scores = example_data(index, **kwargs)
    record = store.example(example_id)
    np.testing.assert_array_equal(record.tokens, tokens)
    assert record.tokens.dtype == np.int32
    assert record.probes == sorted(scores)
    for probe, values in scores.items():
        stored = record.scores(probe)
        assert stored.dtype == np.float32
        np.testing.assert_array_equal(stored, values)
    assert {key: record.attrs[key] for key in attrs} == attrs


class Crash(Exception):
    """Stands in for a process dying just before a completion flag is written."""


def crash_before_flag(monkeypatch):
    def crash(group, flags):
        raise Crash

    monkeypatch.setattr(stores.writer, "_mark_complete", crash)


@pytest.fixture
def path(tmp_path) -> Path:
    return tmp_path / "run.zarr"


# --- round trip -------------------------------------------------------------------------------


def test_round_trip_of_arrays_attrs_and_run_metadata(path):
    writer = stores.create(path, RUN_META)
    write(writer, "ex-0", 0)
    write(writer, "ex-1", 1, num_tokens=31)

    store = stores.open(path)
    assert len(store) == 2
    assert store.example_ids() == ["ex-0", "ex-1"]
    assert_example_matches(store, "ex-0", 0)
    assert_example_matches(store, "ex-1", 1, num_tokens=31)
    assert store.example("ex-1").num_tokens == 31
    assert store.example("ex-1").score_shape("fastkv") == (LAYERS, HEADS, 31)
    np.testing.assert_array_equal(
        store.example("ex-0").scores("fastkv", layers=[3, 1]), example_data(0)[2]["fastkv"][[3, 1]]
    )

    assert {key: store.meta[key] for key in RUN_META} == RUN_META
    assert store.meta["schema_version"] == stores.SCHEMA_VERSION
    assert store.meta["rankkit_version"] == "0.1.0"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", store.meta["created"])


def test_scores_take_lz4_and_stores_written_with_zstd_read_the_same(path, monkeypatch):
    from rankkit.stores import schema

    def codecs(example_id: str) -> dict[str, str]:
        with zipfile.ZipFile(path / "examples" / example_id / "capture.zip") as archive:
            arrays = [json.loads(archive.read(name)) | {"name": name.split("/")[-2]}
                      for name in archive.namelist() if name.endswith("/zarr.json")]  # fmt: skip
        return {
            meta["name"]: meta["codecs"][1]["configuration"]["cname"] for meta in arrays if "codecs" in meta
        }

    writer = stores.create(path, RUN_META)
    write(writer, "ex-0", 0)
    assert codecs("ex-0")["fastkv"] == "lz4" and codecs("ex-0")["tokens"] == "zstd"
    monkeypatch.setattr(
        schema, "FLOAT_COMPRESSORS", schema.INTEGER_COMPRESSORS
    )  # as stores were written before
    write(writer, "ex-1", 1)
    assert set(codecs("ex-1").values()) == {"zstd"}
    assert_example_matches(stores.open(path), "ex-1", 1)


def test_attrs_and_meta_are_stored_as_plain_json(path):
    meta = {**RUN_META, "dataset": {"lengths": (64, np.int64(128)), "seed": np.int32(3)}}
    writer = stores.create(path, meta)
    attrs = {"task": "qa", "spans": {"needle": (np.int64(3), 5)}, "score": np.float32(0.5)}
    writer.write_example("a", attrs=attrs, tokens=np.arange(4), scores={"p": np.ones((1, 1, 4))})

    store = stores.open(path)
    assert store.meta["dataset"] == {"lengths": [64, 128], "seed": 3}
    assert store.example("a").attrs == {
        "task": "qa",
        "spans": {"needle": [3, 5]},
        "score": 0.5,
        "complete": True,
    }
    # a tuple in the new run metadata equals the list it was stored as, so resuming works
    assert stores.create(path, meta).is_complete("a")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tokens": np.zeros((2, 3), dtype=np.int64)}, "1-D integer"),
        ({"tokens": np.array([0.5, 1.5])}, "1-D integer"),
        ({"tokens": np.array([-1, 2])}, r"ids in \[0, 2\*\*31\)"),
        ({"scores": {"p": np.zeros((2, 3))}}, "3-D"),
        ({"scores": {"p": np.zeros((2, 1, 5))}}, r"expected \[layers, kv_heads, 3\]"),
        ({"attrs": {"complete": True}}, "sets those flags itself"),
        ({"attrs": {"when": object()}}, "JSON values"),
    ],
)
def test_bad_example_input_is_refused_before_anything_is_written(path, kwargs, message):
    writer = stores.create(path, RUN_META)
    arguments = {"attrs": {}, "tokens": np.arange(3), "scores": {"p": np.zeros((1, 1, 3))}, **kwargs}
    with pytest.raises(RankkitError, match=message):
        writer.write_example("x", **arguments)
    assert stores.open(path).example_ids(complete_only=False) == []


# --- example ids ------------------------------------------------------------------------------


@given(st.text(min_size=1, max_size=16))  # 16 four-byte characters still fit a file name
def test_name_encoding_round_trips_to_a_safe_file_name(name):
    encoded = stores.encode_name(name)
    assert stores.decode_name(encoded) == name
    assert re.fullmatch(r"[a-z0-9%][a-z0-9_.%-]*", encoded)


def test_ids_unsafe_for_paths_are_stored_and_listed_as_given(path):
    ids = ["ruler/niah:0001", "..", ".", "A", "a", "__meta", "50% off", "日本/é", "-x"]
    writer = stores.create(path, RUN_META)
    for index, example_id in enumerate(ids):
        write(writer, example_id, index)

    # one directory per id, even on a case-insensitive file system
    names = [entry.name for entry in (path / "examples").iterdir() if entry.is_dir()]
    assert len({name.lower() for name in names}) == len(ids)
    store = stores.open(path)
    assert sorted(store.example_ids()) == sorted(ids)
    for index, example_id in enumerate(ids):
        assert_example_matches(store, example_id, index)


def test_ids_are_listed_in_natural_order(path):
    writer = stores.create(path, RUN_META)
    for index, example_id in enumerate(["q:10", "q:9", "p", "q:100"]):
        write(writer, example_id, index)
    assert stores.open(path).example_ids() == ["p", "q:9", "q:10", "q:100"]


def test_an_id_too_long_for_a_file_name_is_refused(path):
    writer = stores.create(path, RUN_META)
    with pytest.raises(RankkitError, match="too long"):
        write(writer, "/" * 100, 0)


# --- resume, crashes, overwrite ---------------------------------------------------------------


def test_resume_skips_complete_examples_and_refuses_to_rewrite_them(path):
    write(stores.create(path, RUN_META), "done", 0)

    writer = stores.create(path, RUN_META)
    assert writer.is_complete("done")
    assert not writer.is_complete("todo")
    with pytest.raises(RankkitError, match="already complete.*--overwrite"):
        write(writer, "done", 5)
    assert_example_matches(stores.open(path), "done", 0)


def test_an_interrupted_example_is_not_trusted_and_is_redone(path, monkeypatch):
    writer = stores.create(path, RUN_META)
    write(writer, "kept", 0)
    with monkeypatch.context() as patch:
        crash_before_flag(patch)
        with pytest.raises(Crash):
            write(writer, "crashed", 1, probes=("fastkv", "stale_probe"))

    store = stores.open(path)
    assert store.example_ids() == ["kept"]
    assert store.example_ids(complete_only=False) == ["crashed", "kept"]
    with pytest.raises(RankkitError, match="incomplete.*rerun"):
        store.example("crashed")
    assert store.examples_frame(complete_only=False).select("id", "complete").rows() == [
        ("crashed", False),
        ("kept", True),
    ]

    writer = stores.create(path, RUN_META)
    assert not writer.is_complete("crashed")
    write(writer, "crashed", 2, num_tokens=20)
    assert_example_matches(stores.open(path), "crashed", 2, num_tokens=20)  # no stale probe survives
    assert_example_matches(stores.open(path), "kept", 0)


# Writes one example and stops for good after its arrays are on disk and before the
# complete flag, so the parent can SIGKILL it at exactly that point.
_HANG_BEFORE_FLAG = """
import sys, time
import numpy as np
from rankkit import stores

def hang(group, flags):
    print("arrays written", flush=True)
    time.sleep(600)

stores.writer._mark_complete = hang
tokens = np.arange(5000)
scores = {"fastkv": np.ones((30, 3, 5000), dtype=np.float32)}
w = stores.create(sys.argv[1], {"model": {"id": "m", "weights_hash": "h"}})
w.write_example("victim", attrs={"task": "qa"}, tokens=tokens, scores=scores)
"""

# Writes examples 0, 1, 2, ... forever, reporting each one once it is complete; the
# parent SIGKILLs it at an arbitrary moment in the middle of some write.
_WRITE_FOREVER = """
import itertools, sys
import numpy as np
from rankkit import stores

w = stores.create(sys.argv[1], {"model": {"id": "m", "weights_hash": "h"}})
for index in itertools.count():
    rng = np.random.default_rng(index)
    scores = {p: rng.random((30, 3, 2000), dtype=np.float32) for p in ("a", "b", "c")}
    w.write_example(f"ex:{index}", attrs={"index": index}, tokens=np.arange(2000) + index, scores=scores)
    print(index, flush=True)
"""


def _start(script: str, path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), str(path)], stdout=subprocess.PIPE, text=True
    )


def test_sigkill_between_arrays_and_flag_leaves_an_incomplete_example_that_is_redone(path):
    child = _start(_HANG_BEFORE_FLAG, path)
    try:
        assert child.stdout.readline().strip() == "arrays written"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert (path / "examples" / "victim" / "capture.zip").is_file()

    assert stores.open(path).example_ids(complete_only=False) == ["victim"]
    assert stores.open(path).example_ids() == []
    writer = stores.create(path, {"model": {"id": "m", "weights_hash": "h"}})
    assert not writer.is_complete("victim")
    writer.write_example(
        "victim", attrs={"task": "qa"}, tokens=np.arange(7), scores={"p": np.ones((1, 1, 7))}
    )
    record = stores.open(path).example("victim")
    np.testing.assert_array_equal(record.tokens, np.arange(7))
    assert record.probes == ["p"]


def test_sigkill_at_an_arbitrary_moment_loses_only_the_example_being_written(path):
    child = _start(_WRITE_FOREVER, path)
    try:
        reported = [int(child.stdout.readline()) for _ in range(3)]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)

    store = stores.open(path)
    complete = store.example_ids()
    assert set(complete) >= {f"ex:{index}" for index in reported}
    assert len(store.example_ids(complete_only=False)) - len(complete) <= 1
    for example_id in complete:
        index = int(example_id.split(":")[1])
        record = store.example(example_id)
        np.testing.assert_array_equal(record.tokens, np.arange(2000) + index)
        rng = np.random.default_rng(index)
        for probe in ("a", "b", "c"):
            np.testing.assert_array_equal(record.scores(probe), rng.random((30, 3, 2000), dtype=np.float32))


_DRAFT = {"lookahead": np.arange(12, dtype=np.float32).reshape(3, 4)}


def _capture_with_oracle_and_group(writer: stores.StoreWriter) -> None:
    """Write what a capture with ``--oracle`` and a draft writes, skipping what is already whole:
    the same steps run uninterrupted, or resume a store a crash left."""
    for example_id, index in (("a", 0), ("b", 1)):
        if not writer.is_complete(example_id):
            write(writer, example_id, index)
        if not writer.has_oracle(example_id):
            oracle, oracle_layers = _oracle(seed=index)
            writer.add_oracle(example_id, oracle=oracle, oracle_layers=oracle_layers, attrs={"correct": True})
        if not writer.has_group(example_id, "draft_scores"):
            writer.add_arrays(example_id, "draft_scores", _DRAFT, {"k": 3})


def _assert_whole(store: stores.Store, example_id: str) -> None:
    """A complete example reads back exactly as written, with its oracle and group when flagged."""
    index = {"a": 0, "b": 1}[example_id]
    assert_example_matches(store, example_id, index)
    record = store.example(example_id)
    if record.has_oracle:
        oracle, oracle_layers = _oracle(seed=index)
        np.testing.assert_array_equal(record.oracle, oracle.astype(np.float32))
        np.testing.assert_array_equal(record.oracle_layers, oracle_layers.astype(np.float32))
        assert record.attrs["correct"] is True
    assert record.groups in ([], ["draft_scores"])
    if record.groups:
        np.testing.assert_array_equal(record.group("draft_scores")["lookahead"], _DRAFT["lookahead"])


def test_every_state_a_crash_can_leave_reads_whole_or_absent_and_resumes(path, tmp_path, monkeypatch):
    """The store copied just before and just after each file replace of a capture, its oracles and
    an added group: each copy is what a process killed at that moment leaves. Every one reads
    whole-or-absent, verifies clean, and resumes to the store of an uninterrupted run (a flag
    written apart from the manifest it vouches for made a resumed capture crash)."""
    snapshots: list[Path] = []
    replace = os.replace

    def snapshot() -> None:
        copy = tmp_path / "snapshots" / str(len(snapshots))
        # zarr's own temporaries come and go on its worker threads meanwhile; no reader opens them
        shutil.copytree(path, copy, ignore=shutil.ignore_patterns("*.lock", "*.partial"))
        snapshots.append(copy)

    def replace_between_snapshots(source, target):
        if str(target).startswith(str(path) + os.sep):
            snapshot()
            replace(source, target)
            snapshot()
        else:
            replace(source, target)

    writer = stores.create(path, RUN_META)
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", replace_between_snapshots)
        _capture_with_oracle_and_group(writer)
    assert len(snapshots) >= 2 * 6  # two captures, two oracles, two groups, each a zip and a flag

    for copy in snapshots:
        store = stores.open(copy)
        for example_id in store.example_ids():
            _assert_whole(store, example_id)
        counts = stores.verify(copy).counts()
        assert counts["damaged"] == counts["unreadable"] == counts["mismatched"] == 0, copy.name
        _capture_with_oracle_and_group(stores.create(copy, RUN_META))
        resumed = stores.open(copy)
        assert resumed.example_ids() == ["a", "b"]
        for example_id in ("a", "b"):
            _assert_whole(resumed, example_id)
            record = resumed.example(example_id)
            assert record.has_oracle and record.groups == ["draft_scores"], (copy.name, example_id)


def test_overwrite_replaces_the_store_and_its_run_metadata(path):
    write(stores.create(path, RUN_META), "old", 0)
    new_meta = {**RUN_META, "model": {**RUN_META["model"], "weights_hash": "sha256:bbbb"}}

    writer = stores.create(path, new_meta, overwrite=True)
    assert not writer.is_complete("old")
    write(writer, "new", 1)
    store = stores.open(path)
    assert store.example_ids(complete_only=False) == ["new"]
    assert store.meta["model"]["weights_hash"] == "sha256:bbbb"


def test_overwrite_refuses_to_delete_a_directory_that_is_not_a_store(tmp_path):
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(RankkitError, match="is not a rankkit store; refusing to delete it"):
        stores.create(tmp_path, RUN_META, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "precious"


@pytest.mark.parametrize("inside", ["examples/notes.txt", "examples/a/notes.txt"])
def test_overwrite_refuses_a_store_holding_a_file_of_yours_among_its_examples(path, inside):
    """Only the store's top folder was looked at: a file of one's own among the examples was deleted."""
    writer = stores.create(path, RUN_META)
    write(writer, "a", 0)
    (path / "examples" / "b").mkdir()
    (path / "examples" / "b" / ".zarr.json.partial").write_text("")  # what a kill leaves is the store's own
    (path / inside).write_text("mine")
    with pytest.raises(RankkitError, match=f"^{path} holds {path / inside}, which rankkit did not write; refusing"):
        stores.create(path, RUN_META, overwrite=True)
    assert (path / inside).read_text() == "mine" and stores.open(path).example_ids() == ["a"]
    (path / inside).unlink()
    assert stores.create(path, RUN_META, overwrite=True).example_attrs("a") == {}


def test_an_overwrite_killed_while_it_deletes_the_old_store_leaves_none_half_deleted(path, monkeypatch):
    """A kill midway through deleting the old store (its zarr.json gone first, its examples not yet)
    left a folder that was no store: every command refused it, --overwrite too."""
    write(stores.create(path, RUN_META), "old", 0)
    delete = shutil.rmtree

    def killed_midway(target, *args, **kwargs):
        (Path(target) / "zarr.json").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        stores.create(path, RUN_META, overwrite=True)
    monkeypatch.setattr(shutil, "rmtree", delete)
    assert not path.exists()
    write(stores.create(path, RUN_META, overwrite=True), "new", 1)
    assert stores.open(path).example_ids(complete_only=False) == ["new"]
    assert sorted(entry.name for entry in path.parent.iterdir()) == [path.name]  # the killed deletion's leftover too


def test_an_empty_directory_becomes_a_store(tmp_path):
    write(stores.create(tmp_path, RUN_META), "a", 0)
    assert stores.open(tmp_path).example_ids() == ["a"]


@pytest.mark.parametrize(
    "change, named",
    [
        (
            {"model": {**RUN_META["model"], "weights_hash": "sha256:bbbb"}},
            "model.weights_hash: 'sha256:aaaa' in the store, 'sha256:bbbb' now",
        ),
        (
            {"probes": {**RUN_META["probes"], "fastkv": {"window": 32, "kernel": 7, "pool": "avg"}}},
            "probes.fastkv.window: 8 in the store, 32 now",
        ),
        (
            {"probes": {"fastkv": RUN_META["probes"]["fastkv"]}},
            "probes.gemfilter: {'layer': 2} in the store, absent now",
        ),
    ],
)
def test_resuming_with_a_different_run_fails_naming_the_difference(path, change, named):
    write(stores.create(path, RUN_META), "a", 0)
    with pytest.raises(RankkitError) as raised:
        stores.create(path, {**RUN_META, **change})
    message = str(raised.value)
    assert named in message
    assert "--overwrite" in message and "\n" not in message
    assert (
        stores.create(path, {**RUN_META, **change}, overwrite=True).meta["probes"]
        == {**RUN_META, **change}["probes"]
    )


def test_resume_ignores_the_keys_the_store_sets_itself(path):
    write(stores.create(path, RUN_META), "a", 0)
    # e.g. a rerun that starts from the stored metadata, creation time included
    assert stores.create(path, stores.open(path).meta | {"created": "yesterday"}).is_complete("a")


# --- unreadable stores ------------------------------------------------------------------------


def _one_line_error(action) -> str:
    with pytest.raises(RankkitError) as raised:
        action()
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_a_store_from_a_newer_schema_is_refused_with_the_fix(path):
    write(stores.create(path, RUN_META), "a", 0)
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["schema_version"] = stores.SCHEMA_VERSION + 1
    (path / "zarr.json").write_text(json.dumps(root))

    for action in (lambda: stores.open(path), lambda: stores.create(path, RUN_META)):
        message = _one_line_error(action)
        assert f"schema version {stores.SCHEMA_VERSION + 1}, newer than this rankkit reads" in message
        assert "pip install -U rankkit" in message


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{ garbage", "its zarr.json is not JSON"),
        (b"\xff\xfe", "its zarr.json is not JSON"),
        ("[]", "its zarr.json is not a JSON object"),
        ('{"zarr_format": 3, "node_type": "array"}', "its zarr.json's node_type is 'array', not 'group'"),
        ('{"zarr_format": 3}', "its zarr.json's node_type is None, not 'group'"),
    ],
)
def test_a_corrupt_root_is_refused_with_the_fix(path, content, problem):
    write(stores.create(path, RUN_META), "a", 0)
    (path / "zarr.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    for action in (lambda: stores.open(path), lambda: stores.create(path, RUN_META)):
        assert _one_line_error(action) == f"store {path} is corrupt ({problem}); recapture it with --overwrite"


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ({"num_layers": -3}, "num_layers is -3, not a positive count"),
        ({"kv_heads": "x"}, "kv_heads is 'x', not a positive count"),
        ({"model": "m"}, "model is 'm', not a mapping"),
        ({"model": {"id": "m", "weights_hash": 5}}, "model.weights_hash is 5, not a hash"),
        ({"model": {"id": ["m"]}}, "model.id is ['m'], not a name"),
    ],
)
def test_run_metadata_the_examples_are_checked_against_is_refused_when_malformed(path, damage, problem):
    """Each example is checked against the store's model, layer and head counts; a malformed one
    was a TypeError traceback on the first example read (weights_hash 5) or compared nothing. A
    store created before its metadata had digests is checked so."""
    write(stores.create(path, RUN_META), "a", 0)
    edit_root(path, lambda attrs: (as_before_digests(attrs), attrs.update(damage)))
    assert _one_line_error(lambda: stores.open(path)) == (
        f"store {path} is corrupt ({problem}); recapture it with --overwrite"
    )


def as_before_digests(attrs: dict) -> None:
    """Root attributes as rankkit wrote them before a store's metadata had digests: schema version 2."""
    del attrs["manifest"]
    attrs["schema_version"] = 2


def edit_root(path: Path, edit) -> None:
    """Apply ``edit`` to the store's root attributes, in its zarr.json, as a hand edit would."""
    root = json.loads((path / "zarr.json").read_text())
    edit(root["attributes"])
    (path / "zarr.json").write_text(json.dumps(root))


@pytest.mark.parametrize(
    ("edit", "changed"),
    [
        (lambda attrs: attrs["model"].update(id="Llama-3-8B"), "model"),
        (lambda attrs: attrs["dataset"].update(lengths=[128]), "dataset"),
        (lambda attrs: attrs["probes"].pop("gemfilter"), "probes"),
        (lambda attrs: attrs.pop("tokenizer"), "tokenizer"),
    ],
)
def test_run_metadata_edited_after_it_was_written_is_refused_by_every_reader_and_verify(path, edit, changed):
    write(stores.create(path, RUN_META), "a", 0)
    edit_root(path, edit)
    refusal = (
        f"store {path} is corrupt (its metadata was changed after it was written ({changed} in its zarr.json)); "
        "recapture it with --overwrite"
    )
    assert _one_line_error(lambda: stores.open(path)) == refusal
    assert _one_line_error(lambda: stores.verify(path)) == refusal
    verify = subprocess.run(
        [sys.executable, "-m", "rankkit.cli", "store", "verify", str(path)], capture_output=True, text=True
    )
    assert (verify.returncode, verify.stdout, verify.stderr) == (2, "", f"rankkit: error: {refusal}\n")


def test_a_store_created_before_its_metadata_had_digests_reads_and_resumes_as_before(path):
    write(stores.create(path, RUN_META), "a", 0)
    edit_root(path, as_before_digests)
    assert stores.open(path).meta["model"] == RUN_META["model"]
    assert stores.verify(path).counts()["good"] == 1
    write(stores.create(path, RUN_META), "b", 1)
    assert_example_matches(stores.open(path), "b", 1)
    resumed = stores.open(path).meta
    # A resume vouches for nothing it did not write: neither a manifest nor the version that requires one.
    assert "manifest" not in resumed and resumed["schema_version"] == 2


def test_a_current_store_without_its_manifest_is_refused_so_its_edited_metadata_is_not_read(path):
    """Removing the manifest along with an edit hid the edit: store verify counted the examples good
    and store info printed the edited settings, as for a store created before the digests."""
    write(stores.create(path, RUN_META), "a", 0)
    edit_root(path, lambda attrs: (attrs.pop("manifest"), attrs["model"].update(id="Llama-3-8B")))
    refusal = (
        f"store {path} is corrupt (its zarr.json has no manifest, which every store of schema version "
        f"{stores.SCHEMA_VERSION} holds); recapture it with --overwrite"
    )
    assert _one_line_error(lambda: stores.open(path)) == refusal
    for command in ("verify", "info"):
        result = subprocess.run(
            [sys.executable, "-m", "rankkit.cli", "store", command, str(path)], capture_output=True, text=True
        )
        assert (result.returncode, result.stdout, result.stderr) == (2, "", f"rankkit: error: {refusal}\n")


def test_a_corrupt_example_is_refused_by_readers_and_redone_by_the_capture(path):
    writer = stores.create(path, RUN_META)
    write(writer, "a", 0)
    (path / "examples" / "a" / "zarr.json").write_text("{ garbage")
    assert "example 'a' " in _one_line_error(lambda: stores.open(path).example_ids())
    assert not writer.is_complete("a")
    write(writer, "a", 1)
    assert_example_matches(stores.open(path), "a", 1)


def test_missing_paths_and_non_stores_are_refused(tmp_path):
    assert "no store at" in _one_line_error(lambda: stores.open(tmp_path / "nope.zarr"))
    assert "not a rankkit store (no zarr.json)" in _one_line_error(lambda: stores.open(tmp_path))
    (tmp_path / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    assert "zarr group but not a rankkit store" in _one_line_error(lambda: stores.open(tmp_path))


def test_unknown_examples_and_probes_are_named(path):
    write(stores.create(path, RUN_META), "a", 0)
    store = stores.open(path)
    assert "has no example 'b'" in _one_line_error(lambda: store.example("b"))
    assert "no scores for probe 'nope' (it has fastkv, gemfilter)" in _one_line_error(
        lambda: store.example("a").scores("nope")
    )
    assert "no example in" in _one_line_error(lambda: store.scores_frame("nope"))
    assert "out of range" in _one_line_error(lambda: store.scores_frame(layers=[LAYERS]))


# --- concurrent writers -----------------------------------------------------------------------


def _write_examples(path: str, indices: list[int], start, rank: int) -> None:
    start.wait()  # both processes create (or find) the store and write at the same moment
    writer = stores.create(path, RUN_META, rank=rank)  # two ranks of one launch
    for index in indices:
        write(writer, f"ex:{index}", index, num_tokens=2000)


def test_two_processes_writing_one_store_at_once_lose_nothing(tmp_path):
    path = tmp_path / "run.zarr"
    context = multiprocessing.get_context("spawn")  # zarr runs an event-loop thread; forking it is unsafe
    start = context.Barrier(2)
    shares = [list(range(0, 24, 2)), list(range(1, 24, 2))]
    processes = [
        context.Process(target=_write_examples, args=(str(path), share, start, rank))
        for rank, share in enumerate(shares)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0

    store = stores.open(path)
    assert store.example_ids(complete_only=False) == [f"ex:{index}" for index in range(24)]
    for index in range(24):
        assert_example_matches(store, f"ex:{index}", index, num_tokens=2000)
    assert [entry.name for entry in tmp_path.iterdir()] == ["run.zarr"]  # the losing creator cleaned up


# --- later additions --------------------------------------------------------------------------


def _oracle(num_tokens: int = 48, seed: int = 7):
    rng = np.random.default_rng(seed)
    return rng.random(num_tokens), rng.random((LAYERS, num_tokens))


def test_add_oracle_round_trip_merges_attrs(path):
    writer = stores.create(path, RUN_META)
    write(writer, "a", 0)
    write(writer, "b", 1)
    oracle, oracle_layers = _oracle()
    writer.add_oracle(
        "a", oracle=oracle, oracle_layers=oracle_layers, attrs={"prediction": "1000", "correct": True}
    )

    assert writer.has_oracle("a") and not writer.has_oracle("b")
    record = stores.open(path).example("a")
    np.testing.assert_array_equal(record.oracle, oracle.astype(np.float32))
    np.testing.assert_array_equal(record.oracle_layers, oracle_layers.astype(np.float32))
    assert record.attrs["prediction"] == "1000" and record.attrs["correct"] is True
    assert record.attrs["task"] == "niah_single_1"
    assert stores.open(path).example("b").oracle is None
    assert stores.open(path).example("b").oracle_layers is None


def test_an_interrupted_oracle_leaves_the_capture_intact_and_the_oracle_absent(path, monkeypatch):
    writer = stores.create(path, RUN_META)
    write(writer, "a", 0)
    first, first_layers = _oracle(seed=1)
    writer.add_oracle("a", oracle=first, oracle_layers=first_layers, attrs={"correct": True})

    second, second_layers = _oracle(seed=2)
    with monkeypatch.context() as patch:
        crash_before_flag(patch)
        with pytest.raises(Crash):  # replacing the first oracle dies after the new arrays
            writer.add_oracle("a", oracle=second, oracle_layers=second_layers, attrs={"correct": False})

    store = stores.open(path)
    assert_example_matches(store, "a", 0)
    record = store.example("a")
    assert record.oracle is None and not record.has_oracle
    assert not writer.has_oracle("a")

    writer.add_oracle("a", oracle=second, oracle_layers=second_layers, attrs={"correct": False})
    record = stores.open(path).example("a")
    np.testing.assert_array_equal(record.oracle, second.astype(np.float32))
    assert record.attrs["correct"] is False


def test_add_oracle_needs_a_captured_example_and_matching_lengths(path, monkeypatch):
    writer = stores.create(path, RUN_META)
    oracle, oracle_layers = _oracle()
    with pytest.raises(RankkitError, match="not captured.*capture it before adding its oracle"):
        writer.add_oracle("ghost", oracle=oracle, oracle_layers=oracle_layers, attrs={})
    write(writer, "a", 0)
    with pytest.raises(RankkitError, match="covers 47 tokens but the example has 48"):
        writer.add_oracle("a", oracle=oracle[:-1], oracle_layers=oracle_layers, attrs={})
    with pytest.raises(RankkitError, match="sets those flags itself"):
        writer.add_oracle("a", oracle=oracle, oracle_layers=oracle_layers, attrs={"oracle_complete": True})


def test_add_arrays_round_trip_and_interruption(path, monkeypatch):
    writer = stores.create(path, RUN_META)
    write(writer, "a", 0)
    draft = {"lookahead/max": np.arange(12, dtype=np.float32).reshape(3, 4), "ids": np.arange(5)}
    writer.add_arrays("a", "draft_scores", draft, {"draft_model": "tiny", "k": 8})
    with monkeypatch.context() as patch:
        crash_before_flag(patch)
        with pytest.raises(Crash):
            writer.add_arrays("a", "half_written", {"x": np.ones(3)}, {})

    reopened = stores.create(path, RUN_META)  # what a resumed capture asks before redoing a group
    assert reopened.has_group("a", "draft_scores") and writer.has_group("a", "draft_scores")
    assert not reopened.has_group("a", "half_written") and not reopened.has_group("a", "other")
    record = stores.open(path).example("a")
    assert record.groups == ["draft_scores"]
    group = record.group("draft_scores")
    assert group.attrs == {"draft_model": "tiny", "k": 8}
    assert group.names == ["ids", "lookahead/max"]
    np.testing.assert_array_equal(group["lookahead/max"], draft["lookahead/max"])
    np.testing.assert_array_equal(group["ids"], np.arange(5))
    with pytest.raises(RankkitError, match="no complete group 'half_written'"):
        record.group("half_written")
    with pytest.raises(RankkitError, match="part of the example layout"):
        writer.add_arrays("a", "scores", {"x": np.ones(3)}, {})


# --- frames -----------------------------------------------------------------------------------


@pytest.fixture
def filled(path) -> stores.Store:
    """Three examples of different lengths; the oracle on the first and the last."""
    writer = stores.create(path, RUN_META)
    for index, num_tokens in enumerate((48, 30, 12)):
        write(writer, f"ex:{index}", index, num_tokens=num_tokens)
    for index, num_tokens in ((0, 48), (2, 12)):
        oracle, oracle_layers = _oracle(num_tokens, seed=index)
        writer.add_oracle(
            f"ex:{index}", oracle=oracle, oracle_layers=oracle_layers, attrs={"correct": index == 0}
        )
    return stores.open(path)


def test_examples_frame(filled):
    frame = filled.examples_frame()
    assert frame.columns[:6] == ["id", "complete", "task", "num_tokens", "has_oracle", "correct"]
    assert "question" in frame.columns and "answers" not in frame.columns and "spans" not in frame.columns
    assert frame.schema["id"] == pl.Categorical and frame.schema["num_tokens"] == pl.Int32
    assert frame.select("id", "task", "num_tokens", "has_oracle", "correct").rows() == [
        ("ex:0", "niah_single_1", 48, True, True),
        ("ex:1", "qa", 30, False, None),
        ("ex:2", "niah_single_1", 12, True, False),
    ]
    assert frame["question"].to_list() == [f"What is the magic number {index}?" for index in range(3)]


def test_scores_frame_sums_heads_by_default(filled):
    frame = filled.scores_frame()
    assert frame.columns == ["example", "probe", "layer", "token", "score"]
    assert dict(frame.schema) == {
        "example": pl.Categorical,
        "probe": pl.Categorical,
        "layer": pl.Int32,
        "token": pl.Int32,
        "score": pl.Float32,
    }
    assert frame.height == len(PROBES) * LAYERS * (48 + 30 + 12)
    expected = example_data(1, num_tokens=30)[2]["gemfilter"].sum(axis=1)  # [layers, T]
    cell = frame.filter((pl.col("example") == "ex:1") & (pl.col("probe") == "gemfilter")).sort(
        "layer", "token"
    )
    np.testing.assert_allclose(cell["score"].to_numpy().reshape(LAYERS, 30), expected, rtol=1e-6)


def test_scores_frame_per_head_for_one_probe_and_some_layers(filled):
    frame = filled.scores_frame("fastkv", reduce=None, examples=["ex:2"], layers=[3, 0])
    assert frame.columns == ["example", "probe", "layer", "head", "token", "score"]
    scores = example_data(2, num_tokens=12)[2]["fastkv"]
    assert frame.height == 2 * HEADS * 12
    for layer, head, token, score in frame.select("layer", "head", "token", "score").iter_rows():
        assert score == scores[layer, head, token]
    assert set(frame["layer"]) == {0, 3}
    assert frame["probe"].unique().to_list() == ["fastkv"]

    maxed = filled.scores_frame("fastkv", reduce="max", examples=["ex:2"])
    np.testing.assert_array_equal(maxed["score"].to_numpy().reshape(LAYERS, 12), scores.max(axis=1))


def test_scores_frames_come_one_example_at_a_time(filled):
    frames = list(filled.iter_scores_frames("fastkv"))
    assert [frame["example"].unique().to_list() for frame in frames] == [["ex:0"], ["ex:1"], ["ex:2"]]


def test_oracle_frames(filled):
    frame = filled.oracle_frame()
    assert frame.columns == ["example", "token", "oracle"]
    assert frame["example"].unique(maintain_order=True).to_list() == ["ex:0", "ex:2"]
    oracle, oracle_layers = _oracle(12, seed=2)
    last = frame.filter(pl.col("example") == "ex:2")
    np.testing.assert_array_equal(last["token"].to_numpy(), np.arange(12))
    np.testing.assert_array_equal(last["oracle"].to_numpy(), oracle.astype(np.float32))

    layered = filled.oracle_layers_frame(examples=["ex:2"], layers=[1])
    assert layered.columns == ["example", "layer", "token", "oracle"]
    np.testing.assert_array_equal(layered["oracle"].to_numpy(), oracle_layers[1].astype(np.float32))

    # frames of one store join without casts
    joined = filled.scores_frame("fastkv").join(frame, on=["example", "token"])
    assert joined.height == LAYERS * (48 + 12)


def test_frames_of_an_empty_store_have_their_columns(path):
    stores.create(path, RUN_META)
    store = stores.open(path)
    assert len(store) == 0
    assert store.scores_frame().columns == ["example", "probe", "layer", "token", "score"]
    assert store.scores_frame(reduce=None).columns == ["example", "probe", "layer", "head", "token", "score"]
    assert store.oracle_frame().columns == ["example", "token", "oracle"]
    assert store.examples_frame().columns == ["id", "complete", "task", "num_tokens", "has_oracle", "correct"]


# --- summary and CLI --------------------------------------------------------------------------


def test_describe_counts_what_the_store_holds(filled, monkeypatch):
    writer = stores.create(filled.path, RUN_META)
    writer.add_arrays("ex:1", "draft_scores", {"x": np.ones(3)}, {})
    with monkeypatch.context() as patch:
        crash_before_flag(patch)
        with pytest.raises(Crash):
            write(writer, "ex:3", 3)

    summary = stores.describe(filled.path)
    assert summary["examples"] == {"complete": 3, "incomplete": 1, "with_oracle": 2}
    assert summary["tasks"] == {"niah_single_1": 2, "qa": 1}
    assert summary["probes"]["fastkv"] == {
        "examples": 3,
        "layers": [LAYERS],
        "kv_heads": [HEADS],
        "tokens_min": 12,
        "tokens_max": 48,
    }
    assert summary["groups"] == {"draft_scores": 1}
    assert summary["run_meta"] == RUN_META
    assert summary["schema_version"] == stores.SCHEMA_VERSION
    json.dumps(summary)  # plain JSON values only


def test_cli_store_info(filled):
    from typer.testing import CliRunner

    from rankkit.cli import store_cmd  # noqa: F401  (registers the command)
    from rankkit.cli.app import app

    runner = CliRunner()
    as_json = runner.invoke(app, ["store", "info", str(filled.path), "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.output) == stores.describe(filled.path)
    assert runner.invoke(app, ["store", "info", str(filled.path), "--format", "json"]).output == as_json.output
    as_csv = runner.invoke(app, ["store", "info", str(filled.path), "--format", "csv"])
    assert as_csv.exit_code == 0, as_csv.output
    lines = as_csv.output.splitlines()
    assert lines[0] == "key,value"
    assert {"examples.complete,3", "examples.with_oracle,2", "probes.fastkv.tokens_min,12", "groups,{}"} <= set(lines)
    assert f"run_meta.model.config.num_hidden_layers,{LAYERS}" in lines
    assert 'run_meta.dataset.tasks,"[""niah_single_1""]"' in lines

    tables = runner.invoke(app, ["store", "info", str(filled.path)], env={"COLUMNS": "160"})
    assert tables.exit_code == 0, tables.output
    for text in (
        "sha256:aaaa",
        "Probes: scores [layers, kv_heads, tokens]",
        "fastkv",
        "12–48",
        "with oracle",
        "task qa",
    ):
        assert text in tables.output


def test_cli_store_info_reads_without_torch(filled):
    """Inspecting a store is a glance, not a model run: importing torch alone would take it from under a
    second to three."""
    script = (
        "import atexit, sys; atexit.register(lambda: print('torch' in sys.modules, file=sys.stderr)); "
        f"sys.argv = ['rankkit', 'store', 'info', {str(filled.path)!r}]; from rankkit.cli import main; main()"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0 and "fastkv" in result.stdout, result.stderr
    assert result.stderr == "False\n"


def test_cli_store_info_on_a_bad_path_exits_2_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rankkit.cli", "store", "info", str(tmp_path / "missing.zarr")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert (
        result.stderr
        == f"rankkit: error: no store at {tmp_path / 'missing.zarr'}; check the path or capture into it first\n"
    )


# --- verification: a damaged array never reads as data ------------------------------------------


@pytest.fixture
def oracled(path) -> Path:
    """Two examples with oracles."""
    writer = stores.create(path, RUN_META)
    for index, example_id in enumerate(("a", "b")):
        write(writer, example_id, index)
        oracle, oracle_layers = _oracle()
        writer.add_oracle(example_id, oracle=oracle, oracle_layers=oracle_layers, attrs={"answer": "x"})
    return path


def read_error(path: Path, read) -> str:
    with pytest.raises(RankkitError) as caught:
        read(stores.open(path).example("a"))
    return str(caught.value)


def flip_byte_inside(zip_path: Path, member: str) -> None:
    """Alter one byte of a member's data, keeping the file's size."""
    with zipfile.ZipFile(zip_path) as archive:
        info = archive.getinfo(member)
    data = bytearray(zip_path.read_bytes())
    data[info.header_offset + 30 + len(info.filename) + len(info.extra) + info.compress_size // 2] ^= 0xFF
    zip_path.write_bytes(bytes(data))


def test_an_example_is_three_files_and_four_with_an_added_group(oracled):
    stores.create(oracled, RUN_META).add_arrays("a", "draft_scores", {"lookahead": np.ones((2, 48))}, {})
    files = sorted(file.name for file in (oracled / "examples" / "a").rglob("*") if file.is_file())
    assert files == ["capture.zip", "draft_scores.zip", "oracle.zip", "zarr.json"]


def test_a_deleted_capture_file_fails_naming_example_array_and_fix(oracled):
    (oracled / "examples" / "a" / "capture.zip").unlink()
    message = read_error(oracled, lambda record: record.scores("fastkv"))
    assert message == (
        f"example 'a' in {oracled}: array scores/fastkv is damaged (capture.zip is missing); "
        f"run `rankkit store verify {oracled} --reset`, then rerun the capture into {oracled}"
    )
    assert_example_matches(stores.open(oracled), "b", 1)


def test_a_truncated_oracle_file_fails_naming_the_oracle_command(oracled):
    file = oracled / "examples" / "a" / "oracle.zip"
    size = file.stat().st_size
    file.write_bytes(file.read_bytes()[: size // 2])
    message = read_error(oracled, lambda record: record.oracle)
    assert f"array oracle is damaged (oracle.zip has {size // 2} bytes, {size} were written)" in message
    assert message.endswith(f"then `rankkit oracle {oracled}`")


def test_an_altered_array_metadata_or_chunk_fails_on_read(oracled):
    capture = oracled / "examples" / "a" / "capture.zip"
    flip_byte_inside(capture, "tokens/zarr.json")
    assert "array tokens is damaged (does not decode: Bad CRC-32" in read_error(
        oracled, lambda record: record.tokens
    )
    flip_byte_inside(oracled / "examples" / "a" / "oracle.zip", "oracle_layers/c/0/0")
    assert "array oracle_layers is damaged (does not decode: Bad CRC-32" in read_error(
        oracled, lambda record: record.oracle_layers
    )


@pytest.mark.parametrize(
    ("damage", "detail"),
    [
        (lambda metadata: metadata.write_bytes(metadata.read_bytes()[:100]), "its zarr.json does not parse"),
        (lambda metadata: metadata.unlink(), "its zarr.json is missing"),
    ],
)
def test_an_example_whose_metadata_is_truncated_or_deleted_stops_every_reader(oracled, damage, detail):
    """No write leaves an example's zarr.json cut short, nor its arrays without one (it is written
    first, each time whole): either is damage, refused as a damaged array is, not left out."""
    damage(oracled / "examples" / "a" / "zarr.json")
    refusal = f"example 'a' in {oracled} is unreadable ({detail}); rerun the capture into {oracled} to redo it"
    store = stores.open(oracled)
    for read in (store.example_ids, store.skipped, store.warn_skipped, store.scores_frame, lambda: store.example("a")):
        assert _one_line_error(read) == refusal
    assert [record.id for record in store.examples(skip_unreadable=True)] == ["b"]
    report = stores.verify(oracled)
    assert (report.counts()["unreadable"], report.problems[0].detail) == (1, detail)


def test_an_example_killed_before_its_metadata_landed_is_left_out_as_incomplete(oracled):
    (oracled / "examples" / "c").mkdir()
    store = stores.open(oracled)
    assert store.example_ids() == ["a", "b"] and store.skipped() == {"incomplete": 1}
    with pytest.warns(UserWarning, match=f"left out 1 incomplete example\\(s\\) of {oracled}"):
        store.warn_skipped()


def test_verify_counts_every_state_and_reset_lets_the_writers_redo_the_damage(oracled):
    writer = stores.create(oracled, RUN_META)
    write(writer, "c", 2)
    write(writer, "d", 3)
    writer.add_arrays("d", "draft_scores", {"lookahead": np.ones((2, 48))}, {"k": 2})
    flip_byte_inside(oracled / "examples" / "a" / "capture.zip", "scores/fastkv/c/0/0/0")
    oracle_size = (oracled / "examples" / "b" / "oracle.zip").stat().st_size
    (oracled / "examples" / "b" / "oracle.zip").write_bytes(b"")
    (oracled / "examples" / "c" / "zarr.json").write_text("{ garbage")
    (oracled / "examples" / "d" / "draft_scores.zip").unlink()
    (oracled / "examples" / "e").mkdir()  # a capture killed before its metadata landed

    report = stores.verify(oracled)
    assert report.counts() == {
        "good": 0,
        "unchecked": 0,
        "damaged": 3,
        "incomplete": 1,
        "unreadable": 1,
        "mismatched": 0,
    }
    assert [(problem.example, problem.part, problem.detail) for problem in report.problems][:2] == [
        ("a", "capture", "capture.zip was altered (checksum differs)"),
        ("b", "oracle", f"oracle.zip has 0 bytes, {oracle_size} were written"),
    ]
    with pytest.raises(
        RankkitError, match=f"3 damaged example\\(s\\) in {oracled}; run `rankkit store verify"
    ):
        report.raise_if_damaged()

    stores.verify(oracled, reset=True)
    assert not writer.is_complete("a") and writer.is_complete("b") and not writer.has_oracle("b")
    assert stores.open(oracled).example("d").groups == []
    write(writer, "a", 0)
    oracle, oracle_layers = _oracle()
    writer.add_oracle("b", oracle=oracle, oracle_layers=oracle_layers, attrs={})
    writer.add_arrays("d", "draft_scores", {"lookahead": np.ones((2, 48))}, {"k": 2})
    assert stores.verify(oracled).counts()["damaged"] == 0
    assert_example_matches(stores.open(oracled), "a", 0)
    assert stores.open(oracled).example("d").group("draft_scores").attrs == {"k": 2}


def write_schema_1_store(path: Path) -> None:
    """A store as rankkit 0.1 wrote it: every array a plain zarr directory, no manifests."""
    root = zarr.open_group(path, mode="w", zarr_format=3, attributes={**RUN_META, "schema_version": 1})
    examples = root.create_group("examples")
    for index, example_id in enumerate(("a", "b")):
        attrs, tokens, scores = example_data(index)
        example = examples.create_group(example_id, attributes={**attrs, "complete": False})
        example.create_array("tokens", data=tokens.astype(np.int32))
        for probe, values in scores.items():
            example.require_group("scores").create_array(probe, data=values)
        oracle, oracle_layers = _oracle()
        example.create_array("oracle", data=oracle)
        example.create_array("oracle_layers", data=oracle_layers)
        draft = example.create_group("draft_scores", attributes={"k": 2, "complete": True})
        draft.create_array("lookahead", data=np.ones((2, 48), dtype=np.float32))
        example.attrs.update({"complete": True, "oracle_complete": True})


def test_a_schema_1_store_still_reads_verifies_by_decoding_and_resumes(path):
    write_schema_1_store(path)
    store = stores.open(path)
    assert_example_matches(store, "a", 0)
    record = store.example("a")
    assert record.score_shape("fastkv") == (4, 2, 48) and record.num_tokens == 48
    np.testing.assert_array_equal(record.oracle, _oracle()[0])
    assert record.groups == ["draft_scores"] and record.group("draft_scores").attrs == {"k": 2}
    assert record.group("draft_scores")["lookahead"].shape == (2, 48)
    assert stores.verify(path).counts() == {
        "good": 0,
        "unchecked": 2,
        "damaged": 0,
        "incomplete": 0,
        "unreadable": 0,
        "mismatched": 0,
    }

    (path / "examples" / "a" / "scores" / "fastkv" / "c" / "0" / "0" / "0").write_bytes(b"not blosc")
    assert [problem.example for problem in stores.verify(path).problems] == ["a"]
    assert "array scores/fastkv is damaged (does not decode" in read_error(path, lambda r: r.scores("fastkv"))

    writer = stores.create(path, RUN_META)  # resuming adds examples in the current layout
    write(writer, "c", 2)
    assert stores.open(path).meta["schema_version"] == 2  # the layout its new examples have
    assert stores.open(path).example_ids() == ["a", "b", "c"]
    assert_example_matches(stores.open(path), "c", 2)


def test_cli_store_verify_lists_problems_and_exits_2(oracled):
    (oracled / "examples" / "a" / "capture.zip").unlink()
    result = subprocess.run(
        [sys.executable, "-m", "rankkit.cli", "store", "verify", str(oracled)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stdout.splitlines() == [
        "a\tdamaged\tcapture\tcapture.zip is missing",
        f"2 examples in {oracled}: 1 good, 0 unchecked, 1 damaged, 0 incomplete, 0 unreadable, 0 mismatched",
    ]
    assert result.stderr.startswith("rankkit: error: 1 damaged example(s)") and result.stderr.count("\n") == 1


def test_cli_store_verify_reset_says_what_it_did_and_counts_the_examples_left_without_an_oracle(oracled):
    (oracled / "examples" / "b" / "oracle.zip").unlink()
    verify = [sys.executable, "-m", "rankkit.cli", "store", "verify", str(oracled)]
    reset = subprocess.run([*verify, "--reset"], capture_output=True, text=True)
    assert (reset.returncode, reset.stderr) == (0, "")
    assert reset.stdout.splitlines() == [
        "b\tdamaged\toracle\toracle.zip is missing",
        f"2 examples in {oracled}: 1 good, 0 unchecked, 1 damaged, 0 incomplete, 0 unreadable, 0 mismatched",
        f"reset 1 damaged example(s) in {oracled}; run `rankkit oracle {oracled}` to redo them",
    ]
    after = subprocess.run(verify, capture_output=True, text=True)
    assert (after.returncode, after.stderr) == (0, "")
    assert after.stdout.splitlines() == [
        f"2 examples in {oracled}: 2 good, 0 unchecked, 0 damaged, 0 incomplete, 0 unreadable, 0 mismatched; "
        f"1 without an oracle (`rankkit oracle {oracled}` adds it)"
    ]


def test_a_reset_still_refuses_the_examples_it_cannot_redo(oracled):
    (oracled / "examples" / "a" / "capture.zip").unlink()
    (oracled / "examples" / "b" / "zarr.json").write_text("{ garbage")
    report = stores.verify(oracled, reset=True)
    assert report.reset_note() == f"reset 1 damaged example(s) in {oracled}; rerun the capture into {oracled} to redo them"
    with pytest.raises(RankkitError, match="1 unreadable example\\(s\\) in .*listed above; recapture them"):
        report.raise_if_damaged()


# --- examples that do not belong where they lie ------------------------------------------------


def _refused_by_every_reader(path: Path, message: str) -> None:
    """``examples()``, ``example()`` and ``store verify`` refuse the store in one line naming the example."""
    for read in (lambda store: list(store.examples()), lambda store: store.scores_frame()):
        with pytest.raises(RankkitError) as refused:
            read(stores.open(path))
        assert message in str(refused.value) and "\n" not in str(refused.value)
    report = stores.verify(path)
    assert report.counts()["mismatched"] >= 1 and message in report.problems[0].detail
    with pytest.raises(RankkitError, match="mismatched example\\(s\\) in .*listed above; recapture them"):
        report.raise_if_damaged()


def test_swapped_example_folders_are_refused_by_the_id_inside_the_manifest(oracled):
    examples = oracled / "examples"
    (examples / "a").rename(examples / "swap")
    (examples / "b").rename(examples / "a")
    (examples / "swap").rename(examples / "b")
    _refused_by_every_reader(
        oracled, "the folder of example 'a' holds example 'b' (folders renamed or swapped)"
    )


def test_an_example_copied_in_from_another_models_store_is_refused(tmp_path, oracled):
    other = stores.create(
        tmp_path / "other.zarr", {**RUN_META, "model": {**RUN_META["model"], "weights_hash": "sha256:bbbb"}}
    )
    write(other, "c", 2)
    shutil.copytree(tmp_path / "other.zarr" / "examples" / "c", oracled / "examples" / "c")
    _refused_by_every_reader(
        oracled, "example 'c' was captured with model weights sha256:bbbb, the store with sha256:aaaa"
    )


def test_an_example_of_another_depth_or_head_count_is_refused(tmp_path):
    meta = {**RUN_META, "num_layers": LAYERS, "kv_heads": HEADS, "num_attention_heads": 2 * HEADS}
    deeper = tmp_path / "deeper.zarr"
    writer = stores.create(deeper, meta)
    write(writer, "a", 0)
    attrs, tokens, _ = example_data(1)
    writer.write_example("b", attrs=attrs, tokens=tokens, scores={"fastkv": np.ones((LAYERS + 1, HEADS, 48))})
    _refused_by_every_reader(
        deeper, f"example 'b' has scores of {LAYERS + 1} layers, the store's model {LAYERS}"
    )
    wider = tmp_path / "wider.zarr"
    writer = stores.create(wider, meta)
    writer.write_example("a", attrs=attrs, tokens=tokens, scores={"fastkv": np.ones((LAYERS, 3 * HEADS, 48))})
    _refused_by_every_reader(wider, f"example 'a' has scores of {3 * HEADS} heads, the store's model [2, 4]")


def test_an_evidence_span_past_the_prompt_is_refused(path):
    writer = stores.create(path, RUN_META)
    attrs, tokens, scores = example_data(0)
    attrs["spans"] = {"context_tokens": [0, 40], "evidence_tokens": [[17, 21], [45, 52]]}
    writer.write_example("a", attrs=attrs, tokens=tokens, scores=scores)
    _refused_by_every_reader(path, "example 'a' has evidence_tokens [45, 52) outside its 48 tokens")


def test_an_example_written_before_ids_and_hashes_were_recorded_still_reads(oracled):
    """Stores written before the manifest named the example and the model: nothing to compare, read as before."""
    metadata = oracled / "examples" / "a" / "zarr.json"
    written = json.loads(metadata.read_text())
    for key in ("example_id", "weights_hash"):
        del written["attributes"]["manifest"][key]
    metadata.write_text(json.dumps(written))
    assert [record.id for record in stores.open(oracled).examples()] == ["a", "b"]
    assert stores.verify(oracled).counts()["good"] == 2
    assert_example_matches(stores.open(oracled), "a", 0)


@pytest.mark.parametrize(
    ("edit", "changed"),
    [
        (lambda attrs: attrs.update(answer="y"), "answer"),  # the oracle's settings, as --kernel 5 for 7
        (lambda attrs: attrs.update(task="other"), "task"),  # the capture's own
        (lambda attrs: attrs.pop("task"), "task"),
    ],
)
def test_an_example_whose_metadata_was_edited_after_it_was_written_is_refused(oracled, edit, changed):
    """An oracle's kernel edited by hand in zarr.json passed verify and was compared as measured."""
    metadata = oracled / "examples" / "a" / "zarr.json"
    written = json.loads(metadata.read_text())
    edit(written["attributes"])
    metadata.write_text(json.dumps(written))
    problem = f"the metadata of example 'a' was changed after it was written ({changed} in its zarr.json)"
    assert [(each.example, each.state, each.detail) for each in stores.verify(oracled).problems] == [
        ("a", "mismatched", problem)
    ]
    with pytest.raises(RankkitError, match=re.escape(problem)):
        stores.open(oracled).example("a")
    assert_example_matches(stores.open(oracled), "b", 1)


def test_verify_finds_an_edited_token_text_which_reads_leave_unchecked(path):
    """A token's display text edited in zarr.json passed verify: the manifest left it out, for the
    read's speed. It is digested now, and checked by verify alone; an older store without its digest
    still verifies."""
    writer = stores.create(path, RUN_META)
    attrs, tokens, scores = example_data(0)
    writer.write_example("a", attrs={**attrs, "token_text": [f"t{i}" for i in range(48)]}, tokens=tokens, scores=scores)
    metadata = path / "examples" / "a" / "zarr.json"
    written = json.loads(metadata.read_text())
    written["attributes"]["token_text"][30] = "edited"
    metadata.write_text(json.dumps(written))
    problem = "the metadata of example 'a' was changed after it was written (token_text in its zarr.json)"
    assert [(each.example, each.state, each.detail) for each in stores.verify(path).problems] == [
        ("a", "mismatched", problem)
    ]
    assert stores.open(path).example("a").attrs["token_text"][30] == "edited"
    del written["attributes"]["manifest"]["attrs"]["token_text"]
    metadata.write_text(json.dumps(written))
    assert stores.verify(path).counts()["good"] == 1


def test_cli_store_verify_exits_2_on_an_example_whose_metadata_no_longer_parses(oracled):
    metadata = oracled / "examples" / "a" / "zarr.json"
    metadata.write_text(metadata.read_text()[:40])  # truncated
    result = subprocess.run(
        [sys.executable, "-m", "rankkit.cli", "store", "verify", str(oracled)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stdout.splitlines()[-1] == (
        f"2 examples in {oracled}: 1 good, 0 unchecked, 0 damaged, 0 incomplete, 1 unreadable, 0 mismatched"
    )
    assert result.stderr == (
        f"rankkit: error: 1 unreadable example(s) in {oracled}, listed above; recapture them "
        "(or move a mismatched one back to its own folder or store)\n"
    )


def test_a_zip_written_again_clears_what_a_killed_write_of_it_left(tmp_path):
    """A kill while an oracle's zip was written left its hidden staging file in the example for good."""
    from rankkit.stores import schema

    path = tmp_path / "oracle.zip"
    left = tmp_path / ".oracle.zip.0123abcd.partial"
    other = tmp_path / ".scores.zip.0123abcd.partial"  # another zip's: cleared when that zip is written again
    left.write_bytes(b"PK")
    other.write_bytes(b"PK")
    schema.write_zip(path, {"oracle": np.arange(4, dtype=np.float32)})
    assert sorted(entry.name for entry in tmp_path.iterdir()) == [other.name, "oracle.zip"]
    np.testing.assert_array_equal(schema.read_zip_arrays(path, ["oracle"])["oracle"], np.arange(4))


def test_zip_arrays_decode_as_zarr_reads_them_in_every_chunk_layout(tmp_path, monkeypatch):
    from rankkit.stores import schema

    monkeypatch.setattr(schema, "TARGET_CHUNK_BYTES", 64)  # several chunks, the last one partial
    rng = np.random.default_rng(0)
    arrays = {
        "scores/many_chunks": rng.random((7, 3, 5), dtype=np.float32),
        "scores/half": rng.random((2, 2, 9)).astype(np.float16),
        "tokens": rng.integers(0, 50_000, 33).astype(np.int32),
        "zeros": np.zeros((5, 4), dtype=np.float32),  # chunks of only the fill value are never written
        "holes": np.where(np.arange(6)[:, None] < 3, 0.0, rng.random((6, 4))).astype(np.float64),
        "nan_fill": np.full((3, 2), np.nan, dtype=np.float32),
    }
    path = tmp_path / "arrays.zip"
    schema.write_zip(path, arrays)
    with zipfile.ZipFile(path) as archive:
        assert not any(name.startswith("zeros/c") for name in archive.namelist())
        assert "scores/many_chunks/c/6/0/0" in archive.namelist()
    for name, expected in arrays.items():
        with schema.open_zip(path) as root:
            via_zarr = root[name][...]
        found = schema.read_zip_arrays(path, [name])[name]
        assert found.dtype == expected.dtype and found.shape == expected.shape
        np.testing.assert_array_equal(found, via_zarr)
        np.testing.assert_array_equal(found, expected)
    together = schema.read_zip_arrays(path, list(arrays))  # one opening of the zip
    assert list(together) == list(arrays)
    for name, expected in arrays.items():
        np.testing.assert_array_equal(together[name], expected)


def test_zip_arrays_of_another_layout_read_through_zarr(tmp_path):
    from zarr.storage import ZipStore

    from rankkit.stores import schema

    path = tmp_path / "other.zip"
    store = ZipStore(path, mode="w")
    root = zarr.open_group(store, mode="w", zarr_format=3)
    values = np.arange(24, dtype=np.int64).reshape(4, 6)
    root.create_array("gzipped", data=values, chunks=(3, 4), compressors=zarr.codecs.GzipCodec())
    store.close()
    np.testing.assert_array_equal(schema.read_zip_arrays(path, ["gzipped"])["gzipped"], values)


def test_float16_scores_are_stored_at_half_size_and_read_as_float32(tmp_path):
    half, full = tmp_path / "half.zarr", tmp_path / "full.zarr"
    for path, meta in ((half, {**RUN_META, "score_dtype": "float16"}), (full, RUN_META)):
        write(stores.create(path, meta), "a", 0, num_tokens=4096)
    record = stores.open(half).example("a")
    expected = example_data(0, num_tokens=4096)[2]["fastkv"]
    assert record.scores("fastkv").dtype == np.float32
    np.testing.assert_array_equal(record.scores("fastkv"), expected.astype(np.float16).astype(np.float32))
    sizes = [(path / "examples" / "a" / "capture.zip").stat().st_size for path in (half, full)]
    assert sizes[0] < 0.6 * sizes[1]
    with pytest.raises(RankkitError, match="--score-dtype must be one of float32, float16, got 'int8'"):
        stores.create(tmp_path / "bad.zarr", {**RUN_META, "score_dtype": "int8"})
    with pytest.raises(RankkitError, match="holds a different run \\(score_dtype"):
        stores.create(half, RUN_META)
