"""The probe: one layer's keys in, one score per (KV head, token) out."""

from dataclasses import dataclass
from typing import ClassVar

import torch

from rankkit.probes import Probe
from rankkit.runner import AttentionCall


@dataclass
class KeyNormProbe(Probe):
    """Each key's L2 norm, negated: a key of small norm draws much attention, so it ranks high."""

    name: ClassVar[str] = "key_norm"

    def score(self, call: AttentionCall) -> torch.Tensor:
        return -call.key[0].float().norm(dim=-1)  # [kv_heads, S]
