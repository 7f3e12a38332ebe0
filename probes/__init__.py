"""Token-scoring probes, registered by name, and the hook that records them during a prefill.

Every probe returns float32 [kv_heads, S] per layer from the post-RoPE Q/K/V the runner
exposes, without an S x S matrix. Importing this package registers all of them.
Like the oracle, the probes score the attention the model computes: capped logits, sinks
in the softmax, and a local layer's sliding window in the mask (see ``attention.py``);
``ProbeRecorder`` stores NaN for keys a local layer cannot see.
"""

from __future__ import annotations

from rankkit.errors import RankkitError

from .base import REGISTRY, Probe, register
from .last_token_heads import LastTokenHeadsProbe
from .last_token_raw import LastTokenRawProbe
from .lava import LavaProbe
from .recorder import ProbeRecorder
from .token_units import TokenUnitsProbe
from .window import WindowProbe

__all__ = [
    "REGISTRY",
    "LastTokenHeadsProbe",
    "LastTokenRawProbe",
    "LavaProbe",
    "Probe",
    "ProbeRecorder",
    "TokenUnitsProbe",
    "WindowProbe",
    "make",
    "parse_probes",
    "register",
]


def make(name: str, **params) -> Probe:
    """The probe registered as ``name``, with ``params`` overriding its paper defaults."""
    if name not in REGISTRY:
        raise RankkitError(f"unknown probe {name!r}; known: {', '.join(sorted(REGISTRY))}")
    try:
        return REGISTRY[name](**params)
    except TypeError as error:  # an unknown parameter name
        raise RankkitError(f"probe {name!r}: {error}") from error


def parse_probes(spec: str) -> list[Probe]:
    """Probes with default parameters from ``"window,last_token_raw"`` or ``"all"`` (every registered one)."""
    names = (
        list(REGISTRY)
        if spec.strip() == "all"
        else [name.strip() for name in spec.split(",") if name.strip()]
    )
    if not names:
        raise RankkitError("no probe named; give comma-separated names or 'all'")
    return [make(name) for name in dict.fromkeys(names)]
