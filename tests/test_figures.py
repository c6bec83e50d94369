"""Figures and results tables: regenerated from CSVs alone, valid PNGs, deterministic, and the
committed figures/ equal to what the committed results regenerate. No GPU needed.

The committed figures are compared with their regeneration pixel by pixel within a small tolerance,
not byte by byte: PNG bytes change with the encoder (Pillow, zlib) and with anti-aliasing details of
the plotting stack while the picture stays the same, and pinning those versions would force them
on every user of the library. A moved point, bar or label changes far more pixels than the
tolerance allows (test_pixel_tolerance_catches_a_changed_measurement).
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

import pytest

from altup_cupy.lab import figures, report
from altup_cupy.lab.bench import CSV_COLUMNS, csv_path, read_csv
from altup_cupy.lab.benchmarks import collapse as collapse_bench
from altup_cupy.lab.benchmarks import predict_correct_backward as backward_bench
from altup_cupy.lab.ceilings import H200
from altup_cupy.lab.paths import FIGURES_DIR, RECORDED_RESULTS_DIR
from altup_cupy.lab.workloads import Workload

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MIN_PNG_BYTES = 10_000
# Pixel comparison of two renderings of one figure (RGB values 0..255): the mean absolute difference
# over all channels, and the share of pixels where some channel moved by more than CHANGED_LEVEL.
MAX_MEAN_ABS_DIFFERENCE = 0.5
CHANGED_LEVEL = 32
MAX_CHANGED_PIXEL_SHARE = 0.002


def assert_valid_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert len(data) > MIN_PNG_BYTES, f"{path.name} is only {len(data)} bytes"
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200, image.shape


# ---------------------------------------------------------------------------------------------
# a small synthetic result set

def _row(bench, w: Workload, impl, us, passed):
    """One CSV row of `impl` on workload `w`, its throughput and SOL from the op's cost model."""
    flops, byts = bench.flops(w), bench.compulsory_bytes(w)
    sol = 1e6 * H200.sol_seconds(flops, byts)
    return {
        "op": w.op, "impl": impl, "suite": "benchmark", "N": w.streams, "H": w.hidden,
        "batch_size": w.batch_size, "seq_len": w.seq_len, "tokens": w.tokens, "median_us": us,
        "p10_us": round(us * 0.98, 2), "p90_us": round(us * 1.03, 2),
        "sol_us": round(sol, 2), "pct_sol": round(100 * sol / us, 1), "tflops": round(flops / us / 1e6, 1),
        "tbps": round(byts / us / 1e6, 3), "match_ratio": "" if passed == "" else (0.9999 if passed else 0.98),
        "rel_l2": "" if passed == "" else "1.0e-03", "passed": passed, "gpu": "NVIDIA H200",
        "git_sha": "0123456789ab", "date": "2026-12-02T12:00Z",
    }


def _synthetic_workload(op, n, h, b, s) -> Workload:
    return Workload(op, n, h, b, s, 1e-5, 0.05, 1e-6)


SYNTH_COLLAPSE = [  # (B, S, {impl: (us, passed)})
    (1, 128, {"altup_cupy": (30.0, True), "torch_eager_fp32": (600.0, True),
              "torch_compile_bf16gemm": (120.0, False), "cublas_gemms_fp32out": (20.0, "")}),
    (8, 512, {"altup_cupy": (300.0, True), "torch_eager_fp32": (3000.0, True),
              "torch_compile_bf16gemm": (280.0, False), "cublas_gemms_fp32out": (250.0, "")}),
    (16, 1024, {"altup_cupy": (1000.0, False), "torch_eager_fp32": (8000.0, True),
                "torch_compile_bf16gemm": (900.0, False), "cublas_gemms_fp32out": (850.0, "")}),
]
SYNTH_BACKWARD = [
    (1, 256, {"altup_cupy": (10.0, True), "torch_autograd": (2000.0, True), "torch_compile": (1000.0, True),
              "copy_floor": (6.0, "")}),
    (8, 512, {"altup_cupy": (60.0, True), "torch_autograd": (3000.0, True), "torch_compile": (2400.0, False),
              "copy_floor": (50.0, "")}),
]


