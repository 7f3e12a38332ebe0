"""Every captured ranking against the Answer-Informed Oracle, layer by layer (CLAA Sec. 3.1, 4.1, Fig. 2).

Methods, each ranking the tokens of one example:

- every captured probe, its scores summed over KV heads (``per_head`` keeps the heads apart);
- "gemfilter" and "fastkv": the ``last_token_raw`` (CLAA Eq. 1) and ``window`` (Eq. 2)
  rankings under the methods' names. Each prunes at one layer; like CLAA's Fig. 2 the
  frames show them at every layer they could pick;
- "claa": at pruning layer l_p, the max of the window scores over the n = 4 layers ending
  at l_p (Eq. 5, Listing 5); ``sweep`` holds "claa-n1", "-n2", "-n4", "-n8";
- "specprefill" (CLAA Eq. 3), when an example holds a draft model's lookahead scores in
  group ``draft_scores``, array ``lookahead`` [k, ..., T] (see ``specprefill_scores``); it
  has no layer.

Which tokens are ranked: the context span (``spans.context_tokens``) when the example has
one, else all tokens. The methods always keep the observation window and question, so only
the ranking of the context decides what they keep. ``ranked_span`` changes the span.

Frames (tidy; ``example`` is Categorical like the store's frames; NaN-free, undefined = null):

per_layer  example, task, method, layer, spearman, kendall, recall_at_10, recall_at_20, recall_at_40,
           needle_recall, adjacent_spearman
per_head   example, task, method, layer, head, spearman                       (probes only)
sweep      example, task, method, claa_layers, layer, spearman, recall_at_10, recall_at_20,
           recall_at_40, needle_recall, adjacent_spearman                     (no kendall: it is the slow metric)
stability  method, mean_spearman, std_spearman, min_spearman, trough_layer, layer_to_layer
summary    method, layer, spearman, kendall, recall_at_10, recall_at_20, recall_at_40, needle_recall,
           n_examples, then the stability columns

recall_at_X: share of the oracle's top X% that the method's top X% keeps. needle_recall: share
of the evidence tokens (``spans.evidence_tokens``) in the method's top ``needle_keep``, null
without evidence. adjacent_spearman: Spearman between the method's rankings at this layer and
the one before (null at layer 0 and without layers).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from rankkit.errors import RankkitError

if TYPE_CHECKING:
    from rankkit.stores import Store

from .ranking import (
    aggregate_claa_every_layer,
    average_ranks,
    descending_ranks,
    keep_count,
    kendall,
    overlap_share,
    pearson,
    ranks_and_places,
    spans_mask,
    specprefill_scores,
)

KEEP_RATES = (0.1, 0.2, 0.4)  # CLAA Table 4
RECALL_COLUMNS = tuple(f"recall_at_{round(rate * 100)}" for rate in KEEP_RATES)
NEEDLE_KEEP = 0.1
METRIC_COLUMNS = ("spearman", "kendall", *RECALL_COLUMNS, "needle_recall")

WINDOW_PROBE = "window"
LAST_TOKEN_PROBE = "last_token_raw"
SINGLE_LAYER_METHODS = {"gemfilter": LAST_TOKEN_PROBE, "fastkv": WINDOW_PROBE}
CLAA = "claa"
CLAA_LAYERS = 4  # n, CLAA Sec. 5.1
CLAA_SWEEP = (1, 2, 4, 8)  # CLAA Table 4 explores n up to 12; 8 already spans a quarter of a 32-layer model
SPECPREFILL = "specprefill"
DRAFT_GROUP = "draft_scores"
DRAFT_ARRAY = "lookahead"


def ranked_slice(spans: Mapping[str, Any] | None, ranked_span: str | None, num_tokens: int) -> slice:
    """The tokens to rank: ``spans[ranked_span]`` as [start, end) when present, else all ``num_tokens``."""
    if ranked_span is None or not spans or ranked_span not in spans:
        return slice(0, num_tokens)
    start, end = spans[ranked_span]
    if not 0 <= start < end <= num_tokens:
        raise RankkitError(
            f"span {ranked_span} = [{start}, {end}) is empty or outside the {num_tokens} tokens; "
            "recapture the example or rank all tokens (ranked_span=None)"
        )
    return slice(start, end)


def scored_layers(records: Sequence[Any]) -> int:
    """The model's layer count, read off the first example's scores (capture scores every layer)."""
    return records[0].score_shape(records[0].probes[0])[0]


class Reference:
    """What every ranking of one example is compared with, prepared once: the oracle's average
    ranks and top-k sets, and the evidence tokens; all over the ranked tokens only.

    Without an oracle only the reference-free metrics (needle recall, adjacent-layer Spearman)
    are defined; the others come out NaN.
    """

    def __init__(
        self, oracle: np.ndarray | None, evidence: np.ndarray, needle_keep: float | int = NEEDLE_KEEP
    ):
        num_tokens = evidence.shape[0]
        self.oracle = oracle
        self.evidence = evidence
        self.needle_k = keep_count(needle_keep, num_tokens)
        self.recall_ks = [keep_count(rate, num_tokens) for rate in KEEP_RATES]
        if oracle is not None:
            self.oracle_ranks = average_ranks(oracle)
            oracle_places = descending_ranks(oracle)
            self.oracle_tops = [oracle_places < k for k in self.recall_ks]

    def metrics(self, scores: np.ndarray, *, with_kendall: bool = True) -> dict[str, np.ndarray]:
        """Metric columns for the rankings in ``scores`` [R, T] (rows are layers, in order): one value per row."""
        ranks, places = ranks_and_places(scores)
        oracle_metrics = (
            ("spearman", "kendall", *RECALL_COLUMNS) if with_kendall else ("spearman", *RECALL_COLUMNS)
        )
        columns = dict.fromkeys(oracle_metrics, np.full(scores.shape[0], np.nan))
        if self.oracle is not None:
            columns["spearman"] = pearson(ranks, self.oracle_ranks)
            if with_kendall:
                columns["kendall"] = kendall(scores, self.oracle)
            for name, k, oracle_top in zip(RECALL_COLUMNS, self.recall_ks, self.oracle_tops, strict=True):
                columns[name] = overlap_share(places < k, oracle_top)
        columns["needle_recall"] = overlap_share(places < self.needle_k, self.evidence)
        columns["adjacent_spearman"] = np.concatenate([[np.nan], pearson(ranks[1:], ranks[:-1])])
        return columns

    def head_spearman(self, scores: np.ndarray) -> np.ndarray | None:
        """Spearman per (layer, head) of scores [L, H, T]; None without an oracle."""
        return None if self.oracle is None else pearson(average_ranks(scores), self.oracle_ranks)


def evaluate_example(
    scores: Mapping[str, np.ndarray],
    reference: Reference,
    methods: Sequence[str],
    draft: np.ndarray | None = None,
) -> tuple[list[pl.DataFrame], list[pl.DataFrame], list[pl.DataFrame]]:
    """Per-layer, per-head and sweep frames (without example columns) of one example.

    ``scores`` maps probe -> [L, kv_heads, T] and ``draft`` is [k, ..., T] or [T], both already
    cut to the ranked tokens. Methods whose inputs the example lacks are skipped.
    """
    # CLAA Eq. 1, 2 and 5 all sum over heads; the window scores are pooled before the sum,
    # and avg pooling commutes with it.
    layer_scores = {probe: values.sum(axis=1) for probe, values in scores.items()}
    probe_metrics: dict[str, dict[str, np.ndarray]] = {}

    def metrics_of(probe: str) -> dict[str, np.ndarray]:
        if probe not in probe_metrics:
            probe_metrics[probe] = reference.metrics(layer_scores[probe])
        return probe_metrics[probe]

    per_layer, per_head, sweep = [], [], []
    for method in methods:
        if method in scores:
            per_layer.append(_layers_frame(method, metrics_of(method)))
            head_rho = reference.head_spearman(scores[method])
            if head_rho is not None:
                per_head.append(_heads_frame(method, head_rho))
        elif SINGLE_LAYER_METHODS.get(method) in scores:
            per_layer.append(_layers_frame(method, metrics_of(SINGLE_LAYER_METHODS[method])))
        elif method == CLAA and WINDOW_PROBE in scores:
            for n in sorted({*CLAA_SWEEP, CLAA_LAYERS}):
                aggregated = aggregate_claa_every_layer(layer_scores[WINDOW_PROBE], n)
                columns = reference.metrics(aggregated, with_kendall=(n == CLAA_LAYERS))
                if n == CLAA_LAYERS:
                    per_layer.append(_layers_frame(CLAA, columns))
                if n in CLAA_SWEEP:
                    sweep_columns = {name: values for name, values in columns.items() if name != "kendall"}
                    sweep.append(
                        _layers_frame(f"{CLAA}-n{n}", sweep_columns).insert_column(
                            1, pl.lit(n, dtype=pl.Int32).alias("claa_layers")
                        )
                    )
        elif method == SPECPREFILL and draft is not None:
            ranking = specprefill_scores(draft)[np.newaxis]
            per_layer.append(_layers_frame(SPECPREFILL, reference.metrics(ranking), layered=False))
    return per_layer, per_head, sweep


def _layers_frame(method: str, columns: dict[str, np.ndarray], *, layered: bool = True) -> pl.DataFrame:
    num_rows = len(next(iter(columns.values())))
    layers = pl.Series("layer", np.arange(num_rows) if layered else [None] * num_rows, dtype=pl.Int32)
    frame = pl.DataFrame({name: values.astype(np.float64) for name, values in columns.items()})
    return frame.fill_nan(None).select(pl.lit(method).alias("method"), layers, pl.all())


def _heads_frame(method: str, head_rho: np.ndarray) -> pl.DataFrame:
    num_layers, num_heads = head_rho.shape
    return pl.DataFrame(
        {
            "method": [method] * head_rho.size,
            "layer": np.repeat(np.arange(num_layers, dtype=np.int32), num_heads),
            "head": np.tile(np.arange(num_heads, dtype=np.int32), num_layers),
            "spearman": head_rho.reshape(-1),
        }
    ).fill_nan(None)


def stability_frame(per_layer: pl.DataFrame) -> pl.DataFrame:
    """Per method, over the example-mean Spearman curve across layers (CLAA Sec. 4.1, Fig. 2): its mean,
    population standard deviation, deepest trough and the layer there, and the mean adjacent-layer Spearman."""
    curve = per_layer.group_by("method", "layer", maintain_order=True).agg(
        pl.col("spearman").mean(), pl.col("adjacent_spearman").mean()
    )
    spearman = pl.col("spearman")
    return curve.group_by("method", maintain_order=True).agg(
        spearman.mean().alias("mean_spearman"),
        spearman.std(ddof=0).alias("std_spearman"),
        spearman.min().alias("min_spearman"),
        pl.col("layer").filter(spearman == spearman.min()).first().alias("trough_layer"),
        pl.col("adjacent_spearman").mean().alias("layer_to_layer"),
    )


def summary_frame(per_layer: pl.DataFrame, pruning_layer: int) -> pl.DataFrame:
    """One row per method: example means of every metric at ``pruning_layer`` (layer-less methods at
    their only row), the number of examples, and the method's ``stability_frame`` columns."""
    at_layer = per_layer.filter((pl.col("layer") == pruning_layer) | pl.col("layer").is_null())
    means = at_layer.group_by("method", "layer", maintain_order=True).agg(
        *(pl.col(name).mean() for name in METRIC_COLUMNS), pl.len().cast(pl.Int32).alias("n_examples")
    )
    return means.join(stability_frame(per_layer), on="method", how="left", maintain_order="left")


