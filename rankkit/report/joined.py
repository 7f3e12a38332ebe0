"""``rankkit report STORE --bench B.parquet``: the offline and end-to-end faces of each method in one
table, joined per example on ``example_id``.

Per method and keep rate (the bench's): Spearman with the oracle and needle recall at the method's
own layer (``compare_store``'s ``summary_layers``), the evidence its offline selection keeps
(``evidence_kept_offline``), and from the bench the evidence kept online (``evidence_kept``) and
the accuracy; each with its 95% interval, ``n_examples`` and, where examples share a haystack or a
needle, ``n_clusters`` (``rankkit.eval.stats.mean_intervals``). Offline and online evidence kept
follow one rule (``compare.with_evidence_kept``, ``rankkit.bench.evidence_kept``) and agree exactly
for every prompt-pruning method.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass

import polars as pl

from rankkit.checks import refuse_timing_only_store
from rankkit.errors import RankkitError
from rankkit.eval.compare import available_methods, compare_keeps, scored_layers
from rankkit.eval.offline import recorded_model
from rankkit.eval.stats import CLUSTER, EXAMPLE_ID, cluster_column, mean_intervals, scores_among
from rankkit.methods import make
from rankkit.probes import format_parameter

OFFLINE_METRICS = ("spearman", "needle_recall", "evidence_kept_offline")
ONLINE_METRICS = ("evidence_kept", "accuracy")
KEYS = ("method", "keep")


@dataclass(frozen=True)
class Joined:
    per_example: pl.DataFrame  # one row per (example_id, method, keep): both faces' values
    summary: pl.DataFrame  # per method and keep: every metric's mean with its interval and n


def join_store_and_bench(
    store_path: str | os.PathLike,
    bench: str | os.PathLike,
    *,
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Joined:
    """The store's offline comparison at each keep rate of the bench ``bench``, joined with the
    bench's rows of the same examples. A bench of another model, or without rows for the store's
    examples or a keep rate, is refused. With ``out``, the per-example join is written there as
    parquet: refused before any work if it exists (unless ``overwrite``) or is one of the inputs."""
    from rankkit import outputs, stores
    from rankkit.report import _bench_frame

    if out is not None:
        outputs.claim([out], overwrite=overwrite, inputs=[store_path, bench])
    store = stores.open(store_path)
    refuse_timing_only_store(store.meta, store.path, "report its rankings beside a bench")
    joined = join_bench_rows(store, _bench_frame(bench, store), f"bench {bench}")
    if out is not None:
        outputs.write_parquet(joined.per_example, out, overwrite=overwrite)
    return joined


def join_bench_rows(store, bench: pl.DataFrame, what: str, *, workers: int | None = None) -> Joined:
    """``join_store_and_bench`` for an opened store and the rows of a bench of its model (``what``
    names the bench in a refusal; ``workers`` as ``compare_keeps``). Only the examples the store holds
    with an oracle are joined, so each row's figures and its n are of the same examples."""
    records = list(store.examples())
    ids = {record.id for record in records}
    at_keeps = bench.filter(pl.col("keep").is_not_null())
    online = at_keeps.filter(pl.col(EXAMPLE_ID).is_in(ids))
    if not online.height:
        raise RankkitError(
            f"{what} has no rows at a keep rate for the examples of store {store.path}; "
            "bench the store's data with --keep"
        )
    if not any(record.has_oracle for record in records):
        raise RankkitError(f"store {store.path} has no oracle; run `rankkit oracle {store.path}` first")
    refuse_other_examples(records, online, what)
    unheld = at_keeps.filter(~pl.col(EXAMPLE_ID).is_in(ids))[EXAMPLE_ID].n_unique()
    if unheld:
        warnings.warn(f"left out {unheld} example(s) of {what} that store {store.path} does not hold", stacklevel=2)
    # every figure of a row over the same examples: the offline ones exist only where the oracle does
    # (compare warns of the examples it leaves out)
    online = online.filter(pl.col(EXAMPLE_ID).is_in([record.id for record in records if record.has_oracle]))
    probes = sorted({probe for record in records for probe in record.probes})
    offline_faces = set(available_methods(probes, has_draft=False)) - set(probes)
    methods = [name for name in online["method"].unique(maintain_order=True) if name in offline_faces]
    _refuse_other_settings(online, methods, scored_layers(records), recorded_model(store.meta), what)
    keeps = sorted(online["keep"].unique())
    offline = pl.DataFrame()
    if methods:
        results = compare_keeps(store, keep=keeps, methods=methods, detailed=False, workers=workers)
        offline = pl.concat([at_method_layers(result) for result in results], how="diagonal_relaxed")
    per_example = online.select(
        EXAMPLE_ID,
        "task",
        "method",
        "keep",
        *([CLUSTER] if CLUSTER in online.columns else []),
        "evidence_kept",
        pl.col("score").cast(pl.Float64).alias("accuracy"),
    )
    if offline.height:
        per_example = per_example.join(offline, on=[EXAMPLE_ID, "method", "keep"], how="left")
    else:
        per_example = per_example.with_columns(
            pl.lit(None, pl.Float64).alias(name) for name in OFFLINE_METRICS
        )
    summary = mean_intervals(
        per_example,
        list(KEYS),
        [*OFFLINE_METRICS, *ONLINE_METRICS],
        cluster=cluster_column(per_example),
        scores=scores_among([*OFFLINE_METRICS, *ONLINE_METRICS]),
    )
    return Joined(per_example, summary)


