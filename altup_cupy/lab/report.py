"""Markdown results tables from the recorded CSVs, and the README section built from them.

    from altup_cupy import report
    print(report.markdown_tables("results/nvidia-h200"))      # every op and suite present
    report.update_readme("README.md", "results/nvidia-h200")  # rewrites between the markers only

Per op and suite, one row per workload (sorted by tokens): each implementation's median µs
(✗ marks a run that fails the tolerance rule), the datasheet speed-of-light time, our % of it,
our speedup over the fastest PyTorch baseline that passes the tolerance on that workload, and
whether ours passes. The last row holds the means: arithmetic over workloads for the µs columns
and for % of SOL, geometric for the speedup, and the count of passing workloads. Below it,
`gpu_and_wall_table` sets each implementation's GPU time (`median_us`) beside its wall time
(`wall_us`, host included), or a line says that the CSV has no wall time.

For a memory-bound op, `bandwidth_table` gives every implementation's TB/s of compulsory traffic
per workload against the measured copy rate, and `progression_table` each version of ours
(`altup_cupy_vN` rows, then the default) at a small, a medium and a large M: µs, TB/s and % of
the copy floor (the `copy_floor` rows: the same bytes through a device copy).

`headline_table(op)` is the progression every notebook and the README (`readme_section`) open
with: each version of ours over the whole suite (mean µs, multiple of the op's floor, % of SOL,
TFLOP/s or TB/s, workloads passing), headed by the op's one number, the default's mean µs and
multiple of the floor.
"""

from __future__ import annotations

import importlib
import math
import os
import statistics
from pathlib import Path
from typing import Sequence

from .bench import csv_path, read_csv
from .ceilings import H200
from .figures import (OP_FLOORS, OP_TITLES, OURS, bandwidth_points, geomean, impl_order, impl_role,
                      impl_version, memory_bound_ops, our_versions, parse_rows, provenance, roofline_points,
                      workloads_by_tokens)
from .paths import FIGURES_DIR, RECORDED_RESULTS_DIR
from .workloads import OPS, SUITES

BEGIN_MARKER = "<!-- results:begin -->"
END_MARKER = "<!-- results:end -->"
README_FIGURES = ("roofline_collapse.png", "vs_floor_collapse_benchmark.png",
                  "roofline_predict_correct_backward.png", "vs_floor_predict_correct_backward_benchmark.png")
WALL_NOT_RECORDED = "not recorded"  # CSVs of runs before the benchmark measured wall_us


def _us(value: float) -> str:
    if not math.isfinite(value):
        return "—"
    return f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


def best_baseline(by: dict, key: tuple) -> dict | None:
    """The fastest PyTorch baseline row that passes the tolerance on workload `key`."""
    passing = [r for (impl, k), r in by.items() if k == key and impl_role(impl) == "pytorch" and r["passed"]]
    return min(passing, key=lambda r: r["median_us"]) if passing else None


def table_data(rows: Sequence[dict]) -> dict:
    """The numbers behind one table: {'impls', 'rows': [...], 'means': {...}} (parsed rows in)."""
    impls = impl_order(rows)
    by = {(r["impl"], r["workload"]): r for r in rows}
    lines = []
    for key in workloads_by_tokens(rows):
        ours = by.get((OURS, key))
        base = best_baseline(by, key)
        any_row = next(r for (i, k), r in by.items() if k == key)
        lines.append({
            "workload": key,
            "tokens": any_row["tokens"],
            "us": {i: by[(i, key)]["median_us"] if (i, key) in by else math.nan for i in impls},
            "failed": {i: (i, key) in by and by[(i, key)]["passed"] is False for i in impls},
            "sol_us": any_row["sol_us"],
            "pct_sol": ours["pct_sol"] if ours else math.nan,
            "speedup": base["median_us"] / ours["median_us"] if ours and base else math.nan,
            "baseline": base["impl"] if base else None,
            "passed": ours["passed"] if ours else None,
        })

    def mean(values):
        vals = [v for v in values if math.isfinite(v)]
        return statistics.fmean(vals) if vals else math.nan

    means = {
        "us": {i: mean(line["us"][i] for line in lines) for i in impls},
        "sol_us": mean(line["sol_us"] for line in lines),
        "pct_sol": mean(line["pct_sol"] for line in lines),
        "speedup": geomean(line["speedup"] for line in lines),
        "passed": sum(line["passed"] is True for line in lines),
        "checked": sum(line["passed"] is not None for line in lines),
    }
    return {"impls": impls, "rows": lines, "means": means}


