"""The Gemma 3n step kernels build for sm_80 and sm_90 with NVRTC from pip (no GPU): every
instantiation present, no spills, no stack frame."""

from __future__ import annotations

import pytest

from altup_cupy import gemma3n_kernels
from altup_cupy._build import compile_offline


@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
@pytest.mark.parametrize("source", gemma3n_kernels.SOURCES, ids=lambda s: s.filename)
def test_builds_without_spills(source, arch):
    build = compile_offline(source, arch)
    assert len(build.kernels) == len(source.name_expressions), build.log
    for kernel in build.kernels:
        assert (kernel.stack_frame_bytes, kernel.spill_store_bytes, kernel.spill_load_bytes) == (0, 0, 0), kernel
        assert kernel.registers <= 65536 // gemma3n_kernels.ROW_THREADS_MAX, kernel
