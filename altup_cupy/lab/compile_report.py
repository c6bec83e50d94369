"""The offline compile report: every kernel source built for every architecture it supports,
without a GPU, and ptxas' registers, spills and stack per kernel (`python -m altup_cupy check`
without a GPU, and tests/test_compile.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

from .._build import KernelSource, OfflineBuild, arch_number, compile_offline
from .._sources import ALL_SOURCES

# Ampere (A100; RTX 30), Ampere GA10x (A10, A40), Ada (L4, L40S; RTX 40), Hopper (H100, H200).
CHECK_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")


def offline_targets(sources, archs=CHECK_ARCHS) -> list[tuple[KernelSource, str]]:
    """(source, arch) for every source and every architecture of `archs` it supports; a source
    that needs sm_90a is compiled for sm_90a in place of sm_90."""
    targets = []
    for arch in archs:
        for source in sources:
            if source.supports(arch_number(arch)):
                targets.append((source, "sm_90a" if source.needs_sm90a else arch))
    return targets


def demangle(names: list[str]) -> list[str]:
    """C++ names as written ('collapse_epilogue_v1<3,2>'), through c++filt when it is installed."""
    tool = shutil.which("c++filt")
    if tool is None:
        return list(names)
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True)
    return [re.sub(r"\s+", "", re.sub(r"^\s*void\s+", "", line.split("(", 1)[0]))
            for line in out.stdout.splitlines()]


def _compile_by_name(filename: str, arch: str) -> OfflineBuild:
    """compile_offline for a worker process (KernelSource holds a lock: it does not pickle)."""
    return compile_offline(next(s for s in ALL_SOURCES if s.filename == filename), arch)


def compile_all(targets: list[tuple[KernelSource, str]], workers: int = 2):
    """The futures of compile_offline for every (source, arch), in a pool of `workers` processes
    (one NVRTC compile per core). The caller shuts the returned pool down."""
    pool = ProcessPoolExecutor(max_workers=workers)
    return pool, [pool.submit(_compile_by_name, source.filename, arch) for source, arch in targets]


def _progress(futures: list) -> list:
    """`futures`, behind a progress bar on stderr where tqdm is installed (the `bench` extra): a
    full compile takes minutes, and the table prints only at the end."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return futures
    return tqdm(futures, desc="compiled", unit="pair", file=sys.stderr)


def op_sources(op: str) -> list[KernelSource]:
    """The kernel sources the versions of benchmark op `op` launch (its registry's), each once."""
    import importlib

    versions = importlib.import_module(f"altup_cupy.ops.{op}_versions").VERSIONS
    return list({source.filename: source for version in versions.values() for source in version.sources}.values())


def check_all(archs=CHECK_ARCHS, workers: int = 2, sources=ALL_SOURCES) -> int:
    """Compile every one of `sources` (default: all the package's) for every architecture it
    supports, print one table (architecture, source, kernel, registers, spills, stack) and return
    0 if everything compiled with no spills and no stack frame, else 1."""
    targets = offline_targets(sources, archs)
    print(f"Compiling {len(targets)} (source, architecture) pairs with NVRTC, {workers} at a time ...",
          flush=True)
    pool, futures = compile_all(targets, workers)
    rows, failures = [], []
    with pool:
        for (source, arch), future in zip(targets, _progress(futures)):
            try:
                build = future.result()
            except Exception as error:  # a compile error: reported in the table's place
                failures.append(f"{arch} {source.filename}: {error}")
                continue
            for kernel, name in zip(build.kernels, demangle([k.name for k in build.kernels])):
                spills = kernel.spill_store_bytes + kernel.spill_load_bytes
                rows.append((arch, source.filename, name, str(kernel.registers), str(spills),
                             str(kernel.stack_frame_bytes)))
    header = ("architecture", "source", "kernel", "registers", "spills B", "stack B")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for i, row in enumerate((header, *rows)):
        print("  ".join(c.ljust(w) if j < 3 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    bad = [r for r in rows if r[4] != "0" or r[5] != "0"]
    for failure in failures:
        print(f"FAILED to compile: {failure}")
    print(f"{len(rows)} kernels, {len(bad)} with spills or a stack frame, {len(failures)} compile failures")
    return 1 if bad or failures else 0
