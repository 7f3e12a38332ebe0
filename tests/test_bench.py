"""The bench grid on a tiny model: one row per (example, method, budget), ratios to full, summary;
the cost model's fit; and the CLI on the default model (integration)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import warnings

import polars as pl
import pytest
import torch
from conftest import tiny_model

from rankkit.bench import SUMMARY_METRICS, BenchSettings, run_bench, summary
from rankkit.data import Example
from rankkit.eval.stats import interval_columns
from rankkit.measure import TensorMemoryTracker, Timeline, decode_step_bytes, measure, read_bandwidth
from rankkit.methods import Budget, Pass, make
from rankkit.methods.measure import CostModel, head_layers
from rankkit.prompting import Prompt
from rankkit.runner import Runner


class DigitTokenizer:
    """Decodes token ids to their digits, so a tiny model's answer is a string a metric can score."""

    def decode(self, tokens, **kwargs):
        return " ".join(str(token) for token in tokens)


def _example(index: int) -> tuple[Example, Prompt]:
    ids = torch.randint(0, 97, (48,), generator=torch.Generator().manual_seed(index))
    text = "x" * 48  # one character per token
    example = Example(
        id=f"e{index}",
        task="toy",
        context=text[:40],
        question=text[40:],
        answers=("1",),
        evidence=((10, 14),),
        meta={"depth_percent": 25.0},
    )
    prompt = Prompt(text, ids, [(i, i + 1) for i in range(48)], (0, 40), (40, 48))
    return example, prompt


def test_bench_rows_hold_every_measurement_and_ratios_to_full():
    runner = Runner(tiny_model("llama"))
    examples, prompts = zip(*(_example(i) for i in range(2)), strict=True)
    by_id = {example.id: prompt for example, prompt in zip(examples, prompts, strict=True)}
    methods = [make("full"), make("fastkv", window_size=4), make("gemfilter")]
    frame = run_bench(
        runner,
        DigitTokenizer(),
        list(examples),
        methods,
        [Budget.from_keep(0.25), Budget.from_keep(0.5)],
        BenchSettings(max_new_tokens=3, warmup=1),
        prompt_for=lambda example: by_id[example.id],
    )
    assert frame.height == 2 * (1 + 2 * 2)  # full once per example, then budget x method
    assert frame["method"].to_list()[:5] == ["full", "fastkv", "gemfilter", "fastkv", "gemfilter"]
    full = frame.filter(frame["method"] == "full")
    assert full["ttft_ratio"].to_list() == [1.0, 1.0] and full["ideal_ratio"].to_list() == [1.0, 1.0]
    fastkv = frame.filter((frame["method"] == "fastkv") & (frame["budget"] == "keep=0.25")).row(0, named=True)
    assert fastkv["kv_ratio"] == pytest.approx(12 / 48)
    assert fastkv["live_tokens"] == [48, 48, 12] and fastkv["depth_percent"] == 25.0
    assert 0 <= fastkv["evidence_kept"] <= 1 and fastkv["peak_mem_bytes"] > 0
    assert 0 < fastkv["ideal_ratio"] < 1
    table = summary(frame)
    assert table.filter(table["method"] == "gemfilter").height == 2
    assert {"accuracy", "ttft_ratio", "ideal_ratio", "measured_over_ideal", "kv_ratio"} <= set(table.columns)
    (ffn_share,) = frame["cost_ffn_share"].unique().to_list()  # timed: the grid's one calibration
    assert 0 < ffn_share <= 1 and frame["cost_head_layers"].unique().to_list() == [head_layers(runner)]
    # each row's decode bound reads the weights and that row's KV at the one bandwidth of the grid
    assert frame["bandwidth_source"].unique().to_list() == ["measured"]
    (bandwidth,) = frame["bandwidth_bytes_per_s"].unique().to_list()
    assert bandwidth == read_bandwidth(torch.device("cpu"))
    for row in (fastkv, full.row(0, named=True)):
        bound = (decode_step_bytes(runner.model, 0) + row["kv_bytes"]) / bandwidth
        assert row["tpot_bound_s"] == pytest.approx(bound) and row["tpot_over_bound"] == pytest.approx(row["tpot_s"] / bound)
    assert fastkv["tpot_bound_s"] < full["tpot_bound_s"][0]  # a quarter of the KV to read
    gemfilter = table.filter(table["method"] == "gemfilter")
    expected = frame.filter(frame["method"] == "gemfilter").group_by("budget", maintain_order=True).agg(pl.col("tpot_over_bound").mean())
    assert gemfilter["tpot_over_bound"].to_list() == pytest.approx(expected["tpot_over_bound"].to_list())
    # TPOT's parts: 3 new tokens are 2 decode steps, the first and one later
    assert fastkv["tpot_s"] == pytest.approx((fastkv["first_step_s"] + fastkv["later_steps_s"]) / 2)
    assert {"first_step_s", "later_steps_s"} <= set(table.columns)
    # every mean over examples comes with its interval; measured over ideal is each example's
    for metric in SUMMARY_METRICS:
        assert set(interval_columns(metric)) <= set(table.columns), metric
    rows = frame.filter((pl.col("method") == "gemfilter") & (pl.col("budget") == "keep=0.25"))
    per_example = rows.with_columns((pl.col("ttft_ratio") / pl.col("ideal_ratio")).alias("measured_over_ideal"))
    mean = table.filter((pl.col("method") == "gemfilter") & (pl.col("budget") == "keep=0.25")).row(0, named=True)
    for metric in ("ideal_ratio", "measured_over_ideal", "tpot_over_bound", "kv_bytes", "peak_mem_bytes"):
        low, high = (mean[column] for column in interval_columns(metric))
        assert mean[metric] == pytest.approx(per_example[metric].mean()) and low <= mean[metric] <= high, metric
    older = summary(frame.drop("first_step_s", "later_steps_s", "tpot_over_bound"))  # a bench before they were kept
    assert older["tpot_over_bound"].null_count() == older["first_step_s"].null_count() == older.height


