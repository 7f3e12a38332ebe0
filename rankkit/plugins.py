"""Methods and probes from other packages, found through their entry points, and the one way
either registry builds an instance.

A package declares ``[project.entry-points."rankkit.methods"]`` (or ``"rankkit.probes"``)
naming a class, ``name = "package.module:Class"``, or a module whose import registers its
classes; rankkit loads them when it registers its own, so every command knows them
(docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from importlib.metadata import entry_points

from rankkit.errors import RankkitError


def register_entry_points(group: str, registry: dict[str, type], register: Callable[[type], type]) -> None:
    """Register every class the installed packages declare under the entry point ``group``.

    A class whose ``name`` another class already holds is refused (a package cannot replace
    rankkit's methods); a point that fails to load stops with its package's error, in one line.
    """
    for point in entry_points(group=group):
        try:
            loaded = point.load()
        except Exception as error:  # whatever the other package raises on import
            raise RankkitError(
                f"entry point {point.name!r} of group {group!r} ({point.value}) does not load: "
                f"{type(error).__name__}: {error}"
            ) from None
        if not isinstance(loaded, type):
            continue  # a module: importing it registered its classes
        taken = registry.get(loaded.name)
        if taken is not None and taken is not loaded:
            raise RankkitError(
                f"entry point {point.name!r} of group {group!r} ({point.value}) registers the name "
                f"{loaded.name!r}, which {taken.__module__}.{taken.__qualname__} already has; rename it"
            )
        register(loaded)


def construct(cls: type, what: str, params: dict):
    """``cls(**params)`` for a registered method or probe (a dataclass) named ``what`` ("method
    'claa'"), a parameter it does not take refused with the ones it does."""
    known = [spec.name for spec in fields(cls) if spec.init]
    unknown = [name for name in params if name not in known]
    if unknown:
        takes = f"it takes {', '.join(known)}" if known else "it takes none"
        raise RankkitError(f"{what} has no parameter {unknown[0]!r}; {takes}")
    return cls(**params)
