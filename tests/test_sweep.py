"""`rankkit sweep` on a tiny model folder: every stage through its library call, resume, refusals,
bad experiment files, and two gloo ranks giving the one-rank result."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from conftest import run_on_two_gloo_ranks
from polars.testing import assert_frame_equal

from rankkit import stores
from rankkit.errors import RankkitError
from rankkit.eval.compare import compare_store
from rankkit.eval.variance import variance_store
from rankkit.experiment import DATA_FIELDS, TABLE_FIELDS, TOP_FIELDS, parse_experiment
from rankkit.shards import interleave, share
from rankkit.sweep import sweep, tag_columns, unit_settings, units

EXPERIMENT = """
name = "tiny"
stages = ["capture", "oracle", "bench", "diffusion", "compare", "variance", "dashboard"]
keep = [0.2]

[model]
name = "{model}"
device = "cpu"

[[data]]
spec = "niah:n=2,length=256"

[[data]]
kind = "niah"
lengths = [192]
depths = [25, 75]

[oracle]
max_new_tokens = 4

[bench]
methods = ["full", "claa"]
max_new_tokens = 4
warmup = 0

[diffusion]
max_new_tokens = 4
limit = 1
"""
CELLS = ("niah-256", "niah-192")


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _files(root: Path) -> dict[str, int]:
    return {
        str(path.relative_to(root)): path.stat().st_mtime_ns for path in root.rglob("*") if path.is_file()
    }


@pytest.fixture(scope="module")
def experiment(tiny_folder, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("experiment")
    return _write(folder / "tiny.toml", EXPERIMENT.format(model=tiny_folder))


@pytest.fixture(scope="module")
def finished(experiment, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep") / "out"
    summary = sweep(experiment, out, workers=1)
    assert [(report.stage, report.ran, report.skipped) for report in summary.stages] == [
        (stage, 2, 0)
        for stage in ("capture", "oracle", "bench", "diffusion", "compare", "variance", "dashboard")
    ]
    stores_written = [out / "stores" / f"{cell}.zarr" for cell in CELLS]
    assert [report.outputs for report in summary.stages[:2]] == [stores_written, stores_written]
    assert [path.name for path in summary.stages[2].outputs] == ["bench.parquet"]
    return out


def _untagged(frame: pl.DataFrame, stage: str) -> pl.DataFrame:
    return frame.drop(tag_columns(stage))


def test_compare_and_variance_parquets_are_the_library_calls_on_each_store(finished):
    compared = {
        name: pl.read_parquet(finished / f"compare{name}.parquet") for name in ("", ".summary", ".pairs")
    }
    curves = pl.read_parquet(finished / "variance.parquet")
    for cell in CELLS:
        store = finished / "stores" / f"{cell}.zarr"
        direct = compare_store(store, keep=0.2, workers=1)
        mine = {name: frame.filter(pl.col("cell") == cell) for name, frame in compared.items()}
        # the unit's keep tag stands for compare's own keep column
        assert_frame_equal(_untagged(mine[""], "compare"), direct.per_layer.drop("keep"))
        assert_frame_equal(_untagged(mine[".summary"], "compare"), direct.summary.drop("keep"))
        assert mine[".summary"]["needle_keep"].unique().to_list() == [0.2]
        assert_frame_equal(_untagged(mine[".pairs"], "compare"), direct.pairs.drop("keep"))
        assert mine[""]["pruning_layer"].unique().to_list() == [direct.pruning_layer]
        assert mine[""]["budget"].unique().to_list() == ["keep=0.2"]
        assert mine[""]["layer_setting"].is_null().all()
        assert_frame_equal(
            _untagged(curves.filter(pl.col("cell") == cell), "variance"),
            variance_store(store, keep=0.2, workers=1).curves,
        )
    first = compared[""].filter(pl.col("cell") == "niah-192").row(0, named=True)
    assert (first["dataset"], first["data_length"], first["data"]) == (
        "niah",
        192,
        "niah:length=192,depths=25;75",
    )


def test_bench_diffusion_and_dashboards_cover_every_cell(finished, experiment):
    bench = pl.read_parquet(finished / "bench.parquet")
    diffusion = pl.read_parquet(finished / "diffusion.parquet")
    for cell in CELLS:
        ids = stores.open(finished / "stores" / f"{cell}.zarr").example_ids()
        rows = bench.filter(pl.col("cell") == cell)
        assert rows["example_id"].unique(maintain_order=True).to_list() == ids
        assert rows["method"].to_list() == ["full", "claa"] * len(ids)
        model = stores.open(finished / "stores" / f"{cell}.zarr").meta["model"]  # the bench's own model
        assert rows.select("model", "weights_hash").unique().rows() == [(model["id"], model["weights_hash"])]
        probed = diffusion.filter(pl.col("cell") == cell)
        assert probed["example"].unique().to_list() == ids[:1]  # limit = 1
        assert probed["layer"].to_list() == [0, 1, 2, 3]  # evidence removed from each layer on, and never
        assert probed.select("model", "weights_hash").unique().rows() == [(model["id"], model["weights_hash"])]
        page = (finished / "dashboards" / f"{cell}.html").read_text(encoding="utf-8")
        assert len(page) > 100_000
        assert "needle recall in each method's top 20%" in page  # compared at the file's keep = [0.2]
        assert "top 10%" not in page
        report = page.split('id="panel-report"')[1].split("</section>")[0]
        assert "<table" in report and "<td>claa</td>" in report  # the cell's bench joined with its store
    index = (finished / "dashboard.html").read_text(encoding="utf-8")
    assert all(f'href="dashboards/{cell}.html"' in index for cell in CELLS)
    assert (finished / "experiment.toml").read_text(encoding="utf-8") == experiment.read_text(
        encoding="utf-8"
    )


def test_rerun_skips_every_finished_unit_without_loading_a_model(finished, experiment, monkeypatch):
    from rankkit import models

    def refuse(*args, **kwargs):
        raise AssertionError("a finished sweep loaded a model")

    monkeypatch.setattr(models, "load", refuse)
    before = _files(finished)
    summary = sweep(experiment, finished, workers=1)
    assert all(report.ran == 0 and report.skipped == 2 for report in summary.stages)
    assert _files(finished) == before


def test_a_unit_lost_is_redone_alone_and_the_stage_output_rewritten(finished, experiment, tmp_path):
    expected = pl.read_parquet(finished / "compare.summary.parquet")
    for path in [*finished.glob("compare*.parquet"), *(finished / "parts/compare/niah-192").glob("*.done")]:
        path.unlink()
    summary = sweep(experiment, finished, stages=["compare"], workers=1)
    assert [(report.stage, report.ran, report.skipped) for report in summary.stages] == [("compare", 1, 1)]
    assert_frame_equal(pl.read_parquet(finished / "compare.summary.parquet"), expected)


@pytest.mark.parametrize(
    "kept",
    [{"pruning_layer": "1"}, {"pruning_layer": -1}, {"pruning_layer": True}, {"layer": 1}, [1], None],
)
def test_a_marker_whose_kept_tags_are_damaged_reruns_its_unit(finished, experiment, tmp_path, kept):
    """A marker keeps what the merge tags its unit's rows with (compare's pruning layer): one that no
    rankkit wrote is damaged, and its unit is redone, never merged under the tag it holds."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    expected = pl.read_parquet(out / "compare.summary.parquet")
    (path, *_) = sorted((out / "parts/compare/niah-192").glob("*.done"))
    marker = json.loads(path.read_text())
    assert marker["kept"] == {"pruning_layer": 1}
    path.write_text(json.dumps({**marker, "kept": kept}))
    summary = sweep(experiment, out, stages=["compare"], workers=1)
    assert [(report.stage, report.ran, report.skipped) for report in summary.stages] == [("compare", 1, 1)]
    assert_frame_equal(pl.read_parquet(out / "compare.summary.parquet"), expected)
    assert json.loads(path.read_text()) == marker