def write_synthetic(results_dir: Path, collapse=SYNTH_COLLAPSE, backward=SYNTH_BACKWARD) -> None:
    def dump(op, suite, rows):
        path = csv_path(op, suite, results_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)

    dump("collapse", "benchmark", [
        _row(collapse_bench, _synthetic_workload("collapse", 3, 3072, b, s), impl, us, p)
        for b, s, impls in collapse for impl, (us, p) in impls.items()])
    dump("predict_correct_backward", "benchmark", [
        _row(backward_bench, _synthetic_workload("predict_correct_backward", 3, 2304, b, s), impl, us, p)
        for b, s, impls in backward for impl, (us, p) in impls.items()])


@pytest.fixture()
def synthetic(tmp_path) -> Path:
    results = tmp_path / "results"
    write_synthetic(results)
    return results


# ---------------------------------------------------------------------------------------------
# figures


def test_regenerate_synthetic_writes_valid_deterministic_pngs(synthetic, tmp_path):
    messages = []
    first = figures.regenerate(synthetic, tmp_path / "a", log=messages.append)
    names = sorted(p.name for p in first)
    assert names == sorted([
        "roofline_collapse.png", "roofline_predict_correct_backward.png",
        "latency_collapse_benchmark.png", "pct_sol_collapse_benchmark.png", "vs_floor_collapse_benchmark.png",
        "latency_predict_correct_backward_benchmark.png", "pct_sol_predict_correct_backward_benchmark.png",
        "vs_floor_predict_correct_backward_benchmark.png",
        # the backward is memory-bound on every workload: it also gets the byte-based view
        "bandwidth_predict_correct_backward_benchmark.png",
    ])
    for path in first:
        assert_valid_png(path)
    # the absent CSVs (gemma3n suites) are skipped with a message naming them
    assert any("bench_collapse_gemma3n.csv" in m and "skipping" in m for m in messages)
    second = figures.regenerate(synthetic, tmp_path / "b", log=lambda _: None)
    for a, b in zip(first, second, strict=True):
        assert a.read_bytes() == b.read_bytes(), f"{a.name} differs between two regenerations"


def test_regenerate_without_any_csv_is_a_clean_no_op(tmp_path):
    messages = []
    assert figures.regenerate(tmp_path / "empty", tmp_path / "out", log=messages.append) == []
    assert any("nothing to draw" in m for m in messages)


def test_roofline_intensity_comes_from_the_csv(synthetic):
    rows = [r for rs in figures.load_results(synthetic, log=lambda _: None).values() for r in rs]
    points = figures.roofline_points(rows)
    assert len(points) == len(rows)
    for row, intensity, tflops in points:
        bench = collapse_bench if row["op"] == "collapse" else backward_bench
        w = _synthetic_workload(row["op"], row["N"], row["H"], row["batch_size"], row["seq_len"])
        expected = bench.flops(w) / bench.compulsory_bytes(w)
        assert intensity == pytest.approx(expected, rel=1e-2), row["impl"]  # tflops has 0.1 resolution
        assert tflops == pytest.approx(row["tflops"], abs=0.051)


def test_only_the_memory_bound_op_is_placed_by_bytes(synthetic):
    rows = [r for rs in figures.load_results(synthetic, log=lambda _: None).values() for r in rs]
    assert figures.memory_bound_ops(rows) == {"predict_correct_backward"}
    for row, nbytes, tbps in figures.bandwidth_points(rows):
        if row["op"] == "predict_correct_backward":
            assert nbytes == pytest.approx(22 * 2304 * row["tokens"], rel=1e-3)
            assert tbps == pytest.approx(nbytes / row["median_us"] / 1e6)


def test_colours_are_derived_for_any_version_and_baseline():
    impls = ["altup_cupy", "altup_cupy_v1", "altup_cupy_v2", "altup_cupy_v7", "torch_new_baseline",
             "torch_eager", "copy_floor", "some_floor"]
    colors = figures.color_map(impls)
    assert set(colors) == set(impls)
    assert len(set(colors.values())) == len(impls)  # distinct, none hand-listed
    assert figures.color_map(["altup_cupy_v7", "torch_eager"])["torch_eager"] == colors["torch_eager"]
    assert figures.impl_version("altup_cupy_v12") == 12 and figures.impl_version("altup_cupy") is None


