"""Every CUDA source of the package compiles for sm_90 with NVRTC from pip, without a GPU.

Discovery is generic: every module of `altup_cupy` is imported and its module-level
`KernelSource` objects collected; every `.cu` file shipped in the package must belong to one of
them. Each source is compiled exactly as the GPU path compiles it (same text, options and name
expressions) and ptxas' report must show, for every requested instantiation, a kernel with no
spill stores/loads and no stack frame. The register table is printed at the end of the run.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import altup_cupy
from altup_cupy._build import ARCH, KernelSource, compile_offline

PACKAGE_DIR = Path(altup_cupy.__file__).resolve().parent
# The modules the issues name; they must exist and define at least one KernelSource each.
REQUIRED_MODULES = ("altup_cupy.collapse", "altup_cupy.predict_correct")
# Never imported for discovery: running it is the CLI.
SKIPPED_MODULES = {"altup_cupy.__main__"}


def _all_module_names() -> list[str]:
    names = [altup_cupy.__name__]
    for info in pkgutil.walk_packages(altup_cupy.__path__, prefix="altup_cupy."):
        if info.name not in SKIPPED_MODULES:
            names.append(info.name)
    return sorted(set(names) | set(REQUIRED_MODULES))


def _kernel_sources() -> dict[str, list[tuple[str, KernelSource]]]:
    """{module name: [(attribute, KernelSource), ...]} for every module of the package."""
    found: dict[str, list[tuple[str, KernelSource]]] = {}
    for name in _all_module_names():
        module = importlib.import_module(name)
        found[name] = [
            (attr, value) for attr, value in vars(module).items() if isinstance(value, KernelSource)
        ]
    return found


def _unique_sources() -> list[KernelSource]:
    seen: dict[int, KernelSource] = {}
    for entries in _kernel_sources().values():
        for _, source in entries:
            seen.setdefault(id(source), source)
    return sorted(seen.values(), key=lambda s: (s.filename, s.name_expressions))


CU_FILES = sorted(p.name for p in PACKAGE_DIR.glob("*.cu"))


def test_required_modules_define_kernel_sources():
    found = _kernel_sources()
    for name in REQUIRED_MODULES:
        assert found[name], f"{name} defines no module-level KernelSource"


def test_every_cu_file_belongs_to_a_kernel_source():
    assert CU_FILES, f"no .cu files found in {PACKAGE_DIR}"
    owned = {s.filename for s in _unique_sources()}
    orphans = sorted(set(CU_FILES) - owned)
    assert not orphans, f".cu files no KernelSource compiles (dead or untested code): {orphans}"


def test_every_kernel_source_file_exists():
    for source in _unique_sources():
        assert (PACKAGE_DIR / source.filename).is_file(), f"{source.filename} is missing from {PACKAGE_DIR}"
        assert source.name_expressions, f"{source.filename}: KernelSource requests no kernels"


def _demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt")
    if tool is None:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def _signature_key(text: str) -> str:
    """'void collapse_epilogue_v1<3, 2>(uint4 const*, ...)' -> 'collapse_epilogue_v1<3,2>'."""
    head = text.split("(", 1)[0]
    head = re.sub(r"^\s*void\s+", "", head)
    return re.sub(r"\s+", "", head)


@pytest.mark.parametrize("cu_file", CU_FILES)
def test_compiles_for_sm90_without_spills(cu_file, kernel_resources):
    sources = [s for s in _unique_sources() if s.filename == cu_file]
    assert sources, f"{cu_file}: no KernelSource in the package compiles it"
    for source in sources:
        build = compile_offline(source, ARCH)
        assert build.cubin_bytes > 0, f"{cu_file}: empty cubin"
        kernels = list(build.kernels)
        demangled = _demangle([k.name for k in kernels])
        keys = {_signature_key(d): k for d, k in zip(demangled, kernels)}

        print(f"\n{cu_file} for {ARCH}: cubin {build.cubin_bytes} bytes, {len(kernels)} kernels")
        for d, k in zip(demangled, kernels):
            print(f"  {k.registers:4d} regs  stack {k.stack_frame_bytes}  spill st {k.spill_store_bytes}"
                  f" ld {k.spill_load_bytes}  {_signature_key(d)}")
            kernel_resources.append((cu_file, k.__class__(
                _signature_key(d), k.registers, k.stack_frame_bytes, k.spill_store_bytes,
                k.spill_load_bytes)))

        # Every requested instantiation became a kernel (a name expression that names nothing
        # fails in NVRTC already; this also catches a lost entry in ptxas' report).
        assert len(kernels) >= len(source.name_expressions), (
            f"{cu_file}: {len(source.name_expressions)} name expressions but ptxas compiled "
            f"{len(kernels)} entry functions"
        )
        if shutil.which("c++filt"):
            missing = [e for e in source.name_expressions if re.sub(r"\s+", "", e) not in keys]
            assert not missing, f"{cu_file}: requested kernels with no compiled entry: {missing}"

        bad = [
            (k.name, k.stack_frame_bytes, k.spill_store_bytes, k.spill_load_bytes)
            for k in kernels
            if k.stack_frame_bytes or k.spill_store_bytes or k.spill_load_bytes
        ]
        assert not bad, f"{cu_file}: kernels with a stack frame or spills (name, stack, st, ld): {bad}"
        assert all(0 < k.registers <= 255 for k in kernels)
