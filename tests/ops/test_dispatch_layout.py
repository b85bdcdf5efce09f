"""The fused paths' results have the strides the ops' fake implementations promise (contiguous), also in size-1 dims:
dynamo's guards compare every stride, so a block output laid out [1, S, H] as (H, H, 1) instead of (S*H, H, 1) made
the next compiled block recompile with dynamic strides (torchtitan's per-block compile at batch 1)."""

from __future__ import annotations

import pytest
import torch

from fluxinductor import dispatch


@pytest.mark.parametrize("shape, dim", [((1, 6, 4), 1), ((2, 6, 4), 1), ((1, 1, 6, 4), 2), ((3, 6, 4), 0),
                                        ((2, 1, 6, 4), 2)])
def test_restore_gives_contiguous_strides(shape, dim):
    x = torch.randn(shape)
    rows = dispatch._rows_first(x, dim)  # [shape[dim] * rest, last]
    lead = shape[dim]
    rest = tuple(s for d, s in enumerate(shape[:-1]) if d != dim)
    out = dispatch._restore(rows.clone(), lead, rest, dim)
    assert out.shape == x.shape
    assert out.stride() == x.contiguous().stride()  # every dim, size-1 ones included
    torch.testing.assert_close(out, x)


@pytest.mark.parametrize("shape, dim", [((1, 6, 4), 1), ((1, 1, 6, 4), 2), ((6, 4), 0), ((1, 6, 5, 4), 1)])
def test_rows_first_of_leading_size_one_dims_matches_the_moved_layout(shape, dim):
    """Where every dim before ``dim`` has size 1 the move is skipped (a reshape only, less host time per call): the
    rows and the restored result are the ones the move gives, also from a non-contiguous input."""
    x = torch.randn(shape)
    for t in (x, x.transpose(-1, -2).contiguous().transpose(-1, -2)):
        rows = dispatch._rows_first(t, dim)
        moved = t.movedim(dim, 0).contiguous().reshape(-1, t.shape[-1])
        assert rows.is_contiguous() and torch.equal(rows, moved)
    rest = tuple(s for d, s in enumerate(shape[:-1]) if d != dim)
    out = dispatch._restore(moved.clone(), shape[dim], rest, dim)
    assert out.shape == x.shape and out.stride() == x.contiguous().stride() and torch.equal(out, x)


class _BatchMajorKernels:
    """A kernel module standing in for the AG+GEMM on CPU: it gathers two ranks' shards (this one's, twice) into the
    layout it is asked for, batch-major (``batch_rows`` > 0: blocks of ``batch_rows`` rows) or rank-major, and records
    each call's operand and ``batch_rows``."""

    def __init__(self, reason=None):
        self.reason, self.calls = reason, []

    def unsupported_reason(self, *args):
        return None

    def batch_major_reason(self, shard2d, weights, batch_rows):
        return self.reason

    def prepare_all_gather_matmul(self, *args):
        return None

    def all_gather_matmul(self, shard2d, weights, biases, group_name, return_gathered, *, checked=False,
                          batch_rows=0):
        self.calls.append((shard2d, batch_rows))
        if batch_rows:
            blocks = shard2d.view(-1, batch_rows, shard2d.shape[1])
            full = torch.cat([blocks, blocks], 1).reshape(-1, shard2d.shape[1])
        else:
            full = torch.cat([shard2d, shard2d])
        return [full @ w for w in weights], full if return_gathered else shard2d.new_empty(0)


@pytest.fixture
def batch_major(flux_settings, monkeypatch):
    def install(kernels):
        monkeypatch.setattr(dispatch, "_kernels_for", lambda op, operand: kernels)
        monkeypatch.setattr(dispatch, "_world_size", lambda group_name: 2)
        monkeypatch.setattr(dispatch, "_peers_reason", lambda group_name, device: None)
        monkeypatch.setattr(dispatch, "_internode_plan", lambda *args: None)
        monkeypatch.setattr(dispatch, "_device_name", lambda index: "a device with no tuning table")
        flux_settings(dispatch="fused")
        return kernels

    return install


