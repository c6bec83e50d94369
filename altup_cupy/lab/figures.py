"""Every figure of the project, regenerated from the recorded CSV files alone (no GPU, seconds).

    from altup_cupy.lab.figures import regenerate
    regenerate("results/nvidia-h200", "figures")      # -> list of the PNG paths written

Inputs: `results/<gpu>/bench_{op}_{suite}.csv` (schema `bench.CSV_COLUMNS`); the ceilings come from
`altup_cupy.lab.ceilings`. An op or suite whose CSV is absent is skipped with a message; nothing else
is read. Output PNGs are deterministic: the same CSVs and the same
matplotlib give byte-identical files (no software tag or timestamp in the PNG, fixed rcParams),
so a test can check that `figures/` is what the committed data regenerates.

Figures (one file each):
- `roofline.png`: left, the H200 roofline, log-log, datasheet and measured ceilings, every row of
  the ops that reach the compute roof placed at (FLOP / compulsory byte, achieved TFLOP/s); right,
  the ops that are memory-bound on every workload (their FLOP count is nominal) placed by bytes:
  (compulsory bytes of the workload, achieved TB/s) under the HBM and copy ceilings.
- `latency_{op}_{suite}.png`: median latency (p10..p90 bars) against tokens, every implementation,
  with the speed-of-light time; one panel per (N, H).
- `pct_sol_{op}_{suite}.png`: % of the datasheet speed of light per workload, every implementation.
- `speedup_{op}_{suite}.png`: our kernel's speedup over each PyTorch baseline per workload
  (hatched where that baseline fails the tolerance rule).
- `bandwidth_{op}_{suite}.png` (memory-bound ops only): achieved TB/s of compulsory traffic
  against tokens for every version of our kernel and the copy floor, under the measured copy rate.

Colours are derived, not listed: our versions are shades of one red by version number (the default
darkest), baselines and floors take palette entries by name, so a new version or baseline needs no
edit here.
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
OP_TITLES = {"collapse": "collapse forward", "predict_correct_backward": "predict-correct backward"}
# What each baseline is, for legends (an implementation without an entry is shown by its name).
IMPL_DESCRIPTIONS = {
    "torch_eager_fp32": "PyTorch eager fp32 = CUDA-core fp32 GEMMs",
    "torch_eager_bf16gemm": "PyTorch eager, bf16-output GEMMs",
    "torch_compile_bf16gemm": "torch.compile, bf16-output GEMMs",
    "cublas_gemms_fp32out": "cuBLASLt bf16->fp32 GEMMs alone",
    "bmm_gemms_fp32out": "torch.bmm bf16->fp32 GEMMs alone",
    "cupy_cublas_gemms_fp32out": "CuPy's cuBLAS bf16->fp32 GEMMs alone",
    "torch_eager": "PyTorch eager fp32, derived backward",
    "torch_autograd": "PyTorch autograd fp32",
    "torch_compile": "torch.compile of the fp32 backward",
    "copy_floor": "device copy of the compulsory bytes",
}
_BASELINE_PALETTE = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22", "#e377c2", "#aec7e8")
_FLOOR_PALETTE = ("#404040", "#7f7f7f", "#a6a6a6")
_OURS_COLORMAP = "Reds"
_VERSION_PATTERN = re.compile(rf"^{OURS}_v(\d+)$")
OP_MARKERS = {"collapse": "o", "predict_correct_backward": "s"}
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
    role = impl_role(impl)
    if impl == OURS:
        return f"{impl} (ours, default)"
    if role == "ours":
        return f"{impl} (ours, version {impl_version(impl)})" if impl_version(impl) else f"{impl} (ours)"
    text = f"{impl}: {IMPL_DESCRIPTIONS[impl]}" if impl in IMPL_DESCRIPTIONS else impl
    return f"{text} (floor, unchecked)" if role == "floor" else text


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


def color_map(impls: Iterable[str]) -> dict[str, str]:
    """A colour per implementation: ours in shades of red (older versions lighter, the default the
    darkest), PyTorch baselines and floors from their palettes by a hash of the name (the next free
    entry on a collision, in name order), so colours follow the names, not a hand-kept list."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    names = sorted(set(impls))
    ours = sorted((n for n in names if impl_role(n) == "ours"),
                  key=lambda n: (n == OURS, impl_version(n) or 0, n))
    shades = colormaps[_OURS_COLORMAP]
    colors = {n: to_hex(shades(0.35 + 0.55 * i / max(1, len(ours) - 1))) for i, n in enumerate(ours)}
    for role, palette in (("pytorch", _BASELINE_PALETTE), ("floor", _FLOOR_PALETTE)):
        taken: set[int] = set()
        for name in (n for n in names if impl_role(n) == role):
            slot = zlib.crc32(name.encode()) % len(palette)
            for step in range(len(palette)):
                if (slot + step) % len(palette) not in taken:
                    slot = (slot + step) % len(palette)
                    break
            taken.add(slot)
            colors[name] = palette[slot]
    return colors


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
    # No "Software" tag and no timestamp: byte-identical output for identical inputs.
    fig.savefig(path, format="png", dpi=DPI, metadata={"Software": None}, bbox_inches="tight",
                pad_inches=0.15)
    _pyplot().close(fig)
    return path


