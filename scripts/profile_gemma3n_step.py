"""Where the host time of one Gemma 3n step goes: transformers' own code, the patch, and the patch
with its kernels left out.

    python3 scripts/profile_gemma3n_step.py --out-dir results/nvidia-h200/profile_1x256

For each task (train, prefill) under torch.compile it builds the `mini` model of
`altup_cupy.lab.gemma3n_model` three times: unpatched, patched, and patched with the launchers of
`altup_cupy.gemma3n_kernels` replaced by bare allocations of their outputs (the operators' dispatch,
validation and autograd stay; no kernel and no cuBLAS call is issued). The wall time of a step
(median of 20, synchronised) of each shows what the patch's kernels cost the host: unpatched vs
patched is the patch's net effect, patched vs no-kernels is the launchers' own share. Then eager
prefill, patched and not (host-bound at this size). The stub's outputs are garbage: its rows time
the host, never the results. For the unpatched and patched compiled steps it also writes
`prof_<task>_<variant>.txt`: torch.profiler's operator table (CPU time) and a cProfile of five steps
with the backward on the calling thread (`torch.autograd.set_multithreading_enabled(False)`, so
cProfile sees it). Both profilers add their own cost per call: compare the files with each other,
not with the wall times.

    python3 scripts/profile_gemma3n_step.py --kernels --batch 8 --seq 1024 --out-dir DIR

With --kernels it instead profiles the GPU side of the compiled train and prefill steps, unpatched and
patched: `kernels_<task>_<variant>.txt` lists every kernel's total GPU time over five steps, and
the summary line gives a step's span on the GPU (first kernel start to last kernel end), the time
some kernel ran, and the idle rest (where the GPU waited for the host).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from altup_cupy import gemma3n_kernels
from altup_cupy.lab import gemma3n_model

LAUNCHERS = ("predict_forward", "correct_forward", "predict_backward", "correct_backward", "expand_forward",
             "expand_backward", "collapse_backward")
REAL_LAUNCHERS = {name: getattr(gemma3n_kernels, name) for name in LAUNCHERS}


def _square(weights):
    """[N-1, H, H], like the stacked weight gradients."""
    hidden = weights[0].shape[-1]
    return weights[0].new_empty((len(weights), hidden, hidden))


# What each launcher returns, allocated and never written.
BARE_LAUNCHERS = {
    "predict_forward": lambda h, *_: torch.empty_like(h),
    "correct_forward": lambda p, *_: torch.empty_like(p),
    "predict_backward": lambda g, h, coefs, router, norm, *_: tuple(map(torch.empty_like, (h, coefs, router, norm))),
    "correct_backward": lambda g, p, x, coefs, router, norm, *_: tuple(map(torch.empty_like, (p, x, coefs, router,
                                                                                              norm))),
    "expand_forward": lambda e, weights, _floor: (
        e.new_empty((len(weights) + 1, *e.shape)),
        e.new_empty((*e.shape[:-1], len(weights), e.shape[-1]), dtype=torch.float32)),
    "expand_backward": lambda g, e, weights, _projected, _floor: (torch.empty_like(e), _square(weights)),
    "collapse_backward": lambda g, h, weights, _floor: (torch.empty_like(h), _square(weights)),
}


def _use_launchers(launchers: dict) -> None:
    for name, function in launchers.items():
        setattr(gemma3n_kernels, name, function)


def _wall_ms(step, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def _write_profiles(step, path: Path) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    text = [averages.table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=70),
            "\nby self CPU time\n", averages.table(sort_by="self_cpu_time_total", row_limit=30,
                                                   max_name_column_width=70)]
    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        profiler.enable()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumtime").print_stats(60)
    text += ["\ncProfile of 5 steps, the backward on the calling thread\n", stream.getvalue()]
    path.write_text("".join(text))


def _kernel_profile(step, path: Path, steps: int = 5) -> str:
    """GPU kernels of `steps` steps: a table by total GPU time into `path`; returns the per-step
    span / busy / idle summary (CUDA-graph replays are profiled as the kernels they launch)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            with torch.profiler.record_function("step"):
                step()
            torch.cuda.synchronize()
    events = prof.events()
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.device_time_total > 0 and e.name != "step"), key=lambda e: e.time_range.start)
    totals: dict[str, list[float]] = {}
    for e in kernels:
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0] += e.time_range.elapsed_us()
        entry[1] += 1
    # Each step is synchronised inside its "step" range, so its kernels start within that range;
    # from the range's start (the GPU idle, as in a program's step) to its last kernel's end, the
    # union of kernel intervals is the busy time and the rest is time the GPU waited for the host.
    ranges = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.name == "step" and e.device_type == torch.autograd.DeviceType.CPU)
    span = busy = 0.0
    for first, last in ranges:
        mine = [e for e in kernels if first <= e.time_range.start <= last]
        if not mine:
            continue
        end = first
        for e in mine:
            busy += max(0.0, e.time_range.end - max(e.time_range.start, end))
            end = max(end, e.time_range.end)
        span += end - first
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in totals.values())
    lines = [f"{'GPU us/step':>12} {'calls/step':>10} {'share':>6}  kernel"]
    lines += [f"{t / steps:12.1f} {n / steps:10.1f} {100 * t / total:5.1f}%  {name[:150]}" for name, (t, n) in rows]
    path.write_text("\n".join(lines) + "\n")
    count = max(len(ranges), 1)
    return (f"GPU per step: kernels {total / steps / 1e3:.2f} ms, span {span / count / 1e3:.2f}, "
            f"busy {busy / count / 1e3:.2f}, idle {(span - busy) / count / 1e3:.2f}")


