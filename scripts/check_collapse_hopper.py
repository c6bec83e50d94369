#!/usr/bin/env python
"""Check and time the Hopper collapse (altup_cupy.ops.collapse_hopper) on this GPU.

    python scripts/check_collapse_hopper.py --out results/h200/check_collapse_hopper.csv

Needs a Hopper GPU (compute capability 9.0), torch with CUDA, CuPy and cuda-bindings.
1. Builds every kernel and prints ptxas' report.
2. GEMM (launch_v2; launch_v3 with its row statistics) against float64 on fresh random inputs:
   N = 2, 3, 4; odd H (1000, 2056) and 3072; M = 1, 7, 128, 613, 8192; weights stacked and as a list. Each output is poisoned (NaN)
   first; every element must lie within the rigorous fp32 summation bound K * 2^-22 * (|x| @ |w|^T);
   the relative L2 error may be at most twice that of the worse of fp32 torch and cuBLAS' bf16
   GEMM with fp32 output (torch.mm(..., out_dtype=torch.float32)) on the same inputs; two runs
   must agree bitwise; the inputs must be left unchanged.
3. The full op (collapse_v2, v3, v4) on the 16 benchmark workloads, Gemma 3n's shapes and
   odd shapes: the benchmark rule and the 2x-fp32 oracle (altup_cupy.lab.check), allocator poisoned with NaN,
   bitwise determinism over two runs.
4. Times, L2 flushed, CUDA events, median (altup_cupy.lab.bench.time_us): v2's GEMM against
   torch.mm(x, w.T, out_dtype=torch.float32) per stream, and collapse_v2/v3/v4 against
   altup_cupy.collapse. v4 is checked and timed last (after the CSV of the rest is written), and a
   version whose checks fail is not timed.
Prints a table, writes the CSV, exits 1 on any failure (3 if a kernel hangs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from altup_cupy import collapse as collapse_current
from altup_cupy.lab.bench import run_info, sol_us, time_us, write_csv
from altup_cupy.lab.benchmarks.collapse import COLLAPSE
from altup_cupy.lab.check import ORACLE_FACTOR, ORACLE_FLOOR
from altup_cupy.ops import collapse_hopper
from altup_cupy.reference import collapse_reference
from altup_cupy.lab.workloads import (Workload, benchmark_workloads, collapse_inputs, gemma3n_workloads,
                                  tolerance_report)

GEMM_STREAMS = (2, 3, 4)
GEMM_HIDDEN = (1000, 2056, 3072)
GEMM_ROWS = (1, 7, 128, 613, 8192)
# fp32 unit roundoff with truncation (2^-23) times 2: a bound on |fp32 sum - exact sum| / sum |terms|
# per K term that holds for any summation order.
FP32_BOUND_PER_TERM = 2.0 ** -22
HANG_LIMIT_S = 60.0
# Where the checks allocate; tests/test_collapse_hopper.py runs the checkers themselves on the CPU
# against stand-in implementations.
DEVICE = "cuda"
# Row statistics (a sum of 256 fp32 squares): a wrong row, column or tile is off by O(1).
STATS_REL_TOLERANCE = 1e-4
TIMED = ("torch_mm_fp32out", "v2_gemm", "altup_cupy_collapse", "collapse_v2", "collapse_v3", "collapse_v4")
VERSIONS = {"collapse_v2": collapse_hopper.collapse_v2, "collapse_v3": collapse_hopper.collapse_v3,
            "collapse_v4": collapse_hopper.collapse_v4}
# v4 (a counter per row block, the normalisation inside the GEMM) is checked and timed after
# everything else has been measured and written, so that a failure there loses nothing else.
STAGES = (("torch_mm_fp32out", "v2_gemm", "altup_cupy_collapse", "collapse_v2", "collapse_v3"), ("collapse_v4",))


def _finish(what: str, limit_s: float = HANG_LIMIT_S) -> None:
    """Wait for the GPU's queued work; a kernel that has not finished after `limit_s` is reported
    as hung and the process exits (a hung kernel never returns control to Python otherwise)."""
    if DEVICE == "cpu":
        return
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + limit_s
    while not done.query():
        if time.monotonic() > deadline:
            print(f"HUNG: {what} did not finish within {limit_s:.0f} s", flush=True)
            os._exit(3)
        time.sleep(0.001)


def _randn(shape, generator):
    return torch.randn(shape, generator=generator, device=DEVICE, dtype=torch.float32).to(torch.bfloat16)


def _rel_l2(out, ref) -> float:
    return (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)).item()


def _cublas_rel_l2(x, w, ref) -> float:
    """cuBLAS' error on the same product (0 where torch has no torch.mm(..., out_dtype=) for it)."""
    try:
        return _rel_l2(torch.mm(x, w.T, out_dtype=torch.float32), ref)
    except (TypeError, NotImplementedError):
        return 0.0


