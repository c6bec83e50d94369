"""The timing harness: every implementation of an op, on every workload, side by side in one run.

Method: fresh random inputs per workload; each
checked implementation's outputs compared with the float64 reference under the benchmark's
rule; then for timing, the L2 cache is flushed before every call, the call is bracketed by CUDA
events on the current stream, and the median of `reps` calls after `warmup` calls is reported.

Two times per implementation, both with the L2 flushed before every call:
- `median_us`, the GPU's work: a GPU-side sleep is queued after each flush, so the host has
  finished issuing the call before the start event runs on the GPU; the Python and launch overhead
  of every implementation (ours and the baselines alike) stays out of it.
- `wall_us`, what a program sees of one call: the GPU idle, then CUDA events around the call with
  no head start, so host time that the GPU cannot hide is included.
`host_us` is the median host time to issue one call. `host_overhead` measures the host cost of
back-to-back calls (no synchronisation) against one torch.matmul of the op's GEMM shape.
Rows go to a CSV whose schema `CSV_COLUMNS` is shared by every op, figure and notebook.
"""

from __future__ import annotations

import csv
import datetime
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .ceilings import H200
from .paths import REPO_ROOT
from .workloads import Workload, tolerance_report

L2_FLUSH_BYTES = 256 << 20  # > 4x the H200's 60 MiB L2
HOST_HEADSTART_CYCLES = 2_000_000  # ~1 ms of GPU sleep at ~2 GHz: longer than any call's host cost

CSV_COLUMNS = (
    "op", "impl", "suite", "N", "H", "batch_size", "seq_len", "tokens",
    "median_us", "wall_us", "p10_us", "p90_us", "sol_us", "pct_sol", "tflops", "tbps",
    "match_ratio", "rel_l2", "passed", "host_us", "gpu", "git_sha", "date",
)


@dataclass(frozen=True)
class Impl:
    """One implementation: `prepare(inputs)` returns the zero-argument callable that is timed.

    The callable returns the op's outputs as a tuple of tensors, or None for timing-only
    references such as a bandwidth floor (`checked=False`), whose `passed` column stays empty.
    """

    name: str
    prepare: Callable[[dict], Callable[[], Any]]
    checked: bool = True


@dataclass(frozen=True)
class OpBench:
    """What the harness needs to know about one op."""

    op: str
    output_names: tuple[str, ...]
    make_inputs: Callable[[Workload, int], dict]
    reference: Callable[[dict], tuple]  # float64 outputs, in output_names order
    impls: Callable[[Workload], Sequence[Impl]]
    flops: Callable[[Workload], float]
    compulsory_bytes: Callable[[Workload], float]
    # The plain PyTorch implementation at working precision (fp32) that the accuracy oracle
    # compares against: a kernel's error may be at most twice this one's.
    oracle_impl: str = "torch_eager"


def sol_us(bench: OpBench, w: Workload) -> float:
    """Speed of light on the H200's datasheet: the larger of the compute and memory times."""
    return 1e6 * H200.sol_seconds(bench.flops(w), bench.compulsory_bytes(w))


def run_info() -> dict:
    """Provenance stamped on every row: GPU name, git commit (the package version when it does not
    run from a checkout), UTC date."""
    import torch

    sha = os.environ.get("ALTUP_GIT_SHA")
    if not sha and REPO_ROOT is None:
        from .. import __version__

        sha = f"v{__version__}"
    elif not sha:
        try:
            sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            sha = "unknown"
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "git_sha": sha,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
    }


def time_us(fn: Callable[[], Any], reps: int, warmup: int, headstart: bool = True,
            headstart_cycles: int = HOST_HEADSTART_CYCLES) -> tuple[list[float], list[float]]:
    """(event times, host issue times) per call in microseconds; L2 flushed before each call.

    headstart: a GPU sleep of `headstart_cycles` after the flush lets the host issue the whole
    call before the start event runs, so the event time is the GPU's work alone (a call whose host
    issue takes longer needs a longer sleep: `headstart_for`); without it the GPU is idle when the
    start event is recorded and the event time is the call's wall time.
    """
    import time

    import torch

    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    host = []
    for start, end in zip(starts, ends):
        flush.zero_()
        if headstart:
            torch.cuda._sleep(headstart_cycles)
        else:
            torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append(1e6 * (time.perf_counter() - t0))
        end.record()
        torch.cuda.synchronize()  # one call in flight at a time
    return [1e3 * s.elapsed_time(e) for s, e in zip(starts, ends)], host


