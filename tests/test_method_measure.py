"""``rankkit.methods.measure``: the compute model's arithmetic against hand-computed values, and
``run_once`` / ``measure`` reducing scripted (never wall-clock) durations to TTFT, TPOT and E2E; the
FFNs' timing against pauses of known length."""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from conftest import tiny_model

from rankkit.measure import Measurement
from rankkit.methods import Budget, Pass, make
from rankkit.methods import measure as measure_module
from rankkit.methods.base import LOOKAHEAD
from rankkit.methods.measure import (
    CostModel,
    Measured,
    MethodRun,
    calibrate,
    measure,
    run_once,
    timed_block,
    warm_up,
)
from rankkit.runner import Runner

# a = 2 s per token per layer (3/4 of it the FFN's), b = 3 s per query-key pair per layer, an LM head
# worth 4 layers: exact in floats
MODEL = CostModel(linear=2.0, quadratic=3.0, ffn_share=0.75, head_layers=4.0)


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
    with pytest.raises(ValueError):  # a pass names the keys of every layer it names queries for
        MODEL.cost([Pass("main", [2, 2], [8])])


def test_a_layer_whose_ffn_ran_on_fewer_tokens_is_charged_the_ffns_share_of_a_for_those():
    # 8 queries over 8 keys, the FFN on 2 of them: 2 * (1/4 * 8 + 3/4 * 2) + 3 * 64
    assert MODEL.layer_cost(8, 8, 2) == 2 * (2 + 1.5) + 192
    assert MODEL.layer_cost(8, 8, 8) == MODEL.layer_cost(8, 8) == 2 * 8 + 192
    pruned_between = Pass("main", [8, 8, 2], [8, 8, 2], ffn_queries=[8, 2, 2])
    assert MODEL.cost([pruned_between]) == 208 + 199 + (4 + 12)
    assert MODEL.ideal_ratio([pruned_between], 8, 3) == (208 + 199 + 16) / (3 * 208)
    with pytest.raises(ValueError):  # FFN queries for every layer the pass ran
        MODEL.cost([Pass("main", [8, 8], [8, 8], ffn_queries=[8])])


def test_ideal_ratio_prices_passes_over_a_full_prefill_and_charges_lookahead_layers_a_decode_step():
    full = 4 * MODEL.layer_cost(8, 8)  # 4 layers of 8 tokens: 4 * 208
    pruned = [Pass.prefill("main", [8, 8, 2, 2])]  # 2 * 208 + 2 * (4 + 12)
    assert MODEL.ideal_ratio(pruned, 8, 4) == (2 * 208 + 2 * 16) / full
    # a draft of one layer: 3 lookahead steps, 4 LM heads (the prefill's and each step's)
    draft = [Pass.prefill("draft", [8, 8]), Pass(LOOKAHEAD, [1, 1, 1], [9, 9, 9], heads=4), *pruned]
    others = 2 * 208 + 2 * 208 + 2 * 16
    # without a measured decode step a lookahead layer costs a·1 + b·1·m, a head a·4
    assert MODEL.ideal_ratio(draft, 8, 4) == (others + 3 * (2 + 27) + 4 * 2 * 4) / full
    # with one (4 layers and a head worth 4: 80 s a layer), its layers and heads cost their share
    assert MODEL.ideal_ratio(draft, 8, 4, decode_step_s=640.0) == (others + (3 + 4 * 4) * 80.0) / full
    # a decode step's price changes nothing when no pass is a lookahead
    assert MODEL.ideal_ratio(pruned, 8, 4, decode_step_s=640.0) == (2 * 208 + 2 * 16) / full


