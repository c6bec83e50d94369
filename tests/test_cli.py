"""Where the CLI reads and writes (altup_cupy.lab.paths) and what it says when something is missing.
No GPU needed: on a machine without one, `bench` replays recorded results."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from altup_cupy import __main__ as altup_main
from altup_cupy import _extras, _sources
from altup_cupy.__main__ import _gpu_of, main
from altup_cupy._extras import MissingExtraError, require
from altup_cupy.lab import paths
from test_figures import write_synthetic


@pytest.mark.parametrize("name,slug", [("NVIDIA H200", "nvidia-h200"),
                                       ("NVIDIA A100-SXM4-80GB", "nvidia-a100-sxm4-80gb"),
                                       ("  NVIDIA GeForce RTX 4090 ", "nvidia-geforce-rtx-4090")])
def test_gpu_slug(name, slug):
    assert paths.gpu_slug(name) == slug


def test_gpu_slug_rejects_a_name_without_letters():
    with pytest.raises(ValueError, match="gpu_name"):
        paths.gpu_slug(" -- ")


def test_results_dir_is_per_gpu_under_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert paths.results_dir("NVIDIA H200") == tmp_path / "results" / "nvidia-h200"
    assert paths.results_dir("NVIDIA L40S", "/data") == Path("/data/results/nvidia-l40s")


def test_the_checkout_records_the_h200():
    assert paths.REPO_ROOT is not None, "the tests run from a checkout"
    assert paths.RECORDED_RESULTS_DIR == paths.REPO_ROOT / "results" / "nvidia-h200"
    assert any(paths.RECORDED_RESULTS_DIR.glob("bench_*.csv"))
    assert paths.figures_dir_for(paths.RECORDED_RESULTS_DIR) == paths.FIGURES_DIR


def test_another_gpus_figures_stay_in_its_results_folder(tmp_path):
    other = tmp_path / "results" / "nvidia-a100"
    assert paths.figures_dir_for(other) == other.resolve() / "figures"


def test_recorded_results_dirs_prefer_the_current_directory(tmp_path, monkeypatch):
    write_synthetic(tmp_path / "results" / "nvidia-l40s")
    (tmp_path / "results" / "empty-gpu").mkdir()
    monkeypatch.chdir(tmp_path)
    assert paths.recorded_results_dirs() == [tmp_path / "results" / "nvidia-l40s"]


def test_bench_without_gpu_replays_a_results_folder(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results" / "nvidia-l40s"
    write_synthetic(results)
    monkeypatch.chdir(tmp_path)
    # the same on a GPU machine: `bench` must not measure here
    monkeypatch.setattr(altup_main, "gpu_status", lambda: (False, "hidden by the test"))
    assert main(["bench", "--results-dir", str(results)]) == 0
    out = capsys.readouterr().out
    assert "Not measuring. Replaying" in out and "collapse forward, benchmark suite" in out
    assert (results / "figures" / "roofline_collapse.png").is_file(), "another GPU's figures go to its own folder"


def test_figures_with_nothing_recorded_says_so_and_exits_zero(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "nothing"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert main(["figures", "--results-dir", str(empty), "--figures-dir", str(tmp_path / "out")]) == 0
    assert "nothing to draw" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_gpu_of_reads_the_recorded_gpu(tmp_path):
    assert _gpu_of(tmp_path) is None
    write_synthetic(tmp_path)
    assert _gpu_of(tmp_path) == "NVIDIA H200"


FIGURES_COMMAND = "pip install 'matplotlib>=3.8' 'pillow>=10'"


def test_a_missing_extra_is_named_with_its_install_command():
    with pytest.raises(MissingExtraError, match=rf"^altup_cupy_no_such_module is not installed; it comes with the "
                                                rf"'figures' extra: {re.escape(FIGURES_COMMAND)}$"):
        require("altup_cupy_no_such_module", "figures")
    assert require("json", "figures").dumps([]) == "[]"


def test_the_install_command_is_the_extras_requirements(monkeypatch):
    """What the installed package declares for the extra, the package's own extras expanded (it is
    installed from a checkout, not from an index); a checkout run without installing gets the
    editable install."""
    assert _extras.install_command("figures") == FIGURES_COMMAND
    nvrtc = "'cuda-bindings<14,>=13' 'nvidia-cuda-nvrtc<14,>=13'"
    assert _extras.install_command("nvrtc") == f"pip install {nvrtc}"
    assert _extras.install_command("gpu") == f"pip install 'cupy-cuda13x>=14' {nvrtc}"

    def not_installed(distribution):
        raise _extras.metadata.PackageNotFoundError(distribution)

    monkeypatch.setattr(_extras.metadata, "requires", not_installed)
    assert _extras.install_command("figures") == "pip install -e '.[figures]' in the checkout"


def _one_line_naming(err: str, extra: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"it comes with the '{extra}' extra: {_extras.install_command(extra)}" in lines[0]
    return lines[0]


def test_cli_names_the_extra_when_matplotlib_is_missing(tmp_path, monkeypatch, capsys):
    write_synthetic(tmp_path / "r")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    assert main(["figures", "--results-dir", str(tmp_path / "r"), "--figures-dir", str(tmp_path / "f")]) == 1
    _one_line_naming(capsys.readouterr().err, "figures")


def test_bench_replay_names_the_extra_when_matplotlib_is_missing(tmp_path, monkeypatch, capsys):
    write_synthetic(tmp_path / "r")
    monkeypatch.setattr(altup_main, "gpu_status", lambda: (False, "hidden by the test"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "--results-dir", str(tmp_path / "r"), "--figures-dir", str(tmp_path / "f")]) == 1
    assert _one_line_naming(capsys.readouterr().err, "figures").startswith("python -m altup_cupy bench: matplotlib")


def test_bench_names_the_extra_when_tqdm_is_missing(monkeypatch):
    from altup_cupy.lab import bench
    from altup_cupy.lab.benchmarks import op_bench

    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import tqdm.auto -> ModuleNotFoundError
    with pytest.raises(MissingExtraError, match="tqdm is not installed; it comes with the 'bench' extra"):
        bench.measure(op_bench("collapse"), [], "benchmark")


@pytest.mark.parametrize("missing_part", ["bindings", "library"])
def test_check_without_nvrtc_says_so_once(monkeypatch, capsys, missing_part):
    """Without cuda-bindings, or without the NVRTC library it loads: one line naming the extra,
    no compile attempted (not one failure per source and architecture)."""
    monkeypatch.setattr(altup_main, "gpu_status", lambda: (False, "hidden by the test"))
    if missing_part == "bindings":
        monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)
        what = "cuda-bindings is not installed"
    else:
        def no_library():
            raise RuntimeError('Failure finding "libnvrtc.so.13"')

        monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", types.SimpleNamespace(nvrtcVersion=no_library))
        what = "the NVRTC library (nvidia-cuda-nvrtc) is not installed"
    assert main(["check"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert _one_line_naming(err, "nvrtc").startswith(f"python -m altup_cupy check: {what}")


def test_check_without_a_gpu_compiles_the_chosen_op_and_names_what_needs_a_gpu(monkeypatch, capsys):
    """`check --op collapse` without a GPU compiles the collapse's sources only (those its registry
    names), and says that --suite, --rounds and --seed apply to the check on a GPU."""
    from altup_cupy import _build
    from altup_cupy.lab import compile_report
    from altup_cupy.ops.collapse_versions import VERSIONS

    monkeypatch.setattr(altup_main, "gpu_status", lambda: (False, "hidden by the test"))
    monkeypatch.setattr(_build, "load_nvrtc", lambda: None)
    compiled = []
    monkeypatch.setattr(compile_report, "check_all", lambda sources: compiled.append(list(sources)) or 0)
    assert main(["check", "--op", "collapse", "--rounds", "3", "--seed", "7"]) == 0
    expected = {source.filename for version in VERSIONS.values() for source in version.sources}
    assert [{source.filename for source in sources} for sources in compiled] == [expected]
    assert len(compiled[0]) == len(expected)  # each source once
    out = capsys.readouterr().out
    assert "every kernel source of collapse" in out
    assert "--rounds, --seed choose the inputs of the check on a GPU" in out
    compiled.clear()
    assert main(["check"]) == 0
    assert [len(sources) for sources in compiled] == [len(_sources.ALL_SOURCES)]
    assert "apply" not in capsys.readouterr().out


def test_bench_model_suite_passes_its_arguments_through(tmp_path, monkeypatch):
    from altup_cupy.lab import gemma3n_model

    received = []
    monkeypatch.setattr(gemma3n_model, "main", lambda argv: received.append(argv) or 0)
    assert main(["bench", "--suite", "gemma3n-model", "--config", "tiny", "--device", "cpu", "--reps", "2",
                 "--results-dir", str(tmp_path)]) == 0
    assert received == [["--config", "tiny", "--device", "cpu", "--reps", "2", "--out",
                         str(tmp_path / "gemma3n_model.csv")]]


def test_bench_refuses_unknown_arguments_of_the_kernel_suites(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--suite", "benchmark", "--config", "tiny"])
    assert "unrecognized arguments: --config tiny" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["check", "--rounds", "0"], ["bench", "--reps", "0"], ["bench", "--limit", "-1"],
                                  ["bench", "--warmup", "-1"]])
def test_counts_below_their_least_are_refused_before_anything_runs(argv, capsys):
    """`check --rounds 0` would check nothing and say all passed; `--limit -2` would drop workloads."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "must be at least" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["figures", "bench"])
