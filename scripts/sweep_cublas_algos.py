"""Sweep of cuBLASLt's algorithms for the collapse's projection GEMMs on the GPU: every algorithm its
heuristic offers for each workload of both suites (`_cublas.Gemm(candidate=k)`), with its
configuration (tile, split-K, stages, cluster), GPU time, host cost per call and its largest
difference from the heuristic's first choice (which v1 and the `cublas_gemms_fp32out` floor run).

Whether a later candidate beats the first one, where (small M: issue 21 asks the collapse to be no
slower there than cuBLAS's GEMMs alone), and at what host cost, is what this measures. GPU time by
the benchmark's method (bench.time_us: L2 flushed before each call, median); host cost by
bench.host_cost_us (back to back). Rows are written as they are measured.

    python3 scripts/sweep_cublas_algos.py [--reps 30] [--max-candidates 16] [--max-tokens N]
        [--out sweep_cublas_algos.csv]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys

import torch

from altup_cupy import _cublas
from altup_cupy.lab.bench import host_cost_us, run_info, time_us
from altup_cupy.lab.workloads import collapse_inputs, workloads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--max-candidates", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=None, help="only workloads of at most this many tokens")
    parser.add_argument("--out", default="sweep_cublas_algos.csv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: needs a CUDA GPU\n")
    info = run_info()
    fields = ["suite", "workload", "tokens", "hidden", "candidate", *_cublas.ALGO_CONFIG, "workspace_bytes",
              "waves", "gpu_us", "host_us", "max_abs_diff_vs_first", *info]
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for suite in ("benchmark", "gemma3n"):
            for seed, w in enumerate(workloads("collapse", suite)):
                if args.max_tokens is not None and w.tokens > args.max_tokens:
                    continue
                inputs = collapse_inputs(w, 500 + seed)
                weights = inputs["unembed_projs"]
                x = inputs["hidden_states"].view(w.streams, w.tokens, w.hidden)[1:]
                y = torch.empty((w.streams - 1, w.tokens, w.hidden), dtype=torch.float32, device="cuda")
                workspace = torch.empty(_cublas.MAX_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
                first = None
                for candidate in range(args.max_candidates):
                    try:
                        gemm = _cublas.Gemm(rows=w.tokens, cols=w.hidden, inner=w.hidden, batch=w.streams - 1,
                                            x_batch_stride=x.stride(0), y_batch_stride=weights.stride(0),
                                            d_batch_stride=y.stride(0), candidate=candidate)
                    except IndexError:
                        break  # the heuristic offers no more

                    def call(gemm=gemm):
                        gemm(x.data_ptr(), weights.data_ptr(), y.data_ptr(), workspace.data_ptr(),
                             torch.cuda.current_stream().cuda_stream)
                    y.fill_(float("nan"))
                    call()
                    if first is None:
                        first = y.clone()
                    gpu = statistics.median(time_us(call, args.reps, 5)[0])
                    row = {"suite": suite, "workload": w.label, "tokens": w.tokens, "hidden": w.hidden,
                           "candidate": candidate, **gemm.config, "workspace_bytes": gemm.workspace_bytes,
                           "waves": round(gemm.waves, 3), "gpu_us": round(gpu, 2),
                           "host_us": round(host_cost_us(call, calls=50, rounds=5, warmup=5), 2),
                           "max_abs_diff_vs_first": float((y - first).abs().max()), **info}
                    writer.writerow(row)
                    f.flush()
                    print(f"{w.label:22s} candidate {candidate:2d} tile {row['tile']:3d} split-K {row['split_k']:2d} "
                          f"{gpu:9.2f} us GPU, {row['host_us']:6.2f} us host, "
                          f"max diff {row['max_abs_diff_vs_first']:.3g}", flush=True)
                del inputs, weights, x, y, workspace, first
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
