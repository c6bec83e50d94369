"""Occupancy computed from the offline compile, not typed: per kernel and architecture, the
registers, spills and static shared memory ptxas reports, the block size the kernel's
`__launch_bounds__` fixes (read from the cubin), and the blocks per SM those allow.

    from altup_cupy.lab import occupancy
    occupancy.write_csv(occupancy.RECORDED_OCCUPANCY)   # results/offline/occupancy.csv, ~3 min
    rows = occupancy.read_occupancy()                   # what the notebooks read

or `python -m altup_cupy.lab.occupancy`.

Blocks per SM count static shared memory only: the dynamic shared memory a host asks for depends
on the shape it launches (`altup_cupy._occupancy.blocks_per_sm` takes the sum where a caller knows
it). The per-architecture limits are `altup_cupy._occupancy.SM_LIMITS`.
"""

from __future__ import annotations

import argparse
import csv
import struct
from pathlib import Path

from .._build import OfflineBuild
from .._occupancy import SM_LIMITS, WARP, blocks_per_sm
from .._sources import ALL_SOURCES
from .compile_report import CHECK_ARCHS, compile_all, demangle, offline_targets
from .paths import RECORDED_RESULTS_DIR

_SVAL_FORMAT, _MAX_THREADS_ATTRIBUTE = 0x04, 0x05  # EIFMT_SVAL, EIATTR_MAX_THREADS of .nv.info


def launch_bound_threads(cubin: bytes) -> dict[str, int]:
    """{mangled kernel name: the maximum threads per block of its `__launch_bounds__`}, from the
    EIATTR_MAX_THREADS attribute of each kernel's `.nv.info.<name>` section of the ELF cubin."""
    section_offset, = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", cubin, section_offset + i * entry_size) for i in range(count)]
    names = sections[names_index][4]

    def name(section) -> str:
        start = names + section[0]
        return cubin[start:cubin.index(b"\0", start)].decode()

    found = {}
    for section in sections:
        if not name(section).startswith(".nv.info."):
            continue
        data, pos = cubin[section[4]:section[4] + section[5]], 0
        while pos + 4 <= len(data):
            kind, attribute, size = struct.unpack_from("<BBH", data, pos)
            if kind == _SVAL_FORMAT and attribute == _MAX_THREADS_ATTRIBUTE:
                x, y, z = struct.unpack_from("<III", data, pos + 4)
                found[name(section)[len(".nv.info."):]] = x * y * z
            # formats 1-3 hold their value in the 2-byte size field; the others a payload of that size
            pos += 4 if kind in (0x01, 0x02, 0x03) else 4 + size
    return found


NO_LAUNCH_BOUNDS = "no __launch_bounds__"
CSV_COLUMNS = ("arch", "source", "kernel", "registers", "spill_bytes", "static_shared_bytes", "threads",
               "warps", "blocks_per_sm", "limited_by")


def occupancy_rows(build: OfflineBuild) -> list[dict]:
    """One row per kernel of `build`, for its architecture (sm_90a counts as sm_90). A kernel
    without `__launch_bounds__` has no block size in the cubin (the host picks it per launch):
    its threads, warps and blocks per SM are left empty and `limited_by` says why."""
    limits = SM_LIMITS[build.arch.removesuffix("a")]
    threads = launch_bound_threads(build.cubin)
    rows = []
    for kernel, readable in zip(build.kernels, demangle([k.name for k in build.kernels])):
        row = {"arch": build.arch, "source": build.filename, "kernel": readable, "registers": kernel.registers,
               "spill_bytes": kernel.spill_store_bytes + kernel.spill_load_bytes,
               "static_shared_bytes": kernel.shared_bytes, "threads": "", "warps": "", "blocks_per_sm": "",
               "limited_by": NO_LAUNCH_BOUNDS}
        if kernel.name in threads:
            block = threads[kernel.name]
            blocks, limiter = blocks_per_sm(limits, kernel.registers, block, kernel.shared_bytes)
            row.update(threads=block, warps=-(-block // WARP), blocks_per_sm=blocks, limited_by=limiter)
        rows.append(row)
    return rows


def write_csv(path: Path | str, sources=ALL_SOURCES, archs=CHECK_ARCHS, workers: int = 2) -> Path:
    """Compile every source for every architecture it supports and write the occupancy table."""
    path = Path(path)
    pool, futures = compile_all(offline_targets(sources, archs), workers)
    with pool:
        rows = [row for future in futures for row in occupancy_rows(future.result())]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return path


# Offline facts, the same on every machine: not under a GPU's results folder.
RECORDED_OCCUPANCY = RECORDED_RESULTS_DIR.parent / "offline" / "occupancy.csv"


def read_occupancy(path: Path | str = RECORDED_OCCUPANCY) -> list[dict]:
    """The rows of an occupancy CSV, numbers as ints."""
    with Path(path).open(newline="") as f:
        return [{key: int(value) if value.isdigit() else value for key, value in row.items()}
                for row in csv.DictReader(f)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m altup_cupy.lab.occupancy",
                                     description="Compile every kernel offline (about 3 minutes) and write the "
                                                 "occupancy table.")
    parser.add_argument("--out", type=Path, default=RECORDED_OCCUPANCY,
                        help=f"the CSV (default: {RECORDED_OCCUPANCY}, the recorded table the notebooks read)")
    args = parser.parse_args(argv)
    if args.out.is_dir():
        parser.error(f"--out {args.out} is a folder: give the CSV file")
    print(f"wrote {write_csv(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
