"""The dashboard: each figure builder on small frames with known values, the page's inputs and
errors, the CLI, and the rendered page in headless Chromium (JavaScript errors, every panel drawn)."""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import numpy as np
import plotly.offline
import polars as pl
import pytest
from browser import find_chromium, open_in_chromium
from hypothesis import given, settings
from hypothesis import strategies as st

from rankkit import stores
from rankkit.errors import RankkitError
from rankkit.eval.diffusion import layer_summary
from rankkit.eval.stats import interval_columns, wilson_interval
from rankkit.methods import Budget
from rankkit.report import figures, html, write_dashboard

LAYERS, HEADS = 6, 2
PROBES = ("window", "window:w=32", "last_token_raw", "lava")


def write_synthetic_store(
    path: Path,
    *,
    examples: int = 4,
    tokens: int = 120,
    layers: int = LAYERS,
    heads: int = HEADS,
    probes=PROBES,
    oracle: bool = True,
    seed: int = 0,
    model: dict | None = None,
    group: int = 1,
) -> Path:
    """Examples whose probes agree more with the oracle layer by layer; the oracle peaks on the needle.

    ``heads`` KV heads of ``group`` query heads each, recorded as a capture records them:
    ``last_token_heads`` holds a row per query head."""
    from rankkit import stores

    rng = np.random.default_rng(seed)
    writer = stores.create(
        path, {"model": model or {"id": "synthetic"}, "kv_heads": heads, "num_attention_heads": heads * group}
    )
    context = (8, tokens - 12)
    for index in range(examples):
        depth = [0.0, 50.0, 100.0][index % 3]
        needle_start = context[0] + int((context[1] - context[0] - 6) * depth / 100)
        truth = rng.random(tokens).astype(np.float32)
        truth[needle_start : needle_start + 6] += 5
        agreement = np.linspace(0.1, 0.9, layers)[:, None, None]
        rows = {probe: heads * group if probe == "last_token_heads" else heads for probe in probes}
        scores = {
            probe: (agreement * truth + (1 - agreement) * 5 * rng.random((layers, rows[probe], tokens))).astype(
                np.float32
            )
            for probe in probes
        }
        attrs = {
            "task": "niah" if index % 2 == 0 else "qa",
            "answers": ["68247"],
            "meta": {"depth_percent": depth, "length": tokens},
            # token 10's text would end the page's <script> element if it were not escaped
            "token_text": [f"w{position}" if position != 10 else "</script>\n" for position in range(tokens)],
            "spans": {"context_tokens": list(context), "evidence_tokens": [[needle_start, needle_start + 6]]},
        }
        example_id = f"ex{index}"
        writer.write_example(example_id, attrs=attrs, tokens=np.arange(tokens), scores=scores)
        if oracle:
            layered = np.tile(truth, (layers, 1))
            writer.add_oracle(
                example_id, oracle=truth, oracle_layers=layered, attrs={"correct": float(index % 3 != 1)}
            )
    return path


def bench_frame() -> pl.DataFrame:
    """A bench grid: full once per example, then every method at three keep rates."""
    rows = []
    for example, (length, depth) in enumerate(itertools.product((1019, 2041), (0.0, 50.0, 100.0))):
        rows.append(_bench_row(example, length, depth, "full", 1.0, 1.0, 1.0))
        for method, keep in itertools.product(("gemfilter", "fastkv", "claa"), (0.1, 0.2, 0.4)):
            quality = {"gemfilter": 0.5, "fastkv": 0.7, "claa": 0.8}[method] + keep / 2
            score = float((example * 7 + int(keep * 10)) % 10 < quality * 10)
            ttft = 0.2 + keep + (0.1 if method == "claa" else 0.0)
            rows.append(_bench_row(example, length, depth, method, keep, score, ttft))
    return pl.DataFrame(rows)


def _bench_row(
    example: int, length: int, depth: float, method: str, keep: float, score: float, ttft: float
) -> dict:
    return {
        "example_id": f"niah-{example}",
        "task": "niah",
        "length": length,
        "depth_percent": depth,
        "method": method,
        "keep": keep,
        "budget": f"keep={keep:g}",
        "score": score,
        "ttft_ratio": ttft,
        "tpot_ratio": 0.5 + keep,
        "kv_ratio": keep,
        "ideal_ratio": ttft * 0.9,
        "ttft_s": ttft * 2,
        "tpot_s": 0.01,
        "kv_bytes": int(keep * 1e6),
        "peak_mem_bytes": int(1e8),
        "evidence_kept": None if method == "full" else min(1.0, keep * 3),
    }


def diffusion_frame(examples: int = 4, layers: int = LAYERS) -> pl.DataFrame:
    """Rows as `rankkit diffusion --out` writes them: layer 0..L, where L removes nothing and has no attention."""
    rows = [
        {
            "example": f"ex{example}",
            "layer": layer,
            "correct": layer >= 2 + example % 2,
            "score": float(layer >= 2 + example % 2),
            "answer_logprob": -3.0 / (layer + 1) - example * 0.1,
            "first_token_kl": 1.0 / (layer + 1),
            "evidence_attention": layer / layers if layer < layers else None,
            "prediction": "68247",
        }
        for example in range(examples)
        for layer in range(layers + 1)
    ]
    return pl.DataFrame(rows)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return write_synthetic_store(tmp_path_factory.mktemp("dashboard") / "run.zarr")


# -- figure builders ---------------------------------------------------------------------------


def test_method_colors_keep_the_papers_methods_fixed_and_the_rest_stable():
    colors = figures.method_colors(["claa", "window", "lava", "full"])
    assert colors["claa"] == figures.KNOWN_METHOD_COLORS["claa"]
    assert colors["full"] == figures.KNOWN_METHOD_COLORS["full"]
    assert colors == figures.method_colors(["lava", "window", "full", "claa"])
    assert len(set(colors.values())) == 4


def _two_tasks_per_layer() -> pl.DataFrame:
    """Spearman per example and layer: fastkv and window alike in task t1, fastkv alone in t2."""
    return pl.DataFrame(
        {
            "example_id": ["a", "a", "b", "b", "a", "a", "b", "b", "c", "c"],
            "task": ["t1"] * 8 + ["t2"] * 2,
            "method": ["fastkv"] * 4 + ["window"] * 4 + ["fastkv"] * 2,
            "layer": [0, 1, 0, 1] * 2 + [0, 1],
            "spearman": [0.1, 0.5, 0.3, 0.9, 0.1, 0.5, 0.3, 0.9, 0.2, 0.4],
        }
    )


def test_spearman_figure_draws_mean_and_sd_per_task_and_method():
    per_layer = _two_tasks_per_layer()
    figure = figures.spearman_figure(per_layer, pruning_layer=1, colors=figures.method_colors(["fastkv"]))
    lines = [trace for trace in figure.data if trace.mode == "lines"]
    # window ranks exactly like fastkv: drawn once, named with both (task t2 has fastkv alone)
    assert [trace.name for trace in lines] == ["fastkv = window", "fastkv"]
    np.testing.assert_allclose(lines[0].y, [0.2, 0.7])
    np.testing.assert_allclose(lines[1].y, [0.2, 0.4])
    band = next(trace for trace in figure.data if trace.fill == "toself")
    np.testing.assert_allclose(band.y, [0.3, 0.9, 0.5, 0.1])  # mean ± population sd, out and back
    assert [annotation.text for annotation in figure.layout.annotations] == ["task: t1", "task: t2"]
    assert [shape.x0 for shape in figure.layout.shapes] == [1, 1]
    assert {shape.name for shape in figure.layout.shapes} == {"layer:x:0"}