def _legend_outside(ax, handles=None, labels=None):
    """A legend right of the axes, so that it never covers data (the saved figure grows to fit)."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
              framealpha=0.92)


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


def _scatter_by_impl(ax, results: dict, points: list, impls: Sequence[str], colors: dict) -> None:
    for op, suite in sorted(results):
        for impl in impls:
            pts = [(x, y) for r, x, y in points if (r["op"], r["suite"], r["impl"]) == (op, suite, impl)]
            if pts:
                filled = suite == "benchmark"
                ax.scatter([x for x, _ in pts], [y for _, y in pts], marker=OP_MARKERS.get(op, "^"), s=34,
                           linewidths=1.1, facecolors=colors[impl] if filled else "none",
                           edgecolors=colors[impl], alpha=0.9, zorder=3)


def _roofline_panel(ax, results: dict, points: list, impls: Sequence[str], colors: dict) -> None:
    """FLOP/s against FLOP per byte under the datasheet and measured ceilings."""
    peak, bw = H200.bf16_flops / 1e12, H200.hbm_bytes_per_s / 1e12
    measured_peak, measured_bw = H200.cublas_bf16_flops / 1e12, H200.copy_bytes_per_s / 1e12
    ridge = peak / bw
    intensity = [x for _, x, _ in points]
    lo = 10 ** math.floor(math.log10(min(min(intensity), ridge) / 2))
    hi = 10 ** math.ceil(math.log10(max(max(intensity), ridge) * 4))
    xs = [lo * (hi / lo) ** (i / 400) for i in range(401)]
    ax.plot(xs, [min(peak, bw * x) for x in xs], color="black", lw=1.8,
            label=f"datasheet: {peak:.1f} TFLOP/s bf16, {bw:.1f} TB/s HBM3e")
    ax.plot(xs, [min(measured_peak, measured_bw * x) for x in xs], color="black", lw=1.4, ls="--",
            label=f"measured: {measured_peak:.1f} TFLOP/s (cuBLAS 8192³), {measured_bw:.2f} TB/s (device copy)")
    ax.axvline(ridge, color="black", lw=0.6, ls=":")
    _scatter_by_impl(ax, results, points, impls, colors)
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
    ax.set_title("FLOP view (ops that reach the compute roof)")


def _bytes_panel(ax, results: dict, points: list, impls: Sequence[str], colors: dict) -> None:
    """TB/s against the workload's compulsory bytes under the datasheet and copy bandwidths."""
    bw, copy = H200.hbm_bytes_per_s / 1e12, H200.copy_bytes_per_s / 1e12
    ax.axhline(bw, color="black", lw=1.8, label=f"datasheet HBM3e: {bw:.1f} TB/s")
    ax.axhline(copy, color="black", lw=1.4, ls="--", label=f"measured device copy: {copy:.2f} TB/s")
    _scatter_by_impl(ax, results, [(r, x / 1e6, y) for r, x, y in points], impls, colors)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ymin = 10 ** math.floor(math.log10(min(y for _, _, y in points) / 2))
    ax.set_ylim(ymin, bw * 3)
    ax.set_xlabel("compulsory HBM traffic of the workload (MB)")
    ax.set_ylabel("achieved bandwidth (TB/s of compulsory bytes)")
    ax.set_title("byte view (memory-bound ops: the FLOP count is nominal)")


