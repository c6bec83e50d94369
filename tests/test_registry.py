"""The version registries against the recorded benchmark (issue 21): a registered version that the
default beats on every recorded workload must say why it stays (`Version.kept_because`: a teaching
step, a portable fallback); one that wins nowhere and has no reason belongs in git history and its
notebook's story, not in the registry. The same for Gemma 3n's row kernels against their recorded
run. CPU only: it reads the committed CSVs."""

from __future__ import annotations

import importlib

import pytest

from altup_cupy.lab.bench import csv_path, read_csv
from altup_cupy.lab.figures import parse_rows
from altup_cupy.lab.paths import RECORDED_RESULTS_DIR

OPS = ("collapse", "predict_correct_backward")


def _registered() -> list:
    return [pytest.param(op, number, id=f"{op}-v{number}") for op in OPS
            for number in sorted(importlib.import_module(f"altup_cupy.ops.{op}_versions").VERSIONS)]


def _medians(op: str) -> dict[str, dict[tuple, float]]:
    """{impl: {workload: median µs}} of the op's recorded benchmark suite; skips if it is absent."""
    path = csv_path(op, "benchmark", RECORDED_RESULTS_DIR)
    if not path.is_file():
        pytest.skip(f"no recorded benchmark for {op} ({path} is absent)")
    medians: dict[str, dict[tuple, float]] = {}
    for row in parse_rows(read_csv(path)):
        medians.setdefault(row["impl"], {})[row["workload"]] = row["median_us"]
    return medians


@pytest.mark.parametrize("op,number", _registered())
def test_version_slower_than_the_default_everywhere_says_why_it_stays(op, number):
    version = importlib.import_module(f"altup_cupy.ops.{op}_versions").VERSIONS[number]
    medians = _medians(op)
    # Where the default runs this version it has no line of its own: there it is the default.
    _assert_kept_for_a_reason(f"{op} v{number}", medians.get(f"altup_cupy_v{number}", {}), medians["altup_cupy"],
                              version.kept_because, "Version.kept_because")


def _assert_kept_for_a_reason(what: str, own: dict, default: dict, kept_because: str, field: str) -> None:
    """A version slower than the default wherever both were recorded states why it stays."""
    shared = [case for case in own if case in default]
    if not shared:
        pytest.skip(f"{what} has no recorded line of its own next to the default's")
    if all(own[case] > default[case] for case in shared):
        assert kept_because, (f"{what} is slower than the default in all {len(shared)} recorded cases: "
                              f"state why it stays ({field}) or drop it")


# ---- Gemma 3n's row kernels (ops/gemma3n_altup_versions.KERNELS) against gemma3n_kernels.csv ----

def _gemma3n_versions() -> list:
    from altup_cupy.ops.gemma3n_altup_versions import KERNELS

    return [pytest.param(step, number, id=f"gemma3n-{step}-v{number}") for step, versions in KERNELS.items()
            for number in range(1, len(versions) + 1)]


def _gemma3n_kernel_medians() -> dict[str, dict[tuple, float]]:
    """{kernel column: {(N, H, tokens): median µs}} of the recorded row-kernel run; skips if absent."""
    path = RECORDED_RESULTS_DIR / "gemma3n_kernels.csv"
    if not path.is_file():
        pytest.skip(f"no recorded Gemma 3n kernel run ({path} is absent)")
    medians: dict[str, dict[tuple, float]] = {}
    for row in read_csv(path):
        medians.setdefault(row["kernel"], {})[(row["N"], row["H"], row["tokens"])] = float(row["gpu_median_us"])
    return medians


@pytest.mark.parametrize("step,number", _gemma3n_versions())
def test_gemma3n_version_slower_than_the_default_everywhere_says_why_it_stays(step, number):
    from altup_cupy.ops.gemma3n_altup_versions import DEFAULT, KERNELS

    entry = KERNELS[step][number - 1]
    assert entry.note, f"{step} v{number}: say in one line what the version changed (RowKernel.note)"
    if number == DEFAULT[step]:
        return
    medians = _gemma3n_kernel_medians()
    # The recorded run (an H200, sm_90) ran DEFAULT's version where it is the default.
    _assert_kept_for_a_reason(f"{step} v{number}", medians.get(f"{step}_v{number}", {}),
                              medians.get(f"{step}_v{DEFAULT[step]}", {}), entry.kept_because, "RowKernel.kept_because")


def test_the_numbers_a_kept_reason_quotes_are_the_recorded_ones():
    """Collapse v2 and v3 say how far they are from v1 and v2 on the recorded benchmark; the
    notebooks show those sentences verbatim, so they must be the recorded run's numbers."""
    import re
    import statistics

    from altup_cupy.ops.collapse_versions import VERSIONS

    medians = _medians("collapse")
    v1, v2, v3 = (medians[name] for name in ("altup_cupy", "altup_cupy_v2", "altup_cupy_v3"))
    over_v1 = [100 * (v2[k] / v1[k] - 1) for k in v1]
    low, high, median = map(int, re.search(r"(\d+)-(\d+)% \(median (\d+)%\)", VERSIONS[2].kept_because).groups())
    assert (low, high, median) == (round(min(over_v1)), round(max(over_v1)), round(statistics.median(over_v1)))
    within = float(re.search(r"within ([\d.]+)% of v2", VERSIONS[3].kept_because).group(1))
    assert within == round(max(100 * abs(v3[k] / v2[k] - 1) for k in v2), 1)


@pytest.mark.parametrize("number", [1, 2])
def test_the_magnitude_match_backwards_say_their_blocks_per_sm(number):
    """Each says how many blocks share an SM at H = 2048 (N = 4: the model's launch, one thread per
    8-element slice); the offline compile's registers and shared memory give it."""
    import re

    from altup_cupy._occupancy import SM_LIMITS, blocks_per_sm
    from altup_cupy.lab.occupancy import read_occupancy
    from altup_cupy.ops.gemma3n_altup_versions import KERNELS

    kernel = KERNELS["magnitude_match_backward"][number - 1]
    stated = int(re.search(r"(\d+) blocks an SM at H = 2048", kernel.note).group(1))
    row = next(r for r in read_occupancy() if r["arch"] == "sm_90"
               and r["kernel"] == f"altup_magnitude_match_backward_v{number}<4,unsignedshort>")
    assert stated == blocks_per_sm(SM_LIMITS["sm_90"], row["registers"], 2048 // 8, row["static_shared_bytes"])[0]