def test_the_numbers_under_the_spearman_plot_are_its_points_with_intervals_and_n():
    per_layer = _two_tasks_per_layer()
    numbers = figures.spearman_numbers(per_layer)
    assert numbers.columns == ["task", "method", "layer", "spearman", "spearman_ci_low", "spearman_ci_high",
                               "n_examples"]  # fmt: skip
    assert numbers.select("task", "method", "layer", "n_examples").rows() == [
        ("t1", "fastkv = window", 0, 2), ("t1", "fastkv = window", 1, 2), ("t2", "fastkv", 0, 1), ("t2", "fastkv", 1, 1),
    ]  # fmt: skip
    np.testing.assert_allclose(numbers["spearman"], [0.2, 0.7, 0.2, 0.4])
    assert numbers["spearman_ci_low"][2] is None  # one example gives no interval


def test_spearman_curves_resample_clusters_as_compares_curve_does():
    """Twelve examples, two needles of six: the examples of a needle are one sample. With two equal
    clusters a resample is needle a twice, b twice or one each, so the 95% interval runs from a's mean
    to b's; resampling the twelve examples alone gives a band a third as wide."""
    from rankkit.eval.compare import METRIC_COLUMNS, curve_frame

    per_layer = pl.DataFrame(
        {
            "example_id": [f"e{index}" for index in range(12)],
            "task": ["niah"] * 12,
            "method": ["claa"] * 12,
            "layer": [0] * 12,
            **{name: [None] * 12 for name in METRIC_COLUMNS},
            "spearman": [(0.2 if index < 6 else 0.8) + 0.01 * (index % 6) for index in range(12)],
            "cluster": ["needle-a"] * 6 + ["needle-b"] * 6,
        },
        schema_overrides=dict.fromkeys(METRIC_COLUMNS, pl.Float64),
    )
    numbers = figures.spearman_numbers(per_layer)
    low, high = interval_columns("spearman")
    assert numbers.select("spearman", low, high, "n_examples", "n_clusters").rows() == [
        (pytest.approx(0.525), pytest.approx(0.225, abs=1e-6), pytest.approx(0.825, abs=1e-6), 12, 2)
    ]
    compared = curve_frame(per_layer).select("spearman", low, high, "n_examples", "n_clusters")
    assert numbers.select(compared.columns).rows() == compared.rows()
    figure = figures.spearman_figure(per_layer, pruning_layer=0, colors=figures.method_colors(["claa"]))
    line = next(trace for trace in figure.data if trace.mode == "lines")
    np.testing.assert_allclose(line.customdata[0], [0.225, 0.825, 12, 2], atol=1e-6)
    assert "(n = %{customdata[2]} examples in %{customdata[3]} clusters)" in line.hovertemplate


def test_spearman_curves_refuse_rankings_of_two_keeps():
    per_layer = _two_tasks_per_layer()
    both = pl.concat([per_layer.with_columns(keep=pl.lit(keep)) for keep in (0.1, 0.4)])
    with pytest.raises(ValueError, match="keeps"):
        figures.spearman_stats(both)


def test_numbers_table_sorts_by_full_values_and_shows_missing_ones_as_a_dash():
    from rankkit.report.html import _numbers_html

    table = _numbers_html(pl.DataFrame({"method": ["claa<"], "rho": [0.123456], "low": [None], "n": [8]},
                                       schema={"method": pl.String, "rho": pl.Float64, "low": pl.Float64, "n": pl.Int64}))  # fmt: skip
    assert table == (
        '<details class="numbers"><summary>The numbers: 1 rows (click a column to sort)</summary>'
        '<table class="numbers sortable"><thead><tr><th>method</th><th>rho</th><th>low</th><th>n</th></tr></thead>'
        '<tbody><tr><td>claa&lt;</td><td data-value="0.123456">0.123</td><td data-value="NaN">–</td>'
        '<td data-value="8">8</td></tr></tbody></table></details>'
    )


def test_variance_figure_counts_selection_layers_per_tau_with_a_never_bar():
    curves = pl.DataFrame(
        {
            "example": ["a"] * 3 + ["b"] * 3,
            "task": ["t"] * 6,
            "probe": ["window"] * 6,
            "layer": [0, 1, 2] * 2,
            "relative_variance": [None, 1.0, 0.2, None, 1.0, 0.5],
        }
    )
    selections = pl.DataFrame(
        {
            "example": ["a", "b", "a", "b"],
            "task": ["t"] * 4,
            "probe": ["window"] * 4,
            "tau": [0.3, 0.3, 0.6, 0.6],
            "selection_layer": [2, 2, 2, 2],
            "fallback": [False, True, False, False],  # b never drops below 0.3: asl's last layer
        },
        schema_overrides={"selection_layer": pl.Int32},
    )
    from rankkit.eval.variance import mean_curves

    figure = figures.variance_figure(curves, selections, mean_curves(curves), tau=0.3, layer=1, num_layers=3)
    examples = [trace for trace in figure.data if trace.meta and "example" in trace.meta]
    assert [list(trace.y) for trace in examples] == [[1.0, 0.2], [1.0, 0.5]]
    mean = next(
        trace for trace in figure.data if trace.name == "t" and trace.type == "scatter" and not trace.meta
    )
    np.testing.assert_allclose(mean.y, [1.0, 0.35])
    bars = {trace.meta["tau"]: trace for trace in figure.data if trace.type == "bar"}
    assert (list(bars[0.3].x), list(bars[0.3].y), bars[0.3].visible) == ([2, 3], [1, 1], True)  # 3 = "never"
    assert (list(bars[0.6].x), list(bars[0.6].y), bars[0.6].visible) == ([2], [2], False)
    tau_line = next(shape for shape in figure.layout.shapes if shape.name.startswith("tau"))
    assert (tau_line.y0, tau_line.y1) == (0.3, 0.3)


def test_bin_tokens_keeps_each_bins_top_token_and_its_exact_rank():
    values = np.array([[1.0, 5.0, 2.0, 0.0, 3.0], [9.0, 8.0, 7.0, 6.0, 5.0]], dtype=np.float32)
    bins = figures.bin_tokens(values, start=10, max_bins=2)
    assert bins.edges.tolist() == [10, 13, 15]
    np.testing.assert_array_equal(bins.score, [[5.0, 3.0], [9.0, 6.0]])
    np.testing.assert_array_equal(bins.top, [[11, 14], [10, 13]])
    np.testing.assert_array_equal(bins.rank, [[0, 1], [0, 3]])
    unpooled = figures.bin_tokens(values, start=0, max_bins=100)
    np.testing.assert_array_equal(unpooled.score, values)
    np.testing.assert_array_equal(unpooled.top, np.tile(np.arange(5), (2, 1)))


