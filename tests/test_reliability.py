"""Careless and hostile use: bad options refused before the model loads, outputs that are never
lost or overwritten by surprise, interrupts that keep finished work, and one oracle per store.

Each case of "what a careless user tried" is here with its exact input; the model is the
tiny random Llama of ``tiny_folder`` (3 layers, 512 positions) unless the case needs more.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

import rankkit.models
from rankkit import outputs
from rankkit.cli import commands  # noqa: F401  (registers every command)
from rankkit.cli.app import app
from rankkit.errors import RankkitError

TIMING_COLUMNS = (
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "ttft_ratio",
    "tpot_ratio",
    "ideal_ratio",
    "ttft_min_s",
    "cost_linear",
    "cost_quadratic",
)


def refused(args: list[str], cwd: Path) -> str:
    """The one-line RankkitError a command raises; the folder it ran in stays empty."""
    before = sorted(cwd.iterdir())
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, RankkitError), result.output
    assert sorted(cwd.iterdir()) == before  # a rejected command leaves nothing behind
    return str(result.exception)


@pytest.fixture
def no_model_load(monkeypatch, tmp_path):
    """Any weight loading fails the test: the refusals must come before it."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(rankkit.models, "load", forbidden)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("method", ["claa", "fastkv", "oracle", "gemfilter"])
@pytest.mark.parametrize("layer", ["99", "-1"])
@pytest.mark.parametrize("command", ["prefill", "bench"])
def test_a_layer_outside_the_model_is_refused_before_it_loads(
    no_model_load, tiny_folder, command, method, layer
):
    method_option = ["--method", method] if command == "prefill" else ["--methods", f"full,{method}"]
    message = refused(
        [command, *method_option, "--keep", "0.2", "--data", "niah:n=1,length=200", "--layer", layer,
         "--model", str(tiny_folder)],
        no_model_load,
    )  # fmt: skip
    assert message == (
        f"--layer {layer} is not a layer of this model (3 layers, 0..2) for method '{method}'; "
        "give a layer in that range or leave --layer out"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["prefill", "--method", "snapkv", "--keep", "0.2", "--layer", "1"],
         "method snapkv has no selection layer; leave --layer out"),
        (["bench", "--methods", "full,snapkv", "--keep", "0.2", "--layer", "1"],
         "method snapkv has no selection layer; leave --layer out"),
        (["bench", "--methods", ",", "--keep", "0.2"],
         "--methods ',' names nothing; give comma-separated names"),
        (["bench", "--methods", "full,claa", "--keep", "1.5"], "keep rate 1.5 is outside (0, 1]"),
        (["bench", "--methods", "full,nope", "--keep", "0.2"], "unknown method 'nope'"),
        (["prefill", "--method", "claa"], "give exactly one of --keep (e.g. 0.1) or --budget (e.g. 2048)"),
    ],
)  # fmt: skip
def test_bad_method_and_budget_options_are_refused_before_the_model_loads(
    no_model_load, tiny_folder, args, message
):
    text = refused([*args, "--data", "niah:n=1,length=200", "--model", str(tiny_folder)], no_model_load)
    assert message is None or text.startswith(message)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("niah:length=20000", "'niah:length=20000' has 20000 tokens, more than the model's 512 positions; "
         "shorten it, or pass --allow-overlength to run it anyway"),
        ("niah:length=abc", "length must be an integer >= 1, got 'abc' in 'niah:length=abc'"),
        ("ruler:task=nope,length=300", "unknown RULER task 'nope'"),
        ("niah:length=300,colour=red", "niah does not take 'colour'"),
    ],
)  # fmt: skip
def test_spec_values_and_lengths_are_checked_before_the_model_loads(
    no_model_load, tiny_folder, data, message
):
    for command in (["bench", "--methods", "full,claa"], ["prefill", "--method", "claa"]):
        text = refused(
            [*command, "--keep", "0.2", "--data", data, "--model", str(tiny_folder)], no_model_load
        )
        assert text.startswith(message)
    capture = ["capture", "--data", data, "--model", str(tiny_folder), "--out", "store.zarr"]
    assert refused(capture, no_model_load).startswith(message)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (None, "--device-map 'missing.json' is neither a strategy nor a file; give one of auto, "),
        ("{not json", "--device-map missing.json: not readable JSON"),
        ("[1, 2]", "--device-map missing.json: expected a non-empty JSON object"),
        ('{"model.layers.0": [0]}', "--device-map missing.json: module 'model.layers.0' maps to [0]"),
    ],
)
def test_a_bad_device_map_is_refused_before_the_model_loads(no_model_load, tiny_folder, layout, message):
    if layout is not None:
        (no_model_load / "missing.json").write_text(layout)
    common = ["--keep", "0.2", "--data", "niah:n=1,length=200", "--model", str(tiny_folder)]
    for command in (
        ["bench", "--methods", "full,claa", *common],
        ["prefill", "--method", "claa", *common],
        ["capture", "--data", "niah:n=1,length=200", "--model", str(tiny_folder), "--out", "s.zarr"],
    ):
        assert refused([*command, "--device-map", "missing.json"], no_model_load).startswith(message)  # fmt: skip