def _hue(color: str) -> float:
    import colorsys

    from matplotlib.colors import to_rgb

    return colorsys.rgb_to_hls(*to_rgb(color))[0]


def test_every_version_has_its_own_hue_and_marker():
    """Eight versions and the default: no two share a marker, the versions' hues are more than
    0.02 of the hue circle apart, and only the default is red."""
    from matplotlib.colors import to_rgb

    ours = ["altup_cupy"] + [f"altup_cupy_v{n}" for n in range(1, 9)]
    styles = figures.style_map(ours)
    assert len({marker for _, marker in styles.values()}) == len(ours)
    assert len({color for color, _ in styles.values()}) == len(ours)
    reds = [impl for impl, (color, _) in styles.items()
            if (r := to_rgb(color))[0] > 0.6 and r[1] < 0.3 and r[2] < 0.3]
    assert reds == ["altup_cupy"]
    versions = [styles[f"altup_cupy_v{n}"][0] for n in range(1, 9)]
    hues = sorted(_hue(c) for c in versions)
    assert min(b - a for a, b in zip(hues, hues[1:])) > 0.02, hues


def test_labels_are_short():
    for impl in list(figures.IMPL_DESCRIPTIONS) + ["altup_cupy", "altup_cupy_v3", "altup_cupy_op"]:
        assert len(figures.impl_label(impl)) <= 60, figures.impl_label(impl)


def _capture(monkeypatch, what) -> dict:
    """{figure file name: what(figure)} for the figures drawn while the patch holds, none saved."""
    captured = {}
    monkeypatch.setattr(figures, "_save", lambda fig, path: captured.setdefault(path.name, what(fig)))
    return captured


def _legend_texts(fig) -> list[str]:
    return [text.get_text() for ax in fig.axes if ax.get_legend() for text in ax.get_legend().get_texts()]


def test_roofline_is_one_op_and_its_legend_names_only_what_it_draws(synthetic, tmp_path, monkeypatch):
    results = figures.load_results(synthetic, log=lambda _: None)
    # the operator entry times the default's kernel: its points would lie under the default's, unseen
    for key, rows in list(results.items()):
        results[key] = rows + [dict(r, impl=figures.OPERATOR_ENTRY) for r in rows if r["impl"] == figures.OURS]
    legends = _capture(monkeypatch, _legend_texts)
    with figures.style():
        for op in ("collapse", "predict_correct_backward"):
            figures.plot_roofline(op, results, tmp_path / f"roofline_{op}.png")
        figures.plot_latency("collapse", "benchmark", results[("collapse", "benchmark")], tmp_path / "latency.png")
    collapse = legends["roofline_collapse.png"]
    impls = [i for i in figures.impl_order(results[("collapse", "benchmark")]) if i != figures.OPERATOR_ENTRY]
    assert collapse[2:] == [figures.impl_label(i) for i in impls]  # two ceilings, then what is drawn
    latency = " ".join(legends["latency.png"])
    assert figures.impl_label(figures.OPERATOR_ENTRY) not in latency and figures.impl_label(figures.OURS) in latency
    assert sum("datasheet" in text for text in legends["roofline_predict_correct_backward.png"]) == 1
    # fill tells the suites apart: named only when both are drawn
    both = {**results, ("collapse", "gemma3n"): [dict(r, suite="gemma3n") for r in results[("collapse", "benchmark")]]}
    with figures.style():
        figures.plot_roofline("collapse", both, tmp_path / "both.png")
    assert [t for t in legends["both.png"] if "suite" in t] == ["filled: benchmark suite", "hollow: gemma3n suite"]