def test_explorer_heatmap_is_the_stores_head_summed_scores_over_the_context(store):
    from rankkit import stores

    record = stores.open(store).example("ex1")
    start, end = record.attrs["spans"]["context_tokens"]
    expected = record.scores("lava")[..., start:end].sum(axis=1)
    bins = figures.bin_tokens(expected, start=start, max_bins=10_000)
    oracle = figures.bin_tokens(record.oracle[start:end], start=start, max_bins=10_000)
    texts = record.attrs["token_text"][start:end]
    figure = figures.token_explorer_figure(
        bins,
        oracle,
        texts,
        text_start=start,
        evidence=[[30, 36]],
        probe="lava",
        title="ex1",
        layer=2,
        keep=0.1,
        colour="score",
    )
    strip, heatmap, kept = figure.data
    np.testing.assert_array_equal(np.asarray(heatmap.z), expected)
    np.testing.assert_array_equal(np.asarray(strip.z), record.oracle[np.newaxis, start:end])
    token = 40
    customdata = np.asarray(heatmap.customdata)[3, token - start]
    rank = int((expected[3] > expected[3, token - start]).sum()) + 1
    assert customdata[:4].tolist() == [token, token, token, rank]
    assert heatmap.text[3][token - start] == "w40"
    evidence = [shape for shape in figure.layout.shapes if shape.name == "evidence"]
    assert [(shape.x0, shape.x1) for shape in evidence] == [(29.5, 35.5)] * 2
    # The kept strip marks the layer's top 10% of the context: exactly k tokens without pooling.
    top_k = np.argsort(-expected[2], kind="stable")[: int(0.1 * (end - start))]
    np.testing.assert_array_equal(np.flatnonzero(kept.z[0]), np.sort(top_k))
    assert kept.meta["kept_rate"] == "10%" and kept.meta["kept_layer"] == 2
    by_rank = figures.token_explorer_figure(
        bins,
        oracle,
        texts,
        text_start=start,
        evidence=[],
        probe="lava",
        title="ex1",
        layer=2,
        keep=0.1,
        colour="rank",
    )
    assert np.asarray(by_rank.data[1].z)[3].max() == 1.0  # the layer's top token


def test_kept_columns_holds_a_column_iff_one_of_its_tokens_is_in_the_top_k():
    values = np.array([[1.0, 5.0, 2.0, 0.0, 3.0, 4.0]], dtype=np.float32)  # top 2: tokens 1 and 5
    pooled = figures.bin_tokens(values, start=0, max_bins=3)  # columns {0,1} {2,3} {4,5}
    np.testing.assert_array_equal(figures.kept_columns(pooled, 0, 2 / 6), [1, 0, 1])


def test_needle_recall_heatmaps_are_means_over_examples_with_evidence_one_per_keep():
    per_layer = pl.DataFrame(
        {
            "example_id": ["a", "b", "c", "a", "b", "a", "b", "a"],
            "method": ["claa", "claa", "claa", "claa", "claa", "fastkv", "fastkv", "claa"],
            "layer": [0, 0, 0, 1, 1, 0, 0, 0],
            "needle_recall": [0.5, 1.0, None, 0.25, 0.75, 0.0, 0.5, 1.0],
            "keep": [0.1] * 7 + [0.2],
            "needle_keep": [0.1] * 7 + [0.2],
        }
    )
    cells = figures.needle_recall_frame(per_layer)
    assert cells.select("keep", "needle_keep", "method", "layer", "needle_recall", "n_examples").rows() == [
        (0.1, 0.1, "claa", 0, 0.75, 2),  # example c has no evidence: left out, not counted as 0
        (0.1, 0.1, "claa", 1, 0.5, 2),
        (0.1, 0.1, "fastkv", 0, 0.25, 2),
        (0.2, 0.2, "claa", 0, 1.0, 1),
    ]
    figure = figures.needle_recall_figure(cells)
    titles = [annotation.text for annotation in figure.layout.annotations]
    assert titles == [
        "ranked under keep 10%: needle recall in each method's top 10%",
        "ranked under keep 20%: needle recall in each method's top 20%",
    ]
    first, second = figure.data
    assert (list(first.x), list(first.y)) == ([0, 1], ["claa", "fastkv"])
    np.testing.assert_array_equal(first.z, [[0.75, 0.5], [0.25, np.nan]])
    assert (list(second.y), second.meta) == (["claa"], {"ranked_keep": 0.2, "needle_keep": 0.2})
    np.testing.assert_array_equal(second.z, [[1.0]])


def _clustered_needle_rows(keep: float, recalls: list[float]) -> pl.DataFrame:
    """compare's rows of one keep: claa's needle recall at layer 3 of six examples, a needle to each half."""
    from rankkit.eval.compare import METRIC_COLUMNS

    return pl.DataFrame(
        {
            "example_id": [f"e{index}" for index in range(6)],
            "task": ["niah"] * 6,
            "method": ["claa"] * 6,
            "layer": [3] * 6,
            **{name: [None] * 6 for name in METRIC_COLUMNS},
            "spearman": [0.5] * 6,
            "needle_recall": recalls,
            "cluster": ["needle-a"] * 3 + ["needle-b"] * 3,
            "keep": [keep] * 6,
            "needle_keep": [0.1] * 6,
        },
        schema_overrides=dict.fromkeys(METRIC_COLUMNS, pl.Float64),
    )


def test_needle_recall_keeps_each_keeps_rankings_apart_with_compares_clustered_interval():
    """Two keeps counting in one needle keep are two means, each over its own examples, not one over both;
    each interval is compare's own, resampling the two needles: with two clusters of three, a resample
    is needle a twice, b twice or one each, so the 95% interval runs from a's mean to b's."""
    from rankkit.eval.compare import curve_frame

    tight = _clustered_needle_rows(0.1, [0.1, 0.2, 0.3, 0.5, 0.6, 0.7])
    loose = _clustered_needle_rows(0.4, [1.0] * 6)
    cells = figures.needle_recall_frame(pl.concat([tight, loose]))
    low, high = interval_columns("needle_recall")
    assert cells.select("keep", "needle_recall", low, high, "n_examples", "n_clusters").rows() == [
        (0.1, pytest.approx(0.4), pytest.approx(0.2, abs=1e-6), pytest.approx(0.6, abs=1e-6), 6, 2),
        (0.4, 1.0, *(pytest.approx(bound) for bound in _wilson(2, 2)), 6, 2),  # a collapsed share: Wilson's
    ]
    for keep, rows in ((0.1, tight), (0.4, loose)):
        compared = curve_frame(rows).select("needle_recall", low, high, "n_examples", "n_clusters")
        assert cells.filter(pl.col("keep") == keep).select(compared.columns).rows() == compared.rows()
    (trace,) = figures.needle_recall_figure(cells.filter(pl.col("keep") == 0.1)).data
    np.testing.assert_allclose(trace.customdata[0][0], [0.2, 0.6, 6, 2], atol=1e-6)  # the hover's interval, n
    assert "examples in %{customdata[3]} clusters" in trace.hovertemplate


def _wilson(successes: int, samples: int) -> tuple[float, float]:
    """scipy's Wilson interval: what a collapsed share gets over its independent samples."""
    from scipy import stats

    interval = stats.binomtest(successes, samples).proportion_ci(method="wilson")
    return interval.low, interval.high


