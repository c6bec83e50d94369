"""Where a whole-model step's peak memory goes: the allocations alive at the peak, grouped by origin.

    python scripts/trace_peak_memory.py --task train --mode reduce_overhead --shape 1x256
    python scripts/trace_peak_memory.py --task prefill --mode compile --patched 1 --steps 3

For each model (transformers' own code, then patched by altup_cupy, or the one `--patched` names), the
step of `altup_cupy.lab.gemma3n_model.make_step` runs `--steps` times with torch's allocator
recording its history (Python stacks); the script prints each step's peak over the memory allocated
before the first (what gemma3n_model.csv's `peak_mib` takes for reduce_overhead: the warm-up steps'
largest), then, at the largest total of live allocations in the trace, those allocations summed by
where they were made: an altup_cupy line, an inductor-generated kernel, a transformers line, or the
first frames of the stack. Each model starts as the benchmark's cases do (`gemma3n_model._release`).
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

from altup_cupy.lab import gemma3n_model as gm

ORIGINS = (("altup_cupy/", "altup_cupy"), ("torchinductor", "inductor"), ("transformers/", "transformers"))


def origin(frames: list[dict]) -> str:
    """The first frame of a recognised origin, in ORIGINS' order of preference; else the first three."""
    for marker, label in ORIGINS:
        for frame in frames:
            if marker in frame["filename"]:
                return f"{label} {frame['filename'].split('/')[-1]}:{frame['line']} {frame['name']}"
    return " | ".join(f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames[:3])


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """(the largest sum of live allocations over `trace`, the allocations live then)."""
    live, total, peak, at_peak = {}, 0, 0, []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    return peak, at_peak


def trace_model(args: argparse.Namespace, patched: bool) -> None:
    gm._release()
    model = gm.build_model(args.config, patched=patched)
    step = gm.make_step(model, args.task, args.mode, *args.shape)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    peaks = []
    try:
        for _ in range(args.steps):
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peaks.append((torch.cuda.max_memory_allocated() - before) / 2**20)
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    label = f"{args.config} {args.task} {args.mode} {'patched' if patched else 'unpatched'} {args.shape[0]}x{args.shape[1]}"
    print(f"{label}: peak of each step over the memory before the first: "
          + ", ".join(f"{p:.1f}" for p in peaks) + " MiB")
    peak, alive = live_at_peak(trace)
    print(f"  at the trace's peak, {peak / 2**20:.1f} MiB allocated during the trace, {len(alive)} allocations:")
    by_origin = collections.Counter()
    for event in alive:
        by_origin[origin(event.get("frames", []))] += event["size"]
    for where, size in by_origin.most_common(args.top):
        print(f"    {size / 2**20:9.2f} MiB  {where}")
    del model, step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=gm.CONFIGS, default="mini")
    parser.add_argument("--task", choices=gm.TASKS, default="train")
    parser.add_argument("--mode", choices=gm.MODES, default="reduce_overhead")
    parser.add_argument("--shape", type=lambda text: gm._parse_shapes(text)[0], default=(1, 256),
                        help="BATCHxSEQ (default 1x256)")
    parser.add_argument("--patched", type=int, choices=(0, 1), default=None, help="one model only (default both)")
    parser.add_argument("--steps", type=int, default=4, help="steps traced (the first ones compile and record)")
    parser.add_argument("--top", type=int, default=14, help="origins listed")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    for patched in ((0, 1) if args.patched is None else (args.patched,)):
        trace_model(args, bool(patched))
    return 0


if __name__ == "__main__":
    sys.exit(main())
