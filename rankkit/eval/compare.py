"""Every captured ranking against the Answer-Informed Oracle, layer by layer (CLAA Sec. 3.1, 4.1, Fig. 2).

Methods, each ranking the tokens of one example:

- every captured probe by its store key (``window``, ``window:w=32``...), its scores summed
  over KV heads (``per_head`` keeps the heads apart);
- every registered method with an offline face (gemfilter, fastkv, claa, asl, asl-2pass,
  snapkv, streamingllm, oracle, specprefill...), by name or ``NAME:PARAM=VALUE`` with its
  own parameters: its ``layer_rankings`` from the store, the same rule its prefill selects
  by (``rankkit.methods.selection``). A method with a selection layer is shown at every layer
  it could pick (like CLAA's Fig. 2); an adaptive one (ASL) at the layer it picks; KV-only
  ones at every layer; a draft's ranking (specprefill) has no layer. The tokens a method
  always keeps rank first. ``sweep`` holds CLAA at n = 1, 2, 4, 8 ("claa-n1"...), those up to
  the model's depth.

Which tokens are ranked (``span``): "prompt", every prompt token outside the observation
window (CLAA Sec. 3.1 ranks the prompt; the window is kept by every method, so ranking it
says nothing), or "context", the context span (``spans.context_tokens``) when the example
has one. The window is CLAA's (W = 8).

Frames (tidy; ``example_id``, the key bench's rows share, is Categorical like the store's frames;
NaN-free, undefined = null):

per_layer  example_id, task, method, layer, spearman, kendall, recall_at_10, recall_at_20, recall_at_40,
           needle_recall (the evidence in the ranking's top needle_keep), evidence_kept (at a
           prompt-pruning method's selection layer: the evidence its selection keeps at needle_keep,
           as bench's evidence_kept counts online), adjacent_spearman, keep, needle_keep, and cluster where the store's
           examples name one (``with_clusters``)
per_head   example_id, task, method, layer, head, spearman                       (probes only)
sweep      example_id, task, method, claa_layers, layer, spearman, recall_at_10, recall_at_20,
           recall_at_40, needle_recall, adjacent_spearman                     (no kendall: it is the slow metric)
curve      method, layer, then per metric (spearman, kendall, recall_at_X, needle_recall, evidence_kept) its mean
           over examples, ``<metric>_ci_low``/``<metric>_ci_high`` and ``<metric>_n`` (the examples
           that have it), then n_examples (and
           n_clusters, the independent samples, where per_layer has clusters)
stability  method, mean_spearman with its interval and n, std_spearman, min_spearman, trough_layer,
           layer_to_layer with its interval and n, n_examples (``stability_frame``)
summary    method, layer, each metric with its interval as in ``curve``, n_examples, then the
           stability columns; each method at its own selection layer (``--layer`` sets it),
           probes and KV-only methods at CLAA's l_p (or ``--layer``), adaptive ones at the
           layer each example picks (``layer`` null when they differ)
pairs      method, baseline, layer, difference, difference_ci_low, difference_ci_high, p_value,
           n_examples, n_clusters: the paired Spearman difference method - baseline over the examples both
           have at that layer (``pairs``; default CLAA against each single-layer heuristic)

Intervals are 95%, over examples (``rankkit.eval.stats``: percentile bootstrap resampling
examples, or clusters of examples that share a haystack or a needle, Wilson for 0/1 values);
p-values are Wilcoxon signed-rank, two-sided, over examples or each cluster's mean.

recall_at_X: share of the oracle's top X% that the method's top X% keeps. needle_recall: share
of the evidence tokens (``spans.evidence_tokens``) in the method's top ``needle_keep`` (default:
the ``keep`` the methods rank under), null without evidence. ``per_layer``, ``curve`` and
``summary`` name both in their ``keep`` and ``needle_keep`` columns. adjacent_spearman: Spearman between the method's rankings at this layer and
the one before (null at layer 0 and without layers).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import cached_property, partial
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import torch

from rankkit import defaults, outputs
from rankkit.checks import (
    first_repeated,
    refuse_timing_only_store,
    warn_budgets,
    warn_clamped,
    warn_timing_only_store,
)
from rankkit.errors import RankkitError
from rankkit.methods import REGISTRY, Budget, Method, given_budgets, make
from rankkit.methods.base import distinct_labels
from rankkit.methods.selection import DRAFT_SCORES
from rankkit.values import check_number

from .offline import (
    DRAFT_GROUP,
    captured,
    check_inputs,
    is_method,
    method_from_spec,
    recorded_model,
    single_layer_methods,
    split_names,
)
from .parallel import checked_workers, map_examples
from .stats import (
    CLUSTER,
    EXAMPLE_ID,
    SIGNIFICANCE,
    TOP_K_RECALL,
    cluster_column,
    count_column,
    interval_columns,
    made_ahead,
    mean_intervals,
    paired_differences,
    scores_among,
)

if TYPE_CHECKING:
    from rankkit.stores import Store

from .ranking import Ranked, keep_count, overlap_share, row_metrics, spans_mask

KEEP_RATES = (0.1, 0.2, 0.4)  # CLAA Table 4
RECALL_COLUMNS = tuple(f"{TOP_K_RECALL}{round(rate * 100)}" for rate in KEEP_RATES)
METRIC_COLUMNS = ("spearman", "kendall", *RECALL_COLUMNS, "needle_recall", "evidence_kept")

CLAA = "claa"
SPECPREFILL = "specprefill"
CLAA_SWEEP = (1, 2, 4, 8)  # CLAA Table 4 explores n up to 12; 8 already spans a quarter of a 32-layer model
SPANS = {"prompt": None, "context": "context_tokens"}


def observation_window() -> int:
    """The tokens the "prompt" span leaves out: CLAA's observation window W."""
    return make("claa").window_size


