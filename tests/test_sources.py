"""One home for every launch constant the host and the kernels share (altup_cupy/_sources.py).

The kernels read them only as ALTUP_* defines given by their KernelSource, never define them
themselves, and no host module keeps its own copy under another name. Layout sizes the kernels
derive (TokenStats<N>::size, partial_stride) are checked by static_asserts against the defines,
which tests/test_compile.py compiles. Also: the device check and the per-architecture dispatch.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import altup_cupy
from altup_cupy import _device, _sources
from altup_cupy._build import DEFINE_PREFIX, KERNELS_DIR, KernelSource
from altup_cupy._sources import ALL_SOURCES

PACKAGE_DIR = Path(altup_cupy.__file__).resolve().parent
USED_DEFINE = re.compile(rf"\b{DEFINE_PREFIX}([A-Z0-9_]+)\b")


def _code_without_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


@pytest.mark.parametrize("source", ALL_SOURCES, ids=[s.filename for s in ALL_SOURCES])
def test_every_define_a_source_uses_is_given_and_every_given_one_used(source):
    used = set(USED_DEFINE.findall(_code_without_comments(source.code())))
    given = set(source.defines)
    assert used <= given, f"{source.filename} uses {sorted(used - given)} that its KernelSource does not define"
    assert given <= used, f"{source.filename} is given {sorted(given - used)} that it never uses"


def test_no_kernel_file_defines_a_shared_constant():
    for path in sorted(KERNELS_DIR.glob("*.cu*")):
        defined = re.findall(rf"#\s*define\s+({DEFINE_PREFIX}\w+)", path.read_text())
        assert not defined, f"{path.name} defines {defined}; they come from _sources.py"
        constants = re.findall(r"constexpr\s+int\s+(k[A-Z]\w*)\s*=\s*(\d+)\s*;", path.read_text())
        values = {v for s in ALL_SOURCES for v in s.defines.values()}
        copies = [(name, v) for name, v in constants if int(v) in values and int(v) > 8]
        assert not copies, f"{path.name}: constants with the value of a define: {copies}"


def _module_int_constants(path: Path):
    """(name, value) of module-level `NAME = <int expression of literals>` assignments."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                value = ast.literal_eval(node.value) if not isinstance(node.value, ast.BinOp) else eval(
                    compile(ast.Expression(node.value), str(path), "eval"), {})
            except Exception:
                continue
            if type(value) is int:
                yield node.targets[0].id, value


def test_no_host_module_copies_a_define():
    """A host constant with a define's value and a name sharing two words with it (V4_MAX_THREADS
    vs a copy named MAX_V4_THREADS = 352) is a second home for the fact."""
    defines = {name: value for s in ALL_SOURCES for name, value in s.defines.items()}
    copies = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.name == "_sources.py":
            continue
        for name, value in _module_int_constants(path):
            for define, define_value in defines.items():
                shared = set(name.split("_")) & set(define.split("_"))
                if value == define_value and len(shared) >= 2:
                    copies.append(f"{path.relative_to(PACKAGE_DIR)}: {name} = {value} (define {define})")
    assert not copies, "host constants that copy a define (import it from _sources):\n" + "\n".join(copies)


def test_collapse_launch_bounds_cover_every_instantiation():
    most = max(n * c for n in _sources.SUPPORTED_STREAMS for c in _sources.COLLAPSE_CHUNK_CHOICES)
    assert _sources.COLLAPSE_LAUNCH_BOUNDS[-1][0] >= most
    assert _sources.collapse_max_threads(4, 4) == 256 and _sources.collapse_max_threads(2, 2) == 1024


def test_kernel_source_arguments_are_checked():
    with pytest.raises(ValueError, match="min_arch must be 80 or 90"):
        KernelSource("x.cu", ("k",), min_arch=75)
    with pytest.raises(ValueError, match="must be an UPPER_CASE name and an int"):
        KernelSource("x.cu", ("k",), defines={"THREADS": 1.5})
    with pytest.raises(ValueError, match="needs sm_90a must have min_arch 90"):
        KernelSource("x.cu", ("k",), needs_sm90a=True)


def test_supports_and_target_arch_follow_the_compute_capability():
    v3, v4 = _sources.PREDICT_CORRECT_BACKWARD_V3, _sources.PREDICT_CORRECT_BACKWARD_V4
    assert v3.supports(80) and v3.supports(90) and not v3.supports(75)
    assert v4.supports(90) and not v4.supports(89)
    assert v3.target_arch(86) == "sm_86"
    assert v4.target_arch(90) == "sm_90"
    with pytest.raises(RuntimeError, match="needs compute capability 9.0 or newer, not 8.9"):
        v4.target_arch(89)


def test_check_supported_names_a_device_below_8_0(monkeypatch):
    """torch's device queries stubbed: a Turing card is refused by name, an Ampere one passes."""
    monkeypatch.setattr(_device.torch.cuda, "get_device_name", lambda index: "Tesla T4")
    monkeypatch.setattr(_device.torch.cuda, "get_device_capability", lambda index: (7, 5))
    _device.facts.cache_clear()
    with pytest.raises(RuntimeError, match=r"CUDA device 0 \(Tesla T4\) has compute capability 7\.5; "
                                           r"altup_cupy's kernels need 8\.0 or newer"):
        _device.check_supported(0)
    monkeypatch.setattr(_device.torch.cuda, "get_device_capability", lambda index: (8, 6))
    _device.facts.cache_clear()
    assert _device.check_supported(0) == 86
    _device.facts.cache_clear()