def test_cost_model_fit_recovers_linear_and_quadratic_terms():
    true = CostModel(linear=2e-4, quadratic=3e-8, ffn_share=0.6, head_layers=2.0)
    samples = [(n, 30 * true.layer_cost(n, n)) for n in (1000, 2000, 4000)]
    fitted = CostModel.fit(samples, num_layers=30, ffn_seconds=0.6 * 2e-4, head_layers=2.0)
    assert fitted.linear == pytest.approx(2e-4) and fitted.quadratic == pytest.approx(3e-8)
    assert fitted.ffn_share == pytest.approx(0.6)
    half_depth = [Pass.prefill("main", [4000] * 15 + [400] * 15)]
    expected = (15 * true.layer_cost(4000, 4000) + 15 * true.layer_cost(400, 400)) / (
        30 * true.layer_cost(4000, 4000)
    )
    assert fitted.ideal_ratio(half_depth, 4000, 30) == pytest.approx(expected)


def test_cpu_timeline_and_measure_time_the_work_between_marks_and_report_no_allocator_peak():
    timeline = Timeline(torch.device("cpu"))
    timeline.mark()
    time.sleep(0.02)
    timeline.mark()
    timeline.mark()
    timeline.finish()
    assert 0.02 <= timeline.seconds(0, 1) < 1.0
    assert timeline.seconds(1, 2) < 0.01
    with measure(torch.device("cpu")) as block:
        time.sleep(0.02)
    assert 0.02 <= block.seconds < 1.0
    assert block.peak_bytes is None


