"""One function per dashboard panel: tidy polars frames (or one example's arrays) in, a plotly figure out.

Traces carry ``meta`` tags that the page's controls filter on (see ``rankkit.report.html``):
a trace tagged ``{"keep": 0.1}`` is shown only while the keep-rate control says 0.1, one
tagged ``{"example": id}`` only while that example is picked. Per-example curves are drawn
as one faint trace of all examples (a path per group, not per example: the page stays fast
with hundreds of examples) plus a bold trace per example that shows while it is picked.
Shapes named ``"<control>:<axis>:<half width>"`` follow a control's value along that axis
(the layer marker, the tau line).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from rankkit.eval.ranking import descending_ranks, keep_count
from rankkit.eval.stats import EXAMPLE_ID, interval_columns
from rankkit.methods import Budget

# The methods of the papers keep one colour in every panel; others take the rest of the palette.
KNOWN_METHOD_COLORS = {
    "full": "#7f7f7f",
    "oracle": "#111111",
    "claa": "#d62728",
    "fastkv": "#1f77b4",
    "gemfilter": "#2ca02c",
    "specprefill": "#9467bd",
    "asl": "#ff7f0e",
    "sliminfer": "#8c564b",
}
PALETTE = (
    "#17becf",
    "#e377c2",
    "#bcbd22",
    "#393b79",
    "#ad494a",
    "#8ca252",
    "#6b6ecf",
    "#bd9e39",
    "#e7969c",
    "#637939",
    "#a55194",
    "#5254a3",
)
TASK_PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")
FULL = "full"
# each needle metric as the page names it, and its column of needle_frame
NEEDLE_METRICS = {"accuracy": "accuracy", "needle recall": "evidence_kept"}
DIFFUSION_METRICS = {
    "answer_logprob": "answer log-prob",
    "first_token_kl": "first-token KL to unpruned",
    "evidence_attention": "attention to evidence (unpruned)",
}
LAYER_MARKER = {"line": {"color": "#444444", "width": 1, "dash": "dot"}}
FONT = {"family": "Inter, Segoe UI, Helvetica, Arial, sans-serif", "size": 12}


def method_colors(methods: Iterable[str]) -> dict[str, str]:
    """A colour per method: the papers' methods fixed, the others from ``PALETTE`` in name order."""
    names = sorted(set(methods))
    others = [name for name in names if name not in KNOWN_METHOD_COLORS]
    colors = {name: KNOWN_METHOD_COLORS[name] for name in names if name in KNOWN_METHOD_COLORS}
    colors.update({name: PALETTE[index % len(PALETTE)] for index, name in enumerate(others)})
    return colors


def task_colors(tasks: Iterable[str]) -> dict[str, str]:
    return {task: TASK_PALETTE[index % len(TASK_PALETTE)] for index, task in enumerate(sorted(set(tasks)))}


def marker_shape(control: str, axis: str, value: float, half_width: float = 0.0, **style) -> dict:
    """A line (or band, with ``half_width``) across a subplot that the page moves with ``control``."""
    across = "y" if axis == "x" else "x"
    return {
        "type": "line" if half_width == 0 else "rect",
        "name": f"{control}:{axis}:{half_width:g}",
        f"{axis}0": value - half_width,
        f"{axis}1": value + half_width,
        f"{across}0": 0,
        f"{across}1": 1,
        **style,
    }


def _add_shape_to_subplots(figure: go.Figure, shape: dict, subplots: Iterable[tuple[str, str]]) -> None:
    """``shape`` once per (xaxis, yaxis) pair, spanning the subplot's full other axis."""
    along = shape["name"].split(":")[1]
    for xaxis, yaxis in subplots:
        if along == "x":
            figure.add_shape(**shape, xref=xaxis, yref=f"{yaxis} domain")
        else:
            figure.add_shape(**shape, xref=f"{xaxis} domain", yref=yaxis)


def _subplot_axes(count: int) -> list[tuple[str, str]]:
    """(xaxis, yaxis) names of the first ``count`` subplots, in make_subplots' row-major order."""
    return [("x", "y"), *((f"x{index}", f"y{index}") for index in range(2, count + 1))]


