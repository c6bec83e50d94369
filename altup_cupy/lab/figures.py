"""Every figure of the project, regenerated from the recorded CSV files alone (no GPU, seconds).

    from altup_cupy.lab.figures import regenerate
    regenerate("results/nvidia-h200", "figures")      # -> list of the PNG paths written

Inputs: `results/<gpu>/bench_{op}_{suite}.csv` (schema `bench.CSV_COLUMNS`); the ceilings come from
`altup_cupy.lab.ceilings`. An op or suite whose CSV is absent is skipped with a message; nothing else
is read. Output PNGs are deterministic: the same CSVs and the same
matplotlib give byte-identical files (no software tag or timestamp in the PNG, fixed rcParams),
so a test can check that `figures/` is what the committed data regenerates.

Figures (one file each, one message each):
- `roofline_{op}.png`: where every implementation of one op sits under the H200's ceilings. An op
  that reaches the compute roof on some workload is placed at (FLOP / compulsory byte, achieved
  TFLOP/s) under the datasheet and measured rooflines; a memory-bound op (its FLOP count is
  nominal) at (compulsory bytes of the workload, achieved TB/s) under the HBM and copy rates.
- `latency_{op}_{suite}.png`: median latency (p10..p90 bars) against tokens, every implementation,
  with the speed-of-light time; one panel per (N, H).
- `pct_sol_{op}_{suite}.png`: % of the datasheet speed of light per workload, every implementation.
- `vs_floor_{op}_{suite}.png`: each version of ours as a multiple of the op's floor (`OP_FLOORS`:
  the GEMMs alone for the collapse, a device copy of the compulsory bytes for the backward)
  against tokens; 1x is the floor.
- `bandwidth_{op}_{suite}.png` (memory-bound ops only): achieved TB/s of compulsory traffic
  against tokens for every version of our kernel and the copy floor, under the measured copy rate.

Styles are derived, not listed: every implementation gets its own hue and marker, from the palette
of its role (ours: warm hues by version number, the default red; PyTorch: blues; floors: greys)
at a slot fixed by its name, so a new version or baseline needs no edit here and keeps its look
from figure to figure.
"""

from __future__ import annotations

import math
import re
import statistics
import zlib
from pathlib import Path
from typing import Callable, Iterable, Sequence

from .._extras import require
from .bench import csv_path, read_csv
from .ceilings import H200
from .paths import FIGURES_DIR, RECORDED_RESULTS_DIR
from .workloads import OPS, SUITES

OURS = "altup_cupy"  # the implementation every speedup is measured for
# The default's kernel called through torch.ops: in a plot of points it lies under the default's.
OPERATOR_ENTRY = f"{OURS}_op"
OP_TITLES = {"collapse": "collapse forward", "predict_correct_backward": "predict-correct backward"}
# The floor each op is measured against: the collapse's GEMMs alone (its epilogue is what it adds),
# and a device copy of the backward's compulsory bytes (it can do no less traffic).
OP_FLOORS = {"collapse": "cublas_gemms_fp32out", "predict_correct_backward": "copy_floor"}
# What each baseline is, in a few words for legends (an implementation without an entry is shown
# by its name alone).
IMPL_DESCRIPTIONS = {
    "torch_eager_fp32": "fp32 GEMMs",
    "torch_eager_bf16gemm": "bf16-out GEMMs",
    "torch_compile_bf16gemm": "bf16-out GEMMs",
    "cublas_gemms_fp32out": "cuBLASLt GEMMs alone",
    "bmm_gemms_fp32out": "torch.bmm GEMMs alone",
    "cupy_cublas_gemms_fp32out": "CuPy cuBLAS GEMMs alone",
    "torch_eager": "derived backward",
    "torch_autograd": "fp32",
    "torch_compile": "fp32 backward",
    "copy_floor": "copy of the compulsory bytes",
}
# Hues far apart within and across roles: our versions take warm and mid hues by version number
# (no two reds), the default is the one red, PyTorch is blue, floors are grey.
_DEFAULT_STYLE = ("#d62728", "o")
_VERSION_COLORS = ("#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#b8860b", "#1b9e77")
_VERSION_MARKERS = ("s", "^", "D", "v", "P", "X", "*", "h")
_ROLE_PALETTES = {  # (colours, markers) of the implementations without a version number
    "ours": (("#2ca02c", "#000080"), ("p", "H")),
    "pytorch": (("#1f77b4", "#6baed6", "#08306b", "#4292c6"), ("<", ">", "d", "8")),
    "floor": (("#404040", "#7f7f7f", "#a6a6a6"), ("d", "p", "8")),
}  # filled markers only: a hollow one marks the Gemma 3n suite in the roofline
_VERSION_PATTERN = re.compile(rf"^{OURS}_v(\d+)$")
DPI = 110
_RC = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 8,
    "figure.dpi": DPI,
    "savefig.dpi": DPI,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "svg.hashsalt": "altup_cupy",
    "path.simplify": True,
}