# Five 10 MB blocks from the C heap (where torch's CPU tensors come from), touched and freed together,
# as a prefill's layer frees its tensors; the pages five more rounds fault in, in a fresh process (the
# allocator's settings are the process's). Called through ctypes: no other allocation interleaves.
ROUNDS_FAULTS = """
import ctypes, resource, sys, torch
from rankkit.measure import Timeline
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
def layer_like():
    blocks = [libc.malloc(10 * 2**20) for _ in range(5)]
    for block in blocks:
        ctypes.memset(block, 1, 10 * 2**20)
    for block in blocks:
        libc.free(block)
if sys.argv[1] == "timed":
    Timeline(torch.device("cpu"))
layer_like()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    layer_like()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif("CS_GNU_LIBC_VERSION" not in getattr(os, "confstr_names", {}), reason="glibc's allocator")
def test_a_cpu_timeline_keeps_freed_memory_so_later_runs_fault_no_pages_in():
    faults = {}
    for arm in ("untimed", "timed"):
        ran = subprocess.run([sys.executable, "-c", ROUNDS_FAULTS, arm], capture_output=True, text=True, check=True)
        faults[arm] = int(ran.stdout)
    assert faults["untimed"] > 5 * 50 * 2**20 // 4096 * 0.9  # glibc gave the heap's top back: every page again
    assert faults["timed"] < 50


def test_freed_memory_is_left_to_a_c_library_other_than_glibc(monkeypatch):
    import ctypes

    from rankkit.measure import hold_freed_memory

    monkeypatch.setattr(os, "confstr_names", {}, raising=False)  # as on musl or macOS
    monkeypatch.setattr(ctypes, "CDLL", lambda name: pytest.fail("no C library is loaded"))
    assert hold_freed_memory.__wrapped__() is False


def test_memory_tracker_counts_new_storages_until_they_are_freed():
    weights = torch.ones(1000)
    with TensorMemoryTracker() as tracker:
        kept = weights * 2  # 4000 bytes
        scratch = torch.ones(2000) + 1  # two 8000-byte storages at once, then one is freed
        del scratch
        view = kept[:10]  # a view allocates nothing
    assert tracker.peak == 4000 + 8000 + 8000
    assert tracker.live == 4000 and view.numel() == 10


def test_memory_tracker_reads_tensors_in_lists_tuples_and_keywords():
    first, second, given = torch.ones(100), torch.ones(100), torch.empty(100)
    with TensorMemoryTracker() as tracker:
        joined = torch.cat([first, second])  # 800 bytes, from a list of inputs
        values, indices = torch.topk(first, 10)  # a tuple of results: 40 + 80 bytes
        torch.add(first, 1, out=given)  # into a storage passed as a keyword: nothing new
        sums = torch._foreach_add([first, second], 1)  # a list of results: 400 + 400 bytes
    assert tracker.peak == tracker.live == 800 + 40 + 80 + 800
    assert joined.numel() + values.numel() + indices.numel() + len(sums) == 222


def _prefill_json(tmp_path, *options: str) -> dict:
    """``rankkit prefill ... --json`` on a short secret-code prompt, its JSON parsed."""
    from typer.testing import CliRunner

    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app

    context = tmp_path / "context.txt"
    context.write_text("The secret code is 4172. " + "Grass is green and the sky is blue. " * 20)
    result = CliRunner().invoke(
        app,
        ["prefill", *options, "--context-file", str(context), "--question", "What is the secret code?",
         "--max-new-tokens", "4", "--json", "--warmup", "0", "--device", "cpu"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_bench_cli_prints_the_summary_rows_as_csv_or_as_its_json(monkeypatch):
    import polars as pl
    from typer.testing import CliRunner

    import rankkit.bench
    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app

    rows = [
        {"method": "claa", "budget": "keep=0.1", "n_examples": 2, "accuracy": 0.5, "ttft_ratio": 0.123456789},
        {"method": "full", "budget": "keep=1", "n_examples": 2, "accuracy": 1.0, "ttft_ratio": None},
    ]
    monkeypatch.setattr(rankkit.bench, "bench", lambda *args, **options: None)
    monkeypatch.setattr(rankkit.bench, "summary", lambda frame: pl.DataFrame(rows))
    grid = ["bench", "--methods", "claa,full", "--keep", "0.1", "--data", "niah:n=2,length=256"]
    as_csv = CliRunner().invoke(app, [*grid, "--format", "csv"])
    assert as_csv.exit_code == 0, as_csv.output
    assert as_csv.stdout.splitlines() == [
        "method,budget,n_examples,accuracy,ttft_ratio",
        "claa,keep=0.1,2,0.5,0.123456789",
        "full,keep=1,2,1.0,",
    ]
    as_json = CliRunner().invoke(app, [*grid, "--json"]).stdout
    assert json.loads(as_json) == {"out": None, "warmup": 0, "timing_only": False, "summary": rows}
    assert CliRunner().invoke(app, [*grid, "--format", "json"]).stdout == as_json


def test_bench_table_shows_the_independent_samples_and_which_means_have_no_interval(monkeypatch):
    """Four examples of one haystack are one sample: the table says so (ind. 1) and marks the mean
    without an interval, which printed as a bare "0.75"."""
    from typer.testing import CliRunner

    import rankkit.bench
    from rankkit.cli import commands  # noqa: F401
    from rankkit.cli.app import app

    rows = summary(
        _bench_rows({None: 1.0}).with_columns(
            cluster=pl.lit("niah-s0-needle0"), score=pl.Series([1.0, 0.0, 1.0, 1.0])
        )
    )
    monkeypatch.setattr(rankkit.bench, "bench", lambda *args, **options: None)
    monkeypatch.setattr(rankkit.bench, "summary", lambda frame: rows)
    grid = ["bench", "--methods", "claa", "--keep", "0.1", "--data", "niah:n=4,length=256"]
    shown = CliRunner().invoke(app, grid)
    assert shown.exit_code == 0, shown.output
    assert "ind." in shown.stdout
    line = next(line for line in shown.stdout.splitlines() if "claa" in line)
    assert re.search(r"claa\W+keep=0\.1\W+4\W+1\W+0\.75 \[–\]", line), line


@pytest.mark.integration
def test_prefill_cli_compares_with_full_on_the_default_model(tmp_path, default_model):
    payload = _prefill_json(tmp_path, "--method", "claa", "--keep", "0.5", "--compare", "full")
    assert {
        "method",
        "keep",
        "ttft_s",
        "tpot_s",
        "e2e_s",
        "kv_bytes",
        "peak_mem_bytes",
        "ideal_ratio",
    } <= set(payload)
    assert {"answer", "score", "ttft_ratio", "kv_ratio"} <= set(payload)
    assert payload["method"] == "claa" and payload["keep"] == 0.5 and payload["kv_ratio"] < 1
    # the same form as `rankkit select`: the example, the selection layer and the kept positions
    assert payload["example_id"] == "prompt" and payload["selection_layer"] == 14  # CLAA's l_p of 30 layers
    kept = payload["selected_positions"]
    assert kept == sorted(kept) and len(kept) == Budget.from_keep(0.5).resolve(payload["length"], 8)


def test_interleaved_rounds_pair_each_run_with_full_of_the_same_round():
    from rankkit.methods.measure import Measured, MethodRun

    def run(ttft):
        return MethodRun("m", {}, "keep=1", 10, [1], ttft, 0.1, ttft + 1, 100, [10.0], [10], [], None)

    full = Measured([run(10.0), run(20.0), run(10.0)])
    method = Measured([run(5.0), run(10.0), run(9.0)])  # a burst of load in round 2 hit both
    assert method.ratio_to(full, "ttft_s") == pytest.approx(0.5)
    assert method.run.ttft_s == 9.0 and method.run.e2e_s == 10.0


def test_measure_interleaved_warms_every_entry_up_then_times_them_in_counterbalanced_rounds(random_ids):
    """Rounds alternate the order, so no method always runs first or right after the same one; each
    method's runs are its own, one per round, paired by round with the reference's."""
    from rankkit.methods.measure import measure_interleaved

    runner = Runner(tiny_model("llama"))
    order = []
    entries = [
        (make("full"), Budget.from_keep(1.0)),
        (make("snapkv", window_size=4), Budget.from_keep(0.5)),
        (make("streamingllm"), Budget.from_keep(0.25)),
    ]
    measured = measure_interleaved(
        runner,
        entries,
        random_ids,
        2,
        tokenizer=None,
        warmup_runs=1,
        repeats=3,
        on_run=lambda method, _: order.append(method.name),
    )
    warm, rounds = order[:3], [order[3:6], order[6:9], order[9:]]
    assert warm == ["full", "snapkv", "streamingllm"]
    assert rounds == [warm, warm[::-1], warm]
    assert [[run.method for run in result.runs] for result in measured] == [[name] * 3 for name in warm]
    assert [run.kv_bytes for run in measured[2].runs] == [measured[2].runs[0].kv_bytes] * 3
    assert measured[0].warmup_peak_bytes > measured[1].run.kv_bytes
    assert [result.warmup_runs for result in measured] == [1, 1, 1]  # what says the runs carry no one-time costs


def test_the_compiled_sort_is_ready_before_the_first_run_on_a_cpu(random_ids, monkeypatch):
    """Its compiling or loading (seconds after an install) would land in the first method that sorts."""
    from rankkit.methods import measure as measure_module

    events = []
    monkeypatch.setattr(measure_module, "load_compiled", lambda: events.append("sort ready"))
    entries = [(make("full"), Budget.from_keep(1.0)), (make("snapkv", window_size=4), Budget.from_keep(0.5))]
    measure_module.measure_interleaved(
        Runner(tiny_model("llama")),
        entries,
        random_ids,
        1,
        tokenizer=None,
        warmup_runs=0,
        repeats=1,
        on_run=lambda method, _: events.append(method.name),
    )
    assert events == ["sort ready", "full", "snapkv", "full", "snapkv"]


@pytest.mark.integration
def test_prefill_cli_runs_full_without_a_budget(tmp_path, default_model):
    payload = _prefill_json(tmp_path, "--method", "full")
    assert payload["method"] == "full" and payload["keep"] == 1.0
    assert payload["ideal_ratio"] == pytest.approx(1.0)


def test_calibration_is_cached_per_model_device_and_thread_count(tmp_path, monkeypatch):
    from rankkit.methods import measure as measure_module

    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path))
    calls = []
    fitted = CostModel(2e-6, 3e-9, 0.8, 2.0, [(40, 0.001), (10, 0.0002)])
    monkeypatch.setattr(
        measure_module, "calibrate", lambda *args, **kwargs: calls.append((args, kwargs)) or fitted
    )
    runner = Runner(tiny_model("llama"))
    ids = torch.arange(40)
    assert measure_module.cached_calibration(runner, ids, "ab" * 32) == fitted
    assert measure_module.cached_calibration(runner, ids[:20], "ab" * 32) == fitted  # from the cache
    # the prompt at its full length and a quarter, one round each
    assert calls == [((runner, ids), {"fractions": (1.0, 0.25), "repeats": 1})]
    (path,) = (tmp_path / "calibration").iterdir()
    assert path.name == f"{'ab' * 8}-cpu-{torch.get_num_threads()}threads-timed-ffn.json"
    cuda1 = measure_module.calibration_path("ab" * 32, torch.device("cuda", 1))
    assert cuda1.name == f"{'ab' * 8}-cuda1-{torch.get_num_threads()}threads-timed-ffn.json"  # one fit per GPU
    measure_module.cached_calibration(runner, ids, "cd" * 32)  # another model calibrates anew
    assert len(calls) == 2
    # up to 10% past the fit's longest prompt (40 tokens) the fit prices it; further, it is timed
    # anew and that fit is the one cached
    assert measure_module.cached_calibration(runner, torch.arange(44), "ab" * 32) == fitted
    longer = CostModel(2e-6, 4e-9, 0.8, 2.0, [(45, 0.001), (11, 0.0002)])
    monkeypatch.setattr(measure_module, "calibrate", lambda *args, **kwargs: calls.append(args) or longer)
    assert measure_module.cached_calibration(runner, torch.arange(45), "ab" * 32) == longer
    assert measure_module.cached_calibration(runner, ids, "ab" * 32) == longer
    assert len(calls) == 3


def _record(**changed) -> str:
    """A cached cost model's JSON with ``changed`` values (a valid one without)."""
    record = {"linear": 2e-06, "quadratic": 3e-09, "ffn_share": 0.8, "head_layers": 2.0, "samples": [[40, 0.001]]}
    return json.dumps(record | changed)


