"""ASL's relative rank-variance curves and the selection layer each threshold would choose
(ASL Sec. 4.1, Appendix A Algorithm 2, Fig. 6).

Frames:

curves      example, task, probe, layer, relative_variance   (null before L_min), and cluster where the
            store's examples name one (``compare.with_clusters``)
selections  example, task, probe, tau, selection_layer, fallback: the layer ``asl`` selects at tau
            (``rankkit.methods.asl.selection_layer``), and whether it is its last layer only because
            the curve never drops below tau
means       task, probe, layer, relative_variance, relative_variance_ci_low, relative_variance_ci_high,
            relative_variance_n, n_examples (and n_clusters): the mean curve per task with its 95% interval over the task's
            examples, resampling clusters where they share one (``rankkit.eval.stats``), from L_min on
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from rankkit import defaults, outputs
from rankkit.checks import first_repeated, warn_budgets, warn_timing_only_store
from rankkit.errors import RankkitError
from rankkit.methods import Budget
from rankkit.methods.asl import Asl, is_fallback, selection_layer
from rankkit.methods.base import declared_bounds
from rankkit.values import as_list, check_number

from .offline import captured, check_inputs, method_from_spec
from .parallel import checked_workers, map_examples
from .stats import cluster_column, mean_intervals

if TYPE_CHECKING:
    from rankkit.stores import Store


def output_paths(path: str | os.PathLike) -> list[Path]:
    """The files ``VarianceResult.write(path)`` writes: the curves at ``path``, the selections and
    the mean curves beside it."""
    target = outputs.named_file(path)
    return [target, *(target.with_name(f"{target.stem}.{name}.parquet") for name in ("selections", "means"))]


def mean_curves(curves: pl.DataFrame) -> pl.DataFrame:
    """The ``means`` frame of ``curves`` (see the module docstring)."""
    defined = curves.filter(pl.col("relative_variance").is_not_null())
    if not defined.height:
        return pl.DataFrame()
    by_task = defined.partition_by("task")  # resampled within each task; in first-seen order, polars' default
    return pl.concat(
        [
            mean_intervals(
                task,
                ["task", "probe", "layer"],
                ["relative_variance"],
                example="example",
                cluster=cluster_column(task),
            )
            for task in by_task
        ]
    )


@dataclass(frozen=True)
class VarianceResult:
    min_layer: int
    curves: pl.DataFrame
    selections: pl.DataFrame
    store: Path  # the store the curves were drawn from: ``write`` keeps its outputs out of it

    @cached_property
    def means(self) -> pl.DataFrame:
        return mean_curves(self.curves)

    def write(self, path: str | os.PathLike, *, overwrite: bool = False) -> list[Path]:
        """``curves`` to ``path``, ``selections`` and ``means`` beside it as <stem>.selections.parquet
        and <stem>.means.parquet; returns the paths. Refused as ``rankkit variance --out`` is
        (``compare.claim_outputs``)."""
        from .compare import claim_outputs

        paths = claim_outputs(output_paths(path), self.store, overwrite=overwrite)
        frames = (self.curves, self.selections, self.means)
        return [outputs.write_parquet(frame, file, overwrite=overwrite) for frame, file in zip(frames, paths, strict=True)]

    def by_example(self) -> list[dict[str, Any]]:
        """One plain dict per example: example, task, probe, min_layer, relative_variance (a list over
        all layers, None before L_min), selection_layer ({"0.3": layer, ...}) and fallback
        ({"0.3": True where no layer fell below 0.3 and the last one selects, ...})."""
        curves = self.curves.group_by("example", "task", "probe", maintain_order=True).agg(
            "relative_variance"
        )
        selections = self.selections.group_by("example", maintain_order=True).agg(
            "tau", "selection_layer", "fallback"
        )
        rows = []
        for curve, selection in zip(
            curves.iter_rows(named=True), selections.iter_rows(named=True), strict=True
        ):
            taus = [f"{tau:g}" for tau in selection["tau"]]
            chosen = dict(zip(taus, selection["selection_layer"], strict=True))
            fallback = dict(zip(taus, selection["fallback"], strict=True))
            rows.append(
                {**curve, "min_layer": self.min_layer, "selection_layer": chosen, "fallback": fallback}
            )
        return rows


def curve_method(
    method: str = defaults.VARIANCE_METHOD, min_layer: int | None = None, observed_layers: int | None = None
) -> Asl:
    """The ASL method ``method`` (``asl:window_size=8``) whose curve ``variance_store`` draws, with
    L_min and L_obs set where given (refused where the spec gives others)."""
    if not isinstance(method_from_spec(method), Asl):  # before the options: other methods take no L_min
        raise RankkitError(f"rankkit variance follows ASL's curve; name asl or asl-2pass, not {method!r}")
    options = {"--min-layer": ("min_layer", min_layer), "--observed-layers": ("observed_layers", observed_layers)}
    return method_from_spec(method, options=options)


def checked_thresholds(thresholds: Sequence[float] | str | float) -> list[float]:
    """``thresholds`` as a list, refused unless each is a value asl's tau takes and each is named
    once: a layer printed for tau NaN or -1, which ``asl:tau=-1`` refuses, read as a result."""
    values = as_list(thresholds, "--thresholds", float)
    if not values:
        raise RankkitError("--thresholds names nothing; give e.g. --thresholds 0.2,0.3")
    tau = declared_bounds(Asl, "tau")
    for value in values:
        check_number(value, "--thresholds")
        problem = tau.problem(value, None)
        if problem is not None:
            raise RankkitError(f"--thresholds {value:g} {problem}; give taus asl takes, e.g. --thresholds 0.2,0.3")
    twice = first_repeated(values)
    if twice is not None:
        raise RankkitError(f"--thresholds names {twice:g} twice; name each once")
    return values


def variance_store(
    path: str | os.PathLike | Store,  # a path, or a store already open
    *,
    method: str = defaults.VARIANCE_METHOD,
    keep: float | None = None,
    budget: int | None = None,
    min_layer: int | None = None,
    observed_layers: int | None = None,
    thresholds: Sequence[float] | str | float = defaults.VARIANCE_THRESHOLDS,
    workers: int | None = None,
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> VarianceResult:
    """ASL curves and selection layers for every complete example of a store.

    The curve is the ``asl`` method's own (``Asl.variance_curve``, ASL Alg. 2: the window
    probe at W = 32, k = budget - W, ranks over every token outside the window), made under the keep
    rate ``keep`` (``--keep``) or the token count ``budget`` (``--budget``), one of them, default
    keep ``defaults.KEEP``, warned of as ``compare_store`` warns of them; so at the
    method's tau (reported beside ``thresholds``) the layer chosen here is the one ``asl`` selects at.
    ``method`` may carry ASL's parameters (``asl:window_size=8``); ``min_layer``/``observed_layers``
    set L_min/L_obs, refused where they contradict the spec's. With ``out`` (``rankkit variance
    --out``) the frames are written there (``VarianceResult.write``), the path refused before any
    work unless it may be written (``compare.claim_outputs``, ``overwrite``).
    """
    from rankkit import stores

    from .compare import claim_outputs, scored_layers, with_clusters

    workers = checked_workers(workers)  # a bad --workers fails before any reading
    thresholds = checked_thresholds(thresholds)
    budget = Budget.one_of(keep, budget, default=Budget.from_keep(defaults.KEEP))
    asl = curve_method(method, min_layer, observed_layers)
    if out is not None:
        claim_outputs(output_paths(out), path, overwrite=overwrite)
    store = stores.open(path)
    warn_timing_only_store(store.meta, store.path)
    store.warn_skipped()
    records = list(store.examples())
    if not records:
        raise RankkitError(f"store {store.path} has no complete example; capture into it first")
    check_inputs([asl], records, store.meta)
    bound = asl.bind(scored_layers(records))  # refuses an L_min or L_obs the model's depth cannot hold
    warn_budgets([budget], [asl], [record.num_tokens for record in records])
    # the method's own tau among them, so the layer it selects is always reported
    reported = tuple(sorted({*thresholds, asl.tau}))
    evaluate = partial(variance_example, asl=asl, budget=budget, thresholds=reported)
    curve_frames, selection_rows = [], []
    for curve_frame, rows in map_examples(
        store.path, [record.id for record in records], evaluate, workers=workers
    ):
        curve_frames.append(curve_frame)
        selection_rows += rows
    selection_schema = {
        "example": pl.Categorical,
        "task": pl.String,
        "probe": pl.String,
        "tau": pl.Float64,
        "selection_layer": pl.Int32,
        "fallback": pl.Boolean,
    }
    curves = with_clusters(pl.concat(curve_frames), records, example="example")  # the means resample shared haystacks together
    result = VarianceResult(
        bound.min_layer, curves, pl.DataFrame(selection_rows, schema=selection_schema), store.path
    )
    if out is not None:
        result.write(out, overwrite=overwrite)
    return result


def variance_example(
    record: Any, *, asl: Asl, budget: Budget, thresholds: Sequence[float]
) -> tuple[pl.DataFrame, list[dict[str, Any]]]:
    """One stored example's curve frame and selection rows (``variance_store``'s unit of work, run in
    a worker process)."""
    probe = asl.probe().key
    curve = np.asarray(asl.variance_curve(captured(record, asl), budget))
    task = record.attrs.get("task")
    curve_frame = (
        pl.DataFrame({"layer": np.arange(curve.size, dtype=np.int32), "relative_variance": curve})
        .with_columns(  # null before L_min
            pl.when(pl.col("relative_variance").is_finite()).then(pl.col("relative_variance"))
        )
        .select(
            pl.lit(record.id, dtype=pl.Categorical).alias("example"),
            pl.lit(task, dtype=pl.String).alias("task"),
            pl.lit(probe).alias("probe"),
            "layer",
            "relative_variance",
        )
    )
    selection_rows = [
        {
            "example": record.id,
            "task": task,
            "probe": probe,
            "tau": float(threshold),
            "selection_layer": selection_layer(curve, threshold),
            "fallback": is_fallback(curve, threshold),
        }
        for threshold in thresholds
    ]
    return curve_frame, selection_rows
