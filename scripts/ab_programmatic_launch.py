"""A/B of the package's programmatic dependent launches (the default on Hopper) against plain
launches, on every workload of both suites: the collapse's epilogue after its GEMM (v1, and v2,
whose GEMM is the package's own, on sm_90 GPUs) and the backward's weight-gradient reduction after
the ring kernels (v4, v6).

Both plans of a shape are built apart (not from the versions' caches); the plain one has that
launch switched to a plain cuLaunchKernel. Their outputs must agree bit for bit; each is timed by
the benchmark's method (bench.time_us: L2 flushed before each call), three alternating rounds of
`--reps` calls, median over the rounds. Rows are written as they are measured.

    python3 scripts/ab_programmatic_launch.py [--op collapse|predict_correct_backward|all] [--reps 20]
        [--max-tokens N] [--out programmatic_launch_ab.csv]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from typing import Callable, Iterator

import torch

from altup_cupy.lab.bench import run_info, time_us
from altup_cupy.lab.benchmarks.predict_correct_backward import ARG_NAMES
from altup_cupy.lab.benchmarks.predict_correct_backward import PREDICT_CORRECT_BACKWARD as BACKWARD
from altup_cupy.lab.workloads import Workload, collapse_inputs, workloads
from altup_cupy.ops import collapse_hopper
from altup_cupy.ops.collapse_versions import VERSIONS as COLLAPSE_VERSIONS
from altup_cupy.ops.collapse_versions import _v1_plan
from altup_cupy.ops.predict_correct_backward import run_plan
from altup_cupy.ops.predict_correct_backward_versions import RINGS, ring_plan, ring_supported

OPS = ("collapse", "predict_correct_backward")
# A call of one version with its launch programmatic (True) or plain (False): returns its outputs.
Call = Callable[[bool], tuple[torch.Tensor, ...]]


def backward_calls(w: Workload, seed: int) -> Iterator[tuple[str, Call]]:
    """The ring versions that take `w`, each as a Call whose reduction is programmatic or not."""
    inputs = BACKWARD.make_inputs(w, seed)
    tensors = [inputs[k] for k in ARG_NAMES]
    a, eps = inputs["active_idx"], inputs["eps"]
    for version, ring in RINGS.items():
        if not ring_supported(ring, w.streams, w.hidden):
            continue
        plans = {}
        for flag in (True, False):
            plan = ring_plan.__wrapped__(ring, w.streams, a, w.tokens, w.hidden, torch.cuda.current_device())
            plan.reduce.launch.programmatic &= flag
            plans[flag] = plan
        yield f"v{version}", lambda flag, plans=plans: run_plan(lambda *shape: plans[flag], tensors, a, eps)


def collapse_calls(w: Workload, seed: int) -> Iterator[tuple[str, Call]]:
    """v1, and v2 where it runs, each as a Call whose epilogue is programmatic or not."""
    inputs = collapse_inputs(w, seed)
    hs, ws, eps = inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"]
    device = torch.cuda.current_device()
    builders = {1: lambda: _v1_plan.__wrapped__(w.streams, w.tokens, w.hidden, True, device)}
    if torch.cuda.get_device_capability() == (9, 0) and COLLAPSE_VERSIONS[2].supports(w.streams, w.hidden):
        builders[2] = lambda: collapse_hopper.plan.__wrapped__(2, w.streams, w.tokens, w.hidden, True, device)
    for version, build in builders.items():
        plans, outs = {}, {}
        for flag in (True, False):
            plans[flag] = build()
            plans[flag].epilogue.programmatic &= flag
            outs[flag] = torch.empty((w.tokens, w.hidden), dtype=torch.bfloat16, device="cuda")

        def call(flag, plans=plans, outs=outs):
            plans[flag]((hs, ws), (outs[flag],), (eps,), torch.cuda.current_stream().cuda_stream, False)
            return (outs[flag],)
        yield f"v{version}", call


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=(*OPS, "all"), default="all")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=None, help="only workloads of at most this many tokens")
    parser.add_argument("--out", default="programmatic_launch_ab.csv")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        parser.exit(2, f"{parser.prog}: needs a Hopper (or later) GPU, where launches are programmatic\n")
    info = run_info()
    fields = ["op", "workload", "tokens", "version", "programmatic_us", "plain_us", "saved_us", "bitwise_same", *info]
    makers = {"collapse": collapse_calls, "predict_correct_backward": backward_calls}
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for op in OPS if args.op == "all" else (args.op,):
            chosen = [w for w in workloads(op, "benchmark") + workloads(op, "gemma3n")
                      if args.max_tokens is None or w.tokens <= args.max_tokens]
            for i, w in enumerate(chosen):
                for version, call in makers[op](w, 300 + i):
                    same = all(torch.equal(bits(x), bits(y)) for x, y in zip(call(True), call(False)))
                    times = {True: [], False: []}
                    for _ in range(3):
                        for flag in (True, False):
                            times[flag] += time_us(lambda: call(flag), args.reps, 3)[0]
                    on, off = statistics.median(times[True]), statistics.median(times[False])
                    writer.writerow({"op": op, "workload": w.label, "tokens": w.tokens, "version": version,
                                     "programmatic_us": round(on, 2), "plain_us": round(off, 2),
                                     "saved_us": round(off - on, 2), "bitwise_same": same, **info})
                    f.flush()
                    print(f"{op:24s} {w.label:22s} {version} programmatic {on:8.2f} us, plain {off:8.2f} us, "
                          f"same bits {same}", flush=True)
                call = None  # its closure holds this workload's tensors
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
