"""Markdown results tables from the recorded CSVs, and the README section built from them.

    from altup_cupy import report
    print(report.markdown_tables("results/nvidia-h200"))      # every op and suite present
    report.update_readme("README.md", "results/nvidia-h200")  # rewrites between the markers only

Per op and suite, one row per workload (sorted by tokens): each implementation's median µs
(✗ marks a run that fails the tolerance rule), the datasheet speed-of-light time, our % of it,
our speedup over the fastest PyTorch baseline that passes the tolerance on that workload, and
whether ours passes. The last row holds the means: arithmetic over workloads for the µs columns
and for % of SOL, geometric for the speedup, and the count of passing workloads.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from typing import Sequence

from ._paths import FIGURES_DIR, RECORDED_RESULTS_DIR
from .bench import csv_path, read_csv
from .figures import (OP_TITLES, OURS, geomean, impl_order, impl_role, parse_rows,
                      provenance, workloads_by_tokens)
from .workloads import OPS, SUITES

BEGIN_MARKER = "<!-- results:begin -->"
END_MARKER = "<!-- results:end -->"
README_FIGURES = ("roofline.png", "speedup_collapse_benchmark.png",
                  "speedup_predict_correct_backward_benchmark.png")


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
        n, h, b, s = line["workload"]
        label = f"N{n} H{h} {b}×{s}" if with_nh else f"{b}×{s}"
        cells = [label, str(line["tokens"])]
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


def _pct(value: float) -> str:
    return f"{value:.1f}%" if math.isfinite(value) else "—"


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
                "workloads passing.")
    return "\n\n".join(parts) + "\n"


def readme_section(results_dir: Path | str = RECORDED_RESULTS_DIR, figures_dir: Path | str = FIGURES_DIR,
                   readme_dir: Path | str | None = None) -> str:
    """The generated README section: the main figures (those present) and every table."""
    figures_dir = Path(figures_dir)
    readme_dir = Path(readme_dir) if readme_dir is not None else figures_dir.parent
    lines = ["<!-- generated by `python -m altup_cupy figures --update-readme`; do not edit by hand -->", ""]
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
