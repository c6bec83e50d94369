"""python -m altup_cupy {bench,check,figures}: benchmark, verify, and regenerate figures."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import _paths
from ._device import gpu_status
from ._extras import MissingExtraError
from .workloads import OPS, SUITES


def _selected(value: str, choices: tuple[str, ...]) -> tuple[str, ...]:
    return choices if value == "all" else (value,)


def _regenerate(results_dir: Path, figures_dir: Path | None, update_readme: bool) -> None:
    """Figures (and, if asked, the README's tables) from the CSVs in `results_dir`."""
    from . import figures, report

    figures_dir = figures_dir or _paths.figures_dir_for(results_dir)
    for path in figures.regenerate(results_dir, figures_dir):
        print(f"wrote {path}")
    if update_readme:
        if _paths.README is None:
            raise SystemExit("--update-readme: the README belongs to a checkout of the repository; "
                             "this package is an installed copy")
        report.update_readme(_paths.README, results_dir, figures_dir)
        print(f"updated the results table in {_paths.README}")


def _recorded_dirs(results_dir: Path | None) -> list[Path]:
    """The folder asked for, else every results/<gpu>/ holding CSVs (see _paths)."""
    return [results_dir] if results_dir is not None else _paths.recorded_results_dirs()


def _nothing_recorded() -> int:
    print(f"No recorded results: no {_paths.RESULTS_DIRNAME}/<gpu>/bench_*.csv under {Path.cwd()}. "
          f"Run `python -m altup_cupy bench` on a CUDA GPU to measure, or pass --results-dir.")
    return 0


def _gpu_of(results_dir: Path) -> str | None:
    """The GPU named in the CSVs already in `results_dir` (None if it holds none)."""
    from .bench import read_csv

    for path in sorted(results_dir.glob("bench_*.csv")):
        for row in read_csv(path):
            return row.get("gpu")
    return None


def cmd_bench(args) -> int:
    from . import report

    usable, why = gpu_status()
    if not usable:
        dirs = _recorded_dirs(args.results_dir)
        if not dirs:
            print(f"No GPU: {why}. Not measuring.")
            return _nothing_recorded()
        for results_dir in dirs:
            print(f"No GPU: {why}.\nNot measuring. Replaying the recorded results from {results_dir}:\n")
            print(report.markdown_tables(results_dir))
            _regenerate(results_dir, args.figures_dir, False)
        return 0
    import torch

    from . import bench
    from .benchmarks import op_bench
    from .workloads import workloads

    gpu = torch.cuda.get_device_name()
    results_dir = args.results_dir or _paths.results_dir(gpu)
    recorded_gpu = _gpu_of(results_dir)
    if recorded_gpu not in (None, gpu):
        print(f"{results_dir} holds measurements of {recorded_gpu}, this GPU is {gpu}: not overwriting "
              f"them. Pass another --results-dir (default: ./{_paths.RESULTS_DIRNAME}/{_paths.gpu_slug(gpu)}).",
              file=sys.stderr)
        return 2
    for op in _selected(args.op, OPS):
        for suite in _selected(args.suite, SUITES):
            chosen = workloads(op, suite)[: args.limit] if args.limit else workloads(op, suite)
            rows = bench.measure(op_bench(op), chosen, suite, reps=args.reps, warmup=args.warmup)
            path = bench.csv_path(op, suite, results_dir)
            bench.write_csv(rows, path)
            print(f"wrote {path}")
    from . import host_overhead

    path = Path(results_dir) / "host_overhead.csv"
    bench.write_csv(host_overhead.measure(_selected(args.op, OPS)), path, host_overhead.CSV_COLUMNS)
    print(f"wrote {path}")
    print(report.markdown_tables(results_dir))
    _regenerate(results_dir, args.figures_dir, args.update_readme)
    return 0


def cmd_check(args) -> int:
    usable, why = gpu_status()
    if not usable:
        from ._build import CHECK_ARCHS, check_all, load_nvrtc

        load_nvrtc()  # before any output: a missing extra is one line, not one per compile
        print(f"No GPU: {why}. Checking what needs none: every kernel source compiles for "
              f"{', '.join(CHECK_ARCHS)} with no spills and no stack frame.")
        return check_all()

    if args.seed is None:
        import random

        args.seed = random.SystemRandom().randrange(1 << 30)
        print(f"seed {args.seed}")
    failed = 0
    from .benchmarks import op_bench
    from .check import verify
    from .workloads import workloads

    print(f"{'op':26s} {'workload':22s} {'impl':14s} {'output':28s} {'matched':>9s} {'rel_l2':>9s} "
          f"{'fp32 torch':>10s}  verdict")
    for op in _selected(args.op, OPS):
        bench = op_bench(op)
        impls = [i.name for i in bench.impls(workloads(op)[0]) if i.name.startswith("altup_cupy")]
        for suite in _selected(args.suite, SUITES):
            for i, w in enumerate(workloads(op, suite)):
                for round_ in range(args.rounds):
                    for c in verify(bench, w, args.seed + 1000 * round_ + i, impls):
                        failed += not c.passed
                        print(f"{op:26s} {w.label:22s} {c.impl:14s} {c.output:28s} {c.match_ratio:9.5f} "
                              f"{c.rel_l2:9.2e} {c.oracle_rel_l2:10.2e}  {'ok' if c.passed else 'FAIL'}")
    print("all checks passed" if not failed else f"{failed} checks FAILED")
    return 1 if failed else 0


def cmd_figures(args) -> int:
    dirs = _recorded_dirs(args.results_dir)
    if not dirs:
        return _nothing_recorded()
    for results_dir in dirs:
        _regenerate(results_dir, args.figures_dir, args.update_readme)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m altup_cupy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--results-dir", type=Path, default=None,
                       help="CSV folder (default: ./results/<gpu-name>/, e.g. results/nvidia-h200/)")
        p.add_argument("--figures-dir", type=Path, default=None,
                       help="PNG folder (default: figures/ for the recorded H200 results, "
                            "<results-dir>/figures/ for any other GPU's)")
        p.add_argument("--update-readme", action="store_true", help="also rewrite the README's results table")

    p = sub.add_parser("bench", help="time every implementation on every workload (on a GPU); "
                                     "without one, replay the recorded results as tables and figures")
    common(p)
    p.add_argument("--op", choices=(*OPS, "all"), default="all")
    p.add_argument("--suite", choices=(*SUITES, "all"), default="all")
    p.add_argument("--reps", type=int, default=100, help="timed calls per measurement (median taken)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--limit", type=int, default=0, help="only the first LIMIT workloads of each suite")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("check", help="verify the kernels against float64 on fresh random inputs (on a "
                                     "GPU); without one, compile every kernel for sm_80, sm_86, sm_89 and "
                                     "sm_90 and report spills")
    p.add_argument("--op", choices=(*OPS, "all"), default="all")
    p.add_argument("--suite", choices=(*SUITES, "all"), default="benchmark")
    p.add_argument("--rounds", type=int, default=1, help="fresh input draws per workload")
    p.add_argument("--seed", type=int, default=None, help="first seed (default: random)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("figures", help="regenerate every figure from the recorded CSVs (no GPU needed)")
    common(p)
    p.set_defaults(func=cmd_figures)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except MissingExtraError as error:
        print(f"python -m altup_cupy {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