def test_vs_floor_is_each_version_over_the_ops_floor(synthetic, tmp_path, monkeypatch):
    rows = _with_versions(synthetic)
    drawn = _capture(monkeypatch, lambda fig: {line.get_label(): list(line.get_ydata())
                                               for ax in fig.axes for line in ax.get_lines()})
    with figures.style():
        figures.plot_vs_floor("predict_correct_backward", "benchmark", rows, tmp_path / "vs_floor.png")
    lines = drawn["vs_floor.png"]
    floor = [impls["copy_floor"][0] for _, _, impls in SYNTH_BACKWARD]
    ours = [impls["altup_cupy"][0] for _, _, impls in SYNTH_BACKWARD]
    assert lines[figures.impl_label("altup_cupy")] == pytest.approx([o / f for o, f in zip(ours, floor)])
    assert lines["altup_cupy_v1"] == pytest.approx([2 * o / f for o, f in zip(ours, floor)])
    assert set(lines) == {"altup_cupy (default)", "altup_cupy_v1", "1x: copy_floor (floor)"}
    without_floor = [r for r in rows if r["impl"] != "copy_floor"]
    assert figures.plot_vs_floor("predict_correct_backward", "benchmark", without_floor, tmp_path / "x.png") is None


def _committed_csvs() -> list[Path]:
    return sorted(RECORDED_RESULTS_DIR.glob("bench_*.csv"))


def test_regenerate_committed_results_into_tmp(tmp_path):
    if not _committed_csvs():
        pytest.skip(f"no bench_*.csv committed under {RECORDED_RESULTS_DIR} yet")
    written = figures.regenerate(RECORDED_RESULTS_DIR, tmp_path, log=lambda _: None)
    assert written
    for path in written:
        assert_valid_png(path)


def pixel_difference(a: Path, b: Path) -> tuple[float, float]:
    """(mean absolute RGB difference, share of pixels changed by more than CHANGED_LEVEL) of two
    PNGs of the same size."""
    import numpy as np
    from PIL import Image

    with Image.open(a) as image_a, Image.open(b) as image_b:
        assert image_a.size == image_b.size, f"{a.name}: {image_a.size} vs {image_b.size} pixels"
        pixels_a = np.asarray(image_a.convert("RGB"), dtype=np.int16)
        pixels_b = np.asarray(image_b.convert("RGB"), dtype=np.int16)
    difference = np.abs(pixels_a - pixels_b)
    return float(difference.mean()), float((difference.max(axis=-1) > CHANGED_LEVEL).mean())


def assert_same_picture(committed: Path, regenerated: Path) -> None:
    mean_abs, changed = pixel_difference(committed, regenerated)
    assert mean_abs <= MAX_MEAN_ABS_DIFFERENCE and changed <= MAX_CHANGED_PIXEL_SHARE, (
        f"{committed} differs from its regeneration (mean |diff| {mean_abs:.3f}, limit "
        f"{MAX_MEAN_ABS_DIFFERENCE}; {changed:.3%} of pixels changed, limit {MAX_CHANGED_PIXEL_SHARE:.1%}): "
        "run `python -m altup_cupy figures`")


def test_committed_figures_match_regeneration(tmp_path):
    if not _committed_csvs():
        pytest.skip(f"no bench_*.csv committed under {RECORDED_RESULTS_DIR} yet: nothing to regenerate figures/ from")
    written = figures.regenerate(RECORDED_RESULTS_DIR, tmp_path, log=lambda _: None)
    committed = sorted(p.name for p in FIGURES_DIR.glob("*.png"))
    assert committed == sorted(p.name for p in written), (
        "figures/ does not hold exactly the figures the committed CSVs produce: "
        "run `python -m altup_cupy figures`")
    for path in written:
        assert_same_picture(FIGURES_DIR / path.name, path)


def test_pixel_tolerance_catches_a_changed_measurement(synthetic, tmp_path):
    """One latency moved (30 -> 45 µs on one workload): the comparison above must reject it."""
    changed = [(b, s, {**impls, "altup_cupy": (45.0, True)} if (b, s) == (1, 128) else impls)
               for b, s, impls in SYNTH_COLLAPSE]
    write_synthetic(tmp_path / "changed", collapse=changed)
    name = "latency_collapse_benchmark.png"
    (original,) = [p for p in figures.regenerate(synthetic, tmp_path / "a", log=lambda _: None) if p.name == name]
    (moved,) = [p for p in figures.regenerate(tmp_path / "changed", tmp_path / "b", log=lambda _: None)
                if p.name == name]
    mean_abs, changed_share = pixel_difference(original, moved)
    assert mean_abs > MAX_MEAN_ABS_DIFFERENCE or changed_share > MAX_CHANGED_PIXEL_SHARE, (mean_abs, changed_share)
    assert pixel_difference(original, original) == (0.0, 0.0)


