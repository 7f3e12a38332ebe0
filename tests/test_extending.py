"""A method and a probe from another package (tests/plugin, docs/extending.md), found through entry
points, run in every command with no change to rankkit."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from rankkit.errors import RankkitError
from rankkit.plugins import register_entry_points

PLUGIN = Path(__file__).parent / "plugin"
DATA = "niah:n=2,length=200"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The plugin installed as any package is, into a folder of its own (put on PYTHONPATH); built from a
    copy, so the build leaves nothing in tests/plugin."""
    source, target = tmp_path_factory.mktemp("plugin") / "source", tmp_path_factory.mktemp("site")
    shutil.copytree(PLUGIN, source)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return target


def _rankkit(site: Path, cwd: Path, *arguments: str) -> str:
    """``rankkit ARGUMENTS`` in a process of its own, which finds the plugin as it starts."""
    command = [sys.executable, "-c", "from rankkit.cli import main; main()", *arguments]
    done = subprocess.run(
        command, env=os.environ | {"PYTHONPATH": str(site)}, cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def found(site, monkeypatch):
    """This process as one started with the plugin installed: its folder on the path and the entry
    points read again, as importing rankkit reads them; the registries as they were afterwards."""
    import importlib

    from rankkit import methods, probes

    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    before = [(registry, dict(registry)) for registry in (methods.REGISTRY, probes.REGISTRY)]
    try:
        register_entry_points("rankkit.probes", probes.REGISTRY, probes.register)
        register_entry_points("rankkit.methods", methods.REGISTRY, methods.register)
        yield
    finally:
        for registry, entries in before:
            registry.clear()
            registry.update(entries)


def test_a_method_from_another_package_runs_in_every_command(site, found, tiny_folder, tmp_path, monkeypatch):
    """The first command in a process of its own, which finds the plugin through its entry points as
    it starts; the rest in this one, where ``found`` read them the same way (a process's start costs
    seconds of imports)."""
    model = ["--model", str(tiny_folder), "--device", "cpu"]
    _rankkit(site, tmp_path, "capture", *model, "--data", DATA, "--probes", "key_norm", "--oracle",
             "--max-new-tokens", "2", "--out", "store.zarr")  # fmt: skip

    from typer.testing import CliRunner

    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app

    monkeypatch.chdir(tmp_path)

    def rankkit(*arguments: str) -> str:
        done = CliRunner().invoke(app, list(arguments))
        assert done.exit_code == 0, done.output
        return done.stdout

    selected = json.loads(rankkit("select", "store.zarr", "--method", "knorm", "--keep", "0.5",
                                   "--layer", "1", "--json"))  # fmt: skip
    prefilled = json.loads(rankkit("prefill", *model, "--method", "knorm", "--keep", "0.5",
                                    "--data", DATA, "--kept-layers", "1", "--max-new-tokens", "2", "--json"))  # fmt: skip
    first, length = selected[0], prefilled["length"]
    heads = first["selected_positions"]
    assert (first["method"], first["layer"], first["budget_tokens"]) == ("knorm", 1, math.ceil(0.5 * length))
    assert all(len(head) == first["budget_tokens"] and head[-1] == length - 1 for head in heads)  # the last token
    # the online face keeps in its cache exactly what the offline face selects from the store
    assert prefilled["kept_positions_by_layer"]["1"] == heads

    compared = json.loads(rankkit("compare", "store.zarr", "--oracle", "--methods",
                                   "knorm,key_norm", "--json", "--workers", "1"))  # fmt: skip
    assert {row["method"] for row in compared} >= {"knorm", "key_norm"}

    rankkit("bench", *model, "--methods", "full,knorm", "--keep", "0.5", "--data", DATA,
             "--max-new-tokens", "2", "--out", "bench.parquet")  # fmt: skip
    bench = pl.read_parquet(tmp_path / "bench.parquet")
    assert bench.filter(pl.col("method") == "knorm").height == 2

    rankkit("dashboard", "store.zarr", "--bench", "bench.parquet", "--out", "report.html",
             "--workers", "1")  # fmt: skip
    assert '"knorm"' in (tmp_path / "report.html").read_text()

    (tmp_path / "sweep.toml").write_text(
        f'name = "plugin"\nstages = ["bench"]\nkeep = [0.5]\nmethods = ["full", "knorm"]\n'
        f'[model]\nname = "{tiny_folder}"\ndevice = "cpu"\n[[data]]\nspec = "{DATA}"\n'
        "[bench]\nmax_new_tokens = 2\n"
    )
    rankkit("sweep", "sweep.toml", "--out", "swept", "--workers", "1")
    swept = pl.read_parquet(next((tmp_path / "swept").glob("bench*.parquet")))
    assert swept.filter(pl.col("method") == "knorm").height == 2


def test_a_package_cannot_take_a_name_rankkit_has(monkeypatch):
    from rankkit.methods import REGISTRY, register

    class Point:
        name, group, value = "claa", "rankkit.methods", "impostor:CLAA"

        def load(self):
            return type("CLAA", (), {"name": "claa", "__module__": "impostor"})

    monkeypatch.setattr("rankkit.plugins.entry_points", lambda group: [Point()])
    with pytest.raises(RankkitError, match=r"registers the name 'claa', which rankkit\.methods\.claa\.Claa already has; rename it$"):
        register_entry_points("rankkit.methods", REGISTRY, register)


def test_a_package_that_fails_to_load_is_one_line_naming_it(monkeypatch):
    class Point:
        name, group, value = "broken", "rankkit.probes", "broken_package:Probe"

        def load(self):
            raise ImportError("No module named 'broken_package'")

    monkeypatch.setattr("rankkit.plugins.entry_points", lambda group: [Point()])
    with pytest.raises(RankkitError, match=r"^entry point 'broken' of group 'rankkit.probes' \(broken_package:Probe\) "
                       r"does not load: ImportError: No module named 'broken_package'$"):  # fmt: skip
        register_entry_points("rankkit.probes", {}, lambda cls: cls)