# ----------------------------------------------------------------------------------------------
# data


def impl_role(impl: str) -> str:
    """'ours' (this package's kernels), 'pytorch' (a PyTorch baseline) or 'floor' (a reference
    that is timed but not checked, e.g. the cuBLAS GEMMs alone or a device copy)."""
    if impl.startswith("altup_cupy"):
        return "ours"
    if impl.startswith("torch_"):
        return "pytorch"
    return "floor"


def impl_version(impl: str) -> int | None:
    """N for an earlier version kept in the benchmark (`altup_cupy_vN`), else None (the default
    `altup_cupy` dispatches to the newest version that supports the shape)."""
    match = _VERSION_PATTERN.match(impl)
    return int(match.group(1)) if match else None


def impl_label(impl: str) -> str:
    """A legend entry, a few words long: the name, and what a baseline is or that it is a floor."""
    if impl == OURS:
        return f"{impl} (default)"
    words = [IMPL_DESCRIPTIONS[impl]] if impl in IMPL_DESCRIPTIONS else []
    if impl_role(impl) == "floor":
        words.insert(0, "floor")
    return f"{impl} ({': '.join(words)})" if words else impl


def _float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _passed(value) -> bool | None:
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    return None  # unchecked (a floor) or not recorded


def parse_rows(rows: Iterable[dict]) -> list[dict]:
    """CSV rows (all strings) -> rows with numbers, booleans and a workload key."""
    out = []
    for raw in rows:
        row = dict(raw)
        for key in ("N", "H", "batch_size", "seq_len", "tokens"):
            row[key] = int(float(raw[key]))
        for key in ("median_us", "wall_us", "p10_us", "p90_us", "sol_us", "pct_sol", "tflops", "tbps",
                    "match_ratio", "rel_l2"):
            row[key] = _float(raw.get(key))
        row["passed"] = _passed(raw.get("passed"))
        row["workload"] = (row["N"], row["H"], row["batch_size"], row["seq_len"])
        out.append(row)
    return out


def load_results(results_dir: Path | str = RECORDED_RESULTS_DIR, log: Callable[[str], None] = print
                 ) -> dict[tuple[str, str], list[dict]]:
    """{(op, suite): parsed rows} for every CSV present; absent ones are reported and skipped."""
    found = {}
    for op in OPS:
        for suite in SUITES:
            path = csv_path(op, suite, Path(results_dir))
            if not path.is_file():
                log(f"figures: no {path.name} in {results_dir}: skipping {op} / {suite}")
                continue
            rows = parse_rows(read_csv(path))
            if not rows:
                log(f"figures: {path.name} has no rows: skipping {op} / {suite}")
                continue
            found[(op, suite)] = rows
    return found