@pytest.mark.parametrize(
    ("family", "ffn_flops"),  # per token, with an LM head of 2 x 64 x 97 (the tiny vocabulary)
    [
        ("llama", 2 * 3 * 64 * 96),  # gate, up and down projections
        ("mixtral", 2 * (64 * 4 + 2 * 3 * 64 * 96)),  # the router over 4 experts, then 2 experts
        # the router, 2 experts of 32, the shared expert of 48 and its gate
        ("qwen2_moe", 2 * (64 * 4 + 2 * 3 * 64 * 32 + 3 * 64 * 48 + 64)),
    ],
)
def test_head_layers_are_the_lm_heads_flops_for_one_token_in_layers_worth(family, ffn_flops):
    # per token: q and o 64x64, k and v 64x32 (2 KV heads of 16); CPU's fused kernel for attention
    # over the one key reports no FLOPs (a CUDA kernel's 4 x 4 heads x 16 would move the share 0.4%)
    layer_flops = 2 * (2 * 64 * 64 + 2 * 64 * 32) + ffn_flops
    runner = Runner(tiny_model(family))
    head_layers = measure_module.head_layers(runner)
    assert head_layers == pytest.approx(2 * 64 * 97 / layer_flops, rel=1e-12)
    hooked = [
        name for name, module in runner.model.named_modules() if module._forward_hooks or module._forward_pre_hooks
    ]
    assert hooked == []  # every counting hook is gone: later prefills run as they did


def test_a_fit_prices_prompts_up_to_a_tenth_past_its_longest_sample():
    fitted = CostModel(1e-5, 1e-8, 0.5, 2.0, samples=[(10, 0.1), (45, 1.0)])
    assert fitted.covers(50) and not fitted.covers(51)  # 45 >= 0.9 x 50, 45 < 0.9 x 51


def test_ffns_timed_are_the_time_inside_every_layers_ffn_and_nothing_else(monkeypatch):
    # 3 layers; each FFN made to take 50 ms more, each attention 250 ms more: one attention counted as an
    # FFN's is past the bound, while a busy machine's own time stays inside it (a slow CI's took 32 ms,
    # two test processes at once on two cores 148 ms)
    model = tiny_model("llama")
    for layer in model.model.layers:
        for module, pause in ((layer.mlp, 0.05), (layer.self_attn, 0.25)):
            module.register_forward_hook(lambda module, args, output, pause=pause: time.sleep(pause))
    runner, ids = Runner(model), torch.arange(16).reshape(1, 16)
    with measure_module.ffns_timed(runner) as ffns:
        runner.prefill(ids)
    seconds = ffns.seconds
    assert 3 * 0.05 <= seconds < 3 * 0.05 + 0.25
    with timed_block(runner.device) as prefill:  # the hooks are gone: the FFNs' marks, not a whole prefill
        runner.prefill(ids)
    assert prefill.seconds >= 3 * (0.05 + 0.25) > seconds


def test_grouped_products_count_two_flops_per_multiply_add_in_each_layout():
    from torch.utils.flop_counter import FlopCounterMode

    def counted(*args, **kwargs) -> int:
        mapping = {torch.ops.aten._grouped_mm: measure_module._grouped_mm_flops}
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            torch._grouped_mm(*args, **kwargs)
        return counter.get_total_flops()

    bf16 = {"dtype": torch.bfloat16}
    offs = torch.tensor([2, 4, 6], dtype=torch.int32)
    # 6 token rows, each through one of 3 experts' 8x5 matrices (MoE blocks' layout)
    experts = torch.randn(3, 5, 8, **bf16).transpose(1, 2)
    assert counted(torch.randn(6, 8, **bf16), experts, offs=offs) == 2 * 6 * 8 * 5
    # 3 groups of 4 rows, batched
    assert counted(torch.randn(3, 4, 8, **bf16), experts) == 2 * 3 * 4 * 8 * 5
    # the groups split the shared dimension 24 into three of 8: 3 outputs of 8x8
    shared = torch.tensor([8, 16, 24], dtype=torch.int32)
    assert counted(torch.randn(24, 8, **bf16).t(), torch.randn(24, 8, **bf16), offs=shared) == 2 * 8 * 24 * 8


