"""SlimInfer Sec. 4, Eq. 1-2, Alg. 1: progressive block pruning with KV swapping.

Prefill. The prompt is cut into blocks of ``block_size`` original positions, each block
into token units of ``unit_size``. Right after a pruning layer's attention, every block
still live is scored by Eq. 1-2 (the unit keys' dot product with the mean of the last w
queries, averaged over the query heads, maximised over the block's units); the first
block (an attention sink) and the best other blocks, ``keep_tokens`` worth in all, stay
live, and the layer's FFN and every later layer see only them. Budgets follow the
paper's 8k/4k/2k schedule (its Llama-3.1-8B setting, applied to every model; its Qwen2.5-7B
one kept 12k/6k/4k): the last pruning layer keeps the budget, the ones before 2x and 4x it. The last w prompt tokens also stay live, whatever their block: they are the
query window of the next pruning layer and give the first token's logits.

transformers runs a decoder layer's attention and FFN in one forward, so the pruning
layer's FFN is handed only the kept tokens through a pre/post hook pair on its MLP
module; the survivors' values are those of pruning between attention and FFN.

Decoding. The layers after pruning layer l up to the next one hold the blocks l kept
(their KV never existed for the others); B_active starts as l's prefill choice, the query
window's tokens outside it wait on the host. At every step, in l's attention, l scores the
blocks it holds (Eq. 2 with the mean of the last w decode queries over the unit keys kept
from its prefill) and picks the first block and the best others, on the device; right
after l, the host reads that candidate and Alg. 1 runs on the cache of every layer l
governs, restricted to the blocks the layer holds, before those layers attend in the same
step (``BlockSwap``). The device work has shapes fixed for the whole decode, so under
``--cuda-graphs`` a step replays as one graph per stretch of layers between pruning layers,
Alg. 1 running on the host between them (``LayerHook.decode_breaks``).

Defaults are the paper's (Sec. 5): blocks of 64, units of 8, γ = 0.9, a query window of
4, pruning at layers 10, 20, 30 of 32 (scaled to the model's depth).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import ClassVar

import numpy as np
import torch

from rankkit.cache import KVCache
from rankkit.methods.base import (
    LAYERS,
    Budget,
    Method,
    Selection,
    bounded,
    depth_field,
    full_prefill,
    make_probe,
    register,
    scale_layer,
)
from rankkit.methods.selection import Captured, descending_order
from rankkit.methods.swap import BlockLayout, BlockSwap, SwapDecision
from rankkit.probes.token_units import UnitBlocks, UnitSlots, unit_similarity
from rankkit.runner import AttentionCall, LayerHook, PrefillState

REFERENCE_PRUNING_LAYERS = (10, 20, 30)  # Llama-3.1-8B


def budget_multiples(count: int) -> list[int]:
    """The paper's 8k/4k/2k schedule: each pruning layer keeps twice the next one's budget, the last 1x."""
    return [2 ** (count - 1 - index) for index in range(count)]


@dataclass(frozen=True)
class BlockChoice:
    """Sec. 4.2's choice among fixed candidates, on the device: the first eligible block (the attention
    sink's) and the best ``count`` - 1 other eligible ones. What does not depend on the scores is made
    once (a pruning layer's decode chooses among the same slots at every step).

    ``blocks`` [slots] ascending (spare slots last); ``eligible`` [slots] the slots that may be chosen.
    """

    blocks: torch.Tensor
    first: torch.Tensor  # [1] the first eligible slot
    others: torch.Tensor  # [slots] the other eligible slots
    count: int

    @classmethod
    def of(cls, blocks: torch.Tensor, eligible: torch.Tensor, count: int) -> BlockChoice:
        first = torch.argmax(eligible.to(torch.uint8))[None]  # a 0-d index would be read back to the host
        return cls(blocks, first, eligible.clone().index_fill_(0, first, False), count)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        """Block ids [count] for ``scores`` [slots] (each block's Eq. 2 score), ascending blocks first;
        -1 fills the places of blocks there were not. Ties go to the earlier block."""
        best = descending_order(scores.masked_fill(~self.others, float("-inf")))[: max(0, self.count - 1)]
        best = best.to(self.blocks.device)
        picked = torch.where(self.others[best], self.blocks[best], -1)
        return torch.cat([self.blocks[self.first], picked])


def chosen_blocks(
    blocks: torch.Tensor, scores: torch.Tensor, count: int, eligible: torch.Tensor
) -> torch.Tensor:
    """``BlockChoice`` made and applied once: block ids [count]."""
    return BlockChoice.of(blocks, eligible, count)(scores)


def block_count(keep_tokens: int, block_size: int) -> int:
    """Blocks ``keep_tokens`` is worth, the first block among them."""
    return max(1, math.ceil(keep_tokens / block_size))


def first_of(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the first ``count`` True entries of ``mask`` [S], ascending: the host knows how many
    there are, so no size is read (a stable sort puts them first, in order)."""
    return torch.sort((~mask).to(torch.uint8), stable=True).indices[:count]


def first_token_scores(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each block's score (Eq. 2), blocks 0, 1, ... in order, read at its first token from the
    ``token_units`` scores [kv_heads, T] of a full prompt (every token of a block holds its block's
    score; Eq. 2 averages over all query heads, so every KV-head row is the same)."""
    return scores[0, ::block_size]


@dataclass
class PruningLayer:
    """One pruning layer: its budget, the unit keys it scores with, the caches it governs in decoding."""

    layer: int
    keep_tokens: int
    governed: list[int]  # the following layers up to the next pruning layer
    unit_means: torch.Tensor | None = None  # [kv_heads, units, d], Eq. 1 over every block it holds
    unit_blocks: UnitBlocks | None = None  # the blocks of its units
    chosen: set[int] = field(default_factory=set)  # B_active after the prefill
    decode_choice: BlockChoice | None = None  # among the blocks the governed layers hold
    layout: BlockLayout | None = None  # where the governed layers' entries go
    swaps: list[BlockSwap] = field(default_factory=list)
    recent_queries: torch.Tensor | None = None  # [w, q_heads, d]: the last w decode queries, a ring
    decode_steps: torch.Tensor | None = None  # [1] decode queries seen
    candidate: torch.Tensor | None = None  # [blocks kept] this step's candidate, -1 filling

    def decode_tensors(self) -> list[torch.Tensor]:
        """Every tensor a decode step of this layer reads or writes, in a fixed order."""
        held = (self.unit_blocks, self.decode_choice)
        parts = [getattr(part, each.name) for part in held for each in fields(part)]
        return [
            self.unit_means,
            *(part for part in parts if isinstance(part, torch.Tensor)),
            self.recent_queries,
            self.decode_steps,
            self.candidate,
        ]

    def replay(self, captured: PruningLayer) -> None:
        """Decode through ``captured``'s tensors (a graph made with them replays): they take this layer's
        values, and this layer takes them."""
        for mine, theirs in zip(self.decode_tensors(), captured.decode_tensors(), strict=True):
            theirs.copy_(mine)
        self.unit_means, self.unit_blocks, self.decode_choice = (
            captured.unit_means,
            captured.unit_blocks,
            captured.decode_choice,
        )
        self.recent_queries, self.decode_steps, self.candidate = (
            captured.recent_queries,
            captured.decode_steps,
            captured.candidate,
        )


class SlimInferHook(LayerHook):
    """Block pruning during prefill, block scoring and swapping during decoding (see the module docstring).

    Blocks are chosen on the device; the host reads each pruning layer's choice once (in the
    prefill and at every decode step): Alg. 1 moves blocks between the tiers, which the host
    drives. Everything else the host needs it counts itself: it follows the live positions of
    a prefill (``live_positions``, from 0..T-1 of a full prefill), so the kept tokens' count and
    the governed layers' regions (one ``BlockLayout`` for the layers a pruning layer governs) need
    no read, and a governed layer's swap reads nothing.
    """

    def __init__(
        self, schedule: list[PruningLayer], *, block_size: int, unit_size: int, gamma: float, window: int
    ):
        self.schedule = {entry.layer: entry for entry in schedule}
        self.governor = {layer: entry for entry in schedule for layer in entry.governed}
        self.block_size = block_size
        self.unit_size = unit_size
        self.gamma = gamma
        self.window = window
        self.keep: torch.Tensor | None = None  # indices of the live tokens the current pruning layer keeps
        self.live = 0
        self.live_positions: np.ndarray | None = None  # the live tokens' positions, as the host follows them
        self.cached_positions: np.ndarray | None = None  # the positions the current layer's cache holds
        self.kept_positions: torch.Tensor | None = None
        self.selection_layer: int | None = None
        self.ffn_tokens: dict[int, int] = {}  # the tokens each pruning layer's FFN runs on
        self.decisions: list[SwapDecision] = []

    def _candidate(self, entry: PruningLayer, query: torch.Tensor, choice: BlockChoice) -> torch.Tensor:
        """The blocks ``entry`` keeps for ``query`` (q_l [q_heads, d]) by Eq. 1-2 and ``choice``, on the device."""
        return choice(entry.unit_blocks.maxima(unit_similarity(query, entry.unit_means))[0])

    @property
    def _decoding(self) -> list[PruningLayer]:
        """The pruning layers that govern layers in decoding, in order."""
        return [entry for _, entry in sorted(self.schedule.items()) if entry.swaps]

    @property
    def decode_breaks(self) -> tuple[int, ...]:
        return tuple(entry.layer for entry in self._decoding)

    @property
    def replay_key(self) -> str:
        shapes = ";".join(
            ",".join(str(tuple(tensor.shape)) for tensor in entry.decode_tensors()) for entry in self._decoding
        )
        return f"sliminfer:layers={self.decode_breaks}:{shapes}"

    def replayed_as(self, captured: LayerHook) -> None:
        for entry, replayed in zip(self._decoding, captured._decoding, strict=True):
            entry.replay(replayed)

    def on_attention(self, call: AttentionCall) -> None:
        if call.phase == "prefill":
            if self.live_positions is None:  # a full prefill: positions 0..T-1
                self.live_positions = np.arange(call.query_positions.shape[0])
            self.cached_positions = self.live_positions
        entry = self.schedule.get(call.layer)
        if entry is None:
            return
        if call.phase == "prefill":
            self._prune(entry, call)
        elif entry.swaps:
            # the ring's oldest query gives way; rows no query filled yet are zero and add nothing
            slot = entry.decode_steps % self.window
            entry.recent_queries.index_copy_(0, slot, call.query[0, :, -1:].float().transpose(0, 1))
            entry.decode_steps += 1
            window = entry.recent_queries.sum(dim=0) / entry.decode_steps.clamp(max=self.window)
            entry.candidate.copy_(self._candidate(entry, window, entry.decode_choice))

    def after_decode_layer(self, layer: int, cache: KVCache) -> None:
        """Alg. 1 on every layer ``layer`` governs, with this step's candidate: the host's one read."""
        entry = self.schedule[layer]
        chosen = {block for block in entry.candidate.tolist() if block >= 0}
        for swap in entry.swaps:
            self.decisions.append(swap.swap(chosen & swap.pool(), cache))

    def _prune(self, entry: PruningLayer, call: AttentionCall) -> None:
        slots = UnitSlots.of(call.key_positions[0], self.unit_size)
        entry.unit_means = slots.mean_keys(call.key[0].float())
        entry.unit_blocks = UnitBlocks.of(slots.unit_ids, self.unit_size, self.block_size)
        blocks, blocks_kept = entry.unit_blocks.blocks, block_count(entry.keep_tokens, self.block_size)
        query = call.query[0, :, -self.window :].float()
        chosen_ids = self._candidate(entry, query.mean(dim=1), BlockChoice.of(blocks, blocks >= 0, blocks_kept))
        entry.chosen = {block for block in chosen_ids.tolist() if block >= 0}
        entry.recent_queries = query.new_zeros(self.window, *query.shape[::2])
        entry.decode_steps = torch.zeros(1, dtype=torch.long, device=query.device)
        entry.candidate = torch.empty_like(chosen_ids)
        # the kept tokens, counted by the host on its live positions ...
        live = self.live_positions
        in_blocks = np.isin(live // self.block_size, sorted(entry.chosen))
        kept = in_blocks.copy()
        kept[-self.window :] = True
        # ... and marked on the device through a table of blocks (slot 0: no block, the -1 fills)
        live_blocks = call.query_positions // self.block_size + 1
        slots = int(live[-1]) // self.block_size + 2
        chosen_table = torch.zeros(slots, dtype=torch.bool, device=live_blocks.device)
        in_blocks_device = chosen_table.index_fill_(0, chosen_ids.to(live_blocks.device) + 1, True)[
            live_blocks
        ]
        kept_device = in_blocks_device.clone()
        kept_device[-self.window :] = True
        if self.kept_positions is None:  # the first pruning layer's blocks, as `rankkit select` gives them
            self.kept_positions = call.query_positions[first_of(in_blocks_device, int(in_blocks.sum()))]
            self.selection_layer = call.layer
        # the blocks its governed layers hold: the pool each decode step chooses from
        held = torch.zeros(slots, dtype=torch.long, device=live_blocks.device)
        held = held.index_add_(0, live_blocks, kept_device.long()) > 0
        eligible = (blocks >= 0) & held[blocks.to(held.device) + 1].to(blocks.device)
        entry.decode_choice = BlockChoice.of(blocks, eligible, blocks_kept)
        self.live, count = live.shape[0], int(kept.sum())
        self.ffn_tokens[call.layer] = count
        self.keep = None if count == self.live else first_of(kept_device, count)
        self.live_positions = live[kept]

    def ffn_input(self, module, args):
        return None if self.keep is None else (args[0][:, self.keep], *args[1:])

    def ffn_output(self, module, args, output):
        if self.keep is None:
            return None
        full = output.new_zeros(output.shape[0], self.live, output.shape[-1])
        full[:, self.keep] = output  # the dropped tokens' rows are discarded by ``after_layer``
        return full

    def after_layer(self, layer: int, state: PrefillState) -> None:
        if layer in self.schedule and self.keep is not None:
            keep, self.keep = self.keep, None
            state.prune(keep)
        governor = self.governor.get(layer)
        if governor is not None:  # its prefill KV is final: decoding swaps its blocks from here
            if governor.layout is None:  # the layers it governs hold the same positions
                governor.layout = BlockLayout.of(
                    self.cached_positions,
                    block_size=self.block_size,
                    prompt_length=state.prompt_length,
                    active=governor.chosen,  # the query window's own block waits on the host
                )
            governor.swaps.append(BlockSwap(state.cache, layer, governor.layout, gamma=self.gamma))


@contextmanager
def ffn_on_kept_tokens(runner, hook: SlimInferHook):
    """Route each pruning layer's FFN through ``hook`` for the duration of a prefill."""
    handles = []
    for layer in hook.schedule:
        mlp = runner.body.layers[layer].mlp
        handles += [mlp.register_forward_pre_hook(hook.ffn_input), mlp.register_forward_hook(hook.ffn_output)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def paper_pruning_layers(num_layers: int) -> tuple[int, ...]:
    """Layers 10, 20, 30 of 32 (Sec. 5) at the same relative depths of ``num_layers``."""
    return tuple(sorted({scale_layer(layer, num_layers) for layer in REFERENCE_PRUNING_LAYERS}))


@register
@dataclass
class SlimInfer(Method):
    name: ClassVar[str] = "sliminfer"
    pruning_layers: tuple[int, ...] | None = depth_field(paper_pruning_layers, selects=True, bounds=LAYERS)
    block_size: int = bounded(64, 1)
    unit_size: int = bounded(8, 1)
    window_size: int = bounded(4, 1)  # w, the query window
    gamma: float = bounded(0.9, 0, 1, reference="γ, SlimInfer Alg. 1")  # an overlap ratio

    def minimum_keep(self):
        return self.block_size  # the first block, the attention sink, is always kept

    def _schedule(self, num_layers: int, length: int, budget: Budget, layer_types=None) -> list[PruningLayer]:
        """Each pruning layer with the tokens it keeps (the budget at the last, 2x and 4x before
        it) and the layers it governs in decoding (up to the next pruning layer)."""
        keep = self.kept_tokens(budget, length)
        layers = sorted(self.bind(num_layers, layer_types).pruning_layers)
        ends = [*layers[1:], num_layers - 1]
        return [
            PruningLayer(layer, min(length, keep * multiple), list(range(layer + 1, end + 1)))
            for layer, end, multiple in zip(layers, ends, budget_multiples(len(layers)), strict=True)
        ]

    def hook(self, num_layers: int, prompt_length: int, budget: Budget, layer_types=None) -> SlimInferHook:
        """The hook that carries out SlimInfer on a prompt of ``prompt_length`` tokens."""
        return SlimInferHook(
            self._schedule(num_layers, prompt_length, budget, layer_types),
            block_size=self.block_size,
            unit_size=self.unit_size,
            gamma=self.gamma,
            window=self.window_size,
        )

    def probe(self):
        return make_probe(
            "token_units", block_size=self.block_size, unit_size=self.unit_size, window_size=self.window_size
        )

    def prefill(self, runner, input_ids, budget):
        hook = self.hook(runner.num_layers, int(input_ids.numel()), budget, runner.layer_types)
        with ffn_on_kept_tokens(runner, hook):
            run = full_prefill(runner, input_ids, hooks=[hook])
        (main,) = run.passes
        main.ffn_queries = [hook.ffn_tokens.get(layer, live) for layer, live in enumerate(main.queries)]
        run.decode_hooks = [hook]
        run.kept_positions, run.selection_layer = hook.kept_positions, hook.selection_layer
        return run

    # -- the offline face: the first pruning layer's blocks, from the stored token_units scores ---

    def captured_inputs(self):
        return [self.probe().key]

    def select_offline(self, captured: Captured, budget: Budget, *, layer=None) -> Selection:
        first, by_block = self._first_block_scores(captured, budget)
        blocks = torch.arange(by_block.shape[0])
        chosen = chosen_blocks(
            blocks,
            by_block,
            block_count(first.keep_tokens, self.block_size),
            torch.ones_like(blocks, dtype=torch.bool),
        )
        positions = torch.arange(captured.num_tokens)
        return Selection(first.layer, positions[torch.isin(positions // self.block_size, chosen)])

    def layer_rankings(self, captured: Captured, budget: Budget) -> dict[int | None, torch.Tensor]:
        """At the first pruning layer, each token ranked by its block's score (Eq. 2), the first block
        (always kept) at +inf: the order ``select_offline`` takes blocks in."""
        first, by_block = self._first_block_scores(captured, budget)
        ranking = by_block[torch.arange(captured.num_tokens) // self.block_size]
        ranking[: self.block_size] = math.inf
        return {first.layer: ranking}

    def _first_block_scores(self, captured: Captured, budget: Budget) -> tuple[PruningLayer, torch.Tensor]:
        """The first pruning layer (where ``rankkit select`` reads SlimInfer's choice) and its block scores."""
        first = self._schedule(captured.num_layers, captured.num_tokens, budget, captured.layer_types)[0]
        scores = captured.get(self.probe().key, self.name)[first.layer]
        return first, first_token_scores(scores, self.block_size)