def provenance(rows: Sequence[dict]) -> str:
    """'NVIDIA H200, 2026-12-02, git abc123' from the rows' gpu, date and git_sha columns."""
    gpus = sorted({r.get("gpu", "") for r in rows if r.get("gpu")})
    days = sorted({str(r.get("date", ""))[:10] for r in rows if r.get("date")})
    shas = sorted({r.get("git_sha", "") for r in rows if r.get("git_sha")})
    gpu = " / ".join(gpus) or "unknown GPU"
    day = (days[0] if len(days) == 1 else f"{days[0]} .. {days[-1]}") if days else "undated"
    sha = f", git {', '.join(shas)}" if shas and len(shas) <= 2 else ""
    return f"{gpu}, measured {day}{sha}"


def impl_order(rows: Sequence[dict]) -> list[str]:
    """Implementations in a stable order: ours first, then PyTorch baselines, then floors."""
    rank = {"ours": 0, "pytorch": 1, "floor": 2}
    first_seen = {}
    for i, r in enumerate(rows):
        first_seen.setdefault(r["impl"], i)
    return sorted(first_seen, key=lambda name: (rank[impl_role(name)], name != OURS, first_seen[name]))


def style_map(impls: Iterable[str]) -> dict[str, tuple[str, str]]:
    """(colour, marker) per implementation. The default is red with circles; `altup_cupy_vN` takes
    slot N - 1 of the version palettes; any other name takes a slot of its role's palettes chosen
    by a hash of the name (the next free one on a collision, in name order). Styles follow the
    names, not a hand-kept list."""
    names = sorted(set(impls))
    styles = {}
    for name in names:
        if name == OURS:
            styles[name] = _DEFAULT_STYLE
        elif (version := impl_version(name)) is not None:
            slot = (version - 1) % len(_VERSION_COLORS)
            styles[name] = (_VERSION_COLORS[slot], _VERSION_MARKERS[slot])
    for role, (colors, markers) in _ROLE_PALETTES.items():
        taken: set[int] = set()
        for name in (n for n in names if impl_role(n) == role and n not in styles):
            slot = zlib.crc32(name.encode()) % len(colors)
            for step in range(len(colors)):
                if (slot + step) % len(colors) not in taken:
                    slot = (slot + step) % len(colors)
                    break
            taken.add(slot)
            styles[name] = (colors[slot], markers[slot % len(markers)])
    return styles


def _zorder(impl: str) -> int:
    """The default's points on top of the other implementations'."""
    return 4 if impl == OURS else 3


def color_map(impls: Iterable[str]) -> dict[str, str]:
    """The colour of each implementation (`style_map`)."""
    return {name: color for name, (color, _) in style_map(impls).items()}


def workloads_by_tokens(rows: Sequence[dict]) -> list[tuple]:
    keys = {r["workload"]: r["tokens"] for r in rows}
    return sorted(keys, key=lambda k: (keys[k], k))


def workload_label(key: tuple, with_nh: bool = False) -> str:
    n, h, b, s = key
    base = f"{b}x{s}"
    return f"N{n} H{h} {base}" if with_nh else base


def geomean(values: Iterable[float]) -> float:
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(statistics.fmean(math.log(v) for v in vals)) if vals else math.nan


# ----------------------------------------------------------------------------------------------
# plotting


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def style():
    """A context in which matplotlib has the figures' settings (defaults + `_RC`), whatever the
    caller's rcParams: every figure function is meant to run inside it."""
    import contextlib

    import matplotlib

    @contextlib.contextmanager
    def context():
        with matplotlib.rc_context():
            matplotlib.rcdefaults()
            matplotlib.rcParams.update(_RC)
            yield

    return context()


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The legends are outside the layout (`_legend_outside`): name them so that the tight box,
    # which grows the saved figure, still holds them.
    legends = [legend for ax in fig.axes if (legend := ax.get_legend()) is not None]
    extra = fig.get_default_bbox_extra_artists() + legends
    # No "Software" tag and no timestamp: byte-identical output for identical inputs.
    fig.savefig(path, format="png", dpi=DPI, metadata={"Software": None}, bbox_inches="tight",
                bbox_extra_artists=extra, pad_inches=0.15)
    _pyplot().close(fig)
    return path


