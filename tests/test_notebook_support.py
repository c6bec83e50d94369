"""notebook_support: where the recorded results are found, how a recorded Nsight Compute report is
read, and how kernel sources are quoted. No GPU needed."""

from __future__ import annotations

import pytest

from altup_cupy.lab import notebook_support as nbs

NCU_REPORT = """==PROF== Profiling "kernel_a": 0%....50%....100% - 10 passes
ran N3_H2304_B1_S256 version=None x1
[9] python3.12@127.0.0.1
  void kernel_a<3, 0>(const uint4 *, int) (132, 1, 1)x(320, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    Duration                         us        11.46
    Executed Instructions                           inst   62,986,892
    Issued Warp Per Scheduler                        0.31
          first. This stall type represents about 47.5% of the total average of 7.2 cycles
  void kernel_b<3>(const float4 *, int) (73, 1, 1)x(1024, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                         us         5.66
"""


@pytest.fixture()
def fake_results(tmp_path, monkeypatch):
    folder = tmp_path / "results" / "nvidia-h200"
    monkeypatch.setattr(nbs, "RECORDED_RESULTS_DIR", folder)
    return folder


def test_results_dir_is_the_recorded_folder(fake_results):
    with pytest.raises(FileNotFoundError, match="results/nvidia-h200 does not exist"):
        nbs.results_dir()
    fake_results.mkdir(parents=True)
    assert nbs.results_dir() == fake_results


def test_ncu_launches_reads_every_launch_and_its_metrics(fake_results):
    fake_results.mkdir(parents=True)
    (fake_results / "ncu_x.txt").write_text(NCU_REPORT)
    first, second = nbs.ncu_launches("ncu_x.txt")
    assert (first["kernel"], second["kernel"]) == ("kernel_a", "kernel_b")
    assert first["metrics"]["Duration"] == 11.46 and second["metrics"]["Duration"] == 5.66
    assert first["metrics"]["Executed Instructions"] == 62_986_892
    assert first["metrics"]["Issued Warp Per Scheduler"] == 0.31
    assert first["ran"] == "ran N3_H2304_B1_S256 version=None x1"
    excerpt = nbs.ncu_excerpt(first, ("Duration", "represents about"))
    assert "11.46" in excerpt and "47.5%" in excerpt and "5.66" not in excerpt


def test_kernel_source_quotes_a_definition_with_its_file():
    source = nbs.kernel_source("block_sum")
    assert source.startswith("// altup_cupy/") and "block_sum" in source and source.rstrip().endswith("}")
    assert nbs.file_header("block_sum").startswith("// altup_cupy/")
    with pytest.raises(KeyError, match="no_such_kernel"):
        nbs.kernel_source("no_such_kernel")


def test_kernel_sources_are_named_from_an_installed_package_too(monkeypatch):
    """Without a checkout (an installed package) a file is named from the folder the package lies in."""
    monkeypatch.setattr(nbs, "REPO_ROOT", None)
    assert nbs.kernel_source("block_sum").startswith("// altup_cupy/kernels/")
    assert nbs.file_header("block_sum").startswith("// altup_cupy/kernels/")


def test_cpu_mode_names_the_recorded_commit_and_the_checkout_commit(fake_results, monkeypatch, capsys):
    fake_results.mkdir(parents=True)
    (fake_results / "bench_collapse_benchmark.csv").write_text(
        "impl,gpu,git_sha,date\naltup_cupy,NVIDIA H200,0123abc,2026-12-02T13:39Z\n")
    monkeypatch.setattr(nbs, "REPO_ROOT", fake_results.parent.parent)
    monkeypatch.setenv("ALTUP_NOTEBOOK_MODE", "cpu")
    monkeypatch.setenv("ALTUP_GIT_SHA", "feedbee")
    assert nbs.checkout_commit() == "feedbee"
    assert nbs.mode() == "cpu"
    printed = capsys.readouterr().out
    assert printed.startswith("CPU mode (")
    assert "CSVs of altup_cupy at git 0123abc" in printed and "NVIDIA H200 (2026-12-02)" in printed
    assert "kernel sources from altup_cupy at git feedbee" in printed


@pytest.mark.parametrize("op", ["collapse", "predict_correct_backward"])
def test_version_table_lists_every_registered_version_and_the_default_order(op):
    import importlib

    registry = importlib.import_module(f"altup_cupy.ops.{op}_versions")
    table = nbs.version_table(op, [{"impl": "altup_cupy_v1"}, {"impl": "torch_eager"}])
    rows = [line for line in table.splitlines()[2:] if line.startswith("| v")]
    assert [row.split(" | ")[0] for row in rows] == [f"| v{n}" for n in sorted(registry.VERSIONS)]
    assert "`altup_cupy_v1`" in rows[0] and all(row.endswith("| no |") for row in rows[1:])
    assert f"runs v{registry.PREFERENCE[0]}" in table
    assert "no longer in the registry" not in table


def test_version_table_names_recorded_versions_the_registry_dropped():
    rows = [{"impl": "altup_cupy_v1"}, {"impl": "altup_cupy_v99"}, {"impl": "altup_cupy"}]
    table = nbs.version_table("predict_correct_backward", rows)
    assert "| v99 |" not in table
    assert table.endswith("no longer in the registry: `altup_cupy_v99` (measured before the version was dropped; "
                          "git history keeps its code).")
