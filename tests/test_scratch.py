"""The per-stream scratch buffers (`_scratch.StreamScratch`): a buffer is lent to one call at a
time, kept only where the call may reuse it. On CPU tensors (the lending needs no GPU)."""

from __future__ import annotations

import pytest
import torch

from altup_cupy import _scratch

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def not_capturing(monkeypatch):
    """A CPU build of torch cannot ask whether a CUDA stream is capturing; nothing is."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def test_a_buffer_handed_back_serves_the_next_call_on_its_stream():
    scratch = _scratch.StreamScratch()
    first, key = scratch.take(64, CPU, stream=7)
    assert first.numel() >= 64 and key is not None
    scratch.give_back(first, key)
    again, _ = scratch.take(32, CPU, stream=7)
    assert again.data_ptr() == first.data_ptr()
    other, _ = scratch.take(32, CPU, stream=8)  # another stream: its own buffer
    assert other.data_ptr() != first.data_ptr()


def test_a_buffer_in_use_is_never_lent_twice():
    """Two calls on one stream at once (two threads): the second gets a fresh buffer, so neither
    call's launches can land on the other's memory."""
    scratch = _scratch.StreamScratch()
    first, first_key = scratch.take(64, CPU, stream=7)
    second, second_key = scratch.take(64, CPU, stream=7)
    assert second.data_ptr() != first.data_ptr()
    scratch.give_back(first, first_key)
    scratch.give_back(second, second_key)
    third, _ = scratch.take(64, CPU, stream=7)
    assert third.data_ptr() in (first.data_ptr(), second.data_ptr())


def test_a_larger_request_gets_a_larger_buffer():
    scratch = _scratch.StreamScratch()
    small, key = scratch.take(16, CPU, stream=1)
    scratch.give_back(small, key)
    large, _ = scratch.take(4096, CPU, stream=1)
    assert large.numel() >= 4096


@pytest.mark.parametrize("case", ["no reuse", "too large", "capturing"])
def test_buffers_that_must_not_outlive_the_call_are_not_kept(case, monkeypatch):
    scratch = _scratch.StreamScratch()
    nbytes, reuse = 64, True
    if case == "no reuse":
        reuse = False
    elif case == "too large":
        nbytes = _scratch.MAX_CACHED_BYTES + 1
    else:
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    buffer, key = scratch.take(nbytes, CPU, stream=3, reuse=reuse)
    assert key is None and buffer.numel() >= nbytes
    scratch.give_back(buffer, key)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    later, _ = scratch.take(64, CPU, stream=3)
    assert later.data_ptr() != buffer.data_ptr()


def test_zeroed_buffers_start_as_zeros():
    buffer, _ = _scratch.StreamScratch(zeroed=True).take(128, CPU, stream=0)
    assert not buffer.any()
