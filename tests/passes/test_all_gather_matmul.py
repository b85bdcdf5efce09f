"""The all_gather -> matmul rewrite (passes/all_gather_matmul.py) on traced post-grad graph forms.

Each test asserts the match count (``rewrite_stats`` and fused nodes in the graph), which ops are present before
and absent after, ``meta['val']`` of the new nodes, and the skip reasons (graph builders: tests/_pass_graphs.py).
"""

from __future__ import annotations

import operator

import pytest
import torch

from fluxinductor.passes.all_gather_matmul import WEIGHT_GRADIENT_SKIP
from _pass_graphs import (
    AG_MM,
    MM_RS,
    WORLD,
    WORLD1_GROUP,
    all_gather,
    assert_all_vals,
    aten,
    back_through_views,
    c10d,
    count,
    fused,
    group,
    nodes,
    numeric_case,
    qkv,
    rows_first_source,
    run_passes,
    skipped,
    sp_linear_backward,
    sp_mlp_forward,
    trace,
)


def test_all_gather_dim0_mm():
    """dist.all_gather_into_tensor / funcol gather_dim 0 on 2-D rows, then mm (the c10d-traced form)."""

    def fn(x, w):
        return aten.mm.default(all_gather(x, 0, WORLD, group()), w)

    gm = trace(fn, torch.randn(4, 16), torch.randn(16, 32))
    assert count(gm, c10d.all_gather_into_tensor.default) == 1
    run_passes(gm)
    assert fused("all_gather_matmul") == 1
    assert count(gm, AG_MM) == 1
    assert count(gm, c10d.all_gather_into_tensor.default) == 0
    assert count(gm, c10d.wait_tensor.default) == 0
    assert count(gm, aten.mm.default) == 0
    (node,) = nodes(gm, AG_MM)
    shard, weights, biases, gather_dim, group_name, return_gathered = node.args
    assert (gather_dim, group_name, return_gathered, biases) == (0, group(), False, [None])
    outs, gathered = node.meta["val"]
    assert tuple(outs[0].shape) == (8, 32) and gathered.numel() == 0
    assert_all_vals(gm)


@pytest.mark.parametrize("batch", [2, 1], ids=["B2_split_cat", "B1_view_form"])
def test_all_gather_sequence_dim1_forward(batch):
    """DTensor SP MLP forward, [B, S/w, H] gathered on S: split/cat form (B > 1) and funcol's view form
    (B = 1).  The flattened gathered input is saved for backward, so the op returns it."""
    fn = sp_mlp_forward(WORLD, group(), 1)
    args = (torch.randn(batch, 4, 16), torch.randn(32, 16), torch.randn(32), torch.randn(16, 32), torch.randn(16))
    gm = trace(fn, *args)
    assert count(gm, aten.cat.default) == (2 if batch > 1 else 1)
    run_passes(gm)
    assert fused("all_gather_matmul") == 1 and fused("matmul_reduce_scatter") == 1
    assert count(gm, c10d.all_gather_into_tensor.default) == 0
    assert count(gm, c10d.reduce_scatter_tensor.default) == 0
    assert count(gm, aten.addmm.default) == 0
    assert count(gm, aten.split.Tensor) == 0 and count(gm, aten.cat.default) == 0
    (node,) = nodes(gm, AG_MM)
    outs, gathered = node.meta["val"]
    gather_dim, return_gathered = node.args[3], node.args[5]
    # The view form reads the same memory as a dim-0 gather, and is passed as one; with B > 1 the op gets the
    # shard rows-first ([S/w * B, H]) and gathers on dim 0.
    assert gather_dim == 0
    assert return_gathered is True
    if batch > 1:
        assert rows_first_source(node.args[0], [1, 0, 2], 16).op == "placeholder"
        assert tuple(gathered.shape) == (8 * batch, 16) and tuple(outs[0].shape) == (8 * batch, 32)
    else:
        assert node.args[0].op == "placeholder"
        assert tuple(gathered.shape) == (2, 4, 16) and tuple(outs[0].shape) == (2, 4, 32)
    # The gathered output feeds the saved [B*S, H] view (an output of the graph).
    readers = [u for u in node.users if u.args[1] == 1]
    assert len(readers) == 1
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    saved = out_node.args[0][1]
    assert tuple(saved.meta["val"].shape) == (batch * 8, 16)
    (rs,) = nodes(gm, MM_RS)
    if batch > 1:
        # Rows-first: the op scatters [S * B, H] on dim 0; the graph reads [B, S/w, H] through permute + clone.
        assert tuple(rs.meta["val"].shape) == (4 * batch, 16) and rs.args[3:] == ("sum", 0, group())
        (view,) = rs.users
        (permute,) = view.users
        (clone,) = permute.users
        assert clone.target == aten.clone.default and tuple(clone.meta["val"].shape) == (batch, 4, 16)
        assert clone.meta["val"].is_contiguous()
    else:
        assert tuple(rs.meta["val"].shape) == (batch, 4, 16) and rs.args[3:] == ("sum", 1, group())
    assert_all_vals(gm)


