"""SlimInfer Sec. 4, Eq. 1-2, Alg. 1: progressive block pruning with KV swapping.

Probe ``token_units`` (Eq. 1-2: a block's score is the best of its token units' mean
keys against the mean of the last w queries, averaged over heads) x a layer schedule
x progressive one-pass block pruning:

- prompt tokens form blocks of ``block_size`` original positions; the layers before the
  first pruning layer keep every block (preserve layers);
- after the attention of each pruning layer l_s the hidden states keep only the
  ``keep_s`` tokens' worth of best blocks (the first block, an attention sink, always;
  and the block holding the prompt's last tokens, which must produce the logits) and
  every later layer sees only those. Budgets follow the paper's 8k/4k/2k schedule: the
  last pruning layer keeps the budget, the ones before 2x and 4x it;
- the KV of the blocks a pruning layer drops is not discarded but moved to the host
  tier of that layer's ``BlockSwap`` (Sec. 4.3);
- during decoding, every step re-scores the blocks of each pruning layer (both tiers)
  with the mean of the last w decode queries (Eq. 2 on the token-unit keys kept from
  the prefill) and hands the top blocks to Algorithm 1, which swaps them in only when
  their overlap with the active set falls below γ. The swap happens between steps, so
  a decision made at step t is used from step t+1 (the prefetch of Sec. 3.2).

Defaults are the paper's (Sec. 5): blocks of 64, units of 8, γ = 0.9, a query window of
4, pruning at layers 10, 20, 30 of 32 (scaled to the model's depth).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.methods.base import Method, full_prefill, make_probe, register, scale_layer
from rankkit.methods.swap import BlockSwap, SwapDecision
from rankkit.probes.token_units import unit_means
from rankkit.runner import AttentionCall, LayerHook, PrefillState

REFERENCE_PRUNING_LAYERS = (10, 20, 30)  # Llama-3.1-8B


def budget_multiples(count: int) -> list[int]:
    """The paper's 8k/4k/2k schedule: each pruning layer keeps twice the next one's budget, the last 1x."""
    return [2 ** (count - 1 - index) for index in range(count)]


@dataclass
class PruningLayer:
    """One pruning layer's state: the block scores' inputs and its swap manager."""

    layer: int
    keep_tokens: int
    unit_keys: torch.Tensor | None = None  # [kv_heads, units, head_dim], Eq. 1, every block with KV here
    unit_blocks: torch.Tensor | None = None  # [units] block id of each unit
    swap: BlockSwap | None = None
    recent_queries: deque | None = None
    candidate: set[int] | None = None


class SlimInferHook(LayerHook):
    """Block pruning during prefill, block scoring and swapping during decoding (see the module docstring)."""

    def __init__(self, probe, schedule: list[PruningLayer], *, block_size: int, gamma: float, window: int):
        self.probe = probe
        self.schedule = {entry.layer: entry for entry in schedule}
        self.block_size = block_size
        self.gamma = gamma
        self.window = window
        self.scores: torch.Tensor | None = None
        self.decisions: list[SwapDecision] = []

    def on_attention(self, call: AttentionCall) -> None:
        entry = self.schedule.get(call.layer)
        if entry is None:
            return
        if call.phase == "prefill":
            self.scores = self.probe.score(call)
            unit = self.probe.unit_size
            entry.unit_keys = unit_means(call.key[0].float(), unit)
            entry.unit_blocks = call.key_positions[0, ::unit] // self.block_size
            entry.recent_queries = deque(maxlen=self.window)
        elif entry.swap is not None:
            entry.recent_queries.append(call.query[0, :, -1:].float())
            entry.candidate = self._candidate(entry, self._decode_block_scores(entry))

    def _decode_block_scores(self, entry: PruningLayer) -> dict[int, float]:
        """Eq. 2 for every block with KV at this layer, from the recent decode queries."""
        queries = torch.cat(list(entry.recent_queries), dim=1).mean(dim=1)  # [q_heads, d]
        kv_heads = entry.unit_keys.shape[0]
        per_unit = torch.einsum("gqd,gud->u", queries.view(kv_heads, -1, queries.shape[-1]), entry.unit_keys)
        per_unit = per_unit / queries.shape[0]
        blocks = entry.unit_blocks.to(per_unit.device)
        best = torch.full((int(blocks.max()) + 1,), float("-inf"), device=per_unit.device)
        best = best.scatter_reduce(0, blocks, per_unit, reduce="amax")
        return {int(block): float(best[block]) for block in torch.unique(blocks)}

    def _candidate(self, entry: PruningLayer, block_scores: dict[int, float]) -> set[int]:
        """The first and last blocks plus the best others, ``keep_tokens`` worth of blocks in all."""
        first, last = min(block_scores), max(block_scores)
        count = max(2, math.ceil(entry.keep_tokens / self.block_size))
        others = sorted(
            (b for b in block_scores if b not in (first, last)), key=block_scores.get, reverse=True
        )
        return {first, last, *others[: count - 2]}

    def after_layer(self, layer: int, state: PrefillState) -> None:
        entry = self.schedule.get(layer)
        if entry is None:
            return
        scores, self.scores = self.scores, None
        live_blocks = state.positions // self.block_size
        block_scores = {
            int(block): float(scores[0, int(index)]) for index, block in _first_of_each(live_blocks)
        }
        chosen = self._candidate(entry, block_scores)
        if len(chosen) == len(block_scores):
            return  # the budget covers every block: nothing to prune or offload
        entry.swap = BlockSwap(
            state.cache,
            layer,
            block_size=self.block_size,
            prompt_length=state.prompt_length,
            gamma=self.gamma,
        )
        entry.swap.offload_inactive(chosen)
        keep = torch.nonzero(torch.isin(live_blocks, torch.tensor(sorted(chosen), device=live_blocks.device)))
        state.prune(keep.flatten())

    def after_step(self, cache) -> None:
        """Between decode steps: Algorithm 1 on every pruning layer with the candidates of the last step."""
        for entry in self.schedule.values():
            if entry.swap is not None and entry.candidate is not None:
                self.decisions.append(entry.swap.swap(entry.candidate))

    def host_bytes(self) -> int:
        return sum(entry.swap.host_bytes() for entry in self.schedule.values() if entry.swap is not None)


def _first_of_each(blocks: torch.Tensor):
    """(index of the first live token, block id) for every block among the sorted live tokens."""
    values, counts = torch.unique_consecutive(blocks, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    return zip(starts.tolist(), values.tolist(), strict=True)


@register
@dataclass
class SlimInfer(Method):
    name: ClassVar[str] = "sliminfer"
    pruning_layers: tuple[int, ...] | None = None  # default 10, 20, 30 of 32 scaled
    block_size: int = 64
    unit_size: int = 8
    window_size: int = 4  # w, the query window
    gamma: float = 0.9  # γ, Algorithm 1's swap threshold

    def layers(self, num_layers: int) -> list[int]:
        if self.pruning_layers is not None:
            return sorted(self.pruning_layers)
        return sorted({scale_layer(layer, num_layers) for layer in REFERENCE_PRUNING_LAYERS})

    def resolved(self, num_layers):
        return {
            "pruning_layers": self.layers(num_layers),
            "budget_multiples": budget_multiples(len(self.layers(num_layers))),
            "block_size": self.block_size,
            "unit_size": self.unit_size,
            "window_size": self.window_size,
            "gamma": self.gamma,
        }

    def prefill(self, runner, input_ids, budget):
        length = int(input_ids.numel())
        keep = budget.resolve(length, always_kept=2 * self.block_size)
        layers = self.layers(runner.num_layers)
        multiples = budget_multiples(len(layers))
        schedule = [
            PruningLayer(layer, min(length, keep * multiple))
            for layer, multiple in zip(layers, multiples, strict=True)
        ]
        probe = make_probe(
            "token_units", block_size=self.block_size, unit_size=self.unit_size, window_size=self.window_size
        )
        hook = SlimInferHook(
            probe, schedule, block_size=self.block_size, gamma=self.gamma, window=self.window_size
        )
        run = full_prefill(runner, input_ids, hooks=[hook])
        run.decode_hooks = [hook]
        return run
