"""No host synchronisation per layer, head or decode step: what the host reads from tensors while a
method runs is counted on CPU, where every such read would make a GPU wait for the device.

Counted: scalar reads (``aten::_local_scalar_dense``: ``.item()``, ``int(t)``, ``float(t)``,
``bool(t)``), ``torch.equal``, operators whose output size depends on the data (``nonzero``,
boolean indexing, ``unique``, ``masked_select``), ``.tolist()``/``.numpy()``, and tensors made
from host values (``torch.tensor``, ``as_tensor`` of numbers, ``from_numpy``, indexing with a
list: ``aten::lift_fresh``), which on CUDA are copies to the device that wait for it unless they
come from page-locked memory. A Python number assigned into a slice is no such copy (CUDA fills
it on the device), so it is left out. Ranking sorts as on CUDA (the CPU's compiled sort goes
through numpy). The count of a prefill and of a decode step must not grow with the number of
layers or of heads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial

import pytest
import torch
from conftest import own_position_writes
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from rankkit.measure import OperatorLaunches, launches_of
from rankkit.methods import REGISTRY, Budget, make
from rankkit.methods.selection import sorting_as_on_cuda
from rankkit.overhead import step_dispatches
from rankkit.runner import Runner, greedy_continue

SYNCING_OPERATORS = {
    "aten._local_scalar_dense.default",
    # indexing with a 0-d integer tensor (``t[i]``) reads ``i`` through ``item`` in C++, which neither
    # the Python-level reads below nor ``_local_scalar_dense`` (not dispatched under it) see
    "aten.item.default",
    "aten.equal.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
}
SCALAR_OPERATORS = {"aten._local_scalar_dense.default", "aten.item.default"}  # what a Python-level read runs
# Scalar reads of inference tensors skip the Python dispatcher, so they are caught at the
# Python level too. ``.numpy()`` is left out: it needs a CPU tensor (a CPU-only path, rankkit.sorting).
SCALAR_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
}


HOST_VALUES = "aten.lift_fresh.default"  # a tensor made from host values, where CPU tensors come from


class HostReads(TorchDispatchMode):
    """Counts the operators that make the host wait for the device, by name."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.reading = False  # inside a scalar read already counted at the Python level
        self.filling = False  # inside a slice assignment of a Python number

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in SYNCING_OPERATORS and not (self.reading and name in SCALAR_OPERATORS):
            self.counts[name] += 1
        elif name == HOST_VALUES and not self.filling:
            self.counts["host values"] += 1
        elif name == "aten.index.Tensor" and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in args[1]
        ):
            self.counts["boolean indexing"] += 1
        return func(*args, **(kwargs or {}))


