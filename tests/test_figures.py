"""Figures and results tables: regenerated from CSVs alone, valid PNGs, deterministic, and the
committed figures/ equal to what the committed results regenerate. No GPU needed."""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

import pytest

from altup_cupy import figures, report
from altup_cupy.bench import CSV_COLUMNS, RESULTS_DIR, csv_path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MIN_PNG_BYTES = 10_000
FIGURES_DIR = RESULTS_DIR.parent.parent / "figures"


def assert_valid_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert len(data) > MIN_PNG_BYTES, f"{path.name} is only {len(data)} bytes"
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200, image.shape


# ---------------------------------------------------------------------------------------------
# a small synthetic result set

def _row(op, impl, suite, n, h, b, s, us, passed, flop_per_token, bytes_per_token):
    tokens = b * s
    flops, byts = flop_per_token * tokens, bytes_per_token * tokens
    sol = 1e6 * max(flops / 989.4e12, byts / 4.8e12)
    return {
        "op": op, "impl": impl, "suite": suite, "N": n, "H": h, "batch_size": b, "seq_len": s,
        "tokens": tokens, "median_us": us, "p10_us": round(us * 0.98, 2), "p90_us": round(us * 1.03, 2),
        "sol_us": round(sol, 2), "pct_sol": round(100 * sol / us, 1), "tflops": round(flops / us / 1e6, 1),
        "tbps": round(byts / us / 1e6, 3), "match_ratio": "" if passed == "" else (0.9999 if passed else 0.98),
        "rel_l2": "" if passed == "" else "1.0e-03", "passed": passed, "gpu": "NVIDIA H200",
        "git_sha": "0123456789ab", "date": "2026-12-02T12:00Z",
    }


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


def write_synthetic(results_dir: Path) -> None:
    def dump(op, suite, rows):
        path = csv_path(op, suite, results_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)

    n, h = 3, 3072
    dump("collapse", "benchmark", [
        _row("collapse", impl, "benchmark", n, h, b, s, us, p, 2 * (n - 1) * h * h, 2 * (n + 1) * h)
        for b, s, impls in SYNTH_COLLAPSE for impl, (us, p) in impls.items()])
    n, h = 3, 2304
    dump("predict_correct_backward", "benchmark", [
        _row("predict_correct_backward", impl, "benchmark", n, h, b, s, us, p, 60 * h, 22 * h)
        for b, s, impls in SYNTH_BACKWARD for impl, (us, p) in impls.items()])


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
        "roofline.png",
        "latency_collapse_benchmark.png", "pct_sol_collapse_benchmark.png", "speedup_collapse_benchmark.png",
        "latency_predict_correct_backward_benchmark.png", "pct_sol_predict_correct_backward_benchmark.png",
        "speedup_predict_correct_backward_benchmark.png",
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
        expected = (2 * 2 * 3072 * 3072) / (2 * 4 * 3072) if row["op"] == "collapse" else 60 / 22
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


def _committed_csvs() -> list[Path]:
    return sorted(RESULTS_DIR.glob("bench_*.csv"))


def test_regenerate_committed_results_into_tmp(tmp_path):
    if not _committed_csvs():
        pytest.skip(f"no bench_*.csv committed under {RESULTS_DIR} yet")
    written = figures.regenerate(RESULTS_DIR, tmp_path, log=lambda _: None)
    assert written
    for path in written:
        assert_valid_png(path)


def _pinned_version(package: str) -> str:
    for line in (FIGURES_DIR.parent / "requirements.txt").read_text().splitlines():
        if line.lower().startswith(f"{package}=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"requirements.txt pins no {package}")


def test_committed_figures_match_regeneration(tmp_path):
    if not _committed_csvs():
        pytest.skip(f"no bench_*.csv committed under {RESULTS_DIR} yet: nothing to regenerate figures/ from")
    import PIL
    import matplotlib

    # PNG bytes depend on the plotting stack: compare only where it is the pinned one (CI's).
    for package, module in (("matplotlib", matplotlib), ("pillow", PIL)):
        if module.__version__ != _pinned_version(package):
            pytest.skip(f"{package} {module.__version__} here; figures/ is made with the pinned "
                        f"{_pinned_version(package)} (requirements.txt), so bytes cannot match")
    written = figures.regenerate(RESULTS_DIR, tmp_path, log=lambda _: None)
    committed = sorted(p.name for p in FIGURES_DIR.glob("*.png"))
    assert committed == sorted(p.name for p in written), (
        "figures/ does not hold exactly the figures the committed CSVs produce: "
        "run `python -m altup_cupy figures`")
    for path in written:
        assert (FIGURES_DIR / path.name).read_bytes() == path.read_bytes(), (
            f"figures/{path.name} differs from its regeneration: run `python -m altup_cupy figures`")


# ---------------------------------------------------------------------------------------------
# report


def _table_lines(markdown: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in markdown.splitlines() if line.startswith("|")]


def test_results_table_means_row(synthetic):
    rows = figures.parse_rows(
        __import__("altup_cupy.bench", fromlist=["read_csv"]).read_csv(csv_path("collapse", "benchmark", synthetic)))
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
    rows = figures.parse_rows(
        __import__("altup_cupy.bench", fromlist=["read_csv"]).read_csv(
            csv_path("predict_correct_backward", "benchmark", synthetic)))
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


def _with_versions(synthetic) -> list[dict]:
    """The synthetic backward rows plus an earlier version of ours at twice the default's time."""
    rows = figures.parse_rows(
        __import__("altup_cupy.bench", fromlist=["read_csv"]).read_csv(
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
