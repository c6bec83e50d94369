"""The collapse forward on a GPU (issue 2, point 7). Skipped, with the reason, without one.

Every check compares against a float64 reference computed on the GPU from the same bf16 inputs:
- the benchmark's rule: >= 99% of elements within atol + rtol*|ref|, no NaN/Inf;
- the accuracy oracle: rel. L2 error <= max(2 * that of plain PyTorch fp32 rounded to bf16, 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from altup_cupy import _cublas, _sources, collapse
from altup_cupy.lab.check import oracle_bound
from altup_cupy.lab.workloads import benchmark_workloads, collapse_inputs, tolerance_report
from altup_cupy.ops import collapse_versions
from altup_cupy.ops.collapse_epilogue import epilogue_v1
from altup_cupy.reference import collapse_reference

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
ATOL, RTOL, EPS = 1e-5, 0.05, 1e-5  # the collapse's tolerances in workloads.json
ROUNDS = 3
WORKLOADS = benchmark_workloads("collapse")


@pytest.fixture(autouse=True)
def _exact_fp32_matmul():
    """The fp32 oracle must be real fp32 (no TF32)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _inputs(n, b, s, h, seed, eps=EPS):
    from altup_cupy.lab.workloads import Workload

    return collapse_inputs(Workload("collapse", n, h, b, s, ATOL, RTOL, eps), seed)


def _check(out, hs, ws, eps, atol=ATOL, rtol=RTOL, what=""):
    """Assert the benchmark rule and the oracle; return the report."""
    b, s, h = hs.shape[1:]
    assert isinstance(out, torch.Tensor), type(out)
    assert out.dtype == BF16 and tuple(out.shape) == (b, s, h) and out.device == hs.device
    ref64 = collapse_reference(hs, ws, eps, dtype=torch.float64)
    ref32 = collapse_reference(hs, ws, eps, dtype=torch.float32).to(BF16)
    report = tolerance_report(out, ref64, atol, rtol)
    oracle = tolerance_report(ref32, ref64, atol, rtol)
    bound = oracle_bound(oracle.rel_l2)
    print(f"{what}: match {report.match_ratio:.6f}  rel_l2 {report.rel_l2:.3e}  "
          f"(fp32 torch {oracle.rel_l2:.3e}, bound {bound:.3e})")
    assert report.finite, f"{what}: NaN or Inf in the output"
    assert report.passed, f"{what}: only {report.match_ratio:.4%} of elements within tolerance"
    assert report.rel_l2 <= bound, f"{what}: rel_l2 {report.rel_l2:.3e} > {bound:.3e}"
    return report


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == BF16 else t


# ---- the 16 benchmark workloads, fresh inputs each round ---------------------------------------


