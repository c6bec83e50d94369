"""What the workspace cap of a cuBLASLt plan changes: the collapse's projection GEMM (bf16 x bf16 ->
fp32, N-1 products in one strided batched call) planned by `_cublas.Gemm` with the heuristic allowed
32 MiB, 4 MiB or no workspace, at the benchmark's shape (N = 3, H = 3072) and Gemma 3n's (N = 4,
H = 2048), M = 128 .. 8192; next to torch.bmm (bf16 out, and fp32 out through `out_dtype`) and one
torch.matmul.

    python3 scripts/probe_cublas_workspace.py

Per line: the workspace the chosen algorithm asks for, host time per call (bench.host_cost_us: back
to back, no synchronisation), GPU time (median of 50 single calls after an L2 flush, CUDA events, the host's issue time
hidden behind a GPU sleep),
the largest error against an fp32 product, and the kernels one call launches (torch.profiler).
"""

from __future__ import annotations

import statistics

import torch

from altup_cupy import _cublas
from altup_cupy.lab.bench import host_cost_us

CAPS = (32 << 20, 4 << 20, 0)
SHAPES = ((3072, 2), (2048, 3))  # (H, N - 1)
TOKENS = (128, 256, 2048, 8192)


def gpu_us(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(20000)  # the GPU busy while the host issues the call: its issue time is hidden
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def kernels(fn) -> list[str]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    print("gpu", torch.cuda.get_device_name())
    stream = torch.cuda.current_stream().cuda_stream
    for hidden, products in SHAPES:
        for tokens in TOKENS:
            x = torch.randn(products + 1, tokens, hidden, device="cuda").bfloat16()
            w = torch.randn(products, hidden, hidden, device="cuda").bfloat16()
            d = torch.empty(products, tokens, hidden, device="cuda")
            exact = torch.bmm(x[1:].float(), w.float().transpose(1, 2))
            for cap in CAPS:
                _cublas.MAX_WORKSPACE_BYTES = cap
                gemm = _cublas.Gemm(rows=tokens, cols=hidden, inner=hidden, batch=products,
                                    x_batch_stride=tokens * hidden, y_batch_stride=hidden * hidden,
                                    d_batch_stride=tokens * hidden)
                workspace = torch.empty(max(gemm.workspace_bytes, 1), dtype=torch.uint8, device="cuda")

                def call():
                    gemm(x[1].data_ptr(), w.data_ptr(), d.data_ptr(), workspace.data_ptr(), stream)
                call()
                torch.cuda.synchronize()
                error = (d - exact).abs().max().item()
                print(f"H={hidden} N-1={products} M={tokens} cap={cap >> 20}MiB workspace={gemm.workspace_bytes} "
                      f"host={host_cost_us(call):.1f}us gpu={gpu_us(call):.1f}us err={error:.3g} "
                      f"kernels={kernels(call)}", flush=True)
            xs, wt = x[1:], w.transpose(1, 2)
            for name, fn in (("torch.bmm bf16", lambda: torch.bmm(xs, wt)),
                             ("torch.bmm out_dtype=f32", lambda: torch.bmm(xs, wt, out_dtype=torch.float32)),
                             ("torch.matmul, one product", lambda: torch.matmul(x[1], w[0]))):
                print(f"  {name} host={host_cost_us(fn):.1f} gpu={gpu_us(fn):.1f} kernels={kernels(fn)}", flush=True)


if __name__ == "__main__":
    main()
