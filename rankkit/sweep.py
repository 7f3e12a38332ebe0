"""``rankkit sweep``: an experiment file's grid run end to end into one directory, resumable and sharded.

The experiment (``rankkit.experiment``, docs/sweeps.md) names a model, data cells, probes,
methods, keep rates, layers and stages. Each stage runs through the library call its
command runs (``capture``, ``add_oracle``, ``bench``, ``diffusion_probe``, ``compare_store``,
``variance_store``, ``write_dashboard``), once per unit of the grid:

=========  ==================================  ====================================
stage      unit                                output in DIR
=========  ==================================  ====================================
capture    cell                                stores/<cell>.zarr
oracle     cell                                (added to the store)
bench      cell x layer                        bench.parquet
diffusion  cell                                diffusion.parquet
compare    cell x budget x layer               compare.parquet, compare.<frame>.parquet
variance   cell x budget                       variance.parquet, .selections, .means
dashboard  cell                                dashboards/<cell>.html, dashboard.html
=========  ==================================  ====================================

A stage's parquet concatenates its units' frames, each row led by the columns naming its
unit: ``cell``, ``dataset``, ``data_length``, ``data`` (the spec), and where the grid
varies them ``keep``/``budget`` and ``layer_setting`` (null: each method's own layer).
compare's frames also carry ``pruning_layer``, the layer its probes are summarised at.

Resume and growth: each unit's result is kept under ``parts/<stage>/<cell>/`` as it finishes
(the library's own files, written atomically), then a ``.done`` marker holding the unit's
settings (``unit_settings``: its own, defaults filled in, and those of the units it reads) and
the rankkit version. A rerun compares them: a unit is *new* (no marker), *changed* (other
settings; its old result is discarded first) or *kept*, and runs only when it is not kept, so
a keep rate added to the file runs compare and variance at that rate and reuses the stores.
Capture, oracle, bench and diffusion also resume inside a unit, example by example. A stage's
parquet is rewritten when the units behind it differ from those it was made of. ``plan``
shows all this before anything loads (``--dry-run`` stops there), with the work ahead and, where
a cost model is cached for the model (``Timing``), capture's estimate in seconds.

What DIR holds that the sweep wrote is listed in ``manifest.json``; ``overwrite`` removes
those paths and nothing else, and a path the sweep would write that it did not (a folder in
the way) is refused, except a rankkit store at a cell's store path, which seeds the cell.

Sharding: under ``torchrun`` every rank runs the model stages on its share of each cell's
examples (``rankkit.shards``): capture and oracle write into the one store, bench and
diffusion each into a part of their own. After a barrier rank 0 merges the parts in example
order and runs the stages that read the stores; the other ranks return.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import torch

from rankkit import __version__, models, outputs, stores
from rankkit.bench import Setup
from rankkit.bench import bench as run_bench
from rankkit.capture import add_oracle, capture, capture_probes, store_bytes
from rankkit.checks import check_prompt_lengths, check_spec_length, first_repeated
from rankkit.data import data_fingerprint, load_examples
from rankkit.errors import RankkitError
from rankkit.eval import compare, variance
from rankkit.eval.diffusion import diffusion_probe
from rankkit.eval.offline import method_from_spec
from rankkit.eval.parallel import checked_workers
from rankkit.experiment import (
    MAX_UNITS,
    MODEL_STAGES,
    STAGES,
    DataCell,
    Experiment,
    declared_examples,
    errors_in,
    parse_experiment,
    read_experiment,
)
from rankkit.interrupts import keep_on_interrupt
from rankkit.methods import Budget, budget_keywords, check_parameters
from rankkit.methods.measure import CostModel, cached_cost_model
from rankkit.methods.specprefill import draft_problem
from rankkit.progress import Progress, ProgressCallback, ignore
from rankkit.shards import interleave, process_group, rank_device, shard, share_size, wait_for_other_ranks
from rankkit.values import as_list

EXPERIMENT_FILE = "experiment.toml"
RESULT_SUFFIXES = (".parquet", ".html")  # the stages' tables and pages, each marked as rankkit's (outputs)
MANIFEST_FILE = "manifest.json"  # every path the sweep wrote in DIR: all that --overwrite removes
STORE_STAGES = ("oracle", "compare", "variance", "dashboard")  # read what capture wrote
NEEDS = {  # the stages whose output a stage reads, when the experiment has them
    "oracle": ("capture",),
    "compare": ("capture", "oracle"),
    "variance": ("capture",),
    "dashboard": ("capture", "oracle", "bench", "diffusion"),
}
BUDGETED_STAGES = ("compare", "variance")  # run once per keep rate (or token budget)
LAYERED_STAGES = ("compare", "bench")  # run once per layer setting
TAG_TYPES = {  # the columns naming a unit, leading every row of a stage's parquet
    "cell": pl.String,
    "dataset": pl.String,
    "data_length": pl.Int64,
    "data": pl.String,
    "keep": pl.Float64,
    "budget": pl.String,
    "layer_setting": pl.Int32,
    "pruning_layer": pl.Int32,
}


@dataclass(frozen=True)
class Unit:
    """One point of a stage's grid: a data cell, and the budget and layer setting where the stage varies them."""

    cell: DataCell
    budget: Budget | None = None
    layer: int | None = None
    layered: bool = False  # the stage varies the layer setting

    @property
    def variant(self) -> str:
        """The unit's file name within its cell: ``keep=0.1_layer=own``, or ``all``."""
        parts = [] if self.budget is None else [self.budget.label]
        if self.layered:
            parts.append(f"layer={'own' if self.layer is None else self.layer}")
        return "_".join(parts) or "all"

    def tags(self) -> dict[str, Any]:
        tags = self.cell.columns()
        if self.budget is not None:
            tags |= {"keep": self.budget.keep, "budget": self.budget.label}
        if self.layered:
            tags["layer_setting"] = self.layer
        return tags


def tag_columns(stage: str) -> list[str]:
    """The columns naming the unit at the front of every row of ``stage``'s parquet."""
    given = {
        "keep": stage in BUDGETED_STAGES,
        "budget": stage in BUDGETED_STAGES,
        "layer_setting": stage in LAYERED_STAGES,
        "pruning_layer": stage == "compare",
    }
    return [name for name in TAG_TYPES if given.get(name, True)]


def units(experiment: Experiment, stage: str) -> list[Unit]:
    """The grid of ``stage``: its units in the order they run."""
    budgets = experiment.budgets if stage in BUDGETED_STAGES else (None,)
    layered = stage in LAYERED_STAGES
    layers = experiment.layers if layered else (None,)
    return [
        Unit(cell, budget, layer, layered)
        for cell in experiment.data
        for budget in budgets
        for layer in layers
    ]


def _keyword_defaults(function: Callable) -> dict[str, Any]:
    """The keywords of ``function`` with their defaults (``workers`` and where it writes left out: they
    change no result)."""
    parameters = inspect.signature(function).parameters.values()
    return {
        each.name: each.default
        for each in parameters
        if each.default is not inspect.Parameter.empty and each.name not in ("workers", "out", "overwrite")
    }


# What compare and variance run with where the experiment leaves a setting out, read once.
_LIBRARY_DEFAULTS = {
    "compare": _keyword_defaults(compare.compare_store),
    "variance": _keyword_defaults(variance.variance_store),
}


