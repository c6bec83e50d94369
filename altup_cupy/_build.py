"""Compiling the package's CUDA sources (altup_cupy/kernels/), on a GPU and without one.

A `KernelSource` is one `.cu` file, the template instantiations the host launches from it, the
oldest architecture it runs on and the -D defines it is compiled with (altup_cupy/_sources.py
lists them all). Its text is the file with every `#include "x.cuh"` replaced by that header's
text (recursively, each header once), so NVRTC needs no include path and no CUDA toolkit.

- On a GPU, `KernelSource.kernel(name)` compiles the source once per device with NVRTC through
  `cupy.RawModule` for the device's own architecture (cached by CuPy in memory and on disk), and
  refuses a device older than the source's `min_arch`.
- Without a GPU, `compile_offline(source, arch)` compiles the same text with the same options for
  any architecture through `cuda.bindings.nvrtc` (the `nvrtc` extra: cuda-bindings and
  nvidia-cuda-nvrtc) and reads ptxas' report (`altup_cupy.lab.compile_report` does it for every
  source and architecture: `python -m altup_cupy check` without a GPU). The sm_90a sources are
  built this way on a GPU too.
"""

from __future__ import annotations

import re
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ._extras import missing, require

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
# Every NVRTC compile of the package, on a GPU (cupy.RawModule) and offline (compile_offline, the
# sm_90a cubins, `check`), gets these options and the architecture, nothing else. CuPy adds the
# last two to every RawModule compile itself; they are stated here so that the offline build is
# the one a GPU runs: unannotated functions (lambdas) are device code, and fp32 denormals are
# flushed to zero. No --use_fast_math: tanh, rsqrt and division keep their IEEE-accurate fp32
# versions.
NVRTC_OPTIONS = ("-std=c++17", "--device-as-default-execution-space", "-ftz=true")
# Every define reaches the kernels under this prefix, so a source's own names cannot collide.
DEFINE_PREFIX = "ALTUP_"
_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.MULTILINE)


def arch_number(arch: str) -> int:
    """'sm_86' -> 86, 'sm_90a' -> 90."""
    match = re.fullmatch(r"sm_(\d+)a?", arch)
    if match is None:
        raise ValueError(f"arch must look like 'sm_90' or 'sm_90a', got {arch!r}")
    return int(match.group(1))


@dataclass
class KernelSource:
    """One `.cu` file of altup_cupy/kernels/ and how to build it.

    name_expressions: the template instantiations the host launches; min_arch: the oldest
    compute capability it runs on (80 or 90, as an int: 90 = 9.0); defines: NAME -> int, given to
    the compiler as -DALTUP_NAME=value; needs_sm90a: compile for sm_90a (wgmma and other
    architecture-specific Hopper features) instead of plain sm_90.
    """

    filename: str
    name_expressions: tuple[str, ...]
    min_arch: int = 80
    defines: Mapping[str, int] = field(default_factory=dict)
    needs_sm90a: bool = False
    _modules: dict = field(default_factory=dict, repr=False)
    _functions: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        if self.min_arch not in (80, 90):
            raise ValueError(f"{self.filename}: min_arch must be 80 or 90, got {self.min_arch!r}")
        if self.needs_sm90a and self.min_arch != 90:
            raise ValueError(f"{self.filename}: a source that needs sm_90a must have min_arch 90")
        for name, value in self.defines.items():
            if not re.fullmatch(r"[A-Z][A-Z0-9_]*", name) or type(value) is not int:
                raise ValueError(f"{self.filename}: define {name!r} = {value!r} must be an UPPER_CASE name "
                                 f"and an int")

    def supports(self, compute_capability: int) -> bool:
        """Whether this source may be compiled for and launched on a device of this compute
        capability (an int: 86 for 8.6)."""
        return compute_capability >= self.min_arch

    def code(self) -> str:
        """The text NVRTC compiles: the file with its headers pasted in."""
        return _paste_includes(KERNELS_DIR / self.filename, set())

    def options(self) -> tuple[str, ...]:
        """NVRTC options other than the architecture: NVRTC_OPTIONS and the defines."""
        return NVRTC_OPTIONS + tuple(f"-D{DEFINE_PREFIX}{name}={value}" for name, value in self.defines.items())

    def target_arch(self, compute_capability: int) -> str:
        """The architecture to compile for on a device of this compute capability."""
        if not self.supports(compute_capability):
            raise RuntimeError(f"{self.filename} needs compute capability {self.min_arch // 10}."
                               f"{self.min_arch % 10} or newer, not {compute_capability // 10}."
                               f"{compute_capability % 10}")
        return "sm_90a" if self.needs_sm90a else f"sm_{compute_capability}"

    def kernel(self, name_expression: str):
        """The compiled kernel for `name_expression` on the current CuPy device."""
        import cupy

        device = cupy.cuda.runtime.getDevice()
        key = (device, name_expression)
        function = self._functions.get(key)
        if function is None:
            if name_expression not in self.name_expressions:
                raise KeyError(f"{name_expression!r} is not instantiated in {self.filename}")
            with self._lock:
                module = self._modules.get(device)
                if module is None:
                    module = self._modules[device] = self._load(device)
                function = self._functions[key] = module.get_function(name_expression)
        return function

    def _load(self, device: int):
        import cupy

        from ._device import check_supported

        arch = self.target_arch(check_supported(device))
        if arch.endswith("a"):
            # CuPy picks the plain architecture itself; an sm_90a cubin is built here and loaded
            # from a file that lives as long as the process (CuPy may read it lazily).
            build = compile_offline(self, arch)
            with tempfile.NamedTemporaryFile(prefix="altup_cupy_", suffix=".cubin", delete=False) as file:
                file.write(build.cubin)
            return _NamedModule(cupy.RawModule(path=file.name), build.lowered_names)
        return cupy.RawModule(code=self.code(), options=self.options(),
                              name_expressions=list(self.name_expressions))