def check_gemm(streams: int, rows: int, hidden: int, seed: int, stacked: bool, stats: bool = False) -> dict:
    """One launch_v2 (or, with `stats`, launch_v3) shape against float64; returns a result row."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    hs = _randn((streams, rows, hidden), g)
    w = _randn((streams - 1, hidden, hidden), g)
    weights = w if stacked else [w[k].clone() for k in range(streams - 1)]
    hs_before, w_before = hs.clone(), w.clone()
    stream = torch.cuda.current_stream().cuda_stream if DEVICE == "cuda" else 0
    col_tiles = -(-hidden // collapse_hopper.BLOCK_N)
    runs = []
    plan = None
    for _ in range(2):
        y = torch.full((streams - 1, rows, hidden), float("nan"), dtype=torch.float32, device=DEVICE)
        if stats:
            sumsq = torch.full((streams - 1, rows, col_tiles), float("nan"), dtype=torch.float32, device=DEVICE)
            plan = collapse_hopper.launch_v3(hs, weights, y, sumsq, stream)
            runs.append((y, sumsq))
        else:
            plan = collapse_hopper.launch_v2(hs, weights, y, stream)
            runs.append((y, y))
    _finish(f"{'launch_v3' if stats else 'launch_v2'} N={streams} M={rows} H={hidden}")
    (y, sumsq), (y_again, sumsq_again) = runs
    deterministic = torch.equal(y, y_again) and torch.equal(sumsq, sumsq_again)
    unchanged = torch.equal(hs, hs_before) and (
        torch.equal(w, w_before) if stacked else all(torch.equal(a, b) for a, b in zip(weights, w_before)))
    finite = bool(torch.isfinite(y).all().item() and torch.isfinite(sumsq).all().item())
    worst_ratio = 0.0
    rel = oracle = stats_rel = 0.0
    for k in range(streams - 1):
        x64, w64 = hs[k + 1].double(), w[k].double()
        ref = x64 @ w64.T
        bound = hidden * FP32_BOUND_PER_TERM * (x64.abs() @ w64.abs().T)
        worst_ratio = max(worst_ratio, ((y[k].double() - ref).abs() / bound).max().item())
        rel = max(rel, _rel_l2(y[k], ref))
        oracle = max(oracle, _rel_l2(hs[k + 1].float() @ w[k].float().T, ref), _cublas_rel_l2(hs[k + 1], w[k], ref))
        if stats:
            padded = torch.nn.functional.pad(ref.square(), (0, col_tiles * collapse_hopper.BLOCK_N - hidden))
            ref_sumsq = padded.view(rows, col_tiles, collapse_hopper.BLOCK_N).sum(-1)
            stats_rel = max(stats_rel, ((sumsq[k].double() - ref_sumsq).abs() / ref_sumsq).max().item())
        del ref, bound, x64, w64
    passed = (finite and worst_ratio <= 1.0 and rel <= max(ORACLE_FACTOR * oracle, ORACLE_FLOOR)
              and stats_rel <= STATS_REL_TOLERANCE and deterministic and unchanged)
    return {
        "check": "gemm_v3" if stats else "gemm_v2",
        "shape": f"N{streams}_M{rows}_H{hidden}_{'stacked' if stacked else 'list'}",
        "passed": passed, "detail": (f"splits={plan.splits} grid={plan.grid} bound_ratio={worst_ratio:.3f} "
                                     f"rel_l2={rel:.2e} fp32_rel_l2={oracle:.2e} stats_rel={stats_rel:.1e} "
                                     f"finite={finite} deterministic={deterministic} inputs_unchanged={unchanged}"),
    }


def check_collapse(w: Workload, seed: int, stacked: bool = True, version: str = "collapse_v2") -> dict:
    """collapse_v2 or collapse_v3 on one workload by the benchmark rule and the oracle; allocator poisoned."""
    inputs = collapse_inputs(w, seed, device=DEVICE)
    hs, ws, eps = inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"]
    weights = ws if stacked else [ws[k].clone() for k in range(w.streams - 1)]
    hs_before = hs.clone()
    outs = []
    for _ in range(2):
        # Freed blocks of NaN: the caching allocator hands them to the next allocations.
        poison = torch.full(((w.streams + 1) * w.tokens * w.hidden,), float("nan"), device=DEVICE)
        del poison
        outs.append(VERSIONS[version](hs, weights, eps))
    _finish(f"{version} {w.label}")
    out = outs[0]
    ref = collapse_reference(hs, ws, eps)
    oracle_out = collapse_reference(hs, ws, eps, torch.float32).to(torch.bfloat16)
    report = tolerance_report(out, ref, w.atol, w.rtol)
    oracle = tolerance_report(oracle_out, ref, w.atol, w.rtol).rel_l2
    deterministic = torch.equal(outs[0], outs[1])
    unchanged = torch.equal(hs, hs_before)
    oracle_ok = report.rel_l2 <= max(ORACLE_FACTOR * oracle, ORACLE_FLOOR)
    passed = report.passed and oracle_ok and deterministic and unchanged
    return {
        "check": version, "shape": f"{w.label}_{'stacked' if stacked else 'list'}", "passed": passed,
        "detail": (f"match={report.match_ratio:.6f} rel_l2={report.rel_l2:.2e} fp32_rel_l2={oracle:.2e} "
                   f"finite={report.finite} deterministic={deterministic} inputs_unchanged={unchanged}"),
    }


def odd_workloads() -> list[Workload]:
    """N = 2..4 at H not a multiple of the tiles, M from 1 to 8192 (benchmark tolerance)."""
    base = benchmark_workloads("collapse")[0]
    return [Workload("collapse", n, h, 1, m, base.atol, base.rtol, base.eps)
            for n, h, m in ((2, 1000, 7), (3, 2056, 613), (4, 1000, 8192), (4, 2056, 1), (2, 3072, 128))]


def _row(w: Workload, impl: str, times: list[float], info: dict, check: tuple = ("", "", "")) -> dict:
    times = sorted(times)
    median = statistics.median(times)
    sol = sol_us(COLLAPSE, w)
    match, rel, passed = check
    return {
        "op": "collapse", "impl": impl, "suite": "check_collapse_hopper", "N": w.streams, "H": w.hidden,
        "batch_size": w.batch_size, "seq_len": w.seq_len, "tokens": w.tokens,
        "median_us": round(median, 2), "p10_us": round(times[len(times) // 10], 2),
        "p90_us": round(times[(9 * len(times)) // 10], 2), "sol_us": round(sol, 2),
        "pct_sol": round(100 * sol / median, 1), "tflops": round(COLLAPSE.flops(w) / median / 1e6, 1),
        "tbps": round(COLLAPSE.compulsory_bytes(w) / median / 1e6, 3), "match_ratio": match,
        "rel_l2": rel, "passed": passed, "host_us": "", **info,
    }


def time_workload(w: Workload, seed: int, reps: int, warmup: int, info: dict, names: tuple) -> list[dict]:
    """Time the implementations `names` (of TIMED) on one workload."""
    inputs = collapse_inputs(w, seed)
    hs, ws, eps = inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"]
    xs = hs.view(w.streams, w.tokens, w.hidden)
    y = torch.empty((w.streams - 1, w.tokens, w.hidden), dtype=torch.float32, device=DEVICE)
    stream = torch.cuda.current_stream().cuda_stream

    def cublas():
        for k in range(w.streams - 1):
            torch.mm(xs[k + 1], ws[k].T, out_dtype=torch.float32)

    impls = {
        "torch_mm_fp32out": cublas,
        "v2_gemm": lambda: collapse_hopper.launch_v2(xs, ws, y, stream),
        "altup_cupy_collapse": lambda: collapse_current(hs, ws, eps),
        **{name: (lambda f=f: f(hs, ws, eps)) for name, f in VERSIONS.items()},
    }
    rows = []
    for name in names:
        fn = impls[name]
        try:
            times, _ = time_us(fn, reps, warmup)
        except (TypeError, NotImplementedError) as error:  # a torch without torch.mm(..., out_dtype=)
            print(f"  {name}: not timed ({error})")
            continue
        rows.append(_row(w, name, times, info))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="CSV of the timings")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=20261202)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs a Hopper GPU (compute capability 9.0)", file=sys.stderr)
        return 2
    print(f"GPU: {torch.cuda.get_device_name()}")

    build = collapse_hopper._cubin(collapse_hopper.SOURCE)
    print("ptxas (sm_90a):\n" + "\n".join(l for l in build.log.splitlines() if "registers" in l or "spill" in l
                                          or "Compiling" in l or "C7" in l))

    results = []
    seed = args.seed

    def run(label, fn, *fargs, **fkwargs):
        nonlocal seed
        seed += 1
        try:
            result = fn(*fargs, seed=seed, **fkwargs)
        except Exception as error:  # recorded as a failure; a sticky CUDA error fails the rest too
            traceback.print_exc()
            result = {"check": label, "shape": str(fargs), "passed": False, "detail": f"{type(error).__name__}: {error}"}
        results.append(result)
        print(f"{'PASS' if result['passed'] else 'FAIL'} {result['check']:12s} {result['shape']:32s} {result['detail']}",
              flush=True)

    workloads = benchmark_workloads("collapse") + gemma3n_workloads("collapse") + odd_workloads()
    timed_workloads = benchmark_workloads("collapse") + gemma3n_workloads("collapse")
    info = run_info()
    rows = []
    for stage, names in enumerate(STAGES):
        if stage == 0:
            for n in GEMM_STREAMS:
                for h in GEMM_HIDDEN:
                    for m in GEMM_ROWS:
                        run("gemm_v2", check_gemm, n, m, h, stacked=(m + n) % 2 == 0)
                        run("gemm_v3", check_gemm, n, m, h, stacked=(m + n) % 2 == 1, stats=True)
        versions = [v for v in VERSIONS if v in names]
        for i, w in enumerate(workloads):
            for version in versions:
                run(version, check_collapse, w, stacked=i % 3 != 2, version=version)
            torch.cuda.empty_cache()
        if any(not r["passed"] for r in results if r["check"] in versions):
            print(f"not timing {', '.join(versions)}: its checks failed")
            names = tuple(n for n in names if n not in versions)
        for w in timed_workloads:
            seed += 1
            rows += time_workload(w, seed, args.reps, args.warmup, info, names)
            torch.cuda.empty_cache()
        write_csv(rows, args.out)
    print_table(rows)
    failed = [r for r in results if not r["passed"]]
    print(f"\n{len(results) - len(failed)}/{len(results)} checks passed; CSV: {args.out}")
    return 1 if failed else 0


def print_table(rows: list[dict]) -> None:
    """Median us and % of SOL per workload and implementation; means over the benchmark's 16."""
    print(f"\n{'workload':24s} " + " ".join(f"{n:>20s}" for n in TIMED))
    by_workload = {}
    for r in rows:
        by_workload.setdefault((r["N"], r["H"], r["batch_size"], r["seq_len"]), {})[r["impl"]] = r
    for (n, h, b, s), impls in by_workload.items():
        cells = [f"{impls[i]['median_us']:>12.1f} us {impls[i]['pct_sol']:4.0f}%" if i in impls else f"{'-':>20s}"
                 for i in TIMED]
        print(f"N{n}_H{h}_B{b}_S{s:<8d} " + " ".join(cells))
    bench_rows = [r for r in rows if r["H"] == 3072 and r["N"] == 3]
    for impl in TIMED:
        times = [r["median_us"] for r in bench_rows if r["impl"] == impl]
        if times:
            print(f"mean over the {len(times)} benchmark workloads, {impl}: {statistics.mean(times):.1f} us")


if __name__ == "__main__":
    sys.exit(main())
