"""End-to-end methods: each heuristic's selection run for real, registered by name.

``make("claa", pruning_layer=15)`` builds one; ``REGISTRY`` lists them. Importing this
package registers every method: rankkit's own, then those other packages declare under the
entry point group ``rankkit.methods`` (docs/extending.md).
"""

from rankkit.errors import RankkitError
from rankkit.methods import (  # noqa: F401  (each module registers its method)
    adakv,
    asl,
    claa,
    fastkv,
    full,
    gemfilter,
    lava,
    oracle,
    pyramidkv,
    sage_kv,
    sliminfer,
    snapkv,
    specprefill,
    streamingllm,
    tova,
)
from rankkit.methods.base import (
    REGISTRY,
    Budget,
    Method,
    MethodPrefill,
    Pass,
    Selection,
    budget_keywords,
    check_parameters,
    given_budgets,
    make,
    register,
    scale_layer,
)
from rankkit.methods.selection import Captured
from rankkit.plugins import register_entry_points

__all__ = [
    "REGISTRY",
    "Budget",
    "Captured",
    "budget_keywords",
    "Method",
    "MethodPrefill",
    "Pass",
    "Selection",
    "check_parameters",
    "given_budgets",
    "make",
    "probes_methods_need",
    "register",
    "scale_layer",
]


def default_capture_probes() -> list:
    """What ``rankkit capture`` records by default (``--probes all``): every probe at its defaults, and
    every probe setting a registered method ranks by (``probes_methods_need``)."""
    from rankkit.probes import parse_probes

    probe_list = parse_probes("all")
    keys = {probe.key for probe in probe_list}
    return probe_list + [probe for probe in probes_methods_need() if probe.key not in keys]


def probes_methods_need() -> list:
    """The probes the registered methods rank by at their defaults, once per store key: what a
    default capture records beside every probe, so each method's offline face finds its scores."""
    from rankkit import probes

    needed = {}
    for cls in REGISTRY.values():
        method = cls()
        try:
            keys = method.captured_inputs()
        except RankkitError:  # a method without an offline face needs nothing captured
            continue
        for key in keys:
            if key.partition(":")[0] in probes.REGISTRY:
                needed.setdefault(key, method.probe())
    return list(needed.values())


# Last, so a package's module finds everything above when its import registers its classes.
register_entry_points("rankkit.methods", REGISTRY, register)