def _legend_outside(ax, handles=None, labels=None):
    """A legend right of the axes, so that it never covers data. It takes no part in the layout:
    the axes keep the figure's width, and the saved figure grows to fit the legend."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    legend = ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
                       framealpha=0.92)
    legend.set_in_layout(False)


def _fastest_rows(rows: Sequence[dict], column: str) -> dict[tuple, dict]:
    """{(op, workload): its row with the largest `column` (> 0)}. The CSV rounds tflops to
    0.1 TFLOP/s and tbps to 0.001 TB/s, so the fastest row holds the most digits of the workload's
    FLOP or byte count (column x median_us)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["op"], r["workload"])
        if r[column] > 0 and r["median_us"] > 0 and (key not in best or r[column] > best[key][column]):
            best[key] = r
    return best


def roofline_points(rows: Sequence[dict]) -> list[tuple[dict, float, float]]:
    """(row, FLOP per compulsory byte, achieved TFLOP/s) for every row that can be placed.

    A workload's FLOP count and intensity are the same for all its implementations; both are taken
    from its fastest row: FLOP = tflops * median_us * 1e6, intensity = tflops / tbps. Each row's
    throughput is then FLOP / its own median_us, which keeps slow baselines (whose own tflops may
    round to 0.0) exact. Rows of a workload without a FLOP count are not placed.
    """
    best = {k: r for k, r in _fastest_rows(rows, "tflops").items() if r["tbps"] > 0}
    points = []
    for r in rows:
        ref = best.get((r["op"], r["workload"]))
        if ref is None or not r["median_us"] > 0:
            continue
        flop_e6 = ref["tflops"] * ref["median_us"]  # FLOP / 1e6
        points.append((r, ref["tflops"] / ref["tbps"], flop_e6 / r["median_us"]))
    return points


def bandwidth_points(rows: Sequence[dict]) -> list[tuple[dict, float, float]]:
    """(row, compulsory bytes of its workload, achieved TB/s) for every row that can be placed;
    the byte count from the workload's fastest row, the rate from each row's own median_us."""
    best = _fastest_rows(rows, "tbps")
    points = []
    for r in rows:
        ref = best.get((r["op"], r["workload"]))
        if ref is None or not r["median_us"] > 0:
            continue
        nbytes = ref["tbps"] * ref["median_us"] * 1e6
        points.append((r, nbytes, nbytes / r["median_us"] / 1e6))
    return points


def memory_bound_ops(rows: Sequence[dict]) -> set[str]:
    """The ops below the datasheet ridge point on every workload (or without a FLOP count): their
    FLOP count does not bound them, so they are shown by bytes."""
    ridge = H200.bf16_flops / H200.hbm_bytes_per_s
    reaches_roof = {r["op"] for r, intensity, _ in roofline_points(rows) if intensity >= ridge}
    return {r["op"] for r, _, _ in bandwidth_points(rows)} - reaches_roof