def test_a_run_that_would_redo_a_cell_under_results_it_does_not_redo_is_refused_before_any_work(
    finished, tiny_folder, tmp_path
):
    """Another file with one cell's capture changed and only capture to run recaptured the store and
    left the oracle's, compare's, variance's and the dashboard's results of the old one beside it; so
    did the same file edited, run with --stages capture."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    before = _files(out)
    edited = EXPERIMENT.format(model=tiny_folder).replace("depths = [25, 75]", "depths = [10, 50]")
    only_capture = edited.replace(
        '"capture", "oracle", "bench", "diffusion", "compare", "variance", "dashboard"', '"capture"'
    )
    refusal = r"redoes the capture stage of niah-192, from which the oracle results in .* were made; run oracle"
    with pytest.raises(RankkitError, match=refusal):
        sweep(_write(tmp_path / "other.toml", only_capture), out, workers=1)
    with pytest.raises(RankkitError, match=refusal):
        sweep(_write(tmp_path / "edited.toml", edited), out, stages=["capture"], workers=1)
    assert _files(out) == before


def test_a_rerun_remakes_a_damaged_stage_output_from_its_units(finished, experiment, tmp_path):
    """A cut compare.summary.parquet was kept by the rerun, which reported every unit finished."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    damaged = out / "compare.summary.parquet"
    damaged.write_bytes(damaged.read_bytes()[:100])
    summary = sweep(experiment, out, stages=["compare"], workers=1)
    assert [(report.ran, report.skipped, damaged in report.outputs) for report in summary.stages] == [(0, 2, True)]
    assert_frame_equal(pl.read_parquet(damaged), pl.read_parquet(finished / "compare.summary.parquet"))


