"""The values a spec's string options take, and the check that names a wrong one.

A leaf module: ``specs.py`` and ``gpt.py`` both check their options here, so neither imports
the other for it.
"""

from __future__ import annotations

from toolkit.errors import ToolkitError

ACTIVATIONS = ("relu", "tanh")
LOSSES = ("cross_entropy", "mse")
DTYPES = ("float32", "float64")


def check_choice(kind: str, value: object, valid: tuple[str, ...]) -> object:
    """``value``; a ToolkitError naming it when it is not one of ``valid``.

    Example:
        >>> check_choice("dtype", "float64", DTYPES)
        'float64'
    """
    if value not in valid:
        raise ToolkitError(f"unknown {kind} {value!r}", f"use one of: {', '.join(valid)}")
    return value
