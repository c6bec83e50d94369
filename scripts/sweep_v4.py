"""Tuning sweep of the backward's ring kernels (v4, and v6 where it applies) on the GPU: every
ring-stage count that fits, on workloads spanning the token counts of both suites, beside v3 and
the copy floor.

Each plan is first checked against the float64 reference under the benchmark's rule (all six
outputs), then timed by the benchmark's own method (bench.time_us: L2 flushed before each call,
warm-up, median). Prints a table and writes CSV rows; the default plan (v4_launch_plan) is chosen
from what this measures (results/nvidia-h200/NOTES.md).

    python3 scripts/sweep_v4.py [--reps 30] [--out sweep_v4.csv]
"""

from __future__ import annotations

import argparse
import csv
import functools
import statistics
import sys

import torch

from altup_cupy import predict_correct_backward
from altup_cupy.lab.bench import run_info, time_us
from altup_cupy.lab.benchmarks.predict_correct_backward import ARG_NAMES
from altup_cupy.lab.benchmarks.predict_correct_backward import PREDICT_CORRECT_BACKWARD as BENCH
from altup_cupy.lab.workloads import tolerance_report, workloads
from altup_cupy.ops.predict_correct_backward import run_plan
from altup_cupy.ops.predict_correct_backward_versions import RINGS, ring_plan, ring_stage_choices, v4_launch_plan

TOKENS = (256, 1024, 2984, 8192, 39232)  # of the benchmark suite


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # the first paragraph
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default="sweep_v4.csv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: needs a CUDA GPU\n")

    chosen = [w for w in workloads("predict_correct_backward", "benchmark") if w.tokens in TOKENS]
    chosen = sorted({w.tokens: w for w in chosen}.values(), key=lambda w: w.tokens)
    chosen += [w for w in workloads("predict_correct_backward", "gemma3n") if w.tokens == 8192]
    info = run_info()
    rows = []
    for i, w in enumerate(chosen):
        inputs = BENCH.make_inputs(w, 100 + i)
        reference = BENCH.reference(inputs)
        args_ = [inputs[k] for k in ARG_NAMES]
        a, eps = inputs["active_idx"], inputs["eps"]
        default = v4_launch_plan(w.streams, w.hidden)
        candidates = [(f"v{version}", ring, stages) for version, ring in RINGS.items()
                      for stages in ring_stage_choices(ring, w.streams, w.hidden)] + [("v3", None, None)]
        for name, ring, plan in candidates:
            def call(ring=ring, plan=plan):
                if ring is None:
                    return tuple(predict_correct_backward(*args_, a, eps, version=3))
                return tuple(run_plan(functools.partial(ring_plan, ring, stages=plan), args_, a, eps))
            outputs = call()
            torch.cuda.synchronize()
            reports = [tolerance_report(o, r, w.atol, w.rtol) for o, r in zip(outputs, reference)]
            del outputs
            times, _ = time_us(call, args.reps, args.warmup)
            rows.append({
                "workload": w.label, "N": w.streams, "H": w.hidden, "tokens": w.tokens,
                "impl": name, "stages": plan or "",
                "default": name == "v4" and plan == default, "median_us": round(statistics.median(times), 2),
                "passed": all(r.passed for r in reports),
                "worst_rel_l2": f"{max(r.rel_l2 for r in reports):.3e}", **info,
            })
            print(f"{w.label:22s} {name} stages={plan} default={rows[-1]['default']} "
                  f"{rows[-1]['median_us']:9.2f} us passed={rows[-1]['passed']} rel_l2<={rows[-1]['worst_rel_l2']}",
                  flush=True)
        copy = next(impl for impl in BENCH.impls(w) if impl.name == "copy_floor").prepare(inputs)
        times, _ = time_us(copy, args.reps, args.warmup)
        print(f"{w.label:22s} copy_floor {statistics.median(times):9.2f} us", flush=True)
        rows.append({"workload": w.label, "N": w.streams, "H": w.hidden, "tokens": w.tokens,
                     "impl": "copy_floor", "stages": "", "default": "",
                     "median_us": round(statistics.median(times), 2), "passed": "", "worst_rel_l2": "", **info})
        del inputs, reference, copy
        torch.cuda.empty_cache()
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    failed = [r for r in rows if r["passed"] is False]
    print(f"wrote {args.out}; {len(failed)} configurations FAILED the rule" if failed else f"wrote {args.out}; all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
