"""python -m altup_cupy {bench,check,figures}: benchmark, verify, and regenerate figures."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._device import gpu_status
from ._extras import MissingExtraError
from .lab import paths as _paths
from .lab.workloads import OPS, SUITES


# `bench --suite gemma3n-model`: the whole-model benchmark (altup_cupy.lab.gemma3n_model), which
# takes its own arguments; `--suite all` stays the kernels' suites.
MODEL_SUITE = "gemma3n-model"
# Timed and warm-up calls of the kernel suites when --reps / --warmup are not given.
KERNEL_REPS, KERNEL_WARMUP = 100, 10


def _at_least(lowest: int):
    """An argparse type: an int >= lowest (argparse's own error, and exit code 2, otherwise)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be at least {lowest}, got {value}")
        return value
    parse.__name__ = "int"  # argparse's message names the type
    return parse


def _selected(value: str, choices: tuple[str, ...]) -> tuple[str, ...]:
    return choices if value == "all" else (value,)


def _regenerate(results_dir: Path, figures_dir: Path | None, update_readme: bool) -> None:
    """Figures (and, if asked, the README's tables) from the CSVs in `results_dir`."""
    from .lab import figures, report

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
    """The folder asked for (it must exist), else every results/<gpu>/ holding CSVs (see _paths)."""
    if results_dir is None:
        return _paths.recorded_results_dirs()
    if not results_dir.is_dir():
        raise SystemExit(f"--results-dir {results_dir}: no such folder")
    return [results_dir]


def _nothing_recorded() -> int:
    print(f"No recorded results: no {_paths.RESULTS_DIRNAME}/<gpu>/bench_*.csv under {Path.cwd()}. "
          f"Run `python -m altup_cupy bench` on a CUDA GPU to measure, or pass --results-dir.")
    return 0


def _gpu_of(results_dir: Path) -> str | None:
    """The GPU named in the CSVs already in `results_dir` (None if it holds none)."""
    from .lab.bench import read_csv

    for path in sorted(results_dir.glob("bench_*.csv")):
        for row in read_csv(path):
            return row.get("gpu")
    return None


def _bench_model(args) -> int:
    """The whole-model benchmark with the arguments bench did not take, and --reps, --warmup and
    --results-dir where given."""
    from .lab import gemma3n_model

    forwarded = list(args.model_args)
    for flag, value in (("--reps", args.reps), ("--warmup", args.warmup)):
        if value is not None:
            forwarded += [flag, str(value)]
    if args.results_dir is not None:
        forwarded += ["--out", str(args.results_dir / "gemma3n_model.csv")]
    return gemma3n_model.main(forwarded)


def cmd_bench(args) -> int:
    if args.suite == MODEL_SUITE:
        return _bench_model(args)
    from .lab import report

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
        if args.update_readme:
            print("--update-readme: nothing was measured, so the README is left as it is "
                  "(`python -m altup_cupy figures --update-readme` rewrites it from the recorded results)")
        return 0
    import torch

    from .lab import bench
    from .lab.benchmarks import op_bench
    from .lab.workloads import workloads

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
            rows = bench.measure(op_bench(op), chosen, suite,
                                 reps=KERNEL_REPS if args.reps is None else args.reps,
                                 warmup=KERNEL_WARMUP if args.warmup is None else args.warmup)
            path = bench.csv_path(op, suite, results_dir)
            bench.write_csv(rows, path)
            print(f"wrote {path}")
    from .lab import host_overhead

    path = Path(results_dir) / "host_overhead.csv"
    bench.write_csv(host_overhead.measure(_selected(args.op, OPS)), path, host_overhead.CSV_COLUMNS)
    print(f"wrote {path}")
    print(report.markdown_tables(results_dir))
    _regenerate(results_dir, args.figures_dir, args.update_readme)
    return 0


def cmd_check(args) -> int:
    usable, why = gpu_status()
    if not usable:
        from ._build import load_nvrtc
        from ._sources import ALL_SOURCES
        from .lab.compile_report import CHECK_ARCHS, check_all, op_sources

        load_nvrtc()  # before any output: a missing extra is one line, not one per compile
        which = "every kernel source" if args.op == "all" else f"every kernel source of {args.op}"
        print(f"No GPU: {why}. Checking what needs none: {which} compiles for "
              f"{', '.join(CHECK_ARCHS)} with no spills and no stack frame.")
        gpu_only = [flag for flag, given in (("--suite", args.suite != "benchmark"), ("--rounds", args.rounds != 1),
                                             ("--seed", args.seed is not None)) if given]
        if gpu_only:
            verb, pronoun = ("choose", "they do") if len(gpu_only) > 1 else ("chooses", "it does")
            print(f"({', '.join(gpu_only)} {verb} the inputs of the check on a GPU; without one {pronoun} not apply.)")
        return check_all(sources=ALL_SOURCES if args.op == "all" else op_sources(args.op))

    if args.seed is None:
        import random

        args.seed = random.SystemRandom().randrange(1 << 30)
        print(f"seed {args.seed}")
    failed = 0
    from .lab.benchmarks import op_bench
    from .lab.check import verify
    from .lab.workloads import workloads

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
    p.add_argument("--suite", choices=(*SUITES, "all", MODEL_SUITE), default="all",
                   help=f"all: every kernel suite; {MODEL_SUITE}: a whole Gemma 3n model, patched and not "
                        "(python -m altup_cupy.lab.gemma3n_model; its own arguments follow: its --help "
                        "lists them)")
    p.add_argument("--reps", type=_at_least(1), default=None,
                   help=f"timed calls per measurement, median taken (default {KERNEL_REPS}; "
                        f"{MODEL_SUITE}: its own)")
    p.add_argument("--warmup", type=_at_least(0), default=None,
                   help=f"untimed calls first (default {KERNEL_WARMUP}; {MODEL_SUITE}: its own)")
    p.add_argument("--limit", type=_at_least(0), default=0,
                   help="only the first LIMIT workloads of each suite (0: all)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("check", help="verify the kernels against float64 on fresh random inputs (on a "
                                     "GPU); without one, compile every kernel (or --op's) for sm_80, sm_86, "
                                     "sm_89 and sm_90 and report spills")
    p.add_argument("--op", choices=(*OPS, "all"), default="all")
    p.add_argument("--suite", choices=(*SUITES, "all"), default="benchmark")
    p.add_argument("--rounds", type=_at_least(1), default=1, help="fresh input draws per workload")
    p.add_argument("--seed", type=int, default=None, help="first seed (default: random)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("figures", help="regenerate every figure from the recorded CSVs (no GPU needed)")
    common(p)
    p.set_defaults(func=cmd_figures)

    args, rest = parser.parse_known_args(argv)
    model_suite = args.command == "bench" and args.suite == MODEL_SUITE
    if rest and not model_suite:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if model_suite:
        kernel_only = [flag for flag, given in (("--op", args.op != "all"), ("--limit", args.limit != 0),
                                                ("--figures-dir", args.figures_dir is not None),
                                                ("--update-readme", args.update_readme)) if given]
        if kernel_only:
            parser.error(f"bench --suite {MODEL_SUITE} takes no {', '.join(kernel_only)} (the kernel suites' "
                         "options; the model's: python -m altup_cupy.lab.gemma3n_model --help)")
    args.model_args = rest
    try:
        return args.func(args)
    except MissingExtraError as error:
        print(f"python -m altup_cupy {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
