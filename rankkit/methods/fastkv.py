"""FastKV (Jo et al. 2025) as CLAA Appendix D.2 Listing 2 writes it: one pass.

Probe ``window`` (CLAA Eq. 2 / Eq. 4: softmax attention of the last W queries, avg
pooled with kernel 7) x ``FixedLayer(TSP)`` x one-pass mode: every layer before the
Token-Selective Propagation layer keeps, per KV head, its top tokens in the cache
(SnapKV-style, Eq. 4) while all hidden states go on; at the TSP layer the hidden states
are pruned to the top tokens of that layer's scores summed over heads (Eq. 2), while that
layer's cache keeps, like every layer before it, its own per-head top tokens (Listing 2
compresses each layer's cache by its own scores, as FastKV's GQA-aware compression does).
So layers <= TSP hold the budget per head, layers > TSP hold the selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rankkit.methods.base import bounded, make_probe, paper_layer, register
from rankkit.methods.selection import FixedLayer, PolicyMethod


@register
@dataclass
class FastKV(PolicyMethod):
    name: ClassVar[str] = "fastkv"
    tsp_layer: int | None = paper_layer(15, selection=True)  # FastKV and CLAA Table 4, of 32 layers
    window_size: int = bounded(8, 1)  # W
    kernel_size: int = bounded(7, 1)

    def probe(self):
        return make_probe("window", window_size=self.window_size, kernel_size=self.kernel_size)

    def policy(self, num_layers, keep):
        return FixedLayer(self.tsp_layer)

    def forced(self, keep):
        return self.window_size, 0

    def compress_from(self):
        return 0