def test_fit_falls_back_to_one_term_when_least_squares_makes_the_other_negative():
    # per layer (L = 2): 1 s at n = 1, 1 s at n = 2 -> lstsq wants b < 0: all cost is linear
    linear_only = CostModel.fit([(1, 2.0), (2, 2.0)], num_layers=2, ffn_seconds=0.5, head_layers=4.0)
    assert linear_only.linear == pytest.approx(2 / 3) and linear_only.quadratic == 0.0
    assert linear_only.ffn_share == pytest.approx(0.5 / (2 / 3)) and linear_only.head_layers == 4.0
    # per layer: 1 s at n = 1, 8 s at n = 2 -> lstsq wants a < 0: all cost is quadratic, and the FFN's
    # share of an a of 0 is all of it
    quadratic_only = CostModel.fit([(1, 2.0), (2, 16.0)], num_layers=2, ffn_seconds=0.5, head_layers=4.0)
    assert quadratic_only.linear == 0.0 and quadratic_only.quadratic == pytest.approx((1 + 8 * 4) / (1 + 16))
    assert quadratic_only.samples == [(1, 2.0), (2, 16.0)] and quadratic_only.ffn_share == 1.0
    # FFNs timed above a (noise, or a timer's cost) take the whole of it
    assert CostModel.fit([(1, 2.0), (2, 2.0)], num_layers=2, ffn_seconds=0.7, head_layers=4.0).ffn_share == 1.0


def test_fit_is_exact_in_float64_for_long_prompts_and_numpy_typed_samples():
    # per layer (L = 3): 1 s at 60k tokens, 8 s at 120k -> a < 0 -> b = sum(t n^2) / sum(n^4), where
    # n^4 (2e20 at 120k) is past the int64 range: the lengths must be floats before any power
    fitted = CostModel.fit([(60000, 3.0), (120000, 24.0)], num_layers=3, ffn_seconds=1e-9, head_layers=4.0)
    assert fitted.linear == 0.0
    assert fitted.quadratic == (1.0 * 60000.0**2 + 8.0 * 120000.0**2) / (60000.0**4 + 120000.0**4)
    # lengths and seconds as a numpy frame hands them (int32, float32) fit as the same Python numbers
    typed = [(np.int32(60000), np.float32(3.1)), (np.int32(120000), np.float32(24.7))]
    plain = [(int(tokens), float(seconds)) for tokens, seconds in typed]
    assert CostModel.fit(typed, num_layers=7, ffn_seconds=1e-9, head_layers=4.0) == CostModel.fit(
        plain, num_layers=7, ffn_seconds=1e-9, head_layers=4.0
    )


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
    scripted.scripts = [[5.0, 1.0, 3.0, 2.0], [2.0, 1.5], [4.0]]  # 4 tokens; 2 tokens; a one-token answer
    run = run_once(runner, make("full"), PROMPT, Budget.from_keep(1.0), 4)
    assert len(run.tokens) == 4 and run.prompt_length == 8 and run.budget == "keep=1"
    assert (run.ttft_s, run.e2e_s, run.tpot_s) == (5.0, 11.0, 2.0)
    assert (run.first_step_s, run.later_steps_s) == (1.0, 2.5)  # the steps took 1, then 3 and 2
    # 3 layers x (key, value) x 2 KV heads x 8 tokens x 16 dims x 4 bytes, every position in every head
    assert run.kv_bytes == 3 * 2 * 2 * 8 * 16 * 4 and run.kv_tokens_per_layer == [8.0, 8.0, 8.0]
    assert [positions.tolist() for positions in run.cache_positions] == [[list(range(8))] * 2] * 3
    assert run.passes == [Pass.prefill("main", [8, 8, 8])] and run.live_tokens == [8, 8, 8]
    assert (run.kept_positions, run.selection_layer, run.peak_mem_bytes) == (None, None, None)

    one_step = run_once(runner, make("full"), PROMPT, Budget.from_keep(1.0), 2)
    assert (one_step.ttft_s, one_step.tpot_s, one_step.first_step_s, one_step.later_steps_s) == (2.0, 1.5, 1.5, None)

    single = run_once(runner, make("gemfilter"), PROMPT, Budget.from_tokens(4), 1)
    assert (single.ttft_s, single.e2e_s, single.tpot_s) == (4.0, 4.0, None)
    assert (single.first_step_s, single.later_steps_s) == (None, None)
    assert single.params == {"routing_layer": 1, "kernel_size": 5}  # resolved for 3 layers
    kept = single.kept_positions
    assert isinstance(kept, list) and len(kept) == 4 and kept[-1] == 7 and single.selection_layer == 1
    assert [positions.tolist() for positions in single.cache_positions] == [[kept] * 2] * 3
    assert single.kv_bytes == 3 * 2 * 2 * 4 * 16 * 4 and single.kv_tokens_per_layer == [4.0, 4.0, 4.0]
    assert single.passes == [Pass.prefill("selection", [8, 8]), Pass.prefill("main", [4, 4, 4])]


