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

from collections import deque
from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.methods.base import Method, make_probe, register, scale_count
from rankkit.methods.selection import LayerPolicy, SelectionHook, one_pass, two_pass

REFERENCE_OBSERVED_LAYERS = 8  # L_obs


def descending_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Rank of every entry, 0 for the highest score (``RankDesc``), as float."""
    order = torch.argsort(scores, descending=True)
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(order.numel(), device=order.device)
    return ranks.float()


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
        past = summed[: summed.numel() - self.window]  # Algorithm 1 line 4: the window is not ranked
        self.rank_cache.append(descending_ranks(past))
        if layer < self.min_layer:
            return None
        ranks = torch.stack(list(self.rank_cache))  # [L_obs, T - W]
        k = min(self.top_k, ranks.shape[1])
        union = torch.unique(torch.topk(ranks, k, dim=1, largest=False).indices.flatten())
        variance = float(ranks[:, union].var(dim=0, unbiased=False).mean())
        if self.initial_variance is None:
            self.initial_variance = variance
        relative = variance / self.initial_variance if self.initial_variance > 0 else 0.0
        self.relative_variance[layer] = relative
        return summed if relative < self.tau or layer == self.last_layer else None


@dataclass
class Asl(Method):
    """One-pass ASL with SnapKV before the selection layer."""

    name: ClassVar[str] = "asl"
    tau: float = 0.3
    min_layer: int | None = None  # L_min; default floor(L / 3) (Appendix D.2)
    observed_layers: int | None = None  # L_obs; default 8 of 32 layers scaled
    window_size: int = 32
    kernel_size: int = 7
    two_pass: ClassVar[bool] = False

    def layers(self, num_layers: int) -> tuple[int, int]:
        min_layer = self.min_layer if self.min_layer is not None else num_layers // 3
        observed = (
            self.observed_layers
            if self.observed_layers is not None
            else scale_count(REFERENCE_OBSERVED_LAYERS, num_layers, minimum=2)
        )
        return min_layer, observed

    def resolved(self, num_layers):
        min_layer, observed = self.layers(num_layers)
        return {
            "tau": self.tau,
            "min_layer": min_layer,
            "observed_layers": observed,
            "window_size": self.window_size,
            "kernel_size": self.kernel_size,
        }

    def prefill(self, runner, input_ids, budget):
        keep = budget.resolve(int(input_ids.numel()), always_kept=self.window_size)
        min_layer, observed = self.layers(runner.num_layers)
        policy = RankVariance(
            self.tau, min_layer, observed, keep - self.window_size, self.window_size, runner.num_layers - 1
        )
        probe = make_probe("window", window_size=self.window_size, kernel_size=self.kernel_size)
        if self.two_pass:
            return two_pass(runner, input_ids, SelectionHook(probe, policy, keep, window=self.window_size))
        hook = SelectionHook(probe, policy, keep, window=self.window_size, compress_from=0)
        return one_pass(runner, input_ids, hook)


@dataclass
class AslTwoPass(Asl):
    """ASL's selection layer found in a first pass, then GemFilter's re-prefill of the selection."""

    name: ClassVar[str] = "asl-2pass"
    two_pass: ClassVar[bool] = True


register(Asl)
register(AslTwoPass)
