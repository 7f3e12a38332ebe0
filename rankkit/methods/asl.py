"""ASL, Adaptive Selection Layer (ASL Sec. 4, Appendix A Alg. 1-2).

Probe ``window`` (W=32, avg pooled with kernel 7; summed over all heads, Sec. 4.1) x
``RankVariance`` x one of two modes:

- ``asl``: one pass. Every layer before the selection compresses its cache per KV head
  to the budget (Algorithm 1, SnapKV), and at the selection layer the hidden states are
  pruned to the selected tokens, so every layer's cache holds exactly the budget.
- ``asl-2pass``: the first pass only finds the selection (no compression), then the
  selected tokens are re-prefilled through every layer (GemFilter's two passes).

Algorithm 2: from layer L_min on, stack the token ranks of the last L_obs layers
(R in N^{L_obs x T}, rank 0 = highest pooled score, window tokens excluded), take the
union U of each layer's top-k (k = budget - W), and the mean over U of the variance of
its ranks across those layers; divide by the same quantity at L_min. The first layer
where this relative variance drops below tau is the selection layer, and the tokens
kept are the top-k of that layer plus the window. If it never drops, the last layer
selects (nothing is left to speed up; the cache is still compressed).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.methods import selection
from rankkit.methods.base import LAYER, bounded, depth_field, make_probe, paper_count, register
from rankkit.methods.selection import Captured, LayerPolicy, PolicyMethod, descending_ranks


class RankVariance(LayerPolicy):
    """ASL's adaptive selection layer (Algorithm 2 ``SelectTokens``)."""

    def __init__(
        self, tau: float, min_layer: int, observed_layers: int, top_k: int, window: int, last_layer: int
    ):
        self.tau = tau
        self.min_layer = min_layer
        self.top_k = top_k
        self.window = window
        self.last_layer = last_layer
        self.observed_layers = observed_layers
        self.first_ranked_layer = max(0, min_layer - observed_layers + 1)
        self.rank_cache: deque[torch.Tensor] = deque(maxlen=observed_layers)
        self.initial_variance: float | None = None
        self.relative_variance: dict[int, float] = {}

    def needs_scores(self, layer):
        return layer >= self.first_ranked_layer

    def decide(self, layer, scores):
        if scores is None:  # a layer before the first one L_obs looks back to
            return None
        summed = scores.sum(0)
        self.rank_cache.append(self._ranks(summed))
        if layer < self.min_layer:
            return None
        return summed if self._selects(layer, torch.stack(list(self.rank_cache))) else None

    def decide_at_once(self, head_sums):
        """``decide``'s walk over every layer's head sums [L, T], with every layer's ranks made in one
        sort; the variances are exact, so each layer's is ``decide``'s to the last bit."""
        ranks = self._ranks(head_sums[self.first_ranked_layer :])
        for layer in range(self.min_layer, head_sums.shape[0]):
            last = layer - self.first_ranked_layer + 1
            if self._selects(layer, ranks[max(0, last - self.observed_layers) : last]):
                return layer, head_sums[layer]
        return None

    def _ranks(self, summed: torch.Tensor) -> torch.Tensor:
        """The ranks (0 = highest) of the scores [..., T] without the window (Algorithm 1 line 4: the
        window is not ranked), as float64: integers, whose sums stay exact."""
        return descending_ranks(summed[..., : summed.shape[-1] - self.window]).double()

    def _selects(self, layer: int, ranks: torch.Tensor) -> bool:
        """Whether the relative rank variance of the ranks [L_obs, T - W] ending at ``layer`` selects
        there (below tau, or the last layer); it is recorded in ``relative_variance``."""
        variance = float(union_rank_variance(ranks, self.top_k))
        if self.initial_variance is None:
            self.initial_variance = variance
        relative = variance / self.initial_variance if self.initial_variance > 0 else 0.0
        self.relative_variance[layer] = relative
        return selects(relative, self.tau, layer, self.last_layer)


def selects(relative_variance: float, tau: float, layer: int, last_layer: int) -> bool:
    """Algorithm 2 line 9: ``layer`` selects where its relative variance is below tau, and the last
    layer selects whatever its variance (nothing is left to speed up, the cache is still compressed)."""
    return relative_variance < tau or layer == last_layer


