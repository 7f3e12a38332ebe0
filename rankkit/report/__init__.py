"""``write_dashboard``: a capture store (plus optional bench and diffusion frames) as one self-contained HTML report.

    from rankkit.report import write_dashboard
    write_dashboard("runs/niah.zarr", "report.html", bench="bench.parquet", diffusion="diffusion.parquet")

Panels: Spearman vs layer (CLAA Fig. 2/8), ASL rank variance and selection layers (ASL Fig. 6/9),
the token-score explorer, needle recall per layer, the needle heatmap (CLAA Fig. 3), accuracy vs
TTFT with its Pareto front (CLAA Fig. 4), the offline and end-to-end figures joined (``rankkit
report``'s table) and information diffusion (SlimInfer Fig. 2). A panel whose data is missing
names the command that produces it.

Size: the explorer keeps every example, probe and layer, but pools the token axis into
contiguous bins (max score per bin, with the top token's position and exact rank) so its
arrays fit ``EXPLORER_BUDGET_BYTES``; scores travel as float16, ranks as uint16 (uint32 past
65,536 tokens) and the top token as its offset in the bin (uint8 up to 256 tokens a bin).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from rankkit import outputs
from rankkit.bench import (
    FIRST_RUNS_TIMED,
    SUMMARY_INPUTS,
    check_bench_values,
    check_same_model,
    first_runs_timed,
    is_model_of,
    measured_by,
    refuse_timing_only_bench,
    short_hash,
)
from rankkit.checks import first_repeated, refuse_timing_only_store
from rankkit.errors import RankkitError
from rankkit.eval.compare import KEEP_RATES, compared_budgets
from rankkit.eval.parallel import map_examples, shared_workers
from rankkit.methods import Budget, budget_keywords
from rankkit.values import as_list

from . import figures
from .html import Control, Page, Panel, encode_array, render, render_index

# The explorer's arrays (before base64) stay under this; with plotly.js (4.8 MB), the token
# texts and the other panels a 50-example, 4k-token, 5-probe, 30-layer store comes out near 16 MB.
EXPLORER_BUDGET_BYTES = 7 * 2**20
MAX_BINS = 1024  # about one column per screen pixel of a wide panel
MIN_BINS = 64  # below this a 4k-token heatmap stops showing where anything is
# Beyond this many examples (or as many as fit the budget at MIN_BINS) the explorer shows a
# sample, so a 1,000-example page stays under 20 MB and opens quickly; the aggregate panels
# always cover every example.
EXPLORER_EXAMPLES = 100
RANKED_SPAN = "prompt"  # what compare ranks by default; the explorer shows the same tokens
DEFAULT_PROBE = "window"
ASL_PROBE = "window:w=32"  # the window setting ASL ranks by (its curve is the variance panel)
DEFAULT_TAU = 0.3

BENCH_COLUMNS = (*SUMMARY_INPUTS, "length", "depth_percent", "evidence_kept")
DIFFUSION_COLUMNS = ("example", "layer", "correct")
BENCH_COMMAND = (
    "rankkit bench --methods full,gemfilter,fastkv,claa --keep 0.1,0.2,0.4 --data niah:n=8,length=2048 "
    "--out bench.parquet"
)
DIFFUSION_COMMAND = "rankkit diffusion --data niah:n=4,length=1024 --out diffusion.parquet"

BenchSource = str | os.PathLike | pl.DataFrame  # a bench's rows, or the parquet file holding them

__all__ = ["write_dashboard", "write_index"]


def write_dashboard(
    store_path: str | os.PathLike,
    out: str | os.PathLike,
    bench: BenchSource | Sequence[BenchSource] | None = None,
    diffusion: str | os.PathLike | pl.DataFrame | None = None,
    *,
    overwrite: bool = False,
    workers: int | None = None,
    explore: Sequence[str] | str | None = None,
    keep: Sequence[float] | str | float | None = None,
    budget: Sequence[int] | str | int | None = None,
    needle_keep: float | int | None = None,
) -> Path:
    """Write the dashboard of ``store_path`` to ``out`` and return that path.

    ``bench`` is the frame ``rankkit bench --out`` writes (or its parquet path), or several of them
    (one per run, of any model), drawn side by side, each labelled with its run, model and weights
    (``_benches``); only a bench of the store's model is joined with the store's offline figures,
    in the report panel (``rankkit report``'s table); ``diffusion`` the
    one ``rankkit diffusion --out`` writes; ``keep`` the keep rates in (0, 1] or ``budget`` the token
    counts the store is compared under, as compare takes them (``compared_budgets``; the Spearman
    panel shows the first, the needle recall panel one heatmap each, counting at its budget unless
    ``needle_keep``, a keep rate or a token count, names one for all); ``workers`` processes compute the rankings (see
    ``rankkit.eval.parallel``). The aggregate panels cover every example; the token explorer
    shows ``explore`` (example ids), by default all examples up to ``EXPLORER_EXAMPLES`` and an
    evenly spaced sample of that many beyond, so a large store's page stays small and quick.
    RankkitError names the fix for a missing store or a file that is not the expected parquet.
    An existing ``out`` is replaced only with ``overwrite``; one inside the store or equal
    to an input is refused (``outputs.claim``).
    """
    from rankkit import stores
    from rankkit.report.joined import refuse_other_examples

    explore = None if explore is None else as_list(explore, "--explore")
    compared = compared_budgets(keep, budget)
    if needle_keep is not None:
        Budget.parse(needle_keep, "--needle-keep")
    benches = [] if bench is None else list(bench) if isinstance(bench, list | tuple) else [bench]
    twice = first_repeated([Path(each).resolve() for each in benches if not isinstance(each, pl.DataFrame)])
    if twice is not None:  # its rows would count twice in every panel
        raise RankkitError(f"--bench names {twice} twice; give each bench once")
    sources = [each for each in (store_path, *benches, diffusion) if not isinstance(each, pl.DataFrame)]
    outputs.claim([out], overwrite=overwrite, inputs=sources)
    store = stores.open(store_path)
    refuse_timing_only_store(store.meta, store_path, "show its rankings against the oracle in a dashboard")
    records = list(store.examples())
    if not records:
        raise RankkitError(f"store {store_path} has no complete example; capture into it first")
    if not records[0].probes:
        raise RankkitError(f"store {store_path} holds no probe scores; capture them with `rankkit capture`")
    runs = _benches(benches, store)
    for run in runs:  # a bench of other examples under the store's ids: report refuses it, so does the page
        if run.of_store_model:
            refuse_other_examples(records, run.rows, f"bench {run.run}")
    diffusion_frame = _frame(diffusion, "diffusion", DIFFUSION_COLUMNS, DIFFUSION_COMMAND)
    if diffusion_frame is not None:
        from rankkit.eval.diffusion import check_diffusion_values

        what = "the diffusion frame" if isinstance(diffusion, pl.DataFrame) else f"diffusion {diffusion}"
        check_diffusion_values(diffusion_frame, what, records[0].score_shape(records[0].probes[0])[0])
        check_same_model(diffusion_frame, store.meta.get("model") or {}, what, f"store {store_path}")
    explored = _explorer_sample(records, explore, store_path)
    with shared_workers(store.path):  # compare, variance and the explorer: one start-up of the workers
        page = _page(store, records, explored, store_path, runs, diffusion_frame, workers, compared, needle_keep)
    return outputs.write_text(render(page), out, overwrite=overwrite)


def write_index(
    out_path: str | os.PathLike,
    title: str,
    facts: Sequence[tuple[str, str]],
    rows: Sequence[dict[str, str]],
    *,
    link: str = "dashboard",
) -> Path:
    """A page linking several dashboards (one row each, ``link`` holding the dashboard's path
    relative to ``out_path``), written atomically over any page there."""
    return outputs.write_text(render_index(title, facts, rows, link), out_path)


@dataclass(frozen=True)
class BenchRun:
    """One ``--bench``: its rows as written, the run it names and the model that measured it."""

    rows: pl.DataFrame
    run: str  # the file's name (its path where names repeat; "bench N" for a frame)
    model: str | None  # None: a bench written before benches named their model
    weights_hash: str | None
    of_store_model: bool  # measured with the store's weights: the only kind joined with its figures

    @property
    def label(self) -> str:
        """What names the run's methods on the page: the run, and the model with its short hash."""
        if self.weights_hash is None:
            return self.run
        return f"{self.run}, {self.model} {short_hash(self.weights_hash)}"

    def named(self, frame: pl.DataFrame) -> pl.DataFrame:
        """``frame`` (this run's rows, or a table of them per method) with each method named after the run."""
        method = pl.format("{} ({})", pl.col("method").cast(pl.String), pl.lit(self.label))
        return frame.with_columns(method.alias("method"))


def _labelled(runs: Sequence[BenchRun]) -> bool:
    """Whether the page names each run's methods after it: always, but for a lone run of the store's model."""
    return not (len(runs) == 1 and runs[0].of_store_model)


def _benches(benches: Sequence[BenchSource], store) -> list[BenchRun]:
    """Each bench with its run and model. A bench of another model is kept, to be shown apart under
    its own label, never under the store's model's name nor joined with the store's figures."""
    names = [f"bench {index + 1}" if isinstance(each, pl.DataFrame) else Path(each).stem
             for index, each in enumerate(benches)]  # fmt: skip
    if len(set(names)) < len(names):
        names = [name if isinstance(each, pl.DataFrame) else str(each) for name, each in zip(names, benches, strict=True)]
    runs = []
    model = store.meta.get("model") or {}
    for source, name in zip(benches, names, strict=True):
        frame, what = _checked_bench(source)
        measured, weights_hash = measured_by(frame, what)
        own = is_model_of(frame, model, what, f"store {store.path}")
        runs.append(BenchRun(frame, name, measured, weights_hash, own))
    return runs


def _bench_rows(runs: Sequence[BenchRun]) -> pl.DataFrame | None:
    """Every run's rows for the bench panels: a lone run of the store's model with its methods as
    named; otherwise each method named after its run's label, "claa (8k, SmolLM2 1a2b3c4d5e6f)", so no
    run's numbers show under another's name or another model's under the store's."""
    if not runs:
        return None
    if not _labelled(runs):
        return runs[0].rows
    return pl.concat([run.named(run.rows) for run in runs], how="diagonal_relaxed")


def _frame(
    source: str | os.PathLike | pl.DataFrame | None, what: str, columns: Sequence[str], command: str
) -> pl.DataFrame | None:
    if source is None or isinstance(source, pl.DataFrame):
        frame = source
    else:
        path = Path(source)
        if not path.is_file():
            raise RankkitError(f"no {what} file at {path}; write one with `{command}`")
        try:
            frame = pl.read_parquet(path)
        except Exception as error:  # polars raises several types for a file that is not parquet
            raise RankkitError(
                f"{path} is not a parquet file ({type(error).__name__}); pass the file `{command}` writes"
            ) from None
    if frame is not None:
        missing = [column for column in columns if column not in frame.columns]
        if missing:
            raise RankkitError(
                f"the {what} frame lacks column(s) {', '.join(missing)}; pass the file `{command}` writes"
            )
    return frame


def _bench_frame(source: str | os.PathLike | pl.DataFrame | None, store) -> pl.DataFrame | None:
    """The bench frame ``source`` of ``store``'s model: a bench of another model is refused."""
    if source is None:
        return None
    frame, what = _checked_bench(source)
    check_same_model(frame, store.meta.get("model") or {}, what, f"store {store.path}")
    return frame


def _checked_bench(source: BenchSource) -> tuple[pl.DataFrame, str]:
    """A bench's rows, with what names it in messages: refused if it lacks a column the page reads,
    holds a value no bench writes, or was measured with random weights."""
    frame = _frame(source, "bench", BENCH_COLUMNS, BENCH_COMMAND)
    what = "the bench" if isinstance(source, pl.DataFrame) else f"bench {source}"
    check_bench_values(frame, what)
    refuse_timing_only_bench(frame, what)
    return frame, what


def _page(
    store,
    records,
    explored,
    store_path,
    runs: Sequence[BenchRun],
    diffusion: pl.DataFrame | None,
    workers: int | None,
    compared: Sequence[Budget],
    needle_keep: float | int | None,
) -> Page:
    from rankkit.eval.compare import compare_keeps
    from rankkit.eval.offline import recorded_model
    from rankkit.eval.variance import variance_store
    from rankkit.methods import make

    num_layers = records[0].score_shape(records[0].probes[0])[0]
    # compare's layer for probes, CLAA's l_p
    layer = make("claa").bind(num_layers, recorded_model(store.meta).get("layer_types")).pruning_layer
    probes = sorted({probe for record in records for probe in record.probes})
    has_oracle = any(record.has_oracle for record in records)
    # The page shows Spearman per layer and the paired tests, not Kendall or per-head rows.
    # one comparison per keep; the Spearman panel shows the first, the needle recall panel every one
    comparisons = (
        compare_keeps(
            store, **budget_keywords(compared), workers=workers, detailed=False, needle_keep=needle_keep
        )
        if has_oracle
        else []
    )
    comparison = comparisons[0] if comparisons else None
    if comparison is None:  # compare_store warns of what it leaves out itself
        store.warn_skipped()
    # ASL's curves under the first budget, as the Spearman panel's rankings: a sweep's variance stage draws them so
    variance = variance_store(store, **compared[0].keywords, workers=workers) if ASL_PROBE in probes else None
    bench = _bench_rows(runs)
    methods = set(comparison.per_layer["method"].unique()) if comparison is not None else set()
    methods |= set(bench["method"].unique()) if bench is not None else set()
    colors = figures.method_colors(methods)
    taus = sorted(variance.selections["tau"].unique()) if variance is not None else []
    tau = DEFAULT_TAU if DEFAULT_TAU in taus else (taus[0] if taus else DEFAULT_TAU)
    has_needles = bench is not None and bench["depth_percent"].drop_nulls().len() > 0
    # a token budget's rows have no keep rate (null): the keep control cannot pick them
    bench_keeps = sorted(keep for keep in bench["keep"].drop_nulls().unique() if keep < 1.0) if has_needles else []
    keeps = bench_keeps or list(KEEP_RATES)  # the explorer marks what a keep rate keeps, bench or not
    keep = keeps[0]
    diffusion_metrics = (
        [name for name in figures.DIFFUSION_METRICS if name in diffusion.columns]
        if diffusion is not None
        else []
    )
    probe = DEFAULT_PROBE if DEFAULT_PROBE in probes else probes[0]
    max_bins = _bins_for_budget(explored)

    panels = [
        _spearman_panel(comparison, colors, layer, store_path),
        _variance_panel(variance, tau, layer, num_layers, store_path, explored, compared[0]),
        _explorer_panel(
            explored, probe, layer, keep, max_bins, _unexplored_note(records, explored, store_path)
        ),
        _needle_recall_panel(comparisons, store_path),
        _needle_panel(bench, has_needles, colors, keep),
        _tradeoff_panel(bench, colors),
        _report_panel(store, runs, has_oracle, workers),
        _diffusion_panel(diffusion, diffusion_metrics, layer),
    ]
    controls = [
        Control(
            "example",
            "example",
            "filter",
            [(record.id, _example_label(record)) for record in explored],
            explored[0].id,
        ),
        Control("probe", "probe", "explorer", [(name, name) for name in probes], probe),
        Control("colour", "explorer colour", "explorer", list(figures.EXPLORER_COLOURS.items()), "rank"),
        Control("layer", "layer", "shape", default=layer, slider_range=(0, num_layers - 1)),
        Control("keep", "keep rate", "filter", [(value, f"{value:.0%}") for value in keeps], keep),
    ]
    if taus:
        controls.append(Control("tau", "τ", "filter", [(value, f"{value:g}") for value in taus], tau))
    if has_needles:
        controls.append(
            Control(
                "needle_metric",
                "needle metric",
                "filter",
                [(name, name) for name in figures.NEEDLE_METRICS],
                "accuracy",
            )
        )
    if diffusion_metrics:
        controls.append(
            Control(
                "diffusion_metric",
                "diffusion metric",
                "filter",
                [(name, figures.DIFFUSION_METRICS[name]) for name in diffusion_metrics],
                diffusion_metrics[0],
            )
        )
    explored_ids = [record.id for record in explored]
    payloads = map_examples(
        store.path, explored_ids, partial(_explorer_payload, max_bins=max_bins, keeps=keeps), workers=workers
    )
    model = (store.meta.get("model") or {}).get("id", "unknown model")
    facts = [
        ("store", str(store_path)),
        ("model", str(model)),
        ("examples", f"{len(records)} ({sum(record.has_oracle for record in records)} with oracle)"),
        ("tasks", ", ".join(sorted({str(record.attrs.get("task")) for record in records}))),
        ("probes", ", ".join(probes)),
        ("explorer", f"{len(explored)} of {len(records)} examples"),
        ("layers", str(num_layers)),
        ("bench rows", str(bench.height) if bench is not None else "none"),
        *((f"bench {run.run}", _bench_fact(run, model)) for run in runs),
    ]
    return Page(
        title="rankkit dashboard",
        facts=facts,
        controls=controls,
        panels=panels,
        examples=dict(zip(explored_ids, payloads, strict=True)),
        explorer={"colour_titles": figures.EXPLORER_COLOURS},
    )


def _code(command: str) -> str:
    return f"<code>{escape(command)}</code>"


def _spearman_panel(comparison, colors, layer: int, store_path) -> Panel:
    title = "Ranking quality per layer"
    caption = (
        "Spearman ρ between each method's token ranking and the answer-informed oracle at every layer, "
        "averaged over the task's examples with a band for its 95% interval (bootstrap over examples, "
        "resampling whole clusters where examples share a haystack or a needle: the hover's n names both; "
        "CLAA Fig. 2, Fig. 8). Stars mark layers where CLAA differs from a single-layer heuristic "
        "(Wilcoxon signed-rank p < 0.05 within the task; hover for the difference). The dotted line is the "
        "layer control; dashed curves have no layer (SpecPrefill). Methods whose rankings agree at every example "
        "and layer are one curve named together (fastkv = window). Ranked span: every prompt token outside "
        "CLAA's observation window (compare --span prompt); each method ranks with its own defaults."
    )
    if comparison is None:
        return Panel(
            "spearman",
            title,
            caption,
            missing=f"The store has no oracle. Add it with {_code(f'rankkit oracle {store_path}')}.",
        )
    caption += f" Rankings under {Budget.parse(comparison.keep).printed}, the first keep compared."
    stats = figures.spearman_stats(comparison.per_layer)  # the bootstrap, once for the plot and its numbers
    return Panel(
        "spearman",
        title,
        caption,
        figures.spearman_figure(
            comparison.per_layer,
            pruning_layer=layer,
            colors=colors,
            pairs=comparison.tested_pairs,
            stats=stats,
        ),
        numbers=figures.spearman_numbers(comparison.per_layer, stats),
    )


def _variance_panel(
    variance, tau: float, layer: int, num_layers: int, store_path, explored, budget: Budget
) -> Panel:
    title = "Adaptive selection layer (ASL)"
    top = f"{budget.share} of the prompt" if budget.tokens is None else budget.share
    caption = (
        "Relative rank variance of the top tokens over the last L_obs layers, divided by its value at L_min, "
        "per example (thin; the picked example bold) and per task (mean, band: 95% interval over examples, "
        "resampling whole clusters where examples share a haystack or a needle; "
        "ASL Fig. 6); right, how many examples each "
        f"layer is the first below τ for (ASL Fig. 9). Probe: {ASL_PROBE}, k = {top} - W (the first budget "
        "compared)."
    )
    if variance is None:
        command = f"rankkit capture --data SPEC --probes all --oracle --out {store_path} --overwrite"
        return Panel(
            "variance",
            title,
            caption,
            missing=f"The store has no {ASL_PROBE} scores, which ASL ranks by. Capture them with "
            f"{_code(command)}.",
        )
    figure = figures.variance_figure(
        variance.curves,
        variance.selections,
        variance.means,
        tau=tau,
        layer=layer,
        num_layers=num_layers,
        pickable={record.id for record in explored},
    )
    return Panel("variance", title, caption, figure)


def _explorer_sample(records, explore: Sequence[str] | None, store_path) -> list:
    """The examples the token explorer shows: ``explore``, or all up to ``EXPLORER_EXAMPLES`` (fewer when
    their arrays would pass ``EXPLORER_BUDGET_BYTES`` at ``MIN_BINS`` columns), or an evenly spaced
    sample of that many."""
    if explore:
        by_id = {record.id: record for record in records}
        missing = [example_id for example_id in explore if example_id not in by_id]
        if missing:
            raise RankkitError(
                f"--explore names {', '.join(missing)}, not complete examples of {store_path}; "
                f"it holds {_some(list(by_id))}"
            )
        twice = first_repeated(explore)
        if twice is not None:
            raise RankkitError(f"--explore names {twice} twice; name each example once")
        return [by_id[example_id] for example_id in explore]
    most = _explorer_capacity(records[0])  # examples of one store share their rows
    if len(records) <= most:
        return records
    return [records[index * len(records) // most] for index in range(most)]


def _unexplored_note(records, explored, store_path) -> str:
    shown = {record.id for record in explored}
    others = [record.id for record in records if record.id not in shown]
    if not others:
        return ""
    return (
        f" The explorer holds {len(explored)} of the {len(records)} examples; draw any others with "
        f"`rankkit dashboard {store_path} --explore ID[,ID...]`. Not shown: {', '.join(others)}."
    )


def _explorer_panel(records, probe: str, layer: int, keep: float, max_bins: int, note: str) -> Panel:
    caption = (
        "The picked probe's scores (summed over KV heads) for the picked example, layers x prompt tokens outside "
        "the observation window (the span compare ranks); the "
        "oracle is the top strip, and the strip below it marks the columns the probe's top tokens at the picked "
        "layer and keep rate fall in. Evidence spans are outlined in cyan. Colour by the top token's rank within "
        "its layer, or by raw score. Hover a cell for its tokens, its top token's text, rank and score (float16). "
        "Long contexts are pooled into columns of equal width, each showing its highest score."
    ) + note
    record = records[0]  # the page redraws the explorer for the picked example; this sets its look
    ranked = _ranked_slice(record)
    chosen = probe if probe in record.probes else record.probes[0]
    figure = figures.token_explorer_figure(
        _probe_bins(record, chosen, ranked, max_bins),
        _oracle_bins(record, ranked, max_bins),
        _token_texts(record, ranked),
        text_start=ranked.start,
        evidence=_evidence(record),
        probe=chosen,
        title=_example_title(record),
        layer=layer,
        keep=keep,
    )
    # The page draws the explorer from the compact per-example arrays; the figure ships its look only.
    figure.update_traces(z=[], customdata=None, text=None)
    return Panel("explorer", "Token-score explorer", caption, figure)


def _needle_recall_panel(comparisons, store_path) -> Panel:
    title = "Needle recall per layer"
    caption = (
        "Share of each example's evidence tokens in the method's top tokens at every layer, averaged over "
        "the examples with evidence; one heatmap per budget the store was compared under "
        "(dashboard --keep 0.1,0.2 or --budget 512,1024), each the rankings made under it, counting in its "
        "top share (compare's needle_keep). Hover a cell for its 95% interval and n (compare's curve: bootstrap over "
        "examples, whole clusters where examples share a haystack or a needle). Methods whose rankings are "
        "one, as in the Spearman plot, are one row named together (fastkv = window)."
    )
    if not comparisons:
        return Panel(
            "needle_recall",
            title,
            caption,
            missing=f"The store has no oracle. Add it with {_code(f'rankkit oracle {store_path}')}.",
        )
    cells = figures.needle_recall_frame(pl.concat([each.per_layer for each in comparisons], how="diagonal"))
    if cells.is_empty():
        return Panel("needle_recall", title, caption, missing="No example of the store has evidence spans.")
    return Panel("needle_recall", title, caption, figures.needle_recall_figure(cells), numbers=cells)


def _needle_panel(bench, has_needles: bool, colors, keep: float) -> Panel:
    title = "Needle in a haystack"
    caption = (
        "Mean accuracy (or the share of needle tokens the method kept) per needle depth and prompt length, one "
        "heatmap per method, at the picked keep rate (CLAA Fig. 3); hover a cell for its 95% interval and n "
        "(bootstrap over examples, whole clusters where examples share a haystack or a needle; Wilson's for "
        "right/wrong accuracy). Lengths are rounded to two significant figures."
    )
    if bench is None:
        return Panel(
            "needle",
            title,
            caption,
            missing=f"No bench results. Run {_code(BENCH_COMMAND)} and pass {_code('--bench bench.parquet')}.",
        )
    if not has_needles:
        return Panel(
            "needle",
            title,
            caption,
            missing=f"The bench has no needle depths (not niah data). Run {_code(BENCH_COMMAND)}.",
        )
    rated = bench.filter(pl.col("keep").is_not_null())
    if rated.height < bench.height:
        unshown = "runs under a token budget (--budget), which the keep rate control cannot pick, are not shown"
        if not rated["keep"].lt(1.0).any():
            return Panel("needle", title, caption, missing=f"The bench's {unshown}: run it with --keep.")
        caption += f" The bench's {unshown}."
    cells = figures.needle_frame(rated)  # the bootstrap, once for the plot and its numbers
    figure = figures.needle_figure(rated, colors=colors, keep=keep, cells=cells)
    return Panel("needle", title, caption, figure, numbers=cells)


def _tradeoff_panel(bench, colors) -> Panel:
    title = "Accuracy vs time to first token"
    caption = (
        "Mean accuracy against mean TTFT relative to full prefill on the same prompt, one point per method and keep "
        "rate (labels); the ringed points joined by the dashed step are the Pareto front (CLAA Fig. 4)."
    )
    if bench is None or figures.tradeoff_frame(bench).is_empty():
        return Panel(
            "tradeoff",
            title,
            caption,
            missing=f"No scored bench results. Run {_code(BENCH_COMMAND)} and pass "
            f"{_code('--bench bench.parquet')}.",
        )
    if first_runs_timed(bench["warmup"] if "warmup" in bench.columns else []):  # older benches did not keep it
        caption += f" {FIRST_RUNS_TIMED}"
    return Panel(
        "tradeoff",
        title,
        caption,
        figures.tradeoff_figure(bench, colors=colors),
        numbers=figures.tradeoff_numbers(bench),
    )


def _bench_fact(run: BenchRun, store_model: str) -> str:
    measured = "an unnamed model" if run.weights_hash is None else f"{run.model} (weights {short_hash(run.weights_hash)})"
    joined = "joined with the store's figures" if run.of_store_model else f"another model than {store_model}: never joined"
    return f"{run.rows.height} rows of {measured}, {joined}"


def _report_panel(store, runs: Sequence[BenchRun], has_oracle: bool, workers: int | None) -> Panel:
    """``rankkit report STORE --bench B``'s table for each bench of the store's model (``join_bench_rows``):
    the same rows and numbers, its methods named as the other bench panels name them."""
    from rankkit.report.joined import join_bench_rows

    title = "Offline and end to end, joined"
    caption = (
        "Per method and keep rate, as <code>rankkit report STORE --bench B</code> prints it: Spearman ρ with the "
        "oracle and needle recall at the method's own layer, the evidence its offline selection keeps, the "
        "evidence kept online and the accuracy, each a mean over the examples both hold (key example_id) "
        "with its 95% interval and n. Only a bench of the store's model is joined; another model's is shown "
        "in the panels above under its own label."
    )
    own = [run for run in runs if run.of_store_model]
    if not own:
        missing = (
            f"No bench results. Run {_code(BENCH_COMMAND)} on the store's examples and pass "
            f"{_code('--bench bench.parquet')}."
            if not runs
            else "No bench of the store's model: "
            + escape("; ".join(run.label for run in runs))
            + " measured another model, whose numbers are never joined with this store's."
        )
        return Panel("report", title, caption, missing=missing)
    if not has_oracle:
        return Panel(
            "report", title, caption,
            missing=f"The store has no oracle. Add it with {_code(f'rankkit oracle {store.path}')}.",
        )  # fmt: skip
    tables = []
    for run in own:
        try:
            summary = join_bench_rows(store, run.rows, f"bench {run.run}", workers=workers).summary
        except RankkitError as refused:
            return Panel("report", title, caption, missing=escape(str(refused)))
        tables.append(run.named(summary) if _labelled(runs) else summary)
    return Panel("report", title, caption, numbers=pl.concat(tables, how="diagonal_relaxed"))


def _diffusion_panel(diffusion, metrics: list[str], layer: int) -> Panel:
    title = "Information diffusion"
    caption = (
        "What happens to the answer when the evidence tokens' hidden states are removed from layer l on (l = L "
        "removes nothing): share of examples still correct, and the picked per-example metric with its mean. "
        "Attention to the evidence is measured in the unpruned run, at layer l (SlimInfer Fig. 2)."
    )
    if diffusion is None:
        return Panel(
            "diffusion",
            title,
            caption,
            missing=f"No diffusion curves. Run {_code(DIFFUSION_COMMAND)} and pass "
            f"{_code('--diffusion diffusion.parquet')}.",
        )
    figure = figures.diffusion_figure(diffusion, layer=layer, metric=metrics[0] if metrics else "")
    return Panel("diffusion", title, caption, figure)


# -- the explorer's per-example arrays -------------------------------------------------------------


def _ranked_slice(record) -> slice:
    from rankkit.eval.compare import ranked_slice

    return ranked_slice(record.attrs.get("spans"), RANKED_SPAN, record.num_tokens)


# float16 score, uint8 top-token offset, uint16 rank, a uint8 kept flag per keep rate
_CELL_BYTES = 2 + 1 + 2 + len(KEEP_RATES)


def _explorer_rows(record) -> int:
    """The rows of one example's explorer arrays: every layer of every probe, and the oracle."""
    return sum(record.score_shape(probe)[0] for probe in record.probes) + 1


def _explorer_capacity(record) -> int:
    """How many examples like ``record`` the explorer holds: ``EXPLORER_EXAMPLES``, fewer when their
    arrays would pass ``EXPLORER_BUDGET_BYTES`` even at ``MIN_BINS`` columns (at least one)."""
    fitting = EXPLORER_BUDGET_BYTES // (_explorer_rows(record) * MIN_BINS * _CELL_BYTES)
    return max(1, min(EXPLORER_EXAMPLES, fitting))


def _bins_for_budget(records) -> int:
    """The most bins per row that keep every example's explorer arrays within the budget."""
    rows = sum(_explorer_rows(record) for record in records)
    return int(min(MAX_BINS, max(MIN_BINS, EXPLORER_BUDGET_BYTES // (rows * _CELL_BYTES))))


def _probe_bins(record, probe: str, ranked: slice, max_bins: int) -> figures.TokenBins:
    return figures.bin_tokens(
        record.scores(probe)[..., ranked].sum(axis=1), start=ranked.start, max_bins=max_bins
    )


def _oracle_bins(record, ranked: slice, max_bins: int) -> figures.TokenBins | None:
    oracle = record.oracle
    return (
        None if oracle is None else figures.bin_tokens(oracle[ranked], start=ranked.start, max_bins=max_bins)
    )


def _explorer_payload(record, max_bins: int, keeps: list[float]) -> dict[str, Any]:
    ranked = _ranked_slice(record)
    probe_bins = {probe: _probe_bins(record, probe, ranked, max_bins) for probe in record.probes}
    oracle_bins = _oracle_bins(record, ranked, max_bins)
    shape = next(iter(probe_bins.values()))  # every probe of an example bins the same tokens
    return {
        "title": _example_title(record),
        "tokens": _token_texts(record, ranked),
        "evidence": _evidence(record),
        "ranked": shape.num_tokens,
        "layers": shape.score.shape[0],
        "edges": shape.edges.tolist(),
        "width": shape.width,
        "oracle": None if oracle_bins is None else _encoded_bins(oracle_bins),
        "probes": {probe: _encoded_bins(bins) for probe, bins in probe_bins.items()},
        # per probe and keep rate, [layers, bins]: 1 where a column holds one of the layer's kept tokens
        "kept": {
            probe: {f"{keep:g}": encode_array(_kept_grid(bins, keep), "u1") for keep in keeps}
            for probe, bins in probe_bins.items()
        },
    }


def _kept_grid(bins: figures.TokenBins, keep: float) -> np.ndarray:
    return np.stack([figures.kept_columns(bins, layer, keep) for layer in range(bins.rank.shape[0])])


def _encoded_bins(bins: figures.TokenBins) -> dict[str, dict[str, str]]:
    # float16 keeps ~3 significant digits; scores beyond its range stay float32.
    score_dtype = "f2" if np.all(np.abs(bins.score) < 6.0e4) else "f4"
    return {
        "score": encode_array(bins.score, score_dtype),
        "offset": encode_array(bins.top - bins.edges[:-1], "u1" if bins.width <= 2**8 else "u2"),
        "rank": encode_array(bins.rank, "u2" if bins.num_tokens <= 2**16 else "u4"),
    }


def _token_texts(record, ranked: slice) -> list[str]:
    texts = record.attrs.get("token_text")
    if texts is None:  # stores without decoded text: show the token ids
        texts = [f"id {token}" for token in record.tokens.tolist()]
    return [figures.display_token(text) for text in texts[ranked]]


def _evidence(record) -> list[list[int]]:
    return [list(span) for span in (record.attrs.get("spans") or {}).get("evidence_tokens", [])]


def _example_label(record) -> str:
    return f"{record.id} ({record.attrs.get('task')})"


def _example_title(record) -> str:
    attrs = record.attrs
    # The title is plotly markup: the example's own strings are escaped.
    parts = [f"<b>{escape(record.id)}</b>", escape(str(attrs.get("task")))]
    depth = (attrs.get("meta") or {}).get("depth_percent")
    if depth is not None:
        parts.append(f"needle at {depth:g}% depth")
    if attrs.get("answers"):
        parts.append(f"answer “{escape(str(attrs['answers'][0]))}”")
    correct = attrs.get("correct")
    if correct is not None and not (isinstance(correct, float) and math.isnan(correct)):
        parts.append(
            f"model {'right' if correct >= 1 else 'wrong' if correct <= 0 else f'scored {correct:.2f}'}"
        )
    return " · ".join(parts)


def _some(names: list[str], shown: int = 5) -> str:
    """The first ``shown`` of ``names``, and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