def test_all_gather_sequence_dim1_batch_major():
    """[B, S/w, H] with B > 1 and S/w whole 128-row tiles: the op gets the shard as it is, gathered on dim 1 (its
    kernel places each shard batch-major in the gathered tensor), with no permute around it; its results are the
    graph's [B, S, N] and gathered [B, S, H].  So does the reduce-scatter after it: its operand as it is, [B, S, F],
    scattered on dim 1, its result the graph's [B, S/w, H]."""
    fn = sp_mlp_forward(WORLD, group(), 1)
    args = (torch.randn(2, 128, 16), torch.randn(32, 16), torch.randn(32), torch.randn(16, 32), torch.randn(16))
    gm = trace(fn, *args)
    run_passes(gm)
    assert fused("all_gather_matmul") == 1 and fused("matmul_reduce_scatter") == 1
    (node,) = nodes(gm, AG_MM)
    shard = node.args[0]
    assert shard.op == "placeholder" and node.args[3] == 1 and node.args[5] is True
    assert not [u for u in shard.users if u is not node]  # nothing permutes or copies the shard
    outs, gathered = node.meta["val"]
    assert tuple(gathered.shape) == (2, 256, 16) and tuple(outs[0].shape) == (2, 256, 32)
    (rs,) = nodes(gm, MM_RS)
    assert rs.args[4] == 1 and tuple(rs.meta["val"].shape) == (2, 128, 16)
    assert tuple(rs.args[0].meta["val"].shape) == (2, 256, 32)
    assert count(gm, aten.permute.default) == 2  # the weights' transposes only
    assert_all_vals(gm)


def test_batch_major_shard_is_made_contiguous():
    """A batch-major shard whose producer's layout is not contiguous (a norm of the rows-first reduce-scatter's result
    keeps its input's order): the op reads it through a contiguous clone, which inductor folds into the producer."""
    forward = sp_mlp_forward(WORLD, group(), 1)

    def fn(x_rows_first, w_up, b_up, w_down, b_down):
        return forward(aten.permute.default(x_rows_first, [1, 0, 2]), w_up, b_up, w_down, b_down)

    args = (torch.randn(128, 2, 16), torch.randn(32, 16), torch.randn(32), torch.randn(16, 32), torch.randn(16))
    gm = trace(fn, *args)
    run_passes(gm)
    (node,) = nodes(gm, AG_MM)
    clone = node.args[0]
    assert clone.target == aten.clone.default and clone.kwargs["memory_format"] == torch.contiguous_format
    assert clone.args[0].target == aten.permute.default and node.args[3] == 1
    assert clone.meta["val"].is_contiguous()
    assert_all_vals(gm)


def test_all_gather_sequence_dim0_3d():
    """SequenceParallel(sequence_dim=0): [S/w, B, H] gathered on dim 0, then reshape -> addmm."""
    fn = sp_mlp_forward(WORLD, group(), 0)
    gm = trace(fn, torch.randn(4, 3, 16), torch.randn(32, 16), torch.randn(32), torch.randn(16, 32), torch.randn(16))
    run_passes(gm)
    assert fused("all_gather_matmul") == 1 and fused("matmul_reduce_scatter") == 1
    (node,) = nodes(gm, AG_MM)
    assert node.args[3] == 0
    assert tuple(node.meta["val"][0][0].shape) == (8, 3, 32)
    (rs,) = nodes(gm, MM_RS)
    assert rs.args[4] == 0 and tuple(rs.meta["val"].shape) == (4, 3, 16)
    assert count(gm, c10d.all_gather_into_tensor.default) == 0
    assert count(gm, c10d.reduce_scatter_tensor.default) == 0


@pytest.mark.parametrize("gather_dim", [0, 1])
def test_all_gather_qkv_one_op(gather_dim):
    """One all_gather read by Q, K and V linears becomes ONE op with three weights and biases."""
    fn = qkv(WORLD, group(), gather_dim)
    w = [torch.randn(16, 16) if i % 2 == 0 else torch.randn(16) for i in range(6)]
    gm = trace(fn, torch.randn(2, 4, 16), *w)
    assert count(gm, aten.addmm.default) == 3
    run_passes(gm)
    assert fused("all_gather_matmul") == 1
    assert count(gm, AG_MM) == 1 and count(gm, aten.addmm.default) == 0
    (node,) = nodes(gm, AG_MM)
    assert len(node.args[1]) == 3 and all(b is not None for b in node.args[2])
    assert node.args[5] is False  # nothing else reads the gathered tensor
    assert [tuple(o.shape) for o in node.meta["val"][0]] == [(4, 4, 16) if gather_dim == 0 else (16, 16)] * 3
    assert node.args[3] == 0
    assert_all_vals(gm)