@pytest.mark.parametrize("stage", ["compare", "dashboard"])
def test_a_damaged_record_of_what_an_output_was_made_of_remakes_the_output(finished, experiment, tmp_path, stage):
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    record = out / "parts" / stage / "merged.json"
    written = record.read_text()
    record.write_text(written[: len(written) // 2])
    summary = sweep(experiment, out, stages=[stage], workers=1)
    assert [(report.ran, report.skipped, len(report.outputs) > 0) for report in summary.stages] == [(0, 2, True)]
    assert record.read_text() == written
    if stage == "compare":
        assert_frame_equal(pl.read_parquet(out / "compare.parquet"), pl.read_parquet(finished / "compare.parquet"))


def test_an_interrupt_keeps_the_finished_units_and_the_rerun_finishes(
    finished, experiment, tmp_path, monkeypatch
):
    from rankkit.errors import Interrupted
    from rankkit.eval import compare

    out = tmp_path / "out"
    shutil.copytree(finished, out)
    expected = pl.read_parquet(out / "compare.parquet")
    for path in [*out.glob("compare*.parquet"), *(out / "parts/compare").rglob("*.done")]:
        path.unlink()
    calls = []
    real = compare.compare_store

    def ctrl_c_on_the_second(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(compare, "compare_store", ctrl_c_on_the_second)
    with pytest.raises(Interrupted, match=rf"kept in {out} the finished units of each stage \(compare 1\)"):
        sweep(experiment, out, stages=["compare"], workers=1)
    assert [path.parent.name for path in (out / "parts/compare").rglob("*.done")] == ["niah-256"]
    assert not (out / "compare.parquet").exists()
    monkeypatch.setattr(compare, "compare_store", real)
    summary = sweep(experiment, out, stages=["compare"], workers=1)
    assert [(report.ran, report.skipped) for report in summary.stages] == [(1, 1)]
    assert_frame_equal(pl.read_parquet(out / "compare.parquet"), expected)


def test_two_gloo_ranks_give_the_one_rank_result(finished, experiment, tmp_path):
    out = tmp_path / "sharded"
    done = run_on_two_gloo_ranks(
        29541,
        "sweep",
        experiment,
        "--out",
        out,
        "--workers",
        1,
        "--stages",
        "capture,oracle,bench,diffusion,compare",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for cell in CELLS:  # one store per cell, each example written by the rank whose share it is
        one, two = (stores.open(root / "stores" / f"{cell}.zarr") for root in (finished, out))
        assert one.example_ids() == two.example_ids()
        for example_id in one.example_ids():
            assert np.allclose(
                one.example(example_id).oracle, two.example(example_id).oracle, rtol=1e-5, atol=1e-7
            )
    deterministic = [
        "cell",
        "example_id",
        "method",
        "budget",
        "answer",
        "score",
        "selected_positions",
        "live_tokens",
    ]
    bench = [pl.read_parquet(root / "bench.parquet").select(deterministic) for root in (finished, out)]
    assert_frame_equal(*bench)
    assert_frame_equal(
        *(pl.read_parquet(root / "diffusion.parquet") for root in (finished, out)), rel_tol=1e-4
    )
    assert_frame_equal(*(pl.read_parquet(root / "compare.parquet") for root in (finished, out)), rel_tol=1e-4)
    assert not list((out / "parts").rglob("*.rank*"))  # merged, then removed


def test_a_rank_that_left_no_part_stops_the_merge_naming_it(finished, experiment, tmp_path):
    """Two ranks each had an example of the cell to bench; rank 1's part is missing, so merging
    rank 0's alone would drop its rows without a word."""
    from rankkit.experiment import read_experiment
    from rankkit.sweep import Layout, _merge, check, units

    out = tmp_path / "out"
    shutil.copytree(finished, out)
    plan = read_experiment(experiment)[0]
    layout = Layout(out)
    unit = units(plan, "bench")[0]
    part = layout.part("bench", unit)
    part.rename(layout.rank_part("bench", unit, 0, 2))
    layout.marker("bench", unit).unlink()
    (out / "bench.parquet").unlink()
    run = check(plan, layout, ("bench",), experiment)
    with pytest.raises(RankkitError, match=r"rank1-of-2.parquet is missing: rank 1 of 2 did not finish"):
        _merge(run, "bench", 2)
    assert not part.exists() and not (out / "bench.parquet").exists()


def test_another_experiment_runs_its_new_units_and_overwrite_starts_over(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path / "cache"))  # no cost model cached: no seconds
    small = (
        EXPERIMENT.format(model=tiny_folder)
        .split("[[data]]")[0]
        .replace(
            'stages = ["capture", "oracle", "bench", "diffusion", "compare", "variance", "dashboard"]',
            'stages = ["capture"]',
        )
    )
    first = _write(tmp_path / "a.toml", small + '[[data]]\nspec = "niah:n=1,length=128"\n')
    out = tmp_path / "out"
    sweep(first, out)
    renamed = _write(tmp_path / "b.toml", first.read_text().replace('name = "tiny"', 'name = "same"'))
    assert sweep(renamed, out).stages[0].skipped == 1  # the name is no part of what the outputs depend on
    more = _write(
        tmp_path / "more.toml",
        first.read_text().replace('stages = ["capture"]', 'stages = ["capture", "variance"]'),
    )
    grown = sweep(more, out)  # a stage added to the file keeps what the others finished
    assert [(report.stage, report.ran, report.skipped) for report in grown.stages] == [
        ("capture", 0, 1),
        ("variance", 1, 0),
    ]
    other = _write(tmp_path / "c.toml", first.read_text().replace("length=128", "length=160"))
    plans = []
    moved = sweep(other, out, announce=plans.append)  # another cell: its units are new, it alone runs
    assert [stage.line() for stage in plans[0].stages] == [
        "capture: 1 new, 0 changed, 0 kept; 1 examples, 160 prompt tokens through the model"
    ]
    assert [(report.stage, report.ran, report.skipped) for report in moved.stages] == [("capture", 1, 0)]
    assert sorted(path.name for path in (out / "stores").iterdir()) == ["niah-128.zarr", "niah-160.zarr"]
    sweep(other, out, overwrite=True)  # discards what the sweeps wrote, and starts over
    assert sorted(path.name for path in (out / "stores").iterdir()) == ["niah-160.zarr"]
    assert "length=160" in (out / "experiment.toml").read_text()


def test_a_stage_whose_input_is_missing_is_refused_before_any_work(experiment, tmp_path):
    with pytest.raises(RankkitError, match="stage compare needs the capture stage's output"):
        sweep(experiment, tmp_path / "out", stages=["compare"])
    with pytest.raises(RankkitError, match="--stages explore is not a stage of"):
        sweep(experiment, tmp_path / "out", stages=["explore"])
    with pytest.raises(RankkitError, match="^--stages names capture twice; name each stage once$"):
        sweep(experiment, tmp_path / "out", stages=["capture", "capture"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("[diffusion]", "[compare]\nspann = 1\n[diffusion]"),
            r"\[compare\]: unknown field 'spann' \(did you mean span\?\)",
        ),
        (('"dashboard"]', '"dashbord"]'), "unknown stage 'dashbord' in stages; choose from capture"),
        (
            ("keep = [0.2]", 'keep = "0.2"'),
            r'keep must be a number or a list of numbers, not "0.2"; e.g. keep = \[',
        ),
        (("depths = [25, 75]", "depths = [25, 175]"), r"\[\[data\]\] #2: depths must be percentages"),
        (
            ("n=2,length=256", "n=2,length=9999"),
            "more than the model's 512 positions; shorten it, or pass allow_overlength = true in "
            r"\[model\] to run it anyway$",
        ),
        (
            ('"capture", "oracle",', '"capture",'),
            r'\[compare\]: oracle: compare ranks against the oracle, which no stage makes; add "oracle" to '
            r"stages, or set oracle = false in \[compare\]",
        ),
        (
            ("keep = [0.2]", 'keep = [0.2]\nprobes = "window"'),
            r"\[variance\]: method 'asl' reads the probe window:w=32, which probes \(window\) does not "
            'capture; add "window:w=32" to probes',
        ),
        (
            ("[oracle]", '[capture]\ndraft = "layers:9"\n[oracle]'),
            r"draft: 'layers:9' needs a layer count in 1..3",
        ),
        (('device = "cpu"', 'device = "gpu"'), r"\[model\]: unknown device 'gpu': use auto, cpu, cuda"),
        (("keep = [0.2]", "keep = [0.2, 0.2]"), "keep lists 0.2 twice; name each once"),
        (("keep = [0.2]", "keep = [0.2]\nlayers = [1, 1]"), "layers lists 1 twice; name each once"),
        (
            ("keep = [0.2]", "keep = [0.2, 0.20000000000000001]"),
            "keep lists 0.2 twice",  # the same float once read
        ),
        (
            ("keep = [0.2]", "keep = [0.1, 0.10000001]"),
            r"keep: two budgets both read keep=0.1 \(keep=0.1 and keep=0.10000001\); name each once$",
        ),
        (
            ('spec = "niah:n=2,length=256"', f'spec = "niah:n=2,length=256"\nname = "{"x" * 300}"'),
            r"cell name 'x{40}\.\.\.' is not a file name; use at most 100 letters",
        ),
        (  # an empty name was taken as none given: the cell ran under the default name
            ('spec = "niah:n=2,length=256"', 'spec = "niah:n=2,length=256"\nname = ""'),
            r"\[\[data\]\] #1: cell name '' is not a file name; use at most 100 letters",
        ),
        (
            ("depths = [25, 75]", "n = 9223372036854775807"),
            "'niah:n=9223372036854775807,length=192' makes 9223372036854775807 examples, more than the "
            "100000 units a sweep takes on; lower n, or raise the limit with --max-units",
        ),
        (
            ('spec = "niah:n=2,length=256"', 'spec = "niah:length=192,depths=25;75"\nname = "again"'),
            r"\[\[data\]\] #2: 'niah:length=192,depths=25;75' is a cell already; name each data spec once",
        ),
        (("limit = 1", "limit = 0"), r"\[diffusion\]: limit must be at least 1"),
        (
            ("warmup = 0", "warmup = 0\ncompile_decode = true"),
            r"\[bench\]: compile_decode compiles the static-cache decode step: add cuda_graphs$",
        ),
        (  # as capture would refuse it, after writing the sweep's files
            ("n=2,length=256", "n=2,length=10"),
            "cell niah-10: length=10 is too short for this task: its smallest prompt takes",
        ),
        (("keep = [0.2]", "keep = []"), r"keep is an empty list; name at least one, e.g. keep = \["),
        (("keep = [0.2]", "keep = [0.2]\nlayers = [3]"), "layers: 3 is not a layer of this model"),
        (
            ("[diffusion]", '[compare]\nmethods = ["claa:deferred_layers=50"]\n[diffusion]'),
            r"\[compare\]: method 'claa': deferred_layers=50 is outside \[0, 3\]",
        ),
        (
            ("[diffusion]", '[compare]\noracle = false\npairs = ["claa:fastkv"]\n[diffusion]'),
            r"\[compare\]: pairs tests differences of Spearman with the oracle, which oracle = false in \[compare\] "
            "leaves out; drop pairs or compare with the oracle$",
        ),
        (  # a zero difference on every example, tested and printed as a finding
            ("[diffusion]", '[compare]\nmethods = ["claa", "fastkv"]\npairs = ["claa:claa"]\n[diffusion]'),
            r"\[compare\]: pairs claa:claa pairs claa with itself; pair two different methods, e.g. pairs claa:fastkv$",
        ),
        (
            ("[diffusion]", "[compare]\nneedle_keep = 1.5\n[diffusion]"),
            r"\[compare\]: needle_keep 1.5 is neither a keep rate in \(0, 1\] nor a positive token count; "
            "give e.g. 0.1 or 2048$",
        ),
        (
            ("max_new_tokens = 4\n\n[bench]", "max_new_tokens = 4\nkernel = 4\n\n[bench]"),
            r"\[oracle\]: kernel must be a positive odd integer \(length-preserving pooling\), not 4$",
        ),
        (  # OracleOptions's own check, as the Python API and the command line refuse it
            ("max_new_tokens = 4\n\n[bench]", "max_new_tokens = 0\n\n[bench]"),
            r"\[oracle\]: max_new_tokens must be a whole number >= 1, got 0$",
        ),
        (
            ("[diffusion]", '[compare]\nmethods = ["sliminfer:gamma=5"]\n[diffusion]'),
            r"method 'sliminfer': gamma=5 is outside \[0, 1\]",
        ),
    ],
)
def test_a_bad_experiment_is_one_line_naming_the_fix(experiment, tmp_path, edit, message):
    old, new = edit
    assert old in experiment.read_text()
    bad = _write(tmp_path / "bad.toml", experiment.read_text().replace(old, new, 1))
    with pytest.raises(RankkitError, match=message) as refused:
        sweep(bad, tmp_path / "out")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_the_command_exits_2_without_a_traceback_and_writes_nothing(tmp_path):
    bad = _write(tmp_path / "bad.toml", 'stages = ["capture"]\n[[data]]\nspec = "haystack:n=1"\n')
    done = subprocess.run(
        [sys.executable, "-m", "rankkit.cli", "sweep", str(bad), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"rankkit: error: {bad} [[data]] #1: unknown data kind 'haystack'")
    )
    assert not (tmp_path / "out").exists()


def test_docs_show_every_field_with_its_example():
    text = (Path(__file__).parents[1] / "docs" / "sweeps.md").read_text(encoding="utf-8")
    fields = [
        *TOP_FIELDS.values(),
        *DATA_FIELDS.values(),
        *(f for table in TABLE_FIELDS.values() for f in table.values()),
    ]
    missing = [field.example for field in fields if field.example not in text]
    assert not missing
    assert all(f"### `[{table}]`" in text for table in TABLE_FIELDS)


def test_interleave_undoes_share():
    items = list(range(7))
    assert interleave([share(items, rank, 3) for rank in range(3)]) == items
    assert interleave([share(items, rank, 9) for rank in range(9)]) == items


def test_a_sweep_inside_a_store_is_refused_before_it_writes(experiment, tmp_path):
    """--out inside a capture store got the sweep's stores, parts and manifest written among its examples."""
    store = tmp_path / "s.zarr"
    stores.create(store, {"model": "a"})
    with pytest.raises(RankkitError, match=rf"^--out {re.escape(str(store / 'sweep'))} is inside the rankkit store"):
        sweep(experiment, store / "sweep")
    assert not (store / "sweep").exists()


def test_a_store_as_the_sweeps_directory_is_refused_before_it_writes_even_with_overwrite(experiment, tmp_path):
    """--out a store with --overwrite passed the emptiness check, and the sweep wrote its manifest, experiment
    and parts among the store's examples before the first cell store was refused."""
    store = tmp_path / "s.zarr"
    stores.create(store, {"model": "a"})
    before = sorted(path.relative_to(store) for path in store.rglob("*"))
    with pytest.raises(RankkitError, match=rf"^--out {re.escape(str(store))} is inside the rankkit store"):
        sweep(experiment, store, overwrite=True)
    assert sorted(path.relative_to(store) for path in store.rglob("*")) == before


def test_unreadable_and_empty_experiments_are_one_line(tmp_path):
    latin = tmp_path / "latin.toml"
    latin.write_bytes('stages = ["capture"]\nname = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(RankkitError, match=rf"^{latin} is not UTF-8 \(byte 33\); save it as UTF-8$"):
        sweep(latin, tmp_path / "out")
    locked = _write(tmp_path / "locked.toml", 'stages = ["capture"]\n')
    real_open = Path.open

    def refusing_open(self, *args, **kwargs):  # chmod 000 refuses anyone but root
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:  # an OSError traceback before
        patch.setattr(Path, "open", refusing_open)
        with pytest.raises(RankkitError, match=rf"^cannot read {locked} \(Permission denied\); check that it is"):
            sweep(locked, tmp_path / "out")
    empty = _write(tmp_path / "empty.toml", 'stages = ["capture"]\ndata = []\n')
    with pytest.raises(RankkitError, match="write each data entry as a \\[\\[data\\]\\] table"):
        sweep(empty, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_nearly_equal_keep_rates_are_units_of_their_own_unless_they_print_alike():
    grid = 'stages = ["compare"]\nkeep = [0.2, {}]\n[[data]]\nspec = "niah:n=1,length=128"\n'
    plan = parse_experiment(grid.format("0.200001"), source="grid.toml", default_name="grid")
    assert [unit.variant for unit in units(plan, "compare")] == [
        "keep=0.2_layer=own",
        "keep=0.200001_layer=own",
    ]
    assert [unit.tags()["budget"] for unit in units(plan, "compare")] == ["keep=0.2", "keep=0.200001"]
    # printed to 6 digits (compare's table, the dashboards' heatmaps) these two are one rate
    with pytest.raises(RankkitError) as refused:
        parse_experiment(grid.format("0.2000001"), source="grid.toml", default_name="grid")
    assert str(refused.value) == (
        "grid.toml: keep: two budgets both read keep=0.2 (keep=0.2 and keep=0.2000001); name each once"
    )


def test_a_huge_grid_is_refused_building_only_the_first_example_of_its_shortest_cell(
    tiny_folder, tmp_path, monkeypatch
):
    import rankkit.sweep

    built = []
    real = rankkit.sweep.load_examples

    def counted(spec, tokenizer):
        built.append(spec)
        return real(spec, tokenizer)

    monkeypatch.setattr(rankkit.sweep, "load_examples", counted)
    lengths = ", ".join(str(128 + step) for step in range(56))
    grid = _write(
        tmp_path / "grid.toml",
        f'stages = ["capture", "oracle"]\n[model]\nname = "{tiny_folder}"\n'
        f'[[data]]\nkind = "niah"\nlengths = [{lengths}]\nn = 500\n',
    )
    with pytest.raises(RankkitError) as refused:
        sweep(grid, tmp_path / "out", max_units=50_000)
    assert str(refused.value) == (
        f"{grid}: the grid holds 56,000 units of work (an example through a model stage, a unit of another "
        "stage), more than 50,000; shrink it, or raise the limit with --max-units"
    )
    plans = []
    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path / "cache"))  # no cost model cached
    summary = sweep(grid, tmp_path / "out", max_units=56_000, dry_run=True, announce=plans.append)
    assert summary.stages == [] and not (tmp_path / "out").exists()
    assert plans[0].lines()[1:-1] == [
        "  capture: 56 new, 0 changed, 0 kept; 28,000 examples, 4,354,000 prompt tokens through the model",
        "  oracle: 56 new, 0 changed, 0 kept; 28,000 examples, 4,354,000 prompt tokens through the model",
        "  in all 8,708,000 prompt tokens through the model",
    ]
    assert plans[0].lines()[-1].startswith("  no cost model cached for prompts this long on this model: run `rankkit prefill")
    assert built == ["niah:n=1,length=128,seed=0"] * 2  # a length too short would show there, once a call


def test_overwrite_removes_only_what_the_sweep_wrote(tiny_folder, tmp_path):
    out = tmp_path / "hazard"
    precious = out / "stores" / "precious.zarr"
    precious.mkdir(parents=True)
    (precious / "zarr.json").write_text("{}")
    small = _write(
        tmp_path / "small.toml",
        f'stages = ["capture"]\n[model]\nname = "{tiny_folder}"\n[[data]]\nspec = "niah:n=1,length=128"\n',
    )
    with pytest.raises(RankkitError, match=f"{out} is not empty and holds no sweep; choose another --out"):
        sweep(small, out)
    sweep(small, out, overwrite=True)  # writes beside what is there
    assert sorted(path.name for path in (out / "stores").iterdir()) == ["niah-128.zarr", "precious.zarr"]
    sweep(small, out, overwrite=True)  # removes its own store, keeps the other
    assert (precious / "zarr.json").read_text() == "{}"
    assert json.loads((out / "manifest.json").read_text()) == [
        "experiment.toml",
        "manifest.json",
        "parts",
        "stores/niah-128.zarr",
    ]
    # parts is the sweep's whole: a file of the user's put there is refused, not removed with it
    cell = out / "parts" / "capture" / "niah-128"
    for mine, named in ((out / "parts" / "mine.txt", None), (cell / "x" / "keep.txt", cell / "x")):
        mine.parent.mkdir(parents=True, exist_ok=True)
        mine.write_text("mine")
        named = re.escape(str(named or mine))
        with pytest.raises(RankkitError, match=f"^{named} is in the sweep's parts but no sweep wrote it"):
            sweep(small, out, overwrite=True)
        assert mine.read_text() == "mine"
        mine.unlink()
    (cell / "x").rmdir()
    # a store of the sweep's is removed by the store's rule, as capture --overwrite removes it: it was removed
    # whole, a file of the user's in it included; refused before anything is removed
    store = out / "stores" / "niah-128.zarr"
    mine = store / "my_analysis.csv"
    mine.write_text("mine")
    with pytest.raises(RankkitError) as refused:
        sweep(small, out, overwrite=True)
    assert str(refused.value) == (
        f"{store} holds {mine}, which rankkit did not write; refusing to delete it; move it away or choose "
        "another --out"
    )
    assert mine.read_text() == "mine" and (out / "parts" / "capture").is_dir() and (store / "examples").is_dir()
    mine.unlink()
    foreign = tmp_path / "foreign"
    (foreign / "parts").mkdir(parents=True)
    with pytest.raises(RankkitError) as refused:
        sweep(small, foreign, overwrite=True)
    assert str(refused.value) == (
        f"{foreign / 'parts'} is in the way: the sweep writes there but did not make it; move it away, or "
        "choose another --out"
    )
    assert sorted(path.name for path in foreign.iterdir()) == ["parts"]


def test_overwrite_refuses_a_result_the_user_put_in_a_results_place_before_removing_anything(
    finished, experiment, tmp_path
):
    """--overwrite removed every file the manifest lists, a table or page of the user's at that name
    included, where every other command's --overwrite replaces only what rankkit wrote."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    page = next((out / "dashboards").glob("*.html"))
    for mine in (out / "compare.parquet", page):
        original = mine.read_bytes()
        if mine.suffix == ".parquet":
            pl.DataFrame({"mine": [1]}).write_parquet(mine)
        else:
            mine.write_text("<html>my notes</html>")
        kept = mine.read_bytes()
        with pytest.raises(RankkitError) as refused:
            sweep(experiment, out, overwrite=True)
        assert str(refused.value) == (
            f"{mine} was not written by rankkit, and --overwrite replaces only what rankkit wrote; move it away "
            "or choose another --out"
        )
        assert mine.read_bytes() == kept and (out / "variance.parquet").is_file() and (out / "stores").is_dir()
        mine.write_bytes(original)


def test_a_keep_rate_added_runs_at_that_rate_alone_and_reuses_the_stores(
    finished, experiment, tmp_path, monkeypatch
):
    from rankkit import models

    out = tmp_path / "out"
    shutil.copytree(finished, out)
    before = pl.read_parquet(out / "compare.summary.parquet")
    grown = _write(
        tmp_path / "grown.toml", experiment.read_text().replace("keep = [0.2]", "keep = [0.2, 0.4]")
    )
    plans = []
    sweep(grown, out, dry_run=True, announce=plans.append)
    assert plans[0].lines()[-1] == "  no estimate in seconds for bench"  # cost model or not
    assert (
        plans[0].lines()[:-1]
        == [
            f"plan for {out}:",
            "  capture: 0 new, 0 changed, 2 kept",
            "  oracle: 0 new, 0 changed, 2 kept",
            "  bench: 0 new, 2 changed, 0 kept; 4 examples, 896 prompt tokens through the model",  # runs every rate
            "  diffusion: 0 new, 0 changed, 2 kept",
            "  compare: 2 new, 0 changed, 2 kept",
            "  variance: 2 new, 0 changed, 2 kept",
            "  dashboard: 0 new, 2 changed, 0 kept",  # it shows bench's rows
            "  in all 896 prompt tokens through the model",
        ]
    )

    def refuse(*args, **kwargs):
        raise AssertionError("a keep rate added to compare and variance loaded a model")

    monkeypatch.setattr(models, "load", refuse)
    summary = sweep(grown, out, stages=["compare", "variance"], workers=1)
    assert [(report.stage, report.ran, report.skipped) for report in summary.stages] == [
        ("compare", 2, 2),
        ("variance", 2, 2),
    ]
    after = pl.read_parquet(out / "compare.summary.parquet")
    assert sorted(after["keep"].unique().to_list()) == [0.2, 0.4]
    assert_frame_equal(after.filter(pl.col("keep") == 0.2), before)
    marker = json.loads((out / "parts/compare/niah-256/keep=0.4_layer=own.done").read_text())
    assert marker["rankkit_version"] == "0.1.0"
    assert marker["settings"]["compare"]["keep"] == 0.4 and marker["settings"]["compare"]["span"] == "prompt"
    assert marker["settings"]["capture"]["data"] == "niah:n=2,length=256"
    assert marker["settings"]["oracle"]["max_new_tokens"] == 4


def test_a_dashboard_is_redrawn_when_the_stages_it_shows_change(finished, experiment, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    fewer = _write(tmp_path / "fewer.toml", experiment.read_text().replace('"diffusion", ', ""))
    plans = []
    sweep(fewer, out, dry_run=True, announce=plans.append)
    assert plans[0].lines()[-2] == "  dashboard: 0 new, 2 changed, 0 kept"


def test_a_store_at_a_cells_path_seeds_it_and_one_model_load_serves_every_unit(
    finished, tiny_folder, tmp_path, monkeypatch
):
    from rankkit import models

    loads = []
    real = models._load
    monkeypatch.setattr(models, "_load", lambda *args: loads.append(args) or real(*args))
    out = tmp_path / "out"
    (out / "stores").mkdir(parents=True)
    shutil.copytree(finished / "stores" / "niah-256.zarr", out / "stores" / "niah-256.zarr")
    seeded = {path: path.stat().st_mtime_ns for path in (out / "stores").rglob("*.zip")}
    grid = _write(
        tmp_path / "grid.toml",
        EXPERIMENT.format(model=tiny_folder)
        .replace('"bench", ', "")
        .replace('"compare", "variance", "dashboard"', '"compare"'),
    )
    summary = sweep(grid, out, overwrite=True, workers=1)  # --overwrite: the folder holds no sweep yet
    assert [(report.stage, report.ran) for report in summary.stages] == [
        ("capture", 2),
        ("oracle", 2),
        ("diffusion", 2),
        ("compare", 2),
    ]
    assert {path: path.stat().st_mtime_ns for path in seeded} == seeded  # the seed's examples were kept
    assert len(loads) == 1  # capture of both cells and diffusion of both: one load


def test_a_disk_without_room_for_the_stores_is_refused_before_any_work(tiny_folder, tmp_path, monkeypatch):
    import shutil as disk

    from rankkit import outputs

    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: disk._ntuple_diskusage(10**6, 10**6, 1000))
    small = _write(
        tmp_path / "small.toml",
        f'stages = ["capture"]\n[model]\nname = "{tiny_folder}"\n[[data]]\nspec = "niah:n=1,length=128"\n',
    )
    with pytest.raises(RankkitError) as refused:
        sweep(small, tmp_path / "out")
    # 128 tokens x 3 layers x 2 KV heads x 6 probes x 4 bytes
    assert str(refused.value) == (
        f"{tmp_path / 'out'} needs about 18.0 KiB but {tmp_path} has 1000 bytes free; free some space or "
        "choose another --out"
    )
    assert sorted(tmp_path.iterdir()) == [small]


def test_a_second_sweep_into_a_directory_being_written_is_refused(tiny_folder, tmp_path):
    """Nothing stopped it: its --overwrite removed the stores and parts the first was writing."""
    import fcntl

    small = _write(
        tmp_path / "small.toml",
        f'stages = ["capture"]\n[model]\nname = "{tiny_folder}"\n[[data]]\nspec = "niah:n=1,length=128"\n',
    )
    out = tmp_path / "out"
    out.mkdir()
    first = os.open(out, os.O_RDONLY)  # a sweep writing there holds this
    try:
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RankkitError, match=f"^another rankkit sweep is writing {re.escape(str(out))}; wait"):
            sweep(small, out, overwrite=True, workers=1)
        assert not any(out.iterdir())
    finally:
        os.close(first)
    assert sweep(small, out, overwrite=True, workers=1).stages[0].ran == 1


def test_a_jsonl_file_whose_lines_changed_reruns_its_units(tiny_folder, tmp_path):
    """Units were keyed by the spec string alone: a resumed sweep kept results of the old lines
    beside the new ones under one data name."""
    from transformers import AutoTokenizer

    from rankkit.data import export_spec

    data = tmp_path / "mine.jsonl"
    export_spec("niah:n=2,length=128", AutoTokenizer.from_pretrained(tiny_folder), data)
    small = _write(
        tmp_path / "small.toml",
        f'stages = ["capture"]\n[model]\nname = "{tiny_folder}"\n[[data]]\nspec = "{data}"\n',
    )
    out = tmp_path / "out"
    assert sweep(small, out, workers=1).stages[0].ran == 1
    plans = []
    sweep(small, out, dry_run=True, announce=plans.append)
    assert plans[0].lines()[1].startswith("  capture: 0 new, 0 changed, 1 kept")
    export_spec("niah:n=2,length=128,seed=1", AutoTokenizer.from_pretrained(tiny_folder), data, overwrite=True)
    sweep(small, out, dry_run=True, announce=plans.append)
    assert plans[1].lines()[1].startswith("  capture: 0 new, 1 changed, 0 kept")


def test_a_changed_setting_reruns_exactly_the_units_it_decides(finished, experiment, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    changed = _write(tmp_path / "changed.toml", experiment.read_text() + '\n[compare]\nspan = "context"\n')
    plans = []
    summary = sweep(changed, out, stages=["compare"], workers=1, announce=plans.append)
    assert plans[0].lines() == [
        f"plan for {out}:",
        "  compare: 0 new, 2 changed, 0 kept",
        "  no model stage to run",
    ]
    assert [(report.stage, report.ran, report.skipped) for report in summary.stages] == [("compare", 2, 0)]
    expected = compare_store(out / "stores" / "niah-192.zarr", keep=0.2, span="context", workers=1).summary
    rows = pl.read_parquet(out / "compare.summary.parquet").filter(pl.col("cell") == "niah-192")
    # the unit's keep tag stands for compare's own keep column
    assert_frame_equal(_untagged(rows, "compare"), expected.drop("keep"), check_dtypes=False)
    assert sweep(changed, out, stages=["compare"], workers=1).stages[0].skipped == 2


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_folder, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from rankkit.cli import commands  # noqa: F401  (registers every command)
    from rankkit.cli.app import app

    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path / "cache"))  # no cost model cached
    small = _write(
        tmp_path / "small.toml",
        f'stages = ["capture", "variance"]\n[model]\nname = "{tiny_folder}"\n[[data]]\nspec = "niah:n=3,length=128"\n',
    )
    out = tmp_path / "out"
    shown = CliRunner().invoke(app, ["sweep", str(small), "--out", str(out), "--dry-run"])
    assert shown.exit_code == 0, shown.output
    calibrate = (
        f"rankkit prefill --method full --model {tiny_folder} --device cpu --threads {torch.get_num_threads()} "
        "--data niah:n=3,length=128"
    )
    assert shown.stdout.splitlines() == [
        f"plan for {out}:",
        "  capture: 1 new, 0 changed, 0 kept; 3 examples, 384 prompt tokens through the model",
        "  variance: 1 new, 0 changed, 0 kept",
        "  in all 384 prompt tokens through the model",
        f"  no cost model cached for prompts this long on this model: run `{calibrate}` once to calibrate",
    ]
    as_json = CliRunner().invoke(app, ["sweep", str(small), "--out", str(out), "--dry-run", "--json"])
    assert json.loads(as_json.stdout) == {
        "stages": [
            {
                "stage": "capture",
                "new": 1,
                "changed": 0,
                "kept": 0,
                "examples": 3,
                "tokens": 384,
                "seconds": None,
            },
            {
                "stage": "variance",
                "new": 1,
                "changed": 0,
                "kept": 0,
                "examples": 0,
                "tokens": 0,
                "seconds": None,
            },
        ],
        "seconds": None,
        "calibrate": calibrate,
    }
    assert not out.exists()


def test_dry_run_estimates_seconds_from_the_cached_cost_model_without_loading_a_model(
    tiny_folder, tmp_path, monkeypatch
):
    from typer.testing import CliRunner

    from rankkit import model_cache, models
    from rankkit.cli import commands  # noqa: F401  (registers every command)
    from rankkit.cli.app import app
    from rankkit.methods.measure import calibration_path

    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path / "cache"))
    grown = _write(
        tmp_path / "grown.toml",
        f'stages = ["capture", "oracle", "variance"]\n[model]\nname = "{tiny_folder}"\n'
        '[[data]]\nspec = "niah:n=1,length=96"\n[[data]]\nspec = "niah:n=3,length=128"\n',  # 96: not too short
    )
    weights_hash = model_cache.folder_weights_hash(tiny_folder)  # remembered in the cache, as a load leaves it
    monkeypatch.setattr(models, "load", lambda *args, **kwargs: pytest.fail("--dry-run loaded a model"))
    out = tmp_path / "out"

    def dry_run(*flags: str):
        shown = CliRunner().invoke(app, ["sweep", str(grown), "--out", str(out), "--dry-run", *flags])
        assert shown.exit_code == 0, shown.output
        return shown.stdout

    calibrate = (  # on the longest prompts, of the second cell
        f"rankkit prefill --method full --model {tiny_folder} --device cpu --threads {torch.get_num_threads()} "
        "--data niah:n=3,length=128"
    )
    uncached = f"  no cost model cached for prompts this long on this model: run `{calibrate}` once to calibrate"
    assert dry_run().splitlines()[-1] == uncached
    assert json.loads(dry_run("--json"))["seconds"] is None  # no estimate: it read 0 s
    refused = CliRunner().invoke(app, ["sweep", str(grown), "--out", str(out), "--dry-run", "--workers", "0"])
    assert str(refused.exception).startswith("--workers must be a whole number")  # before any stage runs
    # a = 1/128 s per token per layer, b = 1/16384 s per query-key pair per layer; the tiny model has
    # 3 layers. Capture: 3 x (1/128 x (3 x 128 + 96) + 1/16384 x (3 x 128² + 96²)) = 3 x (3.75 + 3.5625) s.
    path = calibration_path(weights_hash, torch.device("cpu"))
    path.parent.mkdir(parents=True)
    fit = {"linear": 1 / 128, "quadratic": 1 / 16384, "samples": [[116, 1.0]]}
    path.write_text(json.dumps(fit))  # as an older rankkit cached it, without the FLOP shares
    assert dry_run().splitlines()[-1] == uncached
    shares = {"ffn_share": 0.7, "head_layers": 2.0}
    path.write_text(json.dumps(fit | shares | {"samples": [[115, 1.0]]}))  # 115 < 0.9 x 128
    assert dry_run().splitlines()[-1] == uncached
    path.write_text(json.dumps(fit | shares))
    assert dry_run().splitlines() == [
        f"plan for {out}:",
        "  capture: 2 new, 0 changed, 0 kept; 4 examples, 480 prompt tokens through the model, "
        "about 21.9 s (one full prefill per example)",
        "  oracle: 2 new, 0 changed, 0 kept; 4 examples, 480 prompt tokens through the model",
        "  variance: 2 new, 0 changed, 0 kept",
        "  in all 960 prompt tokens through the model",
        "  about 21.9 s estimated from the cached cost model; oracle not estimated",
    ]
    plan = json.loads(dry_run("--json"))
    assert plan["seconds"] == 21.9375 and plan["calibrate"] is None
    assert [stage["seconds"] for stage in plan["stages"]] == [21.9375, None, None]
    assert not out.exists()


def test_the_suggested_calibration_runs_the_longest_prompt_of_a_file(tiny_folder, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from rankkit.cli import commands  # noqa: F401  (registers every command)
    from rankkit.cli.app import app

    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path / "cache"))
    examples = tmp_path / "mine.jsonl"
    examples.write_text(
        "".join(
            json.dumps({"id": name, "context": context, "question": "Code?", "answers": "4417"}) + "\n"
            for name, context in [("a", "The code is 4417."), ("b", "Cats purr. " * 20 + "The code is 4417.")]
        )
    )
    plan = _write(
        tmp_path / "file.toml",
        f'stages = ["capture"]\n[model]\nname = "{tiny_folder}"\n[[data]]\nspec = "niah:n=1,length=96"\n'
        f'[[data]]\nspec = "{examples}"\n',
    )
    shown = CliRunner().invoke(app, ["sweep", str(plan), "--out", str(tmp_path / "out"), "--dry-run", "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["calibrate"] == (
        f"rankkit prefill --method full --model {tiny_folder} --device cpu --threads {torch.get_num_threads()} "
        f"--data {examples} --example 1"
    )


def test_a_stage_that_refuses_as_it_runs_names_the_files_fields(tiny_folder, tmp_path):
    from rankkit.capture import capture

    out = tmp_path / "out"
    store = out / "stores" / "niah-128.zarr"
    capture(model=str(tiny_folder), data="niah:n=1,length=128", out=store, device="cpu")  # no oracle
    seeded = _write(
        tmp_path / "seeded.toml",
        f'stages = ["compare"]\n[model]\nname = "{tiny_folder}"\n[[data]]\nspec = "niah:n=1,length=128"\n',
    )
    with pytest.raises(RankkitError) as refused:
        sweep(seeded, out, overwrite=True, workers=1)  # --overwrite: the folder holds no sweep yet
    assert str(refused.value) == (
        f"{seeded}: store {store} has no oracle; run `rankkit oracle {store}` first (or pass oracle = false "
        "in [compare])"
    )


def test_a_bench_interrupted_then_edited_reruns_that_unit_alone_with_its_new_settings(
    tiny_folder, tmp_path, monkeypatch
):
    from rankkit import outputs
    from rankkit.errors import Interrupted

    text = (
        f'stages = ["capture", "bench"]\nkeep = [0.2]\n[model]\nname = "{tiny_folder}"\ndevice = "cpu"\n'
        '[[data]]\nspec = "niah:n=2,length=128"\n[bench]\nmethods = ["full", "claa"]\nwarmup = 0\n'
        "max_new_tokens = 1\n"
    )
    first = _write(tmp_path / "first.toml", text)
    edited = _write(tmp_path / "edited.toml", text.replace("max_new_tokens = 1", "max_new_tokens = 3"))
    out = tmp_path / "out"
    real = outputs.Journal.record

    def ctrl_c_after_the_first_example(journal, key, rows):
        real(journal, key, rows)
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs.Journal, "record", ctrl_c_after_the_first_example)
    with pytest.raises(Interrupted):
        sweep(first, out, workers=1)
    monkeypatch.setattr(outputs.Journal, "record", real)
    assert list((out / "parts/bench/niah-128").glob(".*.unfinished.jsonl"))
    store = _files(out / "stores")
    plans = []
    summary = sweep(edited, out, workers=1, announce=plans.append)
    assert plans[0].lines()[1:3] == [
        "  capture: 0 new, 0 changed, 1 kept",
        "  bench: 0 new, 1 changed, 0 kept; 2 examples, 256 prompt tokens through the model",
    ]
    assert [(report.stage, report.ran, report.skipped) for report in summary.stages] == [
        ("capture", 0, 1),
        ("bench", 1, 0),
    ]
    assert _files(out / "stores") == store  # the store of the unchanged capture is kept
    rows = pl.read_parquet(out / "bench.parquet")
    assert rows.height == 4 and set(rows["new_tokens"]) == {3}  # no row of the first settings
    assert (out / "experiment.toml").read_text() == edited.read_text()


def test_variance_thresholds_are_a_field_as_they_are_an_option():
    """variance_store's thresholds were the Python API's alone: the file and --thresholds name them too,
    and a unit run with others is changed."""
    grid = 'stages = ["variance"]\nkeep = [0.2]\n[[data]]\nspec = "niah:n=1,length=128"\n[variance]\n{}'
    plan = parse_experiment(grid.format("thresholds = [0.25, 0.5]"), source="grid.toml", default_name="grid")
    assert plan.variance.kwargs() == {"thresholds": (0.25, 0.5)}
    (unit,) = units(plan, "variance")
    default = parse_experiment(grid.format(""), source="grid.toml", default_name="grid")
    assert unit_settings(plan, "variance", unit) != unit_settings(default, "variance", unit)
    with pytest.raises(RankkitError, match="thresholds"):
        parse_experiment(grid.format('thresholds = ["high"]'), source="grid.toml", default_name="grid")
    # checked as --thresholds is, named as the file's field
    with pytest.raises(RankkitError, match=re.escape("grid.toml [variance]: thresholds nan is not a number")):
        parse_experiment(grid.format("thresholds = [0.3, nan]"), source="grid.toml", default_name="grid")
    with pytest.raises(RankkitError, match=re.escape("grid.toml [variance]: thresholds -1 is outside (0, inf)")):
        parse_experiment(grid.format("thresholds = [-1]"), source="grid.toml", default_name="grid")


def test_a_sweep_naming_variance_thresholds_is_checked_and_planned(tmp_path, tiny_folder, monkeypatch):
    """The check before any work passed the thresholds to the curve's method: a traceback (TypeError)
    for every sweep that named them, --dry-run included."""
    grid = _write(
        tmp_path / "grid.toml",
        f'stages = ["capture", "oracle", "variance"]\nkeep = [0.2]\n[model]\nname = "{tiny_folder}"\n'
        '[[data]]\nspec = "niah:n=1,length=128"\n[variance]\nthresholds = [0.25, 0.5]\n',
    )
    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path / "cache"))  # no cost model cached: no time estimate
    plans = []
    sweep(grid, tmp_path / "out", dry_run=True, announce=plans.append)
    assert plans[0].lines()[1:4] == [f"  {stage}: 1 new, 0 changed, 0 kept" + tail for stage, tail in (
        ("capture", "; 1 examples, 128 prompt tokens through the model"),
        ("oracle", "; 1 examples, 128 prompt tokens through the model"), ("variance", ""))]  # fmt: skip


def test_a_table_no_stage_reads_is_warned_of_and_bench_takes_the_decode_options():
    grid = 'stages = ["{}"]\nkeep = [0.2]\n[[data]]\nspec = "niah:n=1,length=128"\n[bench]\nmethods = ["full"]\n{}'
    with pytest.warns(UserWarning, match=r"grid.toml \[bench\]: no stage of stages \(capture\) reads it"):
        parse_experiment(grid.format("capture", ""), source="grid.toml", default_name="grid")
    plan = parse_experiment(
        grid.format("bench", "cuda_graphs = true\ncompile_decode = true"), source="grid.toml", default_name="grid"
    )
    assert (plan.bench.cuda_graphs, plan.bench.compile_decode) == (True, True)
