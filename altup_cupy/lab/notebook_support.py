"""Small helpers shared by the notebooks under notebooks/ (no GPU needed to import).

- `results_dir()`: the folder of the recorded measurements, the one place the notebooks find it.
- `mode()`: "gpu" when CuPy and torch both see a CUDA device, else "cpu" (the notebooks then
  replay the recorded CSVs); `ALTUP_NOTEBOOK_MODE=cpu` forces CPU mode, `=gpu` demands a GPU.
  It prints the notebook's first line: what ran, on which GPU, at which commit.
- `checkout_commit()`: the commit of the code the notebook runs (its derivations, kernel sources).
- `version_table(op, rows)`: the op's kernel versions as its registry lists them, for the text.
- `kernel_source(name)`: one kernel's (or device function's) source with the comment block above
  it, found in the package's .cu/.cuh files, so a notebook shows the code it explains.
- `ncu_launches(filename)`: the profiled launches of a recorded Nsight Compute report, each with
  its metrics and lines, so a notebook quotes the profile instead of retyping it.
- `recorded_rows(op, suite)`, `live_rows(op, workloads)`: the rows a table or figure is drawn from.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import Sequence

from .._device import gpu_status
from .bench import csv_path, read_csv, run_info
from .figures import parse_rows
from .paths import PACKAGE_DIR, RECORDED_RESULTS_DIR, REPO_ROOT
from .report import dropped_versions



def results_dir() -> Path:
    """The recorded measurements' folder."""
    if not RECORDED_RESULTS_DIR.is_dir():
        raise FileNotFoundError(f"no recorded results: {RECORDED_RESULTS_DIR} does not exist")
    return RECORDED_RESULTS_DIR


def recorded_provenance(folder: Path | None = None) -> dict:
    """{'git_sha', 'gpu', 'date'} of the recorded benchmark CSVs (each joined with ', ' if several)."""
    folder = folder or results_dir()
    seen: dict[str, set] = {"git_sha": set(), "gpu": set(), "date": set()}
    for path in sorted(folder.glob("bench_*.csv")):
        for row in read_csv(path):
            for key in seen:
                if row.get(key):
                    seen[key].add(row[key][:10] if key == "date" else row[key])
    return {key: ", ".join(sorted(values)) or "unknown" for key, values in seen.items()}


def checkout_commit() -> str:
    """The git commit of this checkout (ALTUP_GIT_SHA if set; the package version if installed)."""
    return run_info()["git_sha"]


def mode(verbose: bool = True) -> str:
    """'gpu' or 'cpu', printing which, why, and what the outputs below come from."""
    forced = os.environ.get("ALTUP_NOTEBOOK_MODE", "").strip().lower()
    usable, why = gpu_status()
    if forced == "gpu" and not usable:
        raise RuntimeError(f"ALTUP_NOTEBOOK_MODE=gpu but no usable GPU: {why}")
    chosen = "gpu" if usable and forced != "cpu" else "cpu"
    if verbose:
        if chosen == "gpu":
            info = run_info()
            print(f"GPU mode: measured live on {info['gpu']}, altup_cupy at git {info['git_sha']} "
                  f"({info['date']}).")
        else:
            reason = "ALTUP_NOTEBOOK_MODE=cpu" if usable else why
            folder = results_dir()
            rec = recorded_provenance(folder)
            print(f"CPU mode ({reason}).\nReplaying the recorded CSVs of altup_cupy at git {rec['git_sha']}, "
                  f"recorded on {rec['gpu']} ({rec['date']}), from {_shown(folder)}/; "
                  f"derivations and kernel sources from altup_cupy at git {checkout_commit()}.")
    return chosen


def _shown(path: Path) -> str:
    """How the notebooks name a file: from the checkout's root, or from the folder an installed
    package lies in (where there is no checkout); absolute if it is under neither."""
    root = REPO_ROOT if REPO_ROOT is not None else PACKAGE_DIR.parent
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


def _source_files() -> list[Path]:
    return sorted([*PACKAGE_DIR.rglob("*.cu"), *PACKAGE_DIR.rglob("*.cuh")])


def _definition_start(lines: list[str], name: str) -> int | None:
    """Index of the line where `name(` is defined (its signature reaches a "{" before any ";")."""
    pattern = re.compile(rf"\b{re.escape(name)}\s*\(")
    for i, line in enumerate(lines):
        if pattern.search(line) and not line.lstrip().startswith("//") and not line.rstrip().endswith(";"):
            rest = "\n".join(lines[i:i + 40])
            brace, semi = rest.find("{"), rest.find(";")
            if brace >= 0 and (semi < 0 or brace < semi or ")" in rest[:brace]):
                return i
    return None


def kernel_source(name: str, comment: bool = True) -> str:
    """The definition of kernel (or device function / struct) `name` in the package's CUDA sources,
    from its `template` line (and the `//` comment block just above, if `comment`) to its closing
    brace, headed by the file it is in."""
    for path in _source_files():
        lines = path.read_text().splitlines()
        start = _definition_start(lines, name)
        if start is None:
            continue
        first = start
        while first > 0 and (lines[first - 1].startswith("template") or "__global__" in lines[first - 1]):
            first -= 1
        if comment:
            while first > 0 and lines[first - 1].lstrip().startswith("//"):
                first -= 1
        depth, seen, end = 0, False, len(lines) - 1
        for j in range(start, len(lines)):
            code = lines[j].split("//", 1)[0]
            depth += code.count("{") - code.count("}")
            seen = seen or "{" in code
            if seen and depth == 0:
                end = j
                break
        return f"// {_shown(path)}\n" + "\n".join(lines[first:end + 1])
    raise KeyError(f"{name} is defined in none of the package's CUDA sources")