def _roofline_panel(ax, points: list) -> None:
    """Axes, datasheet and measured ceilings of FLOP/s against FLOP per byte, sized to `points`."""
    peak, bw = H200.bf16_flops / 1e12, H200.hbm_bytes_per_s / 1e12
    measured_peak, measured_bw = H200.cublas_bf16_flops / 1e12, H200.copy_bytes_per_s / 1e12
    ridge = peak / bw
    intensity = [x for _, x, _ in points]
    lo = 10 ** math.floor(math.log10(min(min(intensity), ridge) / 2))
    hi = 10 ** math.ceil(math.log10(max(max(intensity), ridge) * 4))
    xs = [lo * (hi / lo) ** (i / 400) for i in range(401)]
    ax.plot(xs, [min(peak, bw * x) for x in xs], color="black", lw=1.8,
            label=f"datasheet: {peak:.1f} TFLOP/s, {bw:.1f} TB/s")
    ax.plot(xs, [min(measured_peak, measured_bw * x) for x in xs], color="black", lw=1.4, ls="--",
            label=f"measured: {measured_peak:.1f} TFLOP/s, {measured_bw:.2f} TB/s")
    ax.axvline(ridge, color="black", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ymin = 10 ** math.floor(math.log10(min(y for _, _, y in points) / 2))
    ax.set_ylim(ymin, peak * 3)
    # Label on the ridge line, above the roof (nothing is plotted there).
    ax.annotate(f"ridge point\n{ridge:.0f} FLOP/B", (ridge, peak * 1.15), xytext=(-6, 0),
                textcoords="offset points", ha="right", va="bottom", fontsize=9,
                bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "0.6"})
    ax.set_xlabel("arithmetic intensity (FLOP per compulsory byte of HBM traffic)")
    ax.set_ylabel("achieved throughput (TFLOP/s)")