def selection_layer(curve: Sequence[float], tau: float) -> int:
    """The layer ``asl`` selects at over a relative variance ``curve`` (NaN before L_min, as
    ``relative_variance_curve`` draws it): the first below tau, else the last."""
    last_layer = len(curve) - 1
    return next(
        layer
        for layer, relative in enumerate(curve)
        if not math.isnan(relative) and selects(relative, tau, layer, last_layer)
    )


def is_fallback(curve: Sequence[float], tau: float) -> bool:
    """Whether ``asl`` selects the last layer of ``curve`` only because no layer's variance fell below tau."""
    return not any(relative < tau for relative in curve)  # NaN (before L_min) is never below


def union_rank_variance(ranks: torch.Tensor, top_k: int) -> torch.Tensor:
    """Algorithm 2's mean over U of each token's population variance across the layers of ``ranks``
    [layers, T] (float64 integers), U the tokens in any layer's top-k (each layer's ranks are a
    permutation: its top-k are the tokens ranked below k); NaN for an empty U.

    Worked in sums of integers, exact in float64 (up to some 30k tokens), so any order of
    summing gives the same value: layers^2 x variance = layers x sum(r^2) - sum(r)^2.
    """
    layers = ranks.shape[0]
    union = ranks.amin(dim=0) < top_k
    spread = layers * (ranks * ranks).sum(dim=0) - ranks.sum(dim=0).square()
    return (spread * union).sum() / (layers * layers * union.sum())


def relative_variance_curve(
    layer_scores: torch.Tensor, top_k: int, window: int, min_layer: int, observed_layers: int
) -> list[float]:
    """ASL Alg. 2's relative rank variance at every layer of scores [L, kv_heads, T], NaN before L_min:
    ``RankVariance`` itself run over every layer (a threshold nothing drops below)."""
    num_layers = layer_scores.shape[0]
    policy = RankVariance(float("-inf"), min_layer, observed_layers, top_k, window, last_layer=num_layers)
    policy.decide_at_once(selection.head_sums(layer_scores))
    return [policy.relative_variance.get(layer, float("nan")) for layer in range(num_layers)]


@dataclass
class Asl(PolicyMethod):
    """One-pass ASL with SnapKV before the selection layer."""

    name: ClassVar[str] = "asl"
    tau: float = bounded(0.3, 0, open_low=True, reference="τ, ASL Alg. 2")
    min_layer: int | None = depth_field(
        lambda num_layers: num_layers // 3, bounds=LAYER
    )  # L_min = floor(L/3), Appendix D.2
    observed_layers: int | None = paper_count(8, minimum=2)  # L_obs, of 32 layers
    window_size: int = bounded(32, 1)  # W
    kernel_size: int = bounded(7, 1)

    def probe(self):
        return make_probe("window", window_size=self.window_size, kernel_size=self.kernel_size)

    def policy(self, num_layers, keep):
        """Algorithm 2 with k = budget - W: the window is kept apart from the ranked tokens."""
        return RankVariance(
            self.tau,
            self.min_layer,
            self.observed_layers,
            keep - self.window_size,
            self.window_size,
            num_layers - 1,
        )

    def forced(self, keep):
        return self.window_size, 0

    def minimum_keep(self):
        # Alg. 2 ranks k = budget - W tokens: with none, its rank variance is 0/0 and the
        # selection layer (and the variance curve) would be made up
        return self.window_size + 1

    def compress_from(self):
        return 0

    def variance_curve(self, captured: Captured, budget) -> list[float]:
        """The relative rank variance the selection follows, at every layer (``rankkit variance``)."""
        bound, keep, _, _ = self._plan(captured.num_layers, captured.num_tokens, budget, captured.layer_types)
        policy = bound.policy(captured.num_layers, keep)  # its k, window, L_min and L_obs, not its tau
        return relative_variance_curve(
            self.captured_scores(captured),
            policy.top_k,
            policy.window,
            policy.min_layer,
            policy.observed_layers,
        )


@dataclass
class AslTwoPass(Asl):
    """ASL's selection layer found in a first pass, then GemFilter's re-prefill of the selection."""

    name: ClassVar[str] = "asl-2pass"
    two_pass: ClassVar[bool] = True
    ranks_like: ClassVar[type[Asl]] = Asl


register(Asl)
register(AslTwoPass)