def refuse_other_examples(records, bench: pl.DataFrame, what: str) -> None:
    """Example ids name an example only within one data spec (``niah:n=3`` and ``niah:n=6`` share
    ``niah-512-s0-001`` at other depths): where a bench's rows and the store's ``records`` share an id,
    the bench's prompt length and needle depth must be the store's."""
    recorded = {
        record.id: (record.num_tokens, (record.attrs.get("meta") or {}).get("depth_percent"))
        for record in records
    }
    shared = bench.filter(pl.col(EXAMPLE_ID).is_in(list(recorded)))
    for example_id, length, depth in shared.select(EXAMPLE_ID, "length", "depth_percent").unique(maintain_order=True).iter_rows():
        tokens, stored_depth = recorded[example_id]
        if length != tokens or (depth is not None and stored_depth is not None and depth != stored_depth):
            raise RankkitError(
                f"{what} ran another example named '{example_id}' ({length} tokens, needle depth {depth}) "
                f"than the store holds ({tokens} tokens, depth {stored_depth}); bench the store's --data"
            )


def _refuse_other_settings(online: pl.DataFrame, methods, num_layers: int, layout: dict, what: str) -> None:
    """The offline face is each method at its defaults on the store's model: a bench of other settings
    (``claa:pruning_layer=5``) would be joined to figures it did not run."""
    for method, params in online.filter(pl.col("method").is_in(methods)).select("method", "params").unique(maintain_order=True).iter_rows():
        # as the bench wrote them: through JSON (a tuple of layers reads back as a list)
        defaults = json.loads(json.dumps(make(method).resolved(num_layers, layout.get("layer_types"))))
        if json.loads(params) != defaults:
            given = ",".join(
                f"{key}={format_parameter(value)}"
                for key, value in json.loads(params).items()
                if defaults.get(key) != value
            )
            raise RankkitError(
                f"{what} ran {method} with {given}; report joins each method at its defaults: bench "
                f"{method} at its defaults, or compare the store with --methods {method}:{given}"
            )


def at_method_layers(result) -> pl.DataFrame:
    """A ``CompareResult``'s per-example rows at each method's own layer (``summary_layers``)."""
    rows = []
    for method, layer in result.summary_layers.items():
        chosen = result.per_layer.filter(pl.col("method") == method)
        if layer is not None:
            chosen = chosen.filter(pl.col("layer") == layer)
        rows.append(chosen)
    return pl.concat(rows).select(
        pl.col(EXAMPLE_ID).cast(pl.String),
        "method",
        pl.col("keep").cast(pl.Float64),
        pl.col("layer").alias("offline_layer"),
        "spearman",
        "needle_recall",
        pl.col("evidence_kept").alias("evidence_kept_offline"),
    )
