"""What `_cublas.Gemm` takes from cuBLASLt's heuristic, on the CPU: the library is replaced by one
that offers a fixed list of algorithms, each with its own workspace size and configuration."""

from __future__ import annotations

import ctypes

import pytest
import torch

from altup_cupy import _cublas

OFFERED = 3  # algorithms the stand-in heuristic offers for any shape


class FakeCublasLt:
    """cuBLASLt's entry points that a Gemm calls: descriptors are dummies; the heuristic offers
    OFFERED algorithms, algorithm i has workspace 1000 * (i + 1) bytes, waves i + 0.5, and every
    configuration attribute a reads back as 10 * i + a (the algorithm's first data word is i)."""

    def __init__(self):
        self.requested = []

    @staticmethod
    def _ok(*args):
        return 0

    cublasLtMatmulDescCreate = cublasLtMatmulDescSetAttribute = _ok
    cublasLtMatrixLayoutCreate = cublasLtMatrixLayoutSetAttribute = _ok
    cublasLtMatmulPreferenceCreate = cublasLtMatmulPreferenceSetAttribute = _ok
    cublasLtMatmulPreferenceDestroy = cublasLtMatmul = _ok

    def cublasLtMatmulAlgoGetHeuristic(self, handle, desc, a, b, c, d, preference, count, results, found):
        self.requested.append(count)
        offered = min(count, OFFERED)
        for i in range(offered):
            results[i].algo.data[0] = i
            results[i].workspaceSize = 1000 * (i + 1)
            results[i].wavesCount = i + 0.5
        found._obj.value = offered
        return 0

    @staticmethod
    def cublasLtMatmulAlgoConfigGetAttribute(algo, attribute, value, size, written):
        index = algo._obj.data[0]
        value._obj.value = 10 * index + attribute
        written._obj.value = size
        return 0


@pytest.fixture
def fake_cublas(monkeypatch):
    lt = FakeCublasLt()
    monkeypatch.setattr(_cublas, "_library", lambda: lt)
    monkeypatch.setattr(_cublas, "_handle", lambda device: ctypes.c_void_p(1))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return lt


SHAPE = dict(rows=256, cols=2048, inner=2048, batch=3)


def test_the_heuristics_first_choice_by_default(fake_cublas):
    gemm = _cublas.Gemm(**SHAPE)
    assert fake_cublas.requested == [1]
    assert gemm.workspace_bytes == 1000 and gemm.waves == 0.5
    assert gemm.config["algo_id"] == 0 and gemm.config["split_k"] == 2


@pytest.mark.parametrize("candidate", range(OFFERED))
def test_a_candidate_takes_that_algorithm_and_its_workspace(fake_cublas, candidate):
    gemm = _cublas.Gemm(**SHAPE, candidate=candidate)
    assert fake_cublas.requested == [candidate + 1]
    assert gemm.workspace_bytes == 1000 * (candidate + 1) and gemm.waves == candidate + 0.5
    assert gemm.config == {name: 10 * candidate + attribute
                           for name, (attribute, _) in _cublas.ALGO_CONFIG.items()}
    # The launch's arguments carry this algorithm and its workspace size.
    assert gemm._algo.data[0] == candidate and gemm._args[-2].value == 1000 * (candidate + 1)


def test_a_candidate_the_heuristic_does_not_offer_raises(fake_cublas):
    with pytest.raises(IndexError, match=f"offers {OFFERED} algorithms for this shape; there is no candidate {OFFERED}"):
        _cublas.Gemm(**SHAPE, candidate=OFFERED)