def test_default_dispatch_capability_follows_the_cap(monkeypatch):
    monkeypatch.delenv(_device.DISPATCH_CAP_VARIABLE, raising=False)
    assert _device.default_dispatch_capability(90) == 90
    monkeypatch.setenv(_device.DISPATCH_CAP_VARIABLE, "80")
    assert _device.default_dispatch_capability(90) == 80
    assert _device.default_dispatch_capability(86) == 80
    monkeypatch.setenv(_device.DISPATCH_CAP_VARIABLE, "120")
    assert _device.default_dispatch_capability(90) == 90  # a cap never raises the device's own
    for bad in ("8.0", "75", "sm_80"):
        monkeypatch.setenv(_device.DISPATCH_CAP_VARIABLE, bad)
        with pytest.raises(ValueError, match=f"ALTUP_MAX_COMPUTE_CAPABILITY must be .* got '{bad}'"):
            _device.default_dispatch_capability(90)


def test_every_gemma3n_kernel_instance_is_compiled():
    """Every instantiation a Gemma 3n launcher can ask for is a name expression of its registry
    entry's source (`KernelSource.kernel` refuses any other), and its argument types exist."""
    from altup_cupy.ops import gemma3n_altup_versions
    from altup_cupy._launch import ARG_CODES

    streams = _sources.SUPPORTED_STREAMS
    params = {
        "predict_forward": [(n, a) for n in streams for a in range(n)],
        "predict_backward": [(n, a, given) for n in streams for a in range(n) for given in ("false", "true")],
        "correct_forward": [(n, a) for n in streams for a in range(n)],
        "correct_backward": [(n, a, given) for n in streams for a in range(n) for given in ("false", "true")],
        "router_grads": [(n,) for n in streams],
        "expand_forward": [(n,) for n in streams],
        "magnitude_match_backward": [(n, t) for n in streams for t in ("float", "unsigned short")],
    }
    assert params.keys() == gemma3n_altup_versions.KERNELS.keys()
    for step, versions in gemma3n_altup_versions.KERNELS.items():
        assert 1 <= gemma3n_altup_versions.DEFAULT[step] <= len(versions), step
        for version, entry in enumerate(versions, 1):
            assert entry.source in ALL_SOURCES, (step, version)
            assert set(entry.arg_types) <= ARG_CODES.keys(), (step, version)
            missing = [p for p in params[step] if entry.instance(p) not in entry.source.name_expressions]
            assert not missing, f"{step} v{version}: {entry.source.filename} does not compile {missing}"


def test_every_gemma3n_kernel_version_is_its_own_file():
    """A version of a Gemma 3n step is one .cu, named altup_<step>_v<n>.cu, whose kernel carries
    that name and whose header says what the version is or changed (where a step has several)."""
    from altup_cupy.ops import gemma3n_altup_versions

    seen = set()
    for step, versions in gemma3n_altup_versions.KERNELS.items():
        for version, entry in enumerate(versions, 1):
            name = f"altup_{step}_v{version}"
            assert entry.source.filename == f"{name}.cu" and entry.template == name, (step, version)
            assert entry.source.filename not in seen, entry.source.filename
            seen.add(entry.source.filename)
            header = (KERNELS_DIR / entry.source.filename).read_text().split("#include")[0]
            assert "What this version" in header or len(versions) == 1, f"{entry.source.filename}: no note"


def test_a_gemma3n_kernel_version_outside_the_registry_is_refused():
    from altup_cupy.ops import gemma3n_altup_versions

    versions = len(gemma3n_altup_versions.KERNELS["predict_backward"])
    assert gemma3n_altup_versions.check_version("predict_backward", None) == gemma3n_altup_versions.DEFAULT[
        "predict_backward"]
    assert gemma3n_altup_versions.check_version("predict_backward", versions) == versions
    assert gemma3n_altup_versions.check_version("predict_backward", 1) == 1
    for bad in (0, versions + 1, -1, True, 1.0, "2"):
        with pytest.raises(ValueError, match="predict_backward: version must be one of"):
            gemma3n_altup_versions.check_version("predict_backward", bad)


@pytest.mark.parametrize("shared_per_sm, streams, predict_version, correct_version", [
    (228 * 1024, 4, 3, 2),  # sm_90: two blocks of slice-major sums (48 KiB) fit
    (164 * 1024, 4, 3, 2),  # sm_80
    (100 * 1024, 4, 1, 1),  # sm_86, sm_89: slice-major would leave one block an SM, v1 keeps two
    (100 * 1024, 3, 3, 2),  # slice-major sums take 36 KiB at N = 3
])
def test_the_routed_backward_default_keeps_two_blocks_an_sm(monkeypatch, shared_per_sm, streams, predict_version,
                                                            correct_version):
    from altup_cupy import _device
    from altup_cupy.ops import gemma3n_altup_versions

    monkeypatch.setattr(_device, "shared_memory_per_sm", lambda index: shared_per_sm)
    assert gemma3n_altup_versions._routed_default("predict_backward", 0, streams, 2048) == predict_version
    assert gemma3n_altup_versions._routed_default("correct_backward", 0, streams, 2048) == correct_version
