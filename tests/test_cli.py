"""Where the CLI reads and writes (altup_cupy.lab.paths) and what it says when something is missing.
No GPU needed: on a machine without one, `bench` replays recorded results."""

from __future__ import annotations

from pathlib import Path

import pytest

from altup_cupy import __main__ as altup_main
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
    assert (results / "figures" / "roofline.png").is_file(), "another GPU's figures go to its own folder"


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


def test_a_missing_extra_is_named():
    with pytest.raises(MissingExtraError, match=r"pip install 'altup_cupy\[figures\]'"):
        require("altup_cupy_no_such_module", "figures")
    assert require("json", "figures").dumps([]) == "[]"


def test_cli_names_the_extra_when_matplotlib_is_missing(tmp_path, monkeypatch, capsys):
    import sys

    write_synthetic(tmp_path / "r")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    assert main(["figures", "--results-dir", str(tmp_path / "r"), "--figures-dir", str(tmp_path / "f")]) == 1
    assert "pip install 'altup_cupy[figures]'" in capsys.readouterr().err


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
