"""Small helpers shared by the notebooks under notebooks/ (no GPU needed to import).

- `mode()`: "gpu" when CuPy and torch both see a CUDA device, else "cpu" (the notebooks then
  replay the recorded CSVs); `ALTUP_NOTEBOOK_MODE=cpu` forces CPU mode, `=gpu` demands a GPU.
- `kernel_source(filename, name)`: one kernel's source (with the comment block above it) read
  from the package's .cu/.cuh file in altup_cupy/kernels/, so a notebook shows the code it explains.
- `recorded_rows(op, suite)`, `live_rows(op, workloads)`: the rows a table or figure is drawn from.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

from ._build import KERNELS_DIR
from ._device import gpu_status
from ._paths import RECORDED_RESULTS_DIR, REPO_ROOT
from .bench import csv_path, read_csv
from .figures import parse_rows

PACKAGE_DIR = Path(__file__).resolve().parent


def mode(verbose: bool = True) -> str:
    """'gpu' or 'cpu', printing which and why."""
    forced = os.environ.get("ALTUP_NOTEBOOK_MODE", "").strip().lower()
    usable, why = gpu_status()
    if forced == "gpu" and not usable:
        raise RuntimeError(f"ALTUP_NOTEBOOK_MODE=gpu but no usable GPU: {why}")
    chosen = "gpu" if usable and forced != "cpu" else "cpu"
    if verbose:
        if chosen == "gpu":
            import torch

            print(f"GPU mode: measuring live on {torch.cuda.get_device_name()}.")
        else:
            reason = "ALTUP_NOTEBOOK_MODE=cpu" if usable else why
            print(f"CPU mode ({reason}): no live measurement; the tables and figures below replay "
                  f"the recorded measurements in {_shown(RECORDED_RESULTS_DIR)}/.")
    return chosen


def kernel_source(filename: str, name: str, comment: bool = True) -> str:
    """The definition of kernel (or device function / struct) `name` in kernels/`filename`,
    from its `template` line (and the `//` comment block just above, if `comment`) to its closing brace."""
    text = (KERNELS_DIR / filename).read_text()
    lines = text.splitlines()
    pattern = re.compile(rf"\b{re.escape(name)}\s*\(")
    start = None
    for i, line in enumerate(lines):
        if pattern.search(line) and not line.lstrip().startswith("//") and not line.rstrip().endswith(";"):
            # must be a definition: the signature is followed by a "{" before any ";"
            rest = "\n".join(lines[i:i + 40])
            brace, semi = rest.find("{"), rest.find(";")
            if brace >= 0 and (semi < 0 or brace < semi or ")" in rest[:brace]):
                start = i
                break
    if start is None:
        raise KeyError(f"{name} not found in {filename}")
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
    return "\n".join(lines[first:end + 1])


def file_header(filename: str) -> str:
    """The leading comment block of a kernel source file (kernels/`filename`)."""
    out = []
    for line in (KERNELS_DIR / filename).read_text().splitlines():
        if not line.startswith("//"):
            break
        out.append(line)
    return "\n".join(out)


def _shown(path: Path) -> str:
    """`path` as the notebooks print it: relative to the checkout (or the current directory)."""
    for base in (REPO_ROOT, Path.cwd()):
        if base is not None and path.is_relative_to(base):
            return path.relative_to(base).as_posix()
    return path.as_posix()


def recorded_rows(op: str, suite: str = "benchmark", results_dir: Path = RECORDED_RESULTS_DIR) -> list[dict]:
    """Parsed rows of the recorded CSV, or [] (with a message) if it is absent."""
    path = csv_path(op, suite, results_dir)
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