def test_methods_of_one_ranking_are_one_needle_recall_row_named_as_in_the_spearman_plot():
    # fastkv ranks by the window probe: the same Spearman and needle recall everywhere; claa differs
    examples, layers, keeps = ["a", "b"], [0, 1], [0.1, 0.2]
    cells = list(itertools.product(examples, layers, keeps))
    per_layer = pl.DataFrame(
        {
            "task": ["niah"] * 3 * len(cells),
            "example_id": [example for _ in range(3) for example, _, _ in cells],
            "method": [method for method in ("window", "fastkv", "claa") for _ in cells],
            "layer": [layer for _ in range(3) for _, layer, _ in cells],
            "keep": [keep for _ in range(3) for _, _, keep in cells],
            "needle_keep": [keep for _ in range(3) for _, _, keep in cells],
            "spearman": [0.1 * layer + (0.3 if method == "claa" else 0.0)
                         for method in ("window", "fastkv", "claa") for _, layer, _ in cells],
            "needle_recall": [keep * 2 + 0.25 * layer + (0.1 if method == "claa" and example == "b" else 0.0)
                              for method in ("window", "fastkv", "claa") for example, layer, keep in cells],
        }
    )  # fmt: skip
    assert figures.curve_labels(per_layer) == {"claa": "claa", "fastkv": "fastkv = window"}
    frame = figures.needle_recall_frame(per_layer)
    shown = frame.filter(pl.col("needle_keep") == 0.2).select("method", "layer", "needle_recall", "n_examples")
    assert shown.rows() == [
        ("claa", 0, pytest.approx(0.45), 2),
        ("claa", 1, pytest.approx(0.70), 2),
        ("fastkv = window", 0, pytest.approx(0.40), 2),
        ("fastkv = window", 1, pytest.approx(0.65), 2),
    ]
    first = figures.needle_recall_figure(frame).data[0]
    assert list(first.y) == ["claa", "fastkv = window"]  # drawn once, named together
    # the same Spearman but another needle recall (a keep-dependent ranking) is not one ranking
    apart = per_layer.with_columns(
        pl.when((pl.col("method") == "window") & (pl.col("keep") == 0.2))
        .then(pl.col("needle_recall") + 0.05).otherwise(pl.col("needle_recall")).alias("needle_recall")
    )  # fmt: skip
    assert sorted(figures.needle_recall_frame(apart)["method"].unique()) == ["claa", "fastkv", "window"]


def test_display_token_shows_whitespace_and_no_markup():
    assert figures.display_token("<br>\n") == "&lt;br&gt;⏎"


def test_needle_figure_cells_are_mean_scores_per_depth_and_length():
    bench = bench_frame()
    figure = figures.needle_figure(bench, colors=figures.method_colors(bench["method"].unique()), keep=0.2)
    claa = next(
        trace
        for trace in figure.data
        if trace.name == "claa keep 0.2" and trace.meta["needle_metric"] == "accuracy"
    )
    assert list(claa.x) == ["1.0k", "2.0k"] and list(claa.y) == ["0%", "50%", "100%"]
    rows = bench.filter((pl.col("method") == "claa") & (pl.col("keep") == 0.2))
    for (row, depth), (column, length) in itertools.product(
        enumerate((0.0, 50.0, 100.0)), enumerate((1019, 2041))
    ):
        cell = rows.filter((pl.col("depth_percent") == depth) & (pl.col("length") == length))["score"].mean()
        assert claa.z[row][column] == pytest.approx(cell)
    visible = {(trace.name, trace.meta["needle_metric"]) for trace in figure.data if trace.visible}
    assert visible == {
        ("full keep 1", "accuracy"),
        *((f"{m} keep 0.2", "accuracy") for m in ("claa", "fastkv", "gemfilter")),
    }
    full = next(trace for trace in figure.data if trace.name.startswith("full"))
    assert "keep" not in full.meta  # full runs at keep 1 only: shown beside every keep rate


def test_full_shows_beside_every_keep_under_the_name_a_page_of_several_runs_gives_it():
    """A page of two benches names full "full (8k, ...)": it was drawn as a pruning method at keep 1,
    which the keep control never picks, so full's heatmap vanished."""
    bench = bench_frame().with_columns(pl.format("{} (8k)", pl.col("method")).alias("method"))
    figure = figures.needle_figure(bench, colors=figures.method_colors(bench["method"].unique()), keep=0.2)
    full = [trace for trace in figure.data if trace.name == "full (8k) keep 1"]
    assert len(full) == 2 and all("keep" not in trace.meta for trace in full)
    assert [trace.visible for trace in full] == [True, False]  # accuracy shown, needle recall on demand
    assert figure.layout.annotations[0].text.endswith("full (8k)")  # the reference's heatmap first


def test_needle_panel_leaves_out_token_budget_runs_the_keep_control_cannot_pick():
    """A bench run with --budget (keep null) ended the dashboard in a TypeError ('<' between None and
    float)."""
    from rankkit import report

    bench = bench_frame()
    colors = figures.method_colors(bench["method"].unique())
    tokens = bench.filter(pl.col("method") == "claa").with_columns(
        pl.lit(None, dtype=pl.Float64).alias("keep"), pl.format("budget={}", pl.col("length")).alias("budget")
    )
    only_tokens = pl.concat([bench.filter(pl.col("method") == "full"), tokens])
    panel = report._needle_panel(only_tokens, True, colors, 0.1)
    assert panel.figure is None and panel.missing == (
        "The bench's runs under a token budget (--budget), which the keep rate control cannot pick, "
        "are not shown: run it with --keep."
    )
    mixed = report._needle_panel(pl.concat([bench, tokens]), True, colors, 0.2)
    assert mixed.caption.endswith("The bench's runs under a token budget (--budget), which the keep rate "
                                  "control cannot pick, are not shown.")  # fmt: skip
    assert {trace.name for trace in mixed.figure.data} == {trace.name for trace in report._needle_panel(
        bench, True, colors, 0.2).figure.data}  # fmt: skip


def test_needle_cells_keep_budgets_apart_with_clustered_intervals_and_n():
    """Two token budgets (no keep rate) are two cells, not one mean over both; four examples of two
    haystacks are two samples: the interval runs from one haystack's mean to the other's, and a
    share kept whole in both is Wilson's over the two (it read "1.00 [1.00, 1.00]")."""
    rows = [
        {"example_id": f"e{index}", "cluster": f"haystack-{index // 2}", "method": "claa", "budget": budget,
         "keep": None, "length": 1019, "depth_percent": 50.0, "score": float(index // 2),
         "evidence_kept": kept}
        for budget, recalls in (("budget=16", (0.2, 0.2, 0.6, 0.6)), ("budget=64", (1.0,) * 4))
        for index, kept in enumerate(recalls)
    ]  # fmt: skip
    cells = figures.needle_frame(pl.DataFrame(rows, schema_overrides={"keep": pl.Float64}))
    accuracy, kept = (["accuracy", *interval_columns("accuracy")],
                      ["evidence_kept", *interval_columns("evidence_kept")])
    assert cells.select("budget", *accuracy, *kept, "n_examples", "n_clusters").rows() == [
        ("budget=16", 0.5, 0.0, 1.0,
         pytest.approx(0.4), pytest.approx(0.2, abs=1e-6), pytest.approx(0.6, abs=1e-6), 4, 2),
        ("budget=64", 0.5, 0.0, 1.0, 1.0, pytest.approx(wilson_interval(2, 2)[0]), 1.0, 4, 2),
    ]  # fmt: skip


def test_needle_heatmap_cells_hover_with_their_interval_and_n():
    bench = bench_frame()
    cells = figures.needle_frame(bench)
    figure = figures.needle_figure(bench, colors=figures.method_colors(bench["method"].unique()), keep=0.2)
    claa = next(trace for trace in figure.data
                if trace.name == "claa keep 0.2" and trace.meta["needle_metric"] == "needle recall")  # fmt: skip
    cell = cells.filter((pl.col("method") == "claa") & (pl.col("keep") == 0.2)
                        & (pl.col("length_bucket") == 2000) & (pl.col("depth_percent") == 50.0))  # fmt: skip
    assert cell.height == 1 and cell["n_examples"].item() == 1  # one example a cell: no bootstrap interval
    np.testing.assert_array_equal(claa.customdata[1][1], [np.nan, np.nan, 1])
    assert claa.z[1][1] == pytest.approx(cell["evidence_kept"].item())
    assert "[%{customdata[0]:.2f}, %{customdata[1]:.2f}] (n = %{customdata[2]})" in claa.hovertemplate


def test_length_bucket_rounds_to_two_significant_figures():
    assert [figures.length_bucket(n) for n in (1019, 2041, 4090, 987, 131_000)] == [
        1000,
        2000,
        4100,
        990,
        130_000,
    ]


def _dominated(point, others) -> bool:
    cost, value = point
    return any(c <= cost and v >= value and (c < cost or v > value) for c, v in others)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=12))
