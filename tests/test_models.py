"""Model loading: the default from its GGUF, local folders, hub ids, and the conversion cache."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, FAMILY_CONFIGS, tiny_model

from rankkit import RankkitError, model_cache, models
from rankkit.runner import Runner


def test_unsupported_family_fails_up_front_naming_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(RankkitError, match="llama, mistral, qwen2, qwen3, gemma2, .*, olmo2, olmo3, granite, .*, seed_oss$"):
        models.load(str(tmp_path))


def test_every_family_the_tests_run_has_a_tiny_config():
    """The family tests run on every supported family (FAMILIES is made from SUPPORTED_FAMILIES); one
    added without a config of what makes it differ would fail them all on a KeyError."""
    assert set(FAMILIES) == set(FAMILY_CONFIGS)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(RankkitError, match="no config.json"):
        models.resolve_folder(str(tmp_path))


def test_a_hub_id_with_dots_loads_from_the_hub_cache_and_a_missing_path_is_named(tmp_path, monkeypatch):
    """Qwen/Qwen2.5-0.5B was refused as "neither a folder nor a hub id": its '.5B' read as a file suffix."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--Qwen--Qwen2.5-tiny" / "snapshots" / ("0" * 40)
    tiny_model("qwen2").save_pretrained(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    assert models.resolve_folder("Qwen/Qwen2.5-tiny") == snapshot
    forms = "--model takes 'default', an HF model folder, a hub id (owner/name) or random:<shape>"
    for spec in ("./nothing", "../a/b", "models/x.gguf/more", "x"):
        with pytest.raises(RankkitError, match=rf"^model '{re.escape(spec)}': no such folder; {re.escape(forms)}$"):
            models.resolve_folder(spec)
    (tmp_path / "weights.gguf").write_bytes(b"")
    with pytest.raises(RankkitError, match=rf"is a file; {re.escape(forms)}$"):
        models.resolve_folder(str(tmp_path / "weights.gguf"))


def test_unreachable_hub_id_fails_fast_with_a_clear_message():
    started = time.perf_counter()
    with pytest.raises(RankkitError, match="local HF model folder"):
        models.resolve_folder("no-such-owner/no-such-model")
    assert time.perf_counter() - started < 60


def test_weights_hash_follows_content(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "a")
    tiny_model("llama", seed=1).save_pretrained(tmp_path / "b")
    first = model_cache.folder_weights_hash(tmp_path / "a")
    assert first == model_cache.folder_weights_hash(tmp_path / "a")
    assert first != model_cache.folder_weights_hash(tmp_path / "b")


def test_weights_hash_is_computed_once_per_folder_version(tmp_path, monkeypatch):
    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    reads = []
    real_sha256 = model_cache.file_sha256
    monkeypatch.setattr(model_cache, "file_sha256", lambda path: reads.append(path.name) or real_sha256(path))
    first = model_cache.folder_weights_hash(folder)
    assert model_cache.folder_weights_hash(folder) == first
    assert reads == ["model.safetensors"]
    weights = folder / "model.safetensors"
    tiny_model("llama", seed=1).save_pretrained(folder)  # new content, size equal: the mtime tells
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    changed = model_cache.folder_weights_hash(folder)
    assert changed != first and reads == ["model.safetensors"] * 2
    assert changed == hashlib.sha256(b"model.safetensors" + real_sha256(weights).encode()).hexdigest()


def test_a_recorded_weights_hash_holds_only_for_the_weight_files_it_was_computed_from(
    tmp_path, monkeypatch, tiny_folder
):
    """A converted folder records its hash beside its weights; a copy of it whose weights were
    tuned (one matrix zeroed, same size) or replaced by a copy that kept the mtime is rehashed
    and recorded anew, and an unchanged one is never read."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path / "cache"))
    folder = shutil.copytree(tiny_folder, tmp_path / "cache" / "models" / "Tiny-0123456789ab")
    weights = folder / "model.safetensors"
    record = {"sha256": "ab" * 32, "source": "tiny.gguf", "files": model_cache.weight_files_identity([weights])}
    (folder / model_cache.WEIGHTS_HASH_FILE).write_text(json.dumps(record))
    reads = []
    real_sha256 = model_cache.file_sha256
    monkeypatch.setattr(model_cache, "file_sha256", lambda path: reads.append(path.name) or real_sha256(path))

    assert model_cache.folder_weights_hash(folder) == "ab" * 32
    assert models.known_weights_hash(str(folder), torch.device("cpu")) == "ab" * 32
    assert [(found.weights_hash, found.source) for found in model_cache.cached_models()] == [("ab" * 32, "tiny.gguf")]
    assert reads == []

    tensors = load_file(weights)
    size = weights.stat().st_size
    tensors["model.layers.0.mlp.down_proj.weight"].zero_()
    save_file(tensors, weights, metadata={"format": "pt"})
    assert weights.stat().st_size == size
    tuned = model_cache.folder_weights_hash(folder)
    assert tuned == hashlib.sha256(b"model.safetensors" + real_sha256(weights).encode()).hexdigest()
    assert reads == ["model.safetensors"]
    assert json.loads((folder / model_cache.WEIGHTS_HASH_FILE).read_text()) == {
        "sha256": tuned,
        "content_sha256": tuned,
        "files": model_cache.weight_files_identity([weights]),
    }
    assert model_cache.folder_weights_hash(folder) == tuned
    assert [(found.weights_hash, found.source) for found in model_cache.cached_models()] == [(tuned, None)]
    assert reads == ["model.safetensors"]

    # The original weights copied back over the tuned ones, mtime kept (cp -p): only the inode tells.
    original = tmp_path / "original.safetensors"
    shutil.copyfile(tiny_folder / "model.safetensors", original)
    os.utime(original, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns))
    os.replace(original, weights)
    assert model_cache.folder_weights_hash(folder) == model_cache.folder_weights_hash(tiny_folder) != tuned
    assert reads == ["model.safetensors"] * 3


def test_a_weights_record_from_before_file_identities_were_kept_is_tied_to_its_files_and_a_copy_keeps_its_hash(
    tmp_path, monkeypatch
):
    """A conversion recorded before its files' identities were kept holds its hash (its stores, made with
    it, stay its model's) and is tied to its files from then on; an unchanged copy of the weights is still
    the conversion (its content matches the record's), where it was hashed as a model of its own."""
    import json
    import shutil

    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    weights = folder / "model.safetensors"
    (folder / model_cache.WEIGHTS_HASH_FILE).write_text(json.dumps({"sha256": "ab" * 32, "source": "tiny.gguf"}))
    content = hashlib.sha256(b"model.safetensors" + model_cache.file_sha256(weights).encode()).hexdigest()
    assert model_cache.recorded_weights_hash(folder) is None
    assert model_cache.folder_weights_hash(folder) == "ab" * 32
    assert json.loads((folder / model_cache.WEIGHTS_HASH_FILE).read_text()) == {
        "sha256": "ab" * 32, "source": "tiny.gguf", "files": model_cache.weight_files_identity([weights]),
        "content_sha256": content,
    }  # fmt: skip
    assert model_cache.recorded_weights_hash(folder) == "ab" * 32
    copy = shutil.copytree(folder, tmp_path / "copy")  # new inodes and times: rehashed, the same content
    assert model_cache.recorded_weights_hash(copy) is None
    assert model_cache.folder_weights_hash(copy) == "ab" * 32


HASH = "ab" * 32


@pytest.mark.parametrize(
    ("damaged", "reason"),
    [
        ('{"sha256": "abab', "not JSON: Unterminated string starting at: line 1 column 12 (char 11)"),
        ("[]", "not a JSON object"),
        ('{"source": "tiny.gguf"}', "no sha256 hash"),
        ('{"sha256": "AB"}', "no sha256 hash"),
        (f'{{"sha256": "{HASH}", "content_sha256": 7}}', "its content_sha256 is not a hash"),
        (f'{{"sha256": "{HASH}", "files": []}}', "its files are not an object"),
        (f'{{"sha256": "{HASH}", "source": null}}', "its source is not a file name"),
    ],
)
@pytest.mark.parametrize("converted", [True, False], ids=["conversion", "own folder"])
def test_a_damaged_weights_record_is_refused_in_one_line_naming_what_to_delete(
    tmp_path, monkeypatch, tiny_folder, damaged, reason, converted
):
    """The record beside the weights holds the hash every figure of them is filed under (a conversion's
    is its source file's), which hashing the weights cannot give back: damaged, it is refused before
    any figure, naming what to delete (a conversion goes whole: one without its record is not trusted)."""
    import shutil

    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path / "cache"))
    place = tmp_path / "cache" / "models" / "Tiny-0123456789ab" if converted else tmp_path / "mine"
    folder = shutil.copytree(tiny_folder, place)
    record = folder / model_cache.WEIGHTS_HASH_FILE
    record.write_text(damaged)
    fix = f"delete {folder}, and rankkit converts the model again" if converted else "delete it, and rankkit hashes"
    for read in (model_cache.folder_weights_hash, model_cache.recorded_weights_hash):
        with pytest.raises(RankkitError, match=f"^{re.escape(f'{record} is damaged ({reason}); {fix}')}"):
            read(folder)
    if converted:
        with pytest.raises(RankkitError, match="is damaged"):
            model_cache.cached_models()
    assert record.read_text() == damaged


