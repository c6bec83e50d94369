"""Every CUDA source of the package compiles with NVRTC from pip, without a GPU, for every
architecture it supports (sm_80, sm_86, sm_89, sm_90), with no spills and no stack frame.

One test per (source, architecture); the compiles run in a pool of two processes started by the
first of them, so the tests mostly collect results. Each source is compiled exactly as the GPU
path compiles it (same text, options, defines and name expressions). The register table is
printed at the end of the run (tests/conftest.py).
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest

import altup_cupy
from altup_cupy._build import KERNELS_DIR, KernelSource, compile_offline
from altup_cupy._sources import ALL_SOURCES, PREDICT_CORRECT_BACKWARD_V4
from altup_cupy.lab import occupancy
from altup_cupy.lab.compile_report import compile_all, demangle, offline_targets

TARGETS = offline_targets(ALL_SOURCES)
MAX_CU_LINES = 600
# Instructions that exist from sm_90 on only: they must stay in sources whose min_arch is 90.
HOPPER_ONLY = re.compile(r"\b(mbarrier|cp\.async\.bulk|fence\.mbarrier_init|wgmma|setmaxnreg)\b")


@pytest.fixture(scope="session")
def builds():
    """{(filename, arch): future of its OfflineBuild}, all submitted at once to two processes."""
    pool, futures = compile_all(TARGETS, workers=2)
    yield {(source.filename, arch): future for (source, arch), future in zip(TARGETS, futures)}
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("filename, arch", [(s.filename, arch) for s, arch in TARGETS],
                         ids=[f"{arch}-{s.filename}" for s, arch in TARGETS])
def test_compiles_without_spills(filename, arch, builds, kernel_resources):
    source = next(s for s in ALL_SOURCES if s.filename == filename)
    build = builds[(filename, arch)].result()
    assert build.cubin_bytes > 0, f"{filename} ({arch}): empty cubin"
    kernels = list(build.kernels)
    names = demangle([k.name for k in kernels])
    for name, kernel in zip(names, kernels):
        kernel_resources.append((arch, filename, name, kernel))

    # Every requested instantiation became a kernel (a name expression that names nothing fails
    # in NVRTC already; this also catches a lost entry in ptxas' report).
    compiled = {k.name for k in kernels}
    missing = [e for e, lowered in build.lowered_names.items() if lowered not in compiled]
    assert not missing, f"{filename} ({arch}): requested kernels with no compiled entry: {missing}"
    bad = [(name, k.stack_frame_bytes, k.spill_store_bytes, k.spill_load_bytes)
           for name, k in zip(names, kernels)
           if k.stack_frame_bytes or k.spill_store_bytes or k.spill_load_bytes]
    assert not bad, f"{filename} ({arch}): kernels with a stack frame or spills (name, stack, st, ld): {bad}"
    assert all(0 < k.registers <= 255 for k in kernels)


@pytest.mark.parametrize("filename, arch", [(s.filename, arch) for s, arch in TARGETS],
                         ids=[f"{arch}-{s.filename}" for s, arch in TARGETS])
def test_recorded_occupancy_is_this_compile(filename, arch, builds):
    """results/offline/occupancy.csv, which the notebooks read registers and blocks per SM from,
    holds what this compile gives: a kernel change without regenerating it fails here."""
    fresh = occupancy.occupancy_rows(builds[(filename, arch)].result())
    recorded = [row for row in occupancy.read_occupancy() if (row["arch"], row["source"]) == (arch, filename)]
    regenerate = "regenerate it: python -m altup_cupy.lab.occupancy"
    assert len(recorded) == len(fresh), (
        f"{filename} ({arch}): {len(recorded)} recorded kernels, {len(fresh)} compiled; {regenerate}")
    for old, new in zip(recorded, fresh):
        # Names compare where c++filt made them readable (the recorded ones are).
        fields = [key for key in occupancy.CSV_COLUMNS if key != "kernel" or not new["kernel"].startswith("_Z")]
        assert [old[key] for key in fields] == [new[key] for key in fields], (
            f"{filename} ({arch}) {new['kernel']}: recorded {old}, compiled {new}; {regenerate}")


def test_every_architecture_from_sm80_is_covered():
    for source in ALL_SOURCES:
        archs = {arch for s, arch in TARGETS if s is source}
        expected = {"sm_90a"} if source.needs_sm90a else (
            {"sm_90"} if source.min_arch == 90 else {"sm_80", "sm_86", "sm_89", "sm_90"})
        assert archs == expected, f"{source.filename}: compiled for {sorted(archs)}, expected {sorted(expected)}"


def test_every_kernel_file_belongs_to_a_source():
    cu_files = sorted(p.name for p in KERNELS_DIR.glob("*.cu"))
    assert cu_files, f"no .cu files found in {KERNELS_DIR}"
    owned = sorted(s.filename for s in ALL_SOURCES)
    assert cu_files == owned, f".cu files {cu_files} but sources {owned}"
    included = set()
    for source in ALL_SOURCES:
        included |= set(re.findall(r"// ---- (\S+\.cuh) ----", source.code()))
    headers = {p.name for p in KERNELS_DIR.glob("*.cuh")}
    assert headers <= included, f"headers no source includes (dead code): {sorted(headers - included)}"


def test_no_kernel_file_over_600_lines():
    long = {p.name: n for p in KERNELS_DIR.glob("*.cu*") if (n := len(p.read_text().splitlines())) > MAX_CU_LINES}
    assert not long, f"kernel files over {MAX_CU_LINES} lines: {long}"


def test_every_kernel_source_in_the_package_is_listed():
    """A KernelSource defined anywhere in the package but missing from _sources.ALL_SOURCES would
    be compiled by nothing here."""
    for info in pkgutil.walk_packages(altup_cupy.__path__, prefix="altup_cupy."):
        if info.name == "altup_cupy.__main__":
            continue
        for attr, value in vars(importlib.import_module(info.name)).items():
            if isinstance(value, KernelSource):
                assert any(value is s for s in ALL_SOURCES), f"{info.name}.{attr} is not in ALL_SOURCES"


def test_hopper_instructions_only_in_sm90_sources():
    for source in ALL_SOURCES:
        found = sorted(set(HOPPER_ONLY.findall(source.code())))
        if source.min_arch < 90:
            assert not found, f"{source.filename} (min_arch {source.min_arch}) uses Hopper-only {found}"
    assert HOPPER_ONLY.search(PREDICT_CORRECT_BACKWARD_V4.code()), "the pattern finds nothing in v4"


def test_an_unsupported_architecture_is_refused_before_compiling():
    with pytest.raises(ValueError, match="needs sm_90 or newer, got arch='sm_86'"):
        compile_offline(PREDICT_CORRECT_BACKWARD_V4, "sm_86")
    with pytest.raises(ValueError, match="arch must look like"):
        compile_offline(PREDICT_CORRECT_BACKWARD_V4, "90")
