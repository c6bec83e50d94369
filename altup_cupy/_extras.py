"""Optional dependencies: a missing one names the extra that installs it and the pip command."""

from __future__ import annotations

import importlib
import re
from importlib import metadata
from types import ModuleType

DISTRIBUTION = "altup_cupy"
_SELF = re.compile(rf"{DISTRIBUTION}\[([\w,]+)\]")


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message says which extra installs it."""


def extra_requirements(extra: str) -> list[str]:
    """What the installed package declares for `extra` (its Requires-Dist lines), with the extras
    it names of the package itself ("altup_cupy[nvrtc]") expanded."""
    marker = f'extra == "{extra}"'
    found = []
    for line in metadata.requires(DISTRIBUTION) or ():
        requirement, _, condition = (part.strip() for part in line.partition(";"))
        if condition != marker:
            continue
        own = _SELF.fullmatch(requirement)
        found += ([r for name in own.group(1).split(",") for r in extra_requirements(name)] if own
                  else [requirement])
    return found


def install_command(extra: str) -> str:
    """The command that installs `extra`'s requirements into this environment (the package itself
    is installed from a checkout, not from an index); from a checkout that was never installed,
    the editable install of the extra."""
    try:
        requirements = extra_requirements(extra)
    except metadata.PackageNotFoundError:
        return f"pip install -e '.[{extra}]' in the checkout"
    return "pip install " + " ".join(f"'{r}'" for r in requirements)


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
