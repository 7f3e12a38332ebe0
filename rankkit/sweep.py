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

Resume: each unit's result is kept under ``parts/<stage>/<cell>/`` as it finishes (the
library's own files, written atomically, then a ``.done`` marker for multi-file results);
capture, oracle, bench and diffusion also resume inside a unit, example by example. A rerun skips every
finished unit and stage output, so an interrupted sweep loses at most the examples in
flight. ``experiment.toml`` in DIR is the experiment that made it: another one is refused
unless ``overwrite``, which discards the previous sweep's outputs.

Sharding: under ``torchrun`` every rank runs the model stages on its share of each cell's
examples (``rankkit.shards``): capture and oracle write into the one store, bench and
diffusion each into a part of their own. After a barrier rank 0 merges the parts in example
order and runs the stages that read the stores; the other ranks return.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl

from rankkit import models, outputs, stores
from rankkit.bench import Setup
from rankkit.bench import bench as run_bench
from rankkit.capture import add_oracle, capture, capture_probes
from rankkit.checks import check_prompt_lengths, check_spec_length
from rankkit.data import load_examples
from rankkit.errors import RankkitError
from rankkit.eval import compare, variance
from rankkit.eval.diffusion import diffusion_probe
from rankkit.eval.offline import method_from_spec, split_names
from rankkit.experiment import (
    MODEL_STAGES,
    STAGES,
    DataCell,
    Experiment,
    errors_in,
    parse_experiment,
    read_experiment,
)
from rankkit.interrupts import keep_on_interrupt
from rankkit.methods import Budget, check_parameters
from rankkit.progress import Progress, ProgressCallback, ignore
from rankkit.shards import interleave, process_group, rank_device, shard, share_size, wait_for_other_ranks

EXPERIMENT_FILE = "experiment.toml"
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

    @property
    def budget_value(self) -> float | int:
        """The budget as compare and variance take it: a keep rate or a token count."""
        return self.budget.keep if self.budget.tokens is None else self.budget.tokens

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

    def store(self, cell: DataCell) -> Path:
        return self.root / "stores" / f"{cell.name}.zarr"

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

    def stage_outputs(self, stage: str) -> list[Path]:
        """The parquet files a stage leaves in the directory (none for capture, oracle and dashboard)."""
        target = self.root / f"{stage}.parquet"
        if stage == "compare":
            return compare.output_paths(target)
        if stage == "variance":
            return variance.output_paths(target)
        return [target] if stage in ("bench", "diffusion") else []

    def everything(self) -> list[Path]:
        """Every path a sweep writes at the top of its directory, for ``overwrite`` to discard."""
        paths = [
            self.experiment,
            self.index,
            *(self.root / name for name in ("stores", "parts", "dashboards")),
        ]
        return paths + [path for stage in STAGES for path in self.stage_outputs(stage)]


@dataclass(frozen=True)
class Run:
    """What every stage of one ``sweep`` call works from."""

    plan: Experiment
    layout: Layout
    running: tuple[str, ...]  # the stages this call runs
    examples: dict[str, int]  # per cell, its examples (known when a model stage runs)
    workers: int | None = None

    def share(self, cell: DataCell, limit: int | None = None, of: tuple[int, int] | None = None) -> int:
        """This rank's share of the cell's examples (of the first ``limit``), or the share of
        ``of``, another (rank, world size)."""
        count = self.examples[cell.name]
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
    stages: list[StageReport] = field(default_factory=list)
    seconds: float = 0.0

    def kept(self) -> str:
        done = ", ".join(f"{report.stage} {report.ran + report.skipped}" for report in self.stages)
        return (
            f"interrupted: kept every finished unit in {self.out} ({done or 'none finished'}) and every "
            "example written whole; rerun the same command to resume"
        )