def test_a_damaged_remembered_weights_hash_is_hashed_again_and_remembered_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    first = model_cache.folder_weights_hash(folder)
    (memo,) = (tmp_path / "cache" / "weights-hashes").iterdir()
    for damaged in ('{"sha256": "ab', '{"sha256": 7}', "[]"):
        memo.write_text(damaged)
        assert model_cache.recorded_weights_hash(folder) is None
        assert model_cache.folder_weights_hash(folder) == first
        assert model_cache.recorded_weights_hash(folder) == first


def test_a_conversion_is_published_once_and_replaces_a_folder_without_its_record(tmp_path):
    """A finished conversion takes the target's place; another process's, published first, stands; a
    folder there without its record (deleted by hand) is never trusted and is replaced, where every
    load converted the model again and filed it under its content's hash."""

    def converted(name: str, content: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_text(content)
        (folder / model_cache.WEIGHTS_HASH_FILE).write_text("{}")
        return folder

    target = tmp_path / "models" / "Tiny-0123456789ab"
    target.parent.mkdir()
    model_cache._publish(converted(".first", "first"), target)
    assert (target / "model.safetensors").read_text() == "first"
    model_cache._publish(converted(".second", "second"), target)  # published first: it stands
    assert (target / "model.safetensors").read_text() == "first"
    (target / model_cache.WEIGHTS_HASH_FILE).unlink()
    model_cache._publish(converted(".third", "third"), target)
    assert (target / "model.safetensors").read_text() == "third"
    assert (target / model_cache.WEIGHTS_HASH_FILE).is_file()
    assert sorted(path.name for path in tmp_path.rglob("*")) == sorted(
        ["models", target.name, "model.safetensors", model_cache.WEIGHTS_HASH_FILE]
    )


def test_device_resolution():
    assert models.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RankkitError, match="CUDA is not available"):
            models.resolve_device("cuda")
    # torch.device accepts them; the run then failed in a traceback (meta: "Cannot copy out of meta tensor")
    with pytest.raises(RankkitError, match="^device 'meta' asked for but meta holds no values to run on"):
        models.resolve_device("meta")
    if not torch.backends.mps.is_available():
        with pytest.raises(RankkitError, match="^device 'mps' asked for but this torch has no mps device here"):
            models.resolve_device("mps")


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda folder: (folder / "config.json").write_text("not json"), "is not a valid JSON file"),
        (lambda folder: (folder / "model.safetensors").unlink(), "no file named model.safetensors"),
        (
            lambda folder: (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:100]),
            "Error while deserializing header",
        ),
    ],
)
def test_a_model_folder_transformers_cannot_read_is_one_line(tmp_path, damage, reason):
    """They ended in transformers' or safetensors' traceback."""
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    damage(folder)
    with pytest.raises(RankkitError, match=f"^model '{re.escape(str(folder))}' .* cannot be read: .*{reason}"):
        models.load(str(folder), device="cpu")