def test_pareto_front_is_exactly_the_non_dominated_points(points):
    frame = pl.DataFrame(
        {"ttft_ratio": [float(c) for c, _ in points], "accuracy": [float(v) for _, v in points]}
    )
    front = figures.pareto_front(frame)
    expected = {point for point in points if not _dominated(point, points)}
    got = list(zip(front["ttft_ratio"].cast(int), front["accuracy"].cast(int), strict=True))
    assert set(got) == expected
    assert len(got) == len(expected)  # duplicates of a front point count once
    assert got == sorted(got)


def test_tradeoff_figure_one_point_per_method_and_keep_and_the_front():
    bench = bench_frame()
    figure = figures.tradeoff_figure(bench, colors=figures.method_colors(bench["method"].unique()))
    by_name = {trace.name: trace for trace in figure.data}
    assert set(by_name) == {"full", "gemfilter", "fastkv", "claa", "Pareto front"}
    points = figures.tradeoff_frame(bench)
    claa = points.filter(pl.col("method") == "claa").sort("ttft_ratio")
    np.testing.assert_allclose(by_name["claa"].x, claa["ttft_ratio"])
    np.testing.assert_allclose(by_name["claa"].y, claa["accuracy"])
    front = figures.pareto_front(points)
    np.testing.assert_allclose(by_name["Pareto front"].x, front["ttft_ratio"])
    assert all(
        not _dominated(point, points.select("ttft_ratio", "accuracy").rows())
        for point in front.select("ttft_ratio", "accuracy").rows()
    )


def test_the_tradeoff_panel_says_when_its_times_are_of_first_runs():
    from rankkit.bench import FIRST_RUNS_TIMED
    from rankkit.report import _tradeoff_panel

    bench = bench_frame()
    colors = figures.method_colors(bench["method"].unique())
    first_runs = bench.with_columns(warmup=pl.when(pl.col("method") == "claa").then(0).otherwise(1))
    assert FIRST_RUNS_TIMED in _tradeoff_panel(first_runs, colors).caption
    for warmed in (bench.with_columns(warmup=pl.lit(1)), bench):  # a bench without the column says nothing
        assert FIRST_RUNS_TIMED not in _tradeoff_panel(warmed, colors).caption


def test_diffusion_figure_share_correct_and_per_example_metrics():
    frame = diffusion_frame()
    figure = figures.diffusion_figure(frame, layer=3, metric="answer_logprob")
    share = figure.data[0]
    np.testing.assert_allclose(share.y, [0, 0, 0.5, 1, 1, 1, 1])
    visible = [trace for trace in figure.data[1:] if trace.visible]
    assert {trace.meta["diffusion_metric"] for trace in visible} == {"answer_logprob"}
    faint, band, mean = visible  # every example in one trace, the mean's 95% interval, the mean
    by_example = [
        frame.filter(pl.col("example") == f"ex{index}")["answer_logprob"].to_list() for index in range(4)
    ]
    assert list(faint.y) == [value for values in by_example for value in [*values, None]]
    expected_mean = (
        frame.group_by("layer").agg(pl.col("answer_logprob").mean()).sort("layer")["answer_logprob"]
    )
    np.testing.assert_allclose(mean.y, expected_mean)
    summary = layer_summary(frame)
    low, high = (summary[column].to_numpy() for column in interval_columns("answer_logprob"))
    np.testing.assert_allclose(band.y, np.concatenate([high, low[::-1]]))
    assert (low < expected_mean.to_numpy()).all() and (expected_mean.to_numpy() < high).all()
    picked = [trace for trace in figure.data if trace.meta and trace.meta.get("example") == "ex1"]
    assert [trace.meta["diffusion_metric"] for trace in picked] == list(figures.DIFFUSION_METRICS)
    np.testing.assert_allclose(picked[0].y, frame.filter(pl.col("example") == "ex1")["answer_logprob"])


# -- the page ----------------------------------------------------------------------------------------


def test_page_is_self_contained_and_missing_data_names_the_command(tmp_path):
    store = write_synthetic_store(tmp_path / "no-oracle.zarr", examples=2, oracle=False, probes=("lava",))
    page = write_dashboard(store, tmp_path / "report.html").read_text()
    plotly_js = plotly.offline.get_plotlyjs()
    assert page.count(plotly_js) == 1
    ours = page.replace(plotly_js, "")
    assert "<script src" not in ours and "http" not in ours  # nothing to fetch
    assert f"rankkit oracle {store}" in page
    assert "rankkit bench --methods" in page
    assert "rankkit diffusion --data niah:n=4,length=1024 --out diffusion.parquet" in page
    assert "The store has no window:w=32 scores" in page and "--probes all" in page


def test_page_inlines_the_packaged_css_and_javascript_and_carries_no_test_code(tmp_path):
    store = write_synthetic_store(tmp_path / "no-oracle.zarr", examples=2, oracle=False, probes=("lava",))
    page = write_dashboard(store, tmp_path / "report.html").read_text()
    assets = Path(html.__file__).with_name("assets")
    for name in ("error_capture.js", "dashboard.css", "dashboard.js"):
        assert page.count((assets / name).read_text(encoding="utf-8")) == 1
    assert "selftest" not in page.lower()


def test_a_page_another_run_wrote_meanwhile_is_kept_without_overwrite(tmp_path, monkeypatch):
    """Two dashboards of one --out at once both passed the check for an existing page before their work:
    the one finishing second replaced the other's page unasked."""
    import rankkit.report
    from rankkit.outputs import GENERATOR_TAG

    store = write_synthetic_store(tmp_path / "run.zarr", examples=2, oracle=False, probes=("lava",))
    out = tmp_path / "report.html"
    render = rankkit.report.render
    other = f"<html>{GENERATOR_TAG} the other run's page</html>"
    rendered = []

    def the_other_run_finishes_first(page):
        out.write_text(other)
        rendered.append(render(page))
        return rendered[-1]

    monkeypatch.setattr(rankkit.report, "render", the_other_run_finishes_first)
    with pytest.raises(RankkitError, match=f"^{out} was written by another run while this one worked; pass --overwrite"):
        write_dashboard(store, out, workers=1)
    assert out.read_text() == other and sorted(path.name for path in tmp_path.iterdir()) == ["report.html", "run.zarr"]
    assert write_dashboard(store, out, workers=1, overwrite=True).read_text() == rendered[-1] != other


def test_bad_inputs_raise_one_line_errors_naming_the_fix(tmp_path, store):
    with pytest.raises(RankkitError, match="no store at .*capture into it first"):
        write_dashboard(tmp_path / "missing.zarr", tmp_path / "report.html")
    not_parquet = tmp_path / "bench.parquet"
    not_parquet.write_text("method,keep\nclaa,0.1\n")
    with pytest.raises(RankkitError, match="is not a parquet file.*rankkit bench"):
        write_dashboard(store, tmp_path / "report.html", bench=not_parquet)
    with pytest.raises(RankkitError, match="no bench file at .*rankkit bench"):
        write_dashboard(store, tmp_path / "report.html", bench=tmp_path / "none.parquet")
    with pytest.raises(RankkitError, match="lacks column.*ttft_ratio"):
        write_dashboard(store, tmp_path / "report.html", bench=bench_frame().drop("ttft_ratio"))


