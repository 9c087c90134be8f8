"""The one error type users see from the toolkit: what went wrong, then a HINT line."""

from __future__ import annotations

import dataclasses


class ToolkitError(RuntimeError):
    """A problem the user can fix. ``str(err)`` ends with a ``HINT:`` line saying how.

    Args:
        message: what went wrong, naming the offending value.
        hint: what to do about it.
    """

    def __init__(self, message: str, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\nHINT: {hint}")


def at_least_one(name: str, value: int, hint: str) -> None:
    """A ToolkitError naming ``name=value`` unless it is at least 1."""
    if value < 1:
        raise ToolkitError(f"{name}={value} must be >= 1", hint)


def describe(obj: object, limit: int = 6) -> str:
    """An object as an error message names it: its class and its settings, never its repr
    (a torch optimizer's repr is 14 lines of parameter groups).

    The settings are a torch optimizer's ``defaults``, a Keras object's ``get_config()``, or
    a dataclass's fields, whichever the object has; scalars only, at most ``limit`` of them.

    Example:
        >>> class AdamW:
        ...     defaults = {"lr": 0.001, "betas": (0.9, 0.999), "weight_decay": 0.01}
        >>> describe(AdamW())
        'AdamW(lr=0.001, weight_decay=0.01)'
        >>> describe((1, 2)), describe("lamb")
        ('tuple of 2 (int, int)', "'lamb'")
    """
    if obj is None or isinstance(obj, str | bool | int | float):  # a value: as written
        return repr(obj)
    name = type(obj).__name__
    if isinstance(obj, tuple | list):
        return f"{name} of {len(obj)} ({', '.join(type(item).__name__ for item in obj)})"
    settings = _settings(obj)
    scalars = [(k, v) for k, v in settings.items()
               if isinstance(v, bool | int | float | str) and k != "name"]
    if not scalars:
        return name
    shown = ", ".join(f"{k}={v!r}" for k, v in scalars[:limit])
    return f"{name}({shown}{', ...' if len(scalars) > limit else ''})"


def _settings(obj: object) -> dict:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    defaults = getattr(obj, "defaults", None)  # torch.optim.Optimizer
    if isinstance(defaults, dict):
        return defaults
    get_config = getattr(obj, "get_config", None)  # Keras objects
    if callable(get_config):
        try:
            config = get_config()
        except Exception:  # a half-built object: its class alone names it
            return {}
        return config if isinstance(config, dict) else {}
    return {}