def _bytes_panel(ax, points: list) -> None:
    """Axes and bandwidth ceilings of TB/s against the workload's compulsory MB, sized to `points`."""
    bw, copy = H200.hbm_bytes_per_s / 1e12, H200.copy_bytes_per_s / 1e12
    ax.axhline(bw, color="black", lw=1.8, label=f"datasheet HBM3e: {bw:.1f} TB/s")
    ax.axhline(copy, color="black", lw=1.4, ls="--", label=f"measured device copy: {copy:.2f} TB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ymin = 10 ** math.floor(math.log10(min(y for _, _, y in points) / 2))
    ax.set_ylim(ymin, bw * 3)
    ax.set_xlabel("compulsory HBM traffic of the workload (MB)")
    ax.set_ylabel("achieved bandwidth (TB/s of compulsory bytes)")


def plot_roofline(op: str, results: dict, path: Path) -> Path | None:
    """Every implementation of `op` (rows of every suite in `results`) under the ceilings: by FLOPs
    if the op reaches the compute roof on some workload, else by bytes. None if no row of `op` can
    be placed."""
    from matplotlib.lines import Line2D

    plt = _pyplot()
    rows = [r for (row_op, _), rs in sorted(results.items()) if row_op == op for r in rs]
    if op in memory_bound_ops(rows):
        points, panel, view = [(r, x / 1e6, y) for r, x, y in bandwidth_points(rows)], _bytes_panel, "bytes"
    else:
        points, panel, view = roofline_points(rows), _roofline_panel, "FLOPs"
    if not points:
        return None
    impls = [impl for impl in impl_order([r for r, _, _ in points]) if impl != OPERATOR_ENTRY]
    styles = style_map(impls)
    suites = sorted({r["suite"] for r, _, _ in points}, key=lambda s: s != "benchmark")
    fig, ax = plt.subplots(figsize=(7.2, 6.0))
    panel(ax, points)
    for suite in suites:
        for impl in impls:
            pts = [(x, y) for r, x, y in points if (r["suite"], r["impl"]) == (suite, impl)]
            if pts:
                color, marker = styles[impl]
                ax.scatter([x for x, _ in pts], [y for _, y in pts], marker=marker, s=36, linewidths=1.1,
                           facecolors=color if suite == suites[0] else "none", edgecolors=color, alpha=0.9,
                           zorder=_zorder(impl))
    handles, labels = ax.get_legend_handles_labels()
    for impl in impls:
        color, marker = styles[impl]
        handles.append(Line2D([], [], ls="", marker=marker, color=color, markersize=7))
        labels.append(impl_label(impl))
    if len(suites) > 1:  # fill tells the suites apart only when both are drawn
        for suite in suites:
            filled = suite == suites[0]
            handles.append(Line2D([], [], ls="", marker="o", color="0.3", markersize=7,
                                  markerfacecolor="0.3" if filled else "none"))
            labels.append(f"{'filled' if filled else 'hollow'}: {suite} suite")
    _legend_outside(ax, handles, labels)
    unplaced = len(rows) - len(points)
    note = f"; {unplaced} rows without a count not placed" if unplaced else ""
    ax.set_title(f"{OP_TITLES.get(op, op)}: every implementation, placed by {view}\n"
                 f"{provenance(rows)}{note}")
    fig.tight_layout()
    return _save(fig, path)


def _per_shape_panels(plt, rows: Sequence[dict]):
    """One panel per (N, H) of `rows`: [(axis, (N, H), the rows of that shape)] and the figure."""
    shapes = sorted({(r["N"], r["H"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes) + 1.5, 5.6), squeeze=False)
    return fig, [(ax, shape, [r for r in rows if (r["N"], r["H"]) == shape]) for ax, shape in zip(axes[0], shapes)]


def _finish_panels(fig, panels, title: str, rows: Sequence[dict], path: Path) -> Path:
    """The shared end of the per-workload-group figures: the legend beside the last panel, the
    title with the run's provenance, then the file."""
    _legend_outside(panels[-1][0])
    fig.suptitle(f"{title}\n{provenance(rows)}")
    fig.tight_layout()
    return _save(fig, path)


def plot_latency(op: str, suite: str, rows: Sequence[dict], path: Path) -> Path:
    """Every implementation's time against tokens (the operator entry, the default's kernel, left
    out: its line would lie under the default's), one panel per (N, H)."""
    plt = _pyplot()
    impls = [impl for impl in impl_order(rows) if impl != OPERATOR_ENTRY]
    styles = style_map(impls)
    fig, panels = _per_shape_panels(plt, rows)
    for ax, (n, h), sub in panels:
        for impl in impls:
            pts = sorted((r for r in sub if r["impl"] == impl), key=lambda r: r["tokens"])
            if not pts:
                continue
            x = [r["tokens"] for r in pts]
            y = [r["median_us"] for r in pts]
            err = [[max(0.0, r["median_us"] - r["p10_us"]) for r in pts],
                   [max(0.0, r["p90_us"] - r["median_us"]) for r in pts]]
            failed = any(r["passed"] is False for r in pts)
            role = impl_role(impl)
            color, marker = styles[impl]
            ax.errorbar(x, y, yerr=err, color=color, marker=marker, ms=4, lw=1.6 if role == "ours" else 1.1,
                        zorder=_zorder(impl),
                        ls=":" if role == "floor" else "-", capsize=2,
                        label=impl_label(impl) + (" [fails tolerance]" if failed else ""))
        sol = {r["tokens"]: r["sol_us"] for r in sub}
        xs = sorted(sol)
        ax.plot(xs, [sol[x] for x in xs], color="black", ls="--", lw=1.2, label="speed of light (H200 datasheet)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens M = batch_size x seq_len")
        ax.set_ylabel("median latency (µs), bars p10..p90")
        ax.set_title(f"N={n}, H={h}")
    return _finish_panels(fig, panels, f"{OP_TITLES.get(op, op)}: latency vs tokens ({suite} suite)", rows, path)


def plot_bandwidth(op: str, suite: str, rows: Sequence[dict], path: Path) -> Path | None:
    """TB/s of compulsory traffic against tokens: every version of ours and the floors, under the
    datasheet bandwidth and the measured copy rate (the PyTorch baselines are in the latency figure)."""
    plt = _pyplot()
    points = [p for p in bandwidth_points(rows) if impl_role(p[0]["impl"]) != "pytorch"]
    if not any(impl_role(r["impl"]) == "ours" for r, _, _ in points):
        return None
    impls = impl_order([r for r, _, _ in points])
    styles = style_map(impls)
    rate = {id(r): tbps for r, _, tbps in points}
    fig, panels = _per_shape_panels(plt, [r for r, _, _ in points])
    bw, copy = H200.hbm_bytes_per_s / 1e12, H200.copy_bytes_per_s / 1e12
    for ax, (n, h), sub in panels:
        ax.axhline(bw, color="black", lw=1.8, label=f"datasheet HBM3e: {bw:.1f} TB/s")
        ax.axhline(copy, color="black", lw=1.4, ls="--", label=f"measured device copy: {copy:.2f} TB/s")
        for impl in impls:
            pts = sorted((r for r in sub if r["impl"] == impl), key=lambda r: r["tokens"])
            if pts:
                color, marker = styles[impl]
                ax.plot([r["tokens"] for r in pts], [rate[id(r)] for r in pts], color=color, marker=marker,
                        ms=4, zorder=_zorder(impl), lw=2.0 if impl == OURS else 1.3,
                        ls=":" if impl_role(impl) == "floor" else "-",
                        label=impl_label(impl))
        ax.set_xscale("log")
        ax.set_ylim(0, bw * 1.08)
        ax.set_xlabel("tokens M = batch_size x seq_len")
        ax.set_ylabel("achieved bandwidth (TB/s of compulsory bytes)")
        ax.set_title(f"N={n}, H={h}")
    title = f"{OP_TITLES.get(op, op)}: bandwidth per version vs the copy rate ({suite} suite)"
    return _finish_panels(fig, panels, title, rows, path)


def _grouped_bars(ax, keys, series, colors, hatches=None):
    """series: list of (label, color_key, [value per key]); one group of bars per key."""
    width = 0.8 / max(1, len(series))
    for i, (label, ckey, values) in enumerate(series):
        xs = [k + (i - (len(series) - 1) / 2) * width for k in range(len(keys))]
        bars = ax.bar(xs, [v if math.isfinite(v) else 0.0 for v in values], width=width,
                      color=colors[ckey], label=label, edgecolor="white", linewidth=0.4)
        if hatches is not None:
            for bar, hatch in zip(bars, hatches[i]):
                if hatch:
                    bar.set_hatch("////")
                    bar.set_edgecolor("black")


def plot_pct_sol(op: str, suite: str, rows: Sequence[dict], path: Path) -> Path:
    plt = _pyplot()
    impls = impl_order(rows)
    colors = color_map(impls)
    keys = workloads_by_tokens(rows)
    with_nh = len({k[:2] for k in keys}) > 1
    by = {(r["impl"], r["workload"]): r for r in rows}
    series, hatches = [], []
    for impl in impls:
        vals = [by[(impl, k)]["pct_sol"] if (impl, k) in by else math.nan for k in keys]
        fails = [(impl, k) in by and by[(impl, k)]["passed"] is False for k in keys]
        finite = [v for v in vals if math.isfinite(v)]
        mean = f", mean {statistics.fmean(finite):.1f}%" if finite else ""
        series.append((impl_label(impl) + mean, impl, vals))
        hatches.append(fails)
    fig, ax = plt.subplots(figsize=(min(16.0, max(9.0, 0.45 * len(keys) * max(1, len(impls)) / 3 + 5)), 6.0))
    _grouped_bars(ax, keys, series, colors, hatches)
    ax.axhline(100, color="black", lw=1.0, ls="--", label="speed of light (100%)")
    if any(any(h) for h in hatches):
        from matplotlib.patches import Patch

        handles, labels = ax.get_legend_handles_labels()
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="////"))
        labels.append("hatched: fails the tolerance rule")
        _legend_outside(ax, handles, labels)
    else:
        _legend_outside(ax)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([workload_label(k, with_nh) for k in keys], rotation=45, ha="right")
    ax.set_xlabel("workload (batch_size x seq_len), sorted by tokens")
    ax.set_ylabel("% of speed of light (T_SOL / T_measured)")
    top = max([v for _, _, vals in series for v in vals if math.isfinite(v)] + [100.0])
    ax.set_ylim(0, top * 1.25)
    ax.set_title(f"{OP_TITLES.get(op, op)}: % of speed of light per workload ({suite} suite)\n{provenance(rows)}")
    fig.tight_layout()
    return _save(fig, path)


