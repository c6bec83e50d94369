"""How the collapse's cuBLAS versions split the rows into GEMM + epilogue rounds, without a GPU.

v5 exists to keep one round's fp32 projections in L2 from its GEMMs to its epilogue: every round
of the benchmark's, Gemma 3n's and larger shapes must hold at most L2_BLOCK_BYTES of them, with as
few rounds as that allows, and the rounds must cover the rows once, in order.
"""

from __future__ import annotations

import math

import pytest

from altup_cupy._sources import L2_LINE_BYTES
from altup_cupy.lab.workloads import benchmark_workloads, gemma3n_workloads
from altup_cupy.ops.collapse_versions import L2_BLOCK_BYTES, WORKSPACE_BYTES, row_blocks, rows_per_block

WORKLOADS = benchmark_workloads("collapse") + gemma3n_workloads("collapse")
SHAPES = sorted({(w.streams, w.hidden, w.tokens) for w in WORKLOADS}
                | {(n, h, m) for n in (3, 4) for h in (2048, 2560, 3072) for m in (1, 1023, 1024, 1025, 40_000)})


@pytest.mark.parametrize("block_bytes", [L2_BLOCK_BYTES, WORKSPACE_BYTES], ids=["L2_BLOCK_BYTES", "WORKSPACE_BYTES"])
@pytest.mark.parametrize("streams,hidden,rows", SHAPES, ids=[f"N{n}_H{h}_M{m}" for n, h, m in SHAPES])
def test_row_blocks_stay_within_their_bound(streams, hidden, rows, block_bytes):
    projection_row_bytes = (streams - 1) * hidden * 4
    block_rows = rows_per_block(rows, streams, hidden, block_bytes)
    blocks = row_blocks(rows, block_rows)
    assert [first for first, _ in blocks] == list(range(0, rows, block_rows))
    assert sum(count for _, count in blocks) == rows
    assert all(0 < count <= block_rows for _, count in blocks)
    assert block_rows * projection_row_bytes <= block_bytes
    # The fewest rounds: one row more per block would pass the bound (or there is one block).
    assert block_rows == rows or (block_rows + 1) * projection_row_bytes > block_bytes
    assert len(blocks) == math.ceil(rows / block_rows)


def test_one_row_wider_than_the_bound_is_a_block_of_its_own():
    assert rows_per_block(5, 4, 8192, block_bytes=1024) == 1
    assert row_blocks(5, 1) == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]


def test_the_measured_shapes_have_whole_l2_lines_per_projection_row():
    """v5 drops only lines wholly inside one row: at every benchmark and Gemma 3n shape that is
    every line of the projections."""
    assert all(w.hidden * 4 % L2_LINE_BYTES == 0 for w in WORKLOADS)
