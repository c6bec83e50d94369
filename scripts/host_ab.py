"""Host cost per call of an earlier commit's package against this tree's, measured in one process.

    git archive ce42255 altup_cupy | tar -x -C /tmp/base
    python3 scripts/host_ab.py --base-tree /tmp/base --base-commit ce42255 --rounds 16 \
        --out results/<gpu>/host_ab_ce42255.csv

`host_overhead.csv` (altup_cupy.lab.host_overhead) compares an op with one torch.matmul; comparing
two commits' host costs from two such runs mixes in how fast the host happened to be in each (one
process's torch.matmul took 13 µs, the next one's 27 µs on the same machine). Here the earlier
package is imported beside this one under another name (a copy of `<base-tree>/altup_cupy` with
every `altup_cupy` renamed `altup_cupy_base`, its operators in their own namespace), and each round
runs the earlier package's `measure` and this tree's, in alternating order, so both see the same
host state. Every round times one torch.matmul with each; the ratios below divide by that round's.

CSV rows, one per op, implementation and token count: the median host µs per call of each tree,
the median over rounds of this tree's cost over the earlier one's, raw and normalised by each
round's torch.matmul, and in how many rounds this tree was the cheaper.
"""

from __future__ import annotations

import argparse
import csv
import re
import shutil
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
BASE_NAME = "altup_cupy_base"
COLUMNS = ("op", "impl", "tokens", "base_host_us", "host_us", "ratio", "ratio_vs_matmul", "rounds_cheaper",
           "rounds", "gpu", "base_commit", "git_sha", "date")


def renamed_copy(base_tree: Path, into: Path) -> Path:
    """`base_tree/altup_cupy` copied to `into/altup_cupy_base` with every `altup_cupy` renamed."""
    source = base_tree / "altup_cupy"
    if not (source / "__init__.py").is_file():
        raise SystemExit(f"--base-tree: {source} is not an altup_cupy package")
    target = into / BASE_NAME
    shutil.copytree(source, target)
    word = re.compile(r"\baltup_cupy\b")
    for path in target.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".cu", ".cuh", ".json"):
            path.write_text(word.sub(BASE_NAME, path.read_text()))
    return into


def _base_host_overhead():
    """The earlier package's host_overhead module (under lab/ from 2026-12 on, top level before)."""
    import importlib

    try:
        return importlib.import_module(f"{BASE_NAME}.lab.host_overhead")
    except ModuleNotFoundError:
        return importlib.import_module(f"{BASE_NAME}.host_overhead")


def measure_rounds(base_measure, head_measure, rounds: int, tokens: tuple[int, ...]) -> list[dict]:
    """One record per round, tree, op, implementation and token count."""
    records = []
    for r in tqdm(range(rounds), desc="rounds", file=sys.stderr):
        trees = [("base", base_measure), ("head", head_measure)]
        for tree, measure in (trees if r % 2 == 0 else trees[::-1]):
            for row in measure(tokens=tokens):
                records.append({"round": r, "tree": tree, "op": row["op"],
                                "impl": row["impl"].replace(BASE_NAME, "altup_cupy"), "tokens": row["tokens"],
                                "host_us": row["host_us"], "matmul_us": row["torch_matmul_host_us"]})
    return records


def summarise(records: list[dict]) -> list[dict]:
    by_case: dict[tuple, dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for rec in records:
        by_case[(rec["op"], rec["impl"], rec["tokens"])][rec["tree"]][rec["round"]] = rec
    rows = []
    for (op, impl, tokens), trees in by_case.items():
        base, head = trees["base"], trees["head"]
        rounds = sorted(set(base) & set(head))
        ratios = [head[r]["host_us"] / base[r]["host_us"] for r in rounds]
        normalised = [(head[r]["host_us"] / head[r]["matmul_us"]) / (base[r]["host_us"] / base[r]["matmul_us"])
                      for r in rounds]
        rows.append({"op": op, "impl": impl, "tokens": tokens,
                     "base_host_us": round(statistics.median(base[r]["host_us"] for r in rounds), 1),
                     "host_us": round(statistics.median(head[r]["host_us"] for r in rounds), 1),
                     "ratio": round(statistics.median(ratios), 3),
                     "ratio_vs_matmul": round(statistics.median(normalised), 3),
                     "rounds_cheaper": sum(x < 1 for x in ratios), "rounds": len(rounds)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-tree", type=Path, required=True,
                        help="a folder holding the earlier commit's altup_cupy/ (git archive <commit> altup_cupy)")
    parser.add_argument("--base-commit", required=True, help="that commit, for the CSV")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("host_ab: needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as folder:
        sys.path.insert(0, str(renamed_copy(args.base_tree, Path(folder))))
        base = _base_host_overhead()
        from altup_cupy.lab import host_overhead
        from altup_cupy.lab.bench import run_info

        records = measure_rounds(base.measure, host_overhead.measure, args.rounds, host_overhead.TOKENS)
    info = run_info()
    rows = [{**row, "base_commit": args.base_commit, **info}
            for row in summarise(records)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        print(f"{row['op']:>24} {row['impl']:>13} M={row['tokens']:<5} {row['base_host_us']:7.1f} -> "
              f"{row['host_us']:7.1f} µs  x{row['ratio']:.3f} (x{row['ratio_vs_matmul']:.3f} vs matmul), "
              f"cheaper in {row['rounds_cheaper']}/{row['rounds']} rounds")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