def headstart_for(host_us: float) -> int:
    """GPU sleep cycles that outlast issuing a call of `host_us` on the host (twice over, at a
    2 GHz clock), and never less than the default."""
    return max(HOST_HEADSTART_CYCLES, int(2 * 2000 * host_us))


def host_cost_us(fn: Callable[[], Any], calls: int = 100, rounds: int = 15, warmup: int = 20) -> float:
    """Host time per call of `calls` back-to-back calls with no synchronisation between them (the
    GPU runs behind), median over `rounds`: what issuing the op costs a program's thread. Python's
    garbage collector is paused while timing (as `timeit` does): a collection of a process holding
    torch's objects takes milliseconds and would land on whichever call triggers it."""
    import gc
    import time

    import torch

    for _ in range(warmup):
        fn()
    per_call = []
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call.append(1e6 * (time.perf_counter() - t0) / calls)
            torch.cuda.synchronize()
    finally:
        if collecting:
            gc.enable()
    return statistics.median(per_call)


def copy_floor(nbytes: int, device) -> Callable[[], None]:
    """A bf16 device-to-device copy of nbytes / 4 elements: it reads and writes nbytes in all, the
    pace of a kernel that moves exactly those bytes once and does nothing else."""
    import torch

    src = torch.zeros(int(nbytes) // 4, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)

    def run() -> None:
        dst.copy_(src)
    return run


def check_outputs(bench: OpBench, w: Workload, outputs: tuple, reference: tuple):
    """The worst match ratio and worst relative L2 error over the op's outputs, and the verdict."""
    reports = [tolerance_report(o, r, w.atol, w.rtol) for o, r in zip(outputs, reference, strict=True)]
    return (min(r.match_ratio for r in reports), max(r.rel_l2 for r in reports),
            all(r.passed for r in reports))


def measure(bench: OpBench, workloads: Sequence[Workload], suite: str, reps: int = 100,
            warmup: int = 10, seed: int = 0, progress: bool = True,
            impl_names: Sequence[str] | None = None) -> list[dict]:
    """Check and time every implementation of `bench` (or those named) on every workload; return
    CSV rows."""
    import torch

    from .._extras import require

    tqdm = require("tqdm.auto", "bench", "tqdm").tqdm

    def chosen(w):
        return [i for i in bench.impls(w) if impl_names is None or i.name in impl_names]

    info = run_info()
    jobs = [(w, impl) for w in workloads for impl in chosen(w)]
    rows = []
    bar = tqdm(total=len(jobs), desc=f"bench {bench.op}", disable=not progress, file=sys.stderr)
    for i, w in enumerate(workloads):
        inputs = bench.make_inputs(w, seed + i)
        reference = bench.reference(inputs) if any(impl.checked for impl in chosen(w)) else None
        for impl in chosen(w):
            bar.set_postfix_str(f"{impl.name} {w.label}")
            fn = impl.prepare(inputs)
            match = rel = passed = ""
            if impl.checked:
                outputs = fn()
                torch.cuda.synchronize()
                match, rel, passed = check_outputs(bench, w, outputs, reference)
                del outputs
            times, host = time_us(fn, reps, warmup)
            walls, _ = time_us(fn, reps, warmup=1, headstart=False)
            times = sorted(times)
            median = statistics.median(times)
            sol = sol_us(bench, w)
            rows.append({
                "op": bench.op, "impl": impl.name, "suite": suite, "N": w.streams, "H": w.hidden,
                "batch_size": w.batch_size, "seq_len": w.seq_len, "tokens": w.tokens,
                "median_us": round(median, 2), "wall_us": round(statistics.median(walls), 2),
                "p10_us": round(times[len(times) // 10], 2),
                "p90_us": round(times[(9 * len(times)) // 10], 2), "sol_us": round(sol, 2),
                "pct_sol": round(100 * sol / median, 1),
                "tflops": round(bench.flops(w) / median / 1e6, 1),
                "tbps": round(bench.compulsory_bytes(w) / median / 1e6, 3),
                "match_ratio": match if match == "" else round(match, 6),
                "rel_l2": rel if rel == "" else f"{rel:.3e}", "passed": passed,
                "host_us": round(statistics.median(host), 1), **info,
            })
            del fn
            bar.update()
        del inputs, reference
        torch.cuda.empty_cache()
    bar.close()
    return rows


def write_csv(rows: Sequence[dict], path: Path, columns: Sequence[str] = CSV_COLUMNS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def csv_path(op: str, suite: str, results_dir: Path | str) -> Path:
    return Path(results_dir) / f"bench_{op}_{suite}.csv"