def our_versions(rows: Sequence[dict]) -> list[str]:
    """Our kernel versions in the rows, oldest first: `altup_cupy_vN` by N, then the default (the
    operator entry `altup_cupy_op`, the default's kernel behind torch.ops, is no version)."""
    ours = {r["impl"] for r in rows if r["impl"] == OURS or impl_version(r["impl"]) is not None}
    return sorted(ours, key=lambda i: (i == OURS, impl_version(i) or 0))


def plot_vs_floor(op: str, suite: str, rows: Sequence[dict], path: Path) -> Path | None:
    """Each version of ours as a multiple of the op's floor (`OP_FLOORS`) against tokens, one
    panel per (N, H): how far each version is from the least the op can cost. None when the rows
    hold no floor or no version of ours."""
    plt = _pyplot()
    floor = OP_FLOORS.get(op)
    floor_us = {r["workload"]: r["median_us"] for r in rows if r["impl"] == floor and r["median_us"] > 0}
    versions = our_versions(rows)
    placed = [r for r in rows if r["impl"] in versions and r["workload"] in floor_us and r["median_us"] > 0]
    if not placed:
        return None
    styles = style_map(versions)
    fig, panels = _per_shape_panels(plt, placed)
    for ax, (n, h), sub in panels:
        ax.axhline(1.0, color="black", lw=1.4, ls="--", label=f"1x: {floor} (floor)")
        for impl in versions:
            pts = sorted((r for r in sub if r["impl"] == impl), key=lambda r: r["tokens"])
            if pts:
                color, marker = styles[impl]
                ax.plot([r["tokens"] for r in pts], [r["median_us"] / floor_us[r["workload"]] for r in pts],
                        color=color, marker=marker, ms=5, lw=2.0 if impl == OURS else 1.3, label=impl_label(impl))
        ax.set_xscale("log")
        ax.set_ylim(0, max(r["median_us"] / floor_us[r["workload"]] for r in placed) * 1.1)
        ax.set_xlabel("tokens M = batch_size x seq_len")
        ax.set_ylabel("multiple of the floor (µs / floor µs)")
        ax.set_title(f"N={n}, H={h}")
    return _finish_panels(fig, panels, f"{OP_TITLES.get(op, op)}: each version against its floor ({suite} suite)",
                          rows, path)


