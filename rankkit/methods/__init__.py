"""End-to-end methods: each heuristic's selection run for real, registered by name.

``make("claa", pruning_layer=15)`` builds one; ``REGISTRY`` lists them. Importing this
package registers every method.
"""

from rankkit.methods import (  # noqa: F401  (each module registers its method)
    asl,
    claa,
    fastkv,
    full,
    gemfilter,
    lava,
    oracle,
    sage_kv,
    sliminfer,
    snapkv,
    specprefill,
    streamingllm,
)
from rankkit.methods.base import REGISTRY, Budget, Method, MethodPrefill, Pass, make, scale_layer

__all__ = ["REGISTRY", "Budget", "Method", "MethodPrefill", "Pass", "make", "scale_layer"]