def results_table(rows: Sequence[dict]) -> str:
    """One markdown table (parsed rows of one op and suite)."""
    data = table_data(rows)
    impls = data["impls"]
    with_nh = len({line["workload"][:2] for line in data["rows"]}) > 1
    head = (["workload" + (" (N, H, B×S)" if with_nh else " (B×S)"), "tokens"]
            + [f"{i} µs" + (" (floor)" if impl_role(i) == "floor" else "") for i in impls]
            + ["SOL µs", f"{OURS} % of SOL", "speedup vs best passing PyTorch", f"{OURS} passes"])
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 2) + [":---:"]) + "|"]
    for line in data["rows"]:
        cells = [_workload_cell(line["workload"], with_nh), str(line["tokens"])]
        cells += [_us(line["us"][i]) + (" ✗" if line["failed"][i] else "") for i in impls]
        speed = (f"{line['speedup']:.2f}× ({line['baseline']})" if math.isfinite(line["speedup"]) else "—")
        verdict = {True: "pass", False: "**FAIL**", None: "—"}[line["passed"]]
        cells += [_us(line["sol_us"]), _pct(line["pct_sol"]), speed, verdict]
        out.append("| " + " | ".join(cells) + " |")
    m = data["means"]
    cells = ["**mean**", ""] + [_us(m["us"][i]) for i in impls]
    speed = f"{m['speedup']:.2f}× (geomean)" if math.isfinite(m["speedup"]) else "—"
    cells += [_us(m["sol_us"]), _pct(m["pct_sol"]), speed, f"{m['passed']}/{m['checked']}"]
    out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _has_wall(row: dict) -> bool:
    return math.isfinite(row.get("wall_us", math.nan))


def gpu_and_wall_table(rows: Sequence[dict]) -> str:
    """Per implementation: GPU time and wall time (what one call costs a program, host included),
    as means over the workloads and at the smallest and the largest M. Empty for CSVs recorded
    before the benchmark measured wall time; a wall time some of whose rows lack it (CSVs of
    several runs) reads "not recorded"."""
    if not any(_has_wall(r) for r in rows):
        return ""
    tokens = sorted({r["tokens"] for r in rows})
    head = ["implementation", "mean GPU µs", "mean wall µs", f"GPU / wall µs at M = {tokens[0]}",
            f"GPU / wall µs at M = {tokens[-1]}"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]

    def wall(some: Sequence[dict]) -> str:
        if not all(_has_wall(r) for r in some):
            return WALL_NOT_RECORDED
        return _us(statistics.fmean(r["wall_us"] for r in some))

    for impl in impl_order(rows):
        mine = [r for r in rows if r["impl"] == impl]
        at = {r["tokens"]: r for r in mine}

        def pair(m):
            r = at.get(m)
            return f"{_us(r['median_us'])} / {wall([r])}" if r else "—"
        cells = [impl, _us(statistics.fmean(r["median_us"] for r in mine)), wall(mine),
                 pair(tokens[0]), pair(tokens[-1])]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _pct(value: float) -> str:
    return f"{value:.1f}%" if math.isfinite(value) else "—"


def _workload_cell(key: tuple, with_nh: bool) -> str:
    n, h, b, s = key
    return f"N{n} H{h} {b}×{s}" if with_nh else f"{b}×{s}"


COPY_FLOOR = OP_FLOORS["predict_correct_backward"]  # the device copy of an op's compulsory bytes


def bandwidth_data(rows: Sequence[dict]) -> dict:
    """{'impls', 'rows': [{'workload', 'tokens', 'tbps': {impl: TB/s}}], 'means': {impl: TB/s}}: the
    TB/s of compulsory traffic of every implementation on every workload (figures.bandwidth_points)."""
    impls = impl_order(rows)
    rate = {(r["impl"], r["workload"]): tbps for r, _, tbps in bandwidth_points(rows)}
    tokens = {r["workload"]: r["tokens"] for r in rows}
    lines = [{"workload": key, "tokens": tokens[key],
              "tbps": {i: rate.get((i, key), math.nan) for i in impls}} for key in workloads_by_tokens(rows)]
    means = {i: statistics.fmean(v) if (v := [line["tbps"][i] for line in lines
                                              if math.isfinite(line["tbps"][i])]) else math.nan for i in impls}
    return {"impls": impls, "rows": lines, "means": means}