def _style(figure: go.Figure, title: str, height: int) -> go.Figure:
    figure.update_layout(
        title={"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        height=height,
        template="plotly_white",
        font=FONT,
        margin={"l": 60, "r": 20, "t": 70, "b": 50},
        legend={"tracegroupgap": 2},
        hoverlabel={"font": {"family": "ui-monospace, Menlo, Consolas, monospace"}},
    )
    return figure


def _grid(count: int, max_columns: int) -> tuple[int, int]:
    columns = min(max_columns, max(1, count))
    return math.ceil(count / columns), columns


def example_curves(
    frame: pl.DataFrame,
    y: str,
    *,
    color: str,
    label: str,
    meta: Mapping[str, object] | None = None,
    pickable: Collection[str] | None = None,
) -> list[go.Scatter]:
    """Every example's ``y`` vs layer as one faint trace (breaks between examples), then one bold
    trace per example tagged ``example`` (hidden until the page's example control picks it), for
    the ``pickable`` examples only when given: a thousand hidden traces would slow the page."""
    meta = dict(meta or {})
    rows = frame.filter(pl.col(y).is_not_null()).sort("example", "layer")
    x: list = []
    values: list = []
    names: list = []
    for (example,), curve in rows.group_by("example", maintain_order=True):
        x += [*curve["layer"], None]
        values += [*curve[y], None]
        names += [example] * curve.height + [None]
    faint = go.Scatter(
        x=x,
        y=values,
        customdata=names,
        mode="lines",
        line={"color": color, "width": 1},
        opacity=0.3,
        name=f"{label}: examples",
        showlegend=False,
        legendgroup=label,
        meta=meta or None,
        hovertemplate=f"%{{customdata}} ({label})<br>layer %{{x}}: %{{y:.3f}}<extra></extra>",
    )
    picked = [
        go.Scatter(
            x=curve["layer"],
            y=curve[y],
            mode="lines+markers",
            line={"color": color, "width": 3},
            marker={"size": 5},
            name=f"{example} (picked)",
            showlegend=False,
            legendgroup=label,
            visible=False,
            meta={**meta, "example": example},
            hovertemplate=f"<b>{example}</b> ({label})<br>layer %{{x}}: %{{y:.3f}}<extra></extra>",
        )
        for (example,), curve in rows.group_by("example", maintain_order=True)
        if pickable is None or example in pickable
    ]
    return [faint, *picked]


# -- Spearman vs layer (CLAA Fig. 2 / Fig. 8) ------------------------------------------------------


SAME_RANKING_KEYS = ("task", EXAMPLE_ID, "example", "keep", "needle_keep", "layer")  # where rows are compared
SAME_RANKING_VALUES = ("spearman", "needle_recall")  # what two rankings that are one must agree on


def curve_labels(per_layer: pl.DataFrame) -> dict[str, str]:
    """The methods worth a line (or a heatmap row), each with its label. Methods whose rankings are
    the same by construction (fastkv and the window probe it ranks by, snapkv and window:w=32, asl and
    asl-2pass) score the same Spearman and needle recall at every example, layer and keep of
    ``per_layer`` (the Spearman plot asks per task): they are drawn once, under the first name,
    and labelled with all of them, "asl = asl-2pass"."""
    keys = [name for name in SAME_RANKING_KEYS if name in per_layer.columns]
    rows = per_layer.select(
        pl.col("method").cast(pl.String),
        *(pl.col(name).cast(pl.String) if name in ("task", EXAMPLE_ID, "example") else pl.col(name) for name in keys),
        *(pl.col(name).fill_nan(None) for name in SAME_RANKING_VALUES if name in per_layer.columns),
    ).sort("method", *keys, nulls_last=True)
    same: dict[tuple, list[str]] = {}
    for (method,), curve in rows.group_by("method", maintain_order=True):
        same.setdefault(tuple(curve.drop("method").iter_rows()), []).append(method)
    return {names[0]: " = ".join(names) for names in same.values()}


def _by_task(per_layer: pl.DataFrame) -> pl.DataFrame:
    """``CompareResult.per_layer`` with plain-text tasks and methods, rows without a task as task "all"."""
    return per_layer.with_columns(pl.col("task").fill_null("all").cast(pl.String), pl.col("method").cast(pl.String))


def spearman_stats(per_layer: pl.DataFrame) -> pl.DataFrame:
    """Mean Spearman ρ per task, method and layer with its 95% interval and n (and ``n_clusters`` where
    examples share a haystack or a needle), each task's resampled over its own examples as compare's
    curve is (``example_means``): the curves ``spearman_figure`` draws. ``per_layer`` holds the
    rankings of one budget: a mean over two would be neither's."""
    from rankkit.eval.compare import example_means

    if "keep" in per_layer.columns and per_layer["keep"].n_unique() > 1:
        keeps = sorted(per_layer["keep"].unique())
        raise ValueError(f"per_layer holds the rankings of keeps {keeps}; give one keep's")
    frame = _by_task(per_layer)
    return pl.concat(
        [
            example_means(frame.filter(pl.col("task") == task), ["task", "method", "layer"], ["spearman"])
            for task in sorted(frame["task"].unique())
        ],
        how="diagonal",  # a task without clusters has no n_clusters
    ).sort("task", "method", "layer", nulls_last=True)


def spearman_numbers(per_layer: pl.DataFrame, stats: pl.DataFrame | None = None) -> pl.DataFrame:
    """Every point ``spearman_figure`` draws, one row per task, curve and layer, the curve by its label
    (``stats``: ``spearman_stats(per_layer)`` when the caller has it already)."""
    frame = _by_task(per_layer)
    labels = pl.concat(
        [
            pl.DataFrame(
                {"task": task, "method": list(names), "curve": list(names.values())},
                schema={"task": pl.String, "method": pl.String, "curve": pl.String},
            )
            for task in sorted(frame["task"].unique())
            for names in [curve_labels(frame.filter(pl.col("task") == task))]
        ]
    )
    stats = spearman_stats(frame) if stats is None else stats
    return (
        stats.join(labels, on=["task", "method"])
        .select("task", pl.col("curve").alias("method"), "layer", "spearman", *interval_columns("spearman"),
                *_counts(stats))
    )  # fmt: skip


def spearman_figure(
    per_layer: pl.DataFrame,
    *,
    pruning_layer: int,
    colors: Mapping[str, str],
    pairs: Sequence[tuple[str, str]] = (),
    stats: pl.DataFrame | None = None,
) -> go.Figure:
    """Mean Spearman rho vs layer per method with its 95% interval over examples as a band
    (``rankkit.eval.stats``), one subplot per task (``stats``: ``spearman_stats(per_layer)`` when the
    caller has it already).

    ``per_layer`` is ``CompareResult.per_layer``; layer-less methods (specprefill) are a flat
    dashed line at their one value. For each (method, baseline) of ``pairs`` a star marks the
    method's curve at the layers where the paired difference is significant (Wilcoxon p < 0.05,
    within the task; ``rankkit.eval.compare.pairs_frame``).
    """
    from rankkit.eval.compare import pairs_frame

    frame = _by_task(per_layer)
    layers = sorted(frame["layer"].drop_nulls().unique())
    tasks = sorted(frame["task"].unique())
    low, high = interval_columns("spearman")
    stats = spearman_stats(frame) if stats is None else stats
    rows, columns = _grid(len(tasks), 3)
    figure = make_subplots(
        rows=rows,
        cols=columns,
        subplot_titles=[f"task: {task}" for task in tasks],
        shared_yaxes=True,
        horizontal_spacing=0.04,
        vertical_spacing=0.14 if rows > 1 else 0.1,
    )
    shown_in_legend: set[str] = set()
    for index, task in enumerate(tasks):
        row, column = divmod(index, columns)
        labels = curve_labels(frame.filter(pl.col("task") == task))
        for method in sorted(labels):
            curve = stats.filter((pl.col("task") == task) & (pl.col("method") == method))
            if curve["layer"].null_count() == curve.height:  # layer-less: one value for every layer
                curve = pl.DataFrame({"layer": layers}).join(curve.drop("layer"), how="cross")
                dash = "dash"
            else:
                dash = "solid"
            x, mean = curve["layer"].to_list(), curve["spearman"].to_numpy()
            lows, highs = (curve[name].fill_null(np.nan).to_numpy() for name in (low, high))
            color = colors[method]
            band = _interval_band(x, lows, highs, color=color, group=method)
            line = go.Scatter(
                x=x,
                y=mean,
                mode="lines",
                line={"color": color, "width": 2, "dash": dash},
                name=labels[method],
                legendgroup=method,
                showlegend=method not in shown_in_legend,
                customdata=np.column_stack([lows, highs, curve.select(_counts(curve)).to_numpy()]),
                hovertemplate=f"<b>{labels[method]}</b> layer %{{x}}<br>ρ %{{y:.3f}} [%{{customdata[0]:.3f}}, "
                f"%{{customdata[1]:.3f}}] ({_counts_hover(curve, 2)})<extra></extra>",
            )
            shown_in_legend.add(method)
            figure.add_trace(band, row=row + 1, col=column + 1)
            figure.add_trace(line, row=row + 1, col=column + 1)
        task_rows = frame.filter(pl.col("task") == task)
        for marks in _significant_marks(pairs_frame(task_rows, pairs), stats.filter(pl.col("task") == task)):
            figure.add_trace(marks, row=row + 1, col=column + 1)
    _add_shape_to_subplots(
        figure, marker_shape("layer", "x", pruning_layer, **LAYER_MARKER), _subplot_axes(len(tasks))
    )
    figure.update_xaxes(title_text="layer")
    figure.update_yaxes(title_text="Spearman ρ vs oracle", col=1)
    return _style(
        figure,
        "Ranking quality per layer: Spearman ρ with the answer-informed oracle (mean, 95% interval)",
        360 * rows + 80,
    )


COUNTS = ("n_examples", "n_clusters")  # a mean's n: its examples, and its clusters where they were resampled


def _counts(means: pl.DataFrame) -> list[str]:
    """The n columns of a frame of means (``mean_intervals``): ``n_clusters`` where it resampled clusters."""
    return [name for name in COUNTS if name in means.columns]


def _counts_hover(means: pl.DataFrame, first: int) -> str:
    """A hover's n from ``_counts(means)`` held in customdata from index ``first`` on: the examples,
    and the clusters they fall in where those were the resampled unit."""
    examples = f"n = %{{customdata[{first}]}}"
    clusters = f" examples in %{{customdata[{first + 1}]}} clusters" if len(_counts(means)) > 1 else ""
    return examples + clusters


def _interval_band(x: list, lows: np.ndarray, highs: np.ndarray, *, color: str, group: str) -> go.Scatter:
    """A mean curve's 95% interval as a filled band, in the curve's colour and legend group."""
    return go.Scatter(
        x=x + x[::-1],
        y=np.concatenate([highs, lows[::-1]]),
        fill="toself",
        fillcolor=color,
        opacity=0.15,
        line={"width": 0},
        hoverinfo="skip",
        legendgroup=group,
        showlegend=False,
        name=f"{group} 95% interval",
    )


def _significant_marks(pairs: pl.DataFrame, curves: pl.DataFrame) -> list[go.Scatter]:
    """Stars on each method's curve where it differs from a baseline significantly (``SIGNIFICANCE``)."""
    from rankkit.eval.stats import SIGNIFICANCE

    significant = pairs.filter(pl.col("p_value") < SIGNIFICANCE).join(
        curves.select("method", "layer", "spearman"), on=["method", "layer"]
    )
    traces = []
    for (method, baseline), rows in significant.group_by("method", "baseline", maintain_order=True):
        traces.append(
            go.Scatter(
                x=rows["layer"],
                y=rows["spearman"],
                mode="markers",
                marker={"symbol": "star", "size": 9, "color": "#222222"},
                name=f"{method} vs {baseline}, p < {SIGNIFICANCE}",
                legendgroup=method,
                showlegend=False,
                customdata=rows.select(
                    "difference", "difference_ci_low", "difference_ci_high", "p_value"
                ).to_numpy(),
                hovertemplate=f"<b>{method} − {baseline}</b> layer %{{x}}<br>Δρ %{{customdata[0]:+.3f}} "
                "[%{customdata[1]:+.3f}, %{customdata[2]:+.3f}], Wilcoxon p = %{customdata[3]:.3g}<extra></extra>",
            )
        )
    return traces


# -- ASL relative rank variance (ASL Fig. 6 / Fig. 9) ----------------------------------------------


def variance_figure(
    curves: pl.DataFrame,
    selections: pl.DataFrame,
    means: pl.DataFrame,
    *,
    tau: float,
    layer: int,
    num_layers: int,
    pickable: Collection[str] | None = None,
) -> go.Figure:
    """Left: relative rank variance vs layer of every example (faint; the picked one bold) and per
    task (mean), with the tau line. Right: how many examples each layer is the selection layer of,
    per task, for the picked tau.

    ``curves``, ``selections`` and ``means`` are ``VarianceResult``'s frames (the mean curves with
    their 95% interval as a band); bars are tagged with ``tau``.
    """
    curves = curves.with_columns(pl.col("task").fill_null("all"), pl.col("example").cast(pl.String))
    selections = selections.with_columns(pl.col("task").fill_null("all"), pl.col("example").cast(pl.String))
    colors = task_colors(curves["task"].unique())
    figure = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.62, 0.38],
        horizontal_spacing=0.08,
        subplot_titles=["relative rank variance (ASL Alg. 2)", "selection layer: first layer below τ"],
    )
    defined = curves.filter(pl.col("relative_variance").is_not_null())
    for task in sorted(colors):
        for trace in example_curves(
            defined.filter(pl.col("task") == task),
            "relative_variance",
            color=colors[task],
            label=task,
            pickable=pickable,
        ):
            figure.add_trace(trace, row=1, col=1)
    low, high = interval_columns("relative_variance")
    for task in sorted(colors):
        mean = means.filter(pl.col("task").fill_null("all") == task).sort("layer")
        layers = mean["layer"].to_list()
        lows, highs = (mean[name].fill_null(np.nan).to_numpy() for name in (low, high))
        figure.add_trace(_interval_band(layers, lows, highs, color=colors[task], group=task), row=1, col=1)
        figure.add_trace(
            go.Scatter(
                x=layers,
                y=mean["relative_variance"],
                mode="lines",
                line={"color": colors[task], "width": 3},
                name=task,
                legendgroup=task,
                customdata=np.column_stack([lows, highs, mean.select(_counts(mean)).to_numpy()]),
                hovertemplate=f"<b>{task}</b> mean<br>layer %{{x}}: %{{y:.3f}} [%{{customdata[0]:.3f}}, "
                f"%{{customdata[1]:.3f}}] ({_counts_hover(mean, 2)})<extra></extra>",
            ),
            row=1,
            col=1,
        )
    never = num_layers  # examples whose curve never drops below tau (asl's fallback) get their own bar
    for (chosen_tau, task), chosen in selections.group_by("tau", "task", maintain_order=True):
        shown_layer = pl.when(pl.col("fallback")).then(never).otherwise(pl.col("selection_layer"))
        counts = chosen.group_by(shown_layer.alias("selection_layer")).len().sort("selection_layer")
        figure.add_trace(
            go.Bar(
                x=counts["selection_layer"],
                y=counts["len"],
                marker_color=colors[task],
                name=task,
                legendgroup=task,
                showlegend=False,
                visible=math.isclose(chosen_tau, tau),
                meta={"tau": chosen_tau},
                hovertemplate=f"{task}, τ={chosen_tau:g}<br>layer %{{x}}: %{{y}} examples<extra></extra>",
            ),
            row=1,
            col=2,
        )
    figure.add_shape(
        **marker_shape("tau", "y", tau, line={"color": "#c44e52", "width": 1.5, "dash": "dash"}),
        xref="x domain",
        yref="y",
    )
    figure.add_shape(**marker_shape("layer", "x", layer, **LAYER_MARKER), xref="x", yref="y domain")
    ticks = list(range(0, num_layers, 5))
    figure.update_layout(barmode="stack")
    figure.update_xaxes(title_text="layer", row=1, col=1)
    figure.update_xaxes(
        title_text="selection layer",
        tickvals=[*ticks, never],
        ticktext=[*map(str, ticks), "never"],
        range=[-0.5, never + 0.5],
        row=1,
        col=2,
    )
    figure.update_yaxes(title_text="variance / variance at L_min", row=1, col=1)
    figure.update_yaxes(title_text="examples", row=1, col=2)
    return _style(figure, "ASL adaptive selection layer: relative rank variance and where τ stops it", 440)


