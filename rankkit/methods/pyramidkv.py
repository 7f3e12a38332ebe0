"""PyramidKV (Cai et al. 2024), KV-only: SnapKV's per-head selection under budgets that shrink with depth.

Probe ``window`` (W=32, avg pooled, kernel 7: SnapKV's settings here) x no selection layer x
KV-only mode, as SnapKV, except that each layer keeps its own count. Attention "funnels" with
depth: lower layers spread it over many tokens, higher ones gather it on a few, so lower
layers keep more. Beyond the observation window, which every layer keeps, the layers'
counts form an arithmetic sequence from ``high`` at layer 0 down to ``low`` at the last layer
with the budget's mean (``layer_budgets``); ``beta`` sets the slope (``low`` = mean / beta).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rankkit.methods.base import Budget, bounded, register
from rankkit.methods.selection import Captured, NeverSelect, SelectionHook, one_pass
from rankkit.methods.snapkv import SnapKV


def layer_budgets(num_layers: int, length: int, keep: int, window: int, beta: float) -> list[int]:
    """Tokens each layer keeps for a prompt of ``length`` and a budget of ``keep`` per layer on average.

    With a = keep - window, the share beyond the window: ``low`` = a / beta, ``high`` = 2a - low
    (so their mean is a); when ``high`` would pass the length - window tokens there are,
    it is that and ``low`` = 2a - high. Layer l keeps round(high - l (high - low) / (L - 1)) + window.
    """
    if keep >= length:  # e.g. a prompt shorter than the window: every layer keeps it whole
        return [length] * num_layers
    share = keep - window
    low = share / beta
    high = 2 * share - low
    if high > length - window:
        high = length - window
        low = 2 * share - high
    if num_layers == 1:
        return [keep]
    step = (high - low) / (num_layers - 1)
    return [round(high - layer * step) + window for layer in range(num_layers)]


class LayerBudgetHook(SelectionHook):
    """A KV-only ``SelectionHook`` whose layer l keeps ``budgets[l]`` entries per KV head."""

    def __init__(self, probe, budgets: list[int], *, window: int):
        super().__init__(probe, NeverSelect(), budgets[0], window=window, compress_from=0)
        self.budgets = budgets

    def after_layer(self, layer, state):
        self.keep = self.budgets[layer]
        super().after_layer(layer, state)


@register
@dataclass
class PyramidKV(SnapKV):
    name: ClassVar[str] = "pyramidkv"
    # PyramidKV's default: the last layer keeps 1/20 of the mean share (1 keeps the same count per layer)
    beta: float = bounded(20.0, 1, reference="β, PyramidKV")

    def budgets(self, num_layers: int, length: int, budget: Budget) -> list[int]:
        keep = self.kept_tokens(budget, length)
        return layer_budgets(num_layers, length, keep, self.window_size, self.beta)

    def prefill(self, runner, input_ids, budget):
        budgets = self.budgets(runner.num_layers, int(input_ids.numel()), budget)
        return one_pass(runner, input_ids, LayerBudgetHook(self.probe(), budgets, window=self.window_size))

    def select_offline(self, captured: Captured, budget: Budget, *, layer: int | None = None):
        """SnapKV's per-head kept set at ``layer``, under that layer's count."""
        if layer is not None and 0 <= layer < captured.num_layers:
            budget = Budget.from_tokens(self.budgets(captured.num_layers, captured.num_tokens, budget)[layer])
        return super().select_offline(captured, budget, layer=layer)
