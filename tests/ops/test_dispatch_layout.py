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