# ---------------------------------------------------------------------------------------------
# report


def _table_lines(markdown: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in markdown.splitlines() if line.startswith("|")]


def test_results_table_means_row(synthetic):
    rows = figures.parse_rows(read_csv(csv_path("collapse", "benchmark", synthetic)))
    table = _table_lines(report.results_table(rows))
    head, body, means = table[0], table[2:-1], table[-1]
    assert len(body) == len(SYNTH_COLLAPSE)
    col = {name: i for i, name in enumerate(head)}
    assert means[0] == "**mean**"
    for impl in ("altup_cupy", "torch_eager_fp32", "torch_compile_bf16gemm"):
        expected = statistics.fmean(impls[impl][0] for _, _, impls in SYNTH_COLLAPSE)
        assert float(means[col[f"{impl} µs"]].replace(",", "")) == pytest.approx(expected, abs=0.06 if expected < 1000 else 0.5)
    assert float(means[col["cublas_gemms_fp32out µs (floor)"]].replace(",", "")) == pytest.approx(373.3, abs=0.06)
    # speedup: over the fastest PyTorch baseline that PASSES (torch_compile_bf16gemm fails everywhere)
    speedups = [impls["torch_eager_fp32"][0] / impls["altup_cupy"][0] for _, _, impls in SYNTH_COLLAPSE]
    for line, s in zip(body, speedups):
        assert line[col["speedup vs best passing PyTorch"]] == f"{s:.2f}× (torch_eager_fp32)"
    geo = math.exp(statistics.fmean(math.log(s) for s in speedups))
    assert means[col["speedup vs best passing PyTorch"]] == f"{geo:.2f}× (geomean)"
    pct = statistics.fmean(float(line[col["altup_cupy % of SOL"]].rstrip("%")) for line in body)
    assert float(means[col["altup_cupy % of SOL"]].rstrip("%")) == pytest.approx(pct, abs=0.051)
    assert means[col["altup_cupy passes"]] == "2/3"
    assert body[2][col["altup_cupy passes"]] == "**FAIL**"
    assert body[0][col["torch_compile_bf16gemm µs"]].endswith("✗")


def test_best_baseline_skips_failing_ones(synthetic):
    rows = figures.parse_rows(read_csv(csv_path("predict_correct_backward", "benchmark", synthetic)))
    data = report.table_data(rows)
    # workload 1: torch_compile (1000 µs) passes and is fastest; workload 2: it fails -> autograd
    assert [line["baseline"] for line in data["rows"]] == ["torch_compile", "torch_autograd"]
    assert data["rows"][1]["speedup"] == pytest.approx(3000.0 / 60.0)


def test_markdown_tables_and_readme_markers(synthetic, tmp_path):
    text = report.markdown_tables(synthetic)
    assert "collapse forward, benchmark suite" in text
    assert "bench_collapse_gemma3n.csv is absent" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nintro\n\n{report.BEGIN_MARKER}\nstale\n{report.END_MARKER}\n\nafter\n")
    assert report.update_readme(readme, synthetic, tmp_path / "figures") is True
    new = readme.read_text()
    assert new.startswith("# title\n\nintro\n\n" + report.BEGIN_MARKER + "\n")
    assert new.endswith(report.END_MARKER + "\n\nafter\n")
    assert "stale" not in new and "| **mean** |" in new
    assert report.update_readme(readme, synthetic, tmp_path / "figures") is False  # idempotent
    readme.write_text("no markers here\n")
    with pytest.raises(ValueError, match="markers"):
        report.update_readme(readme, synthetic)