def test_prefill_through_a_device_map_file_gives_the_answer_of_a_plain_load(tmp_path, tiny_folder):
    """The explicit per-layer map a multi-GPU user writes, here with every module on the CPU."""
    layout = {name: "cpu" for name in ("model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head")}
    layout |= {f"model.layers.{index}": "cpu" for index in range(3)}
    map_file = tmp_path / "layout.json"
    map_file.write_text(json.dumps(layout))
    runs = []
    for device_map in (None, str(map_file)):
        result = CliRunner().invoke(
            app,
            ["prefill", "--method", "claa", "--keep", "0.5", "--data", "niah:n=1,length=200",
             "--model", str(tiny_folder), "--device", "cpu", "--max-new-tokens", "3", "--repeats", "1",
             "--warmup", "0", "--json", *(["--device-map", device_map] if device_map else [])],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        runs.append(json.loads(result.output))
    same = ("answer", "selection_layer", "selected_positions", "kv_bytes")
    assert [{key: run[key] for key in same} for run in runs][0] == {key: runs[1][key] for key in same}
    assert runs[0]["selected_positions"] and runs[0]["kv_bytes"] > 0


def test_oracle_answer_is_checked_before_the_model_loads(no_model_load, tiny_folder):
    capture = ["capture", "--data", "niah:length=200", "--model", str(tiny_folder), "--out", "store.zarr"]
    message = refused([*capture, "--oracle", "--answer", "gold"], no_model_load)
    assert message == "--answer must be one of generated, reference, got 'gold'"


def test_a_jsonl_prompt_past_the_model_positions_is_refused_unless_forced(tmp_path, tiny_folder):
    data = tmp_path / "long.jsonl"
    long_line = {"id": "long", "context": "word " * 600, "question": "Which word?", "answers": ["word"]}
    data.write_text(json.dumps(long_line) + "\n")
    args = ["bench", "--methods", "full", "--keep", "1", "--data", str(data), "--model", str(tiny_folder)]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "rows.parquet")])
    assert isinstance(result.exception, RankkitError)
    assert str(result.exception).startswith("the prompt of example 'long' has 6")
    assert "more than the model's 512 positions" in str(result.exception)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["long.jsonl"]


def test_a_budget_larger_than_the_prompt_warns_that_it_keeps_everything(tmp_path, tiny_folder):
    from rankkit.bench import BenchSettings, Setup, bench
    from rankkit.methods import Budget

    with pytest.warns(
        UserWarning, match=r"--budget 5000 is larger than the prompt of example .* it keeps all"
    ):
        frame = bench(
            ["full", "claa"],
            [Budget.from_tokens(5000)],
            "niah:n=1,length=200",
            settings=BenchSettings(max_new_tokens=1, warmup_runs=0),
            setup=Setup(model=str(tiny_folder), device="cpu"),
        )
    assert frame.filter(pl.col("method") == "claa")["kv_ratio"].to_list() == [1.0]


@pytest.mark.parametrize(("warmup", "repeats"), [(1, 1), (0, 3)])
def test_bench_progress_counts_calibration_warmups_and_repeats_and_ends_at_its_total(
    tiny_folder, warmup, repeats
):
    from rankkit.bench import BenchSettings, Setup, bench
    from rankkit.methods import Budget

    events = []
    bench(
        ["full", "claa", "fastkv"],
        [Budget.from_keep(0.5), Budget.from_keep(0.25)],
        "niah:n=2,length=200",
        settings=BenchSettings(max_new_tokens=1, warmup_runs=warmup, repeats=repeats),
        setup=Setup(model=str(tiny_folder), device="cpu"),
        progress=events.append,
    )
    entries = 1 + 2 * 2  # full once, then claa and fastkv at each budget
    total = 1 + 2 * entries * (1 + repeats)  # calibration, then per example a warm-up and the repeats
    assert {event.total for event in events} == {total}
    assert [event.done for event in events] == sorted(event.done for event in events)
    assert events[-1].done == total and all(event.done <= total for event in events)
    stages = [event.stage for event in events]
    assert stages.count("warm-up") == 2 * entries and stages.count("timed") == 2 * entries * repeats


