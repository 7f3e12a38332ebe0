"""`rankkit demo`, the README's first command, run as a user runs it: the CLI entry point on the
embedded default model into a fresh folder, then every file it says it wrote read back (integration,
about two minutes on two cores: the price of never shipping a broken main job again)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import plotly
import polars as pl
import pytest

from rankkit import outputs
from rankkit.stores.verify import verify

pytestmark = pytest.mark.integration

# What the demo runs (rankkit.demo): 4 examples captured, 2 of them benched with these methods.
DEMO_EXAMPLES = 4
BENCHED_EXAMPLES = 2
BENCHED_METHODS = {"full", "gemfilter", "fastkv", "claa", "snapkv"}


class DemoRuns(NamedTuple):
    out: Path
    stdout: str  # the run that finished: a rerun of one interrupted in its bench
    interrupted: subprocess.CompletedProcess  # the first run, Ctrl-C'd once its bench kept an example
    held: dict  # the example its bench kept, as its journal holds it


def _demo_command(out: Path) -> list[str]:
    return [str(Path(sys.executable).with_name("rankkit")), "demo", "--out", str(out), "--device", "cpu"]


DEMO_ENVIRONMENT = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> DemoRuns:
    """The demo as a user may well run it: interrupted (Ctrl-C) in its bench, after it wrote its store
    and tables, then run again to the end. Two runs, not three: the rerun both resumes and rewrites
    the files the first wrote."""
    out = tmp_path_factory.mktemp("demo") / "out"
    out.mkdir()
    (out / "notes.txt").write_text("a user's notes")  # stays beside the demo's files
    journal = outputs.journal_path(out / "bench.parquet")
    logs = out.parent / "first.stdout", out.parent / "first.stderr"  # files: a pipe unread would fill
    with open(logs[0], "w") as stdout, open(logs[1], "w") as stderr:
        first = subprocess.Popen(_demo_command(out), stdout=stdout, stderr=stderr, env=DEMO_ENVIRONMENT)
        deadline = time.monotonic() + 900
        while not _kept(journal) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        first.send_signal(signal.SIGINT)
        first.wait(timeout=120)
    stdout, stderr = (log.read_text() for log in logs)
    interrupted = subprocess.CompletedProcess(first.args, first.returncode, stdout, stderr)
    assert "Traceback" not in stderr, stderr[-3000:]
    (held,) = _kept(journal)
    finished = subprocess.run(_demo_command(out), capture_output=True, text=True, env=DEMO_ENVIRONMENT, timeout=900)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "Traceback" not in finished.stderr
    return DemoRuns(out, finished.stdout, interrupted, held)


def _kept(journal: Path) -> list[dict]:
    """The examples a bench's journal holds."""
    lines = journal.read_text().splitlines() if journal.is_file() else []
    return [entry for entry in map(json.loads, lines) if "key" in entry]


def _written(stdout: str) -> dict[str, Path]:
    """The files the demo lists after 'demo output:', by name."""
    listing = stdout.split("demo output:", 1)[1].splitlines()[1:]
    return {name: Path(path) for name, path in (line.split(maxsplit=1) for line in listing if line.strip())}


def test_demo_lists_every_output_and_each_exists_inside_its_folder(demo_run):
    out, stdout = demo_run.out, demo_run.stdout
    written = _written(stdout)
    assert set(written) == {"store", "compare", "variance", "bench", "dashboard"}
    for path in written.values():
        assert path.exists() and path.parent == out


def test_demo_store_verifies_whole_with_an_oracle_per_example(demo_run):
    report = verify(_written(demo_run.stdout)["store"])
    assert report.examples == DEMO_EXAMPLES
    counts = report.counts()
    assert counts.pop("good") == DEMO_EXAMPLES
    assert counts and not any(counts.values()), counts  # unchecked, damaged, incomplete, ...: none


def test_demo_parquets_read_back_with_their_columns_and_rows(demo_run):
    written = _written(demo_run.stdout)

    compare = pl.read_parquet(written["compare"])
    assert {"example_id", "layer", "spearman"} <= set(compare.columns)
    assert compare["example_id"].n_unique() == DEMO_EXAMPLES
    assert (
        compare["spearman"].drop_nulls().is_between(-1, 1).all()
        and compare["spearman"].drop_nulls().len() > 0
    )

    variance = pl.read_parquet(written["variance"])
    assert variance.height > 0 and variance["example"].n_unique() == DEMO_EXAMPLES

    bench = pl.read_parquet(written["bench"])
    assert set(bench["method"].unique()) == BENCHED_METHODS
    assert bench.height == BENCHED_EXAMPLES * len(BENCHED_METHODS)
    assert bench["ttft_s"].min() > 0
    full = bench.filter(pl.col("method") == "full")
    assert (full["ttft_ratio"] == 1.0).all() and (full["kv_ratio"] == 1.0).all()


def test_demo_dashboard_is_one_self_contained_page(demo_run):
    page = _written(demo_run.stdout)["dashboard"].read_text()
    assert page.startswith("<!DOCTYPE html>") or page.lstrip().lower().startswith("<!doctype html>")
    ours = page.replace(plotly.offline.get_plotlyjs(), "")
    assert "<script src" not in ours and "http" not in ours  # nothing to fetch


def test_demo_tables_carry_numbers(demo_run):
    assert re.search(rf"captured {DEMO_EXAMPLES} examples \([\d,]+ tok/s\)", demo_run.interrupted.stdout)
    rankings, end_to_end = demo_run.stdout.split("rankings vs the oracle", 1)[1].split("end to end at keep", 1)
    interval = r"-?\d\.\d+ \[-?\d\.\d+, -?\d\.\d+\]"  # a mean with its 95% interval
    assert len(re.findall(interval, rankings)) >= 5
    for method in BENCHED_METHODS:
        row = next(line for line in end_to_end.splitlines() if re.search(rf"\b{method}\b", line))
        assert re.search(interval, row), row


