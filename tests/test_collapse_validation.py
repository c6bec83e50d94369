"""Bad input to `altup_cupy.collapse` gets a clear TypeError/ValueError, never a wrong answer
(issue 2, point 4); the package imports without CuPy and compiles nothing; the CLI answers
--help. All of it runs without a GPU: validation happens before anything touches CUDA, and the
checks come in a fixed order (kind, dtype, shape, contiguity, alignment, eps, device), so torch CPU tensors
reach every check up to the device one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from altup_cupy import collapse
from altup_cupy.reference import collapse_reference

REPO_ROOT = Path(__file__).resolve().parent.parent
BF16 = torch.bfloat16


def _inputs(n=3, b=1, s=4, h=16, dtype=BF16):
    return torch.zeros((n, b, s, h), dtype=dtype), torch.zeros((n - 1, h, h), dtype=dtype)


def _raises(exc, *fragments, call):
    """call() raises exactly `exc`, and its message contains every fragment (case-sensitive)."""
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc, f"expected {exc.__name__}, got {type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"message {message!r} lacks {fragment!r}"
    return message


# ---- dtype ----------------------------------------------------------------------------------


# The kernels take bf16 only; meta tensors follow the kernels' rule (the CPU reference also takes
# float32 and float64, for autograd checks).
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_hidden_states_wrong_dtype(dtype):
    hs, ws = (t.to("meta") for t in _inputs())
    _raises(TypeError, "hidden_states", "bfloat16", str(dtype).removeprefix("torch."),
            call=lambda: collapse(hs.to(dtype), ws))


def test_cpu_refuses_float16_and_mixed_dtypes():
    hs, ws = _inputs()
    _raises(TypeError, "hidden_states", "bfloat16, float32 or float64 on the CPU", "float16",
            call=lambda: collapse(hs.half(), ws))
    _raises(TypeError, "unembed_projs", "float32", "bfloat16", call=lambda: collapse(hs.float(), ws))


def test_zero_width_is_refused_by_name():
    hs, ws = _inputs(h=0)
    _raises(ValueError, "hidden_states dim 3", "positive and divisible by 8", "got 0", call=lambda: collapse(hs, ws))


def test_stacked_weights_wrong_dtype():
    hs, ws = _inputs()
    _raises(TypeError, "unembed_projs", "bfloat16", "float32", call=lambda: collapse(hs, ws.float()))


def test_listed_weight_wrong_dtype_names_its_index():
    hs, ws = _inputs()
    _raises(TypeError, "unembed_projs[1]", "bfloat16", "float16",
            call=lambda: collapse(hs, [ws[0], ws[1].half()]))


# ---- rank and shape ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 4, 16), (3, 1, 1, 4, 16), (16,)])
def test_hidden_states_wrong_rank(shape):
    _, ws = _inputs()
    hs = torch.zeros(shape, dtype=BF16)
    _raises(ValueError, "hidden_states", "shape", str(list(shape)), call=lambda: collapse(hs, ws))


@pytest.mark.parametrize("n", [1, 5, 8])
def test_unsupported_stream_count(n):
    hs = torch.zeros((n, 1, 2, 16), dtype=BF16)
    ws = torch.zeros((max(n - 1, 1), 16, 16), dtype=BF16)
    _raises(ValueError, "hidden_states", "(2, 3, 4)", f"got {n}", call=lambda: collapse(hs, ws))


def test_list_length_disagrees_with_n():
    hs, ws = _inputs(n=3)
    _raises(ValueError, "unembed_projs", "N-1 = 2", "got 1", call=lambda: collapse(hs, [ws[0]]))
    _raises(ValueError, "unembed_projs", "N-1 = 2", "got 3",
            call=lambda: collapse(hs, [ws[0], ws[1], ws[1]]))


def test_stacked_count_disagrees_with_n():
    hs, _ = _inputs(n=4, h=16)
    ws = torch.zeros((2, 16, 16), dtype=BF16)
    _raises(ValueError, "unembed_projs", "[3, 16, 16]", "[2, 16, 16]", call=lambda: collapse(hs, ws))


def test_hidden_size_mismatch():
    hs, _ = _inputs(h=16)
    _raises(ValueError, "unembed_projs", "[2, 16, 16]", "[2, 24, 24]",
            call=lambda: collapse(hs, torch.zeros((2, 24, 24), dtype=BF16)))
    _raises(ValueError, "unembed_projs[0]", "[16, 16]", "[16, 24]",
            call=lambda: collapse(hs, [torch.zeros((16, 24), dtype=BF16), torch.zeros((16, 16), dtype=BF16)]))


def test_weight_wrong_rank():
    hs, _ = _inputs(h=16)
    _raises(ValueError, "unembed_projs must be a 3-D tensor [N-1, H, H]", "got a 2-D tensor of shape [32, 16]",
            call=lambda: collapse(hs, torch.zeros((32, 16), dtype=BF16)))


@pytest.mark.parametrize("h", [4, 12, 42, 3074])
def test_hidden_not_divisible_by_8(h):
    hs, ws = _inputs(h=h)
    _raises(ValueError, "hidden_states", "divisible by 8", f"got {h}", call=lambda: collapse(hs, ws))


# ---- contiguity -------------------------------------------------------------------------------


def test_non_contiguous_hidden_states():
    hs = torch.zeros((3, 1, 16, 4), dtype=BF16).transpose(2, 3)  # shape [3, 1, 4, 16], strided
    _, ws = _inputs()
    assert not hs.is_contiguous()
    _raises(ValueError, "hidden_states", "contiguous", call=lambda: collapse(hs, ws))


@pytest.mark.gpu
def test_misaligned_hidden_states():
    """A contiguous view 2 bytes into its storage: the epilogue's 16-byte loads would fault."""
    ws = _inputs()[1].cuda()
    hs = torch.zeros(3 * 4 * 16 + 1, dtype=BF16, device="cuda")[1:].view(3, 1, 4, 16)
    assert hs.is_contiguous() and hs.data_ptr() % 16
    _raises(ValueError, "hidden_states", "16-byte aligned", call=lambda: collapse(hs, ws))