@dataclass(frozen=True)
class CompareResult:
    pruning_layer: int
    per_layer: pl.DataFrame
    per_head: pl.DataFrame
    sweep: pl.DataFrame
    stability: pl.DataFrame
    summary: pl.DataFrame

    def write(self, path: str | os.PathLike) -> list[Path]:
        """``per_layer`` to ``path``, the other frames beside it as <stem>.<frame>.parquet; returns the paths."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        written = {target: self.per_layer}
        for name in ("per_head", "sweep", "stability", "summary"):
            written[target.with_name(f"{target.stem}.{name}.parquet")] = getattr(self, name)
        for file, frame in written.items():
            frame.write_parquet(file)
        return list(written)


def available_methods(probes: Sequence[str], has_draft: bool) -> list[str]:
    """Method names a store with these probes offers, in display order."""
    methods = sorted(probes)
    methods += [method for method, probe in SINGLE_LAYER_METHODS.items() if probe in probes]
    methods += [CLAA] if WINDOW_PROBE in probes else []
    methods += [SPECPREFILL] if has_draft else []
    return methods


def compare_store(
    path: str | os.PathLike | Store,  # a path, or a store already open
    *,
    layer: int | None = None,
    methods: Sequence[str] | None = None,
    use_oracle: bool = True,
    ranked_span: str | None = "context_tokens",
    needle_keep: float | int = NEEDLE_KEEP,
) -> CompareResult:
    """Compare every method of a store with its oracle; ``layer`` is l_p for the summary (default: half depth).

    With ``use_oracle`` only examples with an oracle count; without it every example counts and
    only the reference-free metrics are filled in.
    """
    from rankkit import stores

    store = stores.open(path)
    records = list(store.examples())
    if not records:
        raise RankkitError(f"store {store.path} has no complete example; capture into it first")
    if use_oracle:
        records = [record for record in records if record.has_oracle]
        if not records:
            raise RankkitError(
                f"store {store.path} has no oracle; run `rankkit oracle {store.path}` first (or pass --no-oracle)"
            )

    has_draft = any(DRAFT_GROUP in record.groups for record in records)
    offered = available_methods(sorted({probe for record in records for probe in record.probes}), has_draft)
    chosen = list(methods) if methods else offered
    unknown = [method for method in chosen if method not in offered]
    if unknown:
        raise RankkitError(
            f"method {', '.join(unknown)} is not available in {store.path}; choose from {', '.join(offered)}"
        )
    num_layers = scored_layers(records)
    pruning_layer = num_layers // 2 if layer is None else layer
    if not 0 <= pruning_layer < num_layers:
        raise RankkitError(
            f"layer {pruning_layer} (--layer) is outside the model's layers 0..{num_layers - 1}"
        )

    needed = _probes_needed(chosen)
    frames: dict[str, list[pl.DataFrame]] = {"per_layer": [], "per_head": [], "sweep": []}
    for record in records:
        ranked = ranked_slice(record.attrs.get("spans"), ranked_span, record.num_tokens)
        spans = record.attrs.get("spans") or {}
        evidence = [
            (start - ranked.start, end - ranked.start) for start, end in spans.get("evidence_tokens", [])
        ]
        oracle = record.oracle[ranked] if use_oracle else None
        reference = Reference(oracle, spans_mask(evidence, ranked.stop - ranked.start), needle_keep)
        scores = {probe: record.scores(probe)[..., ranked] for probe in record.probes if probe in needed}
        draft = record.group(DRAFT_GROUP)[DRAFT_ARRAY][..., ranked] if DRAFT_GROUP in record.groups else None
        example_columns = (
            pl.lit(record.id, dtype=pl.Categorical).alias("example"),
            pl.lit(record.attrs.get("task"), dtype=pl.String).alias("task"),
        )
        for name, found in zip(frames, evaluate_example(scores, reference, chosen, draft), strict=True):
            frames[name] += [frame.select(*example_columns, pl.all()) for frame in found]

    per_layer, per_head, sweep = (_concat(frames[name]) for name in ("per_layer", "per_head", "sweep"))
    return CompareResult(
        pruning_layer=pruning_layer,
        per_layer=per_layer,
        per_head=per_head,
        sweep=sweep,
        stability=stability_frame(per_layer),
        summary=summary_frame(per_layer, pruning_layer),
    )


def _probes_needed(methods: Sequence[str]) -> set[str]:
    """The probes whose scores the methods rank by."""
    needed = {SINGLE_LAYER_METHODS.get(method, method) for method in methods}
    return needed | {WINDOW_PROBE} if CLAA in methods else needed


def _concat(frames: list[pl.DataFrame]) -> pl.DataFrame:
    return pl.concat(frames) if frames else pl.DataFrame()
