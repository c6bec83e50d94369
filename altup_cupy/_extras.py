"""Optional dependencies: a missing one names the extra that installs it and the pip command."""

from __future__ import annotations

import importlib
from importlib import metadata
from types import ModuleType

from . import _paths

DISTRIBUTION = "altup_cupy"


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message says which extra installs it."""


def extra_requirements(extra: str) -> list[str]:
    """The requirements the installed package declares for `extra` (its Requires-Dist lines)."""
    marker = f'extra == "{extra}"'
    declared = [line.split(";", 1) for line in metadata.requires(DISTRIBUTION) or ()]
    return [parts[0].strip() for parts in declared if len(parts) == 2 and parts[1].strip() == marker]


def install_command(extra: str) -> str:
    """The command that installs `extra`: from the checkout the package runs from, as the README
    installs it; for an installed copy, the extra's own requirements (the package is installed
    from a checkout, not from an index)."""
    if _paths.REPO_ROOT is not None:
        return f"pip install -e '{_paths.REPO_ROOT}[{extra}]'"
    return "pip install " + " ".join(f"'{r}'" for r in extra_requirements(extra))


def missing(what: str, extra: str, name: str | None = None) -> MissingExtraError:
    """The error for `what` (a distribution or library) not being installed; name: the module
    that failed to import, if one did."""
    return MissingExtraError(f"{what} is not installed; it comes with the '{extra}' extra: {install_command(extra)}",
                             name=name)


def require(module: str, extra: str, distribution: str | None = None) -> ModuleType:
    """Import `module`, or raise MissingExtraError naming the extra and its install command.
    distribution: the name pip knows, where it is not the module's (cuda-bindings for cuda.bindings)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise missing(distribution or error.name, extra, error.name) from error
