"""Where the research tools read and write their files: one home for every path.

Measurements live in `results/<gpu slug>/` (the slug of "NVIDIA H200" is `nvidia-h200`), one folder
per GPU model so that no GPU's run overwrites another's. Run from a checkout of the repository, the
recorded results, figures and README are the repository's; run from an installed package, they are
looked up under the current directory, and the package's own folder is never written to. The
runtime (everything outside `altup_cupy.lab`) reads no file of the checkout but its kernel sources.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # altup_cupy/
# The GPU whose measurements the repository records (results/nvidia-h200/, figures/, README tables).
RECORDED_GPU = "NVIDIA H200"
RESULTS_DIRNAME = "results"


def _checkout_root() -> Path | None:
    """The repository root when the package is imported from a checkout (editable install or
    PYTHONPATH), else None (an installed copy in site-packages)."""
    root = PACKAGE_DIR.parent
    markers = (root / "pyproject.toml", root / RESULTS_DIRNAME, root / "altup_cupy" / "__init__.py")
    return root if all(m.exists() for m in markers) else None


REPO_ROOT = _checkout_root()


def gpu_slug(gpu_name: str) -> str:
    """Folder name for a GPU model: 'NVIDIA H200' -> 'nvidia-h200', 'NVIDIA A100-SXM4-80GB' ->
    'nvidia-a100-sxm4-80gb'."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")
    if not slug:
        raise ValueError(f"gpu_name must contain a letter or digit, got {gpu_name!r}")
    return slug


def results_dir(gpu_name: str, base: Path | str | None = None) -> Path:
    """Where the benchmark of `gpu_name` writes: `<base>/results/<slug>/`, base = the current
    directory unless given."""
    return (Path.cwd() if base is None else Path(base)) / RESULTS_DIRNAME / gpu_slug(gpu_name)


def _home() -> Path:
    """The repository root in a checkout, else the current directory."""
    return REPO_ROOT if REPO_ROOT is not None else Path.cwd()


# The recorded measurements, the figures drawn from them and the README whose tables they fill.
RECORDED_RESULTS_DIR = _home() / RESULTS_DIRNAME / gpu_slug(RECORDED_GPU)
FIGURES_DIR = _home() / "figures"
README = REPO_ROOT / "README.md" if REPO_ROOT is not None else None


def recorded_results_dirs() -> list[Path]:
    """Every `results/<slug>/` holding benchmark CSVs: under the current directory first; from a
    checkout, the repository's own when the current directory has none."""
    for base in dict.fromkeys([Path.cwd(), _home()]):
        found = sorted(d for d in (base / RESULTS_DIRNAME).glob("*/") if any(d.glob("bench_*.csv")))
        if found:
            return found
    return []


def figures_dir_for(results: Path | str) -> Path:
    """Figures of the recorded GPU go to figures/ (the README shows them); any other GPU's go to
    `<its results folder>/figures/`, so they never replace the recorded ones."""
    results = Path(results).resolve()
    return FIGURES_DIR if results == RECORDED_RESULTS_DIR.resolve() else results / "figures"
