"""Where the host time of one eager call goes: each op's public function and torch operator, and the
parts they are made of, each timed alone, back to back.

    python3 scripts/host_breakdown.py --out results/<gpu>/host_breakdown.csv [--profile-dir DIR]

`host_overhead.csv` (altup_cupy.lab.host_overhead) says what a call costs against one torch.matmul;
this says what the cost is made of: the collapse and the predict-correct backward at M = 256 (the
benchmark's N and H), their checks, output allocations, launch plans and the plans' launches alone,
then Gemma 3n's operators at 1 x 256 (N = 4, H = 2048) through torch.ops with no autograd; two rows
time the interpreter alone (to compare hosts: the package's host path is Python). Each row is
bench.host_cost_us (200 calls back to back, median of 15 rounds). The parts overlap (a plan call
holds its launches) and do not add up exactly to the whole: each is timed in a loop of its own,
where its code and data stay in the caches (inside a model step they do not:
`scripts/profile_gemma3n_step.py --in-step`). With --profile-dir, a cProfile of 3000 calls of the
collapse, the backward and Gemma's correct_backward (internal time per function) goes there.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from dataclasses import replace
from pathlib import Path

import torch

COLUMNS = ("part", "us_per_call", "gpu", "git_sha", "date")


def _cprofile(fn, path: Path, calls: int = 3000) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    path.write_text(text.getvalue())


def _one_line(value: int) -> int:
    return value + 1


def _python_calls() -> None:
    for i in range(100):
        _one_line(i)


def _tensor_reads(t: torch.Tensor, count: int) -> None:
    """What a validation reads of `count` tensors."""
    for _ in range(count):
        t.dtype, t.shape, t.is_contiguous(), t.data_ptr()


def parts(profile_dir: Path | None) -> list[tuple[str, object]]:
    """(name, zero-argument call) of every part timed; writes the cProfiles on the way."""
    import altup_cupy
    import altup_cupy.torch  # noqa: F401  (the Gemma operators' autograd, as a model has it)
    from altup_cupy.lab.benchmarks import op_bench
    from altup_cupy.lab.workloads import benchmark_workloads
    from altup_cupy.ops import collapse as C
    from altup_cupy.ops import predict_correct_backward as P

    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    device = torch.cuda.current_device()
    x, w = torch.randn(256, 3072, device="cuda").bfloat16(), torch.randn(3072, 3072, device="cuda").bfloat16()
    rows = [("torch.matmul [256, 3072] x [3072, 3072]", lambda: torch.matmul(x, w)),
            ("torch.empty [1, 256, 3072] bf16", lambda: torch.empty((1, 256, 3072), dtype=torch.bfloat16, device="cuda")),
            ("torch.empty_like [256, 3072]", lambda: torch.empty_like(x)),
            # the interpreter alone: hosts differ more in this than in torch's C++ calls, and the
            # package's host path is Python
            ("python: 100 calls of a one-line function", _python_calls),
            ("python: 7 tensors' dtype, shape, contiguity, address", lambda: _tensor_reads(x, 7))]

    work = replace(benchmark_workloads("collapse")[0], batch_size=1, seq_len=256)
    inputs = op_bench("collapse").make_inputs(work, 0)
    hs, ws, eps = inputs["hidden_states"], inputs["unembed_projs"], inputs["eps"]
    streams, batch, seq, hidden = hs.shape
    plan = C._version(None, streams, hidden, device).plan(streams, batch * seq, hidden, True, device)
    out = torch.empty((batch, seq, hidden), dtype=torch.bfloat16, device="cuda")
    rows += [("collapse: altup_cupy.collapse", lambda: altup_cupy.collapse(hs, ws, eps)),
             ("collapse: torch.ops.altup_cupy.collapse", lambda: torch.ops.altup_cupy.collapse(hs, [ws], eps)),
             ("collapse: validate", lambda: C.validate(hs, [ws], eps, launching=True)),
             ("collapse: plan call (v1: GEMM + epilogue)", lambda: plan((hs, ws), (out,), (eps,), stream, True))]
    if hasattr(plan, "gemms"):  # v1's parts: the cuBLASLt call and the epilogue's launch alone
        buffer = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device="cuda")
        gemm, first_projection = plan.gemms[batch * seq], hs.data_ptr() + 2 * batch * seq * hidden
        rows += [("collapse: v1 cuBLASLt GEMM call", lambda: gemm(first_projection, ws.data_ptr(), buffer.data_ptr(),
                                                                   buffer.data_ptr() + plan.gemm_workspace_offset,
                                                                   stream)),
                 ("collapse: v1 epilogue launch", lambda: plan.epilogue(stream, batch * seq, hs.data_ptr(),
                                                                        buffer.data_ptr(), out.data_ptr(), hidden,
                                                                        batch * seq, eps))]
    if profile_dir is not None:
        _cprofile(lambda: altup_cupy.collapse(hs, ws, eps), profile_dir / "cprofile_collapse.txt")

    work = replace(benchmark_workloads("predict_correct_backward")[0], batch_size=1, seq_len=256)
    inputs = op_bench("predict_correct_backward").make_inputs(work, 0)
    args, active, eps = tuple(inputs[k] for k in P.INPUT_NAMES), inputs["active_idx"], inputs["eps"]
    streams, hidden = args[0].shape[0], args[0].shape[-1]
    backward_plan = P._version(None, streams, hidden, device).plan(streams, active, 256, hidden, device)
    grads = P._empty_grads(args[0], args[2], separate_weight_grads=False)
    rows += [("backward: altup_cupy.predict_correct_backward",
              lambda: altup_cupy.predict_correct_backward(*args, active, eps)),
             ("backward: torch.ops.altup_cupy.predict_correct_backward",
              lambda: torch.ops.altup_cupy.predict_correct_backward(*args, active, eps)),
             ("backward: validate", lambda: P.validate(*args, active, eps)),
             ("backward: outputs, weight gradients as views of one allocation",
              lambda: P._empty_grads(args[0], args[2], separate_weight_grads=False)),
             ("backward: outputs, six allocations", lambda: P._empty_grads(args[0], args[2], separate_weight_grads=True)),
             ("backward: plan call (main kernel + reduction)", lambda: backward_plan(args, grads, (eps,), stream, True))]
    if profile_dir is not None:
        _cprofile(lambda: altup_cupy.predict_correct_backward(*args, active, eps), profile_dir / "cprofile_backward.txt")
    return rows + _gemma3n_parts(profile_dir)


def _gemma3n_parts(profile_dir: Path | None) -> list[tuple[str, object]]:
    """Gemma 3n's operators at 1 x 256, N = 4, H = 2048, through torch.ops with no autograd."""
    ops = torch.ops.altup_cupy
    streams, hidden, eps, floor = 4, 2048, 1e-6, 1e-5
    scale = 1.0 / hidden

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, device="cuda") * std).bfloat16()

    hs, grad, act = rand(streams, 1, 256, hidden), rand(streams, 1, 256, hidden), rand(1, 256, hidden)
    P, Q = rand(streams * streams, streams, std=0.3), rand(streams, streams, std=0.3)
    R, w = rand(streams, hidden, std=0.05), rand(hidden)
    projections = [rand(hidden, hidden, std=0.02) for _ in range(streams - 1)]
    with torch.no_grad():
        _, projected = ops.expand(act, projections, floor)
    rows = [("gemma3n: predict", lambda: ops.predict(hs, P, R, w, 0, eps, scale)),
            ("gemma3n: predict_with_active", lambda: ops.predict_with_active(hs, P, R, w, 0, eps, scale)),
            ("gemma3n: correct", lambda: ops.correct(hs, act, Q, R, w, 0, eps, scale)),
            ("gemma3n: correct_with_active", lambda: ops.correct_with_active(hs, act, Q, R, w, 0, eps, scale)),
            ("gemma3n: predict_backward, grad_active", lambda: ops.predict_backward(grad, hs, P, R, w, 0, eps, scale,
                                                                                  grad_active=act)),
            ("gemma3n: correct_backward, grad_active", lambda: ops.correct_backward(grad, hs, act, Q, R, w, 0, eps,
                                                                                  scale, grad_active=act)),
            ("gemma3n: expand", lambda: ops.expand(act, projections, floor)),
            ("gemma3n: expand_backward", lambda: ops.expand_backward(grad, act, projections, projected, floor)),
            ("gemma3n: collapse", lambda: ops.collapse(hs, projections, floor)),
            ("gemma3n: collapse_backward", lambda: ops.collapse_backward(act, hs, projections, floor))]
    if profile_dir is not None:
        _cprofile(lambda: ops.correct_backward(grad, hs, act, Q, R, w, 0, eps, scale, grad_active=act),
                  profile_dir / "cprofile_gemma3n_correct_backward.txt")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # the first paragraph
    parser.add_argument("--out", type=Path, required=True, help="the CSV to write")
    parser.add_argument("--profile-dir", type=Path, default=None, help="where the cProfiles go (none: no profiles)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: needs a CUDA GPU\n")
    from altup_cupy.lab.bench import host_cost_us, run_info, write_csv

    if args.profile_dir is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    info, rows = run_info(), []
    with torch.no_grad():
        for name, call in parts(args.profile_dir):
            rows.append({"part": name, "us_per_call": round(host_cost_us(call, calls=200), 2), **info})
            print(f"{rows[-1]['us_per_call']:8.2f} us  {name}", flush=True)
    write_csv(rows, args.out, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