def plot_roofline(results: dict, path: Path) -> Path | None:
    plt = _pyplot()
    rows = [r for rs in results.values() for r in rs]
    memory_ops = memory_bound_ops(rows)
    flop_points = [p for p in roofline_points(rows) if p[0]["op"] not in memory_ops]
    byte_points = [p for p in bandwidth_points(rows) if p[0]["op"] in memory_ops]
    placed = [p[0] for p in flop_points + byte_points]
    if not placed:
        return None
    impls = impl_order(placed)
    colors = color_map(impls)
    panels = [(panel, pts) for panel, pts in ((_roofline_panel, flop_points), (_bytes_panel, byte_points)) if pts]
    fig, axes = plt.subplots(1, len(panels), figsize=(7.2 * len(panels), 6.4), squeeze=False)
    handles, labels = [], []
    for ax, (panel, pts) in zip(axes[0], panels):
        panel(ax, results, pts, impls, colors)
        h, l = ax.get_legend_handles_labels()
        handles += h
        labels += l
    # One legend for both panels: colours = implementations, markers = ops, fill = suite.
    from matplotlib.lines import Line2D

    for impl in impls:
        handles.append(Line2D([], [], ls="", marker="o", color=colors[impl], markersize=7))
        labels.append(impl_label(impl))
    for op in sorted({r["op"] for r in placed}):
        handles.append(Line2D([], [], ls="", marker=OP_MARKERS.get(op, "^"), color="0.3", markersize=7))
        labels.append(f"marker: {OP_TITLES.get(op, op)}")
    if any(s == "gemma3n" for _, s in results):
        handles.append(Line2D([], [], ls="", marker="o", markerfacecolor="none", color="0.3", markersize=7))
        labels.append("hollow: Gemma 3n shapes (N=4); filled: benchmark workloads")
    _legend_outside(axes[0][-1], handles, labels)
    unplaced = len(rows) - len(placed)
    note = f"; {unplaced} rows without a FLOP or byte count not placed" if unplaced else ""
    fig.suptitle(f"H200: every workload and implementation of every op\n{provenance(rows)}{note}")
    fig.tight_layout()
    return _save(fig, path)