@dataclass(frozen=True)
class _NamedModule:
    """A module loaded from a cubin, looked up by name expression like a compiled RawModule."""

    module: object
    lowered_names: Mapping[str, str]

    def get_function(self, name_expression: str):
        return self.module.get_function(self.lowered_names[name_expression])


def _paste_includes(path: Path, pasted: set[str]) -> str:
    def include(match: re.Match) -> str:
        name = match.group(1)
        header = path.parent / name
        if name in pasted:
            return f"// ---- {name} (already pasted) ----"
        if not header.is_file():
            raise FileNotFoundError(f"{path.name} includes {name}, which is not in {path.parent}")
        pasted.add(name)
        return f"// ---- {name} ----\n{_paste_includes(header, pasted)}// ---- end of {name} ----"

    return _INCLUDE.sub(include, path.read_text())


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel."""

    name: str
    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int  # static shared memory


@dataclass(frozen=True)
class OfflineBuild:
    """The result of compiling one source for one architecture without a GPU."""

    filename: str
    arch: str
    cubin: bytes
    kernels: tuple[KernelResources, ...]
    lowered_names: Mapping[str, str]  # name expression -> mangled kernel name
    log: str

    @property
    def cubin_bytes(self) -> int:
        return len(self.cubin)


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SHARED = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> tuple[KernelResources, ...]:
    """Split ptxas' verbose log into one record per compiled entry function."""
    kernels = []
    parts = _ENTRY.split(log)
    for name, text in zip(parts[1::2], parts[2::2]):
        frame = _FRAME.search(text)
        regs = _REGS.search(text)
        if frame is None or regs is None:
            raise RuntimeError(f"could not read ptxas resources for {name}:\n{text}")
        kernels.append(
            KernelResources(
                name=name,
                registers=int(regs.group(1)),
                stack_frame_bytes=int(frame.group(1)),
                spill_store_bytes=int(frame.group(2)),
                spill_load_bytes=int(frame.group(3)),
                shared_bytes=int(shared.group(1)) if (shared := _SHARED.search(text)) else 0,
            )
        )
    return tuple(kernels)


NVRTC_EXTRA = "nvrtc"


def load_nvrtc():
    """cuda.bindings.nvrtc with the NVRTC library loaded, or a MissingExtraError naming the extra."""
    nvrtc = require("cuda.bindings.nvrtc", NVRTC_EXTRA, "cuda-bindings")
    try:
        nvrtc.nvrtcVersion()
    except RuntimeError as error:  # the bindings load libnvrtc on first use: it was not found
        raise missing("the NVRTC library (nvidia-cuda-nvrtc)", NVRTC_EXTRA) from error
    return nvrtc


def compile_offline(source: KernelSource, arch: str) -> OfflineBuild:
    """Compile `source` for `arch` ('sm_80', 'sm_90a', ...) to a cubin with NVRTC from pip; needs
    no GPU and no driver. An architecture the source does not support raises ValueError."""
    number = arch_number(arch)
    if not source.supports(number):
        raise ValueError(f"{source.filename} needs sm_{source.min_arch} or newer, got arch={arch!r}")
    if source.needs_sm90a and arch != "sm_90a":
        raise ValueError(f"{source.filename} needs the sm_90a target, got arch={arch!r}")
    nvrtc = load_nvrtc()

    def check(result, what):
        status = result[0] if isinstance(result, tuple) else result
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC {what} failed for {source.filename} ({arch}): {status}")
        return result[1:] if isinstance(result, tuple) else ()

    (program,) = check(
        nvrtc.nvrtcCreateProgram(source.code().encode(), source.filename.encode(), 0, [], []),
        "create",
    )
    try:
        for expression in source.name_expressions:
            check(nvrtc.nvrtcAddNameExpression(program, expression.encode()), "add name")
        options = [f"--gpu-architecture={arch}".encode(), b"--ptxas-options=-v"]
        options += [o.encode() for o in source.options()]
        compiled = nvrtc.nvrtcCompileProgram(program, len(options), options)
        (log_size,) = check(nvrtc.nvrtcGetProgramLogSize(program), "log size")
        log = b" " * log_size
        check(nvrtc.nvrtcGetProgramLog(program, log), "log")
        log_text = log.decode(errors="replace").rstrip("\x00 ")
        if compiled[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC could not compile {source.filename} for {arch}:\n{log_text}")
        (cubin_size,) = check(nvrtc.nvrtcGetCUBINSize(program), "cubin size")
        cubin = b" " * cubin_size
        check(nvrtc.nvrtcGetCUBIN(program, cubin), "cubin")
        lowered = {}
        for expression in source.name_expressions:
            (name,) = check(nvrtc.nvrtcGetLoweredName(program, expression.encode()), "lowered name")
            lowered[expression] = name.decode()
        return OfflineBuild(source.filename, arch, bytes(cubin), parse_ptxas_log(log_text), lowered, log_text)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