# The backward with an earlier version the registry keeps (v1) and one it no longer has (v99).
SYNTH_BACKWARD_VERSIONS = [
    (1, 256, {"altup_cupy": (10.0, True), "altup_cupy_v1": (30.0, True), "altup_cupy_v99": (20.0, False),
              "copy_floor": (6.0, "")}),
    (8, 512, {"altup_cupy": (60.0, True), "altup_cupy_v1": (90.0, True), "altup_cupy_v99": (80.0, True),
              "copy_floor": (50.0, "")}),
]


def test_headline_means_multiples_of_the_floor_and_dropped_versions(tmp_path):
    write_synthetic(tmp_path, backward=SYNTH_BACKWARD_VERSIONS)
    rows = figures.parse_rows(read_csv(csv_path("predict_correct_backward", "benchmark", tmp_path)))
    data = report.headline_data("predict_correct_backward", rows)
    assert data["floor"] == "copy_floor" and data["rate_unit"] == "TB/s"  # memory-bound on every workload
    by = {line["impl"]: line for line in data["rows"]}
    assert list(by) == ["altup_cupy_v1", "altup_cupy_v99", "altup_cupy", "copy_floor"]
    floor_us = (6.0 + 50.0) / 2
    for impl, mean_us in {"altup_cupy_v1": 60.0, "altup_cupy_v99": 50.0, "altup_cupy": 35.0}.items():
        assert by[impl]["mean_us"] == pytest.approx(mean_us)
        assert by[impl]["x_floor"] == pytest.approx(mean_us / floor_us)
    assert by["copy_floor"]["x_floor"] == pytest.approx(1.0)
    assert [line["dropped"] for line in data["rows"]] == [False, True, False, False]
    assert (by["altup_cupy_v99"]["passed"], by["altup_cupy_v99"]["checked"]) == (1, 2)
    workloads = [_synthetic_workload("predict_correct_backward", 3, 2304, b, s) for b, s, _ in SYNTH_BACKWARD_VERSIONS]
    tbps = [backward_bench.compulsory_bytes(w) / us / 1e6 for w, us in zip(workloads, (10.0, 60.0))]
    assert by["altup_cupy"]["rate"] == pytest.approx(statistics.fmean(tbps), rel=1e-3)

    table = report.headline_table("predict_correct_backward", tmp_path)
    assert table.startswith("### Headline: predict-correct backward: `altup_cupy` 35.0 µs mean over 2 workloads, "
                            "1.25× its floor (`copy_floor`)\n")
    assert "git 0123456789ab" in table and "mean TB/s" in table
    assert "| `altup_cupy_v99` (dropped from the registry) | 50.0 | 1.79× |" in table
    assert "| `altup_cupy_v1` | 60.0 | 2.14× |" in table and "| `copy_floor` (floor) | 28.0 | 1.00× |" in table
    collapse = report.headline_table("collapse", tmp_path)
    assert "mean TFLOP/s" in collapse and "dropped" not in collapse
    # the README's generated section quotes the same table
    assert table in report.readme_section(tmp_path, tmp_path / "figures")


def _with_versions(synthetic) -> list[dict]:
    """The synthetic backward rows plus an earlier version of ours at twice the default's time."""
    rows = figures.parse_rows(
        __import__("altup_cupy.lab.bench", fromlist=["read_csv"]).read_csv(
            csv_path("predict_correct_backward", "benchmark", synthetic)))
    older = [dict(r, impl="altup_cupy_v1", median_us=2 * r["median_us"]) for r in rows if r["impl"] == "altup_cupy"]
    return rows + older


def test_progression_table_reads_versions_from_the_impl_names(synthetic):
    data = report.progression_data(_with_versions(synthetic))
    assert [line["impl"] for line in data["rows"]] == ["altup_cupy_v1", "altup_cupy", "copy_floor"]
    default = data["rows"][1]
    for cell, (b, s, impls) in zip(default["cells"], SYNTH_BACKWARD):
        assert cell["us"] == impls["altup_cupy"][0]
        assert cell["pct_copy_floor"] == pytest.approx(100 * impls["copy_floor"][0] / impls["altup_cupy"][0])
        assert cell["tbps"] == pytest.approx(22 * 2304 * b * s / cell["us"] / 1e6, rel=1e-3)
    assert data["rows"][0]["cells"][0]["us"] == 2 * default["cells"][0]["us"]
    table = _table_lines(report.progression_table(_with_versions(synthetic)))
    assert table[1 + 2][0] == "altup_cupy (default)" and table[-1][0] == "copy_floor (device copy)"


