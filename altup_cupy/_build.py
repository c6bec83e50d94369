"""Loading the package's CUDA sources.

Every `.cu` file next to this module is one `KernelSource`. On a GPU it becomes one
`cupy.RawModule`, compiled by NVRTC on first use and cached by CuPy (in memory and on disk).
Without a GPU the same text, with the same options and template instantiations, can be compiled
for sm_90 through `cuda.bindings.nvrtc` (pip: cuda-bindings + nvidia-cuda-nvrtc); the tests use
that to show that every kernel builds with no spills and no stack frame.

The sources include no headers (bf16 conversions are written out in `common.cuh`, which is
pasted in front of each source), so neither path needs a CUDA toolkit's include directory.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
COMMON_HEADER = "common.cuh"
# Hopper. Plain sm_90: these kernels use no wgmma/setmaxnreg, so they need no sm_90a.
ARCH = "sm_90"
# No --use_fast_math: tanh, rsqrt and division keep their IEEE-accurate fp32 versions.
NVRTC_OPTIONS = ("-std=c++17",)


@dataclass
class KernelSource:
    """One `.cu` file and the template instantiations the host code launches from it."""

    filename: str  # relative to this package, e.g. "collapse.cu" or "kernels/collapse_v2.cu"
    name_expressions: tuple[str, ...]
    # The oldest target the source builds for; "sm_90a" for wgmma/setmaxnreg (arch-specific).
    min_arch: str = ARCH
    defines: tuple[str, ...] = ()  # extra NVRTC options such as "-DFOO=1"
    _modules: dict = field(default_factory=dict, repr=False)
    _functions: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def code(self) -> str:
        common = (SOURCE_DIR / COMMON_HEADER).read_text()
        body = (SOURCE_DIR / self.filename).read_text()
        # The header is pasted, not #included, so NVRTC needs no include path.
        body = body.replace(f'#include "{COMMON_HEADER}"', f"// ---- {COMMON_HEADER} ----\n{common}")
        return body

    def kernel(self, name_expression: str):
        """The compiled kernel for `name_expression` on the current CuPy device."""
        import cupy

        key = (cupy.cuda.runtime.getDevice(), name_expression)
        function = self._functions.get(key)
        if function is None:
            if name_expression not in self.name_expressions:
                raise KeyError(f"{name_expression!r} is not instantiated in {self.filename}")
            with self._lock:
                module = self._modules.get(key[0])
                if module is None:
                    module = cupy.RawModule(
                        code=self.code(),
                        options=NVRTC_OPTIONS + self.defines,
                        name_expressions=list(self.name_expressions),
                    )
                    self._modules[key[0]] = module
                function = self._functions[key] = module.get_function(name_expression)
        return function


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel."""

    name: str
    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


@dataclass(frozen=True)
class OfflineBuild:
    """The result of compiling one source for sm_90 without a GPU."""

    filename: str
    cubin_bytes: int
    kernels: tuple[KernelResources, ...]
    log: str


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


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
            )
        )
    return tuple(kernels)


@dataclass(frozen=True)
class Cubin:
    """A source compiled by NVRTC: the image, each name expression's mangled name, ptxas' log."""

    image: bytes
    lowered_names: dict
    log: str


def compile_offline(source: KernelSource, arch: str = ARCH) -> OfflineBuild:
    """Compile `source` to a cubin with NVRTC from pip; needs no GPU and no driver.

    A source whose `min_arch` is an arch-specific target (sm_90a) is compiled for that target.
    """
    build = compile_cubin(source, source.min_arch if source.min_arch.endswith("a") else arch)
    return OfflineBuild(source.filename, len(build.image), parse_ptxas_log(build.log), build.log)


def compile_cubin(source: KernelSource, arch: str) -> Cubin:
    """NVRTC `source` (with its defines) for `arch`, with ptxas' verbose report."""
    from cuda.bindings import nvrtc

    def check(result, what):
        status = result[0] if isinstance(result, tuple) else result
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC {what} failed for {source.filename}: {status}")
        return result[1:] if isinstance(result, tuple) else ()

    (program,) = check(
        nvrtc.nvrtcCreateProgram(source.code().encode(), source.filename.encode(), 0, [], []),
        "create",
    )
    try:
        for expression in source.name_expressions:
            check(nvrtc.nvrtcAddNameExpression(program, expression.encode()), "add name")
        options = [f"--gpu-architecture={arch}".encode(), b"--ptxas-options=-v"]
        options += [o.encode() for o in (*NVRTC_OPTIONS, *source.defines)]
        compiled = nvrtc.nvrtcCompileProgram(program, len(options), options)
        (log_size,) = check(nvrtc.nvrtcGetProgramLogSize(program), "log size")
        log = b" " * log_size
        check(nvrtc.nvrtcGetProgramLog(program, log), "log")
        log_text = log.decode(errors="replace").rstrip("\x00 ")
        if compiled[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC could not compile {source.filename}:\n{log_text}")
        (cubin_size,) = check(nvrtc.nvrtcGetCUBINSize(program), "cubin size")
        image = b" " * cubin_size
        check(nvrtc.nvrtcGetCUBIN(program, image), "cubin")
        lowered = {}
        for expression in source.name_expressions:
            (name,) = check(nvrtc.nvrtcGetLoweredName(program, expression.encode()), "lowered name")
            lowered[expression] = name.decode() if isinstance(name, bytes) else name
        return Cubin(image, lowered, log_text)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
