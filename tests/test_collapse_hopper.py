"""The Hopper collapse (altup_cupy.ops.collapse_hopper, kernels/collapse_v2.cu).

CPU: the host plan, the work-unit schedule and the accumulator layout (Python mirrors of the
kernel's index arithmetic), tensor-map arguments, the parameter block's layout against the
kernel's static_asserts, argument validation, and an NVRTC sm_90a build with no spills and no
stack. GPU (Hopper only): launch_v2 and collapse_v2 against float64, by the checks of
scripts/check_collapse_hopper.py.
"""

from __future__ import annotations

import importlib.util
import re
import struct
from pathlib import Path

import pytest
import torch

from altup_cupy._build import KERNELS_DIR, compile_offline
from altup_cupy.ops import collapse_hopper as ch
from altup_cupy.lab.workloads import benchmark_workloads, gemma3n_workloads

KERNEL_TEXT = (KERNELS_DIR / ch.SOURCE.filename).read_text()
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_collapse_hopper.py"


# ---- mirrors of the kernel ---------------------------------------------------------------------

def decode_unit(plan: ch.GemmPlan, unit: int, fused: bool = False) -> tuple[int, int, int, int, int, int]:
    """decode_unit<MODE> of collapse_v2.cu: (projection, row tile, col tile, split, k_begin, k_end)."""
    split = unit % plan.splits
    rest = unit // plan.splits
    col = rest % plan.col_tiles
    rest //= plan.col_tiles
    if fused:
        projection, row = rest % plan.projections, rest // plan.projections
    else:
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
    flag = re.search(r"kBarrierBytes = 2 \* kStages \* 8 \+ (\d+);", KERNEL_TEXT)
    assert flag and int(flag.group(1)) == 16


# (size, alignment) of the field types CollapseGemmParams uses; TensorMap is CUtensorMap's
# 128 bytes, 64-byte aligned.
_C_TYPES = {"TensorMap": (128, 64), "long long": (8, 8), "int": (4, 4), "float": (4, 4), "pointer": (8, 8)}


