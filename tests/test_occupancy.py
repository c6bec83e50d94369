"""Blocks per SM from registers, block size and shared memory (hand-checked cases), read from a
real offline compile, and the recorded occupancy table consistent with both. No GPU needed."""

from __future__ import annotations

import pytest

from altup_cupy import _sources
from altup_cupy._build import compile_offline
from altup_cupy._occupancy import SM_LIMITS, blocks_per_sm
from altup_cupy.lab import occupancy
from altup_cupy.lab.compile_report import offline_targets


@pytest.mark.parametrize("arch, registers, threads, shared, expected", [
    # 128 registers x 32 lanes = 4096 a warp: 16 warps fit, two blocks of 8 warps
    ("sm_90", 128, 256, 0, (2, "registers")),
    # 33 registers round up to 1280 a warp: 51 warps, six blocks of 8 warps
    ("sm_90", 33, 256, 0, (6, "registers")),
    # 32 registers would allow 8 blocks of 256 threads; GA10x holds 1536 threads
    ("sm_86", 32, 256, 0, (6, "threads")),
    # one-warp blocks: Ampere's cap of 32 resident blocks binds
    ("sm_80", 16, 32, 0, (32, "blocks")),
    ("sm_86", 16, 32, 0, (16, "blocks")),
    ("sm_89", 16, 32, 0, (24, "blocks")),
    # 48 KiB + the 1 KiB reserved per block: two fit in Ada's 100 KiB, four in Hopper's 228
    ("sm_89", 32, 128, 48 * 1024, (2, "shared memory")),
    ("sm_90", 32, 128, 48 * 1024, (4, "shared memory")),
])
def test_blocks_per_sm_hand_checked(arch, registers, threads, shared, expected):
    assert blocks_per_sm(SM_LIMITS[arch], registers, threads, shared) == expected


@pytest.fixture(scope="module")
def reduce_build():
    return compile_offline(_sources.PREDICT_CORRECT_BACKWARD_REDUCE, "sm_80")


def test_block_size_and_shared_memory_come_from_the_compile(reduce_build):
    threads = occupancy.launch_bound_threads(reduce_build.cubin)
    assert set(threads) == {k.name for k in reduce_build.kernels}
    assert set(threads.values()) == {_sources.REDUCE_THREADS}  # its __launch_bounds__
    rows = occupancy.occupancy_rows(reduce_build)
    assert len(rows) == len(reduce_build.kernels)
    for row, kernel in zip(rows, reduce_build.kernels):
        assert row["static_shared_bytes"] == kernel.shared_bytes > 0
        assert row["warps"] == _sources.REDUCE_THREADS // 32
        assert (row["blocks_per_sm"], row["limited_by"]) == blocks_per_sm(
            SM_LIMITS["sm_80"], row["registers"], row["threads"], row["static_shared_bytes"])


def test_the_recorded_table_covers_every_kernel_and_is_its_own_arithmetic():
    if not occupancy.RECORDED_OCCUPANCY.is_file():
        pytest.skip(f"{occupancy.RECORDED_OCCUPANCY} not written: python -m altup_cupy.lab.occupancy")
    rows = occupancy.read_occupancy()
    assert {(r["arch"], r["source"]) for r in rows} == {
        (arch, source.filename) for source, arch in offline_targets(_sources.ALL_SOURCES)}
    for row in (r for r in rows if r["limited_by"] != occupancy.NO_LAUNCH_BOUNDS):
        limits = SM_LIMITS[row["arch"].removesuffix("a")]
        assert (row["blocks_per_sm"], row["limited_by"]) == blocks_per_sm(
            limits, row["registers"], row["threads"], row["static_shared_bytes"]), row
