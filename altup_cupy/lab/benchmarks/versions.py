"""The benchmark's implementations of one op read off its version registry: the default
(`altup_cupy`, what a caller gets with version=None) and every other version that runs on this GPU
and shape (`altup_cupy_v<n>`), so a new registry entry is benchmarked with no edit here."""

from __future__ import annotations

from typing import Callable, Mapping

from ..bench import Impl


def impls(versions: Mapping, preference, prepare: Callable, w) -> tuple[Impl, ...]:
    import torch

    from ..._device import facts

    capability, _ = facts(torch.cuda.current_device())
    runnable = [v.number for v in versions.values() if v.runs_on(capability, w.streams, w.hidden)]
    default = next(n for n in preference if n in runnable)
    return (Impl("altup_cupy", prepare(None)),
            *(Impl(f"altup_cupy_v{n}", prepare(n)) for n in sorted(runnable, reverse=True) if n != default))