# --- safe outputs ---


def test_claim_refuses_an_existing_file_a_directory_and_the_command_inputs(tmp_path):
    store = tmp_path / "capture.zarr"
    store.mkdir()
    (store / "zarr.json").write_text("{}")
    existing = tmp_path / "report.html"
    existing.write_text("old")
    with pytest.raises(RankkitError, match="report.html already exists; pass --overwrite to replace it"):
        outputs.claim([existing])
    assert outputs.claim([existing], overwrite=True) == [existing]
    with pytest.raises(RankkitError, match=f"--out {tmp_path} is a directory; give a file path inside it"):
        outputs.claim([tmp_path], overwrite=True)
    with pytest.raises(RankkitError, match="zarr.json is one of this command's inputs"):
        outputs.claim([store / "zarr.json"], overwrite=True, inputs=[store])
    with pytest.raises(RankkitError, match="is one of this command's inputs"):
        outputs.claim([store], overwrite=True, inputs=[store])


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_partial(tmp_path):
    target = tmp_path / "rows.parquet"
    target.write_text("old")

    def half_then_fail(partial: Path) -> None:
        partial.write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(RankkitError) as failed:
        outputs.write_atomic(target, half_then_fail)
    assert str(failed.value) == (
        f"cannot write {target} (No space left on device); the old file, if any, is unchanged"
    )
    assert target.read_text() == "old" and sorted(tmp_path.iterdir()) == [target]
    outputs.write_text("new", target)
    assert target.read_text() == "new" and sorted(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dashboard", "store.zarr", "--out", "store.zarr/zarr.json"], "is one of this command's inputs"),
        (["dashboard", "store.zarr", "--out", "reports"], "--out reports is a directory"),
        (["dashboard", "store.zarr", "--out", "old.html"], "old.html already exists; pass --overwrite"),
        (["compare", "store.zarr", "--out", "old.parquet"], "old.parquet already exists"),
        (["compare", "store.zarr", "--out", "c.parquet"], "c.summary.parquet already exists"),
        (["compare", "store.zarr", "--out", "store.zarr/c.parquet"], "is one of this command's inputs"),
        (["variance", "store.zarr", "--out", "old.parquet"], "old.parquet already exists"),
        (
            ["bench", "--methods", "full", "--keep", "1", "--data", "old.jsonl", "--out", "old.parquet"],
            "old.parquet already exists",
        ),
        (
            ["data", "export", "old.jsonl", "--out", "old.jsonl", "--overwrite"],
            "is one of this command's inputs",
        ),
        (["data", "export", "old.jsonl", "--out", "old.html"], "old.html already exists"),
        (["diffusion", "--data", "old.jsonl", "--out", "old.parquet"], "old.parquet already exists"),
        (
            ["diffusion", "--data", "old.jsonl", "--out", "old.jsonl", "--overwrite"],
            "is one of this command's inputs",
        ),
        (
            [
                "bench",
                "--methods",
                "full",
                "--keep",
                "1",
                "--data",
                "old.jsonl",
                "--out",
                "old.jsonl",
                "--overwrite",
            ],
            "is one of this command's inputs",
        ),
    ],
)
def test_outputs_are_never_overwritten_or_written_into_an_input_unless_asked(no_model_load, args, message):
    folder = no_model_load
    (folder / "store.zarr").mkdir()
    (folder / "store.zarr" / "zarr.json").write_text("{}")
    (folder / "reports").mkdir()
    for name in ("old.html", "old.parquet", "c.summary.parquet", "old.jsonl"):
        (folder / name).write_text("old")
    assert message in refused(args, folder)
    assert all((folder / name).read_text() == "old" for name in ("old.html", "old.parquet", "old.jsonl"))


# --- interrupts and resume ---