def test_all_gather_backward_weight_grad_skipped():
    """Backward: gathered gradient -> input-grad mm is fused; the weight-grad mm(g2.t(), x) is skipped
    with its reason and keeps reading the op's gathered output."""
    fn = sp_linear_backward(WORLD, group(), 1)
    gm = trace(fn, torch.randn(2, 4, 16), torch.randn(16, 32), torch.randn(16, 24))
    assert count(gm, aten.mm.default) == 2
    run_passes(gm)
    assert fused("all_gather_matmul") == 1
    assert skipped("all_gather_matmul") == {WEIGHT_GRADIENT_SKIP: 1}
    assert count(gm, aten.mm.default) == 1  # the weight-gradient mm is left
    (node,) = nodes(gm, AG_MM)
    assert node.args[5] is True
    (grad_w,) = nodes(gm, aten.mm.default)
    src = back_through_views(grad_w.args[0])  # permute(view(clone(permute(reshape(getitem(op, 1))))))
    assert src.target is operator.getitem and src.args == (node, 1)
    assert count(gm, c10d.all_gather_into_tensor.default) == 0


def test_all_gather_gathered_second_operand_skipped():
    def fn(x, a):
        return aten.mm.default(a, all_gather(x, 0, WORLD, group()))

    gm = trace(fn, torch.randn(4, 16), torch.randn(5, 8))
    run_passes(gm)
    assert fused("all_gather_matmul") == 0
    reasons = skipped("all_gather_matmul")
    assert reasons.get("gathered tensor is the second matmul operand") == 1
    assert reasons.get("no matmul reads the gathered tensor") == 1
    assert count(gm, c10d.all_gather_into_tensor.default) == 1 and count(gm, AG_MM) == 0


def test_all_gather_integer_dtype_skipped():
    def fn(x, w):
        return aten.mm.default(all_gather(x, 0, WORLD, group()), w)

    gm = trace(fn, torch.randint(0, 5, (4, 16)), torch.randint(0, 5, (16, 8)))
    run_passes(gm)
    assert fused("all_gather_matmul") == 0
    assert skipped("all_gather_matmul") == {"non-floating dtype": 1}
    assert count(gm, c10d.all_gather_into_tensor.default) == 1 and count(gm, aten.mm.default) == 1


def test_all_gather_contraction_dim_gather_skipped():
    """all_gather on the last dim (K) of a 2-D shard: the op does not take it."""

    def fn(x, w):
        return aten.mm.default(all_gather(x, 1, WORLD, group()), w)

    gm = trace(fn, torch.randn(4, 8), torch.randn(16, 8))
    run_passes(gm)
    assert fused("all_gather_matmul") == 0
    assert skipped("all_gather_matmul") == {"gather_dim is the contraction dim": 1}


def test_all_gather_weight_after_gather_is_hoisted():
    """The weight is computed after the first reader of the gathered tensor: it moves up with the op."""

    def fn(x, w, z):
        gathered = all_gather(x, 0, WORLD, group())
        early = aten.sum.default(gathered)
        weight = aten.mul.Tensor(w, aten.sum.default(z))
        return aten.mm.default(gathered, weight), early

    gm = trace(fn, torch.randn(4, 16), torch.randn(16, 8), torch.randn(3))
    run_passes(gm)
    assert fused("all_gather_matmul") == 1
    (node,) = nodes(gm, AG_MM)
    assert node.args[5] is True  # the sum still reads the gathered tensor


def test_chunks_out_of_rank_order_skipped():
    def fn(x, w):
        ag = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(x, WORLD, group()))
        parts = aten.split.Tensor(ag, 2)
        gathered = aten.cat.default([parts[1], parts[0]], 1)
        return aten.mm.default(aten.reshape.default(gathered, [-1, 16]), w)

    gm = trace(fn, torch.randn(2, 4, 16), torch.randn(16, 8))
    run_passes(gm)
    assert fused("all_gather_matmul") == 0
    assert skipped("all_gather_matmul") == {"all_gather chunks not in rank order": 1}


def test_all_gather_weight_reading_gathered_skipped():
    """A weight computed from the gathered tensor itself (through a non-view reader) cannot be fused."""

    def fn(x, w):
        gathered = all_gather(x, 0, WORLD, group())
        weight = aten.mul.Tensor(w, aten.sum.default(gathered))
        return aten.mm.default(gathered, weight)

    gm = trace(fn, torch.randn(4, 16), torch.randn(16, 8))
    run_passes(gm)
    assert fused("all_gather_matmul") == 0
    reasons = skipped("all_gather_matmul")
    assert reasons.get("weight depends on the gathered tensor") == 1
    assert count(gm, c10d.all_gather_into_tensor.default) == 1