def test_a_results_folder_that_does_not_exist_is_an_error(tmp_path, monkeypatch, command):
    monkeypatch.setattr(altup_main, "gpu_status", lambda: (False, "hidden by the test"))
    for missing in (tmp_path / "nowhere", tmp_path / "a_file.csv"):
        missing.parent.mkdir(exist_ok=True)
        if missing.suffix:
            missing.write_text("x\n")
        with pytest.raises(SystemExit, match="no such folder"):
            main([command, "--results-dir", str(missing)])


def test_model_bench_refuses_an_output_it_cannot_append_to_before_any_case(tmp_path, monkeypatch, capsys):
    from altup_cupy.lab import gemma3n_model

    monkeypatch.setattr(gemma3n_model, "run_case", lambda *a, **k: pytest.fail("a case ran"))
    other_schema = tmp_path / "other.csv"
    other_schema.write_text("op,impl\n")
    a_file = tmp_path / "file"
    a_file.write_text("")
    for out, said in ((tmp_path, "is a folder"), (other_schema, "has columns"), (a_file / "m.csv", "is a file")):
        assert gemma3n_model.main(["--device", "cpu", "--config", "tiny", "--no-progress", "--out", str(out)]) == 2
        assert said in capsys.readouterr().err


def test_model_bench_names_the_extra_when_transformers_is_missing(monkeypatch, capsys):
    from altup_cupy.lab import gemma3n_model

    monkeypatch.setitem(sys.modules, "transformers", None)
    assert gemma3n_model.main(["--device", "cpu", "--config", "tiny", "--no-progress"]) == 1
    assert "transformers is not installed; it comes with the 'gemma3n' extra" in capsys.readouterr().err


def test_op_registration_refuses_a_folder_as_its_csv(tmp_path, capsys):
    from altup_cupy.lab import op_registration

    with pytest.raises(SystemExit) as exit_info:
        op_registration.main(["--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "is a folder" in capsys.readouterr().err


def test_occupancy_help_compiles_nothing(capsys):
    """`python -m altup_cupy.lab.occupancy --help` prints its usage (the table takes ~3 minutes of
    compiling and overwrites the recorded CSV by default: --help must not start it)."""
    from altup_cupy.lab import occupancy

    with pytest.raises(SystemExit) as done:
        occupancy.main(["--help"])
    assert done.value.code == 0 and "--out" in capsys.readouterr().out


@pytest.mark.parametrize("flag", (["--limit", "2"], ["--op", "collapse"], ["--update-readme"], ["--figures-dir", "x"]))
def test_model_suite_refuses_the_kernel_suites_options(flag, capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "--suite", "gemma3n-model", *flag])
    assert done.value.code == 2 and flag[0] in capsys.readouterr().err
