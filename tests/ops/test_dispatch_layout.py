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