class ScalarReads(TorchFunctionMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__setitem__ and isinstance(args[2], bool | int | float):
            self.reads.filling = True
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.reads.filling = False
        if func not in SCALAR_READS:
            return func(*args, **(kwargs or {}))
        self.reads.counts[func.__name__] += 1
        self.reads.reading = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.reads.reading = False


class counting:
    """``with counting() as reads: ...``; ``reads.counts`` by operator or method name."""

    def __enter__(self) -> HostReads:
        self.reads = HostReads()
        self.scalars = ScalarReads(self.reads)
        self.sorting = sorting_as_on_cuda()
        self.sorting.__enter__()
        self.scalars.__enter__()
        self.reads.__enter__()
        return self.reads

    def __exit__(self, *exc):
        self.reads.__exit__(*exc)
        self.scalars.__exit__(*exc)
        self.sorting.__exit__(*exc)


LOCAL_WINDOW = 16  # a hybrid model's local layers see the last 16 of PROMPT's tokens


def _runner(layers: int, kv_heads: int, *, cuda_graphs: bool = False, hybrid: bool = False) -> Runner:
    """A tiny random Llama; ``hybrid``: a Qwen2 whose layers are local (a ``LOCAL_WINDOW`` window)
    and global by turns."""
    from transformers import AutoConfig, AutoModelForCausalLM

    local = {
        "layer_types": [("sliding_attention", "full_attention")[layer % 2] for layer in range(layers)],
        "use_sliding_window": True,
        "sliding_window": LOCAL_WINDOW,
    }
    config = AutoConfig.for_model(
        "qwen2" if hybrid else "llama",
        **(local if hybrid else {}),
        vocab_size=97,
        hidden_size=16 * kv_heads * 2,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return Runner(model, cuda_graphs=cuda_graphs)


SHAPES = [(2, 2), (4, 2), (2, 4)]  # (layers, kv heads): more layers, then more heads
DECODE_STEPS = 3
PROMPT = torch.randint(0, 97, (96,), generator=torch.Generator().manual_seed(3))


class NoTextTokenizer:
    def decode(self, tokens, **kwargs):
        return ""


def _prepared(name: str, layers: int, kv_heads: int, *, cuda_graphs: bool = False, hybrid: bool = False, **params):
    """A runner of that shape and method ``name`` prepared for ``PROMPT``."""
    runner = _runner(layers, kv_heads, cuda_graphs=cuda_graphs, hybrid=hybrid)
    method = make(name, **PARAMETERS.get(name, {}) | params)
    method.prepare(runner, PROMPT, tokenizer=NoTextTokenizer())
    return runner, method


def _reads(
    name: str, layers: int, kv_heads: int, *, cuda_graphs: bool = False, hybrid: bool = False, **params
) -> tuple[Counter, Counter]:
    """Host reads of one prefill, and of one decode step (the mean over ``DECODE_STEPS`` after the first,
    which the prefill's logits give, and the second, which starts the decode), of method ``name``."""
    runner, method = _prepared(name, layers, kv_heads, cuda_graphs=cuda_graphs, hybrid=hybrid, **params)
    budget = Budget.from_keep(0.5)
    with torch.inference_mode():
        method.prefill_for_decoding(runner, PROMPT, budget)  # warm-up: lazily built state is not a per-run cost
        with counting() as prefill:
            run = method.prefill_for_decoding(runner, PROMPT, budget)
        with counting() as first:
            greedy_continue(runner, run.result, 2, run.decode_hooks)
        with counting() as decode:
            run = method.prefill_for_decoding(runner, PROMPT, budget)
    del decode  # the prefill above only rebuilds the cache
    with torch.inference_mode(), counting() as steps:
        greedy_continue(runner, run.result, 2 + DECODE_STEPS, run.decode_hooks)
    per_step = {key: (value - first.counts[key]) / DECODE_STEPS for key, value in steps.counts.items()}
    return prefill.counts, Counter({key: value for key, value in per_step.items() if value})


# Methods that still read the device per layer, and why (each an xfail that fails once fixed).
PER_LAYER_READS = {
    # ASL Alg. 2 decides after each layer from L_min on whether the next one runs on every token or on
    # the kept ones: the next layer's shape waits on that decision, so keeping it on the device would
    # mean running the later layers on every token (the method's saving lost) or running them twice.
    "asl": "ASL Alg. 2 decides per layer from L_min whether the next layer is pruned: one read per layer",
    "asl-2pass": "ASL Alg. 2 decides per layer from L_min where the first pass stops: one read per layer",
}
# SlimInfer reads its choice of blocks once per pruning layer (Alg. 1 moves them between the host and
# the device): the paper's three layers, which a 2-layer model folds into one; one at every depth here.
PARAMETERS = {"sliminfer": {"pruning_layers": (0,)}}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=PER_LAYER_READS[name]))
        if name in PER_LAYER_READS
        else name
        for name in sorted(REGISTRY)
    ],
)
def test_host_reads_do_not_grow_with_layers_or_heads(name):
    counts = {shape: _reads(name, *shape) for shape in SHAPES}
    prefills = {shape: prefill for shape, (prefill, _) in counts.items()}
    steps = {shape: step for shape, (_, step) in counts.items()}
    assert prefills[(2, 2)] == prefills[(4, 2)] == prefills[(2, 4)], prefills
    assert steps[(2, 2)] == steps[(4, 2)] == steps[(2, 4)], steps


