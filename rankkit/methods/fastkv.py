"""FastKV (Jo et al. 2025) as CLAA Appendix D.2 Listing 2 writes it: one pass.

Probe ``window`` (CLAA Eq. 2 / Eq. 4: softmax attention of the last W queries, avg
pooled with kernel 7) x ``FixedLayer(TSP)`` x one-pass mode: every layer before the
Token-Selective Propagation layer keeps, per KV head, its top tokens in the cache
(SnapKV-style, Eq. 4) while all hidden states go on; at the TSP layer the hidden states
are pruned to the top tokens of that layer's scores summed over heads (Eq. 2), and that
layer's cache is compressed with the same indices, so layers >= TSP hold the selection.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from rankkit.methods.base import Method, make_probe, register, scale_layer
from rankkit.methods.selection import FixedLayer, SelectionHook, one_pass

REFERENCE_TSP_LAYER = 15  # FastKV and CLAA Table 4 for 32-layer Llama-3.1-8B


@register
@dataclass
class FastKV(Method):
    name: ClassVar[str] = "fastkv"
    tsp_layer: int | None = None  # default 15 of 32 scaled to the model's depth
    window_size: int = 8  # W
    kernel_size: int = 7

    def layer(self, num_layers: int) -> int:
        return self.tsp_layer if self.tsp_layer is not None else scale_layer(REFERENCE_TSP_LAYER, num_layers)

    def resolved(self, num_layers):
        return {
            "tsp_layer": self.layer(num_layers),
            "window_size": self.window_size,
            "kernel_size": self.kernel_size,
        }

    def with_layer(self, layer):
        return replace(self, tsp_layer=layer)

    def prefill(self, runner, input_ids, budget):
        keep = budget.resolve(int(input_ids.numel()), always_kept=self.window_size)
        hook = SelectionHook(
            make_probe("window", window_size=self.window_size, kernel_size=self.kernel_size),
            FixedLayer(self.layer(runner.num_layers)),
            keep,
            window=self.window_size,
            compress_from=0,
        )
        return one_pass(runner, input_ids, hook)