@pytest.mark.parametrize(
    ("damaged", "reason"),
    [
        ('{"linear": 2e-06, "quadratic"', "not JSON: Expecting ':' delimiter: line 1 column 30 (char 29)"),
        ("[]", "not a JSON object"),
        (_record(linear=-2e-06), "its linear is -2e-06, not a number >= 0"),
        (_record(quadratic=float("nan")), "its quadratic is NaN, not a number >= 0"),
        (_record(ffn_share=1.5), "its ffn_share is 1.5, above 1"),
        (_record(head_layers=True), "its head_layers is true, not a number >= 0"),
        (_record(linear="2e-06"), 'its linear is "2e-06", not a number >= 0'),
        (_record(linear=0, quadratic=0), "it prices a prefill at 0 s"),
        *[
            (_record(samples=samples), "its samples are not [tokens, seconds] pairs of positive numbers")
            for samples in ([], [[0, 0.001]], [[40, 0]], [[40, 0.001, 1]], [[40.0, 0.001]], [[40, float("inf")]])
        ],
    ],
)
def test_a_damaged_cached_calibration_is_not_used_and_the_next_one_replaces_it(
    tmp_path, monkeypatch, damaged, reason
):
    """Every ideal ratio is priced from the cached fit: one no calibration gives (cut short, a value out
    of its range, no samples) is set aside with a warning and timed anew, never priced from."""
    from rankkit.methods import measure as measure_module

    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path))
    fitted = CostModel(2e-6, 3e-9, 0.8, 2.0, [(40, 0.001), (10, 0.0002)])
    calls = []
    monkeypatch.setattr(measure_module, "calibrate", lambda *args, **kwargs: calls.append(args) or fitted)
    path = measure_module.calibration_path("ab" * 32, torch.device("cpu"))
    path.parent.mkdir(parents=True)
    path.write_text(damaged)
    message = f"{path} is damaged ({reason}): not used; the next calibration replaces it"
    with pytest.warns(UserWarning, match=f"^{re.escape(message)}$"):
        assert measure_module.cached_cost_model("ab" * 32, torch.device("cpu")) is None
    with pytest.warns(UserWarning, match="is damaged"):
        assert measure_module.cached_calibration(Runner(tiny_model("llama")), torch.arange(40), "ab" * 32) == fitted
    assert len(calls) == 1
    assert CostModel.from_record(json.loads(path.read_text())) == fitted


