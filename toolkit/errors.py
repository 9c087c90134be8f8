"""The one error type users see from the toolkit: what went wrong, then a HINT line."""

from __future__ import annotations


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