def ranked_slice(spans: Mapping[str, Any] | None, span: str, num_tokens: int) -> slice:
    """The tokens to rank: "prompt", all but the last W (``observation_window``); "context",
    ``spans["context_tokens"]`` as [start, end) when the example has one, else the prompt span."""
    if span not in SPANS:
        raise RankkitError(f"span {span!r} is not one of {', '.join(SPANS)}; use --span prompt or context")
    key = SPANS[span]
    if key is None or not spans or key not in spans:
        return slice(0, max(1, num_tokens - observation_window()))
    start, end = spans[key]
    if not 0 <= start < end <= num_tokens:
        raise RankkitError(
            f"span {key} = [{start}, {end}) is empty or outside the {num_tokens} tokens; "
            "recapture the example or rank the prompt (--span prompt)"
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

    def __init__(self, oracle: np.ndarray | None, evidence: np.ndarray, needle_keep: float | int):
        num_tokens = evidence.shape[0]
        self.oracle = oracle
        self.evidence = evidence
        self.needle_keep = needle_keep
        self.needle_k = keep_count(needle_keep, num_tokens)
        self.recall_ks = [keep_count(rate, num_tokens) for rate in KEEP_RATES]
        self.oracle_ranked = None if oracle is None else Ranked(oracle)
        self.oracle_tops = None
        if self.oracle_ranked is not None:
            self.oracle_tops = np.stack([self.oracle_ranked.places < k for k in self.recall_ks])
        self.scored: dict[tuple, list[tuple[np.ndarray, bool, dict[str, np.ndarray]]]] = {}

    def metrics(self, scores: np.ndarray, *, with_kendall: bool = True) -> dict[str, np.ndarray]:
        """Metric columns for the rankings in ``scores`` [R, T] (rows are layers, in order): one value
        per row; ``kendall`` is NaN without ``with_kendall`` (the slow metric).

        Rankings scored before are not scored again: several methods rank by a probe's own
        scores (fastkv and CLAA at n = 1 by ``window``'s, gemfilter by ``last_token_raw``'s).
        """
        # a few columns tell most rankings apart; equal values confirm a match
        fingerprint = (
            scores.shape,
            np.asarray(scores[..., :: self.FINGERPRINT_STRIDE], np.float64).tobytes(),
        )
        for earlier, had_kendall, columns in self.scored.get(fingerprint, ()):
            if (had_kendall or not with_kendall) and np.array_equal(earlier, scores, equal_nan=True):
                return columns
        columns = self._metrics(scores, with_kendall)
        self.scored.setdefault(fingerprint, []).append((scores, with_kendall, columns))
        return columns

    FINGERPRINT_STRIDE = 61

    def _metrics(self, scores: np.ndarray, with_kendall: bool) -> dict[str, np.ndarray]:
        found = row_metrics(
            scores,
            self.oracle_ranked,
            top_sets=self.oracle_tops,
            top_ks=self.recall_ks if self.oracle_tops is not None else (),
            evidence=self.evidence,
            needle_k=self.needle_k,
            with_kendall=with_kendall,
            chained=True,
        )
        overlap = found["overlap"]
        return {
            "spearman": found["spearman"],
            "kendall": found["kendall"],
            **{
                name: overlap[:, index] if overlap.shape[1] else np.full(len(overlap), np.nan)
                for index, name in enumerate(RECALL_COLUMNS)
            },
            "needle_recall": found["evidence"],
            "evidence_kept": np.full(len(overlap), np.nan),  # a selection's, not a ranking's: see below
            "adjacent_spearman": found["chained"],
        }

    def head_spearman(self, scores: np.ndarray) -> np.ndarray | None:
        """Spearman per (layer, head) of scores [L, H, T], in that order [L·H]; None without an oracle."""
        if self.oracle is None:
            return None
        return row_metrics(scores, self.oracle_ranked)["spearman"]


def evaluate_example(
    record,
    reference: Reference,
    probes: Sequence[str],
    methods: Mapping[str, Method],
    budget: Budget,
    ranked: slice,
    layout: Mapping[str, Any] | None = None,
    detailed: bool = True,
) -> tuple[_Rows, _Rows, _Rows]:
    """Per-layer, per-head and sweep rows (without example columns) of one example: ``probes``
    by their stored scores, ``methods`` (label -> method) by their ``layer_rankings`` under
    ``budget``; every ranking cut to the ``ranked`` tokens. Without ``detailed``, per-layer rows
    only, without Kendall (``compare_store``'s ``detailed``)."""
    per_layer, per_head, sweep = _Rows(), _Rows(), _Rows()
    for probe in probes:
        scores = record.scores(probe)[..., ranked]
        num_layers, num_heads = scores.shape[:2]
        # CLAA Eq. 1, 2 and 5 all sum over heads; the window scores are pooled before the sum,
        # and avg pooling commutes with it.
        per_layer.add(
            probe, layer=range(num_layers), **reference.metrics(scores.sum(axis=1), with_kendall=detailed)
        )
        head_rho = reference.head_spearman(scores) if detailed else None
        if head_rho is not None:
            per_head.add(
                probe,
                layer=np.repeat(np.arange(num_layers), num_heads),
                head=np.tile(np.arange(num_heads), num_layers),
                spearman=head_rho,
            )
    num_layers = scored_layers([record])
    layer_types = (layout or {}).get("layer_types")
    ranked_once: dict[tuple, tuple[list[int | None], np.ndarray]] = {}

    def scored(method: Method, with_kendall: bool) -> tuple[list[int | None], dict[str, np.ndarray]]:
        """The method's layers and metric columns, ranked once per offline face (asl and asl-2pass
        rank alike, and so do claa and the sweep's claa at its own n) and scored once per
        distinct ranking (``Reference.metrics``)."""
        key = method.bind(num_layers, layer_types).offline_key()
        if key not in ranked_once:
            ranked_once[key] = _rankings(method, record, budget, ranked, layout)
        layers, rankings = ranked_once[key]
        return layers, reference.metrics(rankings, with_kendall=with_kendall)

    for label, method in methods.items():
        layers, columns = scored(method, detailed)
        columns = with_evidence_kept(method, record, reference, ranked, layout, layers, columns)
        per_layer.add(label, layer=layers, **columns)
        if method.name == CLAA and detailed:
            for n in (n for n in CLAA_SWEEP if n <= num_layers):  # n past the depth is refused
                layers, columns = scored(replace(method, aggregation_window=n), False)
                without_kendall = {
                    name: values
                    for name, values in columns.items()
                    if name not in ("kendall", "evidence_kept")
                }
                sweep.add(f"{CLAA}-n{n}", claa_layers=[n] * len(layers), layer=layers, **without_kendall)
    return per_layer, per_head, sweep


def with_evidence_kept(
    method: Method,
    record,
    reference: Reference,
    ranked: slice,
    layout: Mapping[str, Any] | None,
    layers: list[int | None],
    columns: dict[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """``columns`` with ``evidence_kept`` at the layer a prompt-pruning method selects at: the share
    of the evidence in the tokens its selection keeps at the needle keep (``select_offline``, what
    its prefill keeps), the rule ``rankkit.bench.evidence_kept`` applies online, so the two faces
    agree exactly. ``needle_recall`` counts the top needle-keep tokens of the ranking instead, a
    ranking's measure at every layer: SlimInfer keeps whole blocks, its first block and a multiple
    of the budget at its first pruning layer, so a needle in its fifth block is kept (evidence_kept
    1) yet outside the ranking's top-k (needle_recall 0). KV-only methods keep a set per head and
    have no one value here."""
    if not reference.evidence.any():
        return columns
    try:
        selection = method.select_offline(
            captured(record, method, layout), Budget.parse(reference.needle_keep)
        )
    except RankkitError:  # a per-head (KV-only) method keeps no one set without a layer named
        return columns
    if not isinstance(selection.positions, torch.Tensor) or selection.positions.ndim != 1:
        return columns
    if selection.layer not in layers:
        return columns
    kept = np.zeros(ranked.stop - ranked.start, dtype=bool)
    inside = selection.positions.numpy() - ranked.start
    kept[inside[(inside >= 0) & (inside < kept.size)]] = True
    evidence_kept = columns["evidence_kept"].copy()  # ``Reference.metrics`` shares its columns
    evidence_kept[layers.index(selection.layer)] = overlap_share(kept, reference.evidence)
    return {**columns, "evidence_kept": evidence_kept}


class _Rows:
    """The rows of a frame, gathered method by method and example by example and built into one
    frame at the end: a frame per method, or per example, costs more than the metrics in it.
    Columns: example_id and task (when examples were added, ``extend``), method, then the keyword
    columns in the order of the first ``add`` (integer ``layer``, ``head`` and ``claa_layers``,
    float metrics with NaN as null)."""

    INTEGER_COLUMNS = ("layer", "head", "claa_layers")

    def __init__(self):
        self.columns: dict[str, list] = {}
        self.examples: list[tuple[str, str | None, int]] = []  # id, task, number of rows

    def add(self, method: str, **columns: Sequence) -> None:
        rows = len(next(iter(columns.values())))
        for name, values in {"method": [method] * rows, **columns}.items():
            self.columns.setdefault(name, []).append(values)

    def extend(self, example: _Rows, example_id: str, task: str | None) -> None:
        """Add one example's rows (``evaluate_example``'s) under its id and task."""
        rows = sum(len(part) for part in example.columns.get("method", ()))
        if rows:
            self.examples.append((example_id, task, rows))
            for name, parts in example.columns.items():
                self.columns.setdefault(name, []).extend(parts)

    def frame(self) -> pl.DataFrame:
        if not self.columns:
            return pl.DataFrame()
        series = []
        if self.examples:
            ids, tasks, counts = zip(*self.examples, strict=True)
            each_row = np.repeat(np.arange(len(ids)), counts)
            series.append(pl.Series(EXAMPLE_ID, ids, dtype=pl.String).gather(each_row).cast(pl.Categorical))
            series.append(pl.Series("task", tasks, dtype=pl.String).gather(each_row))
        for name, parts in self.columns.items():
            if name == "method":
                series.append(pl.Series(name, list(chain.from_iterable(parts)), dtype=pl.String))
            elif name in self.INTEGER_COLUMNS:
                series.append(pl.Series(name, list(chain.from_iterable(parts)), dtype=pl.Int32))
            else:
                values = np.concatenate(parts).astype(np.float64)
                series.append(pl.Series(name, values, nan_to_null=True))
        return pl.DataFrame(series)


def _rankings(
    method: Method, record, budget: Budget, ranked: slice, layout: Mapping[str, Any] | None
) -> tuple[list[int | None], np.ndarray]:
    """The layers a method could select at and its rankings there [R, ranked tokens], in layer order;
    ``layout`` is the store's ``recorded_model``."""
    rankings = method.layer_rankings(captured(record, method, layout), budget)
    layers = sorted(rankings, key=lambda layer: -1 if layer is None else layer)
    return layers, torch.stack([rankings[layer] for layer in layers]).numpy()[..., ranked]


STABILITY_MEANS = ("mean_spearman", "layer_to_layer")  # means over examples, with their intervals


def stability_frame(per_layer: pl.DataFrame) -> pl.DataFrame:
    """Per method, how steady its Spearman is across layers (CLAA Sec. 4.1, Fig. 2): ``mean_spearman``
    and ``layer_to_layer`` (the adjacent-layer Spearman), each the mean over examples of the example's
    mean over its layers, with their 95% intervals and n; and of the example-mean curve its population
    standard deviation, deepest trough and the layer there."""
    curve = per_layer.group_by("method", "layer", maintain_order=True).agg(pl.col("spearman").mean())
    spearman = pl.col("spearman")
    shape = curve.group_by("method").agg(  # in any order: the join keeps the means' order
        spearman.std(ddof=0).alias("std_spearman"),
        spearman.min().alias("min_spearman"),
        pl.col("layer").filter(spearman == spearman.min()).first().alias("trough_layer"),
    )
    cluster = cluster_column(per_layer)
    per_example = per_layer.group_by("method", EXAMPLE_ID, maintain_order=True).agg(
        spearman.mean().alias("mean_spearman"),
        pl.col("adjacent_spearman").mean().alias("layer_to_layer"),
        *([pl.col(cluster).first()] if cluster else []),
    )
    means = mean_intervals(per_example, ["method"], STABILITY_MEANS, cluster=cluster)
    mean_spearman, layer_to_layer = (
        [name, *interval_columns(name), count_column(name)] for name in STABILITY_MEANS
    )
    counts = [name for name in ("n_examples", "n_clusters") if name in means.columns]
    return means.join(shape, on="method", maintain_order="left").select(
        "method", *mean_spearman, "std_spearman", "min_spearman", "trough_layer", *layer_to_layer, *counts
    )


def summary_frame(per_layer: pl.DataFrame, summary_layers: Mapping[str, int | None]) -> pl.DataFrame:
    """One row per method: example means of every metric at the method's ``summary_layers`` entry
    (None: every row it has, one per example: an adaptive or layer-less method), the number of
    examples, and the method's ``stability_frame`` columns. ``layer`` is null where examples differ."""
    rows = [
        per_layer.filter(pl.col("method") == method)
        if layer is None
        else per_layer.filter((pl.col("method") == method) & (pl.col("layer") == layer))
        for method, layer in summary_layers.items()
    ]
    at_layer = _concat([frame for frame in rows if frame.height])
    if not at_layer.height:
        return pl.DataFrame()
    layer = pl.col("layer")
    layers = at_layer.group_by("method", maintain_order=True).agg(
        pl.when(layer.n_unique() == 1).then(layer.first()).alias("layer")
    )
    means = layers.join(
        example_means(at_layer, ["method"], METRIC_COLUMNS),
        on="method",
        maintain_order="left",
    )
    stability = stability_frame(per_layer).drop("n_examples", "n_clusters", strict=False)  # the summary's own n
    return means.join(stability, on="method", how="left", maintain_order="left")


def example_means(per_layer: pl.DataFrame, by: Sequence[str], metrics: Sequence[str]) -> pl.DataFrame:
    """Per group of ``by``: each of ``metrics`` averaged over the examples of ``per_layer`` with its 95%
    interval and n, resampling clusters where the rows name them (then with ``n_clusters``), a share
    (``stats.SHARES``) Wilson's where its bootstrap collapses. Every mean compare or the dashboard draws
    from compare's rows is this one, so a curve reads the same wherever it is shown."""
    return mean_intervals(per_layer, by, metrics, cluster=cluster_column(per_layer), scores=scores_among(metrics))


def curve_frame(per_layer: pl.DataFrame) -> pl.DataFrame:
    """Per method and layer: each metric's mean over examples with its 95% interval, and n."""
    if not per_layer.height:
        return pl.DataFrame()
    return example_means(per_layer, ["method", "layer"], METRIC_COLUMNS)


def with_keeps(frame: pl.DataFrame, keep: float | int, needle_keep: float | int) -> pl.DataFrame:
    """``frame`` with the keep its rankings were made under and the one needle recall counted in."""
    return frame.with_columns(keep=pl.lit(keep), needle_keep=pl.lit(needle_keep))


def with_example_id(frame: pl.DataFrame) -> pl.DataFrame:
    """A compare frame read back from a parquet, with the example column named ``example_id`` even
    when it was written before compare named it so (``example``)."""
    return frame.rename({"example": EXAMPLE_ID}) if "example" in frame.columns else frame


def with_clusters(per_layer: pl.DataFrame, records: Sequence[Any], example: str = EXAMPLE_ID) -> pl.DataFrame:
    """``per_layer`` with each example's cluster (``meta["cluster"]``: examples sharing a haystack or
    a needle, ``rankkit.data.niah``) when any example records one; an example without is its own.
    ``example`` names the column holding the example ids."""
    named = {record.id: (record.attrs.get("meta") or {}).get(CLUSTER) for record in records}
    if not per_layer.height or not any(named.values()):
        return per_layer
    clusters = {name: cluster or name for name, cluster in named.items()}
    return per_layer.with_columns(pl.col(example).cast(pl.String).replace_strict(clusters).alias(CLUSTER))


def compared_labels(methods: str | Sequence[str]) -> list[str]:
    """The probe keys and method specs ``methods`` names (``--methods``, or its list), each named once:
    a list naming none would compare nothing, and one named twice has one label for two rows."""
    labels = split_names(methods) if isinstance(methods, str) else list(methods)
    if not labels:
        raise RankkitError("--methods names nothing; give e.g. --methods window,claa,fastkv")
    distinct_labels(labels, labels, "name each once")
    return labels


def default_pairs(methods: Sequence[str]) -> list[tuple[str, str]]:
    """CLAA against each single-layer heuristic among ``methods`` (CLAA's own comparison, Fig. 2)."""
    if CLAA not in methods:
        return []
    return [(CLAA, baseline) for baseline in single_layer_methods(methods) if baseline != CLAA]


def parse_pairs(spec: str, labels: Sequence[str]) -> list[tuple[str, str]]:
    """``"claa:fastkv,claa:gemfilter"`` as (method, baseline) pairs of compared ``labels``. A label may
    hold ":" itself (``window:w=32``): each pair splits at the ":" that leaves a label on both sides."""
    pairs = []
    for entry in (part.strip() for part in spec.split(",")):
        if not entry:
            continue
        splits = [
            (entry[:index], entry[index + 1 :])
            for index, char in enumerate(entry)
            if char == ":" and entry[:index] in labels and entry[index + 1 :] in labels
        ]
        if len(splits) != 1:
            raise RankkitError(
                f"--pairs {entry!r} is not METHOD:BASELINE of two compared methods "
                f"({', '.join(labels)}); e.g. --pairs claa:fastkv"
            )
        pairs.append(splits[0])
    if not pairs:
        raise RankkitError("--pairs names no pair; give e.g. --pairs claa:fastkv,claa:gemfilter")
    return checked_pairs(pairs, labels)


def refuse_pairs_without_oracle(pairs: str | Sequence[tuple[str, str]] | None, oracle: bool) -> None:
    """Pairs test differences of Spearman with the oracle: without one they would be a frame of nulls."""
    if pairs and not oracle:
        raise RankkitError(
            "--pairs tests differences of Spearman with the oracle, which --no-oracle leaves out; "
            "drop --pairs or compare with the oracle"
        )


def checked_pairs(pairs: Sequence[tuple[str, str]], labels: Sequence[str]) -> list[tuple[str, str]]:
    """(method, baseline) pairs, each of two compared ``labels`` and named once: a pair of a method not
    compared has no rows to test, and one named twice would be tested, and counted, twice. No pair
    at all tests none."""
    pairs = [tuple(pair) for pair in pairs]
    for pair in pairs:
        if len(pair) != 2 or not all(name in labels for name in pair):
            raise RankkitError(
                f"--pairs {pair!r} is not (method, baseline) of two compared methods ({', '.join(labels)}); "
                "e.g. ('claa', 'fastkv')"
            )
    same = next((method for method, baseline in pairs if method == baseline), None)
    if same is not None:  # its difference is zero on every example, a row that reads as a finding
        raise RankkitError(f"--pairs {same}:{same} pairs {same} with itself; pair two different methods, e.g. --pairs claa:fastkv")
    twice = first_repeated([f"{method}:{baseline}" for method, baseline in pairs])
    if twice is not None:
        raise RankkitError(f"--pairs names {twice} twice; name each pair once")
    return pairs


def pairs_frame(
    per_layer: pl.DataFrame, pairs: Sequence[tuple[str, str]], metric: str = "spearman"
) -> pl.DataFrame:
    """Per pair and shared layer: the paired difference of ``metric`` (Spearman unless named) over
    examples (``stats.paired_differences``), resampling clusters where ``per_layer`` names them."""
    keys, columns, clusters = [], [], []
    cluster = cluster_column(per_layer)
    for method, baseline in pairs:
        both = (
            per_layer.filter(pl.col("method") == method)
            .select(EXAMPLE_ID, "layer", *([cluster] if cluster else []), pl.col(metric).alias("first"))
            .join(
                per_layer.filter(pl.col("method") == baseline).select(
                    EXAMPLE_ID, "layer", pl.col(metric).alias("second")
                ),
                on=[EXAMPLE_ID, "layer"],
                nulls_equal=True,
            )
            .sort("layer", nulls_last=True, maintain_order=True)
        )
        for (layer,), values in both.group_by("layer", maintain_order=True):
            keys.append({"method": method, "baseline": baseline, "layer": layer})
            columns.append(
                tuple(
                    values[name].cast(pl.Float64).fill_null(np.nan).to_numpy() for name in ("first", "second")
                )
            )
            clusters.append(values[cluster].to_list() if cluster else None)
    found = paired_differences(columns, clusters)
    rows = [{**key, **each} for key, each in zip(keys, found, strict=True)]
    schema = {
        "method": pl.String,
        "baseline": pl.String,
        "layer": pl.Int32,
        "difference": pl.Float64,
        "difference_ci_low": pl.Float64,
        "difference_ci_high": pl.Float64,
        "p_value": pl.Float64,
        "n_examples": pl.Int32,
        "n_clusters": pl.Int32,
    }
    return pl.DataFrame(rows, schema=schema)


TABLE_METRICS = ("spearman", "recall_at_10", "needle_recall")  # what a terminal table has room for


def summary_table(summary: pl.DataFrame) -> pl.DataFrame:
    """The summary columns a terminal table shows: method, layer, ``TABLE_METRICS`` with their
    intervals and own counts, n_examples (``--json`` and ``--out`` carry every column)."""
    if not summary.height:
        return summary
    metrics = [
        column for name in TABLE_METRICS for column in (name, *interval_columns(name), count_column(name))
    ]
    counts = [name for name in ("n_examples", "n_clusters") if name in summary.columns]
    return summary.select("method", "layer", *metrics, *counts)


def pairs_at_layer(pairs: pl.DataFrame, layer: int) -> pl.DataFrame:
    """Each pair's difference at ``layer`` with its interval, p-value and n, and at how many of the
    layers they share the method is significantly higher and lower (p < 0.05): "12/30", "3/30"."""
    if not pairs.height:
        return pairs
    significant = pl.col("p_value") < SIGNIFICANCE
    significant = pairs.group_by("method", "baseline", maintain_order=True).agg(
        pl.format("{}/{}", (significant & (pl.col("difference") > 0)).sum(), pl.len()).alias("higher_layers"),
        pl.format("{}/{}", (significant & (pl.col("difference") < 0)).sum(), pl.len()).alias("lower_layers"),
    )
    return (
        pairs.filter(pl.col("layer") == layer)
        .drop("layer")
        .join(significant, on=["method", "baseline"], how="right", maintain_order="right")
        .select("method", "baseline", pl.all().exclude("method", "baseline"))
    )


@dataclass(frozen=True)
class CompareResult:
    """The frames of one comparison. ``curve``, ``stability``, ``summary`` and ``pairs`` are made from
    ``per_layer`` when first asked for: their bootstrap intervals cost seconds at a thousand
    examples, and the dashboard reads none of them."""

    pruning_layer: int  # the layer probes and KV-only methods are summarised at
    span: str  # which tokens were ranked: "prompt" or "context"
    per_layer: pl.DataFrame
    per_head: pl.DataFrame
    sweep: pl.DataFrame
    summary_layers: Mapping[str, int | None]  # each method's layer in ``summary`` (summary_frame)
    tested_pairs: Sequence[tuple[str, str]]  # the (method, baseline) pairs ``pairs`` tests
    keep: float | int  # the budget the methods ranked under
    needle_keep: float | int  # the budget needle recall counts the evidence in
    store: Path  # the store compared: ``write`` keeps its outputs out of it

    def with_keeps(self, frame: pl.DataFrame) -> pl.DataFrame:
        """``frame`` with the keep and the needle keep its rows were made under, as columns."""
        return with_keeps(frame, self.keep, self.needle_keep)

    @cached_property
    def curve(self) -> pl.DataFrame:
        return self.with_keeps(curve_frame(self.per_layer))

    @cached_property
    def stability(self) -> pl.DataFrame:
        return self.with_keeps(stability_frame(self.per_layer))

    @cached_property
    def summary(self) -> pl.DataFrame:
        return self.with_keeps(summary_frame(self.per_layer, self.summary_layers))

    @cached_property
    def pairs(self) -> pl.DataFrame:
        return self.with_keeps(pairs_frame(self.per_layer, self.tested_pairs))

    def write(self, path: str | os.PathLike, *, overwrite: bool = False) -> list[Path]:
        """``per_layer`` to ``path``, the other frames beside it as <stem>.<frame>.parquet; returns the
        paths. Refused as ``rankkit compare --out`` is (``claim_outputs``)."""
        return write_results([self], path, overwrite=overwrite)


def claim_outputs(
    paths: Sequence[Path], store: str | os.PathLike | Store, *, overwrite: bool = False
) -> list[Path]:
    """``paths``, the files drawn from ``store`` (compare's ``output_paths``, variance's), checked as
    ``--out`` is, before any work and again before writing (``outputs.claim``): none may exist unless
    ``overwrite``, none that rankkit did not write even then, none inside ``store`` or another store."""
    from rankkit import stores

    source = store.path if isinstance(store, stores.Store) else store
    return outputs.claim(paths, overwrite=overwrite, inputs=[source])


def write_results(
    results: Sequence[CompareResult],
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    written: list[Path] | None = None,
) -> list[Path]:
    """The frames of ``results`` (one per keep), each concatenated over them, written as
    ``CompareResult.write`` writes one: their ``keep`` and ``needle_keep`` columns tell them apart.
    Each path joins ``written`` as it is written, so an interrupt can name what was."""
    (store,) = {result.store for result in results}
    paths = claim_outputs(output_paths(path), store, overwrite=overwrite)
    frames = [
        pl.concat([getattr(result, name) for result in results])
        for name in ("per_layer", *SIBLING_FRAMES)
    ]
    written = [] if written is None else written
    for frame, file in zip(frames, paths, strict=True):
        written.append(outputs.write_parquet(frame, file, overwrite=overwrite))
    return written


def compared_budgets(keep=None, budget=None) -> list[Budget]:
    """The budgets a store is compared under: ``keep=`` or ``budget=`` as ``given_budgets`` reads them,
    by default ``defaults.KEEP``."""
    return given_budgets(keep, budget, required=False) or [Budget.from_keep(defaults.KEEP)]


def compare_keeps(
    path: str | os.PathLike | Store,
    *,
    keep: Sequence[float] | float | str | None = None,
    budget: Sequence[int] | int | str | None = None,
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    written: list[Path] | None = None,
    **options: Any,
) -> list[CompareResult]:
    """``compare_store`` of one store under each keep rate of ``keep`` (``--keep 0.1,0.2``) or each
    token count of ``budget`` (``--budget 16,24``), by default at ``defaults.KEEP``, with the same ``options``; a ``needle_keep`` among them holds for all, else each counts at its own.
    With ``out`` (``rankkit compare --out``) the frames of all are written there as ``write_results``
    writes them, the path refused before any work unless it may be written (``claim_outputs``,
    ``overwrite``); ``written`` gathers the paths as they are written."""
    from rankkit import stores

    budgets = compared_budgets(keep, budget)
    if out is not None:
        claim_outputs(output_paths(out), path, overwrite=overwrite)
    store = stores.open(path)
    results = [compare_store(store, **budget.keywords, **options) for budget in budgets]
    if out is not None:
        write_results(results, out, overwrite=overwrite, written=written)
    return results


SIBLING_FRAMES = ("per_head", "sweep", "curve", "stability", "summary", "pairs")


def output_paths(path: str | os.PathLike) -> list[Path]:
    """The files ``CompareResult.write(path)`` writes: ``path`` and its siblings, in frame order."""
    target = outputs.named_file(path)
    return [target] + [target.with_name(f"{target.stem}.{name}.parquet") for name in SIBLING_FRAMES]


def available_methods(probes: Sequence[str], has_draft: bool) -> list[str]:
    """What ``compare`` ranks by default: every captured probe, then every registered method whose
    captured inputs the store holds (the oracle method is left out: it is the reference)."""
    offered = sorted(probes)
    available = {*probes, *([DRAFT_SCORES] if has_draft else [])}
    for name in REGISTRY:
        if name in probes:  # a probe of the same name (lava) keeps the name; the method takes NAME:PARAM=...
            continue
        try:
            needs = make(name).captured_inputs()
        except RankkitError:  # no offline face
            continue
        if needs and all(key in available for key in needs):
            offered.append(name)
    return offered


def as_drafted(methods: Sequence[str], store_meta: Mapping[str, Any], num_layers: int) -> list[str]:
    """``methods`` offered by default, SpecPrefill named with the draft the store's lookahead scores
    were made with where its defaults would rank by another (which the store cannot rank by)."""
    drafted = store_meta.get("draft") or {}
    default = make(SPECPREFILL).draft_settings(num_layers)
    made = {key: drafted.get(key) for key in default}
    if not drafted or made == default:
        return list(methods)
    spec = make(SPECPREFILL).drafted_as(made)
    return [spec if name == SPECPREFILL else name for name in methods]


def refuse_mixed_oracles(records, path) -> None:
    """Refuse examples whose oracles were made with different settings (answer, softmax, kernel, new
    tokens): their rankings would be scored against two different ground truths as one. A store
    made by rankkit cannot hold such a mix (capture and oracle refuse it); examples copied in can."""
    first = records[0]
    made = first.attrs.get("oracle_params")
    for record in records[1:]:
        other = record.attrs.get("oracle_params")
        if other != made:
            raise RankkitError(
                f"store {path} holds oracles made with other settings: example {first.id!r} {made}, example "
                f"{record.id!r} {other}; remake them alike with `rankkit oracle {path} --redo`"
            )


def compare_store(
    path: str | os.PathLike | Store,  # a path, or a store already open
    *,
    layer: int | None = None,
    methods: str | Sequence[str] | None = None,
    oracle: bool = True,
    span: str = "prompt",
    keep: float | None = None,
    budget: int | None = None,
    needle_keep: float | int | None = None,
    workers: int | None = None,
    pairs: str | Sequence[tuple[str, str]] | None = None,
    detailed: bool = True,
) -> CompareResult:
    """Compare probes and methods of a store with its oracle (see the module docstring).

    ``methods`` are probe keys and method specs (``claa:aggregation_window=8``), or one string of
    them in the ``--probes`` syntax (``split_names``); ``layer`` is the
    selection layer of every method that has one and the layer probes and KV-only methods are
    summarised at (default: CLAA's l_p for the model's depth). The rankings are made under the keep
    rate ``keep`` in (0, 1] (``--keep``) or the token count ``budget`` (``--budget``), one of them,
    default keep ``defaults.KEEP`` (it sets ASL's k and the size of forced sets; a budget above an
    example's prompt or below what a method always keeps is warned of, as ``select_store`` warns);
    ``needle_keep`` is what needle recall counts the evidence in, a keep rate (a float in (0, 1]) or
    a token count (an int), default the keep or budget ranked under (a count given above an example's
    prompt is warned of, as such a budget is). With ``oracle`` only examples
    with an oracle count; without it every example counts and only the reference-free metrics are
    filled in. ``workers`` processes share the examples (default: one per CPU; see
    ``rankkit.eval.parallel``); the frames do not depend on it. ``pairs`` are the (method,
    baseline) pairs the ``pairs`` frame tests, or their ``--pairs`` string (``parse_pairs``);
    default ``default_pairs``, none without ``oracle`` (which refuses any: they test Spearman). Without ``detailed`` only the per-layer rows are made, with
    ``kendall`` null, and ``per_head`` and ``sweep`` are empty: what the dashboard shows, at
    about half the cost.
    """
    from rankkit import stores

    workers = checked_workers(workers)  # a bad --workers fails before any reading
    if layer is not None:
        check_number(layer, "--layer", whole=True)
    # a bad keep or budget fails before any reading, and so does a bad needle keep
    budget = Budget.one_of(keep, budget, default=Budget.from_keep(defaults.KEEP))
    keep = budget.number
    # without its own, needle recall counts in the budget, already checked (and warned of below)
    own_needle_budget = None if needle_keep is None else Budget.parse(needle_keep, "--needle-keep")
    needle_keep = keep if needle_keep is None else needle_keep
    ranked_slice(None, span, 1)  # so does a bad span
    chosen = None if methods is None else compared_labels(methods)  # and an empty or repeated list
    store = stores.open(path)
    if oracle:
        refuse_timing_only_store(store.meta, store.path, "compare rankings with its oracle")
    else:
        warn_timing_only_store(store.meta, store.path)
    store.warn_skipped()
    records = list(store.examples())
    if not records:
        raise RankkitError(f"store {store.path} has no complete example; capture into it first")
    if oracle:
        without_oracle = sum(not record.has_oracle for record in records)
        records = [record for record in records if record.has_oracle]
        if not records:
            raise RankkitError(
                f"store {store.path} has no oracle; run `rankkit oracle {store.path}` first (or pass --no-oracle)"
            )
        if without_oracle:
            warnings.warn(
                f"left out {without_oracle} example(s) without an oracle; `rankkit oracle {store.path}` adds them",
                stacklevel=2,
            )
        refuse_mixed_oracles(records, store.path)
    num_layers = scored_layers(records)
    layout = recorded_model(store.meta)
    layer_types = layout.get("layer_types")
    default_layer = make(CLAA).bind(num_layers, layer_types).pruning_layer if layer is None else layer
    if not 0 <= default_layer < num_layers:
        raise RankkitError(
            f"layer {default_layer} (--layer) is outside the model's layers 0..{num_layers - 1}"
        )

    captured_probes = sorted({probe for record in records for probe in record.probes})
    has_draft = all(DRAFT_GROUP in record.groups for record in records)
    if chosen is None:
        chosen = as_drafted(available_methods(captured_probes, has_draft), store.meta, num_layers)
    unknown = [name for name in chosen if name not in captured_probes and not is_method(name)]
    if unknown:
        raise RankkitError(
            f"{', '.join(unknown)} is neither a probe {store.path} holds nor a method; choose from "
            f"{', '.join([*captured_probes, *sorted(REGISTRY)])}"
        )
    probes = [name for name in chosen if name in captured_probes]
    ranked_methods = {
        name: method_from_spec(name, layer if make(name.partition(":")[0]).selection_parameter else None)
        for name in chosen
        if name not in captured_probes
    }
    check_inputs(ranked_methods.values(), records, store.meta)
    prompt_lengths = [record.num_tokens for record in records]
    warn_budgets([budget], ranked_methods.values(), prompt_lengths)
    if own_needle_budget is not None:
        # needle recall counts in the ranked span: a needle keep over it counts all of it, and every
        # method's needle recall reads 1.00
        spans = [ranked_slice(record.attrs.get("spans"), span, record.num_tokens) for record in records]
        warn_clamped(own_needle_budget, [ranked.stop - ranked.start for ranked in spans], "--needle-keep", "ranked span")
    labels = [*probes, *ranked_methods]
    if pairs is None:
        pairs = default_pairs(labels) if oracle else []  # differences of Spearman with the oracle
    elif isinstance(pairs, str):
        pairs = parse_pairs(pairs, labels)
    else:
        pairs = checked_pairs(pairs, labels)
    refuse_pairs_without_oracle(pairs, oracle)
    evaluate = partial(
        compare_example,
        probes=tuple(probes),
        methods=ranked_methods,
        budget=budget,
        span=span,
        oracle=oracle,
        needle_keep=needle_keep,
        layout=layout,
        detailed=detailed,
    )
    rows = {"per_layer": _Rows(), "per_head": _Rows(), "sweep": _Rows()}
    # the intervals are made from the frames only when asked for: not by the dashboard
    with made_ahead(len(records)) if detailed else nullcontext():
        for example_id, task, found in map_examples(
            store.path, [record.id for record in records], evaluate, workers=workers
        ):
            for name, example_rows in zip(rows, found, strict=True):
                rows[name].extend(example_rows, example_id, task)
    per_layer, per_head, sweep = (rows[name].frame() for name in ("per_layer", "per_head", "sweep"))
    per_layer = with_keeps(with_clusters(per_layer, records), keep, needle_keep)
    per_head, sweep = (with_keeps(frame, keep, needle_keep) for frame in (per_head, sweep))
    summary_layers: dict[str, int | None] = dict.fromkeys(probes, default_layer)
    for name, method in ranked_methods.items():
        selection = method.selection_parameter
        if selection is not None:
            summary_layers[name] = getattr(method.bind(num_layers, layer_types), selection)
        else:  # every layer (KV-only): the probes' layer; one row per example (adaptive, draft): that row
            rows = per_layer.filter(pl.col("method") == name)
            summary_layers[name] = default_layer if rows.height > rows[EXAMPLE_ID].n_unique() else None
    return CompareResult(
        pruning_layer=default_layer,
        span=span,
        per_layer=per_layer,
        per_head=per_head,
        sweep=sweep,
        summary_layers=summary_layers,
        tested_pairs=list(pairs),
        keep=keep,
        needle_keep=needle_keep,
        store=store.path,
    )


def compare_example(
    record: Any,
    *,
    probes: Sequence[str],
    methods: Mapping[str, Method],
    budget: Budget,
    span: str = "prompt",
    oracle: bool = True,
    needle_keep: float | int,
    layout: Mapping[str, Any] | None = None,
    detailed: bool = True,
) -> tuple[str, str | None, tuple[_Rows, _Rows, _Rows]]:
    """The example's id, task and ``per_layer``, ``per_head`` and ``sweep`` rows (``compare_store``'s
    unit of work, run in a worker process; the main process builds the frames once)."""
    from rankkit.stores import ReadOnce

    record = ReadOnce(record)  # probes are read again by the methods ranking by them
    ranked = ranked_slice(record.attrs.get("spans"), span, record.num_tokens)
    spans = record.attrs.get("spans") or {}
    evidence = [(start - ranked.start, end - ranked.start) for start, end in spans.get("evidence_tokens", [])]
    oracle_scores = record.oracle[ranked] if oracle else None
    reference = Reference(oracle_scores, spans_mask(evidence, ranked.stop - ranked.start), needle_keep)
    found = evaluate_example(record, reference, probes, methods, budget, ranked, layout, detailed)
    return record.id, record.attrs.get("task"), found


def _concat(frames: list[pl.DataFrame]) -> pl.DataFrame:
    return pl.concat(frames) if frames else pl.DataFrame()