def test_run_once_records_the_parameters_the_model_resolves_them_to_and_reused_buffers_as_memory(
    scripted, monkeypatch
):
    """On a model with local layers a method's default layers move to global ones: the run records
    what ran. On a device with an allocator peak, the kept decode buffers the run reused are its memory."""
    runner = Runner(tiny_model("gemma2"))
    method, layers = make("sliminfer"), runner.num_layers
    assert method.resolved(layers, runner.layer_types) != method.resolved(layers)  # else this checks nothing

    class DevicePeak:
        def __init__(self, device):
            pass

        def bytes(self):
            return 1000

    monkeypatch.setattr(measure_module, "PeakMemory", DevicePeak)
    monkeypatch.setattr(runner, "reused_static_bytes", lambda kept: 24)
    scripted.scripts = [[1.0, 1.0]]
    run = run_once(runner, method, PROMPT, Budget.from_tokens(4), 2)
    assert run.params == method.resolved(layers, runner.layer_types)
    assert run.peak_mem_bytes == 1024


def test_measure_prepares_then_reports_the_median_of_the_timed_runs(scripted, runner):
    method, tokenizers = make("full"), []
    method.prepare = lambda runner, input_ids, *, tokenizer: tokenizers.append(tokenizer)
    # TTFT 5, 1, 3 -> 3; E2E 7, 5, 11 -> 7; TPOT 1, 2, 4 -> 2; first steps 1, 2, 6 -> 2; later 1, 2, 2 -> 2
    scripted.scripts = [[5.0, 1.0, 1.0], [1.0, 2.0, 2.0], [3.0, 6.0, 2.0], [9.0, 9.0, 9.0]]
    tokenizer = object()
    run = measure(
        runner, method, PROMPT, Budget.from_keep(1.0), 3, tokenizer=tokenizer, warmup_runs=0, repeats=3
    )
    assert scripted.made == 3 and tokenizers == [tokenizer]
    assert (run.ttft_s, run.e2e_s, run.tpot_s) == (3.0, 7.0, 2.0)
    assert (run.first_step_s, run.later_steps_s) == (2.0, 2.0)
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


def scripted_blocks(seconds):
    """A ``timed_block`` or ``ffns_timed`` whose block takes the next of ``seconds`` each time."""

    @contextmanager
    def timed(device_or_runner):
        block = Measurement()
        yield block
        block.seconds = next(seconds)

    return timed


