"""Optional dependencies: a missing one names the extra that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message says which extra installs it."""


def require(module: str, extra: str) -> ModuleType:
    """Import `module`, or raise MissingExtraError naming `pip install 'altup_cupy[extra]'`."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise MissingExtraError(
            f"{error.name} is not installed; it comes with the '{extra}' extra: "
            f"pip install 'altup_cupy[{extra}]'", name=error.name) from error
