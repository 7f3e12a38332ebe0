"""rankkit: how good is a token-ranking heuristic, layer by layer, and what does it buy end to end."""

from rankkit.errors import RankkitError

__version__ = "0.1.0"
__all__ = ["RankkitError", "__version__"]