def test_a_cached_calibration_of_an_older_rankkit_is_timed_anew_without_a_warning(tmp_path, monkeypatch):
    from rankkit.methods import measure as measure_module

    monkeypatch.setenv("RANKKIT_CACHE", str(tmp_path))
    path = measure_module.calibration_path("ab" * 32, torch.device("cpu"))
    path.parent.mkdir(parents=True)
    path.write_text('{"linear": 2e-06, "quadratic": 3e-09, "samples": [[40, 0.001]]}')  # no shares
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert measure_module.cached_cost_model("ab" * 32, torch.device("cpu")) is None
    fitted = {"linear": 2e-06, "quadratic": 0, "ffn_share": 1, "head_layers": 0, "samples": [[1, 1]]}
    # the least of every value a fit may hold, and a field of a later rankkit's beside them
    assert CostModel.from_record(fitted | {"from_a_later_rankkit": 1}) == CostModel(2e-6, 0, 1, 0, [(1, 1)])


def test_kept_positions_by_layer_are_each_kv_heads_cache_after_the_prefill():
    from rankkit.bench import kept_positions_by_layer
    from rankkit.errors import RankkitError

    runner = Runner(tiny_model("llama"))
    heads = runner.model.config.num_key_value_heads
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(0))
    streaming = kept_positions_by_layer(runner, make("streamingllm"), ids, Budget.from_tokens(12), [0, 2])
    # StreamingLLM keeps the 4 sink tokens and the most recent ones, in every head of every layer.
    assert streaming == {layer: [[0, 1, 2, 3, *range(32, 40)]] * heads for layer in (0, 2)}
    full = kept_positions_by_layer(runner, make("full"), ids, Budget.from_keep(1.0), [1])
    assert full == {1: [list(range(40))] * heads}
    with pytest.raises(RankkitError, match="out of range"):
        kept_positions_by_layer(runner, make("full"), ids, Budget.from_keep(1.0), [runner.num_layers])


