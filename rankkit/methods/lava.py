"""LAVa Sec. 4, Eq. 5-7, Alg. 1-2: KV-only with dynamic head and layer budgets.

Probe ``lava`` (Eq. 5: window attention scaled by the largest value norm, max-pooled
with kernel 7, maximised over the query heads of each KV group, Sec. 4.3) x no
selection layer x KV-only mode with budgets decided by the scores themselves:

- dynamic head budget (Algorithm 1): a layer's scores of all KV heads outside the recent
  window are flattened and its B_l best (head, token) entries kept, so heads keep
  different numbers of tokens; the recent window is kept on top of B_l, never evicted;
- dynamic layer budget (Eq. 6-7, Algorithm 2): each layer's scores are normalised over
  heads and tokens, ŝ = s / Σ s, and its normalised entropy e_l = -Σ ŝ log ŝ / (H·N)
  measures how unsure the layer is; after prefilling layer l every layer l' <= l is
  (re)compressed to B_l' = e_l' / Σ_{j<=l} e_j · 𝔹 of the total budget 𝔹 (CAKE-style, so
  the cache never holds more than 𝔹 entries beyond the layer being prefilled).

𝔹 = (budget tokens - w) x KV heads x layers, so that with the windows the cache holds as
many entries as the uniform methods keep. Budgets are whole entries apportioned by largest
remainder, each layer's between 0 and its entries outside the window, so they sum exactly
to 𝔹 (or to every such entry there is, when 𝔹 exceeds that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.cache import PADDING
from rankkit.errors import RankkitError
from rankkit.methods.base import Budget, Method, Selection, bounded, full_prefill, make_probe, register
from rankkit.methods.selection import Captured, descending_order
from rankkit.runner import AttentionCall, LayerHook, PrefillState


def normalized_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Eq. 6-7 over the scored (non-window) entries [H, N] of one layer, as a 0-d tensor on their device.

    A NaN score is a key a local layer cannot see: not one of its entries. A layer with no
    entry left to score (its window covers all it sees) has nothing to budget: 0.
    """
    seen = ~scores.isnan()
    scores = scores.double().clamp_min(0).masked_fill(~seen, 0.0)
    probabilities = scores / scores.sum()
    count = seen.sum()
    entropy = -torch.special.xlogy(probabilities, probabilities).sum() / count.clamp_min(1)
    return torch.where(count > 0, entropy, torch.zeros_like(entropy))


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


def windowless(scores: torch.Tensor, window: int) -> torch.Tensor:
    """The scored (non-window) entries [H, N - w] of one layer's scores [H, N]."""
    return scores[:, : scores.shape[1] - min(window, scores.shape[1])]


def with_window(scores: torch.Tensor, window: int) -> torch.Tensor:
    """One layer's scores [H, N] with the recent window at +inf: never evicted; keys the layer
    cannot see (NaN) at -inf, as padding: never kept, no share of the layer's budget."""
    unseen = scores.isnan()
    scores = scores.float().clone()
    scores[:, scores.shape[1] - min(window, scores.shape[1]) :] = float("inf")
    return scores.masked_fill(unseen, float("-inf"))


def layer_budgets(
    scores: list[torch.Tensor], entropy: list[float], keep_tokens: int, window: int, num_layers: int
):
    """``entropy_budgets`` of the layers whose scores [H, N] (window +inf, unseen -inf) are given."""
    windows = [int((s == float("inf")).sum()) for s in scores]  # the window entries a layer sees
    sizes = [int((s != float("-inf")).sum()) for s in scores]
    return entropy_budgets(entropy, windows, sizes, keep_tokens, window, scores[0].shape[0], num_layers)


def entropy_budgets(
    entropy: list[float],
    windows: list[int],
    sizes: list[int],
    keep_tokens: int,
    window: int,
    heads: int,
    num_layers: int,
) -> list[int]:
    """Eq. 6-7 / Algorithm 2: the entries each layer so far keeps, given each layer's window entries
    and the entries it holds (``sizes``: what it can still lose).

    LAVa Alg. 1 ranks only the entries outside the recent window and keeps the window on top:
    𝔹 = (keep - w) x heads x layers entries outside the windows are shared by entropy, and each
    layer keeps the window entries it sees besides its share B_l.
    """
    total = max(0, keep_tokens - window) * heads * num_layers
    outside = [size - seen for size, seen in zip(sizes, windows, strict=True)]
    shares = apportion(total, entropy, [0] * len(entropy), outside)
    return [seen + share for seen, share in zip(windows, shares, strict=True)]


def best_entries(order: torch.Tensor, budget: int, heads: int) -> torch.Tensor:
    """Algorithm 1 ``EVICT`` as a mask [H, N]: the ``budget`` first of the flattened (head, token)
    entries in ``order`` (``descending_order``: ties to the earlier entry, as every rankkit rank)."""
    kept = torch.zeros(order.numel(), dtype=torch.bool, device=order.device)
    return kept.index_fill_(0, order[:budget], True).view(heads, -1)


