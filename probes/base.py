"""The probe contract: one layer's attention in, one score per (KV head, token) out."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import torch

from rankkit.runner import AttentionCall


@dataclass
class Probe:
    """A scoring rule. ``score`` is a pure function of one layer's post-RoPE Q/K/V.

    It returns float32 [kv_heads, S] for the S keys of ``call`` (every prompt token in a
    plain prefill), higher = more important, and never builds an S x S matrix.
    """

    name: ClassVar[str] = ""

    def score(self, call: AttentionCall) -> torch.Tensor:
        raise NotImplementedError

    def attention_window(self) -> int | None:
        """How many last queries' attention ``score`` reads (``probes.attention``), None when none: a
        recorder of several such probes computes the widest window once for all of them."""
        return None

    def layout(self) -> dict:
        """How the stored scores are laid out, recorded on the probe's score array (empty: one rule for all)."""
        return {}

    def params(self) -> dict:
        """The parameters a store records beside the scores."""
        return {"probe": self.name, **asdict(self)}

    @property
    def key(self) -> str:
        """The name this instance's scores are stored under: the probe's name, followed by the
        parameters that differ from its defaults in ``--probes`` syntax (``window:w=32``)."""
        changed = [
            f"{SHORT_NAMES.get(spec.name, spec.name)}={getattr(self, spec.name)}"
            for spec in fields(self)
            if getattr(self, spec.name) != spec.default
        ]
        return f"{self.name}:{','.join(changed)}" if changed else self.name


# Short parameter names ``--probes`` accepts (and store keys use) beside the full ones.
SHORT_NAMES = {"window_size": "w", "kernel_size": "kernel"}


REGISTRY: dict[str, type[Probe]] = {}


def register(cls: type[Probe]) -> type[Probe]:
    REGISTRY[cls.name] = cls
    return cls