def test_non_contiguous_weight():
    hs, ws = _inputs()
    _raises(ValueError, "unembed_projs[0]", "contiguous", call=lambda: collapse(hs, [ws[0].T, ws[1]]))
    stacked = torch.zeros((16, 2, 16), dtype=BF16).transpose(0, 1)  # [2, 16, 16], strided
    _raises(ValueError, "unembed_projs", "contiguous", call=lambda: collapse(hs, stacked))


# ---- host memory / wrong kind -------------------------------------------------------------------


def test_numpy_hidden_states():
    _, ws = _inputs()
    _raises(TypeError, "hidden_states", "numpy", "torch tensor or a CuPy array",
            call=lambda: collapse(np.zeros((3, 1, 4, 16), dtype=np.float32), ws))


def test_numpy_weight():
    hs, ws = _inputs()
    _raises(TypeError, "unembed_projs[0]", "numpy",
            call=lambda: collapse(hs, [np.zeros((16, 16), dtype=np.float32), ws[1]]))


@pytest.mark.parametrize("thing", [None, [[1.0]], "x"])
def test_not_an_array(thing):
    _, ws = _inputs()
    _raises(TypeError, "hidden_states", "torch tensor or a CuPy array", call=lambda: collapse(thing, ws))


@pytest.mark.parametrize("version", [1.0, True, "1"])
def test_version_that_is_not_an_int(version):
    hs, ws = _inputs()
    _raises(TypeError, "version must be None or an int", call=lambda: collapse(hs, ws, version=version))


def test_cpu_tensors_run_the_float32_reference():
    g = torch.Generator().manual_seed(1)
    hs = torch.randn((3, 2, 4, 16), generator=g).to(BF16)
    ws = torch.randn((2, 16, 16), generator=g).to(BF16)
    assert torch.equal(collapse(hs, ws), collapse_reference(hs, ws, 1e-5, torch.float32).to(BF16))


def test_weight_on_another_device_is_named():
    hs, ws = _inputs()
    _raises(ValueError, "unembed_projs[1] is on meta but hidden_states is on cpu", "one device",
            call=lambda: collapse(hs, [ws[0], ws[1].to("meta")]))


# ---- eps --------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("nan"), float("inf"), float("-inf")])
def test_eps_not_finite_or_not_positive(eps):
    hs, ws = _inputs()
    _raises(ValueError, "eps", "finite and > 0", call=lambda: collapse(hs, ws, eps=eps))


@pytest.mark.parametrize("eps", [None, "abc", [1e-5], object()])
def test_eps_not_a_number(eps):
    hs, ws = _inputs()
    _raises(TypeError, "eps", "real number", type(eps).__name__, call=lambda: collapse(hs, ws, eps=eps))


# ---- M = 0 is validated too (no launch happens, but bad input still fails) ----------------------


def test_empty_batch_still_validated():
    hs = torch.zeros((3, 0, 4, 16), dtype=BF16)
    _, ws = _inputs()
    _raises(TypeError, "unembed_projs", "bfloat16", call=lambda: collapse(hs, ws.float()))
    _raises(ValueError, "eps", call=lambda: collapse(hs, ws, eps=0.0))


# ---- import without CuPy; CLI --------------------------------------------------------------------

_NO_CUPY = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    class _BlockCupy:
        def find_spec(self, name, path=None, target=None):
            if name == "cupy" or name.startswith("cupy."):
                raise ImportError("cupy blocked by the test")
            return None

    sys.meta_path.insert(0, _BlockCupy())
    import altup_cupy
    from altup_cupy._build import KernelSource
    for info in pkgutil.walk_packages(altup_cupy.__path__, prefix="altup_cupy."):
        if info.name != "altup_cupy.__main__":
            importlib.import_module(info.name)
    assert callable(altup_cupy.collapse)
    assert "cupy" not in sys.modules, "importing altup_cupy imported cupy"
    loaded_nvrtc = [m for m in sys.modules if m.startswith("cuda.bindings.nvrtc") or m == "cupy_backends"]
    assert not loaded_nvrtc, f"importing altup_cupy loaded a compiler: {loaded_nvrtc}"
    for name, module in list(sys.modules.items()):
        if name.startswith("altup_cupy"):
            for value in vars(module).values():
                if isinstance(value, KernelSource):
                    assert not value._modules, f"{name}: a kernel was compiled at import time"
    print("IMPORT-OK", altup_cupy.__version__)
    """
)


def _run_python(code_or_args, **kw):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    args = code_or_args if isinstance(code_or_args, list) else ["-c", code_or_args]
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          env=env, timeout=300, **kw)


def test_import_without_cupy_compiles_nothing():
    result = _run_python(_NO_CUPY)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "IMPORT-OK" in result.stdout


def test_cli_help_exits_zero():
    result = _run_python(["-m", "altup_cupy", "--help"])
    assert result.returncode == 0, result.stdout + result.stderr
    for sub in ("bench", "check", "figures"):
        assert sub in result.stdout, f"--help does not mention the {sub!r} subcommand:\n{result.stdout}"


def test_cli_help_without_cupy():
    code = _NO_CUPY.split("import altup_cupy")[0] + textwrap.dedent(
        """
        import runpy
        sys.argv = ["altup_cupy", "--help"]
        try:
            runpy.run_module("altup_cupy", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            sys.exit(e.code)
        """
    )
    result = _run_python(code)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "usage" in result.stdout.lower()