def test_calibrate_times_prefixes_in_rounds_and_fits_each_length_fastest_time(monkeypatch):
    durations = iter([9.0, 5.0, 1.0, 8.0, 4.0, 3.0, 7.0, 6.0, 2.0])  # rounds of lengths 8, 4, 1
    # the FFNs in each prefill, rounds of lengths 8, 4, 1: the whole prompt's are the ones read
    in_ffns = iter([3.0, 0.1, 0.1, 1.5, 0.1, 0.1, 2.5, 0.1, 0.1])

    monkeypatch.setattr(measure_module, "timed_block", scripted_blocks(durations))
    monkeypatch.setattr(measure_module, "head_layers", lambda runner: 2.0)
    monkeypatch.setattr(measure_module, "ffns_timed", scripted_blocks(in_ffns))
    runner = RecordingRunner()
    fitted = calibrate(runner, torch.arange(8).reshape(1, 8), fractions=(1.0, 0.5, 0.1))
    # one untimed warm-up of the whole prompt, then three rounds; 0.1 of 8 tokens is still one token
    assert runner.lengths == [8] + [8, 4, 1] * 3
    assert fitted.samples == [(8, 7.0), (4, 4.0), (1, 1.0)]
    # the fastest round's FFNs: 1.5 s over 2 layers x 8 tokens, per token and layer
    assert fitted == CostModel.fit([(8, 7.0), (4, 4.0), (1, 1.0)], num_layers=2, ffn_seconds=1.5 / 16, head_layers=2.0)
    assert 0 < fitted.ffn_share < 1


def test_calibrate_takes_the_whole_of_a_for_ffns_timed_above_it(monkeypatch):
    monkeypatch.setattr(measure_module, "head_layers", lambda runner: 2.0)
    monkeypatch.setattr(measure_module, "ffns_timed", scripted_blocks(iter([1e6, 1e6, 1e6])))
    assert calibrate(RecordingRunner(), torch.arange(8).reshape(1, 8), repeats=1).ffn_share == 1.0


def _run(ttft: float, tpot: float | None, e2e: float, peak: int | None = None) -> MethodRun:
    return MethodRun("m", {}, "keep=1", 10, [1, 2], ttft, tpot, e2e, 100, [10.0], [10], [], None, peak)


def test_measured_takes_medians_and_the_warm_up_peak_and_pairs_ratios_by_round():
    runs = Measured([_run(4.0, 1.0, 9.0, 7), _run(2.0, 3.0, 5.0, 7), _run(6.0, 2.0, 8.0, 7)])
    median = runs.run
    assert (median.ttft_s, median.tpot_s, median.e2e_s, median.peak_mem_bytes) == (4.0, 2.0, 8.0, 7)
    assert runs.runs[-1].ttft_s == 6.0  # the runs themselves are left as they were
    one_token = Measured([_run(4.0, None, 4.0), _run(2.0, None, 2.0)], warmup_peak_bytes=99).run
    assert (one_token.ttft_s, one_token.tpot_s, one_token.peak_mem_bytes) == (3.0, None, 99)
    reference = Measured([_run(8.0, 2.0, 1.0), _run(1.0, 0.0, 1.0), _run(2.0, None, 1.0)])
    # TTFT ratios 0.5, 2, 3 -> 2; TPOT: round 2's reference is 0 and round 3's is None -> 1 / 2 alone
    assert runs.ratio_to(reference, "ttft_s") == 2.0
    assert runs.ratio_to(reference, "tpot_s") == 0.5
    assert one_token.tpot_s is None
    assert Measured([_run(1.0, None, 1.0)]).ratio_to(Measured([_run(1.0, 1.0, 1.0)]), "tpot_s") is None
    with pytest.raises(ValueError):  # rounds pair one to one
        runs.ratio_to(Measured(reference.runs[:2]), "ttft_s")


def test_warm_up_prepares_once_and_tracks_memory_in_the_first_run_only(scripted, runner, monkeypatch):
    trackers = []

    class CountingTracker(FixedPeakTracker):
        def __enter__(self):
            trackers.append(self)
            return self

    monkeypatch.setattr(measure_module, "TensorMemoryTracker", CountingTracker)
    method, prepared = make("full"), []
    method.prepare = lambda runner, input_ids, *, tokenizer: prepared.append(tokenizer)
    scripted.scripts = [[1.0], [1.0], [1.0]]
    peak = warm_up(runner, method, PROMPT, Budget.from_keep(1.0), 1, tokenizer="tok", runs=3)
    assert (peak, len(trackers), scripted.made, prepared) == (1234, 1, 3, ["tok"])
    assert warm_up(runner, method, PROMPT, Budget.from_keep(1.0), 1, tokenizer="tok", runs=0) is None
