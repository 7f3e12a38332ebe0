"""LAVa Sec. 4, Eq. 5-7, Alg. 1-2: KV-only with dynamic head and layer budgets.

Probe ``lava`` (Eq. 5: window attention scaled by the largest value norm, max-pooled
with kernel 7, maximised over the query heads of each KV group, Sec. 4.3) x no
selection layer x KV-only mode with budgets decided by the scores themselves:

- dynamic head budget (Algorithm 1): a layer's scores of all KV heads are flattened and
  its B_l best (head, token) entries kept, so heads keep different numbers of tokens;
  the recent window is never evicted (it counts inside B_l);
- dynamic layer budget (Eq. 6-7, Algorithm 2): each layer's scores are normalised over
  heads and tokens, ŝ = s / Σ s, and its normalised entropy e_l = -Σ ŝ log ŝ / (H·N)
  measures how unsure the layer is; after prefilling layer l every layer l' <= l is
  (re)compressed to B_l' = e_l' / Σ_{j<=l} e_j · 𝔹 of the total budget 𝔹 (CAKE-style, so
  the cache never holds more than 𝔹 entries beyond the layer being prefilled).

𝔹 = budget tokens x KV heads x layers, i.e. the same number of entries the uniform
methods keep. Budgets are whole entries apportioned by largest remainder, each layer
between its window (H·w) and its size (H·N), so they sum exactly to 𝔹 (or to every
entry there is, when 𝔹 exceeds that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.methods.base import Method, full_prefill, make_probe, register
from rankkit.runner import AttentionCall, LayerHook, PrefillState


def normalized_entropy(scores: torch.Tensor) -> float:
    """Eq. 6-7 over the scored (non-window) entries [H, N] of one layer."""
    scores = scores.double().clamp_min(0)
    probabilities = scores / scores.sum()
    return float(-torch.special.xlogy(probabilities, probabilities).sum() / scores.numel())


def apportion(total: int, weights: list[float], floors: list[int], caps: list[int]) -> list[int]:
    """Whole shares of ``total`` proportional to ``weights``, each within [floor, cap], summing to ``total``.

    Shares that the proportion would push past a bound are fixed at it and the rest is
    shared again (water-filling); the last fractions go by largest remainder. When
    ``total`` is outside [sum(floors), sum(caps)] every share sits at that bound.
    """
    count = len(weights)
    if total >= sum(caps):
        return list(caps)
    if total <= sum(floors):
        return list(floors)
    shares = [0.0] * count
    open_ = set(range(count))
    remaining = float(total)
    while open_:
        weight = sum(weights[i] for i in open_)
        proposal = {
            i: remaining * weights[i] / weight if weight > 0 else remaining / len(open_) for i in open_
        }
        # fix the shares over their cap first (that only raises the others), then those under their floor
        fixed = {i: caps[i] for i, p in proposal.items() if p > caps[i]} or {
            i: floors[i] for i, p in proposal.items() if p < floors[i]
        }
        if not fixed:
            for i, p in proposal.items():
                shares[i] = p
            break
        for i, bound in fixed.items():
            shares[i] = bound
            remaining -= bound
            open_.discard(i)
    whole = [math.floor(share) for share in shares]
    by_fraction = sorted(range(count), key=lambda i: shares[i] - whole[i], reverse=True)
    for i in by_fraction[: total - sum(whole)]:
        whole[i] += 1
    return whole


class LavaBudgets(LayerHook):
    """Algorithm 2 during one prefill: score each layer, then recompress every layer so far."""

    def __init__(self, probe, keep_tokens: int, window: int, num_layers: int):
        self.probe = probe
        self.keep_tokens = keep_tokens
        self.window = window
        self.num_layers = num_layers
        self.scores: list[
            torch.Tensor
        ] = []  # per layer, aligned with its cache entries; window +inf, padding -inf
        self.entropy: list[float] = []
        self.budgets: list[int] = []
        self._current: torch.Tensor | None = None

    def on_attention(self, call: AttentionCall) -> None:
        if call.phase == "prefill":
            self._current = self.probe.score(call)

    def after_layer(self, layer: int, state: PrefillState) -> None:
        scores, self._current = self._current.float(), None
        heads, length = scores.shape
        window = min(self.window, length)
        self.entropy.append(normalized_entropy(scores[:, : length - window]))
        scores[:, length - window :] = float("inf")
        self.scores.append(scores)
        total = self.keep_tokens * heads * self.num_layers
        sizes = [int((s != float("-inf")).sum()) for s in self.scores]
        floors = [heads * min(self.window, s.shape[1]) for s in self.scores]
        self.budgets = apportion(total, self.entropy, floors, sizes)
        for earlier, budget in enumerate(self.budgets):
            if budget < sizes[earlier]:
                self._evict(state, earlier, budget)

    def _evict(self, state: PrefillState, layer: int, budget: int) -> None:
        """Algorithm 1 ``EVICT``: keep the ``budget`` best entries of the flattened (head, token) scores."""
        scores = self.scores[layer]
        heads, width = scores.shape
        chosen = torch.topk(scores.flatten(), budget).indices
        keep = [torch.sort(chosen[chosen // width == head] % width).values for head in range(heads)]
        state.cache.compress(layer, keep)
        kept = torch.full((heads, max(k.numel() for k in keep)), float("-inf"), device=scores.device)
        for head, indices in enumerate(keep):
            kept[head, : indices.numel()] = scores[head, indices]
        self.scores[layer] = kept


@register
@dataclass
class Lava(Method):
    name: ClassVar[str] = "lava"
    window_size: int = 32  # w (the paper does not state it; SnapKV's, whose window LAVa adopts)
    kernel_size: int = 7

    def prefill(self, runner, input_ids, budget):
        keep = budget.resolve(int(input_ids.numel()), always_kept=self.window_size)
        probe = make_probe("lava", window_size=self.window_size, kernel_size=self.kernel_size)
        hook = LavaBudgets(probe, keep, self.window_size, runner.num_layers)
        return full_prefill(runner, input_ids, hooks=[hook])