@pytest.mark.parametrize("name", sorted(set(REGISTRY) - set(PER_LAYER_READS)))
def test_host_reads_do_not_grow_with_a_hybrid_models_local_layers(name):
    """A per-head cut of a local layer read which keys the layer sees (snapkv, pyramidkv, tova and
    streamingllm two reads a local layer, sage-kv one): a fresh prefill's keys are positions
    0..S-1, so the host knows them (``AttentionCall.first_seen_key``). Rolling the local layers a
    pruned prefill left whole counts what each saw in one read (``Runner.roll_local_layers``)."""
    counts = {layers: _reads(name, layers, 2, hybrid=True) for layers in (2, 4)}
    assert counts[2] == counts[4], counts


def test_a_decode_step_reads_one_token_and_a_prefill_one_length():
    counts = {shape: _reads("full", *shape) for shape in SHAPES}
    assert all(prefill == Counter() for prefill, _ in counts.values())  # the prompt's length is its shape
    assert all(step == Counter({"__int__": 1}) for _, step in counts.values())  # the greedy token


def test_capture_reads_the_device_once_per_prefill():
    from rankkit.probes import ProbeRecorder, parse_probes

    for shape in SHAPES:
        runner = _runner(*shape)
        with torch.inference_mode():
            runner.prefill(PROMPT, hooks=[ProbeRecorder(parse_probes("all"))])  # warm-up
            with counting() as reads:
                recorder = ProbeRecorder(parse_probes("all"))
                runner.prefill(PROMPT, hooks=[recorder])
                recorder.scores()
        assert reads.counts == Counter({"__int__": 1}), shape  # the prompt length the scores are laid out by


@pytest.mark.parametrize(
    "name", ["full", "snapkv", "pyramidkv", "streamingllm", "fastkv", "claa", "gemfilter", "sage-kv", "tova", "oracle"]
)
def test_a_prefill_whose_shapes_the_host_knows_reads_nothing(name):
    """A two-pass method's second pass is told the prompt's length, not read from its positions."""
    for shape in SHAPES:
        assert _reads(name, *shape)[0] == Counter(), shape


# A static cache loaded from a prefill's takes each layer's write slot from the host, in one copy a
# decode (from page-locked memory on CUDA), not one a layer or a step.
STATIC_LOAD = {"host values": 1}


@pytest.mark.parametrize("cuda_graphs", [False, True])  # the draft's lookahead over its static cache
def test_specprefills_prefill_reads_only_the_drafts_lookahead_tokens(cuda_graphs):
    """Listing 3's k greedy lookahead tokens, each read as a decode step's token is; the draft's scores
    (``AnswerAttention``), the top-k and the second pass read nothing, whatever the layers and heads."""
    for shape in SHAPES:
        prefill, _ = _reads("specprefill", *shape, cuda_graphs=cuda_graphs, lookahead=3)
        loaded = STATIC_LOAD if cuda_graphs else {}  # the draft's static cache loads its prefill's
        assert prefill == Counter({"__int__": 3, **loaded}), shape


def test_kv_methods_with_ragged_heads_read_every_layers_width_once_after_the_prefill():
    for name in ("adakv", "lava"):
        for shape in SHAPES:
            assert _reads(name, *shape)[0] == Counter({"tolist": 1}), (name, shape)


@pytest.mark.parametrize("cuda_graphs", [False, True])  # Alg. 1 between the static decode's parts
def test_sliminfer_reads_each_pruning_layers_blocks_once_and_nothing_per_layer_it_governs(cuda_graphs):
    small_blocks = {"block_size": 8, "unit_size": 2, "window_size": 2}  # blocks move between the tiers
    for shape in [(3, 2), (5, 2), (3, 4)]:  # layer 1 governs one layer, then three
        prefill, step = _reads("sliminfer", *shape, cuda_graphs=cuda_graphs, pruning_layers=(0, 1), **small_blocks)
        # layers 0 and 1 prune; each lays out the layers it governs once for all of them
        assert prefill == Counter({"tolist": 2, "host values": 2}), shape
        assert step == Counter({"tolist": 2, "__int__": 1}), shape  # both govern layers; the greedy token
    runner = _runner(4, 2)
    runner.cuda_graphs = cuda_graphs
    method = make("sliminfer", pruning_layers=(0, 1), **small_blocks)
    with torch.inference_mode():
        run = method.prefill(runner, PROMPT, Budget.from_keep(0.3))
        greedy_continue(runner, run.result, 8, run.decode_hooks)
    assert any(decision.swapped for decision in run.decode_hooks[0].decisions)


