"""Shared test machinery.

- `gpu` marker: a test (or module, via `pytestmark = pytest.mark.gpu`) that needs a CUDA GPU and
  CuPy. Without them every such test is SKIPPED with the reason "no usable CUDA GPU (...)", where
  the parentheses say what was found (altup_cupy._device.gpu_status: no driver, no device, a
  driver too old, CuPy missing, a CPU build of torch) -- never run, never counted as passed.
  Set ALTUP_REQUIRE_GPU=1 (e.g. for the H200 run whose log is committed) to turn a missing GPU
  into an error instead of skips.
- `seeds` fixture: fresh random seeds on every run, each one logged (printed in the test's
  captured output and attached to its report), so a failure can be replayed with
  ALTUP_TEST_SEED=<base seed> (the base seed is printed in the session header).
- `kernel_resources` fixture + terminal summary: tests/test_compile.py records what ptxas said
  of every kernel, and the table is printed at the end of the run, whatever -s/-q say.
"""

from __future__ import annotations

import os
import random
import secrets

import pytest

GPU_SKIP_PREFIX = "no usable CUDA GPU"


def _probe_gpu() -> tuple[bool, str]:
    """(available, reason): what the package's own check says (python -m altup_cupy gives the same)."""
    from altup_cupy._device import gpu_status

    usable, why = gpu_status()
    if not usable:
        return False, f"{GPU_SKIP_PREFIX} ({why})"
    import torch

    return True, f"GPU: {torch.cuda.get_device_name(0)}"


GPU_AVAILABLE, GPU_REASON = _probe_gpu()


def _base_seed() -> int:
    fixed = os.environ.get("ALTUP_TEST_SEED")
    return int(fixed) if fixed else secrets.randbits(31)


BASE_SEED = _base_seed()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU and CuPy; skipped with a reason when there is none"
    )
    config.stash[_RESOURCES_KEY] = []


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [
        f"altup_cupy: {GPU_REASON if GPU_AVAILABLE else GPU_REASON + ' -> gpu tests SKIPPED'}",
        f"altup_cupy: base seed {BASE_SEED} (replay with ALTUP_TEST_SEED={BASE_SEED})",
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if GPU_AVAILABLE or not gpu_items:
        return
    if os.environ.get("ALTUP_REQUIRE_GPU") == "1":
        raise pytest.UsageError(f"ALTUP_REQUIRE_GPU=1 but {GPU_REASON}")
    skip = pytest.mark.skip(reason=GPU_REASON)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def seeds(request: pytest.FixtureRequest):
    """`seeds()` returns a fresh seed on each call; all are derived from the run's base seed and
    the test's id, printed, and attached to the test report as the `seeds` user property."""
    rng = random.Random(f"{BASE_SEED}:{request.node.nodeid}")
    drawn: list[int] = []

    def draw() -> int:
        seed = rng.getrandbits(31)
        drawn.append(seed)
        print(f"[seed] {request.node.nodeid}: {seed} (base {BASE_SEED})")
        return seed

    yield draw
    request.node.user_properties.append(("seeds", tuple(drawn)))


# ---- register table of tests/test_compile.py --------------------------------------------------

_RESOURCES_KEY = pytest.StashKey[list]()


@pytest.fixture
def kernel_resources(request: pytest.FixtureRequest) -> list:
    """A list that the compile tests append (arch, filename, kernel name, KernelResources) records to."""
    return request.config.stash[_RESOURCES_KEY]


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    rows = config.stash.get(_RESOURCES_KEY, [])
    if not rows:
        return
    tr = terminalreporter
    tr.section("kernel resources (NVRTC, ptxas -v)")
    header = ("arch", "source", "kernel", "regs", "stack B", "spill st B", "spill ld B")
    table = [header] + [
        (arch, src, name, str(k.registers), str(k.stack_frame_bytes), str(k.spill_store_bytes),
         str(k.spill_load_bytes))
        for arch, src, name, k in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, r in enumerate(table):
        tr.write_line("  ".join(c.ljust(w) if j < 3 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            tr.write_line("  ".join("-" * w for w in widths))