def _per_shape_panels(plt, rows: Sequence[dict]):
    """One panel per (N, H) of `rows`: [(axis, (N, H), the rows of that shape)] and the figure."""
    shapes = sorted({(r["N"], r["H"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes) + 1.5, 5.6), squeeze=False)
    return fig, [(ax, shape, [r for r in rows if (r["N"], r["H"]) == shape]) for ax, shape in zip(axes[0], shapes)]


def plot_latency(op: str, suite: str, rows: Sequence[dict], path: Path) -> Path:
    plt = _pyplot()
    impls = impl_order(rows)
    colors = color_map(impls)
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
            ax.errorbar(x, y, yerr=err, color=colors[impl], marker="o", ms=4, lw=1.6 if role == "ours" else 1.1,
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
    _legend_outside(panels[-1][0])
    fig.suptitle(f"{OP_TITLES.get(op, op)}: latency vs tokens ({suite} suite)\n{provenance(rows)}")
    fig.tight_layout()
    return _save(fig, path)


def plot_bandwidth(op: str, suite: str, rows: Sequence[dict], path: Path) -> Path | None:
    """TB/s of compulsory traffic against tokens: every version of ours and the floors, under the
    datasheet bandwidth and the measured copy rate (the PyTorch baselines are in the latency figure)."""
    plt = _pyplot()
    points = [p for p in bandwidth_points(rows) if impl_role(p[0]["impl"]) != "pytorch"]
    if not any(impl_role(r["impl"]) == "ours" for r, _, _ in points):
        return None
    impls = impl_order([r for r, _, _ in points])
    colors = color_map(impls)
    rate = {id(r): tbps for r, _, tbps in points}
    fig, panels = _per_shape_panels(plt, [r for r, _, _ in points])
    bw, copy = H200.hbm_bytes_per_s / 1e12, H200.copy_bytes_per_s / 1e12
    for ax, (n, h), sub in panels:
        ax.axhline(bw, color="black", lw=1.8, label=f"datasheet HBM3e: {bw:.1f} TB/s")
        ax.axhline(copy, color="black", lw=1.4, ls="--", label=f"measured device copy: {copy:.2f} TB/s")
        for impl in impls:
            pts = sorted((r for r in sub if r["impl"] == impl), key=lambda r: r["tokens"])
            if pts:
                ax.plot([r["tokens"] for r in pts], [rate[id(r)] for r in pts], color=colors[impl], marker="o",
                        ms=4, lw=2.0 if impl == OURS else 1.3, ls=":" if impl_role(impl) == "floor" else "-",
                        label=impl_label(impl))
        ax.set_xscale("log")
        ax.set_ylim(0, bw * 1.08)
        ax.set_xlabel("tokens M = batch_size x seq_len")
        ax.set_ylabel("achieved bandwidth (TB/s of compulsory bytes)")
        ax.set_title(f"N={n}, H={h}")
    _legend_outside(panels[-1][0])
    fig.suptitle(f"{OP_TITLES.get(op, op)}: bandwidth per version vs the copy rate ({suite} suite)\n"
                 f"{provenance(rows)}")
    fig.tight_layout()
    return _save(fig, path)


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


def plot_speedup(op: str, suite: str, rows: Sequence[dict], path: Path) -> Path | None:
    plt = _pyplot()
    baselines = [i for i in impl_order(rows) if impl_role(i) == "pytorch"]
    by = {(r["impl"], r["workload"]): r for r in rows}
    keys = [k for k in workloads_by_tokens(rows) if (OURS, k) in by]
    if not baselines or not keys:
        return None
    colors = color_map(impl_order(rows))
    with_nh = len({k[:2] for k in keys}) > 1
    series, hatches = [], []
    for base in baselines:
        vals = [by[(base, k)]["median_us"] / by[(OURS, k)]["median_us"] if (base, k) in by else math.nan
                for k in keys]
        fails = [(base, k) in by and by[(base, k)]["passed"] is False for k in keys]
        tag = " [fails tolerance]" if any(fails) else ""
        series.append((f"vs {impl_label(base)}{tag}: geomean {geomean(vals):.2f}x", base, vals))
        hatches.append(fails)
    fig, ax = plt.subplots(figsize=(min(16.0, max(9.0, 0.45 * len(keys) * len(baselines) / 3 + 5)), 6.0))
    _grouped_bars(ax, keys, series, colors, hatches)
    ax.axhline(1.0, color="black", lw=1.0, ls="--", label="1x (parity)")
    _legend_outside(ax)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([workload_label(k, with_nh) for k in keys], rotation=45, ha="right")
    ax.set_xlabel("workload (batch_size x seq_len), sorted by tokens")
    ax.set_ylabel(f"speedup of {OURS} (baseline µs / our µs)")
    top = max([v for _, _, vals in series for v in vals if math.isfinite(v)] + [1.0])
    ax.set_ylim(0, top * 1.3)
    ax.set_title(f"{OP_TITLES.get(op, op)}: speedup over PyTorch ({suite} suite; hatched = baseline fails "
                 f"the tolerance)\n{provenance(rows)}")
    fig.tight_layout()
    return _save(fig, path)


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
        path = plot_roofline(results, out_dir / "roofline.png")
        if path:
            written.append(path)
        for (op, suite), rows in sorted(results.items()):
            written.append(plot_latency(op, suite, rows, out_dir / f"latency_{op}_{suite}.png"))
            written.append(plot_pct_sol(op, suite, rows, out_dir / f"pct_sol_{op}_{suite}.png"))
            path = plot_speedup(op, suite, rows, out_dir / f"speedup_{op}_{suite}.png")
            if path:
                written.append(path)
            else:
                log(f"figures: {op} / {suite} has no {OURS} or PyTorch rows: no speedup figure")
            if op in memory_bound_ops(rows):
                path = plot_bandwidth(op, suite, rows, out_dir / f"bandwidth_{op}_{suite}.png")
                if path:
                    written.append(path)
    return written
