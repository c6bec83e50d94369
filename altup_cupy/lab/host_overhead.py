"""What issuing an op costs the calling thread, against one torch.matmul of the op's GEMM shape.

For each op and token count: the host time per call of back-to-back calls with no
synchronisation (bench.host_cost_us), for the public function (`altup_cupy`, the eager fast path)
and for the torch custom operator (`altup_cupy_op`, through the dispatcher), next to
`torch.matmul` of bf16 [M, H] x [H, H] on the same device; ratio = host_us / torch_matmul_host_us.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from .bench import host_cost_us, run_info
from .workloads import OPS, benchmark_workloads

TOKENS = (128, 256, 2048, 8192)
IMPLS = ("altup_cupy", "altup_cupy_op")
CSV_COLUMNS = ("op", "impl", "N", "H", "tokens", "host_us", "torch_matmul_host_us", "ratio", "gpu",
               "git_sha", "date")


def measure(ops: Sequence[str] = OPS, tokens: Sequence[int] = TOKENS, seed: int = 0) -> list[dict]:
    import torch

    from .benchmarks import op_bench

    info = run_info()
    rows = []
    for op in ops:
        bench = op_bench(op)
        for count in tokens:
            w = replace(benchmark_workloads(op)[0], batch_size=1, seq_len=count)
            inputs = bench.make_inputs(w, seed)
            x = torch.randn(count, w.hidden, device="cuda").to(torch.bfloat16)
            weight = torch.randn(w.hidden, w.hidden, device="cuda").to(torch.bfloat16)
            matmul_us = host_cost_us(lambda: torch.matmul(x, weight))
            prepared = {impl.name: impl.prepare for impl in bench.impls(w)}
            for name in IMPLS:
                host_us = host_cost_us(prepared[name](inputs))
                rows.append({"op": op, "impl": name, "N": w.streams, "H": w.hidden, "tokens": count,
                             "host_us": round(host_us, 1), "torch_matmul_host_us": round(matmul_us, 1),
                             "ratio": round(host_us / matmul_us, 2), **info})
            del inputs, x, weight
    return rows