@pytest.mark.integration
def test_prefill_cli_lists_a_kv_only_methods_kept_positions_per_layer_and_head(tmp_path, default_model):
    model, _ = default_model
    payload = _prefill_json(tmp_path, "--method", "snapkv", "--keep", "0.5", "--kept-layers", "0,29")
    kept = payload["kept_positions_by_layer"]
    assert set(kept) == {"0", "29"}
    length = payload["length"]
    for heads in kept.values():
        assert len(heads) == model.config.num_key_value_heads
        for positions in heads:
            # SnapKV keeps a budget of its best tokens per head, the observation window among them.
            assert positions == sorted(set(positions)) and length - 1 in positions
            assert len(positions) == -(-length // 2)  # Budget.resolve: ceil(keep * T)


def test_summary_resamples_the_clusters_of_examples_that_share_a_haystack_or_needle():
    import numpy as np
    import polars as pl

    from rankkit.eval.stats import bootstrap_means

    scores = [0.5, 0.0, 0.5, 1.0]
    frame = pl.DataFrame(
        {
            "example_id": ["e0", "e1", "e2", "e3"],
            "cluster": ["niah-needle0", "niah-needle0", "niah-needle1", None],  # None: its own
            "method": ["claa"] * 4,
            "budget": ["keep=0.1"] * 4,
            "keep": [0.1] * 4,
            "score": scores,
            **{
                name: [0.5, 0.6, 0.7, 0.8] for name in ("ttft_ratio", "tpot_ratio", "kv_ratio", "ideal_ratio")
            },
            **{name: [1.0] * 4 for name in ("ttft_s", "tpot_s", "kv_bytes", "peak_mem_bytes")},
        }
    )
    (row,) = summary(frame).to_dicts()
    assert (row["n_examples"], row["n_clusters"]) == (4, 3)
    _, low, high, _ = bootstrap_means(np.array(scores)[:, None], np.array([0, 0, 1, 2]))
    assert (row["accuracy_ci_low"], row["accuracy_ci_high"]) == pytest.approx((low[0], high[0]))
    assert "n_clusters" not in summary(frame.drop("cluster")).columns


def _bench_rows(layers: dict[int | None, float]) -> pl.DataFrame:
    """Four examples of one method and budget at each layer setting, scored ``layers[setting]``."""
    return pl.DataFrame(
        [
            {
                "example_id": f"e{index}", "method": "claa", "budget": "keep=0.1", "keep": 0.1,
                "layer_setting": layer, "score": score, "ttft_ratio": 0.5, "tpot_ratio": 1.0,
                "kv_ratio": 0.1, "ideal_ratio": 0.5, "ttft_s": 1.0, "tpot_s": 0.1, "kv_bytes": 1.0,
                "peak_mem_bytes": 1.0,
            }
            for layer, score in layers.items()
            for index in range(4)
        ]
    )  # fmt: skip


def test_summary_refuses_two_rows_of_one_example_instead_of_keeping_the_last():
    """A sweep's bench at layers [12, 14] holds each example twice: its accuracy was the last rows'
    alone (0.0 here), where the layers' own are 1.0 and 0.0."""
    from rankkit.errors import RankkitError

    with pytest.raises(RankkitError, match="example_id e0 has more than one row in the group of method claa"):
        summary(_bench_rows({12: 1.0, 14: 0.0}))
    twice = _bench_rows({12: 1.0})
    with pytest.raises(RankkitError, match="more than one row of example_id e0, method claa"):
        summary(pl.concat([twice, twice]))
    for layer, score in ((12, 1.0), (14, 0.0)):
        (row,) = summary(_bench_rows({layer: score})).to_dicts()
        assert (row["accuracy"], row["n_examples"]) == (score, 4)


def test_every_method_fills_evidence_kept_kv_only_ones_from_the_cache_decoding_starts_with():
    """KV-only methods: the share of the evidence each KV head's cache holds after prefill, averaged
    over heads and layers (what ``kept_positions_by_layer`` reads off one more prefill); full: all."""
    from rankkit.bench import kept_positions_by_layer

    runner = Runner(tiny_model("llama"))
    example, prompt = _example(0)
    budget = Budget.from_keep(0.25)
    methods = [make("full"), make("snapkv", window_size=4), make("streamingllm")]
    frame = run_bench(
        runner, DigitTokenizer(), [example], methods, [budget], BenchSettings(max_new_tokens=2, warmup=0),
        prompt_for=lambda _: prompt,
    )  # fmt: skip
    kept = dict(zip(frame["method"], frame["evidence_kept"], strict=True))
    assert kept["full"] == 1.0
    evidence = {10, 11, 12, 13}
    for method in methods[1:]:
        layers = kept_positions_by_layer(
            runner, method, prompt.input_ids, budget, list(range(runner.num_layers))
        )
        shares = [len(evidence & set(head)) / 4 for heads in layers.values() for head in heads]
        assert kept[method.name] == pytest.approx(sum(shares) / len(shares)), method.name
    assert kept["streamingllm"] == 0.0  # sinks and the recent window, none of the evidence


def test_budget_tokens_is_what_each_method_kept_when_a_budget_is_below_what_it_always_keeps():
    """A budget of 2 tokens is raised to a method's window (and one ranked token, for ASL): the row
    said 2 while the method kept 9 or 4."""
    runner = Runner(tiny_model("llama"))
    example, prompt = _example(0)
    methods = [make("full"), make("fastkv", window_size=4), make("asl", window_size=8), make("lava", window_size=4)]
    frame = run_bench(
        runner, DigitTokenizer(), [example], methods, [Budget.from_tokens(2)], BenchSettings(max_new_tokens=2, warmup=0),
        prompt_for=lambda _: prompt,
    )  # fmt: skip
    rows = {row["method"]: row for row in frame.iter_rows(named=True)}
    assert rows["fastkv"]["budget_tokens"] == len(rows["fastkv"]["selected_positions"]) == 4
    assert rows["asl"]["budget_tokens"] == len(rows["asl"]["selected_positions"]) == 9
    # lava keeps a set per KV head: its window, in every head of every layer
    assert rows["lava"]["budget_tokens"] == 4 and rows["lava"]["kv_tokens_per_layer"] == [4.0] * 3


@pytest.mark.parametrize(
    "spec, options, refusal",
    [
        ("oracle:mirror=claa", {"mirror": "gemfilter"}, "--mirror gemfilter contradicts oracle:mirror=claa"),
        ("specprefill:draft_model=layers:2", {"draft": "layers:4"}, "--draft layers:4 contradicts specprefill:draft_model=layers:2"),
        ("claa:pruning_layer=5", {"layer": 10}, "--layer 10 contradicts claa:pruning_layer=5"),
    ],
)
def test_an_option_contradicting_the_method_spec_is_refused_and_an_equal_one_passes(spec, options, refusal):
    """The spec silently won over --mirror and --draft, and --layer silently won over the spec."""
    from rankkit.bench import MethodOptions
    from rankkit.errors import RankkitError

    with pytest.raises(RankkitError, match=f"^{refusal}; give one of them$"):
        MethodOptions(**options).build([spec], 30, strict=True)
    (parameter, value), = parse_spec_params(spec)
    agreeing = {name: value for name in options}
    (method,) = MethodOptions(**agreeing).build([spec], 30, strict=True)
    assert getattr(method, parameter) == value


@pytest.mark.parametrize(
    "options, refusal",
    [
        ({"mirror": "claa"}, "--mirror sets oracle's mirror, and no oracle is among the methods: drop --mirror, or add oracle"),
        ({"draft": "layers:4"}, "--draft sets specprefill's draft, and no specprefill is among the methods: drop --draft, or add specprefill"),
    ],
)
def test_an_option_for_a_method_the_run_does_not_name_is_refused(options, refusal):
    """bench ran full and claa to the end with --mirror claa, which set nothing."""
    from rankkit.bench import MethodOptions
    from rankkit.errors import RankkitError

    with pytest.raises(RankkitError, match=f"^{re.escape(refusal)}$"):
        MethodOptions(**options).build(["full", "claa"], 30, strict=False)


def parse_spec_params(spec: str) -> list:
    from rankkit.eval.offline import parse_method_spec

    return list(parse_method_spec(spec)[1].items())


def test_run_options_set_methods_whose_spec_leaves_them_out():
    from rankkit.bench import MethodOptions

    with pytest.warns(UserWarning, match="specprefill takes no layer"):
        oracle, specprefill, claa = MethodOptions(10, "layers:4", "claa").build(
            ["oracle", "specprefill", "claa"], 30, strict=False
        )
    assert (oracle.mirror, oracle.pruning_layer) == ("claa", 10)
    assert (specprefill.draft_model, claa.pruning_layer) == ("layers:4", 10)
    (default_oracle,) = MethodOptions().build(["oracle:pruning_layer=4"], 30, strict=True)
    assert (default_oracle.mirror, default_oracle.pruning_layer) == ("fastkv", 4)