def sweep(
    experiment: str | os.PathLike,
    out: str | os.PathLike,
    *,
    stages: list[str] | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    progress: ProgressCallback = ignore,
) -> SweepSummary:
    """Run the experiment file ``experiment`` into the directory ``out`` (see the module docstring).

    ``stages`` runs only those of the experiment's stages (default: all of them); a stage
    whose inputs another stage makes must find them finished in ``out`` or run with it.
    Everything is checked before any model loads. ``progress`` gets ``Progress`` events whose
    ``stage`` is the sweep stage, counting this rank's examples (model stages) or units.
    ``workers`` processes share the store-level analyses (their results do not depend on it).
    """
    experiment_path = Path(experiment)
    plan, text = read_experiment(experiment_path)
    running = _running(plan, stages, experiment_path)
    layout = Layout(Path(out))
    rank, world = shard()
    # Every rank checks before the process group forms, so before rank 0 writes anything.
    _check_directory(layout, plan, overwrite)
    examples = check(plan, layout, running, experiment_path)
    run = Run(plan, layout, running, examples, workers)
    summary = SweepSummary(layout.root, plan.name, rank, world)
    started = time.perf_counter()
    with keep_on_interrupt(summary.kept), process_group(world):
        if rank == 0:
            _prepare_directory(layout, text, overwrite)
        wait_for_other_ranks(world)  # no rank writes before the directory is ready
        for stage in (each for each in running if each in MODEL_STAGES):
            summary.stages += _MODEL_STAGES[stage](run, _Counter(progress, stage))
        wait_for_other_ranks(world)
    if rank == 0:
        with keep_on_interrupt(summary.kept):
            for report in summary.stages:
                report.outputs += _merge(run, report.stage, world)
            for stage in (each for each in running if each not in MODEL_STAGES):
                summary.stages.append(_STORE_STAGES[stage](run, _Counter(progress, stage)))
    summary.seconds = time.perf_counter() - started
    return summary


def _running(plan: Experiment, stages: list[str] | None, path: Path) -> tuple[str, ...]:
    if stages is None:
        return plan.stages
    unknown = [stage for stage in stages if stage not in plan.stages]
    if unknown:
        raise RankkitError(
            f"--stages {unknown[0]} is not a stage of {path} ({', '.join(plan.stages)}); add it to the "
            "file's stages, or choose from those"
        )
    return tuple(stage for stage in STAGES if stage in stages)