@pytest.mark.integration
def test_local_folder_loads_through_the_default_path(tmp_path, default_model):
    folder = tmp_path / "tiny-qwen3"
    tiny_model("qwen3").save_pretrained(folder)
    default_model.tokenizer.save_pretrained(folder)
    loaded = models.load(str(folder), device="cpu")
    assert loaded.model.config.model_type == "qwen3"
    assert loaded.weights_hash == model_cache.folder_weights_hash(folder)


@pytest.mark.integration
def test_default_model_runner_matches_transformers(default_model):
    from rankkit.prompting import build_prompt

    model, tokenizer = default_model
    prompt = build_prompt(
        tokenizer, "The pass key is 68247. " + "The grass is green. " * 40, "What is the pass key?"
    )
    with torch.inference_mode():
        expected_logits = model(prompt.input_ids[None]).logits[0]
    runner = Runner(model)
    assert torch.allclose(
        runner.prefill(prompt.input_ids, logits_at="all").logits, expected_logits, atol=1e-4
    )
    expected = model.generate(prompt.input_ids[None], max_new_tokens=16, do_sample=False)[
        0, prompt.num_tokens :
    ]
    assert runner.generate(prompt.input_ids, 16).tokens == expected.tolist()


_CONVERT = "from rankkit import model_cache; print(model_cache.default_model_folder())"
# the content hash of the default model's converted weights: the same bytes whichever way its GGUF
# file is read
DEFAULT_CONTENT = "d99538b711f0fa205cc9b156de7cba53e7a3e0b8eb9d994764cb4079d2e48b17"


