"""ASL's relative rank-variance curves and the selection layer each threshold would choose
(ASL Sec. 4.1, Appendix A Algorithm 2, Fig. 6).

Frames:

curves      example, task, probe, layer, relative_variance   (null before L_min, or without variance at L_min)
selections  example, task, probe, tau, selection_layer        (null when the curve never drops below tau)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from rankkit.errors import RankkitError

if TYPE_CHECKING:
    from rankkit.stores import Store

from .ranking import descending_ranks, keep_count

# ASL Sec. 5.5 sweeps the threshold over these values; 0.3 is its default.
THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6)
OBSERVED_LAYERS = 8  # L_obs, ASL Sec. 5.1
DEFAULT_BUDGET = 0.1


def default_min_layer(num_layers: int) -> int:
    """L_min = floor(L / 3) (ASL Appendix D.2)."""
    return num_layers // 3


def rank_variance_curve(
    layer_scores: np.ndarray,
    budget: float | int = DEFAULT_BUDGET,
    min_layer: int | None = None,
    observed_layers: int = OBSERVED_LAYERS,
) -> np.ndarray:
    """ASL's relative rank variance at every layer, as Algorithm 2 computes it layer by layer: [L], NaN before L_min.

    ``layer_scores`` is [L, T] or [L, kv_heads, T]; heads are summed (ASL Sec. 4.1, "scores =
    sum over groups and heads of PA"). Per layer the tokens are ranked in descending order
    (Algorithm 1's RankDesc; ties to the earlier token). At layer l >= L_min Algorithm 2 takes
    the ranks of layers l - L_obs + 1..l (clipped at layer 0), the union U of each layer's
    top-k tokens (k from ``keep_count(budget, T)``; Algorithm 2's k = KV_budget - W when the
    window is not among the ranked tokens), and the mean over U of each token's rank
    variance across those layers, divided by the same quantity at L_min. The variance is the
    population one; the choice cancels in the ratio. A zero variance at L_min gives NaN or inf.
    """
    scores = np.asarray(layer_scores)
    if scores.ndim == 3:
        scores = scores.sum(axis=1)
    if scores.ndim != 2:
        raise ValueError(f"layer scores must be [L, T] or [L, heads, T], got shape {np.shape(layer_scores)}")
    num_layers, num_tokens = scores.shape
    min_layer = default_min_layer(num_layers) if min_layer is None else min_layer
    if not 0 <= min_layer < num_layers:
        raise ValueError(f"L_min {min_layer} is outside 0..{num_layers - 1}")
    if observed_layers < 1:
        raise ValueError(f"L_obs must be >= 1, got {observed_layers}")

    ranks = descending_ranks(scores)
    in_top_k = ranks < keep_count(budget, num_tokens)
    variances = np.full(num_layers, np.nan)
    for layer in range(min_layer, num_layers):
        window = slice(max(0, layer - observed_layers + 1), layer + 1)
        union = in_top_k[window].any(axis=0)
        variances[layer] = ranks[window][:, union].var(axis=0).mean()
    with np.errstate(divide="ignore", invalid="ignore"):
        return variances / variances[min_layer]


def selection_layer(curve: np.ndarray, threshold: float) -> int | None:
    """The first layer whose relative variance is below ``threshold`` (ASL Algorithm 2, line 9), or None."""
    below = np.flatnonzero(np.asarray(curve) < threshold)  # NaN (before L_min) is never below
    return int(below[0]) if below.size else None


@dataclass(frozen=True)
class VarianceResult:
    min_layer: int
    curves: pl.DataFrame
    selections: pl.DataFrame

    def write(self, path: str | os.PathLike) -> list[Path]:
        """``curves`` to ``path``, ``selections`` beside it as <stem>.selections.parquet; returns the paths."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        selections = target.with_name(f"{target.stem}.selections.parquet")
        self.curves.write_parquet(target)
        self.selections.write_parquet(selections)
        return [target, selections]

    def by_example(self) -> list[dict[str, Any]]:
        """One plain dict per example: example, task, probe, min_layer, relative_variance (a list over
        all layers, None before L_min) and selection_layer ({"0.3": layer or None, ...})."""
        curves = self.curves.group_by("example", "task", "probe", maintain_order=True).agg(
            "relative_variance"
        )
        selections = self.selections.group_by("example", maintain_order=True).agg("tau", "selection_layer")
        rows = []
        for curve, selection in zip(
            curves.iter_rows(named=True), selections.iter_rows(named=True), strict=True
        ):
            chosen = dict(
                zip((f"{tau:g}" for tau in selection["tau"]), selection["selection_layer"], strict=True)
            )
            rows.append({**curve, "min_layer": self.min_layer, "selection_layer": chosen})
        return rows


def variance_store(
    path: str | os.PathLike | Store,  # a path, or a store already open
    *,
    probe: str = "window",
    budget: float | int = DEFAULT_BUDGET,
    min_layer: int | None = None,
    observed_layers: int = OBSERVED_LAYERS,
    thresholds: Sequence[float] = THRESHOLDS,
    ranked_span: str | None = "context_tokens",
) -> VarianceResult:
    """ASL curves and selection layers for every complete example of a store.

    ``probe`` should be the window-softmax scores ASL ranks by (Algorithm 1). Tokens are
    ranked within ``spans[ranked_span]`` when the example has that span (ASL ranks the
    past-only tokens, Algorithm 1 line 4), else all of them; None ranks all tokens.
    """
    from rankkit import stores

    from .compare import ranked_slice, scored_layers

    store = stores.open(path)
    records = list(store.examples())
    if not records:
        raise RankkitError(f"store {store.path} has no complete example; capture into it first")
    if min_layer is None:
        min_layer = default_min_layer(scored_layers(records))
    curve_frames, selection_rows = [], []
    for record in records:
        if probe not in record.probes:
            raise RankkitError(
                f"example {record.id!r} has no {probe!r} scores (it has {', '.join(record.probes)}); "
                "pass --probe with one of those"
            )
        ranked = ranked_slice(record.attrs.get("spans"), ranked_span, record.num_tokens)
        try:
            curve = rank_variance_curve(record.scores(probe)[..., ranked], budget, min_layer, observed_layers)
        except ValueError as error:
            raise RankkitError(
                f"example {record.id!r}: {error}; adjust --l-min, --l-obs or --budget"
            ) from None
        task = record.attrs.get("task")
        curve_frames.append(
            pl.DataFrame(
                {
                    "layer": np.arange(curve.size, dtype=np.int32),
                    "relative_variance": curve,
                }
            )
            .with_columns(  # null before L_min and where a zero variance at L_min leaves no ratio
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
        selection_rows += [
            {
                "example": record.id,
                "task": task,
                "probe": probe,
                "tau": float(threshold),
                "selection_layer": selection_layer(curve, threshold),
            }
            for threshold in thresholds
        ]
    selection_schema = {
        "example": pl.Categorical,
        "task": pl.String,
        "probe": pl.String,
        "tau": pl.Float64,
        "selection_layer": pl.Int32,
    }
    return VarianceResult(
        min_layer, pl.concat(curve_frames), pl.DataFrame(selection_rows, schema=selection_schema)
    )