def file_header(name: str) -> str:
    """The leading comment block of the package's CUDA source that defines `name`."""
    for path in _source_files():
        lines = path.read_text().splitlines()
        if _definition_start(lines, name) is not None:
            header = []
            for line in lines:
                if not line.startswith("//"):
                    break
                header.append(line)
            return f"// {_shown(path)}\n" + "\n".join(header)
    raise KeyError(f"{name} is defined in none of the package's CUDA sources")


_NCU_METRIC = re.compile(r"^\s{4}(\S.*?\S)\s{2,}(?:(\S+)\s{2,})?([\d,.]+)\s*$")


def _is_launch_header(line: str) -> bool:
    return line.startswith("  ") and not line.startswith("   ") and "(" in line and "Context" in line


def ncu_launches(filename: str) -> list[dict]:
    """Every profiled launch in the recorded Nsight Compute text report `filename` (in results_dir()),
    in file order: {'kernel', 'header', 'lines', 'metrics' {name: float}, 'ran' (the profiled
    script's "ran ..." line, if any)}."""
    text = (results_dir() / filename).read_text().splitlines()
    ran = next((line for line in text if line.startswith("ran ")), "")
    starts = [i for i, line in enumerate(text) if _is_launch_header(line)] + [len(text)]
    launches = []
    for begin, end in zip(starts, starts[1:]):
        lines = text[begin:end]
        metrics: dict[str, float] = {}
        for line in lines[1:]:
            match = _NCU_METRIC.match(line)
            if match:
                metrics.setdefault(match.group(1), float(match.group(3).replace(",", "")))
        kernel = re.search(r"(\w+)\s*[<(]", lines[0].strip().removeprefix("void ")).group(1)
        launches.append({"kernel": kernel, "header": lines[0].strip(), "lines": lines, "metrics": metrics,
                         "ran": ran})
    return launches


def ncu_excerpt(launch: dict, keys: Sequence[str]) -> str:
    """The launch's header and its report lines containing any of `keys`, as they are in the file."""
    picked = [line.rstrip() for line in launch["lines"][1:] if any(k in line for k in keys)]
    return "\n".join([launch["header"][:100] + " ...", *picked])


def version_table(op: str, rows: Sequence[dict] = ()) -> str:
    """Markdown: `op`'s kernel versions as its registry (`altup_cupy.ops.<op>_versions`) lists them,
    with the compute capability each needs, what it changed, why it stays registered where the
    default beats it everywhere (`Version.kept_because`), whether `rows` hold it as its own
    `altup_cupy_v<n>` line, the order in which the default `altup_cupy` picks among them, and the
    `altup_cupy_v<n>` lines of `rows` whose version the registry no longer has."""
    registry = importlib.import_module(f"altup_cupy.ops.{op}_versions")
    listed = {row["impl"] for row in rows}
    lines = ["| version | needs compute capability | what it changed | kept, though slower than the default, "
             "because | its own line in these results |",
             "|---|---:|---|---|---|"]
    for number, version in sorted(registry.VERSIONS.items()):
        capability = version.min_compute_capability
        name = f"altup_cupy_v{number}"
        lines.append(f"| v{number} | {capability // 10}.{capability % 10} | {version.note} | "
                     f"{version.kept_because or '—'} | {f'`{name}`' if name in listed else 'no'} |")
    order = ", else ".join(f"v{number}" for number in registry.PREFERENCE)
    table = "\n".join(lines) + (f"\n\nThe default, `altup_cupy`, runs {order}: the first that serves the "
                                "GPU and the shape (so the default's own version has no line of its own).")
    dropped = dropped_versions(op, listed)
    if dropped:
        table += (f"\n\nIn these results but no longer in the registry: {', '.join(f'`{n}`' for n in dropped)} "
                  "(measured before the version was dropped; git history keeps its code).")
    return table


def recorded_rows(op: str, suite: str = "benchmark") -> list[dict]:
    """Parsed rows of the recorded CSV, or [] (with a message) if it is absent."""
    path = csv_path(op, suite, results_dir())
    if not path.is_file():
        print(f"No recorded results for {op} / {suite} yet ({path.name} is absent).")
        return []
    return parse_rows(read_csv(path))


def live_rows(op: str, workloads: Sequence, suite: str = "benchmark", reps: int = 30,
              warmup: int = 5) -> list[dict]:
    """Check and time this package's kernels, the plain PyTorch baseline and the floor of `op` on
    `workloads` now (GPU mode only). The full comparison, torch.compile included, is the recorded
    benchmark's: compiling here would cost minutes for nothing new."""
    from .bench import measure
    from .benchmarks import op_bench

    bench = op_bench(op)
    names = [i.name for i in bench.impls(workloads[0])
             if i.name.startswith("altup_cupy") or i.name == bench.oracle_impl or not i.checked]
    rows = measure(bench, workloads, suite, reps=reps, warmup=warmup, progress=False, impl_names=names)
    return parse_rows({k: str(v) for k, v in r.items()} for r in rows)
