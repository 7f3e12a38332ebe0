"""`rankkit sweep` on a tiny model folder: every stage through its library call, resume, refusals,
bad experiment files, and two gloo ranks giving the one-rank result."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import run_on_two_gloo_ranks
from polars.testing import assert_frame_equal

from rankkit import stores
from rankkit.errors import RankkitError
from rankkit.eval.compare import compare_store
from rankkit.eval.variance import variance_store
from rankkit.experiment import DATA_FIELDS, TABLE_FIELDS, TOP_FIELDS
from rankkit.shards import interleave, share
from rankkit.sweep import sweep, tag_columns

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
            variance_store(store, budget=0.2, workers=1).curves,
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
        assert (finished / "dashboards" / f"{cell}.html").stat().st_size > 100_000
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
    with pytest.raises(Interrupted, match=f"kept every finished unit in {out}"):
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
    from rankkit.sweep import Layout, Run, _merge, units

    out = tmp_path / "out"
    shutil.copytree(finished, out)
    plan = read_experiment(experiment)[0]
    layout = Layout(out)
    unit = units(plan, "bench")[0]
    part = layout.part("bench", unit)
    part.rename(layout.rank_part("bench", unit, 0, 2))
    (out / "bench.parquet").unlink()
    run = Run(plan, layout, ("bench",), {cell.name: 2 for cell in plan.data})
    with pytest.raises(RankkitError, match=r"rank1-of-2.parquet is missing: rank 1 of 2 did not finish"):
        _merge(run, "bench", 2)
    assert not part.exists() and not (out / "bench.parquet").exists()


def test_another_experiment_is_refused_and_overwrite_starts_over(tiny_folder, tmp_path):
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
    with pytest.raises(RankkitError, match=r"another experiment \(it differs in data\); pass --overwrite"):
        sweep(other, out)
    assert (out / "stores" / "niah-128.zarr").is_dir()  # a refusal touches nothing
    sweep(other, out, overwrite=True)
    assert sorted(path.name for path in (out / "stores").iterdir()) == ["niah-160.zarr"]
    assert "length=160" in (out / "experiment.toml").read_text()


def test_a_stage_whose_input_is_missing_is_refused_before_any_work(experiment, tmp_path):
    with pytest.raises(RankkitError, match="stage compare needs the capture stage's output"):
        sweep(experiment, tmp_path / "out", stages=["compare"])
    with pytest.raises(RankkitError, match="--stages explore is not a stage of"):
        sweep(experiment, tmp_path / "out", stages=["explore"])
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
        (("n=2,length=256", "n=2,length=9999"), "more than the model's 512 positions"),
        (("limit = 1", "limit = 0"), r"\[diffusion\]: limit must be at least 1"),
        (("keep = [0.2]", "keep = []"), r"keep is an empty list; name at least one, e.g. keep = \["),
        (("keep = [0.2]", "keep = [0.2]\nlayers = [3]"), "layers: 3 is not a layer of this model"),
        (
            ("[diffusion]", '[compare]\nmethods = ["claa:deferred_layers=50"]\n[diffusion]'),
            r"\[compare\]: method 'claa': deferred_layers=50 is outside \[0, 3\]",
        ),
        (
            ("[diffusion]", "[compare]\nneedle_keep = 1.5\n[diffusion]"),
            r"keep rate 1.5 is outside \(0, 1\]",
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