def evict(scores: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Algorithm 1 ``EVICT``: per head, the sorted positions among the ``budget`` best entries of the
    flattened (head, token) scores [H, N]."""
    kept = best_entries(descending_order(scores.flatten()), budget, scores.shape[0])
    return [torch.nonzero(head).flatten() for head in kept]


class LavaBudgets(LayerHook):
    """Algorithm 2 during one prefill: score each layer, then recompress every layer so far.

    Each layer's (head, token) entries are sorted once, when it is scored. A recompression
    keeps the best B_l' of what the layer kept, which is the first B_l' of that order (a
    subset keeps the order and the ties of the whole), so every earlier layer is cut from
    its one order; the host reads, per layer, the layer's entropy and sizes, then the widest
    head of every layer it recompresses, all at once.
    """

    def __init__(self, probe, keep_tokens: int, window: int, num_layers: int):
        self.probe = probe
        self.keep_tokens = keep_tokens
        self.window = window
        self.num_layers = num_layers
        self.orders: list[torch.Tensor] = []  # per layer, its flattened (head, position) entries, best first
        self.entropy: list[float] = []
        self.sizes: list[int] = []  # the entries each layer holds now (keys it cannot see are none)
        self.floors: list[int] = []  # its window entries, never evicted
        self.budgets: list[int] = []
        self._current: torch.Tensor | None = None

    def on_attention(self, call: AttentionCall) -> None:
        if call.phase == "prefill":
            scores, unseen = self.probe.score(call), call.unseen_keys()
            # NaN marks keys a local layer cannot see, online as offline (``Captured.hide_unseen``)
            self._current = scores if unseen is None else scores.masked_fill(unseen, float("nan"))

    def after_layer(self, layer: int, state: PrefillState) -> None:
        scores, self._current = self._current.float(), None
        ranked = with_window(scores, self.window)
        entropy = normalized_entropy(windowless(scores, self.window))
        sizes = torch.stack([(ranked != float("-inf")).sum(), (ranked == float("inf")).sum()])
        entropy, size, floor = torch.cat([entropy[None], sizes.to(entropy.dtype)]).tolist()
        self.orders.append(descending_order(ranked.flatten()).to(ranked.device))
        self.entropy.append(entropy)
        self.sizes.append(int(size))
        self.floors.append(int(floor))
        heads = ranked.shape[0]
        self.budgets = entropy_budgets(
            self.entropy, self.floors, self.sizes, self.keep_tokens, self.window, heads, self.num_layers
        )
        shrinking = [earlier for earlier, budget in enumerate(self.budgets) if budget < self.sizes[earlier]]
        if shrinking:
            self._evict(state, shrinking, heads)

    def _evict(self, state: PrefillState, layers: list[int], heads: int) -> None:
        cache = state.cache
        kept = []
        for layer in layers:
            best = best_entries(self.orders[layer], self.budgets[layer], heads)
            positions = cache.positions[layer]  # a full prefill's entry positions are its token indices
            kept.append(best.gather(1, positions.clamp_min(0)) & (positions != PADDING))
        widths = torch.stack([mask.sum(dim=1).amax() for mask in kept]).tolist()
        for layer, mask, width in zip(layers, kept, widths, strict=True):
            cache.compress_to_mask(layer, mask, width)
            self.sizes[layer] = self.budgets[layer]


@register
@dataclass
class Lava(Method):
    name: ClassVar[str] = "lava"
    window_size: int = bounded(32, 1)  # w (the paper does not state it; SnapKV's, whose window LAVa adopts)
    kernel_size: int = bounded(7, 1)

    def probe(self):
        return make_probe("lava", window_size=self.window_size, kernel_size=self.kernel_size)

    def prefill(self, runner, input_ids, budget):
        keep = budget.resolve(int(input_ids.numel()), always_kept=self.window_size)
        hook = LavaBudgets(self.probe(), keep, self.window_size, runner.num_layers)
        return full_prefill(runner, input_ids, hooks=[hook])

    # -- the offline face: the budgets after the last layer, from the stored lava scores --------
    # Each recompression keeps the best of what the layer kept, so after the last layer each
    # layer holds the best B_l entries of its own scores: the budgets can be applied once.

    def captured_inputs(self):
        return [self.probe().key]

    def _stored(self, captured: Captured) -> torch.Tensor:
        """The stored scores with NaN for keys a local layer could not see, as the hook marks them."""
        return captured.hide_unseen(captured.get(self.probe().key, self.name))

    def _layers(self, captured: Captured) -> list[torch.Tensor]:
        scores = self._stored(captured)
        return [with_window(scores[layer], self.window_size) for layer in range(captured.num_layers)]

    def select_offline(self, captured: Captured, budget: Budget, *, layer=None) -> Selection:
        if layer is None or not 0 <= layer < captured.num_layers:
            raise RankkitError(
                f"method 'lava' keeps a set per layer and KV head: name the layer with --layer "
                f"(0..{captured.num_layers - 1})"
            )
        stored = self._stored(captured)
        entropy = [
            float(normalized_entropy(windowless(stored[index], self.window_size)))
            for index in range(captured.num_layers)
        ]
        keep = budget.resolve(captured.num_tokens, always_kept=self.window_size)
        layers = self._layers(captured)
        budgets = layer_budgets(layers, entropy, keep, self.window_size, captured.num_layers)
        return Selection(layer, evict(layers[layer], budgets[layer]))

    def layer_rankings(self, captured: Captured, budget: Budget) -> dict[int | None, torch.Tensor]:
        """Per layer, each token's best entry over the KV heads: the order tokens enter the kept entries."""
        return {layer: scores.amax(dim=0) for layer, scores in enumerate(self._layers(captured))}