def test_demo_says_what_its_capture_did_on_a_first_run_and_on_a_rerun():
    """A rerun resumes a finished store: it captures nothing, so it has no speed to print (it printed
    '0 tok/s'); the oracle's score is over every example the run went through, the held ones' stored
    scores included, with its Wilson interval (2 of 4: [0.15, 0.85]; 1 of 1: none, one example being one sample)."""
    from rankkit.capture import CaptureSummary
    from rankkit.demo import captured_line

    def scored(*values):
        return [{"example_id": f"ex{index}", "cluster": None, "accuracy": value} for index, value in enumerate(values)]

    first = CaptureSummary("niah.zarr", examples=4, written=4, tokens=4000, seconds=50.0, scored=scored(1.0, 0.0, 1.0, 0.0))
    assert captured_line(first) == (
        "captured 4 examples (80 tok/s); the oracle's answers scored 0.50 [0.15, 0.85] (mean of 4, 95% interval)"
    )
    rerun = CaptureSummary("niah.zarr", examples=4, skipped=4)
    assert captured_line(rerun) == "4 examples held from an earlier run, not captured again"
    resumed = CaptureSummary("niah.zarr", examples=4, written=1, skipped=3, tokens=1000, seconds=10.0, scored=scored(1.0))
    assert captured_line(resumed) == (
        "captured 1 example (100 tok/s); the oracle's answers scored 1.00 [–] (mean of 1, 95% interval); "
        "3 examples held from an earlier run, not captured again"
    )


def test_the_demo_never_writes_over_a_file_it_did_not_make(tmp_path):
    """--out may name a user's folder: a file of the demo's names there that no demo made is refused
    before any work and left as it was; other files stay beside the demo's; a folder an earlier
    demo wrote is the demo's to rewrite on a rerun."""
    rankkit = Path(sys.executable).with_name("rankkit")
    users = tmp_path / "mine"
    users.mkdir()
    (users / "compare.summary.parquet").write_bytes(b"a user's table")
    refused = subprocess.run([str(rankkit), "demo", "--out", str(users)], capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        f"rankkit: error: {users / 'compare.summary.parquet'} is in the way: the demo writes there but did "
        "not make it; move it away, or choose another --out"
    ]
    assert sorted(path.name for path in users.iterdir()) == ["compare.summary.parquet"]
    assert (users / "compare.summary.parquet").read_bytes() == b"a user's table"

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    refused = subprocess.run([str(rankkit), "demo", "--out", str(a_file)], capture_output=True, text=True)
    assert refused.returncode == 2 and "is a file, not a folder" in refused.stderr and a_file.read_text() == "mine"


def test_the_demo_refuses_a_store_folder_and_a_bad_device_before_it_writes(tmp_path):
    """--out naming a capture store got the demo's store and marker written among its examples, and
    a minute later a refusal; a bad --device left a marked, empty demo folder behind."""
    from rankkit import stores
    from rankkit.demo import run_demo
    from rankkit.errors import RankkitError

    store = tmp_path / "s.zarr"
    stores.create(store, {"model": "a"})
    before = sorted(path.relative_to(store) for path in store.rglob("*"))
    for out in (store, store / "demo"):
        with pytest.raises(RankkitError, match=rf"^--out {re.escape(str(out))} is inside the rankkit store {re.escape(str(store))};"):
            run_demo(out, device="cpu")
    assert sorted(path.relative_to(store) for path in store.rglob("*")) == before
    with pytest.raises(RankkitError, match="^unknown device 'tpu': use auto, cpu, cuda or cuda:N$"):
        run_demo(tmp_path / "demo", device="tpu")
    assert not (tmp_path / "demo").exists()


def test_a_rerun_of_the_demo_resumes_its_store_and_its_interrupted_bench_and_rewrites_its_files(demo_run):
    """A second `make demo` ended in "compare.parquet already exists; pass --overwrite", an option the
    demo does not have. A run interrupted in its bench keeps the examples it finished there, and the
    rerun takes them as they were measured, rewriting the tables the first run wrote."""
    out, interrupted, held = demo_run.out, demo_run.interrupted, demo_run.held
    journal = outputs.journal_path(out / "bench.parquet")
    assert interrupted.returncode == 130 and interrupted.stderr.strip().splitlines()[-1] == (
        f"rankkit: interrupted: kept 1 finished ({len(BENCHED_METHODS)} rows) in {journal}; "
        "rerun the same command to resume"
    )
    assert "rankings vs the oracle" in interrupted.stdout  # its compare.parquet was written before its bench
    assert f"{DEMO_EXAMPLES} examples held from an earlier run, not captured again" in demo_run.stdout
    assert "bench: 1 example held from an interrupted run, not run again" in demo_run.stdout
    assert (out / "notes.txt").read_text() == "a user's notes"
    rows = pl.read_parquet(out / "bench.parquet")
    assert rows.height == BENCHED_EXAMPLES * len(BENCHED_METHODS) and not journal.exists()
    resumed = rows.filter(pl.col("example_id") == held["key"]).sort("method")
    measured = sorted(held["rows"], key=lambda row: row["method"])
    assert resumed["ttft_s"].to_list() == [row["ttft_s"] for row in measured]


def test_a_demo_folder_is_marked_as_the_demos(demo_run):
    out = demo_run.out
    from rankkit.demo import DEMO_MARKER, claim_folder

    assert (out / DEMO_MARKER).is_file() and (out / "notes.txt").read_text() == "a user's notes"
    claim_folder(out, {"compare": out / "compare.parquet", "variance": out / "variance.parquet"})  # a rerun's
