"""The KV-cache argument and output of a transformers causal LM, under either name.

transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40); the
versions before it that pyproject allows know only `past_key_values`. Which one a model takes is read
from its `forward` signature once per model class, so remote-code models on the old name work too.
"""

from __future__ import annotations

import inspect
from typing import Any

_NAMES: dict[type, str] = {}


def cache_kwarg(model: Any) -> str:
    """`"cache"` where the model's forward takes it, else `"past_key_values"`."""
    kind = type(model)
    name = _NAMES.get(kind)
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = _NAMES[kind] = "cache" if "cache" in params else "past_key_values"
    return name


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword arguments that pass `cache` to `model` (with `use_cache=True`)."""
    return {cache_kwarg(model): cache, "use_cache": True}


def returned_cache(out: Any) -> Any:
    """The KV cache a forward pass returned (None if it returned none), read by its current name:
    `out.past_key_values` is a warning property on versions that renamed it."""
    fields = getattr(type(out), "__dataclass_fields__", {})
    return getattr(out, "cache", None) if "cache" in fields else getattr(out, "past_key_values", None)
