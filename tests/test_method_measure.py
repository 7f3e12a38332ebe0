"""``rankkit.methods.measure``: the compute model's arithmetic against hand-computed values, and
``run_once`` / ``measure`` reducing scripted (never wall-clock) durations to TTFT, TPOT and E2E."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from conftest import tiny_model

from rankkit.measure import Measurement
from rankkit.methods import Budget, Pass, make
from rankkit.methods import measure as measure_module
from rankkit.methods.base import LOOKAHEAD
from rankkit.methods.measure import CostModel, calibrate, measure, run_once
from rankkit.runner import Runner

# a = 2 s per token per layer, b = 3 s per query-key pair per layer: small integers, exact in floats
MODEL = CostModel(linear=2.0, quadratic=3.0)


def test_prefills_seconds_is_layers_times_linear_tokens_plus_quadratic_squares():
    # two prefills of 4 and 6 tokens on 5 layers: 5 * (2 * (4 + 6) + 3 * (16 + 36)) = 5 * 176
    assert MODEL.prefills_seconds(5, 10, 52) == 880.0
    # one prefill of n tokens is L full-prefill layers, each a·n + b·n·n
    assert MODEL.prefills_seconds(3, 7, 49) == 3 * MODEL.layer_cost(7, 7) == 3 * (14 + 147)


def test_layer_cost_and_cost_sum_every_executed_layer_of_every_pass():
    assert MODEL.layer_cost(4, 10) == 2 * 4 + 3 * 4 * 10
    passes = [Pass.prefill("selection", [8, 8]), Pass("main", [2, 2, 2], [8, 8, 8])]
    # 2 * (2*8 + 3*64) + 3 * (2*2 + 3*2*8) = 2 * 208 + 3 * 52
    assert MODEL.cost(passes) == 572.0


def test_ideal_ratio_prices_passes_over_a_full_prefill_and_charges_lookahead_layers_a_decode_step():
    full = 4 * MODEL.layer_cost(8, 8)  # 4 layers of 8 tokens: 4 * 208
    pruned = [Pass.prefill("main", [8, 8, 2, 2])]  # 2 * 208 + 2 * (4 + 12)
    assert MODEL.ideal_ratio(pruned, 8, 4) == (2 * 208 + 2 * 16) / full
    draft = [Pass.prefill("draft", [8, 8]), Pass(LOOKAHEAD, [1, 1, 1], [9, 9, 9]), *pruned]
    others = 2 * 208 + 2 * 208 + 2 * 16
    # without a measured decode step a lookahead layer costs a·1 + b·1·m
    assert MODEL.ideal_ratio(draft, 8, 4) == (others + 3 * (2 + 27)) / full
    # with one, each lookahead layer costs it instead, whatever its keys
    assert MODEL.ideal_ratio(draft, 8, 4, decode_layer_s=100.0) == (others + 3 * 100.0) / full
    # a decode step's price changes nothing when no pass is a lookahead
    assert MODEL.ideal_ratio(pruned, 8, 4, decode_layer_s=100.0) == (2 * 208 + 2 * 16) / full


def test_fit_falls_back_to_one_term_when_least_squares_makes_the_other_negative():
    # per layer (L = 2): 1 s at n = 1, 1 s at n = 2 -> lstsq wants b < 0: all cost is linear
    linear_only = CostModel.fit([(1, 2.0), (2, 2.0)], num_layers=2)
    assert linear_only.linear == pytest.approx(2 / 3) and linear_only.quadratic == 0.0
    # per layer: 1 s at n = 1, 8 s at n = 2 -> lstsq wants a < 0: all cost is quadratic
    quadratic_only = CostModel.fit([(1, 2.0), (2, 16.0)], num_layers=2)
    assert quadratic_only.linear == 0.0 and quadratic_only.quadratic == pytest.approx((1 + 8 * 4) / (1 + 16))
    assert quadratic_only.samples == [(1, 2.0), (2, 16.0)]


class ScriptedTimeline:
    """A ``Timeline`` whose marks are spaced by scripted seconds, one script per run, in order."""

    scripts: list[list[float]] = []
    made = 0

    def __init__(self, device):
        self.script = iter(ScriptedTimeline.scripts[ScriptedTimeline.made])
        ScriptedTimeline.made += 1
        self.marks: list[float] = []

    def mark(self) -> None:
        self.marks.append(self.marks[-1] + next(self.script) if self.marks else 0.0)

    def finish(self) -> None:
        pass

    def seconds(self, start: int, end: int) -> float:
        return self.marks[end] - self.marks[start]


@pytest.fixture
def scripted(monkeypatch):
    """Set ``ScriptedTimeline.scripts`` (the seconds to each run's tokens); returns the class."""
    monkeypatch.setattr(measure_module, "Timeline", ScriptedTimeline)
    monkeypatch.setattr(ScriptedTimeline, "scripts", [])
    monkeypatch.setattr(ScriptedTimeline, "made", 0)
    return ScriptedTimeline


@pytest.fixture(scope="module")
def runner():
    return Runner(tiny_model("llama"))


PROMPT = torch.arange(3, 11)  # 8 tokens


def test_run_once_times_the_first_token_then_the_mean_decode_step(scripted, runner):
    scripted.scripts = [[5.0, 1.0, 3.0, 2.0], [4.0]]  # 4 tokens; then a one-token answer
    run = run_once(runner, make("full"), PROMPT, Budget.from_keep(1.0), 4)
    assert len(run.tokens) == 4
    assert (run.ttft_s, run.e2e_s, run.tpot_s) == (5.0, 11.0, 2.0)
    single = run_once(runner, make("full"), PROMPT, Budget.from_keep(1.0), 1)
    assert (single.ttft_s, single.e2e_s, single.tpot_s) == (4.0, 4.0, None)


def test_measure_prepares_then_reports_the_median_of_the_timed_runs(scripted, runner):
    method, tokenizers = make("full"), []
    method.prepare = lambda runner, input_ids, *, tokenizer: tokenizers.append(tokenizer)
    # TTFT 5, 1, 3 -> 3; E2E 7, 5, 11 -> 7; TPOT 1, 2, 4 -> 2
    scripted.scripts = [[5.0, 1.0, 1.0], [1.0, 2.0, 2.0], [3.0, 4.0, 4.0], [9.0, 9.0, 9.0]]
    tokenizer = object()
    run = measure(
        runner, method, PROMPT, Budget.from_keep(1.0), 3, tokenizer=tokenizer, warmup_runs=0, repeats=3
    )
    assert scripted.made == 3 and tokenizers == [tokenizer]
    assert (run.ttft_s, run.e2e_s, run.tpot_s) == (3.0, 7.0, 2.0)
    assert run.method == "full" and run.prompt_length == 8 and len(run.tokens) == 3
    assert run.peak_mem_bytes is None  # no warm-up tracked it, and a CPU timed run does not


class FixedPeakTracker:
    """A ``TensorMemoryTracker`` that reports a fixed peak without tracking any operator."""

    peak = 1234

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_measure_defaults_to_one_warm_up_and_one_timed_run(scripted, runner, monkeypatch):
    monkeypatch.setattr(measure_module, "TensorMemoryTracker", FixedPeakTracker)
    scripted.scripts = [[100.0, 100.0], [6.0, 2.0], [50.0, 50.0]]
    run = measure(runner, make("full"), PROMPT, Budget.from_keep(1.0), 2, tokenizer=None)
    assert scripted.made == 2
    assert (run.ttft_s, run.e2e_s, run.tpot_s) == (6.0, 8.0, 2.0)
    assert run.peak_mem_bytes == 1234  # the CPU warm-up's tracked peak, not the timed run's None


class RecordingRunner:
    """Enough of a ``Runner`` for ``calibrate``: records the length of every prefill it is asked for."""

    device = torch.device("cpu")
    num_layers = 2

    def __init__(self):
        self.lengths: list[int] = []

    def prefill(self, input_ids):
        self.lengths.append(int(input_ids.numel()))


def test_calibrate_times_prefixes_in_rounds_and_fits_each_length_fastest_time(monkeypatch):
    durations = iter([9.0, 5.0, 1.0, 8.0, 4.0, 3.0, 7.0, 6.0, 2.0])  # rounds of lengths 8, 4, 1

    @contextmanager
    def scripted_block(device):
        block = Measurement()
        yield block
        block.seconds = next(durations)

    monkeypatch.setattr(measure_module, "timed_block", scripted_block)
    runner = RecordingRunner()
    fitted = calibrate(runner, torch.arange(8).reshape(1, 8), fractions=(1.0, 0.5, 0.1))
    # one untimed warm-up of the whole prompt, then three rounds; 0.1 of 8 tokens is still one token
    assert runner.lengths == [8] + [8, 4, 1] * 3
    assert fitted.samples == [(8, 7.0), (4, 4.0), (1, 1.0)]
    assert fitted == CostModel.fit([(8, 7.0), (4, 4.0), (1, 1.0)], num_layers=2)
