"""A/B of the backward's reduction launched as a programmatic dependent launch (the default on
Hopper) against a plain launch, for the ring kernels (v4, v6) on every workload of both suites.

Both plans of a shape are built apart (not from ring_plan's cache); the plain one has its reduction's
launch switched to a plain cuLaunchKernel. Their outputs must agree bit for bit; each is timed by the
benchmark's method (bench.time_us: L2 flushed before each call), alternating three rounds of
`--reps` calls, median over the rounds. Rows are written as they are measured.

    python3 scripts/ab_programmatic_reduce.py [--reps 20] [--max-tokens N] [--out programmatic_reduce_ab.csv]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys

import torch

from altup_cupy.lab.bench import run_info, time_us
from altup_cupy.lab.benchmarks.predict_correct_backward import ARG_NAMES
from altup_cupy.lab.benchmarks.predict_correct_backward import PREDICT_CORRECT_BACKWARD as BENCH
from altup_cupy.lab.workloads import workloads
from altup_cupy.ops.predict_correct_backward import run_plan
from altup_cupy.ops.predict_correct_backward_versions import RINGS, ring_plan, ring_supported


def plan_maker(programmatic: bool, ring):
    """make_plan for run_plan: one plan per shape, its reduction programmatic or not."""
    plans = {}

    def make(*shape):
        if shape not in plans:
            plan = ring_plan.__wrapped__(ring, *shape)  # a plan of its own: ring_plan caches
            plan.reduce.launch.programmatic &= programmatic
            plans[shape] = plan
        return plans[shape]
    return make


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=None, help="only workloads of at most this many tokens")
    parser.add_argument("--out", default="programmatic_reduce_ab.csv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: needs a CUDA GPU\n")
    chosen = workloads("predict_correct_backward", "benchmark") + workloads("predict_correct_backward", "gemma3n")
    chosen = [w for w in chosen if args.max_tokens is None or w.tokens <= args.max_tokens]
    info = run_info()
    fields = ["workload", "tokens", "version", "programmatic_us", "plain_us", "saved_us", "bitwise_same", *info]
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for i, w in enumerate(chosen):
            inputs = BENCH.make_inputs(w, 300 + i)
            tensors = [inputs[k] for k in ARG_NAMES]
            a, eps = inputs["active_idx"], inputs["eps"]
            for version, ring in RINGS.items():
                if not ring_supported(ring, w.streams, w.hidden):
                    continue
                makers = {flag: plan_maker(flag, ring) for flag in (True, False)}
                outputs = {flag: run_plan(makers[flag], tensors, a, eps) for flag in makers}
                same = all(torch.equal(bits(x), bits(y)) for x, y in zip(outputs[True], outputs[False]))
                times = {True: [], False: []}
                for _ in range(3):
                    for flag in (True, False):
                        times[flag] += time_us(lambda: run_plan(makers[flag], tensors, a, eps), args.reps, 3)[0]
                on, off = statistics.median(times[True]), statistics.median(times[False])
                row = {"workload": w.label, "tokens": w.tokens, "version": f"v{version}",
                       "programmatic_us": round(on, 2), "plain_us": round(off, 2), "saved_us": round(off - on, 2),
                       "bitwise_same": same, **info}
                writer.writerow(row)
                f.flush()
                print(f"{w.label:22s} v{version} programmatic {on:8.2f} us, plain {off:8.2f} us, same bits {same}",
                      flush=True)
            del inputs, tensors
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
