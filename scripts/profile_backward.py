"""One call of the backward on one benchmark workload, for a profiler to wrap (Nsight Compute):

    ncu --clock-control none --section SpeedOfLight -k regex:predict_correct_backward python3 scripts/profile_backward.py \
        --tokens 8192 --version 4

Draws the benchmark's inputs for the first benchmark workload with that many tokens, runs the
chosen version once to compile and warm up, then `--calls` more times (the ones to profile).
"""

from __future__ import annotations

import argparse
import functools

import torch

from altup_cupy import predict_correct_backward
from altup_cupy.lab.benchmarks.predict_correct_backward import ARG_NAMES
from altup_cupy.lab.workloads import SUITES, predict_correct_backward_inputs, workloads
from altup_cupy.ops.predict_correct_backward import run_plan
from altup_cupy.ops.predict_correct_backward_versions import v4_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # the first paragraph
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--suite", choices=SUITES, default="benchmark")
    parser.add_argument("--version", type=int, default=None)
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--calls", type=int, default=1)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: needs a CUDA GPU\n")
    w = next((w for w in workloads("predict_correct_backward", args.suite) if w.tokens == args.tokens), None)
    if w is None:
        parser.error(f"no {args.suite} workload has --tokens {args.tokens}; its token counts: "
                     f"{sorted({w.tokens for w in workloads('predict_correct_backward', args.suite)})}")
    inputs = predict_correct_backward_inputs(w, 7, "cuda", "random")
    call_args = [inputs[k] for k in ARG_NAMES]
    for _ in range(1 + args.calls):
        if args.stages is None:
            predict_correct_backward(*call_args, inputs["active_idx"], inputs["eps"], version=args.version)
        else:  # v4 with that many ring stages
            run_plan(functools.partial(v4_plan, stages=args.stages), call_args, inputs["active_idx"], inputs["eps"])
    torch.cuda.synchronize()
    print(f"ran {w.label} version={args.version} stages={args.stages} x{1 + args.calls}")


if __name__ == "__main__":
    main()
