"""CLAA, Cross-Layer Attention Aggregation (CLAA Sec. 4.2, Eq. 5, Appendix D.5 Listing 5).

Probe ``window`` (Eq. 5, avg pooled with kernel 7) x ``CrossLayerMax`` x one-pass mode:
the first m layers keep their whole cache (deferred compression); layers m..l_p-1 keep,
per KV head, their top tokens (as FastKV does); the scores of the last n layers up to
l_p are buffered and at l_p the hidden states are pruned to the top tokens of their
element-wise maximum, S^CLAA_i = max_{l' in l_p-n+1..l_p} S_i^(l'). The cache of l_p is
compressed with the same indices, so layers >= l_p hold the selection.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from rankkit.methods.base import Method, make_probe, register, scale_count, scale_layer
from rankkit.methods.selection import LayerPolicy, SelectionHook, one_pass

REFERENCE_PRUNING_LAYER = 15  # l_p, CLAA Table 4
REFERENCE_AGGREGATION_WINDOW = 4  # n
REFERENCE_DEFERRED_LAYERS = 4  # m


class CrossLayerMax(LayerPolicy):
    """CLAA's layer policy: select at ``layer`` by the max over the buffered scores of up to n layers.

    Only layers >= ``first_layer`` enter the buffer (Listing 5: deferred layers are not scored).
    """

    def __init__(self, layer: int, aggregation_window: int, first_layer: int = 0):
        self.layer = layer
        self.first_layer = max(first_layer, layer - aggregation_window + 1)
        self.buffer: deque[torch.Tensor] = deque(maxlen=aggregation_window)

    def needs_scores(self, layer):
        return self.first_layer <= layer <= self.layer

    def decide(self, layer, scores):
        if scores is not None:
            self.buffer.append(scores.sum(0))
        if layer != self.layer:
            return None
        return torch.stack(list(self.buffer)).amax(dim=0)


@dataclass
class ClaaLayers:
    """CLAA's three layer parameters resolved for one model."""

    pruning_layer: int
    aggregation_window: int
    deferred_layers: int


@register
@dataclass
class Claa(Method):
    name: ClassVar[str] = "claa"
    pruning_layer: int | None = None  # l_p; default 15 of 32 scaled
    aggregation_window: int | None = None  # n; default 4 of 32 layers scaled
    deferred_layers: int | None = None  # m; default 4 of 32 layers scaled
    window_size: int = 8  # W
    kernel_size: int = 7

    def layers(self, num_layers: int) -> ClaaLayers:
        return ClaaLayers(
            self.pruning_layer
            if self.pruning_layer is not None
            else scale_layer(REFERENCE_PRUNING_LAYER, num_layers),
            self.aggregation_window
            if self.aggregation_window is not None
            else scale_count(REFERENCE_AGGREGATION_WINDOW, num_layers),
            self.deferred_layers
            if self.deferred_layers is not None
            else scale_count(REFERENCE_DEFERRED_LAYERS, num_layers, minimum=0),
        )

    def resolved(self, num_layers):
        layers = self.layers(num_layers)
        return {**vars(layers), "window_size": self.window_size, "kernel_size": self.kernel_size}

    def with_layer(self, layer):
        return replace(self, pruning_layer=layer)

    def prefill(self, runner, input_ids, budget):
        layers = self.layers(runner.num_layers)
        keep = budget.resolve(int(input_ids.numel()), always_kept=self.window_size)
        hook = SelectionHook(
            make_probe("window", window_size=self.window_size, kernel_size=self.kernel_size),
            CrossLayerMax(layers.pruning_layer, layers.aggregation_window, layers.deferred_layers),
            keep,
            window=self.window_size,
            compress_from=layers.deferred_layers,
        )
        return one_pass(runner, input_ids, hook)