@pytest.mark.parametrize("split", [False, True])  # SDPA's masked kernel, or the split path CUDA takes
def test_a_static_cache_decode_step_reads_only_the_token(split):
    for shape in SHAPES:
        runner = _runner(*shape)
        runner.cuda_graphs = True
        runner.split_decode_from = 0 if split else None
        with torch.inference_mode():
            greedy_continue(runner, runner.prefill(PROMPT), 1 + DECODE_STEPS)  # builds the static buffers
            first, steps = (runner.prefill(PROMPT) for _ in range(2))
            with counting() as one:
                greedy_continue(runner, first, 1)
            with counting() as more:
                greedy_continue(runner, steps, 1 + DECODE_STEPS)
        assert more.counts - one.counts == Counter({"__int__": DECODE_STEPS, **STATIC_LOAD}), shape


# Work at every decode step that full's has not (Alg. 1's scoring and block swaps; TOVA's eviction): more
# launches than full's, by design
STEERING_DECODE = {"sliminfer", "tova"}


DECODE_LAYERS = 2  # the model whose decode steps are counted


def _launches_per_decode_step(name: str, cuda_graphs: bool, layers: int = DECODE_LAYERS) -> float:
    runner, method = _prepared(name, layers, 2)
    runner.cuda_graphs = cuda_graphs
    with torch.inference_mode():
        run = method.prefill(runner, PROMPT, Budget.from_keep(0.5 if name != "full" else 1.0))
        step = runner.decoder(run.result, 2 + DECODE_STEPS, run.decode_hooks)
        token = torch.argmax(run.result.logits)
        for position in range(96, 98):  # the windows fill and start to roll
            token = torch.argmax(step(token, position))
        with OperatorLaunches() as launches:
            for position in range(98, 98 + DECODE_STEPS):
                token = torch.argmax(step(token, position))
    return launches.count / DECODE_STEPS


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_pruned_or_compressed_cache_decodes_with_no_more_launches_than_full(cuda_graphs):
    """Every method whose decode has no per-step Python launches at most full's operators per step: a
    rolling window writes where an append would, a padded layer's mask is made once. Full's layers hold
    the same positions, which one of them writes for all (``KVCache._append_positions``); a layer that
    holds others of its own (compressed, pruned) writes its own, one launch more."""
    full = _launches_per_decode_step("full", cuda_graphs)
    launches = {name: _launches_per_decode_step(name, cuda_graphs) for name in sorted(set(REGISTRY) - STEERING_DECODE)}
    own_positions = own_position_writes(DECODE_LAYERS, cuda_graphs)
    assert full > 0 and all(count <= full + own_positions for count in launches.values()), (full, launches)


# TOVA's decode step beyond full's, per layer. Eagerly: the new token's attention over a cache with no
# padding (logits, scale, softmax, the window and head sums: 5), its least attended entry (5) and the
# layer's last entry moved into its slot (keys, values, positions: 6), and the append of positions of its
# own, which full's layers share (1). Over the static cache: the
# attention with the mask of the buffer's padding (2 to make, the model's and its negation; 1 to
# apply), the least attended entry with an empty slot first (7), and that slot freed for the next step
# to write (2), where moving the step's entry into it took 11.
TOVA_STEP_LAUNCHES_PER_LAYER = {False: 17, True: 17}


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_tovas_step_launches_a_fixed_few_operators_a_layer_beyond_fulls(cuda_graphs):
    def beyond(layers: int) -> float:
        return _launches_per_decode_step("tova", cuda_graphs, layers) - _launches_per_decode_step("full", cuda_graphs, layers)

    assert _per_layer(beyond) == TOVA_STEP_LAUNCHES_PER_LAYER[cuda_graphs]


