"""Where the host time of one Gemma 3n step goes: transformers' own code, the patch, and the patch
with its kernels left out.

    python3 scripts/profile_gemma3n_step.py --out-dir results/nvidia-h200/profile_1x256

For each task (train, prefill) under torch.compile it builds the `mini` model of
`altup_cupy.lab.gemma3n_model` three times: unpatched, patched, and patched with the launchers of
`altup_cupy.ops.gemma3n_altup_versions` replaced by bare allocations of their outputs (the operators' dispatch,
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

    python3 scripts/profile_gemma3n_step.py --in-step [--batch 1 --seq 256]

With --in-step it measures the compiled train step, unpatched and patched: the wall time of 30
synchronised steps (median, p10, p90, every sample sorted), with Python's garbage collector on and
off; then, in 30 more steps of the patched model, the host time spent inside each of the package's
functions that a step calls (the launchers of `gemma3n_altup_versions`, the Gemma operators' bodies and
their fast shape check, the collapse's CUDA path), per step and per call. A call inside a step costs
more than the same call repeated back to back (`scripts/host_breakdown.py`): between two of its calls
the rest of the step runs, and the caches the call's code and data sat in hold other things.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import pstats
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from altup_cupy.ops import gemma3n_altup, gemma3n_altup_versions
from altup_cupy.lab import gemma3n_model
from altup_cupy.ops import collapse as collapse_op

LAUNCHERS = ("predict_forward", "correct_forward", "predict_backward", "correct_backward", "expand_forward",
             "expand_backward", "collapse_backward")
REAL_LAUNCHERS = {name: getattr(gemma3n_altup_versions, name) for name in LAUNCHERS}


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
        setattr(gemma3n_altup_versions, name, function)


def _wall_ms(step, reps: int = 20) -> float:
    return statistics.median(gemma3n_model._wall_times(step, reps, cuda=True))


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


# The package's functions a patched step calls, timed by --in-step: (module, function name).
IN_STEP_FUNCTIONS = ([(gemma3n_altup_versions, name) for name in LAUNCHERS]
                     + [(gemma3n_altup, name) for name in ("_predict_forward", "_correct_forward", "_kernels_take")]
                     + [(collapse_op, "_run_cuda")])


def _wall_samples(step, reps: int = 30) -> str:
    times = gemma3n_model._wall_times(step, reps, cuda=True)
    p10, p90 = gemma3n_model.p10_p90(times)
    return (f"median {statistics.median(times):7.2f} ms, p10 {p10:7.2f}, p90 {p90:7.2f}; sorted: "
            + " ".join(f"{t:.1f}" for t in sorted(times)))


def _host_time_inside(step, steps: int = 30) -> list[str]:
    """Lines: each IN_STEP_FUNCTIONS function's host time per step and per call over `steps`
    back-to-back steps (the functions are wrapped by a timer for the duration, then restored; the
    outer ones include the inner ones they call)."""
    totals: dict[str, list] = {}
    originals = [(module, name, getattr(module, name)) for module, name in IN_STEP_FUNCTIONS]

    def timed(key, function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                entry = totals.setdefault(key, [0.0, 0])
                entry[0] += time.perf_counter() - start
                entry[1] += 1
        return wrapper

    for module, name, function in originals:
        setattr(module, name, timed(f"{module.__name__.removeprefix('altup_cupy.')}.{name}", function))
    try:
        for _ in range(2):
            step()
        totals.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - start) / steps
    finally:
        for module, name, function in originals:
            setattr(module, name, function)
    lines = [f"  timed: {wall:.2f} ms a step, back to back"]
    for key, (seconds, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {key:40s} {1e3 * seconds / steps:7.3f} ms/step {calls / steps:5.1f} calls/step "
                     f"{1e6 * seconds / calls:7.1f} us/call")
    return lines


def in_step(batch: int, seq: int) -> None:
    for variant in ("unpatched", "patched"):
        gemma3n_model._release()
        model = gemma3n_model.build_model("mini", patched=variant == "patched")
        step = gemma3n_model.make_step(model, "train", "compile", batch, seq)
        for _ in range(4):
            step()
        print(f"train compile {variant:9s} {batch}x{seq}, gc on:  {_wall_samples(step)}", flush=True)
        gc.collect()
        gc.disable()
        try:
            print(f"train compile {variant:9s} {batch}x{seq}, gc off: {_wall_samples(step)}", flush=True)
        finally:
            gc.enable()
        if variant == "patched":
            print("\n".join(_host_time_inside(step)), flush=True)
        del model, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # the first paragraph
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--out-dir", type=Path, default=None, help="where the profiles go (none: no profiles)")
    parser.add_argument("--kernels", action="store_true",
                        help="GPU kernel tables of the compiled steps, unpatched and patched (needs --out-dir)")
    parser.add_argument("--in-step", action="store_true",
                        help="the compiled train step's wall time, and the host time of the package's functions "
                             "inside it (module docstring)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: needs a CUDA GPU\n")
    if args.kernels and args.out_dir is None:
        parser.error("--kernels writes its tables into --out-dir")
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    if args.in_step:
        in_step(args.batch, args.seq)
        return
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