# -- token-score explorer ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenBins:
    """Rows of token scores pooled into contiguous bins along the token axis.

    Bin b covers token positions ``edges[b]`` to ``edges[b + 1] - 1``; per row it holds the
    highest score in the bin (``score``), the position of that token (``top``) and that
    token's 0-based rank among all the row's tokens (``rank``). With as many bins as tokens
    every value is the token's own. Max pooling keeps a needle visible however wide a bin is,
    and the top token's rank says whether any token of the bin is in the top k.
    """

    edges: np.ndarray  # int64 [B + 1], absolute token positions
    score: np.ndarray  # float32 [R, B]
    top: np.ndarray  # int64 [R, B], absolute token positions
    rank: np.ndarray  # int64 [R, B]

    @property
    def num_tokens(self) -> int:
        return int(self.edges[-1] - self.edges[0])

    @property
    def width(self) -> int:
        return int(self.edges[1] - self.edges[0])


def bin_tokens(values: np.ndarray, *, start: int, max_bins: int) -> TokenBins:
    """Pool ``values`` [R, T] (tokens ``start``..``start + T - 1``) into at most ``max_bins`` equal bins."""
    values = np.atleast_2d(np.asarray(values, dtype=np.float32))
    num_rows, num_tokens = values.shape
    width = math.ceil(num_tokens / min(max_bins, num_tokens))
    num_bins = math.ceil(num_tokens / width)
    padded = np.full((num_rows, num_bins * width), -np.inf, dtype=np.float32)
    padded[:, :num_tokens] = values
    offsets = padded.reshape(num_rows, num_bins, width).argmax(axis=2)
    top = np.arange(num_bins) * width + offsets  # relative to start
    places = descending_ranks(values)
    return TokenBins(
        edges=start + np.minimum(np.arange(num_bins + 1) * width, num_tokens),
        score=np.take_along_axis(values, top, axis=1),
        top=start + top,
        rank=np.take_along_axis(places, top, axis=1),
    )