def check(plan: Experiment, layout: Layout, running: tuple[str, ...], path: Path) -> dict[str, int]:
    """Everything the stages would refuse, checked against the model's config and tokenizer (no
    weights load) and the directory: every cell's examples and prompt lengths, layers, methods and
    pairs, ASL's layers, and that the inputs of each running stage are in ``layout`` or made by a
    stage running with it. Returns each cell's number of examples when a model stage runs."""
    with errors_in(f"{path} [model]"):
        config = models.load_config(plan.model.name)
        Setup(device_map=plan.model.device_map)
    num_layers = config.num_hidden_layers
    with errors_in(str(path)):
        for layer in plan.layers:
            if layer is not None and not 0 <= layer < num_layers:
                raise RankkitError(f"layers: {layer} is not a layer of this model (0..{num_layers - 1})")
        _check_inputs(plan, layout, running)
    if "bench" in plan.stages:
        with errors_in(f"{path} [bench]"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the bench stage itself warns of layer-less methods
            for layer in plan.layers:
                plan.bench.options(layer).build(list(plan.bench.methods), num_layers, strict=False)
    if "compare" in plan.stages:
        with errors_in(f"{path} [compare]"):
            _check_compare(plan, layout, num_layers)
    if "variance" in plan.stages:
        with errors_in(f"{path} [variance]"):
            variance.bound_curve_method(variance.curve_method(**plan.variance.kwargs()), num_layers)
    with errors_in(str(path)):
        if any(stage in MODEL_STAGES for stage in running):
            return _cell_examples(plan, config)  # last: it builds every example
    return {}


def _cell_examples(plan: Experiment, config) -> dict[str, int]:
    """Each cell's examples built with the model's tokenizer, their prompts checked against its positions."""
    tokenizer = models.load_tokenizer(plan.model.name)
    counts = {}
    with warnings.catch_warnings():  # an allowed overlength prompt is warned of when it runs
        warnings.simplefilter("ignore")
        for cell in plan.data:
            with errors_in(f"cell {cell.name}"):
                check_spec_length(cell.spec, config, allow_overlength=plan.model.allow_overlength)
                examples = load_examples(cell.spec, tokenizer)
                check_prompt_lengths(
                    tokenizer, examples, config, allow_overlength=plan.model.allow_overlength
                )
            counts[cell.name] = len(examples)
    return counts


def _check_compare(plan: Experiment, layout: Layout, num_layers: int) -> None:
    """compare's methods (their parameters against the model's depth) and pairs against the probes
    the stores will hold."""
    if "capture" in plan.stages:
        probes = [probe.key for probe in capture_probes(plan.probes)]
        has_draft = plan.capture.draft is not None
    elif not layout.store(plan.data[0]).is_dir():
        return  # nothing to check against yet; running compare needs the store (``_check_inputs``)
    else:
        meta = stores.open(layout.store(plan.data[0])).meta
        probes, has_draft = list(meta["probes"]), "draft" in meta
    options = plan.compare.kwargs()
    labels = (
        split_names(options["methods"])
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


def _check_inputs(plan: Experiment, layout: Layout, running: tuple[str, ...]) -> None:
    """Each running stage's inputs: finished in ``layout``, or made by a stage running with it."""
    for stage in running:
        for source in NEEDS.get(stage, ()):
            if source not in plan.stages or source in running:
                continue
            if not _finished(plan, layout, source):
                raise RankkitError(
                    f"stage {stage} needs the {source} stage's output, which {layout.root} does not hold "
                    f"yet; run --stages {source} first, or with it"
                )
    if "capture" not in plan.stages and any(stage in STORE_STAGES for stage in running):
        for cell in plan.data:
            if not layout.store(cell).is_dir():
                raise RankkitError(
                    f'{layout.store(cell)} does not exist; add "capture" to stages, or put the store of '
                    f"{cell.spec} there"
                )


def _finished(plan: Experiment, layout: Layout, stage: str) -> bool:
    if stage in ("capture", "oracle"):
        return all(layout.marker(stage, unit).exists() for unit in units(plan, stage))
    return all(path.exists() for path in layout.stage_outputs(stage))


def _check_directory(layout: Layout, plan: Experiment, overwrite: bool) -> None:
    """Refuse a directory made by another experiment, or holding other files, unless ``overwrite``."""
    root = layout.root
    if root.exists() and not root.is_dir():
        raise RankkitError(f"--out {root} is a file; give a directory for the sweep's outputs")
    if overwrite:
        return
    if layout.experiment.is_file():
        try:
            before = parse_experiment(
                layout.experiment.read_text(encoding="utf-8"), source=str(layout.experiment), default_name=""
            )
            differences = plan.differences(before)
        except RankkitError as error:
            differences = [f"an experiment this rankkit cannot read ({error})"]
        if differences:
            raise RankkitError(
                f"{root} holds the outputs of another experiment (it differs in {', '.join(differences)}); "
                "pass --overwrite to discard them and start over, or choose another --out"
            )
    elif root.is_dir() and any(root.iterdir()):
        raise RankkitError(
            f"{root} is not empty and holds no {EXPERIMENT_FILE}; choose another --out, or pass --overwrite "
            "to write the sweep into it"
        )


def _prepare_directory(layout: Layout, text: str, overwrite: bool) -> None:
    """Discard a previous sweep's outputs (``overwrite``) and keep a copy of the experiment."""
    if overwrite:
        for path in layout.everything():
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    if not layout.experiment.is_file() or layout.experiment.read_text(encoding="utf-8") != text:
        outputs.write_text(text, layout.experiment)


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


def _write_markers(paths: list[Path]) -> None:
    """Mark units finished; rank 0 alone writes, after every rank has done its share."""
    if shard()[0] == 0:
        for path in paths:
            outputs.write_text("{}", path)


def _capture_stage(run: Run, step: _Counter) -> list[StageReport]:
    """Every cell's store; with the oracle stage running too, its oracles in the same pass (and
    the oracle stage's report beside capture's)."""
    plan, layout = run.plan, run.layout
    report = StageReport("capture")
    oracle = plan.oracle if "oracle" in run.running else None
    step.start(sum(run.share(cell) for cell in plan.data))
    for unit in units(plan, "capture"):
        markers = [layout.marker("capture", unit)] + ([layout.marker("oracle", unit)] if oracle else [])
        count = run.share(unit.cell)
        if all(marker.exists() for marker in markers):
            report.skipped += 1
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
        _write_markers(markers)
        report.ran += 1
        step.advance(count, unit.cell.name)
    return [report] + ([replace(report, stage="oracle")] if oracle else [])


def _oracle_stage(run: Run, step: _Counter) -> list[StageReport]:
    """The oracles of stores captured without them (capture running too adds them itself)."""
    plan, layout = run.plan, run.layout
    report = StageReport("oracle")
    if "capture" in run.running:
        return []
    step.start(sum(run.share(cell) for cell in plan.data))
    for unit in units(plan, "oracle"):
        count = run.share(unit.cell)
        if layout.marker("oracle", unit).exists():
            report.skipped += 1
            step.advance(count, f"{unit.cell.name} finished before")
            continue
        add_oracle(
            layout.store(unit.cell),
            options=plan.oracle,
            model=plan.model.name,
            device=plan.model.device,
            progress=step.within(count, unit.cell.name),
            device_map=plan.model.device_map,
        )  # returns once every rank has added its share
        _write_markers([layout.marker("oracle", unit)])
        report.ran += 1
        step.advance(count, unit.cell.name)
    return [report]


def _sharded_stage(stage: str, run_unit: Callable[..., None]):
    """A model stage whose every rank writes its share of a unit's rows to a part of its own
    (``Layout.rank_part``), merged by rank 0 into the unit's part after the barrier."""

    def run_stage(run: Run, step: _Counter) -> list[StageReport]:
        report = StageReport(stage)
        rank, world = shard()
        grid = units(run.plan, stage)
        limit = _LIMITS[stage](run.plan)
        step.start(sum(run.share(unit.cell, limit) for unit in grid))
        for unit in grid:
            count = run.share(unit.cell, limit)
            own = run.layout.rank_part(stage, unit, rank, world)
            if run.layout.part(stage, unit).exists() or own.exists():
                report.skipped += 1
                step.advance(count, f"{unit.cell.name} {unit.variant} finished before")
                continue
            if count:  # a rank with no example of a small cell has nothing to write
                run_unit(run.plan, unit, own, step.within(count, f"{unit.cell.name} {unit.variant}"))
            report.ran += 1
            step.advance(count, f"{unit.cell.name} {unit.variant}")
        return [report]

    return run_stage


def _bench_unit(plan: Experiment, unit: Unit, out: Path, progress: ProgressCallback) -> None:
    run_bench(
        list(plan.bench.methods),
        list(plan.budgets),
        unit.cell.spec,
        limit=plan.bench.limit,
        out=out,
        options=plan.bench.options(unit.layer),
        settings=plan.bench.settings,
        setup=Setup(
            plan.model.name,
            rank_device(plan.model.device),
            allow_overlength=plan.model.allow_overlength,
            device_map=plan.model.device_map,
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
    one rank would have written them), then the stage's parquet; returns what it wrote."""
    if stage not in _EXAMPLE_COLUMN:
        return []
    for unit in units(run.plan, stage):
        part = run.layout.part(stage, unit)
        if part.exists():
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
    return _write_stage_outputs(run, stage)


def _write_stage_outputs(run: Run, stage: str) -> list[Path]:
    """The stage's parquet files: every unit's frames, tagged with the unit, one after another."""
    targets = run.layout.stage_outputs(stage)
    if all(target.exists() for target in targets):
        return []
    grid = units(run.plan, stage)
    for index, target in enumerate(targets):
        frames = []
        for unit in grid:
            part = run.layout.part(stage, unit)
            files = [part] if len(targets) == 1 else _library_paths(stage, part)
            marker = run.layout.marker(stage, unit)
            kept = json.loads(marker.read_text(encoding="utf-8")) if marker.exists() else {}
            frames.append(_tagged(pl.read_parquet(files[index]), unit.tags() | kept))
        outputs.write_parquet(pl.concat(frames, how="diagonal_relaxed"), target)
    return targets


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

    def run_stage(run: Run, step: _Counter) -> StageReport:
        report = StageReport(stage)
        grid = units(run.plan, stage)
        step.start(len(grid))
        for unit in grid:
            marker = run.layout.marker(stage, unit)
            if marker.exists():
                report.skipped += 1
                step.advance(1, f"{unit.cell.name} {unit.variant} finished before")
                continue
            kept = run_unit(run, unit)
            outputs.write_text(json.dumps(kept), marker)
            report.ran += 1
            step.advance(1, f"{unit.cell.name} {unit.variant}")
        report.outputs += _write_stage_outputs(run, stage)
        return report

    return run_stage


def _compare_unit(run: Run, unit: Unit) -> dict[str, Any]:
    result = compare.compare_store(
        run.layout.store(unit.cell),
        layer=unit.layer,
        keep=unit.budget_value,
        workers=run.workers,
        **run.plan.compare.kwargs(),
    )
    result.write(run.layout.part("compare", unit))
    return {"pruning_layer": result.pruning_layer}


def _variance_unit(run: Run, unit: Unit) -> dict[str, Any]:
    result = variance.variance_store(
        run.layout.store(unit.cell),
        budget=unit.budget_value,
        workers=run.workers,
        **run.plan.variance.kwargs(),
    )
    result.write(run.layout.part("variance", unit))
    return {}


def _dashboard_stage(run: Run, step: _Counter) -> StageReport:
    """One dashboard per cell, with its bench and diffusion rows; an index page linking them."""
    from rankkit.report import write_dashboard, write_index

    plan, layout = run.plan, run.layout
    report = StageReport("dashboard")
    step.start(len(plan.data))
    if all(layout.dashboard(cell).exists() for cell in plan.data) and layout.index.exists():
        report.skipped = len(plan.data)
        step.advance(len(plan.data), "finished before")
        return report
    bench, diffusion = (_stage_frame(run, stage) for stage in ("bench", "diffusion"))
    for cell in plan.data:
        target = layout.dashboard(cell)
        if target.exists():
            report.skipped += 1
            step.advance(1, f"{cell.name} finished before")
            continue
        report.outputs.append(
            write_dashboard(
                layout.store(cell),
                target,
                bench=_cell_rows(bench, cell, first_layer=plan.layers[0]),
                diffusion=_cell_rows(diffusion, cell),
                workers=run.workers,
            )
        )
        report.ran += 1
        step.advance(1, cell.name)
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
    report.outputs.append(write_index(layout.index, f"rankkit sweep: {plan.name}", facts, rows))
    return report


def _stage_frame(run: Run, stage: str) -> pl.DataFrame | None:
    """A model stage's parquet, when the experiment has the stage."""
    if stage not in run.plan.stages:
        return None
    (path,) = run.layout.stage_outputs(stage)
    return pl.read_parquet(path)


def _cell_rows(
    frame: pl.DataFrame | None, cell: DataCell, first_layer: int | None = None
) -> pl.DataFrame | None:
    """The rows of ``cell``; of bench's, those at the first layer setting, so each method and budget
    appears once in the dashboard."""
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
