"""What registering an operator costs on the host: `torch.library.custom_op` against a plain
`torch.library.Library` registration, with torch's autograd kernel or with the package's
(`altup_cupy._operators.Operator`, which skips torch's for calls that record no gradient), and the
Gemma 3n operators as shipped.

    python -m altup_cupy.lab.op_registration            # on the GPU if there is one, else the CPU

Every probe operator does the same nothing (`empty_like` of its first input), so a call's time is
the registration's own: the dispatcher, the Python wrappers, autograd's node where the input
requires a gradient. The shipped rows time `torch.ops.altup_cupy.predict` / `correct` on a tiny
input (one token, H = 64), validation and launch included: the host cost of one call in eager mode.
Best of 5 repeats of 2000 calls, in microseconds per call; rows go to
results/<gpu or cpu>/op_registration.csv of the current directory.
"""

from __future__ import annotations

import argparse
import functools
import timeit
from pathlib import Path

import torch

COLUMNS = ("registration", "autograd", "us_per_call", "device", "git_sha", "date")


@functools.cache
def _probe_ops():
    """(custom_op, Library, Operator) registrations of one trivial operator, each differentiable;
    made once a process (a registration lives as long as its library, and the Operator's autograd
    kernel keeps its library alive)."""
    from .._operators import Operator

    @torch.library.custom_op("altup_cupy_probe::via_custom_op", mutates_args=())
    def via_custom_op(x: torch.Tensor, w: torch.Tensor, index: int, eps: float) -> torch.Tensor:
        return torch.empty_like(x)

    via_custom_op.register_fake(lambda x, w, index, eps: torch.empty_like(x))
    library = torch.library.Library("altup_cupy_probe", "FRAGMENT")
    library.define("via_library(Tensor x, Tensor w, SymInt index, float eps) -> Tensor")
    for key in ("CPU", "CUDA"):
        library.impl("via_library", lambda x, w, index, eps: torch.empty_like(x), key)
    torch.library.register_fake("altup_cupy_probe::via_library", lambda x, w, index, eps: torch.empty_like(x),
                                lib=library)

    def setup_context(ctx, inputs, output):
        ctx.index = inputs[2]

    def backward(ctx, grad):
        return grad, None, None, None

    for name in ("via_custom_op", "via_library"):
        torch.library.register_autograd(f"altup_cupy_probe::{name}", backward, setup_context=setup_context,
                                        lib=library)
    via_operator = Operator("via_operator(Tensor x, Tensor w, SymInt index, float eps) -> Tensor",
                            lambda x, w, index, eps: torch.empty_like(x), library)
    via_operator.register_fake(lambda x, w, index, eps: torch.empty_like(x))
    via_operator.register_autograd(backward, setup_context)
    ops = torch.ops.altup_cupy_probe
    return {"custom_op": ops.via_custom_op.default, "Library": ops.via_library.default,
            "Operator": ops.via_operator.default}, library


def _us_per_call(call, number: int) -> float:
    call()
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def measure(device: str, number: int = 2000) -> list[dict]:
    """One row per registration and autograd setting: the best of 5 repeats of `number` calls."""
    from .. import torch as altup

    probes, _ = _probe_ops()
    x, w = torch.randn(4, 1, 1, 64, device=device), torch.randn(4, device=device)
    rows = []
    for name, op in probes.items():
        for autograd in (False, True):
            leaf = x.clone().requires_grad_(autograd)
            rows.append(dict(registration=name, autograd=int(autograd),
                             us_per_call=round(_us_per_call(lambda: op(leaf, w, 1, 1e-6), number), 2)))
    streams = x.to(torch.bfloat16)
    P, Q = torch.randn(16, 4, device=device).bfloat16(), torch.randn(4, 4, device=device).bfloat16()
    R, nw = torch.randn(4, 64, device=device).bfloat16(), torch.ones(64, device=device).bfloat16()
    for autograd in (False, True):
        h = streams.clone().requires_grad_(autograd)
        rows.append(dict(registration="altup_cupy.torch.predict", autograd=int(autograd),
                         us_per_call=round(_us_per_call(lambda: altup.predict(h, P, R, nw, 1), number), 2)))
        rows.append(dict(registration="altup_cupy.torch.correct", autograd=int(autograd),
                         us_per_call=round(_us_per_call(lambda: altup.correct(h, h[1], Q, R, nw, 1), number), 2)))
    return rows


def main(argv=None) -> int:
    from .paths import results_dir
    from .bench import run_info, write_csv

    parser = argparse.ArgumentParser(prog="python -m altup_cupy.lab.op_registration",
                                     description=__doc__.split("\n\n")[0])  # the first paragraph
    parser.add_argument("--out", type=Path, default=None, help="the CSV (default: results/<gpu or cpu>/...)")
    args = parser.parse_args(argv)
    if args.out is not None and args.out.is_dir():  # found now, not after the timing
        parser.error(f"--out {args.out} is a folder: give the CSV file")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    info = run_info()
    rows = [dict(row, device=name, git_sha=info["git_sha"], date=info["date"]) for row in measure(device)]
    for row in rows:
        print(f"{row['registration']:>26}  autograd={row['autograd']}  {row['us_per_call']:8.2f} us/call")
    out = args.out if args.out is not None else results_dir(name) / "op_registration.csv"
    write_csv(rows, out, COLUMNS)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