EXPLORER_HOVER = (
    "layer %{y}<br>tokens %{customdata[0]}–%{customdata[1]}<br>top token #%{customdata[2]}: “%{text}”"
    "<br>rank %{customdata[3]} of %{meta.ranked}<br>score %{customdata[4]:.4g}<extra>%{meta.probe}</extra>"
)
ORACLE_HOVER = (
    "oracle<br>tokens %{customdata[0]}–%{customdata[1]}<br>top token #%{customdata[2]}: “%{text}”"
    "<br>rank %{customdata[3]} of %{meta.ranked}<br>oracle %{customdata[4]:.4g}<extra></extra>"
)
KEPT_HOVER = (
    "tokens %{customdata[0]}–%{customdata[1]}: %{text}<br>(top %{meta.kept_rate} at layer %{meta.kept_layer})"
    "<extra>%{meta.probe}</extra>"
)
KEPT_COLOURS = [[0, "#eeeeee"], [1, "#e4572e"]]
# Numeric rows, not categories: plotly's heatmaps mis-size on a category axis two traces share.
# "kept" sits right above the heatmap (it reads the marked layer), the oracle on top.
STRIP_ROWS = {"kept": 0, "oracle": 1}
EVIDENCE_SHAPE = {"type": "rect", "line": {"color": "#00c2ff", "width": 2}, "fillcolor": "rgba(0,0,0,0)"}
EXPLORER_COLOURS = {"rank": "percentile of the top token's rank", "score": "score (Σ KV heads, max in bin)"}


