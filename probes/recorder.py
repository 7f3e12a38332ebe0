"""A layer hook that scores every prefill layer with a set of probes."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from rankkit.cache import PADDING
from rankkit.errors import RankkitError
from rankkit.models import to_host
from rankkit.runner import AttentionCall, LayerHook

from .attention import SHARED_WINDOW, share_window
from .base import Probe


class ProbeRecorder(LayerHook):
    """Scores each prefill layer's attention with every probe; ``scores()`` hands them over.

    It records one prefill: a new prefill (its first layer arriving again) starts over,
    and decode steps are ignored. Per-layer scores stay on the model's device until
    ``scores()`` moves them to the host, every probe in one transfer.

    Scores are laid out by original position: ``scores()[key][layer, head, p]`` is the
    score of the prompt token at position p, with T one past the largest position seen.
    A token absent from a layer (pruned by an earlier layer, or not re-prefilled in a
    two-pass run) is NaN there, and so is a token a sliding-window layer cannot see from
    its last query (position <= last position - window): such a layer has no opinion on
    it. In a plain prefill of a model with only global layers nothing is NaN.
    """

    def __init__(self, probes: Iterable[Probe]):
        self.probes = list(probes)
        names = [probe.key for probe in self.probes]
        if len(set(names)) != len(names):
            raise RankkitError(f"each probe may be recorded once; got {', '.join(names)}")
        self._layers: list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]] = []
        windows = [window for window in (probe.attention_window() for probe in self.probes) if window]
        self._shared_window = max(windows) if len(windows) > 1 else None

    def on_attention(self, call: AttentionCall) -> None:
        if call.phase != "prefill":
            return
        if self._layers and call.layer <= self._layers[-1][0]:
            self._layers = []
        if self._shared_window is not None:
            share_window(call, self._shared_window)
        scores = {probe.key: probe.score(call) for probe in self.probes}
        if self._shared_window is not None:
            del call.shared[SHARED_WINDOW]  # its W x S blocks, no longer needed
        unseen = call.unseen_keys()  # [kv_heads, S] on a local layer
        if unseen is not None:  # a per-query-head probe's rows share their KV head's keys
            scores = {
                key: score.masked_fill(
                    unseen.repeat_interleave(score.shape[0] // unseen.shape[0], dim=0), float("nan")
                )
                for key, score in scores.items()
            }
        self._layers.append((call.layer, call.key_positions, scores))

    def scores(self) -> dict[str, np.ndarray]:
        """Float32 [layers, heads, T] (KV heads, or query heads for a per-query-head probe) per probe key (``Probe.key``), for the layers the last prefill ran."""
        if not self._layers or not self.probes:
            return {}
        positions = [key_positions for _, key_positions, _ in self._layers]
        length = int(torch.stack([each.max() for each in positions]).max()) + 1
        # every layer's keys, padded to the widest layer: cache padding and the padding here both go
        # to a spare last column, cut off below, so each probe is laid out by one scatter
        widest = max(each.shape[1] for each in positions)
        columns = torch.stack(
            [_padded(each.masked_fill(each == PADDING, length), widest, length) for each in positions]
        )
        recorded = []
        for probe in self.probes:
            stacked = torch.stack(
                [_padded(layer_scores[probe.key], widest, float("nan")) for *_, layer_scores in self._layers]
            )
            # a probe with a row per query head reads its KV head's positions (G rows each)
            rows = columns.repeat_interleave(stacked.shape[1] // columns.shape[1], dim=1).to(stacked.device)
            laid_out = torch.full((*stacked.shape[:2], length + 1), float("nan"), device=stacked.device)
            recorded.append(laid_out.scatter_(2, rows, stacked)[..., :-1])
        # one transfer for every probe: each copy from the device waits for it
        host = to_host(torch.cat([scores.reshape(-1) for scores in recorded]))
        pieces = host.split([scores.numel() for scores in recorded])
        return {
            probe.key: pieces[index].reshape(recorded[index].shape).numpy()
            for index, probe in enumerate(self.probes)
        }


def _padded(entries: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """``entries`` [rows, S] filled with ``value`` up to ``width`` columns (itself when already that wide)."""
    missing = width - entries.shape[1]
    return entries if not missing else torch.nn.functional.pad(entries, (0, missing), value=value)