@pytest.mark.integration
def test_conversion_killed_midway_is_redone_on_the_next_load(tmp_path, monkeypatch):
    env = {**os.environ, "RANKKIT_CACHE": str(tmp_path)}
    models_dir = tmp_path / "models"
    victim = subprocess.Popen([sys.executable, "-c", _CONVERT], env=env, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(models_dir.glob(".*.partial-*/*")):
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert list(models_dir.glob(".*.partial-*")), "the conversion should have been caught half-way"
    assert not [p for p in models_dir.iterdir() if not p.name.startswith(".")], (
        "nothing half-written is published"
    )

    # the next load, in this process: transformers' three readings of the GGUF file (tokenizer,
    # config, weights) parse it once, and the tensor-name table is built once, not once a module
    from unittest import mock

    import gguf

    parses = mock.Mock(wraps=gguf.GGUFReader)
    name_tables = mock.Mock(wraps=gguf.get_tensor_name_map)
    monkeypatch.setattr(gguf, "GGUFReader", parses)
    monkeypatch.setattr(gguf, "get_tensor_name_map", name_tables)
    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path))
    folder = model_cache.default_model_folder()
    assert (parses.call_count, name_tables.call_count) == (1, 1)
    assert (folder / model_cache.WEIGHTS_HASH_FILE).is_file()
    assert not list(models_dir.glob(".*.partial-*")), "the dead run's leftovers are cleaned up"
    assert model_cache.default_model_folder() == folder and parses.call_count == 1
    # what the conversion wrote is what it always wrote: the weights of the cache's own conversion
    assert model_cache.read_cache_json(folder / model_cache.WEIGHTS_HASH_FILE)["content_sha256"] == DEFAULT_CONTENT