def display_token(text: str) -> str:
    """A token's text safe inside a plotly hover label: visible whitespace, no markup."""
    shown = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return shown.replace("\n", "⏎").replace("\t", "⇥")


def bins_colour(bins: TokenBins, colour: str) -> np.ndarray:
    """What the heatmap colours by: the score, or 1 for a bin holding the row's top token down to 0."""
    if colour == "score":
        return bins.score
    return 1.0 - bins.rank / max(1, bins.num_tokens - 1)


def kept_columns(bins: TokenBins, layer: int, keep: float) -> np.ndarray:
    """1 for each column holding one of the layer's top-k tokens (k = ``keep_count(keep, T)``), else 0.

    A column's top token has its best rank, so the column holds a kept token iff that rank is below k.
    """
    return (bins.rank[layer] < keep_count(keep, bins.num_tokens)).astype(np.float64)


def _bins_hover(
    bins: TokenBins, token_text: Sequence[str], text_start: int
) -> tuple[np.ndarray, list[list[str]]]:
    first, last = bins.edges[:-1], bins.edges[1:] - 1
    customdata = np.stack(
        np.broadcast_arrays(first, last, bins.top, bins.rank + 1, bins.score.astype(np.float64)), axis=-1
    )
    text = [[token_text[position - text_start] for position in row] for row in bins.top.tolist()]
    return customdata, text


def token_explorer_figure(
    scores: TokenBins,
    oracle: TokenBins | None,
    token_text: Sequence[str],
    *,
    text_start: int,
    evidence: Sequence[Sequence[int]],
    probe: str,
    title: str,
    layer: int,
    keep: float,
    colour: str = "rank",
) -> go.Figure:
    """Layers x tokens heatmap of one probe for one example; above it the oracle and the columns the
    probe's top ``keep`` share at ``layer`` would keep.

    ``scores`` bins the probe's [L, T] head-summed scores, ``oracle`` the oracle's [1, T];
    ``token_text[i]`` is the display text of token ``text_start + i``. Hover names every bin's
    tokens, its top token, that token's rank and score. Evidence spans are outlined.
    """
    figure = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.14, 0.86], vertical_spacing=0.03)
    edges = scores.edges - 0.5  # cell edges between token positions
    meta = {"probe": probe, "ranked": scores.num_tokens}
    # Trace order is fixed (the page redraws all three per example): oracle strip, heatmap, kept
    # strip. Without an oracle its strip is empty.
    strip = {"x": edges, "y": [STRIP_ROWS["oracle"]], "z": [], "meta": meta}
    if oracle is not None:
        customdata, text = _bins_hover(oracle, token_text, text_start)
        strip.update(z=bins_colour(oracle, colour), customdata=customdata, text=text)
    figure.add_trace(
        go.Heatmap(**strip, colorscale="Greys", showscale=False, hovertemplate=ORACLE_HOVER, name="oracle"),
        row=1,
        col=1,
    )
    customdata, text = _bins_hover(scores, token_text, text_start)
    figure.add_trace(
        go.Heatmap(
            x=edges,
            y=np.arange(scores.score.shape[0]),
            z=bins_colour(scores, colour),
            customdata=customdata,
            text=text,
            meta=meta,
            colorscale="Viridis",
            colorbar={"title": {"text": EXPLORER_COLOURS[colour], "side": "right"}, "thickness": 12},
            hovertemplate=EXPLORER_HOVER,
            name=probe,
        ),
        row=2,
        col=1,
    )
    kept = kept_columns(scores, layer, keep)
    figure.add_trace(
        go.Heatmap(
            x=edges,
            y=[STRIP_ROWS["kept"]],
            z=[kept],
            customdata=[np.column_stack([scores.edges[:-1], scores.edges[1:] - 1])],
            text=[["kept" if column else "dropped" for column in kept]],
            meta={"probe": probe, "kept_rate": f"{keep:.0%}", "kept_layer": layer},
            colorscale=KEPT_COLOURS,
            zmin=0,
            zmax=1,
            showscale=False,
            hovertemplate=KEPT_HOVER,
            name="kept",
        ),
        row=1,
        col=1,
    )
    for start, end in evidence:
        for yref in ("y domain", "y2 domain"):
            figure.add_shape(
                **EVIDENCE_SHAPE,
                name="evidence",
                x0=start - 0.5,
                x1=end - 0.5,
                y0=0,
                y1=1,
                xref="x",
                yref=yref,
            )
    figure.add_shape(
        **marker_shape("layer", "y", layer, 0.5, line={"color": "#ff4d4d", "width": 1.5}),
        xref="x2 domain",
        yref="y2",
    )
    binning = "one token per column" if scores.width == 1 else f"{scores.width} tokens per column, max shown"
    figure.update_xaxes(title_text=f"token position (context, {binning})", row=2, col=1)
    figure.update_yaxes(title_text="layer", row=2, col=1)
    figure.update_yaxes(
        tickvals=list(STRIP_ROWS.values()), ticktext=list(STRIP_ROWS), range=[-0.5, 1.5], row=1, col=1
    )
    figure.update_layout(meta={"evidence_shape": EVIDENCE_SHAPE})
    return _style(figure, title, 540)