@pytest.mark.parametrize("reason", [None, "a one-wave problem"])
def test_batch_major_or_rows_first_by_the_kernel_s_answer(batch_major, reason):
    """A [B, S/w, H] shard with B > 1, gathered on S: where the kernel keeps the batch-major layout the call hands it
    the shard itself, flattened (no copy), with its blocks' rows, and the results are views of the gathered shape; where
    it cannot, the call runs rank-major on a rows-first copy and restores the results.  Both give all_gather's
    results."""
    kernels = batch_major(_BatchMajorKernels(reason))
    shard, weights = torch.randn(3, 4, 8), [torch.randn(5, 8).t(), torch.randn(2, 8).t()]
    outs, gathered = dispatch.all_gather_matmul(shard, weights, [None, None], 1, "g", True)
    full = torch.cat([shard, shard], 1)
    torch.testing.assert_close(gathered, full)
    for out, w in zip(outs, weights):
        torch.testing.assert_close(out, full @ w)
        assert out.is_contiguous() and out.shape == (3, 8, w.shape[1])
    ((operand, batch_rows),) = kernels.calls
    if reason is None:
        assert batch_rows == 4 and operand.data_ptr() == shard.data_ptr()
    else:
        assert batch_rows == 0 and torch.equal(operand, shard.transpose(0, 1).reshape(-1, 8))


def test_a_non_contiguous_shard_runs_rows_first(batch_major):
    kernels = batch_major(_BatchMajorKernels())
    shard = torch.randn(4, 3, 8).transpose(0, 1)  # [3, 4, 8] laid out rows-first
    w = torch.randn(5, 8).t()
    outs, _ = dispatch.all_gather_matmul(shard, [w], [None], 1, "g", False)
    torch.testing.assert_close(outs[0], torch.cat([shard, shard], 1) @ w)
    assert kernels.calls[0][1] == 0


def test_batch_rows_count_the_dims_between_the_gathered_one_and_the_last():
    assert dispatch._batch_rows(torch.empty(2, 3, 5, 8), 1) == 15
    assert dispatch._batch_rows(torch.empty(1, 3, 8), 1) == 0  # batch 1: rank-major already
    assert dispatch._batch_rows(torch.empty(6, 8), 0) == 0


def test_gemm_rs_batch_major_refusals():
    """When the GEMM+RS cannot read an operand batch-major: blocks that do not divide each owner's rows, blocks of
    partial tiles, one rank."""
    from fluxinductor.kernels import gemm_rs

    a = torch.randn(2 * 768, 64, dtype=torch.bfloat16)  # two owners' 768 rows each
    assert gemm_rs.batch_major_reason(a, 384, 2) is None
    assert "whole blocks" in gemm_rs.batch_major_reason(a, 512, 2)
    assert "128-row" in gemm_rs.batch_major_reason(a, 192, 2)
    assert "one rank" in gemm_rs.batch_major_reason(a, 384, 1)


class _BatchMajorReduceScatter:
    """The GEMM+RS on CPU for two ranks holding the same operand: rank 0's result, read batch-major (``batch_rows`` >
    0: its block of every batch) or rank-major (its first half of the rows); records each call."""

    def __init__(self, reason=None):
        self.reason, self.calls = reason, []

    def unsupported_reason(self, *args):
        return None

    def batch_major_reason(self, a2d, batch_rows, world):
        return self.reason

    def prepare_matmul_reduce_scatter(self, *args, **kwargs):
        return None

    def matmul_reduce_scatter(self, a2d, weight, bias, reduce_op, group_name, *, checked=False, transport="store",
                              split_config_choice=None, batch_rows=0, **kwargs):
        self.calls.append((a2d, batch_rows))
        total = 2 * (a2d @ weight)
        if batch_rows:
            return total.view(-1, 2, batch_rows, total.shape[1])[:, 0].reshape(-1, total.shape[1])
        return total[: a2d.shape[0] // 2]


@pytest.mark.parametrize("reason", [None, "blocks of partial tiles"])
def test_gemm_rs_batch_major_or_rows_first(batch_major, reason):
    """A [B, S, K] operand scattered on S with B > 1: where the kernel reads it batch-major the call hands it over in
    place with each owner's blocks' rows and returns a view; else a rows-first copy, the result restored.  Both are
    rank 0's [B, S/2, N] of the sum."""
    kernels = batch_major(_BatchMajorReduceScatter(reason))
    a, w = torch.randn(3, 8, 6), torch.randn(5, 6).t()
    out = dispatch.matmul_reduce_scatter(a, w, None, "sum", 1, "g")
    torch.testing.assert_close(out, (2 * (a @ w))[:, :4])
    assert out.shape == (3, 4, 5) and out.is_contiguous()
    ((operand, batch_rows),) = kernels.calls
    if reason is None:
        assert batch_rows == 4 and operand.data_ptr() == a.data_ptr()
    else:
        assert batch_rows == 0 and torch.equal(operand, a.transpose(0, 1).reshape(-1, 6))
