"""How many blocks of a kernel fit on one SM at once, from the kernel's registers, block size and
shared memory, for the architectures the package compiles for. The persistent backward versions
size their grids with it; `altup_cupy.lab.occupancy` tabulates it for every kernel offline.

Per-SM limits (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"):
65536 32-bit registers on all four, allocated per warp in units of 256; resident threads 2048 on
sm_80 / sm_90, 1536 on sm_86 / sm_89; resident blocks 32 / 16 / 24 / 32; shared memory per SM
164 / 100 / 100 / 228 KiB, of which the driver reserves 1 KiB per resident block.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._launch import ceil_div

KIB = 1024
WARP = 32
REGISTER_UNIT = 256  # registers are allocated per warp in multiples of this
RESERVED_SHARED_PER_BLOCK = 1 * KIB


@dataclass(frozen=True)
class SmLimits:
    registers: int
    threads: int
    blocks: int
    shared_bytes: int


SM_LIMITS = {
    "sm_80": SmLimits(65536, 2048, 32, 164 * KIB),
    "sm_86": SmLimits(65536, 1536, 16, 100 * KIB),
    "sm_89": SmLimits(65536, 1536, 24, 100 * KIB),
    "sm_90": SmLimits(65536, 2048, 32, 228 * KIB),
}


def registers_per_warp(registers: int) -> int:
    """The registers one warp of a kernel holds: `registers` a thread, allocated in REGISTER_UNITs."""
    return ceil_div(max(registers, 1) * WARP, REGISTER_UNIT) * REGISTER_UNIT


def blocks_per_sm(limits: SmLimits, registers: int, threads: int, shared_bytes: int) -> tuple[int, str]:
    """(resident blocks per SM, the resource that limits them: 'registers', 'threads', 'shared
    memory' or 'blocks'). `shared_bytes`: static and dynamic shared memory of one block."""
    warps = ceil_div(threads, WARP)
    by = {
        "registers": limits.registers // registers_per_warp(registers) // warps,
        "threads": limits.threads // (warps * WARP),
        "shared memory": limits.shared_bytes // (shared_bytes + RESERVED_SHARED_PER_BLOCK),
        "blocks": limits.blocks,
    }
    limiter = min(by, key=by.get)
    return by[limiter], limiter