# -- needle heatmap (CLAA Fig. 3) ----------------------------------------------------------------


def length_bucket(length: int) -> int:
    """A prompt length to two significant figures: niah prompts land a few tokens off their target."""
    digits = max(0, len(str(int(length))) - 2)
    return int(round(length, -digits))


def _length_label(length: int) -> str:
    return f"{length / 1000:.1f}k" if length >= 1000 else str(length)


def needle_frame(bench: pl.DataFrame) -> pl.DataFrame:
    """Each needle metric's mean over examples with its 95% interval and n per method, budget, length
    bucket and depth (rows with a depth only), as the bench's summary takes its means
    (``rankkit.bench.example_means``)."""
    from rankkit.bench import example_means

    rows = bench.filter(pl.col("depth_percent").is_not_null()).with_columns(
        pl.col("length").map_elements(length_bucket, return_dtype=pl.Int64).alias("length_bucket")
    )
    cells = ["method", "budget", "keep", "length_bucket", "depth_percent"]
    return example_means(rows, cells, list(NEEDLE_METRICS.values())).sort(cells)


def needle_figure(
    bench: pl.DataFrame,
    *,
    colors: Mapping[str, str],
    keep: float,
    metric: str = "accuracy",
    cells: pl.DataFrame | None = None,
) -> go.Figure:
    """Depth x length heatmap per method (CLAA Fig. 3) of accuracy or needle recall, for one keep rate;
    a cell's hover gives its interval and n (``cells``: ``needle_frame(bench)`` when the caller has it).

    Traces are tagged with ``keep`` and ``needle_metric`` (both filters); a method's rows at keep 1
    (``full``'s, under whatever name a page of several runs gives it) carry no keep tag and show
    beside every keep rate.
    """
    cells = needle_frame(bench) if cells is None else cells
    unpruned = {name for name, keeps in cells.group_by("method").agg("keep").iter_rows() if min(keeps) == 1.0}
    methods = sorted(cells["method"].unique(), key=lambda name: (name not in unpruned, name))
    rows, columns = _grid(len(methods), 4)
    figure = make_subplots(
        rows=rows,
        cols=columns,
        subplot_titles=[f"<span style='color:{colors[name]}'>■</span> {name}" for name in methods],
        shared_yaxes=True,
        horizontal_spacing=0.03,
        vertical_spacing=0.18 if rows > 1 else 0.1,
    )
    lengths = sorted(cells["length_bucket"].unique())
    first_trace = True
    for index, method in enumerate(methods):
        row, column = divmod(index, columns)
        method_cells = cells.filter(pl.col("method") == method)
        for trace_keep in sorted(method_cells["keep"].unique()):
            tag_keep = trace_keep < 1.0
            for name, column_name in NEEDLE_METRICS.items():
                meta = {"needle_metric": name, **({"keep": trace_keep} if tag_keep else {})}
                heatmap = _mean_heatmap(
                    method_cells.filter(pl.col("keep") == trace_keep), "depth_percent", "length_bucket",
                    column_name, name, f"<b>{method}</b>, keep {trace_keep:g}<br>length %{{x}}, depth %{{y}}",
                    columns=lengths,
                    showscale=first_trace,
                    visible=name == metric and (not tag_keep or math.isclose(trace_keep, keep)),
                    meta=meta,
                    name=f"{method} keep {trace_keep:g}",
                )  # fmt: skip
                heatmap.update(
                    x=[_length_label(length) for length in heatmap.x], y=[f"{depth:g}%" for depth in heatmap.y]
                )
                figure.add_trace(heatmap, row=row + 1, col=column + 1)
                first_trace = False
    figure.update_xaxes(title_text="prompt length (tokens)", type="category")
    figure.update_yaxes(title_text="needle depth", col=1)
    figure.update_yaxes(type="category", autorange="reversed")
    return _style(figure, "Needle in a haystack: depth x length per method (CLAA Fig. 3)", 300 * rows + 110)


def needle_recall_frame(per_layer: pl.DataFrame) -> pl.DataFrame:
    """Mean needle recall over the examples that have evidence with its 95% interval and n, per keep
    the rankings were made under, needle keep, method and layer, from ``CompareResult.per_layer``
    frames of one or more keeps (``compare_keeps``): compare's own curve (``example_means``), each
    keep's apart, as a keep-dependent method ranks otherwise at each. Methods whose rankings are one
    (``curve_labels``, the Spearman plot's rule) are one row, named together."""
    from rankkit.eval.compare import example_means

    labels = curve_labels(per_layer)
    rows = (
        per_layer.with_columns(pl.col("method").cast(pl.String))
        .filter(pl.col("method").is_in(list(labels)))
        .with_columns(pl.col("method").replace_strict(labels))
    )
    means = example_means(rows, ["keep", "needle_keep", "method", "layer"], ["needle_recall"])
    # a group no example has evidence in has no mean to draw
    return means.filter(pl.col("needle_recall").is_not_null()).sort("keep", "needle_keep", "method", "layer")