@pytest.mark.parametrize("w", WORKLOADS, ids=[w.label for w in WORKLOADS])
def test_benchmark_workload(w, seeds):
    for round_ in range(ROUNDS):
        inputs = collapse_inputs(w, seeds())
        out = collapse(inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"])
        torch.cuda.synchronize()
        _check(out, inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"], w.atol, w.rtol,
               what=f"{w.label} round {round_}")


# ---- shapes: Gemma 3n's, tiny M, odd H, large H --------------------------------------------------

SHAPES = [
    (2, 2048, 1, 1), (2, 2048, 1, 7), (4, 2048, 1, 1), (4, 2048, 1, 7), (4, 2048, 2, 129),
    (2, 2560, 1, 1), (2, 2560, 1, 7), (4, 2560, 1, 1), (4, 2560, 1, 7), (4, 2560, 3, 100),
    (3, 3072, 1, 1), (3, 3072, 1, 7),
    (3, 40, 1, 7), (3, 8, 1, 1), (2, 8, 2, 3), (4, 40, 5, 3), (2, 24, 1, 1000),
    (3, 8192, 1, 5), (2, 16384, 1, 3),
]


@pytest.mark.parametrize("n,h,b,s", SHAPES, ids=[f"N{n}_H{h}_B{b}_S{s}" for n, h, b, s in SHAPES])
def test_shapes(n, h, b, s, seeds):
    inputs = _inputs(n, b, s, h, seeds())
    hs, ws = inputs["hidden_states"], inputs["unembed_projs"]
    out = collapse(hs, ws, EPS)
    torch.cuda.synchronize()
    _check(out, hs, ws, EPS, what=f"N{n} H{h} M{b * s}")


def test_eps_clamp_on_gpu(seeds):
    """Stream 1 projects to ~0, so max(mean, eps) = eps binds there."""
    inputs = _inputs(3, 1, 64, 2048, seeds())
    hs, ws = inputs["hidden_states"], inputs["unembed_projs"]
    hs[1] = (hs[1].float() * 1e-6).to(BF16)
    out = collapse(hs, ws, 1e-3)
    torch.cuda.synchronize()
    _check(out, hs, ws, 1e-3, what="clamped")


# ---- API: list vs stacked, torch and cupy in/out -------------------------------------------------


def _assert_bitwise_equal(a, b, what):
    differ = _bits(a) != _bits(b)
    if differ.any():
        worst = (a.float() - b.float()).abs().max().item()
        raise AssertionError(f"{what}: {int(differ.sum())} of {a.numel()} elements differ "
                             f"(max |diff| {worst:.3g})")


def _assert_within_one_ulp(a, b, what):
    """cuBLAS may pick another algorithm (another fp32 summation order) for another call shape:
    allow at most one bf16 rounding step (2^-7 of the larger magnitude) on < 1% of the elements,
    plus the benchmark's atol 1e-5 where the output cancels to near zero (there the fp32 rounding
    of the O(1) terms, not the bf16 rounding of the result, sets the difference)."""
    differ = _bits(a) != _bits(b)
    if differ.any():
        step = torch.maximum(a.float().abs(), b.float().abs()) * 2.0**-7 + 1e-5
        worst = ((a.float() - b.float()).abs() - step).max().item()
        assert worst <= 0, f"{what}: a difference {worst:.3g} above one bf16 rounding step"
        assert differ.double().mean().item() < 1e-2, f"{what}: {int(differ.sum())} elements differ"


@pytest.mark.parametrize("m", [1, 7, 33, 154])
def test_stacked_and_list_weights_agree(m, seeds):
    inputs = _inputs(3, 1, m, 3072, seeds())
    hs, ws = inputs["hidden_states"], inputs["unembed_projs"]
    stacked = collapse(hs, ws, EPS)
    listed = collapse(hs, [ws[0], ws[1]], EPS)
    again = collapse(hs, ws, EPS)
    torch.cuda.synchronize()
    _assert_bitwise_equal(stacked, again, "two calls on the same inputs")
    # One strided-batched cuBLAS call against one call per weight.
    _assert_within_one_ulp(stacked, listed, f"M={m}: stacked [N-1, H, H] vs list of [H, H] weights")
    _check(stacked, hs, ws, EPS, what="stacked")


def test_torch_in_torch_out(seeds):
    inputs = _inputs(4, 2, 9, 2560, seeds())
    hs, ws = inputs["hidden_states"], inputs["unembed_projs"]
    out = collapse(hs, ws)
    assert type(out) is torch.Tensor
    assert out.dtype == BF16 and out.shape == (2, 9, 2560) and out.device == hs.device
    assert out.is_contiguous()
    torch.cuda.synchronize()
    _check(out, hs, ws, EPS, what="torch")


def test_cupy_in_cupy_out(seeds):
    import cupy

    inputs = _inputs(3, 1, 33, 3072, seeds())
    hs, ws = inputs["hidden_states"], inputs["unembed_projs"]
    hs_c, ws_c = cupy.from_dlpack(hs), cupy.from_dlpack(ws)
    out_c = collapse(hs_c, ws_c, EPS)
    assert isinstance(out_c, cupy.ndarray), type(out_c)
    assert str(out_c.dtype) == "bfloat16" and out_c.shape == (1, 33, 3072)
    assert out_c.device.id == hs.device.index
    out_list = collapse(hs_c, [ws_c[0], ws_c[1]], EPS)
    assert isinstance(out_list, cupy.ndarray)
    cupy.cuda.get_current_stream().synchronize()
    out_t = torch.from_dlpack(out_c)
    # Same kernels as the torch path: bitwise the same results.
    _assert_bitwise_equal(out_t, collapse(hs, ws, EPS), "cupy vs torch (stacked weights)")
    _assert_bitwise_equal(torch.from_dlpack(out_list), collapse(hs, [ws[0], ws[1]], EPS),
                          "cupy vs torch (list of weights)")
    _check(out_t, hs, ws, EPS, what="cupy")


# ---- outputs poisoned, inputs untouched, caller's stream ----------------------------------------


def test_output_poisoned_through_the_allocator(seeds):
    n, b, s, h = 3, 4, 100, 3072
    inputs = _inputs(n, b, s, h, seeds())
    hs, ws = inputs["hidden_states"], inputs["unembed_projs"]
    # Fill blocks of the output's and the workspace's sizes with NaN and free them: the caching
    # allocator hands them back to the call.
    poison = [torch.full((b, s, h), float("nan"), dtype=BF16, device="cuda"),
              torch.full(((n - 1) * b * s * h,), float("nan"), dtype=torch.float32, device="cuda")]
    torch.cuda.synchronize()
    del poison
    out = collapse(hs, ws, EPS)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    _check(out, hs, ws, EPS, what="poisoned")


def test_epilogue_kernel_writes_every_output_element(seeds):
    """The RawKernel on its own, into a NaN-filled output, from fp32 projections made here."""
    n, b, s, h = 3, 1, 37, 3072
    inputs = _inputs(n, b, s, h, seeds())
    hs, ws = inputs["hidden_states"], inputs["unembed_projs"]
    rows = b * s
    x64 = hs.to(torch.float64)
    y = torch.stack([x64[k].reshape(rows, h) @ ws[k - 1].to(torch.float64).T for k in range(1, n)])
    y32 = y.to(torch.float32).contiguous()
    out = torch.full((b, s, h), float("nan"), dtype=BF16, device="cuda")
    launch = epilogue_v1(n, h)
    launch(torch.cuda.current_stream().cuda_stream, rows, hs.data_ptr(), y32.data_ptr(), out.data_ptr(),
           h, rows, EPS)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "the epilogue left output elements unwritten"
    # Expected from the same fp32 projections, in float64.
    y64 = y32.to(torch.float64)
    s0 = x64[0].reshape(rows, h)
    target = s0.square().mean(-1, keepdim=True).sqrt()
    mag = y64.square().mean(-1, keepdim=True).clamp_min(EPS).sqrt()
    ref = ((s0 + (y64 * (target / mag)).sum(0)) / n).reshape(b, s, h)
    report = tolerance_report(out, ref, ATOL, RTOL)
    assert report.passed and report.rel_l2 < 4e-3, report


def test_inputs_unchanged(seeds):
    inputs = _inputs(3, 2, 50, 3072, seeds())
    hs, ws = inputs["hidden_states"], inputs["unembed_projs"]
    hs_before, ws_before = hs.clone(), ws.clone()
    listed = [ws[0], ws[1]]
    collapse(hs, ws, EPS)
    collapse(hs, listed, EPS)
    torch.cuda.synchronize()
    assert torch.equal(_bits(hs), _bits(hs_before)), "hidden_states was modified"
    assert torch.equal(_bits(ws), _bits(ws_before)), "unembed_projs was modified"


def test_runs_on_the_callers_torch_stream(seeds):
    """Inputs are written on a side stream after a GPU-side delay; the call, made on that stream
    without synchronising, must see them (it would read zeros on any other stream)."""
    n, b, s, h = 3, 2, 64, 3072
    inputs = _inputs(n, b, s, h, seeds())
    src_hs, ws = inputs["hidden_states"], inputs["unembed_projs"]
    hs = torch.zeros_like(src_hs)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on `side`
        hs.copy_(src_hs)
        out = collapse(hs, ws, EPS)
    side.synchronize()
    _check(out, src_hs, ws, EPS, what="side stream")


def test_threads_on_one_stream_never_share_scratch(seeds):
    """Two threads call the collapse back to back on torch's default stream, which they share. Each
    call borrows the reused projections' buffer only while it queues its launches (`_scratch`); had
    both used it at once, one thread's epilogue would read the other's projections. Every result
    must equal, bit for bit, that of the same call made alone."""
    import threading

    work = [_inputs(3, 1, 256, 3072, seeds()) for _ in range(2)]
    alone = [collapse(w["hidden_states"], w["unembed_projs"], EPS) for w in work]
    results: list[list[torch.Tensor]] = [[], []]
    start = threading.Barrier(2)

    def run(i):
        start.wait()
        for _ in range(200):
            results[i].append(collapse(work[i]["hidden_states"], work[i]["unembed_projs"], EPS))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    for i in range(2):
        assert len(results[i]) == 200
        mismatched = sum(not torch.equal(_bits(out), _bits(alone[i])) for out in results[i])
        assert mismatched == 0, f"thread {i}: {mismatched} of 200 results differ from the call made alone"


# The kernel ahead of the epilogue in the next test: it lets the epilogue launch at once, then waits
# `spin_cycles` before it writes the projections.
_LATE_WRITER = r"""
extern "C" __global__ void late_writer(float* dst, const float* src, long long n, long long spin_cycles) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const long long start = clock64();
    while (clock64() - start < spin_cycles) {}
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""


def test_the_epilogue_waits_for_the_kernel_ahead(seeds):
    """On Hopper the epilogue is a programmatic dependent launch: its blocks may start as soon as
    every block of the kernel ahead has released them (griddepcontrol.launch_dependents), so it
    must wait (griddep_wait) for that kernel's writes before it reads. Here the kernel ahead, on
    four blocks, releases it at once and then spins about 0.1 ms before it writes the projections
    into a NaN-filled buffer: an epilogue that read early would give NaN, or other bits than the
    same launch made after the projections were in place."""
    import cupy

    from altup_cupy._launch import PROGRAMMATIC_MIN_DRIVER, PackedLaunch

    major, _ = torch.cuda.get_device_capability()
    launch = epilogue_v1(3, 3072)
    assert launch.programmatic == (major >= 9 and cupy.cuda.runtime.driverGetVersion() >= PROGRAMMATIC_MIN_DRIVER)
    n, rows, h = 3, 300, 3072
    inputs = _inputs(n, 1, rows, h, seeds())
    hs, ws = inputs["hidden_states"], inputs["unembed_projs"]
    y32 = torch.stack([hs[k].reshape(rows, h).float() @ ws[k - 1].float().T for k in range(1, n)]).contiguous()
    late = torch.full_like(y32, float("nan"))
    expected, got = (torch.full((rows, h), float("nan"), dtype=BF16, device="cuda") for _ in range(2))
    writer = PackedLaunch(cupy.RawKernel(_LATE_WRITER, "late_writer"), 256, 0, ("ptr", "ptr", "i64", "i64"))
    stream = torch.cuda.current_stream().cuda_stream
    launch(stream, rows, hs.data_ptr(), y32.data_ptr(), expected.data_ptr(), h, rows, EPS)
    torch.cuda.synchronize()
    # The writer, then at once the epilogue on what the writer has yet to write: nothing between them.
    writer(stream, 4, late.data_ptr(), y32.data_ptr(), late.numel(), 200_000)
    launch(stream, rows, hs.data_ptr(), late.data_ptr(), got.data_ptr(), h, rows, EPS)
    torch.cuda.synchronize()
    assert torch.equal(late, y32), "the writer did not write the projections"
    assert torch.isfinite(expected.float()).all()
    assert torch.equal(_bits(got), _bits(expected)), "the epilogue read the projections before they were written"

# ---- workspace chunking, M = 0, past 2^31 elements ------------------------------------------------


def _count_gemms(monkeypatch):
    """Record the rows of every projection GEMM the collapse issues."""
    calls = []
    real = _cublas.Gemm.__call__

    def counting(self, *args):
        calls.append(self.rows)
        return real(self, *args)

    monkeypatch.setattr(_cublas.Gemm, "__call__", counting)
    return calls


@pytest.fixture
def fresh_collapse_plans():
    """Plans are cached per shape: a test that changes how plans are built starts and ends clean."""
    collapse_versions._v1_plan.cache_clear()
    yield
    collapse_versions._v1_plan.cache_clear()


@pytest.mark.parametrize("weights", ["stacked", "list"])
def test_workspace_chunking(weights, monkeypatch, seeds, fresh_collapse_plans):
    n, b, s, h = 3, 2, 500, 3072  # M = 1000 rows
    inputs = _inputs(n, b, s, h, seeds())
    hs, ws = inputs["hidden_states"], inputs["unembed_projs"]
    ws_arg = ws if weights == "stacked" else [ws[0], ws[1]]
    whole = collapse(hs, ws_arg, EPS)
    block = 97  # 11 blocks, the last one partial (30 rows)
    monkeypatch.setattr(collapse_versions, "WORKSPACE_BYTES", block * (n - 1) * h * 4)
    collapse_versions._v1_plan.cache_clear()
    calls = _count_gemms(monkeypatch)
    chunked = collapse(hs, ws_arg, EPS)
    torch.cuda.synchronize()
    gemms_per_block = 1 if weights == "stacked" else n - 1
    blocks = -(-b * s // block)
    assert len(calls) == blocks * gemms_per_block, (
        f"expected {blocks} row blocks of <= {block} rows, the GEMMs were called with rows={calls}")
    assert max(calls) <= block and sum(calls) == b * s * gemms_per_block
    _check(chunked, hs, ws, EPS, what=f"chunked {weights}")
    # Rows are independent, so chunking changes nothing but cuBLAS' choice of algorithm.
    _assert_within_one_ulp(chunked, whole, "chunked vs whole")


def test_empty_batch_returns_without_launch(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a GPU launch for M = 0")

    monkeypatch.setattr(_cublas.Gemm, "__call__", fail)
    monkeypatch.setattr(_sources.COLLAPSE_V1, "kernel", fail)
    ws = torch.zeros((2, 3072, 3072), dtype=BF16, device="cuda")
    for shape in [(3, 0, 5, 3072), (3, 4, 0, 3072)]:
        hs = torch.zeros(shape, dtype=BF16, device="cuda")
        out = collapse(hs, ws, EPS)
        assert type(out) is torch.Tensor and out.dtype == BF16
        assert tuple(out.shape) == shape[1:] and out.numel() == 0 and out.device == hs.device

    import cupy

    out_c = collapse(cupy.from_dlpack(torch.zeros((3, 0, 5, 3072), dtype=BF16, device="cuda")),
                     cupy.from_dlpack(ws), EPS)
    assert isinstance(out_c, cupy.ndarray) and out_c.shape == (0, 5, 3072)


def test_past_2_pow_31_elements(seeds):
    n, h, m = 3, 3072, 240_000
    assert n * m * h > 2**31
    g = torch.Generator(device="cuda").manual_seed(seeds())
    hs = torch.empty((n, 1, m, h), dtype=BF16, device="cuda")
    for k in range(n):  # drawn stream by stream to bound the fp32 temporary
        hs[k] = torch.randn((1, m, h), generator=g, device="cuda").to(BF16)
    ws = torch.randn((n - 1, h, h), generator=g, device="cuda").to(BF16)
    out = collapse(hs, ws, EPS)
    torch.cuda.synchronize()
    assert out.shape == (1, m, h) and torch.isfinite(out).all()
    rows = torch.cat([torch.arange(0, 4), torch.randint(4, m - 4, (24,), generator=g, device="cuda").cpu(),
                      torch.arange(m - 4, m)]).to("cuda")
    sample_hs = hs[:, :, rows].contiguous()
    _check(out[:, rows].contiguous(), sample_hs, ws, EPS, what="past 2^31 (sampled rows)")
    del hs, out
    torch.cuda.empty_cache()
