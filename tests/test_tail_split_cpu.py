"""The tail split's host side without a GPU: epochs taken per launch, the GEMM+RS knob, the arguments when off."""

from __future__ import annotations

import pytest

from fluxinductor.kernels import tail_split


def _scratch_at(epoch: int) -> tail_split.Scratch:
    scratch = object.__new__(tail_split.Scratch)  # no device buffers: only the epoch arithmetic is under test
    scratch.epoch = epoch
    return scratch


def test_epochs_are_consecutive_and_new():
    scratch = _scratch_at(0)
    assert scratch.take_epochs(1) == 1
    assert scratch.take_epochs(2) == 2  # 2 and 3
    assert scratch.take_epochs(4) == 4  # 4..7
    assert scratch.epoch == 7


def test_epochs_wrap_without_zero_and_without_splitting_a_range():
    """Flags start at 0, so 0 is never an epoch; a range that would run through 0 starts again at 1 (the kernel adds
    the launch index to the first epoch as a uint32)."""
    scratch = _scratch_at(0xFFFFFFFE)
    assert scratch.take_epochs(1) == 0xFFFFFFFF
    assert scratch.take_epochs(1) == 1
    scratch = _scratch_at(0xFFFFFFFD)
    assert scratch.take_epochs(4) == 1  # 0xFFFFFFFE..1 would cross 0
    assert scratch.epoch == 4
    scratch = _scratch_at(0xFFFFFFFF)
    assert scratch.take_epochs(2) == 1


def test_off_below_two_parts():
    assert tail_split.kernel_args(None, None, 0, 1) == tail_split.OFF
    assert tail_split.OFF[3] == 1


def test_gemm_rs_knob(monkeypatch):
    from fluxinductor.kernels import gemm_rs

    monkeypatch.delenv("FLUXINDUCTOR_GEMM_RS_TAIL_SPLIT", raising=False)
    assert gemm_rs.tail_split_parts() == 1  # off until measured on two GPUs
    monkeypatch.setenv("FLUXINDUCTOR_GEMM_RS_TAIL_SPLIT", "4")
    assert gemm_rs.tail_split_parts() == 4
    monkeypatch.setenv("FLUXINDUCTOR_GEMM_RS_TAIL_SPLIT", "0")
    with pytest.raises(ValueError, match="at least 1"):
        gemm_rs.tail_split_parts()