def _grids(
    cells: pl.DataFrame, index: str, on: str, values: Sequence[str], columns: Sequence | None = None
) -> tuple[list, list, np.ndarray]:
    """``cells``' ``values`` as heatmap grids: the sorted values of ``index`` (rows) and of ``on``
    (columns, or ``columns`` where subplots share them), and a [len(values), rows, columns] array,
    NaN where no cell is."""
    rows = sorted(cells[index].unique())
    columns = sorted(cells[on].unique()) if columns is None else list(columns)
    grids = np.full((len(values), len(rows), len(columns)), np.nan)
    at_row = cells[index].replace_strict(rows, list(range(len(rows))), return_dtype=pl.Int64).to_numpy()
    at_column = cells[on].replace_strict(columns, list(range(len(columns))), return_dtype=pl.Int64).to_numpy()
    grids[:, at_row, at_column] = cells.select(pl.col(values).cast(pl.Float64).fill_null(np.nan)).to_numpy().T
    return rows, columns, grids


def _mean_heatmap(
    cells: pl.DataFrame,
    index: str,
    on: str,
    metric: str,
    label: str,
    where: str,
    *,
    columns: Sequence | None = None,
    **style,
) -> go.Heatmap:
    """A heatmap of ``cells``' mean ``metric`` (a ``mean_intervals`` frame) over ``index`` x ``on``
    (``_grids``), each cell's hover giving the mean with its 95% interval and n (``label`` names the
    metric, ``where`` is markup heading the hover)."""
    values = [metric, *interval_columns(metric), *_counts(cells)]
    rows, columns, grids = _grids(cells, index, on, values, columns)
    return go.Heatmap(
        x=columns,
        y=rows,
        z=grids[0],
        customdata=np.moveaxis(grids[1:], 0, -1),
        zmin=0,
        zmax=1,
        colorscale="RdYlGn",
        colorbar={"title": {"text": "mean over examples"}, "thickness": 12},
        xgap=1,
        ygap=1,
        hovertemplate=f"{where}<br>{label} %{{z:.2f}} [%{{customdata[0]:.2f}}, %{{customdata[1]:.2f}}] "
        f"({_counts_hover(cells, 2)})<extra></extra>",
        **style,
    )


def needle_recall_figure(cells: pl.DataFrame) -> go.Figure:
    """Method x layer heatmap of ``needle_recall_frame``'s mean needle recall, one per keep the
    rankings were made under and needle keep, each titled with both; a cell's hover gives its
    interval and n."""
    budgets = cells.select("keep", "needle_keep").unique().sort("keep", "needle_keep").rows()
    shares = [(Budget.parse(keep).share, Budget.parse(needle_keep).share) for keep, needle_keep in budgets]
    methods = sorted(cells["method"].unique())
    figure = make_subplots(
        rows=len(budgets),
        cols=1,
        subplot_titles=[
            f"ranked under keep {ranked}: needle recall in each method's top {counted}" for ranked, counted in shares
        ],
        vertical_spacing=0.12 if len(budgets) > 1 else 0.1,
    )
    for index, ((keep, needle_keep), (ranked, counted)) in enumerate(zip(budgets, shares, strict=True)):
        shown = cells.filter((pl.col("keep") == keep) & (pl.col("needle_keep") == needle_keep))
        figure.add_trace(
            _mean_heatmap(
                shown, "method", "layer", "needle_recall", "needle recall",
                f"<b>%{{y}}</b>, ranked under keep {ranked}, top {counted}<br>layer %{{x}}",
                showscale=index == 0,
                name=f"keep {keep:g}, needle keep {needle_keep:g}",
                meta={"ranked_keep": keep, "needle_keep": needle_keep},
            ),
            row=index + 1,
            col=1,
        )  # fmt: skip
    figure.update_xaxes(title_text="layer")
    figure.update_yaxes(type="category", categoryorder="array", categoryarray=methods[::-1])
    return _style(
        figure, "Needle recall per layer at each keep rate", (24 * len(methods) + 90) * len(budgets) + 80
    )


# -- accuracy vs TTFT (CLAA Fig. 4) ---------------------------------------------------------------


def tradeoff_frame(bench: pl.DataFrame) -> pl.DataFrame:
    """One point per method and budget: ``rankkit.bench.summary``'s mean accuracy and TTFT ratio to
    full with their 95% intervals, where both are defined."""
    from rankkit.bench import summary

    return (
        summary(bench)
        .filter(pl.col("accuracy").is_not_null() & pl.col("ttft_ratio").is_not_null())
        .sort("method", "keep")
    )


def _error_bars(points: pl.DataFrame, metric: str) -> dict:
    """Plotly's asymmetric error bars from a metric's interval columns (none where it has no interval)."""
    low, high = interval_columns(metric)
    mean = points[metric].to_numpy()
    return {
        "type": "data",
        "symmetric": False,
        "array": (points[high].fill_null(np.nan).to_numpy() - mean).tolist(),
        "arrayminus": (mean - points[low].fill_null(np.nan).to_numpy()).tolist(),
        "thickness": 1,
        "width": 3,
    }


def pareto_front(points: pl.DataFrame, *, cost: str = "ttft_ratio", value: str = "accuracy") -> pl.DataFrame:
    """The rows no other row dominates (no more ``cost`` and no less ``value``, better in one), by cost."""
    ordered = points.sort([cost, value], descending=[False, True])
    best_value = -math.inf
    keep = []
    for row_value in ordered[value].to_list():
        # Sorted by cost, then by value descending: a row is on the front iff it beats every cheaper one.
        keep.append(row_value > best_value)
        best_value = max(best_value, row_value)
    return ordered.filter(pl.Series(keep))


def tradeoff_numbers(bench: pl.DataFrame) -> pl.DataFrame:
    """Every point ``tradeoff_figure`` draws, with its intervals and n."""
    return tradeoff_frame(bench).select(
        "method", "budget", "accuracy", *interval_columns("accuracy"), "ttft_ratio", *interval_columns("ttft_ratio"),
        "ideal_ratio", *interval_columns("ideal_ratio"), "n_examples",
    )  # fmt: skip