def bandwidth_table(rows: Sequence[dict]) -> str:
    """Markdown: TB/s of every implementation per workload, and the default's % of the copy rate."""
    data = bandwidth_data(rows)
    impls, copy = data["impls"], H200.copy_bytes_per_s / 1e12
    with_nh = len({line["workload"][:2] for line in data["rows"]}) > 1
    head = ["workload", "tokens"] + [f"{i} TB/s" for i in impls] + [f"{OURS} % of the {copy:.2f} TB/s copy rate"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for line in data["rows"] + [{"workload": None, "tokens": "", "tbps": data["means"]}]:
        label = "**mean**" if line["workload"] is None else _workload_cell(line["workload"], with_nh)
        cells = [label, str(line["tokens"])] + [_tbps(line["tbps"][i]) for i in impls]
        cells.append(_pct(100 * line["tbps"].get(OURS, math.nan) / copy))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _tbps(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else "—"


def progression_shapes(rows: Sequence[dict]) -> list[tuple]:
    """Three workloads of the most common (N, H): the smallest, the middle and the largest M."""
    shapes = [r["workload"][:2] for r in rows]
    common = max(set(shapes), key=lambda nh: (shapes.count(nh), nh))
    keys = [k for k in workloads_by_tokens(rows) if k[:2] == common]
    picks = [keys[0], keys[(len(keys) - 1) // 2], keys[-1]]
    return list(dict.fromkeys(picks))


def progression_data(rows: Sequence[dict]) -> dict:
    """Per version of ours (oldest first, then the copy floor) and per progression shape: µs, TB/s
    and % of the copy floor (copy_floor µs / its µs: 100% = the copy's pace); plus each one's mean
    µs over every workload of the CSV."""
    by = {(r["impl"], r["workload"]): r for r in rows}
    rate = {(r["impl"], r["workload"]): tbps for r, _, tbps in bandwidth_points(rows)}
    shapes = progression_shapes(rows)
    keys = workloads_by_tokens(rows)
    floor = [COPY_FLOOR] if any(r["impl"] == COPY_FLOOR for r in rows) else []
    table = []
    for impl in our_versions(rows) + floor:
        cells = []
        for key in shapes:
            row, copy = by.get((impl, key)), by.get((COPY_FLOOR, key))
            us = row["median_us"] if row else math.nan
            cells.append({"us": us, "tbps": rate.get((impl, key), math.nan),
                          "pct_copy_floor": 100 * copy["median_us"] / us if row and copy else math.nan})
        mean = [by[(impl, k)]["median_us"] for k in keys if (impl, k) in by]
        table.append({"impl": impl, "cells": cells, "mean_us": statistics.fmean(mean) if mean else math.nan,
                      "workloads": len(mean)})
    return {"shapes": shapes, "rows": table}


def progression_table(rows: Sequence[dict]) -> str:
    """Markdown: one row per version of ours (and the copy floor), µs / TB/s / % of the copy floor
    at three shapes, and the mean µs over all workloads."""
    data = progression_data(rows)
    head = ["version"]
    for n, h, b, s in data["shapes"]:
        head += [f"M={b * s} µs", "TB/s", "% of copy floor"]
    head.append("mean µs (workloads)")
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    suffix = {OURS: " (default)", COPY_FLOOR: " (device copy)"}
    for line in data["rows"]:
        cells = [line["impl"] + suffix.get(line["impl"], "")]
        for cell in line["cells"]:
            cells += [_us(cell["us"]), _tbps(cell["tbps"]), _pct(cell["pct_copy_floor"])]
        cells.append(f"{_us(line['mean_us'])} ({line['workloads']})")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def dropped_versions(op: str, impls: Sequence[str]) -> list[str]:
    """The `altup_cupy_v<n>` names among `impls` whose version `op`'s registry
    (`altup_cupy.ops.<op>_versions`) no longer has: a recorded run keeps the lines of a version
    measured before it was dropped."""
    registered = importlib.import_module(f"altup_cupy.ops.{op}_versions").VERSIONS
    return sorted(name for name in set(impls) if impl_version(name) not in (None, *registered))


def headline_data(op: str, rows: Sequence[dict]) -> dict:
    """Per version of ours (`our_versions`: `altup_cupy_v<n>` by n, then the default), then the op's
    floor, over every workload of `rows`: mean µs, that mean as a multiple of the floor's mean µs,
    mean % of SOL, mean rate, workloads passing. The rate is TB/s of compulsory traffic for a
    memory-bound op, else TFLOP/s (both exact from `bandwidth_points` / `roofline_points`, not the
    CSV's rounded columns)."""
    memory_bound = op in memory_bound_ops(rows)
    points = bandwidth_points(rows) if memory_bound else roofline_points(rows)
    rate = {(r["impl"], r["workload"]): value for r, _, value in points}
    floor = OP_FLOORS[op]
    dropped = set(dropped_versions(op, [r["impl"] for r in rows]))
    floor_rows = [r for r in rows if r["impl"] == floor]
    floor_us = statistics.fmean(r["median_us"] for r in floor_rows) if floor_rows else math.nan
    lines = []
    for impl in our_versions(rows) + ([floor] if floor_rows else []):
        mine = [r for r in rows if r["impl"] == impl]
        mean_us = statistics.fmean(r["median_us"] for r in mine)
        rates = [rate[(impl, r["workload"])] for r in mine if (impl, r["workload"]) in rate]
        lines.append({"impl": impl, "dropped": impl in dropped, "mean_us": mean_us, "x_floor": mean_us / floor_us,
                      "pct_sol": statistics.fmean(r["pct_sol"] for r in mine),
                      "rate": statistics.fmean(rates) if rates else math.nan,
                      "passed": sum(r["passed"] is True for r in mine),
                      "checked": sum(r["passed"] is not None for r in mine), "workloads": len(mine)})
    return {"floor": floor, "rate_unit": "TB/s" if memory_bound else "TFLOP/s", "rows": lines,
            "provenance": provenance(rows)}


def _headline_rows(op: str, results_dir: Path | str) -> list[dict]:
    path = csv_path(op, "benchmark", Path(results_dir))
    if not path.is_file():
        raise FileNotFoundError(f"no recorded benchmark suite for {op}: {path} does not exist")
    return parse_rows(read_csv(path))


def _sentence(op: str, data: dict) -> str:
    """'collapse forward: `altup_cupy` 295.1 µs mean over 16 workloads, 1.18× its floor (...)'."""
    top = next(line for line in data["rows"] if line["impl"] == OURS)
    return (f"{OP_TITLES.get(op, op)}: `{OURS}` {_us(top['mean_us'])} µs mean over {top['workloads']} workloads, "
            f"{top['x_floor']:.2f}× its floor (`{data['floor']}`)")


def headline_table(op: str, results_dir: Path | str = RECORDED_RESULTS_DIR, heading_level: int = 3) -> str:
    """Markdown: the headline sentence as a heading, a caption naming the run (GPU, date, commit),
    and one row per version of ours and the floor (`headline_data`) over the benchmark suite;
    versions the registry dropped are marked."""
    data = headline_data(op, _headline_rows(op, results_dir))
    unit = data["rate_unit"]
    head = ["version", "mean µs", "× floor", "mean % of SOL", f"mean {unit}", "workloads passing"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for line in data["rows"]:
        name = f"`{line['impl']}`" + {OURS: " (default)", data["floor"]: " (floor)"}.get(line["impl"], "")
        if line["dropped"]:
            name += " (dropped from the registry)"
        rate = f"{line['rate']:.3f}" if unit == "TB/s" else f"{line['rate']:.1f}"
        passing = f"{line['passed']}/{line['checked']}" if line["checked"] else "not checked"
        out.append(f"| {name} | {_us(line['mean_us'])} | {line['x_floor']:.2f}× | {_pct(line['pct_sol'])} | "
                   f"{rate} | {passing} |")
    caption = (f"{data['provenance']}; benchmark suite, means over its workloads; × floor: the version's mean µs "
               f"over that of `{data['floor']}`")
    if any(line["dropped"] for line in data["rows"]):
        caption += "; a dropped version's code is in git history"
    return f"{'#' * heading_level} Headline: {_sentence(op, data)}\n\n{caption}.\n\n" + "\n".join(out)


def _wall_section(rows: Sequence[dict]) -> str:
    table = gpu_and_wall_table(rows)
    if not table:
        return ("\n\nWall time (`wall_us`: one call on an idle GPU, host time included): "
                f"{WALL_NOT_RECORDED} in this CSV; the µs above are GPU time (`median_us`).")
    return ("\n\nGPU time (above) is what the kernels take when the host issues work ahead of the GPU "
            "(a training step, a CUDA graph, back-to-back calls); wall time is what one call costs a "
            "program that waits for it: CUDA events around the call with the GPU idle before it, host "
            "time included. At small M the host's share dominates the wall time.\n\n" + table)


def markdown_tables(results_dir: Path | str = RECORDED_RESULTS_DIR, heading_level: int = 3) -> str:
    """Every op and suite with a CSV in `results_dir`, as markdown; absent ones are named."""
    parts = []
    hashes = "#" * heading_level
    for op in OPS:
        for suite in SUITES:
            path = csv_path(op, suite, Path(results_dir))
            title = f"{hashes} {OP_TITLES.get(op, op)}, {suite} suite"
            if not path.is_file():
                parts.append(f"{title}\n\nNo recorded results ({path.name} is absent).")
                continue
            rows = parse_rows(read_csv(path))
            if not rows:
                parts.append(f"{title}\n\nNo rows in {path.name}.")
                continue
            parts.append(
                f"{title}\n\n{provenance(rows)}; median of timed calls, L2 flushed before each; "
                f"SOL = H200 datasheet speed of light.\n\n{results_table(rows)}\n\n"
                "✗: fails the benchmark's tolerance rule (≥ 99% of elements within atol + rtol·|ref|). "
                "Mean row: arithmetic means over workloads (µs, % of SOL), geometric mean (speedup), "
                "workloads passing." + _wall_section(rows))
    return "\n\n".join(parts) + "\n"


def readme_section(results_dir: Path | str = RECORDED_RESULTS_DIR, figures_dir: Path | str = FIGURES_DIR,
                   readme_dir: Path | str | None = None) -> str:
    """The generated README section: the main figures (those present) and every table."""
    figures_dir = Path(figures_dir)
    readme_dir = Path(readme_dir) if readme_dir is not None else figures_dir.parent
    lines = ["<!-- generated by `python -m altup_cupy figures --update-readme`; do not edit by hand -->", ""]
    for op in OPS:
        if csv_path(op, "benchmark", Path(results_dir)).is_file():
            lines += [headline_table(op, results_dir), ""]
    for name in README_FIGURES:
        path = figures_dir / name
        if path.is_file():
            rel = Path(os.path.relpath(path, readme_dir)).as_posix()
            lines.append(f"![{path.stem}]({rel})")
            lines.append("")
    lines.append(markdown_tables(results_dir).rstrip())
    return "\n".join(lines) + "\n"


def replace_between_markers(text: str, section: str, begin: str = BEGIN_MARKER, end: str = END_MARKER) -> str:
    """`text` with everything between the two markers replaced by `section` (markers kept)."""
    start = text.find(begin)
    stop = text.find(end, start + len(begin)) if start >= 0 else -1
    if start < 0 or stop < 0:
        raise ValueError(f"README markers {begin!r} and {end!r} not found (in that order)")
    return text[: start + len(begin)] + "\n" + section.strip("\n") + "\n" + text[stop:]


def update_readme(readme: Path | str, results_dir: Path | str = RECORDED_RESULTS_DIR,
                  figures_dir: Path | str = FIGURES_DIR) -> bool:
    """Rewrite the README's section between the markers from the CSVs; True if it changed."""
    readme = Path(readme)
    text = readme.read_text()
    new = replace_between_markers(text, readme_section(results_dir, figures_dir, readme.parent))
    if new != text:
        readme.write_text(new)
    return new != text