def run_case(task: str, mode: str, variant: str, batch: int, seq: int, out_dir: Path | None,
             kernels: bool = False) -> str:
    gemma3n_model._release()
    counters.clear()
    _use_launchers(BARE_LAUNCHERS if variant == "no-kernels" else REAL_LAUNCHERS)
    try:
        model = gemma3n_model.build_model("mini", patched=variant != "unpatched")
        step = gemma3n_model.make_step(model, task, mode, batch, seq)
        for _ in range(3):
            step()
        wall = _wall_ms(step)
        graphs = counters["stats"].get("unique_graphs", 0)
        breaks = sum(counters["graph_break"].values())
        detail = ""
        if kernels:
            detail = ", " + _kernel_profile(step, out_dir / f"kernels_{task}_{variant}_{batch}x{seq}.txt")
        elif out_dir is not None and mode != "eager" and variant != "no-kernels":
            _write_profiles(step, out_dir / f"prof_{task}_{variant}.txt")
    finally:
        _use_launchers(REAL_LAUNCHERS)
    return f"{task:8s} {mode:8s} {variant:10s} {batch}x{seq}: wall {wall:7.2f} ms, graphs {graphs}, breaks {breaks}{detail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # the first paragraph
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--out-dir", type=Path, default=None, help="where the profiles go (none: no profiles)")
    parser.add_argument("--kernels", action="store_true",
                        help="GPU kernel tables of the compiled steps, unpatched and patched (needs --out-dir)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: needs a CUDA GPU\n")
    if args.kernels and args.out_dir is None:
        parser.error("--kernels writes its tables into --out-dir")
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    if args.kernels:
        for task in ("train", "prefill"):
            for variant in ("unpatched", "patched"):
                print(run_case(task, "compile", variant, args.batch, args.seq, args.out_dir, kernels=True), flush=True)
        return
    for task in ("train", "prefill"):
        for variant in ("unpatched", "patched", "no-kernels"):
            print(run_case(task, "compile", variant, args.batch, args.seq, args.out_dir), flush=True)
    for variant in ("unpatched", "patched"):
        print(run_case("prefill", "eager", variant, args.batch, args.seq, None), flush=True)


if __name__ == "__main__":
    main()
