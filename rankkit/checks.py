"""Checks every command runs on its options before the model loads (or before any compute)."""

from __future__ import annotations

import warnings

from rankkit.errors import RankkitError


def check_layer(layer: int, num_layers: int, method: str) -> None:
    """A selection layer (``--layer``) must be one of the model's layers."""
    if not 0 <= layer < num_layers:
        raise RankkitError(
            f"--layer {layer} is not a layer of this model ({num_layers} layers, 0..{num_layers - 1}) "
            f"for method '{method}'; give a layer in that range or leave --layer out"
        )


def check_length(num_tokens: int, config, what: str, *, allow_overlength: bool = False) -> None:
    """A prompt longer than the model's ``max_position_embeddings`` is refused unless forced."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or num_tokens <= limit:
        return
    message = f"{what} has {num_tokens} tokens, more than the model's {limit} positions"
    if not allow_overlength:
        raise RankkitError(f"{message}; shorten it, or pass --allow-overlength to run it anyway")
    warnings.warn(f"{message}; running it anyway (--allow-overlength)", stacklevel=2)


def warn_clamped(budget, prompt_length: int, what: str) -> None:
    """A token budget larger than the prompt keeps the whole prompt: say so instead of clamping silently."""
    if budget.tokens is not None and budget.tokens > prompt_length:
        warnings.warn(
            f"--budget {budget.tokens} is larger than {what} ({prompt_length} tokens); it keeps all of it",
            stacklevel=2,
        )