def test_benches_of_other_models_are_drawn_apart_under_their_own_labels_and_never_joined(tmp_path):
    from rankkit.report import _bench_rows, _benches

    store_model = {"id": "SmolLM2-135M-Instruct", "weights_hash": "a" * 64}
    path = write_synthetic_store(tmp_path / "hashed.zarr", examples=2, model=store_model)
    own = bench_frame().with_columns(model=pl.lit("SmolLM2-135M-Instruct"), weights_hash=pl.lit("a" * 64))
    other = bench_frame().with_columns(model=pl.lit("tiny/llama"), weights_hash=pl.lit("b" * 64), score=pl.lit(0.0))
    # the same model's name with other weights (a fine-tune, another quantization): a model of its own
    renamed = bench_frame().with_columns(
        model=pl.lit("SmolLM2-135M-Instruct"), weights_hash=pl.lit("c" * 64), score=pl.lit(1.0)
    )
    runs = _benches([own, other, renamed], stores.open(path))
    assert [(run.label, run.of_store_model) for run in runs] == [
        ("bench 1, SmolLM2-135M-Instruct aaaaaaaaaaaa", True),
        ("bench 2, tiny/llama bbbbbbbbbbbb", False),
        ("bench 3, SmolLM2-135M-Instruct cccccccccccc", False),
    ]
    rows = _bench_rows(runs)
    accuracy = dict(figures.tradeoff_numbers(rows).select("method", "accuracy").filter(
        pl.col("method").str.starts_with("claa") & (pl.col("accuracy").is_not_null())
    ).group_by("method").agg(pl.col("accuracy").mean()).iter_rows())  # fmt: skip
    own_claa = figures.tradeoff_numbers(own).filter(pl.col("method") == "claa")["accuracy"].mean()
    assert accuracy == {
        "claa (bench 1, SmolLM2-135M-Instruct aaaaaaaaaaaa)": own_claa,
        "claa (bench 2, tiny/llama bbbbbbbbbbbb)": 0.0,
        "claa (bench 3, SmolLM2-135M-Instruct cccccccccccc)": 1.0,
    }
    assert "claa" not in set(rows["method"])  # no run under the bare name, as the store's own
    page = write_dashboard(path, tmp_path / "report.html", bench=[other, renamed]).read_text()
    assert "claa (bench 1, tiny/llama bbbbbbbbbbbb)" in page and "claa (bench 2, SmolLM2-135M-Instruct cccccccccccc)" in page
    facts = dict(re.findall(r"<dt>(.*?)</dt><dd>(.*?)</dd>", page))
    assert facts["bench bench 1"] == f"{other.height} rows of tiny/llama (weights bbbbbbbbbbbb), another model than SmolLM2-135M-Instruct: never joined"
    report = page.split('id="panel-report"')[1].split("</section>")[0]
    assert (
        "No bench of the store's model: bench 1, tiny/llama bbbbbbbbbbbb; bench 2, SmolLM2-135M-Instruct "
        "cccccccccccc measured another model, whose numbers are never joined with this store's." in report
    )
    assert "<table" not in report
    alone = write_dashboard(path, tmp_path / "alone.html", bench=other).read_text()
    assert "claa (bench 1, tiny/llama bbbbbbbbbbbb)" in alone  # even alone, never under the bare name


def test_a_bench_of_several_models_is_refused_and_an_unlabelled_one_shown_as_the_stores_with_a_warning(tmp_path):
    path = write_synthetic_store(tmp_path / "hashed.zarr", examples=2, model={"id": "SmolLM2-135M-Instruct", "weights_hash": "a" * 64})
    mixed = pl.concat([
        bench_frame().with_columns(model=pl.lit("SmolLM2-135M-Instruct"), weights_hash=pl.lit("a" * 64)),
        bench_frame().with_columns(model=pl.lit("tiny/llama"), weights_hash=pl.lit("b" * 64)),
    ])  # fmt: skip
    with pytest.raises(RankkitError) as refused:
        write_dashboard(path, tmp_path / "report.html", bench=mixed)
    assert str(refused.value) == (
        "the bench holds rows of 2 models (weights aaaaaaaaaaaa, bbbbbbbbbbbb); pass one file per model"
    )
    assert not (tmp_path / "report.html").exists()
    # rows edited to name another model under the same weights were drawn under the first row's name
    renamed = mixed.with_columns(weights_hash=pl.lit("a" * 64))
    with pytest.raises(RankkitError) as refused:
        write_dashboard(path, tmp_path / "report.html", bench=renamed)
    assert str(refused.value) == (
        "the bench names the model of its rows in 2 ways (SmolLM2-135M-Instruct, tiny/llama) for weights "
        "aaaaaaaaaaaa: its rows were edited; run the bench again"
    )
    assert not (tmp_path / "report.html").exists()
    with pytest.warns(UserWarning, match="the bench does not say which model measured it"):
        page = write_dashboard(path, tmp_path / "report.html", bench=bench_frame()).read_text()
    assert "claa (" not in page
    # a store no capture wrote has no hash to check a bench against: joined, but said so
    unhashed = write_synthetic_store(tmp_path / "unhashed.zarr", examples=2)
    with pytest.warns(UserWarning, match=f"store {unhashed} records no model weights hash .* shown as its own unchecked"):
        write_dashboard(unhashed, tmp_path / "unhashed.html", bench=mixed.filter(pl.col("weights_hash") == "a" * 64))


