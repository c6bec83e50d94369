"""The Hopper collapse, v2 and v3 (altup_cupy.ops.collapse_hopper; kernels/collapse_gemm_sm90.cuh,
collapse_v2.cu and collapse_v3.cu).

CPU: the host plan, the work-unit schedule and the accumulator layout (Python mirrors of the
kernel's index arithmetic), tensor-map arguments, the parameter block's layout against the
kernel's declaration, an NVRTC sm_90a build with no spills and no stack, and the GPU checks below
run against stand-ins with planted defects (each must catch its defect).
GPU (Hopper only): the GEMM of v2 and of v3 (its row statistics) against float64 over a grid of
N, M and H; the whole op, v2 and v3, by the benchmark's rule and the 2x-fp32 oracle on the benchmark's
and Gemma 3n's workloads and on shapes no tile divides.
"""

from __future__ import annotations

import re
import struct

import pytest
import torch

from altup_cupy import collapse
from altup_cupy._build import KERNELS_DIR, compile_offline
from altup_cupy._launch import SLOT_BYTES, ByValue
from altup_cupy.lab.check import oracle_bound
from altup_cupy.lab.workloads import (Workload, benchmark_workloads, collapse_inputs, gemma3n_workloads,
                                      tolerance_report)
from altup_cupy.ops import collapse_hopper as ch
from altup_cupy.ops.collapse_versions import VERSIONS
from altup_cupy.reference import collapse_reference

KERNEL_TEXT = (KERNELS_DIR / "collapse_gemm_sm90.cuh").read_text()
# fp32 unit roundoff with truncation (2^-23) times 2: a bound on |fp32 sum - exact sum| / sum |terms|
# per K term that holds for any summation order.
FP32_BOUND_PER_TERM = 2.0 ** -22
# Row statistics (a sum of 256 fp32 squares): a wrong row, column or tile is off by O(1).
STATS_REL_TOLERANCE = 1e-4


# ---- mirrors of the kernel ---------------------------------------------------------------------

def decode_unit(plan: ch.GemmPlan, unit: int) -> tuple[int, int, int, int, int, int]:
    """decode_unit of collapse_gemm_sm90.cuh: (projection, row tile, col tile, split, k_begin, k_end)."""
    split = unit % plan.splits
    rest = unit // plan.splits
    col = rest % plan.col_tiles
    rest //= plan.col_tiles
    row, projection = rest % plan.row_tiles, rest // plan.row_tiles
    k_begin = split * plan.k_blocks_per_split
    return projection, row, col, split, k_begin, min(plan.k_blocks, k_begin + plan.k_blocks_per_split)