def test_cached_models_lists_complete_folders_with_hash_and_size_and_the_cli_names_the_default(
    tmp_path, monkeypatch
):
    import json

    from typer.testing import CliRunner

    from rankkit import model_cache
    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app

    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path))
    done = tmp_path / "models" / "Tiny-0123456789ab"
    done.mkdir(parents=True)
    (done / "model.safetensors").write_bytes(b"\0" * 1000)
    # as a conversion records it: beside the weights' identity, which says they are unchanged since
    weights = {"files": model_cache.weight_files_identity([done / "model.safetensors"])}
    record = json.dumps({"sha256": "ab" * 32, "source": "tiny.gguf"} | weights)
    (done / model_cache.WEIGHTS_HASH_FILE).write_text(record)
    (tmp_path / "models" / ".Tiny-0123456789ab.partial-1-x").mkdir()  # a conversion killed half-way
    (tmp_path / "models" / "unfinished").mkdir()
    (found,) = model_cache.cached_models()
    assert found == model_cache.CachedModel(done, "ab" * 32, "tiny.gguf", 1000 + len(record))

    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["default_model"] == str(model_cache.default_model_target())
    assert payload["default_model"].startswith(str(tmp_path / "models" / model_cache.DEFAULT_MODEL_NAME))
    assert [row["folder"] for row in payload["models"]] == [str(done)]
    assert payload["models"][0]["default"] is False
    as_csv = CliRunner().invoke(app, ["models", "--format", "csv"])
    assert as_csv.stdout.splitlines() == [
        "folder,weights_hash,source,size_bytes,default",
        f"{done},{'ab' * 32},tiny.gguf,{1000 + len(record)},False",
    ]


def test_cli_models_lists_the_cache_without_torch(tmp_path):
    """Listing the cache reads file records: importing torch alone would take it from under a second
    to two."""
    script = (
        "import atexit, sys; atexit.register(lambda: print('torch' in sys.modules, file=sys.stderr)); "
        "sys.argv = ['rankkit', 'models', '--json']; from rankkit.cli import main; main()"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**os.environ, "RANKKIT_CACHE": str(tmp_path)}
    )
    assert result.returncode == 0 and str(tmp_path / "models") in result.stdout, result.stderr
    assert result.stderr == "False\n"


_CACHE_FIX = "point it at a directory (or unset it for ~/.cache/rankkit)"


@pytest.mark.processes
def test_a_cache_variable_naming_a_file_is_refused_in_one_line_by_the_cli(tmp_path):
    """RANKKIT_CACHE at a file listed an empty cache in it (`rankkit models`, status 0)."""
    blocker = tmp_path / "cache.txt"
    blocker.write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "rankkit.cli", "models"],
        capture_output=True,
        text=True,
        env={**os.environ, "RANKKIT_CACHE": str(blocker)},
    )
    assert (result.returncode, result.stdout, result.stderr) == (
        2,
        "",
        f"rankkit: error: RANKKIT_CACHE={blocker} is a file; {_CACHE_FIX}\n",
    )


def test_the_default_models_conversion_into_a_cache_under_a_file_is_refused_before_it_starts(tmp_path, monkeypatch):
    """It ended in a NotADirectoryError traceback (`rankkit generate`, status 1)."""
    blocker = tmp_path / "cache.txt"
    blocker.write_text("")
    monkeypatch.setenv("RANKKIT_CACHE", str(blocker / "rankkit"))
    refusal = f"RANKKIT_CACHE={blocker / 'rankkit'} lies under the file {blocker}; {_CACHE_FIX}"
    with pytest.raises(RankkitError, match=f"^{re.escape(refusal)}$"):
        model_cache.default_model_folder()


def test_an_empty_cache_variable_is_the_default_cache_not_the_working_directory(tmp_path, monkeypatch):
    """RANKKIT_CACHE= read as the working directory, where the default model's conversion landed."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANKKIT_CACHE", "")
    assert model_cache.cache_root() == tmp_path / "home" / ".cache" / "rankkit"
    assert model_cache.default_model_target().parent == tmp_path / "home" / ".cache" / "rankkit" / "models"