def test_an_interrupt_inside_deferred_interrupts_is_raised_at_its_end():
    import os

    from rankkit.interrupts import deferred_interrupts

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # where an undeferred signal would have been raised
            reached.append("end of block")
    assert reached == ["end of block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


BENCH = dict(methods="full,claa,fastkv", keep="0.5", data="niah:n=4,length=200", max_new_tokens=2, repeats=15)


def _bench_command(tiny_folder: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "rankkit.cli", "bench", "--methods", BENCH["methods"], "--keep", BENCH["keep"],
        "--data", BENCH["data"], "--model", str(tiny_folder), "--max-new-tokens", str(BENCH["max_new_tokens"]),
        "--warmup", "0", "--repeats", str(BENCH["repeats"]), "--threads", "1", "--device", "cpu",
        "--out", str(out),
    ]  # fmt: skip


def _interrupt_bench(tiny_folder: Path, out: Path, signum: int) -> tuple[int, str, int]:
    """Start the bench, send ``signum`` once an example is kept; (exit status, last stderr line, kept)."""
    journal = out.with_name(f".{out.name}.unfinished.jsonl")

    def kept() -> int:
        lines = journal.read_text().splitlines() if journal.is_file() else []
        return sum('"key"' in line for line in lines)

    victim = subprocess.Popen(
        _bench_command(tiny_folder, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    while kept() < 1 and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    victim.send_signal(signum)
    stderr = victim.communicate(timeout=120)[1]
    return victim.returncode, stderr.strip().splitlines()[-1], kept()


def test_sigterm_stops_a_bench_saying_what_it_kept(tmp_path, tiny_folder):
    out = tmp_path / "rows.parquet"
    status, last_line, kept = _interrupt_bench(tiny_folder, out, signal.SIGTERM)
    assert status == 130 and 1 <= kept < 4 and not out.exists()
    journal = tmp_path / ".rows.parquet.unfinished.jsonl"
    assert last_line == (
        f"rankkit: interrupted: kept {kept} finished ({kept * 3} rows) in {journal}; "
        "rerun the same command to resume"
    )


def test_an_interrupted_bench_resumes_to_the_rows_of_an_uninterrupted_run(tmp_path, tiny_folder):
    from rankkit.bench import BenchSettings, Setup, bench
    from rankkit.methods import Budget

    out = tmp_path / "rows.parquet"
    status, last_line, kept = _interrupt_bench(tiny_folder, out, signal.SIGINT)
    assert status == 130 and last_line.startswith(f"rankkit: interrupted: kept {kept} finished")
    resumed = subprocess.run(_bench_command(tiny_folder, out), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert out.is_file() and sorted(path.name for path in tmp_path.iterdir()) == ["rows.parquet"]
    uninterrupted = bench(
        BENCH["methods"].split(","),
        [Budget.from_keep(float(BENCH["keep"]))],
        BENCH["data"],
        settings=BenchSettings(
            max_new_tokens=BENCH["max_new_tokens"], warmup_runs=0, repeats=BENCH["repeats"]
        ),
        setup=Setup(model=str(tiny_folder), device="cpu", threads=1),
    )
    rows = pl.read_parquet(out)
    assert rows.height == 4 * 3
    assert rows.drop(TIMING_COLUMNS).equals(uninterrupted.drop(TIMING_COLUMNS))


def test_a_journal_of_other_settings_is_refused_and_overwrite_discards_it(tmp_path):
    out = tmp_path / "rows.parquet"
    first = outputs.Journal(out, {"methods": ["full", "claa"]})
    first.record("e0", [{"method": "full", "score": 1.0}])
    with pytest.raises(RankkitError, match="rows.parquet has an unfinished run with other settings"):
        outputs.Journal(out, {"methods": ["full", "fastkv"]})
    resumed = outputs.Journal(out, {"methods": ["full", "claa"]})
    assert resumed.done("e0") and resumed.rows == [{"method": "full", "score": 1.0}]
    assert outputs.Journal(out, {"methods": ["full", "fastkv"]}, overwrite=True).rows == []


def test_a_journal_line_cut_short_by_a_kill_is_redone_and_later_lines_survive(tmp_path):
    out = tmp_path / "rows.parquet"
    first = outputs.Journal(out, {"methods": ["full"]})
    first.record("e0", [{"score": 1.0}])
    with first.path.open("a") as journal:
        journal.write('{"key": "e1", "rows": [{"sco')
    second = outputs.Journal(out, {"methods": ["full"]})
    assert second.done("e0") and not second.done("e1")
    second.record("e1", [{"score": 0.5}])
    assert outputs.Journal(out, {"methods": ["full"]}).rows == [{"score": 1.0}, {"score": 0.5}]