def test_parameter_block_layout_matches_the_kernel():
    """The host's offsets are the natural C layout of the struct as the kernel declares it."""
    size = re.search(r"sizeof\(CollapseGemmParams\) == (\d+)", KERNEL_TEXT)
    assert size and int(size.group(1)) == ch.PARAMS_BYTES
    fields = re.search(r"struct CollapseGemmParams \{(.*?)\};", KERNEL_TEXT, re.S).group(1)
    offset, largest, computed = 0, 1, {}
    for declaration in re.findall(r"^\s*([^/\n;]+);", fields, re.M):
        match = re.fullmatch(r"(.*?)\s*(\**)\s*(\w+)(?:\[(\w+)\])?", declaration.strip())
        ctype, stars, name, count = match.groups()
        ctype = "pointer" if stars else ctype.replace("const ", "").replace("unsigned ", "").strip()
        size_of, align = _C_TYPES[ctype]
        offset = -(-offset // align) * align
        computed[name] = offset
        offset += size_of * (ch.MAX_PROJECTIONS if count == "kMaxProjections" else 1)
        largest = max(largest, align)
    assert computed == ch.PARAM_OFFSETS, "every field is pinned, in declaration order"
    assert -(-offset // largest) * largest == ch.PARAMS_BYTES


def test_pack_params_round_trip():
    plan = ch.plan_gemm(613, 2056, 3, 132)
    x_maps = [bytes([k + 1]) * 128 for k in range(3)]
    w_maps = [bytes([k + 11]) * 128 for k in range(3)]
    packed = ch.pack_params(x_maps, w_maps, 0x7F0000001000, 0x7F0000002000, plan)
    assert len(packed) == ch.PARAMS_BYTES
    for k in range(3):
        assert packed[128 * k:128 * (k + 1)] == x_maps[k]
        assert packed[384 + 128 * k:384 + 128 * (k + 1)] == w_maps[k]
    out, sumsq, rows = struct.unpack_from("<QQq", packed, ch.PARAM_OFFSETS["out"])
    assert (out, sumsq, rows) == (0x7F0000001000, 0x7F0000002000, 613)
    ints = struct.unpack_from("<8i", packed, ch.PARAM_OFFSETS["hidden"])
    assert ints == (2056, 3, plan.row_tiles, plan.col_tiles, plan.k_blocks, plan.splits,
                    plan.k_blocks_per_split, plan.units)
    assert not any(packed[ch.PARAM_OFFSETS["units"] + 4:])  # no fused epilogue: zeros
    fused = ch.FusedEpilogue(0x7F0000003000, 0x7F0000004000, 0x7F0000005000, 1e-5)
    packed = ch.pack_params(x_maps, w_maps, 0x7F0000001000, 0x7F0000002000, plan, fused)
    assert struct.unpack_from("<QQQf", packed, ch.PARAM_OFFSETS["stream0"]) == (
        0x7F0000003000, 0x7F0000004000, 0x7F0000005000, struct.unpack("<f", struct.pack("<f", 1e-5))[0])
    assert struct.unpack_from("<i", packed, ch.PARAM_OFFSETS["units"]) == (plan.units,)
    assert not any(packed[ch.PARAM_OFFSETS["eps"] + 4:])
    two = ch.plan_gemm(5, 8, 1, 4)
    packed = ch.pack_params(x_maps[:1], w_maps[:1], 1, 0, two)
    assert not any(packed[128:384]) and not any(packed[512:768])  # unused map slots are zeros
    with pytest.raises(ValueError, match="tensor maps"):
        ch.pack_params(x_maps[:2], w_maps, 1, 0, plan)


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


@pytest.mark.parametrize("rows,hidden,projections", [(613, 3072, 2), (7184, 1000, 3), (8192, 2056, 1)])
def test_fused_order_finishes_row_blocks_in_sequence(rows, hidden, projections):
    """kFused: every (projection, column tile) of a row block exactly once, the row block's units
    consecutive (so they run in the same wave), and the count the kernel waits for matches."""
    plan = ch.plan_gemm(rows, hidden, projections, 132, split_k=False)
    per_block = projections * plan.col_tiles
    for row_tile in range(plan.row_tiles):
        units = range(row_tile * per_block, (row_tile + 1) * per_block)
        decoded = [decode_unit(plan, u, fused=True) for u in units]
        assert {d[1] for d in decoded} == {row_tile}
        assert sorted((d[0], d[2]) for d in decoded) == [
            (p, c) for p in range(projections) for c in range(plan.col_tiles)]
        assert all(d[4:] == (0, plan.k_blocks) for d in decoded)
    assert plan.units == plan.row_tiles * per_block


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


def test_encode_tensor_map_passes_the_bindings_argument_checks():
    """Without a driver the call fails in the driver's loader, not on argument types; with one,
    encoding needs no allocation at the address (it is not dereferenced)."""
    try:
        encoded = ch.encode_tensor_map(1 << 40, ch.tensor_map_spec(613, 3072, ch.BLOCK_M))
    except TypeError as error:
        pytest.fail(f"cuda-bindings rejected the arguments: {error}")
    except Exception as error:  # no NVIDIA driver on this machine
        assert "cuda" in str(error).lower(), error
    else:
        assert len(encoded) == ch.TENSOR_MAP_BYTES and any(encoded)
    with pytest.raises(ValueError, match="16-byte aligned"):
        ch.encode_tensor_map((1 << 40) + 8, ch.tensor_map_spec(4, 8, 4))


def test_launcher_validation_on_cpu_tensors():
    hs = torch.zeros((3, 2, 4, 16), dtype=torch.bfloat16)
    w = torch.zeros((2, 16, 16), dtype=torch.bfloat16)
    y = torch.zeros((2, 2, 4, 16), dtype=torch.float32)
    with pytest.raises(ValueError, match="expected a CUDA device"):
        ch.launch_v2(hs, w, y, 0)
    with pytest.raises(TypeError, match="dtype bfloat16"):
        ch.launch_v2(hs.float(), w, y, 0)
    with pytest.raises(ValueError, match="divisible by 8"):
        ch.launch_v2(torch.zeros((3, 2, 4, 12), dtype=torch.bfloat16), w, y, 0)
    with pytest.raises(ValueError, match="N-1 = 2 matrices"):
        ch.launch_v2(hs, [w[0]], y, 0)
    with pytest.raises(ValueError, match=r"\[N, B, S, H\] or \[N, M, H\]"):
        ch.launch_v2(hs[0, 0], w, y, 0)
    with pytest.raises(TypeError, match="torch CUDA tensor"):
        ch.launch_v2([1, 2], w, y, 0)
    with pytest.raises(ValueError, match="streams"):
        ch.collapse_v2(torch.zeros((5, 1, 1, 8), dtype=torch.bfloat16), w, 1e-5)


def test_compiles_for_sm90a_without_spills_or_stack():
    build = compile_offline(ch.SOURCE, "sm_90a")
    kernels = {k.name: k for k in build.kernels}
    assert len(kernels) == len(ch.SOURCE.name_expressions), build.log
    for k in kernels.values():
        assert (k.stack_frame_bytes, k.spill_store_bytes, k.spill_load_bytes) == (0, 0, 0), (k, build.log)
    gemm = [k for name, k in kernels.items() if "collapse_gemm_sm90" in name]
    assert gemm and all(k.registers <= 65536 // ch.THREADS for k in gemm)
    # C7508: setmaxnreg ignored; C7518/C7510: wgmma serialized. Either would cost the design.
    assert not re.search(r"C75(08|10|18)", build.log), build.log
    assert "sm_90a" in build.log


def _script():
    spec = importlib.util.spec_from_file_location("check_collapse_hopper", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the GPU script's checkers, run on the CPU against stand-ins ---------------------------------

def _gemm_stand_in(error: str | None):
    """launch_v2/launch_v3 in fp32 torch; `error` plants one defect of the kind a kernel could have."""
    def launch(hidden_states, weights, out_y, *rest):
        stream = rest[-1]
        assert stream == 0
        for k in range(out_y.shape[0]):
            y = hidden_states[k + 1].float() @ weights[k].float().T
            if error == "swapped_columns":
                y = y.roll(8, dims=-1)
            if error == "one_nan":
                y[0, 0] = float("nan")
            out_y[k] = y
        if len(rest) == 2:  # launch_v3: out_row_sumsq
            sumsq = rest[0]
            tiles = sumsq.shape[-1]
            padded = torch.nn.functional.pad(out_y.square(), (0, tiles * ch.BLOCK_N - out_y.shape[-1]))
            sumsq.copy_(padded.view(*out_y.shape[:2], tiles, ch.BLOCK_N).sum(-1))
            if error == "stats_off":
                sumsq[..., -1] *= 1.01
        plan = ch.plan_gemm(out_y.shape[1], out_y.shape[2], out_y.shape[0], 132, split_k=len(rest) == 1)
        return plan
    return launch


@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("error", [None, "swapped_columns", "one_nan", "stats_off"])
def test_gemm_checker_passes_exact_and_fails_planted_errors(monkeypatch, stats, error, seeds):
    script = _script()
    monkeypatch.setattr(script, "DEVICE", "cpu")
    monkeypatch.setattr(ch, "launch_v3" if stats else "launch_v2", _gemm_stand_in(error))
    result = script.check_gemm(3, 9, 264, seeds(), stacked=False, stats=stats)
    expected = error is None or (error == "stats_off" and not stats)
    assert result["passed"] is expected, result


@pytest.mark.parametrize("error", [None, "unscaled", "nan"])
def test_collapse_checker_passes_reference_and_fails_planted_errors(monkeypatch, error, seeds):
    from altup_cupy.reference import collapse_reference
    from altup_cupy.lab.workloads import Workload

    def stand_in(hidden_states, weights, eps):
        out = collapse_reference(hidden_states, weights, eps, torch.float32)
        if error == "unscaled":
            out = out * 1.2
        if error == "nan":
            out[0, 0, 0] = float("nan")
        return out.to(torch.bfloat16)

    script = _script()
    monkeypatch.setattr(script, "DEVICE", "cpu")
    monkeypatch.setitem(script.VERSIONS, "collapse_v3", stand_in)
    workload = Workload("collapse", 3, 264, 2, 5, 1e-5, 0.05, 1e-5)
    result = script.check_collapse(workload, seeds(), stacked=True, version="collapse_v3")
    assert result["passed"] is (error is None), result


# ---- GPU tests -----------------------------------------------------------------------------------


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# v2's GEMM at every size (small M splits K); v3's statistics GEMM where the op runs it, which is
# only where K is not split (at small M, v3 is v2: `uses_row_statistics`).
GEMM_SHAPES = [(3, 1, 3072, True), (2, 131, 1000, False), (4, 613, 2056, True), (3, 2048, 3072, False)]
STATS_GEMM_SHAPES = [(4, 613, 2056, True), (3, 2048, 3072, False), (2, 2300, 1000, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("stats,streams,rows,hidden,stacked",
                         [(False, *shape) for shape in GEMM_SHAPES] + [(True, *shape) for shape in STATS_GEMM_SHAPES],
                         ids=[f"v2-{s}" for s in GEMM_SHAPES] + [f"v3-{s}" for s in STATS_GEMM_SHAPES])
def test_gemm_matches_float64(streams, rows, hidden, stacked, stats, seeds):
    if not _hopper():
        pytest.skip("collapse v2/v3 need a Hopper GPU (compute capability 9.0)")
    if stats:  # the shape is one the op hands to the statistics GEMM
        assert ch.uses_row_statistics(rows, hidden, streams, torch.cuda.current_device())
    result = _script().check_gemm(streams, rows, hidden, seeds(), stacked, stats=stats)
    assert result["passed"], result


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["collapse_v2", "collapse_v3", "collapse_v4"])
@pytest.mark.parametrize("index", [0, 2, 3, 9, 12, 15])
def test_collapse_benchmark_rule_and_oracle(index, version, seeds):
    if not _hopper():
        pytest.skip("collapse v2-v4 need a Hopper GPU (compute capability 9.0)")
    workload = benchmark_workloads("collapse")[index]
    result = _script().check_collapse(workload, seeds(), stacked=index % 2 == 0, version=version)
    assert result["passed"], result