def test_bandwidth_table_against_the_copy_rate(synthetic):
    rows = _with_versions(synthetic)
    data = report.bandwidth_data(rows)
    first = data["rows"][0]["tbps"]
    assert first["altup_cupy_v1"] == pytest.approx(first["altup_cupy"] / 2)
    table = _table_lines(report.bandwidth_table(rows))
    pct = float(table[2][-1].rstrip("%"))
    assert pct == pytest.approx(100 * first["altup_cupy"] / 4.22, abs=0.06)


def test_gpu_and_wall_table_shows_both_times_per_implementation():
    rows = [{"impl": impl, "tokens": m, "median_us": gpu, "wall_us": wall}
            for impl, m, gpu, wall in [("altup_cupy", 128, 10.0, 60.0), ("altup_cupy", 8192, 300.0, 310.0),
                                       ("torch_eager", 128, 50.0, 90.0), ("torch_eager", 8192, 900.0, 905.0)]]
    table = report.gpu_and_wall_table(rows).splitlines()
    assert table[0].startswith("| implementation | mean GPU µs | mean wall µs | GPU / wall µs at M = 128")
    ours = next(line for line in table if line.startswith("| altup_cupy |"))
    assert "155.0" in ours and "185.0" in ours and "10.0 / 60.0" in ours and "300.0 / 310.0" in ours
    assert report.gpu_and_wall_table([{**r, "wall_us": float("nan")} for r in rows]) == ""


def test_gpu_and_wall_table_names_a_wall_time_some_rows_lack():
    """CSVs of several runs: an implementation whose rows only partly carry wall_us gets no mean
    wall time from the rows that do; its cells say so."""
    rows = [{"impl": impl, "tokens": m, "median_us": gpu, "wall_us": wall}
            for impl, m, gpu, wall in [("altup_cupy", 128, 10.0, 60.0), ("altup_cupy", 8192, 300.0, 310.0),
                                       ("torch_eager", 128, 50.0, math.nan), ("torch_eager", 8192, 900.0, 905.0)]]
    table = {line[0]: line for line in _table_lines(report.gpu_and_wall_table(rows))}
    assert table["altup_cupy"][1:] == ["155.0", "185.0", "10.0 / 60.0", "300.0 / 310.0"]
    assert table["torch_eager"][1:] == ["475.0", report.WALL_NOT_RECORDED, f"50.0 / {report.WALL_NOT_RECORDED}",
                                        "900.0 / 905.0"]


def test_markdown_tables_show_wall_time_or_say_it_was_not_recorded(synthetic, tmp_path):
    without = report.markdown_tables(synthetic)  # the synthetic CSVs leave wall_us empty
    assert without.count(f"{report.WALL_NOT_RECORDED} in this CSV") == 2  # one per table present
    assert "mean wall µs" not in without
    for path in synthetic.glob("bench_*.csv"):
        rows = read_csv(path)
        with_wall = tmp_path / "with_wall" / path.name
        with_wall.parent.mkdir(exist_ok=True)
        with with_wall.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            writer.writerows({**r, "wall_us": 2 * float(r["median_us"])} for r in rows)
    text = report.markdown_tables(tmp_path / "with_wall")
    assert text.count("| implementation | mean GPU µs | mean wall µs |") == 2
    assert report.WALL_NOT_RECORDED not in text
    ours = next(line for line in _table_lines(text) if line[0] == "altup_cupy" and len(line) == 5)
    mean_gpu = statistics.fmean(impls["altup_cupy"][0] for _, _, impls in SYNTH_COLLAPSE)
    assert float(ours[1]) == pytest.approx(mean_gpu, abs=0.06) and float(ours[2]) == pytest.approx(2 * mean_gpu, abs=0.06)