def test_mutation_before_matmul_skipped():
    """An in-place op after the gathered tensor's first reader but before the matmul: the span the
    rewrite moves reads across holds a mutation, so it is left alone (conservatively)."""

    def fn(x, w, z):
        gathered = all_gather(x, 0, WORLD, group())
        total = aten.sum.default(gathered)
        z.mul_(2)
        return aten.mm.default(gathered, w), total

    gm = trace(fn, torch.randn(4, 16), torch.randn(16, 8), torch.randn(3))
    run_passes(gm)
    assert fused("all_gather_matmul") == 0
    assert skipped("all_gather_matmul") == {"possible mutation between the all_gather and its matmuls": 1}


def test_all_gather_unfused_bias_gpu_form():
    """On GPUs inductor unfuses addmm whose users are pointwise into ``add(bias, mm)`` before the custom
    pass runs: the mm is fused, the bias add stays and reads the op's output."""

    def fn(x, w, b):
        gathered = all_gather(x, 1, WORLD, group())
        y = aten.add.Tensor(b, aten.mm.default(aten.reshape.default(gathered, [-1, 16]), aten.permute.default(w, [1, 0])))
        return aten.relu.default(aten.reshape.default(y, [2, 8, 24]))

    gm = trace(fn, torch.randn(2, 4, 16), torch.randn(24, 16), torch.randn(24))
    run_passes(gm)
    assert fused("all_gather_matmul") == 1 and count(gm, aten.mm.default) == 0
    (add,) = nodes(gm, aten.add.Tensor)
    assert add.args[1].target == aten.reshape.default and tuple(add.args[1].meta["val"].shape) == (16, 24)
    assert back_through_views(add.args[1]).target is operator.getitem


# ------------------------------------------------------------------------------------------------
# Autocast: the gathered activation is cast before the matmul reads it.
# ------------------------------------------------------------------------------------------------


def autocast_gather(world, name, reshape_first=False):
    """Autocast: the fp32 gathered activation is cast to bf16, then read by the matmul (and saved).
    ``reshape_first``: the cast comes after a reshape, as it does after funcol's B = 1 view form."""

    def fn(x, w):
        gathered = all_gather(x, 1, world, name)
        if reshape_first:
            gathered = aten.reshape.default(gathered, [1, -1, 16])
        gathered = torch.ops.prims.convert_element_type.default(gathered, torch.bfloat16)
        flat = aten.reshape.default(gathered, [-1, 16])
        return aten.mm.default(flat, w), flat

    return fn


@pytest.mark.parametrize("reshape_first", [False, True])
def test_all_gather_through_dtype_cast(reshape_first):
    gm = trace(autocast_gather(WORLD, group(), reshape_first), torch.randn(2, 4, 16),
               torch.randn(16, 8, dtype=torch.bfloat16))
    run_passes(gm)
    assert fused("all_gather_matmul") == 1
    assert count(gm, c10d.all_gather_into_tensor.default) == 0 and count(gm, aten.mm.default) == 0
    (node,) = nodes(gm, AG_MM)
    shard = rows_first_source(node.args[0], [1, 0, 2], 16)
    assert shard.target == torch.ops.prims.convert_element_type.default and shard.args[1] == torch.bfloat16
    assert node.args[5] is True
    outs, gathered = node.meta["val"]
    assert outs[0].dtype == torch.bfloat16 and gathered.dtype == torch.bfloat16 and tuple(gathered.shape) == (16, 16)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    assert tuple(out_node.args[0][1].meta["val"].shape) == (16, 16)
    (item,) = [u for u in node.users if u.args[1] == 1]
    (view,) = item.users
    (permute,) = view.users
    (clone,) = permute.users
    assert clone.target == aten.clone.default and tuple(clone.meta["val"].shape) == (2, 8, 16)
    if reshape_first:  # the [2, 8, 16] gathered tensor is reshaped to the [1, 16, 16] the cast produced
        (reader,) = clone.users
        assert reader.target == aten.reshape.default and tuple(reader.meta["val"].shape) == (1, 16, 16)
    assert_all_vals(gm)


@pytest.mark.parametrize("reshape_first", [False, True])
def test_numerics_dtype_cast_world1(reshape_first):
    torch.manual_seed(5)
    numeric_case(autocast_gather(1, WORLD1_GROUP, reshape_first),
                  (torch.randn(2, 4, 16), torch.randn(16, 8, dtype=torch.bfloat16)))