def _own_settings(plan: Experiment, stage: str, unit: Unit) -> dict[str, Any]:
    """What a unit of ``stage`` itself is run with (the device is left out: it changes no result)."""
    data = {"model": plan.model.name, "data": unit.cell.spec, **data_fingerprint(unit.cell.spec)}
    if stage == "capture":
        return {**data, "probes": plan.probes, **dataclasses.asdict(plan.capture)}
    if stage == "oracle":
        return dataclasses.asdict(plan.oracle)
    if stage == "bench":
        bench = dataclasses.asdict(plan.bench)
        return {**data, **bench, "budgets": [budget.label for budget in plan.budgets], "layer": unit.layer}
    if stage == "diffusion":
        return {**data, **dataclasses.asdict(plan.diffusion)}
    if stage == "compare":
        given = {"layer": unit.layer, **unit.budget.keywords, **plan.compare.kwargs()}
        return {**_LIBRARY_DEFAULTS["compare"], **given}
    if stage == "variance":
        return {**_LIBRARY_DEFAULTS["variance"], **unit.budget.keywords, **plan.variance.kwargs()}
    # the dashboard shows bench's rows at the first layer setting, and compares under every budget ("keeps"
    # holds token counts too: the key finished sweeps recorded, so their pages stay kept)
    keeps = [budget.number for budget in plan.budgets]
    return {"bench_layer": plan.layers[0], "keeps": keeps, "needle_keep": plan.compare.needle_keep}


def unit_settings(plan: Experiment, stage: str, unit: Unit) -> dict[str, Any]:
    """Everything a unit's result depends on: its own settings and those of the units it reads (the
    same cell's, at its layer setting, or the first for the dashboard), as JSON reads them back."""
    settings = {stage: _own_settings(plan, stage, unit)}
    for source in NEEDS.get(stage, ()):
        if source in plan.stages:
            layer = unit.layer if unit.layered else plan.layers[0]
            read = next(
                each for each in units(plan, source) if each.cell == unit.cell and each.layer in (None, layer)
            )
            settings |= unit_settings(plan, source, read)
    return json.loads(json.dumps(settings, default=str))


NEW, CHANGED, KEPT = "new", "changed", "kept"


@dataclass(frozen=True)
class Layout:
    """Where a sweep keeps everything inside its directory ``root``."""

    root: Path

    @property
    def experiment(self) -> Path:
        return self.root / EXPERIMENT_FILE

    @property
    def index(self) -> Path:
        return self.root / "dashboard.html"

    @property
    def stores(self) -> Path:
        return self.root / "stores"

    def store(self, cell: DataCell) -> Path:
        return self.stores / f"{cell.name}.zarr"

    def is_store(self, path: Path) -> bool:
        """Whether ``path`` is where the sweep keeps a cell's store (removed by the store's own rule)."""
        return path.parent == self.stores

    def dashboard(self, cell: DataCell) -> Path:
        return self.root / "dashboards" / f"{cell.name}.html"

    def part(self, stage: str, unit: Unit) -> Path:
        """A unit's finished result (for compare and variance, the first of the library's files)."""
        return self.root / "parts" / stage / unit.cell.name / f"{unit.variant}.parquet"

    def rank_part(self, stage: str, unit: Unit, rank: int, world: int) -> Path:
        part = self.part(stage, unit)
        return part.with_name(f"{unit.variant}.rank{rank}-of-{world}.parquet")

    def marker(self, stage: str, unit: Unit) -> Path:
        """Written last when a unit is finished; it holds what the merge needs besides the frames."""
        return self.part(stage, unit).with_suffix(".done")

    def started(self, stage: str, unit: Unit) -> Path:
        """Written before a unit of a model stage starts: the settings its unfinished files (a store
        being captured, journals, rank parts) are made with, so a rerun with other settings discards them."""
        return self.part(stage, unit).with_suffix(".started.json")

    def stage_outputs(self, stage: str) -> list[Path]:
        """The parquet files a stage leaves in the directory (none for capture, oracle and dashboard)."""
        target = self.root / f"{stage}.parquet"
        if stage == "compare":
            return compare.output_paths(target)
        if stage == "variance":
            return variance.output_paths(target)
        return [target] if stage in ("bench", "diffusion") else []

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_FILE

    def merged(self, stage: str) -> Path:
        """What the stage's outputs were last made of (``_merge_record``)."""
        return self.root / "parts" / stage / "merged.json"

    def paths(self, plan: Experiment) -> list[Path]:
        """Every path the sweep of ``plan`` writes in its directory (folders whole where it owns them);
        stores only when it captures them (otherwise they are its inputs)."""
        made = [self.manifest, self.experiment, self.root / "parts"]
        if "capture" in plan.stages:
            made += [self.store(cell) for cell in plan.data]
        if "dashboard" in plan.stages:
            made += [self.index, *(self.dashboard(cell) for cell in plan.data)]
        return made + [path for stage in plan.stages for path in self.stage_outputs(stage)]


@dataclass(frozen=True)
class CellSize:
    """A cell's examples and their prompt tokens, known before any model loads."""

    examples: int
    tokens: int
    squared_tokens: int  # the sum of each prompt's tokens squared: a prefill's attention grows with it
    longest: int  # the longest prompt's tokens
    longest_example: int  # which example has it (the first of the longest)


@dataclass
class StagePlan:
    """What a sweep call will do in one stage: its units by status, and the work of those that run."""

    stage: str
    new: int = 0
    changed: int = 0
    kept: int = 0
    examples: int = 0  # examples through the model in the units that run (model stages)
    tokens: int = 0  # their prompt tokens
    seconds: float | None = None  # their estimated time, where the stage has an estimate (``ESTIMATED``)

    @property
    def runs_model(self) -> bool:
        return self.stage in MODEL_STAGES and self.new + self.changed > 0

    def line(self) -> str:
        units = f"{self.stage}: {self.new} new, {self.changed} changed, {self.kept} kept"
        if not self.runs_model:
            return units
        work = f"{units}; {self.examples:,} examples, {self.tokens:,} prompt tokens through the model"
        return (
            work if self.seconds is None else f"{work}, about {self.seconds:,.1f} s ({ESTIMATED[self.stage]})"
        )


# What the plan's estimate in seconds counts in a stage: a full prefill of each example's prompt
# is all the cost model prices before anything runs. The oracle's answers, bench's methods and
# the diffusion probe's decoding are known only once they run, so those stages have no estimate.
ESTIMATED = {"capture": "one full prefill per example"}


@dataclass
class SweepPlan:
    out: Path
    stages: list[StagePlan]
    calibrate: str | None = None  # the command that caches a cost model, where none is cached

    @property
    def seconds(self) -> float | None:
        """The estimate of the stages that have one, where a cost model is cached."""
        if self.calibrate is not None:
            return None
        estimated = [stage.seconds for stage in self.stages if stage.seconds is not None]
        return sum(estimated) if estimated else None  # no stage has one: no total either, not 0 s

    def lines(self) -> list[str]:
        """The plan as ``rankkit sweep`` prints it before it starts (and alone with --dry-run)."""
        work = sum(stage.tokens for stage in self.stages)
        total = f"in all {work:,} prompt tokens through the model" if work else "no model stage to run"
        lines = [f"plan for {self.out}:", *(f"  {stage.line()}" for stage in self.stages), f"  {total}"]
        if not work:
            return lines
        unpriced = [stage.stage for stage in self.stages if stage.runs_model and stage.stage not in ESTIMATED]
        if len(unpriced) == sum(stage.runs_model for stage in self.stages):
            return [*lines, f"  no estimate in seconds for {', '.join(unpriced)}"]
        if self.calibrate is not None:
            return [
                *lines,
                f"  no cost model cached for prompts this long on this model: run `{self.calibrate}` once to calibrate",
            ]
        left_out = f"; {', '.join(unpriced)} not estimated" if unpriced else ""
        return [*lines, f"  about {self.seconds:,.1f} s estimated from the cached cost model{left_out}"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "stages": [dataclasses.asdict(stage) for stage in self.stages],
            "seconds": self.seconds,
            "calibrate": self.calibrate,
        }


