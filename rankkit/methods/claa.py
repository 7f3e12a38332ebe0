"""CLAA, Cross-Layer Attention Aggregation (CLAA Sec. 4.2, Eq. 5, Appendix D.5 Listing 5).

Probe ``window`` (Eq. 5, avg pooled with kernel 7) x ``CrossLayerMax`` x one-pass mode:
the first m layers keep their whole cache (deferred compression); layers m..l_p-1 keep,
per KV head, their top tokens (as FastKV does); the scores of the last n layers up to
l_p are buffered and at l_p the hidden states are pruned to the top tokens of their
element-wise maximum, S^CLAA_i = max_{l' in l_p-n+1..l_p} S_i^(l'). The cache of l_p keeps
its own per-head top tokens (Listing 5's ``compression_indices``, apart from its
``pruning_indices``), so layers <= l_p hold the budget per head, layers > l_p the selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.methods.base import bounded, make_probe, paper_count, paper_layer, register
from rankkit.methods.selection import LayerPolicy, PolicyMethod


class CrossLayerMax(LayerPolicy):
    """CLAA's layer policy: select at ``layer`` by the max over the buffered scores of up to n layers.

    Only layers >= ``first_layer`` enter the buffer (Listing 5: deferred layers are not scored);
    the selection layer itself always does, even when it is among the deferred ones. The layers
    scored are first_layer..layer, never more than n, so the buffer holds exactly the n it maxes over.
    """

    def __init__(self, layer: int, aggregation_window: int, first_layer: int = 0):
        self.layer = layer
        self.first_layer = min(layer, max(first_layer, layer - aggregation_window + 1))
        self.buffer: list[torch.Tensor] = []

    def needs_scores(self, layer):
        return self.first_layer <= layer <= self.layer

    def decide(self, layer, scores):
        if scores is not None:
            self.buffer.append(scores.sum(0))
        if layer != self.layer:
            return None
        return torch.stack(self.buffer).amax(dim=0)

    def decide_at_once(self, head_sums):
        return self.layer, head_sums[self.first_layer : self.layer + 1].amax(dim=0)


@register
@dataclass
class Claa(PolicyMethod):
    name: ClassVar[str] = "claa"
    pruning_layer: int | None = paper_layer(15, selection=True)  # l_p, CLAA Table 4, of 32 layers
    aggregation_window: int | None = paper_count(4)  # n, of 32 layers
    deferred_layers: int | None = paper_count(4, minimum=0)  # m, of 32 layers
    window_size: int = bounded(8, 1)  # W
    kernel_size: int = bounded(7, 1)

    def probe(self):
        return make_probe("window", window_size=self.window_size, kernel_size=self.kernel_size)

    def policy(self, num_layers, keep):
        return CrossLayerMax(self.pruning_layer, self.aggregation_window, self.deferred_layers)

    def forced(self, keep):
        return self.window_size, 0

    def compress_from(self):
        return self.deferred_layers