def test_cli_writes_the_report_and_prints_its_path(tmp_path, store):
    from typer.testing import CliRunner

    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app

    bench = tmp_path / "bench.parquet"
    bench_frame().write_parquet(bench)
    out = tmp_path / "out" / "report.html"
    result = CliRunner().invoke(app, ["dashboard", str(store), "--bench", str(bench), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(out)
    assert out.stat().st_size > 4_000_000  # plotly.js inside


def test_dashboard_keep_compares_the_store_at_each_rate_for_the_needle_recall_panel(tmp_path, store, monkeypatch):
    from typer.testing import CliRunner

    import rankkit.report
    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app
    from rankkit.eval.compare import compare_store

    handed = []
    monkeypatch.setattr(rankkit.report, "_needle_recall_panel", lambda comparisons, path: handed.append(comparisons) or rankkit.report.Panel("needle_recall", "", "", missing="-"))
    out = tmp_path / "report.html"
    result = CliRunner().invoke(app, ["dashboard", str(store), "--out", str(out), "--keep", "0.1,0.2", "--workers", "1"])
    assert result.exit_code == 0, result.output
    ((low, high),) = handed
    assert (low.keep, low.needle_keep, high.keep, high.needle_keep) == (0.1, 0.1, 0.2, 0.2)
    direct = compare_store(store, keep=0.2, workers=1, detailed=False)
    assert high.per_layer.equals(direct.per_layer)
    arguments = ["dashboard", str(store), "--out", str(out), "--keep", "0.1,0.2", "--needle-keep", "0.3"]
    result = CliRunner().invoke(app, [*arguments, "--workers", "1", "--overwrite"])
    assert result.exit_code == 0, result.output
    low, high = handed[1]
    assert (low.keep, low.needle_keep, high.keep, high.needle_keep) == (0.1, 0.3, 0.2, 0.3)
    direct = compare_store(store, keep=0.2, needle_keep=0.3, workers=1, detailed=False)
    assert high.per_layer.equals(direct.per_layer)
    # a token count, as compare_store's needle_keep=16 takes it (--needle-keep was a float, 16.0 refused)
    arguments[-1] = "16"
    result = CliRunner().invoke(app, [*arguments, "--workers", "1", "--overwrite"])
    assert result.exit_code == 0, result.output
    low, high = handed[2]
    assert (low.needle_keep, high.needle_keep) == (16, 16) and isinstance(high.needle_keep, int)
    assert high.per_layer.equals(compare_store(store, keep=0.2, needle_keep=16, workers=1, detailed=False).per_layer)
    refused = CliRunner().invoke(app, ["dashboard", str(store), "--out", str(out), "--keep", "1.5", "--overwrite"])
    assert isinstance(refused.exception, RankkitError) and not handed[3:]  # refused before any comparison
    # Python's keep= as --keep: keep rates, a token count refused before any comparison (it was compared at 100 tokens)
    out.unlink()
    message = r"^keep rate 100 is outside \(0, 1\]: use e.g. --keep 0.1, or --budget for a token count$"
    with pytest.raises(RankkitError, match=message):
        rankkit.report.write_dashboard(store, out, keep=[100], workers=1)
    refused = CliRunner().invoke(app, ["dashboard", str(store), "--out", str(out), "--keep", "100"])
    assert re.match(message.replace("100", r"100\.0"), str(refused.exception)) and not handed[3:] and not out.exists()
    # --budget, as compare takes it: token counts, each compared as compare --budget compares it
    result = CliRunner().invoke(app, ["dashboard", str(store), "--out", str(out), "--budget", "16,24", "--workers", "1"])
    assert result.exit_code == 0, result.output
    low, high = handed[3]
    assert (low.keep, low.needle_keep, high.keep, high.needle_keep) == (16, 16, 24, 24)
    assert high.per_layer.equals(compare_store(store, budget=24, workers=1, detailed=False).per_layer)
    refused = CliRunner().invoke(app, ["dashboard", str(store), "--out", str(out), "--overwrite", "--keep", "0.1", "--budget", "16"])
    assert str(refused.exception).startswith("give exactly one of --keep") and not handed[4:]


def test_the_asl_panel_draws_its_curves_under_the_first_budget_compared(tmp_path, store, monkeypatch):
    """It drew them at keep 0.1 whatever the page compared under, so a sweep of budget = [64] showed
    another selection than its own variance stage."""
    import rankkit.report
    from rankkit.eval.variance import variance_store

    handed = []
    drawn = rankkit.report._variance_panel
    monkeypatch.setattr(rankkit.report, "_variance_panel", lambda variance, *rest: handed.append((variance, rest[-1])) or drawn(variance, *rest))
    rankkit.report.write_dashboard(store, tmp_path / "tokens.html", budget=[64, 48], workers=1)
    rankkit.report.write_dashboard(store, tmp_path / "rate.html", keep=[0.3], workers=1)
    for (variance, budget), keywords in zip(handed, ({"budget": 64}, {"keep": 0.3}), strict=True):
        assert budget.keywords == {"keep": None, "budget": None} | keywords
        assert variance.curves.equals(variance_store(store, **keywords, workers=1).curves)
    assert not variance_store(store, keep=0.1, workers=1).curves.equals(handed[0][0].curves)  # the test can tell
    page = (tmp_path / "tokens.html").read_text()
    assert "Probe: window:w=32, k = 64 tokens - W (the first budget compared)." in page


def test_several_benches_are_drawn_side_by_side_each_method_named_after_its_run(tmp_path, store):
    from typer.testing import CliRunner

    from rankkit import stores
    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app
    from rankkit.report import _bench_rows, _benches

    (tmp_path / "8k").mkdir()
    (tmp_path / "32k").mkdir()
    paths = [tmp_path / "8k" / "bench.parquet", tmp_path / "32k" / "bench.parquet"]
    for path in paths:
        bench_frame().write_parquet(path)
    methods = ["claa", "fastkv", "full", "gemfilter"]
    opened = stores.open(store)
    named = _bench_rows(_benches([paths[0], bench_frame()], opened))  # a file by its name, a frame by its place
    assert sorted(named["method"].unique()) == sorted(
        [f"{method} (bench)" for method in methods] + [f"{method} (bench 2)" for method in methods]
    )
    assert named.height == 2 * bench_frame().height
    same_names = _bench_rows(_benches(paths, opened))  # both files are bench.parquet: their paths tell them apart
    assert sorted(same_names["method"].unique()) == sorted(f"{method} ({path})" for path in paths for method in methods)

    out = tmp_path / "report.html"
    result = CliRunner().invoke(
        app, ["dashboard", str(store), "--bench", str(paths[0]), "--bench", str(paths[1]), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert f"claa ({paths[0]})" in page and f"claa ({paths[1]})" in page


needs_chromium = pytest.mark.skipif(
    find_chromium() is None,
    reason="Chromium is not installed; `make browser` (or apt-get install chromium) adds it",
)


@needs_chromium
def test_every_panel_draws_in_headless_chromium_without_javascript_errors(tmp_path, store):
    from rankkit import stores

    page = write_dashboard(
        store, tmp_path / "report.html", bench=bench_frame(), diffusion=diffusion_frame(), keep=[0.1, 0.2]
    )
    screenshot = tmp_path / "report.png"
    report = open_in_chromium(
        page, screenshot=screenshot, fragment="example=ex2&probe=lava&colour=score&layer=4&selftest"
    )
    status = report.status
    assert status["done"] and status["errors"] == []
    assert set(status["panels"]) == {
        "spearman",
        "variance",
        "explorer",
        "needle_recall",
        "needle",
        "tradeoff",
        "report",
        "diffusion",
    }
    # the bench's examples are not the store's: the report panel says so, as `rankkit report` refuses
    report = status["panels"].pop("report")
    assert report["missing"] and "has no rows at a keep rate for the examples of store" in report["text"]
    for name, panel in status["panels"].items():
        assert not panel.get("missing"), name
        assert panel["visible_traces"] > 0 and panel["points"] > 0 and panel["svg_traces"] > 0, (name, panel)
    assert status["panels"]["needle_recall"]["visible_traces"] == 2  # one heatmap per keep given
    # The explorer shows the picked example and probe: every layer's largest score, as float16.
    record = stores.open(store).example("ex2")
    start, end = 0, record.num_tokens - 8  # the prompt outside CLAA's observation window, as compare ranks
    expected = record.scores("lava")[..., start:end].sum(axis=1).max(axis=1)
    explorer = status["explorer"]
    assert (explorer["example"], explorer["probe"], explorer["layers"]) == ("ex2", "lava", LAYERS)
    np.testing.assert_allclose(explorer["row_max"], expected.astype(np.float16), rtol=1e-3)
    assert status["state"]["layer"] == "4"
    kept = Budget.from_keep(0.1).resolve(end - start)
    assert explorer["kept_columns"] == kept  # keep 10% at layer 4, one token a column
    # 4 examples, 4 probes, 2 colourings, 2 slider ends, 5 taus, 3 keep rates, 2 needle and 3 diffusion
    # metrics were each picked, then every control went back to its start
    assert status["selftest_steps"] == (4 + 4 + 2 + 2 + 5 + 3 + 2 + 3) + 8
    # Hovering the first column at layer 0 names its token, that token's rank and score.
    layer_0 = record.scores("lava")[0, :, start:end].sum(axis=0)
    rank = int((layer_0 > layer_0[0]).sum()) + 1
    hover = status["selftest_hover"]
    assert (
        f"layer 0tokens {start}–{start}top token #{start}: “w{start}”rank {rank} of {end - start}score"
        in hover
    )
    assert float(hover.rsplit("score", 1)[1]) == pytest.approx(layer_0[0], rel=1e-3)
    # A click on the numbers' rho column (task, method, layer, spearman, ...) puts the lowest first,
    # a second click the highest.
    spearman_table = page.read_text().split('id="panel-spearman"')[1].split("</table>")[0]
    rows = re.findall(r"<tr>(.*?)</tr>", spearman_table.split("<tbody>")[1])
    values = [float(re.findall(r'<td(?: data-value="([^"]*)")?>', row)[3]) for row in rows]
    values = [value for value in values if not np.isnan(value)]
    assert status["selftest_sorted"] == [min(values), max(values)]
    assert screenshot.stat().st_size > 50_000 and screenshot.read_bytes()[:4] == b"\x89PNG"


_FIFTY_EXAMPLE_BENCHMARK = pytest.mark.skipif(
    not os.environ.get("RANKKIT_DASHBOARD_BENCH"),
    reason="the 50-example dashboard benchmark asserts an open time only an idle machine keeps; "
    "RANKKIT_DASHBOARD_BENCH=1 runs it (docs/benchmarks.md)",
)


@needs_chromium
@pytest.mark.parametrize(
    ("examples", "tokens"),
    [
        # the benchmark's store at two short examples, so that CI sees the store it builds still draws
        pytest.param(2, 256, id="two"),
        pytest.param(50, 4096, id="fifty", marks=_FIFTY_EXAMPLE_BENCHMARK),
    ],
)
def test_a_default_capture_shaped_store_stays_under_20_mb_and_opens_within_3_s(tmp_path, examples, tokens):
    """The figure of docs/benchmarks.md: 50 examples x 4,096 tokens x 30 layers x 3 KV heads (9 query
    heads) x 5 probes.

    The open time is the page's own clock at the moment every panel has drawn; it is asserted for the
    benchmark only, which is run on an idle machine.
    """
    probes = ("window", "last_token_raw", "last_token_heads", "lava", "token_units")
    store = write_synthetic_store(
        tmp_path / "big.zarr", examples=examples, tokens=tokens, layers=30, heads=3, group=3, probes=probes
    )
    page = write_dashboard(
        store, tmp_path / "report.html", bench=bench_frame(), diffusion=diffusion_frame(examples, 30)
    )
    megabytes = page.stat().st_size / 1e6
    report = open_in_chromium(page)
    status = report.status
    print(
        f"\ndashboard: {megabytes:.1f} MB; drawn {status['since_navigation_ms']} ms after navigation "
        f"(plotly.js ready at {status['plotly_ready_ms']} ms); chromium --dump-dom {report.seconds:.1f} s"
    )
    assert megabytes < 20
    assert status["done"] and status["errors"] == []
    if examples == 50:
        assert status["since_navigation_ms"] < 3000


@needs_chromium
def test_a_store_without_oracle_bench_or_window_scores_draws_its_explorer_and_says_what_is_missing(tmp_path):
    store = write_synthetic_store(tmp_path / "bare.zarr", examples=2, oracle=False, probes=("lava",))
    status = open_in_chromium(write_dashboard(store, tmp_path / "report.html"), fragment="selftest").status
    assert status["done"] and status["errors"] == []
    missing = {name for name, panel in status["panels"].items() if panel.get("missing")}
    assert missing == {"spearman", "variance", "needle_recall", "needle", "tradeoff", "report", "diffusion"}
    assert "rankkit oracle" in status["panels"]["spearman"]["text"]
    assert status["panels"]["explorer"]["points"] > 0 and status["explorer"]["probe"] == "lava"


def test_the_explorer_sample_shrinks_to_what_fits_its_budget_at_the_coarsest_columns(
    tmp_path, store, monkeypatch
):
    import rankkit.report

    record = stores.open(store).example(stores.open(store).example_ids()[0])
    rows = (
        sum(record.score_shape(probe)[0] for probe in record.probes) + 1
    )  # every probe's layers and the oracle
    cell = 2 + 1 + 2 + len(rankkit.report.KEEP_RATES)
    monkeypatch.setattr(rankkit.report, "EXPLORER_BUDGET_BYTES", 2 * rows * rankkit.report.MIN_BINS * cell)
    ids = stores.open(store).example_ids()
    assert len(ids) > 2
    page = write_dashboard(store, tmp_path / "report.html").read_text()
    assert f"2 of {len(ids)} examples" in page


def test_a_large_store_explores_a_sample_and_names_the_command_for_the_rest(tmp_path, store, monkeypatch):
    import rankkit.report

    monkeypatch.setattr(rankkit.report, "EXPLORER_EXAMPLES", 2)
    ids = stores.open(store).example_ids()
    page = write_dashboard(store, tmp_path / "report.html").read_text()
    # evenly spaced: indices 0 and len // 2 of the store's order
    sampled, others = [ids[0], ids[len(ids) // 2]], [i for i in ids if i not in (ids[0], ids[len(ids) // 2])]
    assert f"2 of {len(ids)} examples" in page
    assert f"--explore ID[,ID...]`. Not shown: {', '.join(others)}." in page
    assert all(f'data-example="{i}"' in page for i in sampled) and not any(
        f'data-example="{i}"' in page for i in others
    )
    # only the explorer's examples get a bold curve the example control can show
    assert all(f"{i} (picked)" in page for i in sampled) and not any(f"{i} (picked)" in page for i in others)
    chosen = write_dashboard(store, tmp_path / "chosen.html", explore=[ids[-1]]).read_text()
    assert f'data-example="{ids[-1]}"' in chosen and f'data-example="{ids[0]}"' not in chosen
    # the ids there, named in the refusal: `store info` lists none
    held = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
    with pytest.raises(RankkitError, match=f"--explore names nope, not complete examples of .*; it holds {held}$"):
        write_dashboard(store, tmp_path / "bad.html", explore=["nope"])
    with pytest.raises(RankkitError, match=f"^--explore names {ids[0]} twice; name each example once$"):
        write_dashboard(store, tmp_path / "twice.html", explore=[ids[0], ids[0]])


# -- terminal tables -------------------------------------------------------------------------------


def test_frame_table_fits_80_columns_with_short_headers_a_legend_and_no_cut_cells():
    from rich.console import Console

    from rankkit.tables import HEADERS, frame_table

    methods = ["last_token_heads", "last_token_raw", "window"]
    metrics = ["spearman", "mean_spearman", "std_spearman", "min_spearman", "recall_at_10"]
    metrics += ["needle_recall", "layer_to_layer"]
    frame = pl.DataFrame(
        {"method": methods, **{name: [-0.123456, 0.5, None] for name in metrics}, "n_examples": [4, 4, 4]}
    )
    console = Console(width=80, record=True)
    console.print(frame_table(frame, "rankings"))
    lines = [line.rstrip() for line in console.export_text().splitlines()]
    assert max(map(len, lines)) <= 80 and "…" not in "".join(lines)
    header = next(line for line in lines if line.startswith("method"))
    assert header.split() == "method ρ mean ρ sd ρ min ρ rec10 needle adj ρ n".split()
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0] in methods]
    assert rows == [
        [method, *[cell] * 7, "4"] for method, cell in zip(methods, ["-0.123", "0.500", "-"], strict=True)
    ]
    for name in [*metrics, "n_examples"]:
        assert f"{HEADERS[name][0]}: {HEADERS[name][1]}" in lines