def accumulator_cells(warp: int, lane: int) -> list[tuple[int, int, int]]:
    """(register, row, column) of one consumer thread's 128 accumulators, as the store loop
    of collapse_v2.cu reads them (row within the consumer's 64, column within the 256)."""
    cells = []
    for j in range(ch.BLOCK_N // 8):
        row, col = 16 * warp + lane // 4, 8 * j + 2 * (lane % 4)
        cells += [(4 * j, row, col), (4 * j + 1, row, col + 1), (4 * j + 2, row + 8, col),
                  (4 * j + 3, row + 8, col + 1)]
    return cells


# ---- CPU tests -----------------------------------------------------------------------------------

def test_tile_constants_fit_the_kernel_design():
    """The tile comes from _sources (one home); what the kernel's structure requires of it."""
    assert ch.BLOCK_M == 64 * (ch.THREADS // 128 - 1)  # one m64 wgmma row block per consumer
    assert ch.BLOCK_N == 256  # wgmma.m64n256k16 covers a tile's columns in one instruction
    assert ch.BLOCK_K * 2 == 128  # a stage row is exactly one 128-byte swizzle row
    assert ch.SHARED_BYTES <= 227 * 1024
    assert "kThreads = kWarpgroupThreads * (1 + kConsumers)" in KERNEL_TEXT
    assert "kBarrierBytes = 2 * kStages * 8;" in KERNEL_TEXT  # SHARED_BYTES counts the same barriers


def test_every_gemm_mode_has_its_version_source():
    """Mode m of collapse_gemm_sm90 is instantiated by version m + 2's source, and only there."""
    for mode, source in enumerate(ch.SOURCES):
        assert source.filename == f"collapse_v{mode + 2}.cu"
        gemms = [e for e in source.name_expressions if e.startswith("collapse_gemm_sm90")]
        assert gemms == [f"collapse_gemm_sm90<{mode}>"], (source.filename, gemms)


# (size, alignment) of the field types CollapseGemmParams uses; TensorMap is CUtensorMap's
# 128 bytes, 64-byte aligned.
_C_TYPES = {"TensorMap": (128, 64), "long long": (8, 8), "int": (4, 4), "float": (4, 4), "pointer": (8, 8)}


def test_parameter_block_layout_matches_the_kernel():
    """The host's fields, packed as `struct` codes, sit at the offsets of the natural C layout of
    the struct as the kernel declares it, in the same order; the packed size is its sizeof."""
    size = re.search(r"sizeof\(CollapseGemmParams\) == (\d+)", KERNEL_TEXT)
    assert size and int(size.group(1)) == ch.PARAMS_BYTES
    fields = re.search(r"struct CollapseGemmParams \{(.*?)\};", KERNEL_TEXT, re.S).group(1)
    offset, largest, declared = 0, 1, {}
    for declaration in re.findall(r"^\s*([^/\n;]+);", fields, re.M):
        match = re.fullmatch(r"(.*?)\s*(\**)\s*(\w+)(?:\[(\w+)\])?", declaration.strip())
        ctype, stars, name, count = match.groups()
        ctype = "pointer" if stars else ctype.replace("const ", "").replace("unsigned ", "").strip()
        size_of, align = _C_TYPES[ctype]
        offset = -(-offset // align) * align
        declared[name] = offset
        offset += size_of * (ch.MAX_PROJECTIONS if count == "kMaxProjections" else 1)
        largest = max(largest, align)
    packed, at = {}, 0
    for name, code in ch.PARAM_FIELDS:
        packed[name] = at
        at += struct.calcsize("=" + code)
    assert list(packed) == list(declared) and packed == declared, "every field, in declaration order"
    assert -(-offset // largest) * largest == ch.PARAMS_BYTES == struct.calcsize("=" + ch.PARAMS.layout)


def test_parameter_block_packs_each_value_at_its_field():
    plan = ch.plan_gemm(613, 2056, 3, 132)
    x_maps, w_maps = bytes(range(1, 129)) * 2, bytes(range(11, 139)) * 3  # N = 3: two x maps
    values = (x_maps, w_maps, 0x7F0000001000, 0x7F0000002000, 613, 2056, 3, plan.row_tiles, plan.col_tiles,
              plan.k_blocks, plan.splits, plan.k_blocks_per_split, plan.units)
    packed = struct.pack("=" + ch.PARAMS.layout, *values)
    offsets = dict(zip((name for name, _ in ch.PARAM_FIELDS),
                       (struct.calcsize("=" + "".join(c for _, c in ch.PARAM_FIELDS[:i]))
                        for i in range(len(ch.PARAM_FIELDS)))))
    assert packed[:256] == x_maps and not any(packed[256:384])  # the unused map slot stays zeros
    assert packed[384:768] == w_maps
    assert struct.unpack_from("<QQq", packed, offsets["out"]) == (0x7F0000001000, 0x7F0000002000, 613)
    assert struct.unpack_from("<8i", packed, offsets["hidden"]) == (
        2056, 3, plan.row_tiles, plan.col_tiles, plan.k_blocks, plan.splits, plan.k_blocks_per_split, plan.units)
    assert not any(packed[offsets["units"] + 4:])
    assert isinstance(ch.PARAMS, ByValue) and ch.PARAMS_BYTES % SLOT_BYTES == 0


PLAN_SHAPES = [(m, h, p) for m in (1, 7, 64, 65, 127, 128, 129, 131, 256, 613, 2048, 8192, 17312)
               for h in (8, 1000, 2048, 2056, 2560, 3072) for p in (1, 2, 3)]


@pytest.mark.parametrize("rows,hidden,projections", PLAN_SHAPES)
def test_plan_covers_every_output_and_k_block_once(rows, hidden, projections):
    sms = 132
    plan = ch.plan_gemm(rows, hidden, projections, sms)
    assert (plan.row_tiles - 1) * ch.BLOCK_M < rows <= plan.row_tiles * ch.BLOCK_M
    assert (plan.col_tiles - 1) * ch.BLOCK_N < hidden <= plan.col_tiles * ch.BLOCK_N
    assert (plan.k_blocks - 1) * ch.BLOCK_K < hidden <= plan.k_blocks * ch.BLOCK_K
    assert plan.units == projections * plan.row_tiles * plan.col_tiles * plan.splits
    assert 1 <= plan.grid <= min(plan.units, sms)
    # Every (projection, row tile, column tile) gets each K block exactly once over its splits,
    # and no split is empty.
    seen = {}
    for unit in range(plan.units):
        projection, row, col, split, k_begin, k_end = decode_unit(plan, unit)
        assert 0 <= projection < projections and 0 <= row < plan.row_tiles and 0 <= col < plan.col_tiles
        assert k_begin < k_end <= plan.k_blocks
        seen.setdefault((projection, row, col), []).append((split, k_begin, k_end))
    assert len(seen) == projections * plan.row_tiles * plan.col_tiles
    for ranges in seen.values():
        ranges.sort()
        assert [s for s, _, _ in ranges] == list(range(plan.splits))
        assert ranges[0][1] == 0 and ranges[-1][2] == plan.k_blocks
        assert all(a[2] == b[1] for a, b in zip(ranges, ranges[1:]))
    # The persistent grid: CTA b takes units b, b + grid, ...; every unit exactly once.
    taken = sorted(u for b in range(plan.grid) for u in range(b, plan.units, plan.grid))
    assert taken == list(range(plan.units))


@pytest.mark.parametrize("w", benchmark_workloads("collapse") + gemma3n_workloads("collapse"),
                         ids=lambda w: w.label)
def test_small_m_plans_fill_the_gpu(w):
    """Weight-bandwidth-bound shapes (M <= 613) keep at least 70% of 132 SMs streaming."""
    plan = ch.plan_gemm(w.tokens, w.hidden, w.streams - 1, 132)
    if w.tokens <= 613:
        assert plan.grid >= 0.7 * 132, plan
    else:
        assert plan.splits == 1 or plan.units <= 132, plan


def test_plan_without_k_splits():
    """v3's row statistics need whole rows of K: its plans never split."""
    for rows in (1, 128, 613, 8192):
        plan = ch.plan_gemm(rows, 3072, 2, 132, split_k=False)
        assert plan.splits == 1 and plan.k_blocks_per_split == plan.k_blocks == 48


def test_plan_rejects_bad_shapes():
    for kwargs in (dict(rows=0, hidden=8, projections=1, sms=1), dict(rows=1, hidden=12, projections=1, sms=1),
                   dict(rows=1, hidden=8, projections=4, sms=1), dict(rows=1, hidden=8, projections=1, sms=0)):
        with pytest.raises(ValueError, match="plan_gemm needs"):
            ch.plan_gemm(**kwargs)


def test_accumulator_layout_covers_the_tile_once():
    """The 128 consumer threads' accumulators map onto the 64 x 256 tile one-to-one, and every
    8-column chunk j is held entirely by registers 4j..4j+3 (the store's column guard)."""
    cells = {}
    for warp in range(4):
        for lane in range(32):
            for register, row, col in accumulator_cells(warp, lane):
                assert (row, col) not in cells
                cells[(row, col)] = register
                assert register // 4 == col // 8
    assert set(cells) == {(r, c) for r in range(64) for c in range(ch.BLOCK_N)}


def test_tensor_map_specs():
    x = ch.tensor_map_spec(613, 2056, ch.BLOCK_M)
    assert x.global_dim == (2056, 613) and x.global_strides == (4112,)
    assert x.box_dim == (ch.BLOCK_K, ch.BLOCK_M) and x.element_strides == (1, 1)
    w = ch.tensor_map_spec(2056, 2056, ch.BLOCK_N)
    assert w.box_dim == (ch.BLOCK_K, ch.BLOCK_N)
    # The kernel's expected transaction bytes are the two full boxes (zero-filled parts count).
    assert 2 * (x.box_dim[0] * x.box_dim[1] + w.box_dim[0] * w.box_dim[1]) == (
        ch.BLOCK_M + ch.BLOCK_N) * ch.BLOCK_K * 2
    for spec in (x, w):
        assert all(s % 16 == 0 for s in spec.global_strides)
        assert spec.box_dim[0] * 2 == 128 and spec.box_dim[1] <= 256
    with pytest.raises(ValueError, match="cols divisible by 8"):
        ch.tensor_map_spec(4, 12, 128)
    with pytest.raises(ValueError, match="1..256 rows"):
        ch.tensor_map_spec(4, 8, 512)


def test_tensor_map_encoder_passes_the_bindings_argument_checks():
    """Without a driver the call fails in the driver's loader, not on argument types; with one,
    encoding needs no allocation at the address (it is not dereferenced)."""
    encode = ch.TensorMapEncoder(ch.tensor_map_spec(613, 3072, ch.BLOCK_M))
    try:
        encoded = encode(1 << 40)
    except TypeError as error:
        pytest.fail(f"cuda-bindings rejected the arguments: {error}")
    except Exception as error:  # no NVIDIA driver on this machine
        assert "cuda" in str(error).lower(), error
    else:
        assert len(encoded) == ch.TENSOR_MAP_BYTES and any(encoded)


def test_compiles_for_sm90a_without_spills_or_stack():
    for source in ch.SOURCES:
        build = compile_offline(source, "sm_90a")
        kernels = {k.name: k for k in build.kernels}
        assert len(kernels) == len(source.name_expressions), build.log
        for k in kernels.values():
            assert (k.stack_frame_bytes, k.spill_store_bytes, k.spill_load_bytes) == (0, 0, 0), (k, build.log)
        gemm = [k for name, k in kernels.items() if "collapse_gemm_sm90" in name]
        assert len(gemm) == 1 and gemm[0].registers <= 65536 // ch.THREADS
        # C7508: setmaxnreg ignored; C7518/C7510: wgmma serialized. Either would cost the design.
        assert not re.search(r"C75(08|10|18)", build.log), build.log
        assert "sm_90a" in build.log


# ---- the GPU checks (also run on the CPU against stand-ins) --------------------------------------

def _randn(shape, generator, device):
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(torch.bfloat16)


def _rel_l2(out, ref) -> float:
    return (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)).item()


def _cublas_rel_l2(x, w, ref) -> float:
    """cuBLAS' error on the same product (0 where torch has no torch.mm(..., out_dtype=) for it)."""
    try:
        return _rel_l2(torch.mm(x, w.T, out_dtype=torch.float32), ref)
    except (TypeError, NotImplementedError):
        return 0.0


def check_gemm(project, streams: int, rows: int, hidden: int, seed: int, stacked: bool, stats: bool,
               device: str) -> str:
    """The projections `project(hidden_states, weights, y, row_sumsq)` computes (row_sumsq None
    without `stats`; weights [the stacked tensor] or the N-1 matrices; returns its GemmPlan),
    against float64 on fresh inputs; every output poisoned (NaN) first. Returns what failed ("" if
    nothing): an element outside the rigorous fp32 summation bound K * 2^-22 * (|x| @ |w|^T); a
    relative L2 error over twice the worse of fp32 torch and cuBLAS' bf16 GEMM with fp32 output;
    row statistics off; two runs not bitwise equal; inputs changed."""
    g = torch.Generator(device=device).manual_seed(seed)
    hs = _randn((streams, rows, hidden), g, device)
    w = _randn((streams - 1, hidden, hidden), g, device)
    weights = [w] if stacked else [w[k].clone() for k in range(streams - 1)]
    hs_before, w_before = hs.clone(), w.clone()
    col_tiles = -(-hidden // ch.BLOCK_N)
    runs = []
    for _ in range(2):
        y = torch.full((streams - 1, rows, hidden), float("nan"), dtype=torch.float32, device=device)
        sumsq = torch.full((streams - 1, rows, col_tiles), float("nan"), dtype=torch.float32,
                           device=device) if stats else None
        plan = project(hs, weights, y, sumsq)
        runs.append((y, y if sumsq is None else sumsq))
    (y, sumsq), (y_again, sumsq_again) = runs
    failed = []
    if not (torch.equal(y, y_again) and torch.equal(sumsq, sumsq_again)):
        failed.append("not deterministic")
    if not (torch.equal(hs, hs_before) and all(torch.equal(m, m0) for m, m0 in
                                               zip(weights if not stacked else w, w_before))):
        failed.append("inputs changed")
    if not (torch.isfinite(y).all() and torch.isfinite(sumsq).all()):
        failed.append("non-finite outputs")
    worst_ratio = rel = oracle = stats_rel = 0.0
    for k in range(streams - 1):
        x64, w64 = hs[k + 1].double(), w[k].double()
        ref = x64 @ w64.T
        bound = hidden * FP32_BOUND_PER_TERM * (x64.abs() @ w64.abs().T)
        worst_ratio = max(worst_ratio, ((y[k].double() - ref).abs() / bound).max().item())
        rel = max(rel, _rel_l2(y[k], ref))
        oracle = max(oracle, _rel_l2(hs[k + 1].float() @ w[k].float().T, ref), _cublas_rel_l2(hs[k + 1], w[k], ref))
        if stats:
            padded = torch.nn.functional.pad(ref.square(), (0, col_tiles * ch.BLOCK_N - hidden))
            ref_sumsq = padded.view(rows, col_tiles, ch.BLOCK_N).sum(-1)
            stats_rel = max(stats_rel, ((sumsq[k].double() - ref_sumsq).abs() / ref_sumsq).max().item())
    if not worst_ratio <= 1.0:
        failed.append(f"outside the fp32 bound (ratio {worst_ratio:.3f})")
    if not rel <= oracle_bound(oracle):
        failed.append(f"rel_l2 {rel:.2e} over twice fp32's {oracle:.2e}")
    if not stats_rel <= STATS_REL_TOLERANCE:
        failed.append(f"row statistics off by {stats_rel:.1e}")
    return "; ".join(failed) + (f" (splits {plan.splits}, grid {plan.grid})" if failed else "")


def check_collapse(collapse_fn, w: Workload, seed: int, stacked: bool, device: str) -> str:
    """`collapse_fn(hidden_states, weights, eps)` on one workload's fresh inputs, the caching
    allocator's free blocks poisoned with NaN first: the benchmark's rule and the 2x-fp32 oracle
    against float64, two runs bitwise equal, inputs unchanged. Returns what failed ("" if nothing)."""
    inputs = collapse_inputs(w, seed, device=device)
    hs, ws, eps = inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"]
    weights = ws if stacked else [ws[k].clone() for k in range(w.streams - 1)]
    hs_before = hs.clone()
    outs = []
    for _ in range(2):
        # Freed blocks of NaN: the caching allocator hands them to the next allocations.
        poison = torch.full(((w.streams + 1) * w.tokens * w.hidden,), float("nan"), device=device)
        del poison
        outs.append(collapse_fn(hs, weights, eps))
    ref = collapse_reference(hs, ws, eps)
    report = tolerance_report(outs[0], ref, w.atol, w.rtol)
    oracle = tolerance_report(collapse_reference(hs, ws, eps, torch.float32).to(torch.bfloat16), ref,
                              w.atol, w.rtol).rel_l2
    failed = []
    if not report.passed:
        failed.append(f"benchmark rule: {report}")
    if not report.rel_l2 <= oracle_bound(oracle):
        failed.append(f"rel_l2 {report.rel_l2:.2e} over twice fp32's {oracle:.2e}")
    if not torch.equal(outs[0], outs[1]):
        failed.append("not deterministic")
    if not torch.equal(hs, hs_before):
        failed.append("inputs changed")
    return "; ".join(failed)


def _gemm_stand_in(error: str | None):
    """The projections in fp32 torch; `error` plants one defect of the kind a kernel could have."""
    def project(hidden_states, weights, y, row_sumsq):
        mats = weights[0] if weights[0].dim() == 3 else weights
        for k in range(y.shape[0]):
            product = hidden_states[k + 1].float() @ mats[k].float().T
            if error == "swapped_columns":
                product = product.roll(8, dims=-1)
            if error == "one_nan":
                product[0, 0] = float("nan")
            y[k] = product
        if row_sumsq is not None:
            tiles = row_sumsq.shape[-1]
            padded = torch.nn.functional.pad(y.square(), (0, tiles * ch.BLOCK_N - y.shape[-1]))
            row_sumsq.copy_(padded.view(*y.shape[:2], tiles, ch.BLOCK_N).sum(-1))
            if error == "stats_off":
                row_sumsq[..., -1] *= 1.01
        return ch.plan_gemm(y.shape[1], y.shape[2], y.shape[0], 132, split_k=row_sumsq is None)
    return project


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("error", [None, "swapped_columns", "one_nan", "stats_off"])
def test_gemm_check_passes_exact_and_fails_planted_errors(stats, error, stacked, seeds):
    failed = check_gemm(_gemm_stand_in(error), 3, 9, 264, seeds(), stacked, stats, "cpu")
    catches = error is not None and not (error == "stats_off" and not stats)
    assert bool(failed) is catches, failed


@pytest.mark.parametrize("error", [None, "unscaled", "nan"])
def test_collapse_check_passes_the_reference_and_fails_planted_errors(error, seeds):
    def stand_in(hidden_states, weights, eps):
        out = collapse_reference(hidden_states, weights, eps, torch.float32)
        if error == "unscaled":
            out = out * 1.2
        if error == "nan":
            out[0, 0, 0] = float("nan")
        return out.to(torch.bfloat16)

    workload = Workload("collapse", 3, 264, 2, 5, 1e-5, 0.05, 1e-5)
    failed = check_collapse(stand_in, workload, seeds(), True, "cpu")
    assert bool(failed) is (error is not None), failed


# ---- GPU tests -----------------------------------------------------------------------------------


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _gpu_gemm(version: int, streams: int, rows: int, hidden: int, stacked: bool):
    """The GEMM of `version`'s plan for this shape, as check_gemm calls it."""
    plan = ch.plan(version, streams, rows, hidden, stacked, torch.cuda.current_device())

    def project(hidden_states, weights, y, row_sumsq):
        plan.project(hidden_states, weights, y, row_sumsq, torch.cuda.current_stream().cuda_stream,
                     reuse_scratch=False)
        torch.cuda.synchronize()
        return plan.tiles
    return project


# Every N at H a multiple of the column tile (3072) and not (1000, 2056); M from one row to many
# row tiles (small M splits K in v2's GEMM); stacked and listed weights alternate.
GEMM_SHAPES = [(n, m, h, (m + n) % 2 == 0) for n in (2, 3, 4) for h in (1000, 2056, 3072)
               for m in (1, 7, 128, 613, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("stats", [False, True], ids=["v2", "v3"])
@pytest.mark.parametrize("streams,rows,hidden,stacked", GEMM_SHAPES,
                         ids=[f"N{n}-M{m}-H{h}-{'stacked' if s else 'list'}" for n, m, h, s in GEMM_SHAPES])
def test_gemm_matches_float64(streams, rows, hidden, stacked, stats, seeds):
    if not _hopper():
        pytest.skip("collapse v2 and v3 need a Hopper GPU (compute capability 9.0)")
    if stats and not ch.uses_row_statistics(rows, hidden, streams, torch.cuda.current_device()):
        pytest.skip("v3 runs v2's GEMM at this shape (K split)")
    failed = check_gemm(_gpu_gemm(3 if stats else 2, streams, rows, hidden, stacked), streams, rows, hidden,
                        seeds(), stacked, stats, "cuda")
    assert not failed, failed


def odd_workloads() -> list[Workload]:
    """N = 2..4 at H not a multiple of the tiles, M from 1 to 8192 (benchmark tolerance)."""
    base = benchmark_workloads("collapse")[0]
    return [Workload("collapse", n, h, 1, m, base.atol, base.rtol, base.eps)
            for n, h, m in ((2, 1000, 7), (3, 2056, 613), (4, 1000, 8192), (4, 2056, 1), (2, 3072, 128))]


OP_WORKLOADS = benchmark_workloads("collapse") + gemma3n_workloads("collapse") + odd_workloads()
# Every version the registry runs on Hopper only (v1 is tests/test_collapse.py's).
HOPPER_VERSIONS = [n for n, v in VERSIONS.items() if v.min_compute_capability == 90]


@pytest.mark.gpu
@pytest.mark.parametrize("version", HOPPER_VERSIONS)
@pytest.mark.parametrize("index", range(len(OP_WORKLOADS)), ids=[w.label for w in OP_WORKLOADS])
def test_collapse_benchmark_rule_and_oracle(index, version, seeds):
    if not _hopper():
        pytest.skip("collapse v2 and v3 need a Hopper GPU (compute capability 9.0)")

    def run(hidden_states, weights, eps):
        out = collapse(hidden_states, weights, eps, version=version)
        torch.cuda.synchronize()
        return out

    failed = check_collapse(run, OP_WORKLOADS[index], seeds(), index % 3 != 2, "cuda")
    assert not failed, failed