# the stages that judge rankings or answers against the oracle: refused on random weights
JUDGING_STAGES = ("compare", "diffusion", "dashboard")


def _refuse_meaningless_stages(plan: Experiment) -> None:
    """A ``random:<shape>`` model is for timing: the stages that judge its rankings or answers would
    refuse its stores after the capture, so the sweep refuses them before any model loads."""
    judging = [stage for stage in JUDGING_STAGES if stage in plan.stages]
    if models.timing_only(plan.model.name) and judging:
        raise RankkitError(
            f"{plan.model.name} has random weights, for timing only: stages {', '.join(judging)} judge "
            "rankings and answers it does not have; drop them, or name a real model"
        )


@dataclass(frozen=True)
class Timing:
    """What the plan prices its work with: the cost model cached for the experiment's model, device
    and torch thread count (None where none is), and the command that caches one."""

    num_layers: int
    cost_model: CostModel | None
    calibrate: str

    @classmethod
    def cached(cls, plan: Experiment, config, device, sizes: dict[str, CellSize]) -> Timing:
        """Read from the caches alone: no weight file is read and no model loads. A fit that does not
        cover the plan's longest prompt is not used (``cached_calibration`` would time that prompt
        anew): the command calibrates on it."""
        weights_hash = models.known_weights_hash(plan.model.name, device)
        cost_model = None if weights_hash is None else cached_cost_model(weights_hash, device)
        cell = max(plan.data, key=lambda cell: sizes[cell.name].longest)
        size = sizes[cell.name]
        if cost_model is not None and not cost_model.covers(size.longest):
            cost_model = None
        command = (
            f"rankkit prefill --method full --model {plan.model.name} --device {device} "
            f"--threads {torch.get_num_threads()} --data {cell.spec}"
            + (f" --example {size.longest_example}" if size.longest_example else "")
        )
        return cls(config.num_hidden_layers, cost_model, command)

    def prefills_seconds(self, size: CellSize) -> float:
        """A full prefill of each of the cell's prompts (with a cost model cached)."""
        return self.cost_model.prefills_seconds(self.num_layers, size.tokens, size.squared_tokens)


@dataclass(frozen=True)
class Run:
    """What every stage of one ``sweep`` call works from."""

    plan: Experiment
    layout: Layout
    running: tuple[str, ...]  # the stages this call runs
    sizes: dict[str, CellSize]  # per cell
    statuses: dict[tuple[str, str, str], str]  # (stage, cell, variant) -> NEW, CHANGED or KEPT
    timing: Timing
    workers: int | None = None

    def status(self, stage: str, unit: Unit) -> str:
        return self.statuses[(stage, unit.cell.name, unit.variant)]

    def share(self, cell: DataCell, limit: int | None = None, of: tuple[int, int] | None = None) -> int:
        """This rank's share of the cell's examples (of the first ``limit``), or the share of
        ``of``, another (rank, world size)."""
        count = self.sizes[cell.name].examples
        return share_size(count if limit is None else min(count, limit), *(of or shard()))


@dataclass
class StageReport:
    stage: str
    ran: int = 0  # units run (or finished) by this call
    skipped: int = 0  # units finished before it
    outputs: list[Path] = field(default_factory=list)


@dataclass
class SweepSummary:
    out: Path
    experiment: str
    rank: int
    world: int
    plan: SweepPlan | None = None
    stages: list[StageReport] = field(default_factory=list)
    seconds: float = 0.0

    def report(self, stage: str) -> StageReport:
        """A stage's report, listed as the stage starts so that an interrupt counts what it kept."""
        report = StageReport(stage)
        self.stages.append(report)
        return report

    def kept(self) -> str:
        done = ", ".join(f"{report.stage} {report.ran + report.skipped}" for report in self.stages)
        return (
            f"interrupted: kept in {self.out} the finished units of each stage ({done or 'none finished'}) "
            "and every example written whole; rerun the same command to resume"
        )


def _ignore_plan(plan: SweepPlan) -> None:
    """The default ``announce``: a library caller reads the plan from the summary."""


def sweep(
    experiment: str | os.PathLike,
    out: str | os.PathLike,
    *,
    stages: list[str] | str | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    progress: ProgressCallback = ignore,
    dry_run: bool = False,
    max_units: int | None = None,
    announce: Callable[[SweepPlan], None] = _ignore_plan,
    threads: int | None = None,
) -> SweepSummary:
    """Run the experiment file ``experiment`` into the directory ``out`` (see the module docstring).

    ``stages`` runs only those of the experiment's stages (default: all of them); a stage
    whose inputs another stage makes must find them finished in ``out`` or run with it.
    Everything is checked before any model loads, then ``announce`` gets the plan (each stage's
    new, changed and kept units and the work ahead); ``dry_run`` returns there, having written
    nothing. A grid of more than ``max_units`` units of work (an example through a model stage,
    a unit of another stage; default ``MAX_UNITS``) is refused. ``progress`` gets ``Progress`` events whose ``stage`` is
    the sweep stage, counting this rank's examples (model stages) or units. ``workers`` processes
    share the store-level analyses (their results do not depend on it). ``threads`` sets torch's CPU
    threads for the process (``models.use_threads``).
    """
    models.use_threads(threads)
    experiment_path = Path(experiment)
    max_units = MAX_UNITS if max_units is None else max_units
    plan, text = read_experiment(experiment_path, max_units=max_units)
    running = _running(plan, None if stages is None else as_list(stages, "--stages"), experiment_path)
    layout = Layout(Path(out))
    rank, world = shard()
    # Every rank checks before the process group forms, so before rank 0 writes anything.
    _check_directory(layout, plan, overwrite)
    run = check(plan, layout, running, experiment_path, fresh=overwrite, max_units=max_units, workers=workers)
    summary = SweepSummary(layout.root, plan.name, rank, world, plan=_plan(run))
    announce(summary.plan)
    if dry_run:
        return summary
    started = time.perf_counter()
    with _only_sweep_writing(layout.root) if rank == 0 else contextlib.nullcontext():
        # a stage's refusal names the file's fields, as the checks' do
        with (
            errors_in(str(experiment_path)),
            keep_on_interrupt(summary.kept),
            process_group(world),
            models.loaded_once(),
        ):
            if rank == 0:
                _prepare_directory(run, text, overwrite)
            wait_for_other_ranks(world)  # no rank writes before the directory is ready
            for stage in (each for each in running if each in MODEL_STAGES):
                _MODEL_STAGES[stage](run, _Counter(progress, stage), summary)
            wait_for_other_ranks(world)
        if rank == 0:
            with errors_in(str(experiment_path)), keep_on_interrupt(summary.kept):
                for report in list(summary.stages):
                    report.outputs += _merge(run, report.stage, world)
                for stage in (each for each in running if each not in MODEL_STAGES):
                    _STORE_STAGES[stage](run, _Counter(progress, stage), summary.report(stage))
    summary.seconds = time.perf_counter() - started
    return summary


