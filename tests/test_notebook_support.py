"""notebook_support: where the recorded results are found, how a recorded Nsight Compute report is
read, and how kernel sources are quoted. No GPU needed."""

from __future__ import annotations

import pytest

from altup_cupy import notebook_support as nbs

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