# A plain eager decode step's operators a layer beyond transformers' own step over its DynamicCache,
# views included: an 8B model's eager step is host-bound (docs/benchmarks.md, "GPU"), so these are its
# time beyond ``model.generate``'s: the step's keys and values appended in the cache's own room, each a
# write into the slots named once a step and a view (4), where transformers' cache concatenates them (2).
# The positions a pruned or compressed cache's masks need are written once a step for all the layers
# that hold the same, so they add nothing a layer.
PLAIN_STEP_DISPATCHES_BEYOND_TRANSFORMERS = 2


def test_a_plain_decode_step_dispatches_a_fixed_few_operators_a_layer_beyond_transformers_step():
    def beyond(layers: int) -> int:
        ours, theirs = step_dispatches(_runner(layers, 2), PROMPT)
        return ours - theirs

    assert _per_layer(beyond) == PLAIN_STEP_DISPATCHES_BEYOND_TRANSFORMERS


def _per_layer(launches: Callable[[int], int]) -> float:
    """What ``launches(layers)`` adds per layer: the difference between 4 layers and 2, halved."""
    return (launches(4) - launches(2)) / 2


def _method_launches(name: str, layers: int) -> int:
    runner, method = _prepared(name, layers, 2)
    budget = Budget.from_keep(0.5 if name != "full" else 1.0)
    with torch.inference_mode(), sorting_as_on_cuda():
        return launches_of(lambda: method.prefill_for_decoding(runner, PROMPT, budget))


# Operators a method launches per prefill layer beyond full's, where it scores and cuts every layer:
# the window's attention (logits, scale, the step's one mask, softmax, window sum: 5), pooling before
# the window (2), the head sum (1), top-k with the forced tokens (mask, sort, sort of the k: 3) and
# the cut (keys, values, positions: 3). SAGE-KV's union of query-head top-k and its padded cut cost
# 4 more, TOVA skips pooling and the window, StreamingLLM only cuts; AdaKV cuts each layer twice (to
# a bound the host knows, then to its widest head) and ranks over all heads. A layer SlimInfer governs
# lays its blocks out in regions (one scatter each of keys, values and positions) and moves the query
# window's block, a region's slice, to the host. LAVa scores a layer as SnapKV does (15), ranks its
# (head, token) entries once (their order, each one's place, the entries it sees and its window's: 12)
# and measures Eq. 7's entropy (11); after the prefill it makes every layer's budget at once and cuts
# each layer once (11).
PREFILL_LAUNCHES_PER_LAYER = {
    "snapkv": 14,
    "pyramidkv": 14,
    "sage-kv": 18,
    "tova": 12,
    "streamingllm": 6,
    "adakv": 37,
    "sliminfer": 9,
    "lava": 50,
}


@pytest.mark.parametrize("name", sorted(PREFILL_LAUNCHES_PER_LAYER))
def test_a_scoring_layer_launches_a_fixed_few_operators_beyond_fulls(name):
    """What a per-layer method adds to each layer's host time where a prefill is launch-bound (a small
    model on a GPU): the window mask is made once per step and a probe's fresh scores pool in one
    operator, so a scoring layer adds 14, not the 23 it did."""
    beyond = _per_layer(partial(_method_launches, name)) - _per_layer(partial(_method_launches, "full"))
    assert beyond <= PREFILL_LAUNCHES_PER_LAYER[name]


def test_a_capture_layer_launches_what_its_probes_compute():
    """Every probe at every layer, beyond the runner's own operators: the window mask and the token
    units' layout (functions of the positions) are made once per step, so a layer adds 37, not 80."""
    from rankkit.probes import ProbeRecorder, parse_probes

    def launches(layers: int, probes: bool) -> int:
        runner = _runner(layers, 2)
        hooks = [ProbeRecorder(parse_probes("all"))] if probes else []
        with torch.inference_mode():
            return launches_of(lambda: runner.prefill(PROMPT, hooks=hooks))

    assert _per_layer(partial(launches, probes=True)) - _per_layer(partial(launches, probes=False)) <= 37