def tradeoff_figure(bench: pl.DataFrame, *, colors: Mapping[str, str]) -> go.Figure:
    """Accuracy vs TTFT ratio, one point per method and keep rate with 95% interval bars, and the Pareto front."""
    points = tradeoff_frame(bench)
    figure = go.Figure()
    for method in sorted(points["method"].unique(), key=lambda name: (name != FULL, name)):
        method_points = points.filter(pl.col("method") == method).sort("ttft_ratio")
        figure.add_trace(
            go.Scatter(
                x=method_points["ttft_ratio"],
                y=method_points["accuracy"],
                mode="lines+markers+text",
                text=[f"{keep:.0%}" if method != FULL else "" for keep in method_points["keep"]],
                textposition="top center",
                textfont={"size": 10, "color": colors[method]},
                marker={
                    "size": 10,
                    "color": colors[method],
                    "symbol": "square" if method == FULL else "circle",
                },
                line={"color": colors[method], "width": 1.5},
                error_x=_error_bars(method_points, "ttft_ratio"),
                error_y=_error_bars(method_points, "accuracy"),
                name=method,
                customdata=method_points.select(
                    "keep",
                    "ideal_ratio",
                    "n_examples",
                    *interval_columns("accuracy"),
                    *interval_columns("ttft_ratio"),
                ).to_numpy(),
                hovertemplate=f"<b>{method}</b> keep %{{customdata[0]:.0%}}<br>TTFT ratio %{{x:.3f}} "
                "[%{customdata[5]:.3f}, %{customdata[6]:.3f}] (ideal %{customdata[1]:.3f})<br>accuracy %{y:.3f} "
                "[%{customdata[3]:.3f}, %{customdata[4]:.3f}], n = %{customdata[2]}<extra></extra>",
            )
        )
    front = pareto_front(points)
    figure.add_trace(
        go.Scatter(
            x=front["ttft_ratio"],
            y=front["accuracy"],
            mode="lines+markers",
            line={"color": "#222222", "width": 1, "dash": "dash", "shape": "hv"},
            marker={"size": 18, "symbol": "circle-open", "color": "#222222", "line": {"width": 1.5}},
            name="Pareto front",
            customdata=front.select("method", "keep").to_numpy(),
            hovertemplate="Pareto front: %{customdata[0]} keep %{customdata[1]:.0%}<extra></extra>",
        )
    )
    figure.update_xaxes(title_text="TTFT / full-prefill TTFT (lower is faster)")
    figure.update_yaxes(title_text="accuracy (mean score)")
    return _style(figure, "Accuracy vs time to first token, per method and keep rate (CLAA Fig. 4)", 460)


# -- information diffusion (SlimInfer Fig. 2) ---------------------------------------------------


def diffusion_figure(diffusion: pl.DataFrame, *, layer: int, metric: str) -> go.Figure:
    """Top: share of examples answered correctly when the evidence is removed from each layer on.
    Bottom: a metric of the answer per example (faint; the picked one bold) and its mean over
    examples, each metric's traces tagged ``diffusion_metric``. Means and their 95% intervals
    are ``rankkit.eval.diffusion.layer_summary``'s."""
    frame = diffusion.with_columns(pl.col("example").cast(pl.String)).sort("example", "layer")
    metrics = [name for name in DIFFUSION_METRICS if name in frame.columns]
    figure = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        row_heights=[0.4, 0.6],
        vertical_spacing=0.08,
        subplot_titles=["answer still correct", "answer under pruning"],
    )
    from rankkit.eval.diffusion import layer_summary

    means = layer_summary(frame)
    layers = means["layer"].to_list()
    figure.add_trace(
        go.Scatter(
            x=layers,
            y=means["correct"],
            mode="lines+markers",
            line={"color": "#2ca02c", "width": 2},
            error_y=_error_bars(means, "correct"),
            name="share correct",
            customdata=means.select("n_examples", *interval_columns("correct")).to_numpy(),
            hovertemplate="pruned from layer %{x}<br>%{y:.0%} [%{customdata[1]:.0%}, %{customdata[2]:.0%}] "
            "of %{customdata[0]} examples correct<extra></extra>",
        ),
        row=1,
        col=1,
    )
    for name in metrics:
        for trace in example_curves(
            frame, name, color="#4c72b0", label=DIFFUSION_METRICS[name], meta={"diffusion_metric": name}
        ):
            figure.add_trace(
                trace.update(visible=name == metric and trace.visible is not False), row=2, col=1
            )
        label, tag = f"mean {DIFFUSION_METRICS[name]}", {"diffusion_metric": name}
        lows, highs = (means[column].fill_null(np.nan).to_numpy() for column in interval_columns(name))
        band = _interval_band(layers, lows, highs, color="#111111", group=label)
        figure.add_trace(band.update(visible=name == metric, meta=tag), row=2, col=1)
        figure.add_trace(
            go.Scatter(
                x=layers,
                y=means[name],
                mode="lines",
                line={"color": "#111111", "width": 3},
                name=label,
                legendgroup=label,
                visible=name == metric,
                meta=tag,
                customdata=means.select(*interval_columns(name)).to_numpy(),
                hovertemplate=f"{label}<br>layer %{{x}}: %{{y:.3f}} [%{{customdata[0]:.3f}}, "
                "%{customdata[1]:.3f}]<extra></extra>",
            ),
            row=2,
            col=1,
        )
    _add_shape_to_subplots(
        figure, marker_shape("layer", "x", layer, **LAYER_MARKER), [("x", "y"), ("x2", "y2")]
    )
    figure.update_xaxes(
        title_text="layer l from which the evidence tokens' hidden states are removed", row=2, col=1
    )
    figure.update_yaxes(title_text="share of examples", tickformat=".0%", range=[-0.05, 1.05], row=1, col=1)
    figure.update_yaxes(title_text="value (pick with “diffusion metric”)", row=2, col=1)
    return _style(figure, "Information diffusion: pruning the evidence at layer l (SlimInfer Fig. 2)", 520)