def regenerate(results_dir: Path | str = RECORDED_RESULTS_DIR, out_dir: Path | str = FIGURES_DIR,
               log: Callable[[str], None] = print) -> list[Path]:
    """Write every figure that the CSVs in `results_dir` support into `out_dir`; return the paths."""
    matplotlib = require("matplotlib", "figures")
    matplotlib.use("Agg", force=True)
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    results = load_results(results_dir, log)
    if not results:
        log(f"figures: no bench_*.csv in {results_dir}: nothing to draw")
        return []
    written: list[Path] = []
    with style():
        for op in sorted({op for op, _ in results}):
            path = plot_roofline(op, results, out_dir / f"roofline_{op}.png")
            if path:
                written.append(path)
        for (op, suite), rows in sorted(results.items()):
            written.append(plot_latency(op, suite, rows, out_dir / f"latency_{op}_{suite}.png"))
            written.append(plot_pct_sol(op, suite, rows, out_dir / f"pct_sol_{op}_{suite}.png"))
            path = plot_vs_floor(op, suite, rows, out_dir / f"vs_floor_{op}_{suite}.png")
            if path:
                written.append(path)
            else:
                log(f"figures: {op} / {suite} has no {OP_FLOORS.get(op)} rows or no version of {OURS}: "
                    "no figure against the floor")
            if op in memory_bound_ops(rows):
                path = plot_bandwidth(op, suite, rows, out_dir / f"bandwidth_{op}_{suite}.png")
                if path:
                    written.append(path)
    return written
