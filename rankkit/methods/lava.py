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
  (re)compressed to B_l' = e_l' / Σ_{j<=l} e_j · 𝔹 of the total budget 𝔹 (CAKE-style: the
  paper's cache never holds more than 𝔹 entries beyond the layer being prefilled). rankkit
  cuts each layer once, after the prefill, to the same entries (``LavaBudgets``), and holds
  every layer's entries until then, as a full prefill does.

𝔹 = (budget tokens - w) x KV heads x layers, so that with the windows the cache holds as
many entries as the uniform methods keep. Budgets are whole entries apportioned by largest
remainder, each layer's between 0 and its entries outside the window, so they sum exactly
to 𝔹 (or to every such entry there is, when 𝔹 exceeds that). A local layer keeps only keys it
sees, even when its budget covers them all; a budget of the whole prompt is full prefill
(SAGE-KV's rule too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.methods.base import Budget, Method, Selection, bounded, full_prefill, make_probe, register
from rankkit.methods.selection import Captured, check_head_layer, descending_order
from rankkit.runner import AttentionCall, LayerHook, PrefillState


def normalized_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Eq. 6-7 over the scored (non-window) entries [H, N] of one layer, as a 0-d tensor on their device.

    A NaN score is a key a local layer cannot see: not one of its entries, and left out of both
    sums. A layer with no entry left to score (its window covers all it sees), or whose entries
    all score 0, has no distribution to measure: 0.
    """
    probabilities = scores.double().clamp_min(0)
    probabilities = probabilities / probabilities.nansum()
    count = (~scores.isnan()).sum().clamp_min(1)
    return -torch.special.xlogy(probabilities, probabilities).nansum() / count


def apportion(total: int, weights: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """Whole shares of ``total`` proportional to ``weights`` [n] (float64, >= 0), each within [0, cap]
    (``caps`` [n], int64), summing to ``total``; on the weights' device, with nothing read.

    Water-filling: the shares the proportion would push past their cap are fixed at it and the
    rest is shared again, until none passes; the last fractions go by largest remainder (ties
    to the earlier share). When ``total`` is outside [0, sum(caps)] every share sits at that bound.

    The rounds are not run one by one: a share passes its cap in a round when the round's
    ``remaining / weight`` exceeds its ``cap / weight``, so the shares fixed after each round are
    the first ones in ascending ``cap / weight``. Every prefix of that order is evaluated at once
    (its remaining total, the open weights summed in index order, each open share's proposal),
    and the rounds' walk from prefix to prefix is followed by pointer doubling: a constant number
    of launches per call, where a round each would be one launch sequence per layer.
    """
    count = weights.shape[0]
    device = weights.device
    weights, caps = weights.double(), caps.long()
    positive = weights > 0
    # a zero weight's proposal is 0 while others are open: it is fixed last, by its cap alone
    ratio = torch.where(positive, caps.double() / weights, caps.double())  # a zero weight's x / 0 is dropped
    by_ratio = torch.sort(ratio, stable=True).indices
    order = by_ratio[torch.sort((~positive[by_ratio]).to(torch.uint8), stable=True).indices]
    place = torch.empty_like(order).scatter_(0, order, torch.arange(count, device=device))
    prefixes = torch.arange(count + 1, device=device)
    open_ = place[None, :] >= prefixes[:, None]  # [prefix, share]: not yet fixed
    fixed_caps = torch.cat([caps.new_zeros(1), torch.cumsum(caps[order], 0)])
    remaining = (total - fixed_caps).double()[:, None]
    weight = torch.cumsum(weights * open_, dim=1)[:, -1:]  # in index order, as a running sum
    open_count = (count - prefixes).clamp_min(1).double()[:, None]
    proposal = torch.where(weight > 0, remaining * weights / weight, remaining / open_count)
    passing = (open_ & (proposal > caps)).sum(dim=1)
    step = prefixes + passing  # the prefix the next round starts from (itself once none passes)
    for _ in range(max(1, count).bit_length()):
        step = step[step]
    final = step[:1]  # a 1-element index: a 0-d one would be read back to the host to index with
    shares = torch.where(open_.index_select(0, final)[0], proposal.index_select(0, final)[0], caps.double())
    whole = torch.floor(shares)
    missing = total - whole.sum()
    ranks = torch.empty_like(order).scatter_(
        0, descending_order(shares - whole).to(device), torch.arange(count, device=device)
    )
    result = whole.long() + (ranks < missing).long()
    result = torch.where(caps.sum() <= total, caps, result)
    return result if total > 0 else torch.zeros_like(caps)


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
) -> list[int]:
    """``entropy_budgets`` of the layers whose scores [H, N] (window +inf, unseen -inf) are given."""
    windows = torch.stack([(s == float("inf")).sum() for s in scores])  # the window entries a layer sees
    sizes = torch.stack([(s != float("-inf")).sum() for s in scores])
    entropy = torch.tensor(entropy, dtype=torch.float64, device=windows.device)
    heads = scores[0].shape[0]
    return entropy_budgets(entropy, windows, sizes, keep_tokens, window, heads, num_layers).tolist()


def entropy_budgets(
    entropy: torch.Tensor,
    windows: torch.Tensor,
    sizes: torch.Tensor,
    keep_tokens: int,
    window: int,
    heads: int,
    num_layers: int,
) -> torch.Tensor:
    """Eq. 6-7 / Algorithm 2: the entries each layer so far keeps [n], given each layer's entropy,
    window entries and the entries it holds (``sizes``: what it can still lose), all [n] tensors.

    LAVa Alg. 1 ranks only the entries outside the recent window and keeps the window on top:
    𝔹 = (keep - w) x heads x layers entries outside the windows are shared by entropy, and each
    layer keeps the window entries it sees besides its share B_l.
    """
    total = max(0, keep_tokens - window) * heads * num_layers
    return windows + apportion(total, entropy, sizes - windows)


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
    """Algorithm 2 during one prefill: each layer scored and its entries ranked once, every layer cut
    once after the last.

    Alg. 2 recompresses every layer so far after each layer, to its entropy's share of 𝔹 among
    theirs. Those shares only shrink as layers join (the same 𝔹 over more entropy; a layer held at
    its cap is held to less), so each layer ends at its share among all L layers: the last
    recompression's budgets, made here once the prefill is over (``entropy_budgets``, the offline
    face's rule too), in one rounding to whole entries where L of them could each round its own way.
    A recompression keeps the best of what the layer kept, the first entries of the one order made
    when the layer was scored, so one cut to the last budget leaves what all of them would. The
    entries a layer loses later play no further part in the prefill (a layer's cache is read by that
    layer's attention alone), so the caches are those of evicting after each layer; the prefill holds
    every layer's entries until then, and no layer waits on the budgets or launches their arithmetic.
    """

    def __init__(self, probe, keep_tokens: int, window: int, num_layers: int):
        self.probe = probe
        self.keep_tokens = keep_tokens
        self.window = window
        self.num_layers = num_layers
        self.places: list[torch.Tensor] = []  # per layer, each flattened (head, position) entry's rank
        self.entropy: list[torch.Tensor] = []  # per layer, Eq. 7's e_l (0-d, float64, on the device)
        self.seen: list[torch.Tensor] = []  # per layer, the entries it can keep (unseen keys are none)
        self.floors: list[torch.Tensor] = []  # per layer, its window entries, never evicted
        self.heads = 0
        self.sizes: torch.Tensor | None = None  # the entries each layer keeps, once ``evict`` has run
        self._current: torch.Tensor | None = None

    @property
    def budgets(self) -> list[int]:
        """The entries each layer keeps after ``evict`` (reads the device: for inspection)."""
        return [] if self.sizes is None else self.sizes.tolist()

    def on_attention(self, call: AttentionCall) -> None:
        if call.phase == "prefill":
            scores, unseen = self.probe.score(call), call.unseen_keys()
            # NaN marks keys a local layer cannot see, online as offline (``Captured.hide_unseen``)
            self._current = scores if unseen is None else scores.masked_fill(unseen, float("nan"))

    def after_layer(self, layer: int, state: PrefillState) -> None:
        scores, self._current = self._current.float(), None
        ranked = with_window(scores, self.window)
        self.heads = ranked.shape[0]
        order = descending_order(ranked.flatten()).to(ranked.device)
        ranks = torch.arange(order.numel(), device=order.device)
        self.places.append(torch.empty_like(order).scatter_(0, order, ranks))
        self.entropy.append(normalized_entropy(windowless(scores, self.window)))
        self.seen.append((ranked != float("-inf")).sum())
        self.floors.append((ranked == float("inf")).sum())

    def evict(self, cache) -> None:
        """Cut every layer the budgets shrank to its first ``sizes`` entries (Algorithm 1 ``EVICT``);
        one read: which layers shrank, and their widest heads."""
        if not self.places:
            return
        self.sizes = entropy_budgets(
            torch.stack(self.entropy),
            torch.stack(self.floors),
            torch.stack(self.seen),
            self.keep_tokens,
            self.window,
            self.heads,
            self.num_layers,
        )
        kept = [place.view(self.heads, -1) < size for place, size in zip(self.places, self.sizes, strict=True)]
        # every layer's cache holds every key of the prompt, those a local layer cannot see too:
        # such a layer is cut to the keys it sees even when its budget covers them all
        shrunk = self.sizes < self.places[0].numel()
        widths = torch.stack([mask.sum(dim=1).amax() for mask in kept])
        shrunk, widths = torch.stack([shrunk.long(), widths]).tolist()
        for layer, (cut, mask, width) in enumerate(zip(shrunk, kept, widths, strict=True)):
            if cut:  # a full prefill's entry positions are its token indices: the mask is in entry order
                cache.compress_to_mask(layer, mask, width)


@register
@dataclass
class Lava(Method):
    name: ClassVar[str] = "lava"
    window_size: int = bounded(32, 1)  # w (the paper does not state it; SnapKV's, whose window LAVa adopts)
    kernel_size: int = bounded(7, 1)

    def probe(self):
        return make_probe("lava", window_size=self.window_size, kernel_size=self.kernel_size)

    def minimum_keep(self):
        return self.window_size  # Alg. 1 keeps the window on top of every head's budget

    def prefill(self, runner, input_ids, budget):
        length = int(input_ids.numel())
        keep = self.kept_tokens(budget, length)
        if keep >= length:
            return full_prefill(runner, input_ids)
        hook = LavaBudgets(self.probe(), keep, self.window_size, runner.num_layers)
        run = full_prefill(runner, input_ids, hooks=[hook])
        hook.evict(run.result.cache)
        return run

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
        check_head_layer(self.name, layer, captured.num_layers)
        stored = self._stored(captured)
        keep = self.kept_tokens(budget, captured.num_tokens)
        if keep >= captured.num_tokens:
            return Selection(layer, [captured.seen_positions(layer)] * stored.shape[1])
        entropy = [
            float(normalized_entropy(windowless(stored[index], self.window_size)))
            for index in range(captured.num_layers)
        ]
        layers = self._layers(captured)
        budgets = layer_budgets(layers, entropy, keep, self.window_size, captured.num_layers)
        return Selection(layer, evict(layers[layer], budgets[layer]))

    def layer_rankings(self, captured: Captured, budget: Budget) -> dict[int | None, torch.Tensor]:
        """Per layer, each token's best entry over the KV heads: the order tokens enter the kept entries."""
        return {layer: scores.amax(dim=0) for layer, scores in enumerate(self._layers(captured))}