@contextlib.contextmanager
def _only_sweep_writing(root: Path) -> Iterator[None]:
    """``root`` locked while this sweep writes into it: a second sweep there at the same time, whose
    ``--overwrite`` would remove what this one writes, is refused."""
    root.mkdir(parents=True, exist_ok=True)
    handle = os.open(root, os.O_RDONLY)
    try:
        if not outputs.lock_exclusively(handle, root):
            raise RankkitError(f"another rankkit sweep is writing {root}; wait for it to end, or choose another --out")
        yield
    finally:
        os.close(handle)


def _running(plan: Experiment, stages: list[str] | None, path: Path) -> tuple[str, ...]:
    if stages is None:
        return plan.stages
    unknown = [stage for stage in stages if stage not in plan.stages]
    if unknown:
        raise RankkitError(
            f"--stages {unknown[0]} is not a stage of {path} ({', '.join(plan.stages)}); add it to the "
            "file's stages, or choose from those"
        )
    twice = first_repeated(stages)
    if twice is not None:
        raise RankkitError(f"--stages names {twice} twice; name each stage once")
    return tuple(stage for stage in STAGES if stage in stages)


def check(
    plan: Experiment,
    layout: Layout,
    running: tuple[str, ...],
    path: Path,
    *,
    fresh: bool = False,
    max_units: int = MAX_UNITS,
    workers: int | None = None,
) -> Run:
    """Everything the stages would refuse, checked against the model's config (and its tokenizer
    for jsonl cells; no weights load) and the directory: the device, drafts, every cell's size and
    prompt lengths (a synthetic cell's from its spec, nothing built), layers, methods and pairs,
    what compare and variance read from capture, ASL's layers, the grid's size against
    ``max_units``, and that the inputs of each running stage are in ``layout`` or made by a stage
    running with it. Returns the run: each cell's size and each unit's status (all new when
    ``fresh``: the directory is to be emptied)."""
    checked_workers(workers)  # refused before the model stages run, not when the analyses start
    with errors_in(f"{path} [model]"):
        config = models.load_config(plan.model.name)
        Setup(device_map=plan.model.device_map)
        device = models.resolve_device(rank_device(plan.model.device))
        _refuse_meaningless_stages(plan)
    with errors_in(f"{path} [bench]"):  # decoding over a static cache, on one device
        Setup(
            device_map=plan.model.device_map,
            cuda_graphs=plan.bench.cuda_graphs,
            compile_decode=plan.bench.compile_decode,
        )
    num_layers = config.num_hidden_layers
    with errors_in(str(path)):
        for layer in plan.layers:
            if layer is not None and not 0 <= layer < num_layers:
                raise RankkitError(f"layers: {layer} is not a layer of this model (0..{num_layers - 1})")
    if "capture" in plan.stages and plan.capture.draft is not None:
        with errors_in(f"{path} [capture]"):
            _check_draft(plan.capture.draft, plan.model.name, config)
    if "bench" in plan.stages:
        with errors_in(f"{path} [bench]"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the bench stage itself warns of layer-less methods
            if plan.bench.draft is not None:
                _check_draft(plan.bench.draft, plan.model.name, config)
            for layer in plan.layers:
                plan.bench.options(layer).build(list(plan.bench.methods), num_layers, strict=False)
    if "compare" in plan.stages:
        with errors_in(f"{path} [compare]"):
            _check_compare(plan, layout, num_layers)
    if "variance" in plan.stages:
        with errors_in(f"{path} [variance]"):
            asl = variance.curve_method(**plan.variance.curve_kwargs()).bind(num_layers)
            _check_captured(plan, asl.captured_inputs(), f"method {asl.name!r}")
    with errors_in(str(path)):
        sizes = _cell_sizes(plan, config)
        _check_units(plan, running, sizes, max_units)
        statuses = {
            (stage, unit.cell.name, unit.variant): NEW if fresh else _status(layout, plan, stage, unit)
            for stage in plan.stages
            for unit in units(plan, stage)
        }
        timing = Timing.cached(plan, config, device, sizes)
        run = Run(plan, layout, running, sizes, statuses, timing, workers)
        _check_inputs(run)
        _check_dependents(run)
    outputs.check_writable(layout.root, _store_bytes(run, config))
    return run


def _store_bytes(run: Run, config) -> int:
    """About the bytes the stores this call captures take (``capture.store_bytes``)."""
    if "capture" not in run.running:
        return 0
    probes = len(capture_probes(run.plan.probes))
    return sum(
        store_bytes(config, probes, run.sizes[unit.cell.name].tokens, run.plan.capture.score_dtype)
        for unit in units(run.plan, "capture")
        if run.status("capture", unit) != KEPT
    )


def _check_draft(draft: str, model: str, config) -> None:
    """A draft spec (``layers:N`` or a model) checked against the target ``model`` (its ``config``); no
    weights load."""
    if draft.startswith("layers:"):
        count = draft.removeprefix("layers:")
        if not count.isdigit() or not 1 <= int(count) <= config.num_hidden_layers:
            raise RankkitError(f"draft: '{draft}' needs a layer count in 1..{config.num_hidden_layers}")
        return
    problem = draft_problem(draft, model, config.vocab_size)
    if problem:
        raise RankkitError(
            f'draft: {problem}; name a draft with the model\'s tokenizer, or e.g. draft = "layers:8"'
        )


def _captured_probes(plan: Experiment, layout: Layout) -> tuple[list[str], bool] | None:
    """(probe keys, has draft scores) of the stores compare and variance will read: what capture
    records, or what the first existing store holds; None when neither is known yet."""
    if "capture" in plan.stages:
        return [probe.key for probe in capture_probes(plan.probes)], plan.capture.draft is not None
    if not layout.store(plan.data[0]).is_dir():
        return None  # running a stage that reads it needs the store (``_check_inputs``)
    meta = stores.open(layout.store(plan.data[0])).meta
    return list(meta["probes"]), "draft" in meta


def _check_captured(plan: Experiment, needed: list[str], what: str) -> None:
    """The probes a method reads must be among those capture records (the top-level ``probes``)."""
    if "capture" not in plan.stages:
        return
    probes = [probe.key for probe in capture_probes(plan.probes)]
    missing = [key for key in needed if key not in probes]
    if missing:
        raise RankkitError(
            f"{what} reads the probe {missing[0]}, which probes ({plan.probes}) does not capture; add "
            f'"{missing[0]}" to probes'
        )


def _check_compare(plan: Experiment, layout: Layout, num_layers: int) -> None:
    """compare's methods (their parameters against the model's depth) and pairs against the probes
    the stores will hold, and its oracle."""
    options = plan.compare.kwargs()
    if options.get("oracle", True) and "capture" in plan.stages and "oracle" not in plan.stages:
        raise RankkitError(
            'oracle: compare ranks against the oracle, which no stage makes; add "oracle" to stages, '
            "or set oracle = false in [compare] for the reference-free metrics alone"
        )
    compare.refuse_pairs_without_oracle(options.get("pairs"), options.get("oracle", True))
    captured = _captured_probes(plan, layout)
    if captured is None:
        return
    probes, has_draft = captured
    labels = (
        compare.compared_labels(options["methods"])
        if "methods" in options
        else compare.available_methods(probes, has_draft)
    )
    for name in labels:
        if name not in probes:
            method = method_from_spec(name)
            check_parameters(method, num_layers)
            method.captured_inputs()  # a method without an offline face says so
    if "pairs" in options:
        compare.parse_pairs(options["pairs"], labels)


def _cell_sizes(plan: Experiment, config) -> dict[str, CellSize]:
    """Each cell's examples and prompt tokens, its prompts checked against the model's positions:
    a synthetic cell's from its spec (its prompts are fitted to its length; only the first example
    of each task's shortest cell is built, to refuse a length too short for the task), a jsonl
    file's by reading it with the model's tokenizer."""
    from rankkit.data import read_spec

    sizes, tokenizer, shortest = {}, None, _shortest_of_each_task(plan)
    with warnings.catch_warnings():  # an allowed overlength prompt is warned of when it runs
        warnings.simplefilter("ignore")
        for cell in plan.data:
            with errors_in(f"cell {cell.name}"):
                check_spec_length(cell.spec, config, allow_overlength=plan.model.allow_overlength)
                spec = read_spec(cell.spec)
                if spec.kind != "jsonl":
                    if cell in shortest:  # its first example alone is built: it refuses a length too short
                        tokenizer = tokenizer or models.load_tokenizer(plan.model.name)
                        load_examples(_first_example_spec(spec), tokenizer)
                    count = declared_examples(cell.spec)
                    sizes[cell.name] = CellSize(count, count * spec.length, count * spec.length**2, spec.length, 0)
                    continue
                tokenizer = tokenizer or models.load_tokenizer(plan.model.name)
                examples = load_examples(cell.spec, tokenizer)
                prompts = check_prompt_lengths(
                    tokenizer, examples, config, allow_overlength=plan.model.allow_overlength
                )
                lengths = [prompt.num_tokens for prompt in prompts]
                longest = max(range(len(lengths)), key=lengths.__getitem__)
                sizes[cell.name] = CellSize(
                    len(examples), sum(lengths), sum(n * n for n in lengths), lengths[longest], longest
                )
    return sizes


def _shortest_of_each_task(plan: Experiment) -> list[DataCell]:
    """Of the synthetic cells, the shortest of each task: the one a length too short shows in first."""
    from rankkit.data import read_spec

    shortest: dict[tuple[str, str | None], DataCell] = {}
    for cell in plan.data:
        spec = read_spec(cell.spec)
        if spec.kind != "jsonl":
            task = (spec.kind, spec.task)
            shortest[task] = min(shortest.get(task, cell), cell, key=lambda each: each.length)
    return list(shortest.values())


def _first_example_spec(spec) -> str:
    """The spec of the first example of the synthetic ``spec`` (a ``DataSpec``) alone."""
    from rankkit.data.spec import format_spec

    depths = None if spec.depths is None else spec.depths[:1]
    params = {"task": spec.task, "n": None if depths else 1, "length": spec.length, "depths": depths, "seed": spec.seed}
    return format_spec(spec.kind, params)


def _examples_of(plan: Experiment, stage: str, size: CellSize) -> int:
    """How many of a cell's examples one unit of a model stage runs."""
    limit = _LIMITS.get(stage, lambda plan: None)(plan)
    return size.examples if limit is None else min(size.examples, limit)


def _check_units(
    plan: Experiment, running: tuple[str, ...], sizes: dict[str, CellSize], max_units: int
) -> None:
    """Refuse a grid of more than ``max_units`` units of work, before any is done."""
    work = sum(
        _examples_of(plan, stage, sizes[unit.cell.name]) if stage in MODEL_STAGES else 1
        for stage in running
        for unit in units(plan, stage)
    )
    if work > max_units:
        raise RankkitError(
            f"the grid holds {work:,} units of work (an example through a model stage, a unit of another "
            f"stage), more than {max_units:,}; shrink it, or raise the limit with --max-units"
        )


def _status(layout: Layout, plan: Experiment, stage: str, unit: Unit) -> str:
    """KEPT when the unit's marker holds its settings; NEW without a marker, unless the unit was
    started with other settings (its unfinished files are not this run's to resume); else CHANGED."""
    settings = unit_settings(plan, stage, unit)
    marker, started = layout.marker(stage, unit), layout.started(stage, unit)
    if marker.is_file():
        return KEPT if _recorded_settings(marker, marker=True) == settings else CHANGED
    if started.is_file() and _recorded_settings(started) != settings:
        return CHANGED
    return NEW


def _recorded_settings(path: Path, *, marker: bool = False) -> Any:
    """The settings a marker (or a started unit's record) holds; None for one of an older rankkit, or
    damaged: a marker's ``kept`` too, the values the merge tags its unit's rows with."""
    record = _read_json(path)
    if not isinstance(record, dict) or (marker and not _are_tags(record.get("kept"))):
        return None
    return record.get("settings")


def _are_tags(kept: Any) -> bool:
    """Whether ``kept`` holds tag columns only, each with a value its column's type holds."""
    python_types = {pl.String: str, pl.Float64: int | float}  # the rest are integers
    return isinstance(kept, dict) and all(
        name in TAG_TYPES
        and not isinstance(value, bool)
        and isinstance(value, python_types.get(TAG_TYPES[name], int))
        and (not isinstance(value, int) or value >= 0)
        for name, value in kept.items()
    )


def _plan(run: Run) -> SweepPlan:
    """Each running stage's units by status, and the examples and tokens of those that run."""
    stages = []
    for stage in run.running:
        row = StagePlan(stage)
        for unit in units(run.plan, stage):
            status = run.status(stage, unit)
            setattr(row, status, getattr(row, status) + 1)
            if status != KEPT and stage in MODEL_STAGES:
                size = run.sizes[unit.cell.name]
                count = _examples_of(run.plan, stage, size)
                row.examples += count
                row.tokens += size.tokens * count // max(size.examples, 1)
                if stage in ESTIMATED and run.timing.cost_model is not None:
                    row.seconds = (row.seconds or 0.0) + run.timing.prefills_seconds(size)
        stages.append(row)
    calibrate = None if run.timing.cost_model is not None else run.timing.calibrate
    return SweepPlan(run.layout.root, stages, calibrate)


def _check_inputs(run: Run) -> None:
    """Each running stage's inputs: finished in ``layout`` with the current settings, or made by a
    stage running with it."""
    plan, layout = run.plan, run.layout
    for stage in run.running:
        for source in NEEDS.get(stage, ()):
            if source not in plan.stages or source in run.running:
                continue
            if any(run.status(source, unit) != KEPT for unit in units(plan, source)):
                raise RankkitError(
                    f"stage {stage} needs the {source} stage's output with these settings, which "
                    f"{layout.root} does not hold yet; run --stages {source} first, or with it"
                )
    if "capture" not in plan.stages and any(stage in STORE_STAGES for stage in run.running):
        for cell in plan.data:
            if not layout.store(cell).is_dir():
                raise RankkitError(
                    f'{layout.store(cell)} does not exist; add "capture" to stages, or put the store of '
                    f"{cell.spec} there"
                )


def _check_dependents(run: Run) -> None:
    """Refuse to redo a cell's unit whose results another stage, not running, made its own from:
    they would stay in the directory, made from what is no longer there (a store captured again
    under compare's tables of the one it replaced)."""
    for stage in run.running:
        readers = [each for each in STAGES if stage in NEEDS.get(each, ()) and each not in run.running]
        changed = [unit for unit in units(run.plan, stage) if run.status(stage, unit) == CHANGED]
        for unit, reader in itertools.product(changed, readers):
            if any((run.layout.root / "parts" / reader / unit.cell.name).glob("*.done")):
                raise RankkitError(
                    f"this run redoes the {stage} stage of {unit.cell.name}, from which the {reader} "
                    f"results in {run.layout.root} were made; run {reader} with it (add it to the stages), "
                    "or choose another --out, or pass --overwrite to start the directory over"
                )


def _owned(layout: Layout) -> set[Path]:
    """The paths a sweep wrote in ``layout`` (its manifest; for a sweep from before the manifest,
    what its experiment writes)."""
    if layout.manifest.is_file():
        try:
            return {layout.root / each for each in json.loads(layout.manifest.read_text(encoding="utf-8"))}
        except (ValueError, TypeError):
            raise RankkitError(f"{layout.manifest} is damaged; restore it, or choose another --out") from None
    if not layout.experiment.is_file():
        return set()
    try:
        before = parse_experiment(
            layout.experiment.read_text(encoding="utf-8"), source=str(layout.experiment), default_name=""
        )
    except (RankkitError, UnicodeDecodeError):
        return {layout.experiment}
    return set(layout.paths(before))


def _check_directory(layout: Layout, plan: Experiment, overwrite: bool) -> None:
    """Refuse a directory holding files no sweep wrote (unless ``overwrite``, which writes beside
    them), and any path the sweep would write that it did not make, but a cell's rankkit store."""
    root = layout.root
    if root.exists() and not root.is_dir():
        raise RankkitError(f"--out {root} is a file; give a directory for the sweep's outputs")
    outputs.check_outside_stores(root, itself=True)  # a store as --out: --overwrite skips the emptiness check
    owned = _owned(layout)
    if not owned and root.is_dir() and any(root.iterdir()) and not overwrite:
        raise RankkitError(
            f"{root} is not empty and holds no sweep; choose another --out, or pass --overwrite to write "
            "the sweep beside what it holds (nothing of it is removed)"
        )
    foreign = _foreign_part(root / "parts") if overwrite and root / "parts" in owned else None
    if foreign is not None:
        raise RankkitError(
            f"{foreign} is in the sweep's parts but no sweep wrote it, and --overwrite removes the parts "
            "whole; move it out first"
        )
    if overwrite:  # every store and result is checked before any output is removed
        for path in owned:
            if layout.is_store(path):
                stores.check_removable(path)
            elif path.suffix in RESULT_SUFFIXES and path.is_file():  # one the user put in a result's place
                outputs.check_replaceable(path)
    for path in layout.paths(plan):
        if path in owned or not path.exists():
            continue
        if layout.is_store(path) and stores.is_rankkit_store(path):
            continue  # an existing store seeds its cell: capture resumes it if it holds the same run
        raise RankkitError(
            f"{path} is in the way: the sweep writes there but did not make it; move it away, or choose "
            "another --out"
        )


# What a sweep writes under parts/: <stage>/merged.json and <stage>/<cell>/<unit's files>, each
# possibly as an atomic write's leftover (.<name>.partial-<pid>)
_PART_FILE = re.compile(r"\.?[^/]+\.(parquet|done|jsonl|json)(\.partial-\d+)?")


def _foreign_part(parts: Path) -> Path | None:
    """The first path under ``parts`` that no sweep writes there, or None."""
    for path in sorted(parts.rglob("*")) if parts.is_dir() else ():
        relative = path.relative_to(parts).parts
        if path.is_dir():
            written = relative[0] in STAGES and len(relative) <= 2
        else:
            written = relative[0] in STAGES and len(relative) in (2, 3) and _PART_FILE.fullmatch(relative[-1])
        if not written:
            return path
    return None


def _prepare_directory(run: Run, text: str, overwrite: bool) -> None:
    """Remove what an earlier sweep wrote (``overwrite``) or the results of changed units, list
    what this one writes in the manifest first, and keep a copy of the experiment."""
    layout = run.layout
    owned = _owned(layout)
    if overwrite:
        for path in owned - {layout.manifest}:
            _remove(path, layout)
        for folder in (layout.stores, layout.root / "dashboards"):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        owned = set()
    listed = sorted(path.relative_to(layout.root).as_posix() for path in owned | set(layout.paths(run.plan)))
    if _read_json(layout.manifest) != listed:
        outputs.write_text(json.dumps(listed, indent=1), layout.manifest)
    if not layout.experiment.is_file() or layout.experiment.read_text(encoding="utf-8") != text:
        outputs.write_text(text, layout.experiment)
    for stage in run.running:
        for unit in units(run.plan, stage):
            status = run.status(stage, unit)
            if status == CHANGED:
                _discard(layout, stage, unit)
            if status != KEPT and stage in MODEL_STAGES:  # they resume inside a unit
                record = {"settings": unit_settings(run.plan, stage, unit)}
                outputs.write_text(json.dumps(record), layout.started(stage, unit))


def _remove(path: Path, layout: Layout) -> None:
    if layout.is_store(path):
        stores.remove(path)  # the store's own rule: never what rankkit did not write in it
    elif path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _discard(layout: Layout, stage: str, unit: Unit) -> None:
    """The result of a unit whose settings changed: the store and its markers for capture, the
    unit's files and marker for the others (an oracle is recomputed in place, ``redo``)."""
    if stage == "oracle":
        return
    if stage == "capture":
        stores.remove(layout.store(unit.cell))
        for marker in (layout.marker("capture", unit), layout.marker("oracle", unit)):
            marker.unlink(missing_ok=True)
        return
    part = layout.part(stage, unit)
    layout.marker(stage, unit).unlink(missing_ok=True)
    for pattern in (f"{unit.variant}.*", f".{unit.variant}.*"):  # its files, rank parts and journals
        for leftover in part.parent.glob(pattern):
            leftover.unlink()
    if stage == "dashboard":
        layout.dashboard(unit.cell).unlink(missing_ok=True)


class _Counter:
    """A stage's progress: ``Progress(stage, done, total)`` over its units or its examples."""

    def __init__(self, progress: ProgressCallback, stage: str):
        self.progress, self.stage = progress, stage
        self.done, self.total = 0, None

    def start(self, total: int) -> None:
        self.total = total
        self.progress(Progress(self.stage, 0, total))

    def advance(self, steps: int, detail: str) -> None:
        self.done += steps
        self.progress(Progress(self.stage, self.done, self.total, detail))

    def within(self, steps: int, unit: str) -> ProgressCallback:
        """A callback for a library call worth ``steps``: its own events, scaled into them."""

        def report(event: Progress) -> None:
            inner = steps if not event.total else min(steps, event.done * steps // event.total)
            detail = f"{unit}: {event.stage} {event.detail}".rstrip()
            self.progress(Progress(self.stage, self.done + inner, self.total, detail))

        return report


def _write_marker(run: Run, stage: str, unit: Unit, kept: dict[str, Any] | None = None) -> None:
    """Mark a unit finished, with its settings, the rankkit version and what the merge needs
    besides its frames (``kept``); rank 0 alone writes, after every rank has done its share."""
    if shard()[0] == 0:
        marker = {"settings": unit_settings(run.plan, stage, unit), "rankkit_version": __version__}
        outputs.write_text(json.dumps({**marker, "kept": kept or {}}), run.layout.marker(stage, unit))


def _capture_stage(run: Run, step: _Counter, summary: SweepSummary) -> None:
    """Every cell's store; with the oracle stage running too, its oracles in the same pass (and
    the oracle stage's report beside capture's)."""
    plan, layout = run.plan, run.layout
    oracle = plan.oracle if "oracle" in run.running else None
    reports = [summary.report("capture")] + ([summary.report("oracle")] if oracle else [])
    step.start(sum(run.share(cell) for cell in plan.data))
    for unit in units(plan, "capture"):
        count = run.share(unit.cell)
        if run.status("capture", unit) == KEPT:
            if oracle and run.status("oracle", unit) != KEPT:
                _add_oracle(run, unit, step.within(count, unit.cell.name))
                reports[1].ran += 1
            elif oracle:
                reports[1].skipped += 1
            reports[0].skipped += 1
            step.advance(count, f"{unit.cell.name} finished before")
            continue
        capture(
            model=plan.model.name,
            data=unit.cell.spec,
            probes=plan.probes,
            out=layout.store(unit.cell),
            device=plan.model.device,
            oracle=oracle,
            draft=plan.capture.draft,
            progress=step.within(count, unit.cell.name),
            allow_overlength=plan.model.allow_overlength,
            score_dtype=plan.capture.score_dtype,
            device_map=plan.model.device_map,
        )  # returns once every rank has written its share
        _write_marker(run, "capture", unit)
        if oracle:
            _write_marker(run, "oracle", unit)
        for report in reports:
            report.ran += 1
        step.advance(count, unit.cell.name)


def _add_oracle(run: Run, unit: Unit, progress: ProgressCallback) -> None:
    """The oracles of a cell's store, recomputed in place when their settings changed."""
    add_oracle(
        run.layout.store(unit.cell),
        options=run.plan.oracle,
        model=run.plan.model.name,
        device=run.plan.model.device,
        redo=run.status("oracle", unit) == CHANGED,
        progress=progress,
        device_map=run.plan.model.device_map,
    )  # returns once every rank has added its share
    _write_marker(run, "oracle", unit)


def _oracle_stage(run: Run, step: _Counter, summary: SweepSummary) -> None:
    """The oracles of stores captured without them (capture running too adds them itself)."""
    if "capture" in run.running:
        return
    report = summary.report("oracle")
    step.start(sum(run.share(cell) for cell in run.plan.data))
    for unit in units(run.plan, "oracle"):
        count = run.share(unit.cell)
        if run.status("oracle", unit) == KEPT:
            report.skipped += 1
            step.advance(count, f"{unit.cell.name} finished before")
            continue
        _add_oracle(run, unit, step.within(count, unit.cell.name))
        report.ran += 1
        step.advance(count, unit.cell.name)


def _sharded_stage(stage: str, run_unit: Callable[..., None]):
    """A model stage whose every rank writes its share of a unit's rows to a part of its own
    (``Layout.rank_part``), merged by rank 0 into the unit's part after the barrier."""

    def run_stage(run: Run, step: _Counter, summary: SweepSummary) -> None:
        report = summary.report(stage)
        rank, world = shard()
        grid = units(run.plan, stage)
        limit = _LIMITS[stage](run.plan)
        step.start(sum(run.share(unit.cell, limit) for unit in grid))
        for unit in grid:
            count = run.share(unit.cell, limit)
            own = run.layout.rank_part(stage, unit, rank, world)
            if run.status(stage, unit) == KEPT:
                report.skipped += 1
                step.advance(count, f"{unit.cell.name} {unit.variant} finished before")
                continue
            # a part merged (or this rank's share written) before an interrupt is this unit's result
            if count and not run.layout.part(stage, unit).exists() and not own.exists():
                run_unit(run.plan, unit, own, step.within(count, f"{unit.cell.name} {unit.variant}"))
            report.ran += 1
            step.advance(count, f"{unit.cell.name} {unit.variant}")

    return run_stage


def _bench_unit(plan: Experiment, unit: Unit, out: Path, progress: ProgressCallback) -> None:
    run_bench(
        list(plan.bench.methods),
        unit.cell.spec,
        **budget_keywords(plan.budgets),
        limit=plan.bench.limit,
        out=out,
        options=plan.bench.options(unit.layer),
        settings=plan.bench.settings,
        setup=Setup(
            plan.model.name,
            rank_device(plan.model.device),
            allow_overlength=plan.model.allow_overlength,
            device_map=plan.model.device_map,
            cuda_graphs=plan.bench.cuda_graphs,
            compile_decode=plan.bench.compile_decode,
        ),
        progress=progress,
        shard=shard(),
    )


def _diffusion_unit(plan: Experiment, unit: Unit, out: Path, progress: ProgressCallback) -> None:
    diffusion_probe(
        unit.cell.spec,
        model=plan.model.name,
        limit=plan.diffusion.limit,
        device=rank_device(plan.model.device),
        max_new_tokens=plan.diffusion.max_new_tokens,
        out=out,
        allow_overlength=plan.model.allow_overlength,
        progress=progress,
        shard=shard(),
    )


_LIMITS = {  # how many of a cell's examples a sharded stage runs (None: all)
    "bench": lambda plan: plan.bench.limit,
    "diffusion": lambda plan: plan.diffusion.limit,
}
_MODEL_STAGES = {
    "capture": _capture_stage,
    "oracle": _oracle_stage,
    "bench": _sharded_stage("bench", _bench_unit),
    "diffusion": _sharded_stage("diffusion", _diffusion_unit),
}
_EXAMPLE_COLUMN = {"bench": "example_id", "diffusion": "example"}


def _merge(run: Run, stage: str, world: int) -> list[Path]:
    """After a model stage: each unit's rank parts as the unit's part, rows in example order (as
    one rank would have written them), then the stage's parquet; returns what it wrote (for capture
    and the oracle: the stores they wrote into)."""
    if stage not in _EXAMPLE_COLUMN:
        return [run.layout.store(unit.cell) for unit in units(run.plan, stage) if run.status(stage, unit) != KEPT]
    for unit in units(run.plan, stage):
        part = run.layout.part(stage, unit)
        if run.status(stage, unit) == KEPT:
            continue
        if part.exists():  # merged before an interrupt
            _write_marker(run, stage, unit)
            continue
        shares = [run.layout.rank_part(stage, unit, rank, world) for rank in range(world)]
        limit = _LIMITS[stage](run.plan)
        for rank, path in enumerate(shares):  # a rank with examples to run that left no part did not finish
            if not path.exists() and run.share(unit.cell, limit, of=(rank, world)):
                raise RankkitError(
                    f"{path} is missing: rank {rank} of {world} did not finish its share of the {stage} "
                    f"stage of {unit.cell.name}; rerun the same command to redo it"
                )
        frames = [pl.read_parquet(path) for path in shares if path.exists()]
        by_example = [frame.partition_by(_EXAMPLE_COLUMN[stage], maintain_order=True) for frame in frames]
        outputs.write_parquet(pl.concat(interleave(by_example), how="diagonal_relaxed"), part)
        for pattern in (f"{unit.variant}.rank*", f".{unit.variant}.rank*"):  # journals, other world sizes
            for leftover in part.parent.glob(pattern):
                leftover.unlink()
        _write_marker(run, stage, unit)
    return _write_stage_outputs(run, stage)


def _merge_record(run: Run, stage: str) -> list:
    """What a stage's outputs are made of: each unit of its grid with its settings."""
    return [
        [unit.cell.name, unit.variant, unit_settings(run.plan, stage, unit)]
        for unit in units(run.plan, stage)
    ]


def _write_stage_outputs(run: Run, stage: str) -> list[Path]:
    """The stage's parquet files: every unit's frames, tagged with the unit, one after another;
    rewritten when the units behind them differ from those they were made of, or one is missing or
    damaged (a rerun is how a user mends a sweep)."""
    targets = run.layout.stage_outputs(stage)
    record, merged = _merge_record(run, stage), run.layout.merged(stage)
    whole = all(target.is_file() and outputs.written_by_rankkit(target) for target in targets)
    if whole and _read_json(merged) == record:
        return []
    grid = units(run.plan, stage)
    for index, target in enumerate(targets):
        frames = []
        for unit in grid:
            part = run.layout.part(stage, unit)
            files = [part] if len(targets) == 1 else _library_paths(stage, part)
            kept = _read_json(run.layout.marker(stage, unit))["kept"]
            frames.append(_tagged(pl.read_parquet(files[index]), unit.tags() | kept))
        outputs.write_parquet(pl.concat(frames, how="diagonal_relaxed"), target)
    outputs.write_text(json.dumps(record), merged)
    return targets


def _read_json(path: Path) -> Any:
    """A file rankkit wrote as JSON, or None when it is not there or damaged: a record of what an
    output was made of, so the output is made again."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None


def _library_paths(stage: str, part: Path) -> list[Path]:
    """The files compare's or variance's ``write(part)`` wrote, in the order of the stage's outputs."""
    return compare.output_paths(part) if stage == "compare" else variance.output_paths(part)


def _tagged(frame: pl.DataFrame, tags: dict[str, Any]) -> pl.DataFrame:
    """``frame`` with ``tags`` as leading columns (an empty frame stays empty)."""
    columns = [pl.lit(value, dtype=TAG_TYPES[name]).alias(name) for name, value in tags.items()]
    return frame.with_columns(columns).select(*tags, pl.exclude(*tags))


def _store_stage(stage: str, run_unit: Callable[[Run, Unit], dict[str, Any]]):
    """A stage reading the stores, unit by unit; ``run_unit`` writes a unit's files and returns what
    its marker keeps for the merge."""

    def run_stage(run: Run, step: _Counter, report: StageReport) -> None:
        grid = units(run.plan, stage)
        step.start(len(grid))
        for unit in grid:
            if run.status(stage, unit) == KEPT:
                report.skipped += 1
                step.advance(1, f"{unit.cell.name} {unit.variant} finished before")
                continue
            _write_marker(run, stage, unit, run_unit(run, unit))
            report.ran += 1
            step.advance(1, f"{unit.cell.name} {unit.variant}")
        report.outputs += _write_stage_outputs(run, stage)

    return run_stage


def _compare_unit(run: Run, unit: Unit) -> dict[str, Any]:
    (result,) = compare.compare_keeps(
        run.layout.store(unit.cell),
        **unit.budget.keywords,
        layer=unit.layer,
        workers=run.workers,
        out=run.layout.part("compare", unit),
        overwrite=True,  # frames written before an interrupt, before the unit's marker
        **run.plan.compare.kwargs(),
    )
    return {"pruning_layer": result.pruning_layer}


def _variance_unit(run: Run, unit: Unit) -> dict[str, Any]:
    variance.variance_store(
        run.layout.store(unit.cell),
        **unit.budget.keywords,
        workers=run.workers,
        out=run.layout.part("variance", unit),
        overwrite=True,  # frames written before an interrupt, before the unit's marker
        **run.plan.variance.kwargs(),
    )
    return {}


def _dashboard_stage(run: Run, step: _Counter, report: StageReport) -> None:
    """One dashboard per cell, with its bench and diffusion rows; an index page linking them."""
    from rankkit.report import write_dashboard, write_index

    plan, layout = run.plan, run.layout
    grid = units(plan, "dashboard")
    step.start(len(grid))
    frames = None  # read once, when a dashboard is to be drawn
    for unit in grid:
        if run.status("dashboard", unit) == KEPT:
            report.skipped += 1
            step.advance(1, f"{unit.cell.name} finished before")
            continue
        frames = frames or [_stage_frame(run, stage) for stage in ("bench", "diffusion")]
        bench, diffusion = frames
        report.outputs.append(
            write_dashboard(
                layout.store(unit.cell),
                layout.dashboard(unit.cell),
                bench=cell_rows(bench, unit.cell, first_layer=plan.layers[0]),
                diffusion=cell_rows(diffusion, unit.cell),
                overwrite=True,  # a page drawn before an interrupt, before its marker
                workers=run.workers,
                **budget_keywords(plan.budgets),
                needle_keep=plan.compare.needle_keep,
            )
        )
        _write_marker(run, "dashboard", unit)
        report.ran += 1
        step.advance(1, unit.cell.name)
    rows = [
        {
            "cell": cell.name,
            "data": cell.spec,
            "examples": str(len(stores.open(layout.store(cell)))),
            "dashboard": layout.dashboard(cell).relative_to(layout.root).as_posix(),
        }
        for cell in plan.data
    ]
    facts = [("model", plan.model.name), ("stages", ", ".join(plan.stages)), ("cells", str(len(plan.data)))]
    if plan.description:
        facts.insert(0, ("about", plan.description))
    record = json.loads(json.dumps([plan.name, facts, rows]))
    if report.ran or not layout.index.exists() or _read_json(layout.merged("dashboard")) != record:
        report.outputs.append(write_index(layout.index, f"rankkit sweep: {plan.name}", facts, rows))
        outputs.write_text(json.dumps(record), layout.merged("dashboard"))


def _stage_frame(run: Run, stage: str) -> pl.DataFrame | None:
    """A model stage's parquet, when the experiment has the stage."""
    if stage not in run.plan.stages:
        return None
    (path,) = run.layout.stage_outputs(stage)
    return pl.read_parquet(path)


def cell_rows(
    frame: pl.DataFrame | None, cell: DataCell, first_layer: int | None = None
) -> pl.DataFrame | None:
    """The rows of ``cell``; of bench's, those at the first layer setting, so each method and budget
    appears once in the dashboard and in a summary (which refuses an example twice)."""
    if frame is None:
        return None
    rows = frame.filter(pl.col("cell") == cell.name)
    if "layer_setting" in rows.columns:
        same = (
            pl.col("layer_setting").is_null()
            if first_layer is None
            else pl.col("layer_setting") == first_layer
        )
        rows = rows.filter(same)
    return rows


_STORE_STAGES = {
    "compare": _store_stage("compare", _compare_unit),
    "variance": _store_stage("variance", _variance_unit),
    "dashboard": _dashboard_stage,
}
