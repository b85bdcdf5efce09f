"""Unit tests of the graph passes (passes/all_gather_matmul.py, passes/matmul_reduce_scatter.py,
passes/all_reduce_split.py).

As PyTorch's test/distributed/tensor/parallel/test_micro_pipeline_tp.py does, graphs are traced with
``make_fx(tracing_mode="fake")`` on a fake process group of 2 ranks, so no communication happens.  The
traced functions call the same aten / _c10d_functional ops, in the same forms, as the post-grad graphs
inductor produced for DTensor sequence-parallel MLP and attention blocks (forward and backward), funcol
and plain ``dist`` collectives (see passes/README.md); a few tests trace funcol's own API too.

Each test asserts the match count (``rewrite_stats`` and fused nodes in the graph), which ops are
present before and absent after, ``meta['val']`` of the new nodes, and the skip reasons.  The numeric
tests run a graph traced for a 1-rank gloo group, where every collective is the identity, before and
after the rewrite on random data: that checks the wiring and reshapes with no communication.  Multi-rank
numerics through torch.compile are in tests/test_compile_*.py.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import fluxinductor.ops  # noqa: F401  (registers torch.ops.fluxinductor)
from fluxinductor.log import reset_rewrite_stats, rewrite_stats
from fluxinductor.passes.all_gather_matmul import fuse_all_gather_matmul
from fluxinductor.passes.matmul_reduce_scatter import fuse_matmul_reduce_scatter

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
AG_MM = torch.ops.fluxinductor.all_gather_matmul.default
MM_RS = torch.ops.fluxinductor.matmul_reduce_scatter.default
WORLD = 2
WORLD1_GROUP = "fluxinductor_test_world1"


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    """A 2-rank fake default group (no communication) plus a registered 1-rank gloo group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    store = dist.HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, dist.ProcessGroupGloo(store, 0, 1))
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._set_group_name(WORLD1_GROUP)
    torch._C._distributed_c10d._register_process_group(WORLD1_GROUP, pg)
    yield
    torch._C._distributed_c10d._unregister_process_group(WORLD1_GROUP)
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh_stats():
    reset_rewrite_stats()
    yield


def group() -> str:
    return dist.group.WORLD.group_name


# ------------------------------------------------------------------------------------------------
# Graph builders: the forms seen in real post-grad graphs, written with the ops themselves.
# ------------------------------------------------------------------------------------------------


def all_gather(x, gather_dim, world, name):
    """What funcol's all_gather_tensor leaves in a post-grad graph."""
    w = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(x, world, name))
    if gather_dim == 0:
        return w
    if x.shape[0] == 1 and all(s == 1 for s in x.shape[1:gather_dim]):
        # funcol's view form (B = 1): no data movement.
        shape = list(x.shape)
        shape[gather_dim] *= world
        return aten.reshape.default(w, shape)
    return aten.cat.default(list(aten.split.Tensor(w, x.shape[0])), gather_dim)


def reduce_scatter(y, scatter_dim, world, name, reduce_op="sum"):
    """What funcol's reduce_scatter_tensor leaves in a post-grad graph."""
    if scatter_dim != 0:
        y = aten.cat.default(list(aten.split.Tensor(y, y.shape[scatter_dim] // world, scatter_dim)))
    return c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(y, reduce_op, world, name))


def linear(x3, weight, bias=None):
    """Post-grad nn.Linear on [..., K]: reshape -> addmm/mm(permute(W)) -> reshape."""
    x2 = aten.reshape.default(x3, [-1, x3.shape[-1]])
    wt = aten.permute.default(weight, [1, 0])
    y = aten.mm.default(x2, wt) if bias is None else aten.addmm.default(bias, x2, wt)
    return aten.reshape.default(y, list(x3.shape[:-1]) + [weight.shape[0]])


def sp_mlp_forward(world, name, gather_dim):
    """DTensor SP MLP forward: all_gather -> addmm (input saved for backward) ... addmm -> reduce_scatter."""

    def fn(x, w_up, b_up, w_down, b_down):
        gathered = all_gather(x, gather_dim, world, name)
        flat = aten.reshape.default(gathered, [-1, gathered.shape[-1]])
        h = aten.addmm.default(b_up, flat, aten.permute.default(w_up, [1, 0]))
        h = aten.relu.default(aten.reshape.default(h, list(gathered.shape[:-1]) + [w_up.shape[0]]))
        h2 = aten.reshape.default(h, [-1, h.shape[-1]])
        y = aten.addmm.default(aten.div.Tensor(b_down, world), h2, aten.permute.default(w_down, [1, 0]))
        y = aten.reshape.default(y, list(gathered.shape[:-1]) + [w_down.shape[0]])
        return reduce_scatter(y, gather_dim, world, name), flat, h2

    return fn


def sp_linear_backward(world, name, gather_dim):
    """DTensor SP backward of a column-parallel linear's consumer: the gradient is gathered, then read by
    the input-gradient mm, the weight-gradient mm (transposed) and the bias-gradient sum."""

    def fn(grad_shard, weight_t, saved_input2d):
        gathered = all_gather(grad_shard, gather_dim, world, name)
        g2 = aten.reshape.default(gathered, [-1, gathered.shape[-1]])
        grad_in = aten.mm.default(g2, weight_t)
        grad_w = aten.mm.default(aten.permute.default(g2, [1, 0]), saved_input2d)
        grad_b = aten.sum.dim_IntList(g2, [0], True)
        return grad_in, grad_w, grad_b

    return fn


def qkv(world, name, gather_dim):
    """Attention with separate Q/K/V linears on one gathered input."""

    def fn(x, wq, bq, wk, bk, wv, bv):
        gathered = all_gather(x, gather_dim, world, name)
        return linear(gathered, wq, bq), linear(gathered, wk, bk), linear(gathered, wv, bv)

    return fn


def trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def run_passes(gm, allowed=lambda name: True):
    """The pass manager's order: all_gather_matmul, then matmul_reduce_scatter."""
    fuse_all_gather_matmul(gm.graph, allowed)
    fuse_matmul_reduce_scatter(gm.graph, allowed)
    gm.graph.lint()
    gm.recompile()
    return gm


def count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def skipped(pattern):
    return rewrite_stats()["skipped"].get(pattern, {})


def fused(pattern) -> int:
    return rewrite_stats()["fused"].get(pattern, 0)


def rows_first_source(operand, perm, k):
    """``operand`` is ``reshape(clone(permute(x, perm), contiguous), [-1, k])`` (the rows-first operand the passes
    give the op for a gather/scatter dim behind a dim > 1): returns x."""
    assert operand.target == aten.reshape.default and operand.args[1] == [-1, k], operand.format_node()
    clone = operand.args[0]
    assert clone.target == aten.clone.default and clone.kwargs == {"memory_format": torch.contiguous_format}
    permute = clone.args[0]
    assert permute.target == aten.permute.default and permute.args[1] == perm, permute.format_node()
    return permute.args[0]


def back_through_views(node):
    """The node ``node`` reads through reshapes, permutes and contiguous clones."""
    while node.target in (aten.reshape.default, aten.view.default, aten.permute.default, aten.clone.default):
        node = node.args[0]
    return node


def assert_all_vals(gm):
    """Every call_function node (new ones included) carries meta['val'] of its real shape."""
    for n in gm.graph.nodes:
        if n.op == "call_function":
            assert "val" in n.meta, f"{n.name} has no meta['val']"


# ------------------------------------------------------------------------------------------------
# all_gather -> matmul
# ------------------------------------------------------------------------------------------------


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
    assert skipped("all_gather_matmul") == {"gathered tensor is on the contraction dim (weight-gradient mm)": 1}
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


# ------------------------------------------------------------------------------------------------
# matmul -> reduce_scatter
# ------------------------------------------------------------------------------------------------


def test_reduce_scatter_dim0_mm_two_users():
    """mm -> reduce_scatter on dim 0 (c10d form); the wait's two users read the op's output."""

    def fn(a, w):
        out = reduce_scatter(aten.mm.default(a, w), 0, WORLD, group())
        return aten.relu.default(out), aten.sum.default(out)

    gm = trace(fn, torch.randn(8, 16), torch.randn(16, 12))
    run_passes(gm)
    assert fused("matmul_reduce_scatter") == 1
    assert count(gm, c10d.reduce_scatter_tensor.default) == 0 and count(gm, c10d.wait_tensor.default) == 0
    assert count(gm, aten.mm.default) == 0
    (node,) = nodes(gm, MM_RS)
    assert len(node.users) == 2
    assert node.args[2:] == (None, "sum", 0, group())
    assert tuple(node.meta["val"].shape) == (4, 12)


@pytest.mark.parametrize("batch", [2, 1])
def test_reduce_scatter_sequence_dim1_addmm(batch):
    """Row-parallel linear with output Shard(1): addmm(bias/w) -> reshape -> split/cat -> reduce_scatter."""

    def fn(h, w, b):
        h2 = aten.reshape.default(h, [-1, h.shape[-1]])
        y = aten.addmm.default(aten.div.Tensor(b, WORLD), h2, aten.permute.default(w, [1, 0]))
        y = aten.reshape.default(y, [h.shape[0], h.shape[1], w.shape[0]])
        return reduce_scatter(y, 1, WORLD, group())

    gm = trace(fn, torch.randn(batch, 8, 32), torch.randn(16, 32), torch.randn(16))
    run_passes(gm)
    assert fused("matmul_reduce_scatter") == 1
    assert count(gm, aten.addmm.default) == 0 and count(gm, aten.cat.default) == 0
    (node,) = nodes(gm, MM_RS)
    a, weight, bias, reduce_op, scatter_dim, group_name = node.args
    assert bias is not None and bias.target == aten.div.Tensor
    if batch > 1:
        # The op gets [S * B, K] rows-first (of the N-D operand) and scatters dim 0.
        assert (reduce_op, scatter_dim) == ("sum", 0)
        assert rows_first_source(a, [1, 0, 2], 32).op == "placeholder"
        assert tuple(node.meta["val"].shape) == (4 * batch, 16)
    else:
        assert (reduce_op, scatter_dim) == ("sum", 1)
        assert tuple(a.meta["val"].shape) == (batch, 8, 32)  # the N-D operand, not its [B*S, K] view
        assert tuple(node.meta["val"].shape) == (batch, 4, 16)


def test_reduce_scatter_backward_input_grad():
    """Backward of a column-parallel linear fed by an all_gather: the input-gradient mm is reduce-scattered
    (gradient of the all_gather); the weight-gradient mm next to it is untouched."""

    def fn(grad2d, weight, saved3d):
        grad_in = aten.mm.default(grad2d, weight)
        grad_in = aten.reshape.default(grad_in, [2, 8, 16])
        grad_w = aten.mm.default(aten.permute.default(grad2d, [1, 0]), aten.reshape.default(saved3d, [16, 16]))
        return reduce_scatter(grad_in, 1, WORLD, group()), grad_w

    gm = trace(fn, torch.randn(16, 32), torch.randn(32, 16), torch.randn(2, 8, 16))
    run_passes(gm)
    assert fused("matmul_reduce_scatter") == 1
    assert count(gm, aten.mm.default) == 1


def test_reduce_scatter_mm_with_other_users_skipped():
    def fn(a, w):
        y = aten.mm.default(a, w)
        return reduce_scatter(y, 0, WORLD, group()), aten.sum.default(y)

    gm = trace(fn, torch.randn(8, 16), torch.randn(16, 12))
    run_passes(gm)
    assert fused("matmul_reduce_scatter") == 0
    assert skipped("matmul_reduce_scatter") == {"matmul output has other users": 1}
    assert count(gm, c10d.reduce_scatter_tensor.default) == 1


def test_reduce_scatter_non_dividing_skipped():
    """The scattered dim (6 rows over 4 ranks) does not split."""

    def fn(a, w):
        y = aten.mm.default(a, w)
        return c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(y, "sum", 4, group()))

    gm = trace(fn, torch.randn(6, 16), torch.randn(16, 12))
    run_passes(gm)
    assert fused("matmul_reduce_scatter") == 0
    assert skipped("matmul_reduce_scatter") == {"scatter dim does not split over the group": 1}


@pytest.mark.parametrize("reduce_op,fuses", [("avg", True), ("max", False)])
def test_reduce_scatter_reduce_ops(reduce_op, fuses):
    def fn(a, w):
        return reduce_scatter(aten.mm.default(a, w), 0, WORLD, group(), reduce_op)

    gm = trace(fn, torch.randn(8, 16), torch.randn(16, 12))
    run_passes(gm)
    assert fused("matmul_reduce_scatter") == int(fuses)
    if fuses:
        assert nodes(gm, MM_RS)[0].args[3] == "avg"
    else:
        assert skipped("matmul_reduce_scatter") == {"unsupported reduce_op": 1}


def sum_of_matmuls(world, name, scatter_dim):
    """Backward of separate Q/K/V (or gate/up) linears: the input gradient is a sum of mms, written as
    inductor leaves it: ``addmm(mm(a1, w1), a2, w2)`` (its mm + add folding) plus a reshaped 3-D add."""

    def fn(a1, a2, a3, w1, w2, w3):
        two = aten.addmm.default(aten.mm.default(a1, w1), a2, w2)  # [B*S, N]
        three = aten.add.Tensor(aten.reshape.default(two, [2, 8, 16]),
                                aten.reshape.default(aten.mm.default(a3, w3), [2, 8, 16]))
        return reduce_scatter(three, scatter_dim, world, name)

    return fn


def _sum_args():
    return (torch.randn(16, 8), torch.randn(16, 8), torch.randn(16, 4),
            torch.randn(8, 16), torch.randn(8, 16), torch.randn(4, 16))


@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_reduce_scatter_of_sum_of_matmuls(scatter_dim):
    """sum_i a_i @ w_i -> reduce_scatter becomes one op on cat(a_i, 1) and cat(w_i, 0)."""
    gm = trace(sum_of_matmuls(WORLD, group(), scatter_dim), *_sum_args())
    run_passes(gm)
    assert fused("matmul_reduce_scatter") == 1
    assert count(gm, aten.mm.default) == 0 and count(gm, aten.addmm.default) == 0
    assert count(gm, aten.add.Tensor) == 0 and count(gm, c10d.reduce_scatter_tensor.default) == 0
    (node,) = nodes(gm, MM_RS)
    a, weight = node.args[0], node.args[1]
    if scatter_dim == 1:
        a = rows_first_source(a, [1, 0, 2], 20)
    assert tuple(a.meta["val"].shape) == (2, 8, 20) and tuple(weight.meta["val"].shape) == (20, 16)
    assert weight.target == aten.cat.default and len(weight.args[0]) == 3
    assert node.args[4] == 0
    assert tuple(node.meta["val"].shape) == ((1, 8, 16) if scatter_dim == 0 else (8, 16))
    assert_all_vals(gm)


def test_veto_sees_the_concatenated_weight_of_a_sum():
    """The veto gets the weight the fused op will be given: for a sum of matmuls, the concatenation of the weights
    along K (contiguous, N-major), as a meta tensor; the global shape counts every term's K."""
    gm = trace(sum_of_matmuls(WORLD, group(), 0), *_sum_args())
    seen = []

    def veto(op, device, world, m, k, n, dtype, weight=None):
        seen.append((op, m, k, n, tuple(weight.shape), weight.stride(), weight.device.type))
        return None

    fuse_matmul_reduce_scatter(gm.graph, lambda name: True, veto)
    assert seen == [("matmul_reduce_scatter", 16, WORLD * 20, 16, (20, 16), (16, 1), "meta")]
    assert fused("matmul_reduce_scatter") == 1


def test_reduce_scatter_of_matmul_plus_other_skipped():
    """mm + something that is not a matmul (a residual): not fused."""

    def fn(a, w, r):
        return reduce_scatter(aten.add.Tensor(aten.mm.default(a, w), r), 0, WORLD, group())

    gm = trace(fn, torch.randn(8, 16), torch.randn(16, 4), torch.randn(8, 4))
    run_passes(gm)
    assert fused("matmul_reduce_scatter") == 0
    assert skipped("matmul_reduce_scatter") == {"reduce_scatter input is not a matmul": 1}


def test_integer_reduce_scatter_skipped():
    def fn(a, w):
        return reduce_scatter(aten.mm.default(a, w), 0, WORLD, group())

    gm = trace(fn, torch.randint(0, 5, (8, 16)), torch.randint(0, 5, (16, 4)))
    run_passes(gm)
    assert skipped("matmul_reduce_scatter") == {"non-floating dtype": 1}


# ------------------------------------------------------------------------------------------------
# Groups, funcol's own API, chains
# ------------------------------------------------------------------------------------------------


def test_two_dim_mesh_only_allowed_group():
    """A 2-D mesh: the tp group's collectives are fused, the other group's are skipped with the reason."""
    other = dist.new_group(ranks=list(range(WORLD)))
    tp, dp = group(), other.group_name
    assert tp != dp

    def fn(x, w, a, w2):
        y_tp = aten.mm.default(all_gather(x, 0, WORLD, tp), w)
        y_dp = aten.mm.default(all_gather(x, 0, WORLD, dp), w)
        rs_tp = reduce_scatter(aten.mm.default(a, w2), 0, WORLD, tp)
        rs_dp = reduce_scatter(aten.mm.default(a, w2), 0, WORLD, dp)
        return y_tp, y_dp, rs_tp, rs_dp

    gm = trace(fn, torch.randn(4, 16), torch.randn(16, 8), torch.randn(8, 16), torch.randn(16, 6))
    run_passes(gm, allowed=lambda name: name == tp)
    assert fused("all_gather_matmul") == 1 and fused("matmul_reduce_scatter") == 1
    assert skipped("all_gather_matmul") == {"group not allowed": 1}
    assert skipped("matmul_reduce_scatter") == {"group not allowed": 1}
    assert [n.args[4] for n in nodes(gm, AG_MM)] == [tp]
    assert [n.args[5] for n in nodes(gm, MM_RS)] == [tp]
    assert [n.args[2] for n in nodes(gm, c10d.all_gather_into_tensor.default)] == [dp]
    assert [n.args[3] for n in nodes(gm, c10d.reduce_scatter_tensor.default)] == [dp]


@pytest.mark.parametrize("dim", [0, 1])
def test_funcol_api_forms(dim):
    """Graphs traced from funcol's own all_gather_tensor / reduce_scatter_tensor (the forms its
    implementation produces for this torch) are rewritten: all_gather -> mm -> mm -> reduce_scatter."""
    import torch.distributed._functional_collectives as funcol

    name = group()

    def fn(x, w1, w2):
        a = funcol.all_gather_tensor(x, gather_dim=dim, group=name)
        y = torch.matmul(torch.matmul(a, w1), w2)
        return funcol.reduce_scatter_tensor(y, "sum", scatter_dim=dim, group=name)

    gm = trace(fn, torch.randn(2, 4, 16), torch.randn(16, 32), torch.randn(32, 16))
    assert count(gm, c10d.all_gather_into_tensor.default) == 1
    run_passes(gm)
    assert fused("all_gather_matmul") == 1 and fused("matmul_reduce_scatter") == 1
    assert count(gm, c10d.all_gather_into_tensor.default) == 0
    assert count(gm, c10d.reduce_scatter_tensor.default) == 0
    assert count(gm, aten.mm.default) == 0
    (rs,) = nodes(gm, MM_RS)
    assert rs.args[4] == 0 and tuple(rs.meta["val"].shape) == ((2, 4, 16) if dim == 0 else (8, 16))
    assert_all_vals(gm)


def test_no_collectives_is_a_no_op():
    def fn(a, w):
        return aten.mm.default(a, w)

    gm = trace(fn, torch.randn(8, 16), torch.randn(16, 4))
    before = str(gm.graph)
    run_passes(gm)
    assert str(gm.graph) == before and rewrite_stats()["fused"] == {} and rewrite_stats()["skipped"] == {}


# ------------------------------------------------------------------------------------------------
# Numerics on a 1-rank gloo group: the rewritten graph computes what the original did.
# ------------------------------------------------------------------------------------------------


def _numeric_case(fn, args):
    original = trace(fn, *args)
    rewritten = run_passes(trace(fn, *args))
    assert count(rewritten, AG_MM) + count(rewritten, MM_RS) >= 1
    assert count(rewritten, c10d.all_gather_into_tensor.default) + count(rewritten, c10d.reduce_scatter_tensor.default) \
        < count(original, c10d.all_gather_into_tensor.default) + count(original, c10d.reduce_scatter_tensor.default)
    expected = original(*args)
    got = rewritten(*args)
    for e, g in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got)):
        assert e.shape == g.shape
        assert ((g - e).norm() / e.norm()).item() < 1e-5


@pytest.mark.parametrize("gather_dim", [0, 1])
def test_numerics_mlp_forward_world1(gather_dim):
    torch.manual_seed(0)
    fn = sp_mlp_forward(1, WORLD1_GROUP, gather_dim)
    args = (torch.randn(3, 5, 16), torch.randn(24, 16), torch.randn(24), torch.randn(16, 24), torch.randn(16))
    _numeric_case(fn, args)


def test_numerics_qkv_world1():
    torch.manual_seed(1)
    fn = qkv(1, WORLD1_GROUP, 1)
    args = (torch.randn(2, 5, 16), torch.randn(8, 16), torch.randn(8), torch.randn(12, 16), torch.randn(12),
            torch.randn(16, 16), torch.randn(16))
    _numeric_case(fn, args)


def test_numerics_backward_world1():
    torch.manual_seed(2)
    fn = sp_linear_backward(1, WORLD1_GROUP, 1)
    _numeric_case(fn, (torch.randn(2, 6, 16), torch.randn(16, 32), torch.randn(12, 24)))


@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_numerics_reduce_scatter_world1(scatter_dim):
    torch.manual_seed(3)

    def fn(h, w, b):
        y = linear(h, w, b)
        out = reduce_scatter(y, scatter_dim, 1, WORLD1_GROUP)
        return out * 2, out.sum()

    _numeric_case(fn, (torch.randn(3, 4, 32), torch.randn(16, 32), torch.randn(16)))


def test_narrow_chunk_forms():
    """funcol under unbacked-symint tracing chunks with narrow (slice) instead of split: both passes
    recognize the slice/cat form too."""

    def fn(x, w, h, w2):
        ag = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(x, WORLD, group()))
        gathered = aten.cat.default([aten.slice.Tensor(ag, 0, i * 2, (i + 1) * 2) for i in range(WORLD)], 1)
        y = aten.mm.default(aten.reshape.default(gathered, [-1, 16]), w)
        p = aten.reshape.default(aten.mm.default(aten.reshape.default(h, [-1, 8]), w2), [2, 8, 16])
        z = aten.cat.default([aten.slice.Tensor(p, 1, i * 4, (i + 1) * 4) for i in range(WORLD)])
        return y, c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(z, "sum", WORLD, group()))

    gm = trace(fn, torch.randn(2, 4, 16), torch.randn(16, 8), torch.randn(2, 8, 8), torch.randn(8, 16))
    run_passes(gm)
    assert fused("all_gather_matmul") == 1 and fused("matmul_reduce_scatter") == 1
    assert nodes(gm, AG_MM)[0].args[3] == 0 and nodes(gm, MM_RS)[0].args[4] == 0  # rows-first (B = 2)
    assert count(gm, aten.slice.Tensor) == 0 and count(gm, aten.cat.default) == 0


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


def test_mutation_between_skipped():
    """An in-place op between the all_gather and its reader (or the matmul and its reduce_scatter)
    forbids moving the read."""

    def fn(x, w, a, w2):
        gathered = all_gather(x, 0, WORLD, group())
        x.add_(1)
        y = aten.mm.default(gathered, w)
        p = aten.mm.default(a, w2)
        a.mul_(2)
        return y, reduce_scatter(p, 0, WORLD, group())

    gm = trace(fn, torch.randn(4, 16), torch.randn(16, 8), torch.randn(8, 16), torch.randn(16, 4))
    run_passes(gm)
    assert fused("all_gather_matmul") == 0 and fused("matmul_reduce_scatter") == 0
    assert skipped("all_gather_matmul") == {"possible mutation between the all_gather and its matmuls": 1}
    assert skipped("matmul_reduce_scatter") == {"possible mutation between the matmul and the reduce_scatter": 1}


@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_numerics_sum_of_matmuls_world1(scatter_dim):
    torch.manual_seed(4)
    _numeric_case(sum_of_matmuls(1, WORLD1_GROUP, scatter_dim), _sum_args())


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


# ------------------------------------------------------------------------------------------------
# Real post-grad graphs: torch.compile(backend="flux") of DTensor sequence-parallel blocks on the fake
# group (the collectives run but move nothing, so only the rewrite counts are checked here).
# ------------------------------------------------------------------------------------------------


class _SwiGLU(torch.nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate = torch.nn.Linear(dim, hidden, bias=False)
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class _Attention(torch.nn.Module):
    def __init__(self, dim, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim)
        self.v = torch.nn.Linear(dim, dim)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class _Block(torch.nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.attn_norm = torch.nn.LayerNorm(dim)
        self.attn = _Attention(dim, 4)
        self.ffn_norm = torch.nn.LayerNorm(dim)
        self.ffn = _SwiGLU(dim, 32)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


@pytest.mark.parametrize("batch", [2, 1])
def test_real_dtensor_block_compiled_with_flux(batch):
    """A transformer block under DTensor sequence parallelism (separate Q/K/V, SwiGLU), forward and
    backward, compiled with backend="flux": every all-gather and reduce-scatter that feeds or is fed by
    a matmul is fused; only the weight-gradient mms are left, with their reason."""
    import torch._dynamo
    import torch._inductor.config
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (WORLD,))
    block = _Block()
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(block, mesh, {
        "attn_norm": SequenceParallel(), "attn": gather, "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(), "ffn": gather, "ffn.gate": ColwiseParallel(), "ffn.up": ColwiseParallel(),
        "ffn.down": RowwiseParallel(output_layouts=Shard(1)),
    })
    x = torch.randn(batch, 8 // WORLD, 16, requires_grad=True)
    # One compile thread: no subprocess pool to start for two tiny graphs.
    with torch._inductor.config.patch(compile_threads=1):
        torch.compile(block, backend="flux")(x).sum().backward()
    stats = rewrite_stats()
    # forward: all_gather -> {q, k, v} and -> {gate, up}; o and down -> reduce_scatter.
    # backward: the gathered gradients of o and down feed their input-grad mms; the input gradients of
    # {q, k, v} and {gate, up} (sums of mms) are reduce-scattered.
    assert stats["fused"] == {"all_gather_matmul": 4, "matmul_reduce_scatter": 4}
    assert stats["skipped"] == {
        "all_gather_matmul": {"gathered tensor is on the contraction dim (weight-gradient mm)": 2}
    }
    torch._dynamo.reset()


def _autocast_gather(world, name, reshape_first=False):
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
    gm = trace(_autocast_gather(WORLD, group(), reshape_first), torch.randn(2, 4, 16),
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
    _numeric_case(_autocast_gather(1, WORLD1_GROUP, reshape_first),
                  (torch.randn(2, 4, 16), torch.randn(16, 8, dtype=torch.bfloat16)))


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


def test_symbolic_contraction_dims_skipped():
    """A symbolic K or N (here every size is symbolic, weights included) is left alone, with the reason: the
    kernels and the cost model key on them, and a model's weights have static shapes."""

    def fn(x, w, a, w2):
        return aten.mm.default(all_gather(x, 0, WORLD, group()), w), reduce_scatter(aten.mm.default(a, w2), 0, WORLD, group())

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(4, 16), torch.randn(16, 8), torch.randn(8, 16), torch.randn(16, 6))
    run_passes(gm)
    assert fused("all_gather_matmul") == 0 and fused("matmul_reduce_scatter") == 0
    assert skipped("all_gather_matmul") == {"symbolic shape": 1}
    assert skipped("matmul_reduce_scatter") == {"symbolic shape": 1}


def _symbolic(fake_mode, t: torch.Tensor, dynamic_dims=()) -> torch.Tensor:
    """A FakeTensor of ``t`` whose ``dynamic_dims`` are symbolic (the others static), as dynamo marks them."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    dims = [DimDynamic.DYNAMIC if i in dynamic_dims else DimDynamic.STATIC for i in range(t.dim())]
    return fake_mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))


def sp_mlp_dynamic(world, name, gather_dim):
    """sp_mlp_forward as inductor writes it for a symbolic sequence (or row) dim: sizes come from the input's
    symbol (``sym_size(x)``), the gathered tensor is flattened with -1, and the reduce_scatter's chunk size is
    the shard's size."""

    def fn(x, w_up, b_up, w_down, b_down):
        s = x.shape[gather_dim]  # the shard's size: symbolic
        gathered = all_gather(x, gather_dim, world, name)
        flat = aten.reshape.default(gathered, [-1, w_up.shape[1]])
        h = aten.relu.default(aten.addmm.default(b_up, flat, aten.permute.default(w_up, [1, 0])))
        y = aten.addmm.default(aten.div.Tensor(b_down, world), h, aten.permute.default(w_down, [1, 0]))
        lead = [x.shape[0], s * world] if gather_dim == 1 else [s * world]
        y = aten.reshape.default(y, lead + [w_down.shape[0]])
        if gather_dim != 0:
            y = aten.cat.default(list(aten.split.Tensor(y, s, gather_dim)))
        return c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(y, "sum", world, name)), h

    return fn


def _sp_mlp_dynamic_args(gather_dim, rows):
    x = torch.randn(3, rows, 16) if gather_dim == 1 else torch.randn(rows, 16)
    return (x, torch.randn(24, 16), torch.randn(24), torch.randn(16, 24), torch.randn(16))


def _trace_dynamic(fn, args, gather_dim, dynamic_dims=None):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    dims = {gather_dim} if dynamic_dims is None else dynamic_dims
    fakes = [_symbolic(fake_mode, args[0], dims)] + [_symbolic(fake_mode, a) for a in args[1:]]
    return make_fx(fn, tracing_mode="fake")(*fakes)


@pytest.mark.parametrize("gather_dim", [0, 1])
def test_symbolic_rows_fused(gather_dim):
    """Dynamic shapes: a symbolic token (or sequence) dim with static K and N is fused, the new nodes carry
    symbolic meta['val']s equal to what they replace, and no guard is added."""
    gm = _trace_dynamic(sp_mlp_dynamic(WORLD, group(), gather_dim), _sp_mlp_dynamic_args(gather_dim, 4), gather_dim)
    outputs = [n for n in gm.graph.nodes if n.op == "output"][0]
    before = [tuple(m_.meta["val"].shape) for m_ in outputs.args[0]]
    shape_env = m_val(gm).shape_env
    guards_before = len(shape_env.guards)
    run_passes(gm)
    assert fused("all_gather_matmul") == 1 and fused("matmul_reduce_scatter") == 1, rewrite_stats()
    assert count(gm, AG_MM) == 1 and count(gm, MM_RS) == 1
    assert count(gm, c10d.all_gather_into_tensor.default) == 0 and count(gm, c10d.reduce_scatter_tensor.default) == 0
    assert_all_vals(gm)
    after = [tuple(m_.meta["val"].shape) for m_ in outputs.args[0]]
    assert len(after) == len(before)
    for b, a in zip(before, after):
        assert len(a) == len(b) and all(str(x) == str(y) for x, y in zip(a, b)), (before, after)
    assert any(not isinstance(d, int) for d in after[0]), "the output should still be symbolic"
    assert len(shape_env.guards) == guards_before


@pytest.mark.parametrize("gather_dim", [0, 1])
def test_symbolic_rows_veto_is_asked_at_any_m(gather_dim):
    """With a symbolic M the veto is asked with m None (the graph serves every M), and its answer is kept."""
    gm = _trace_dynamic(sp_mlp_dynamic(WORLD, group(), gather_dim), _sp_mlp_dynamic_args(gather_dim, 4), gather_dim)
    seen = []

    def veto(op, device, world, m_, k, n, dtype, weight=None):
        seen.append((op, m_, k, n))
        return "measured to lose at every M" if op == "all_gather_matmul" else None

    fuse_all_gather_matmul(gm.graph, lambda name: True, veto)
    fuse_matmul_reduce_scatter(gm.graph, lambda name: True, veto)
    gm.graph.lint()
    assert seen == [("all_gather_matmul", None, 16, WORLD * 24), ("matmul_reduce_scatter", None, WORLD * 24, 16)]
    assert skipped("all_gather_matmul") == {"not worth fusing here": 1}
    assert count(gm, AG_MM) == 0 and count(gm, MM_RS) == 1


def m_val(gm):
    """The fake mode of a traced graph."""
    from fluxinductor.passes._match import fake_mode_of

    return fake_mode_of(gm.graph)


@pytest.mark.parametrize("gather_dim", [0, 1])
def test_numerics_symbolic_rows_world1(gather_dim):
    """One graph traced with a symbolic row dim, rewritten, then run at three sizes: the -1 reshapes the
    rewrite writes for symbolic sizes are right for each (1-rank gloo group: the collectives are identities)."""
    torch.manual_seed(4)
    fn = sp_mlp_dynamic(1, WORLD1_GROUP, gather_dim)
    original = _trace_dynamic(fn, _sp_mlp_dynamic_args(gather_dim, 4), gather_dim)
    rewritten = run_passes(_trace_dynamic(fn, _sp_mlp_dynamic_args(gather_dim, 4), gather_dim))
    assert count(rewritten, AG_MM) == 1 and count(rewritten, MM_RS) == 1
    for rows in (2, 5, 7):
        args = _sp_mlp_dynamic_args(gather_dim, rows)
        for e, g in zip(original(*args), rewritten(*args)):
            assert e.shape == g.shape
            assert ((g - e).norm() / e.norm()).item() < 1e-5


def test_symbolic_batch_and_sequence_rows_first_world1():
    """[B, S/w, H] with B and S both symbolic (``dynamic=True``): the rows-first reshapes take -1 for the gathered
    (scattered) dim and a ``sym_size`` node of the operand for B; one rewritten graph is right at every (B, S)."""
    torch.manual_seed(6)
    fn = sp_mlp_dynamic(1, WORLD1_GROUP, 1)

    def args(batch, rows):
        return (torch.randn(batch, rows, 16), torch.randn(24, 16), torch.randn(24), torch.randn(16, 24),
                torch.randn(16))

    original = _trace_dynamic(fn, args(3, 4), 1, {0, 1})
    rewritten = run_passes(_trace_dynamic(fn, args(3, 4), 1, {0, 1}))
    (ag,) = nodes(rewritten, AG_MM)
    (rs,) = nodes(rewritten, MM_RS)
    assert ag.args[3] == 0 and rs.args[4] == 0  # rows-first
    # The results go back to [-1, B, N]: B is a sym_size node of the operand, the gathered / scattered dim -1.
    (outs,) = [u for u in ag.users if u.args[1] == 0]
    (out0,) = outs.users
    (view,) = out0.users
    for reshape, source in ((view, ag.args[0]), (next(iter(rs.users)), rs.args[0])):
        assert reshape.target == aten.reshape.default and reshape.args[1][0] == -1, reshape.format_node()
        size = reshape.args[1][1]
        assert size.target == aten.sym_size.int and size.args[1] == 0, size.format_node()
        assert back_through_views(source) is back_through_views(size.args[0])
    assert_all_vals(rewritten)
    for batch, rows in ((2, 3), (3, 4), (5, 2)):
        a = args(batch, rows)
        for e, g in zip(original(*a), rewritten(*a)):
            assert e.shape == g.shape
            assert ((g - e).norm() / e.norm()).item() < 1e-5


def _fused_with_fp32_result(fn, args):
    """Trace ``fn``, run the passes and check they made one GEMM+RS op with out_dtype=float32 and no matmul or cast
    left; returns (the rewritten graph's result, the original graph's)."""
    gm = trace(fn, *args)
    original = trace(fn, *args)
    run_passes(gm)
    assert fused("matmul_reduce_scatter") == 1 and skipped("matmul_reduce_scatter") == {}
    (op,) = nodes(gm, MM_RS)
    assert op.args[6] == torch.float32 and op.meta["val"].dtype == torch.float32
    assert count(gm, torch.ops.prims.convert_element_type.default) == 0
    assert count(gm, aten.mm.default) == 0 and count(gm, aten.addmm.default) == 0
    assert_all_vals(gm)
    got, expected = gm(*args), original(*args)
    assert got.dtype == expected.dtype == torch.float32
    return got, expected


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16])
def test_reduce_scatter_after_half_to_fp32_cast_fused_with_out_dtype(source):
    """Autocast backward: a bf16 (fp16) mm (here with a bias) cast to fp32 and reduced in fp32.  The op takes
    out_dtype=float32: the partials are bf16 (fp16) as in the graph, the reduction and the result fp32."""

    def fn(a, w, b):
        y = torch.ops.prims.convert_element_type.default(aten.addmm.default(b, a, w), torch.float32)
        return reduce_scatter(y, 0, WORLD, group())

    args = (torch.randn(8, 16, dtype=source), torch.randn(16, 4, dtype=source), torch.randn(4, dtype=source))
    got, expected = _fused_with_fp32_result(fn, args)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # the decomposition computes what the graph did


def _reduce_scatter_of_upcast_sum(a1, w1, a2, w2):
    """reduce_scatter(fp32(a1 @ w1) + fp32(a2 @ w2)): autocast's gradient of an fp32 input read by two projections."""
    convert = torch.ops.prims.convert_element_type.default
    y = convert(aten.mm.default(a1, w1), torch.float32) + convert(aten.mm.default(a2, w2), torch.float32)
    return reduce_scatter(y, 0, WORLD, group())


def test_reduce_scatter_of_a_sum_of_upcast_terms_fused_with_out_dtype():
    """Autocast casts an fp32 input once per projection, so its gradient is the fp32 sum of each bf16 matmul cast up:
    one op over the concatenated K with out_dtype=float32.  It rounds each rank's partial once where the graph rounded
    each term, so it matches the graph within bf16 rounding, not bit for bit."""
    fn = _reduce_scatter_of_upcast_sum
    args = (torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 4, dtype=torch.bfloat16),
            torch.randn(8, 24, dtype=torch.bfloat16), torch.randn(24, 4, dtype=torch.bfloat16))
    got, expected = _fused_with_fp32_result(fn, args)
    # The fake group's reduce_scatter returns rank 0's rows of its input.
    exact = (args[0].double() @ args[1].double() + args[2].double() @ args[3].double())[:8 // WORLD]
    for result in (got, expected):  # each within a bf16 rounding of the exact sum
        assert ((result.double() - exact).norm() / exact.norm()).item() < 4e-3
    assert not torch.equal(got, expected)  # the graph's per-term roundings are not what the op computes


def test_reduce_scatter_of_terms_upcast_from_different_dtypes_skipped():
    gm = trace(_reduce_scatter_of_upcast_sum,
               torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 4, dtype=torch.bfloat16),
               torch.randn(8, 24, dtype=torch.float16), torch.randn(24, 4, dtype=torch.float16))
    run_passes(gm)
    assert fused("matmul_reduce_scatter") == 0
    assert skipped("matmul_reduce_scatter") == {"dtype cast between matmul and reduce_scatter": 1}


@pytest.mark.parametrize("source, target", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16),
                                            (torch.float32, torch.bfloat16), (torch.float32, torch.float64)])
def test_reduce_scatter_after_other_dtype_casts_skipped(source, target):
    """Only a half-precision matmul reduced in fp32 has a kernel; the other casts change what is computed between
    the matmul and the reduction and are not what autocast does."""

    def fn(a, w):
        y = torch.ops.prims.convert_element_type.default(aten.mm.default(a, w), target)
        return reduce_scatter(y, 0, WORLD, group())

    gm = trace(fn, torch.randn(8, 16, dtype=source), torch.randn(16, 4, dtype=source))
    run_passes(gm)
    assert fused("matmul_reduce_scatter") == 0
    assert skipped("matmul_reduce_scatter") == {"dtype cast between matmul and reduce_scatter": 1}


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


def test_not_worth_fusing_veto_leaves_graph_and_sees_global_shapes():
    """The pass manager's veto (the cost model on GPUs) gets each match's global GEMM shape; a veto
    leaves the collectives and matmuls in place and is recorded as a skip with its reason."""
    fn = sp_mlp_forward(WORLD, group(), 0)
    args = (torch.randn(4, 3, 16), torch.randn(32, 16), torch.randn(32), torch.randn(16, 32), torch.randn(16))
    gm = trace(fn, *args)
    seen = []

    def veto(op, device, world, m, k, n, dtype, weight=None):
        seen.append((op, device.type, world, m, k, n, dtype))
        if op == "matmul_reduce_scatter":  # the fused op's weight: the transposed nn.Linear weight, K-major
            assert weight is not None and tuple(weight.shape) == (32, 16) and weight.stride(0) == 1
        return "measured to lose"

    fuse_all_gather_matmul(gm.graph, lambda name: True, veto)
    fuse_matmul_reduce_scatter(gm.graph, lambda name: True, veto)
    gm.graph.lint()
    # all_gather_matmul: gathered [8, 3, 16] -> M = 24, K = 16, N = world * 32;
    # matmul_reduce_scatter: partial [8, 3, 16] from K_local = 32 -> M = 24, K = world * 32, N = 16.
    assert seen == [("all_gather_matmul", "cpu", WORLD, 24, 16, WORLD * 32, torch.float32),
                    ("matmul_reduce_scatter", "cpu", WORLD, 24, WORLD * 32, 16, torch.float32)]
    assert fused("all_gather_matmul") == 0 and fused("matmul_reduce_scatter") == 0
    assert skipped("all_gather_matmul") == {"not worth fusing here": 1}
    assert skipped("matmul_reduce_scatter") == {"not worth fusing here": 1}
    assert count(gm, AG_MM) == 0 and count(gm, MM_RS) == 0
    assert count(gm, c10d.all_gather_into_tensor.default) == 1
    assert count(gm, c10d.reduce_scatter_tensor.default) == 1


def test_manager_does_not_veto_cpu_graphs_and_keys_settings():
    from fluxinductor.passes import FluxPassManager

    manager = FluxPassManager()
    assert manager.not_worth_fusing("all_gather_matmul", torch.device("cpu"), 2, 4096, 8192, 8192,
                                    torch.bfloat16) is None
    assert FluxPassManager(fuse_matmul_sums=False).uuid() != FluxPassManager(fuse_matmul_sums=True).uuid()
    assert FluxPassManager(frozenset({"1"})).uuid() != FluxPassManager().uuid()


def test_manager_veto_offers_split_only_for_weights_it_takes(flux_settings, tmp_path, monkeypatch):
    """On a GPU the veto asks the cost model with the paths that can run the match: the split GEMM+RS transport
    for the forward's x @ W.t() (K-major) and the backward's grad @ W (N-major), not for a weight it cannot take
    (N not a multiple of 8) or an unknown one, where a shape whose only winner is split then stays unfused."""
    from fluxinductor import cost_model, dispatch
    from fluxinductor.kernels import gemm_rs
    from fluxinductor.passes import FluxPassManager

    row = dict(op="matmul_reduce_scatter", m=4096, k=16384, n=8192, fused_ms=2.89, fused_copy_ms=2.85,
               fused_split_ms=2.50, sequential_ms=2.64)
    flux_settings(tuning_dir=str(tmp_path), dispatch="auto")
    cost_model.clear_cache()
    cost_model.write_table(str(tmp_path / "nvidia_h200_tp2.json"),
                           cost_model.make_table("NVIDIA H200", 2, torch.bfloat16, [row], source={"test": True}),
                           merge=False)
    monkeypatch.setattr(dispatch, "_kernels", lambda op: (gemm_rs, None))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    manager = FluxPassManager()
    cuda = torch.device("cuda", 0)
    veto = lambda weight: manager.not_worth_fusing("matmul_reduce_scatter", cuda, 2, 4096, 16384, 8192,  # noqa: E731
                                                   torch.bfloat16, weight=weight)
    try:
        assert veto(torch.empty(8192, 8192, device="meta").t()) is None  # K-major: split, 5% ahead of sequential
        assert veto(torch.empty(8192, 8192, device="meta")) is None  # N-major: the same
        assert "sequential" in veto(torch.empty(8192, 8190, device="meta"))  # fused and copy both lose
        assert "sequential" in veto(None)
        # A symbolic M (None): kept where some M's choice is overlapped, vetoed only where every probed M's is
        # sequential.
        any_m = lambda weight: manager.not_worth_fusing("matmul_reduce_scatter", cuda, 2, None, 16384, 8192,  # noqa: E731
                                                        torch.bfloat16, weight=weight)
        assert any_m(torch.empty(8192, 8192, device="meta")) is None
        assert "at every M" in any_m(torch.empty(8192, 8190, device="meta"))
    finally:
        cost_model.clear_cache()


def test_manager_keys_the_async_tp_setting(flux_settings, monkeypatch):
    """``settings.tuning.asynctp`` lets the GPU veto keep matches the cost model sends to async-TP: a cached graph
    compiled without it must not be reused with it."""
    from fluxinductor import dispatch
    from fluxinductor.passes import FluxPassManager

    monkeypatch.setattr(dispatch, "_asynctp_registered", lambda: ("ag", "rs"))
    flux_settings(asynctp=False)
    off = FluxPassManager().uuid()
    flux_settings(asynctp="1")
    assert FluxPassManager().uuid() != off


def test_reduce_scatter_of_sum_of_matmuls_can_be_turned_off():
    gm = trace(sum_of_matmuls(WORLD, group(), 0), *_sum_args())
    fuse_all_gather_matmul(gm.graph, lambda name: True)
    fuse_matmul_reduce_scatter(gm.graph, lambda name: True, fuse_sums=False)
    assert fused("matmul_reduce_scatter") == 0
    assert skipped("matmul_reduce_scatter") == {"sum of matmuls (fuse_matmul_sums=False)": 1}
    assert count(gm, c10d.reduce_scatter_tensor.default) == 1


# ------------------------------------------------------------------------------------------------
# all_reduce -> reduce_scatter + all_gather (passes/all_reduce_split.py)
# ------------------------------------------------------------------------------------------------


def all_reduce(y, name, reduce_op="sum"):
    """What funcol's all_reduce (DTensor's Partial -> Replicate) leaves in a post-grad graph."""
    return c10d.wait_tensor.default(c10d.all_reduce.default(y, reduce_op, name))


def rms_norm(x, weight):
    """Post-grad RMSNorm: reductions over the last dim only."""
    ms = aten.mean.dim(aten.pow.Tensor_Scalar(x, 2), [-1], True)
    return aten.mul.Tensor(aten.mul.Tensor(x, aten.rsqrt.default(aten.add.Tensor(ms, 1e-6))), weight)


def tp_residual_block(name):
    """Plain TP: a row-parallel linear all-reduced, the residual add, a norm, the next column-parallel linear."""

    def fn(x, a, w_o, g, w_q):
        h = aten.add.Tensor(x, all_reduce(linear(a, w_o), name))
        return linear(rms_norm(h, g), w_q), h

    return fn


def _tp_block_args():
    return (torch.randn(2, 8, 32), torch.randn(2, 8, 16), torch.randn(32, 16), torch.randn(32), torch.randn(24, 32))


def split_ar(gm, assume_replicated=False, allowed=lambda name: True):
    from fluxinductor.passes.all_reduce_split import split_all_reduce

    split_all_reduce(gm.graph, allowed, assume_replicated=assume_replicated)
    gm.graph.lint()
    gm.recompile()
    return gm


def test_all_reduce_split_exact_fuses_the_reduce_scatter_and_slices_nothing():
    gm = trace(tp_residual_block(group()), *_tp_block_args())
    assert count(gm, c10d.all_reduce.default) == 1
    split_ar(gm)
    assert fused("all_reduce_split") == 1
    assert count(gm, c10d.all_reduce.default) == 0 and count(gm, aten.slice.Tensor) == 0
    (rs,) = nodes(gm, c10d.reduce_scatter_tensor.default)
    assert rs.args[0].meta["val"].shape == (16, 32) and rs.args[1:] == ("sum", WORLD, group())
    # Exact: the residual x is not known to be the same on every rank, so the gather lands before the add.
    (ag,) = nodes(gm, c10d.all_gather_into_tensor.default)
    assert ag.args[0].meta["val"].shape == (8, 32)
    (add,) = [n for n in nodes(gm, aten.add.Tensor) if n.meta["val"].shape == (2, 8, 32)]
    assert back_through_views(add.args[1]).target == c10d.wait_tensor.default
    assert_all_vals(gm)
    run_passes(gm)
    assert count(gm, MM_RS) == 1 and count(gm, AG_MM) == 0
    assert count(gm, c10d.reduce_scatter_tensor.default) == 0


def test_all_reduce_split_replicated_moves_the_gather_to_the_next_matmul():
    gm = trace(tp_residual_block(group()), *_tp_block_args())
    split_ar(gm, assume_replicated=True)
    # Rank 0 of 2 keeps rows [0, 8) of the 16: x is sliced, the norm runs on 8 rows.
    slices = nodes(gm, aten.slice.Tensor)
    assert [s.args[1:] for s in slices] == [(0, 0, 8)]
    assert back_through_views(slices[0].args[0]).op == "placeholder"
    mean = nodes(gm, aten.mean.dim)
    assert len(mean) == 1 and mean[0].meta["val"].shape == (8, 1)
    # Two gathers: the norm's output (into the matmul) and h (a graph output).
    assert sorted(tuple(n.args[0].meta["val"].shape) for n in nodes(gm, c10d.all_gather_into_tensor.default)) == [
        (8, 32), (8, 32)]
    assert_all_vals(gm)
    run_passes(gm)
    assert count(gm, MM_RS) == 1 and count(gm, AG_MM) == 1
    assert count(gm, c10d.all_gather_into_tensor.default) == 1  # h's: nothing but the output reads it


def test_all_reduce_split_replicated_gathers_once_for_every_linear_reading_the_rows():
    """The norm's output feeds two column-parallel linears (w1 and w3, or Q/K/V), each reshaping it for itself: one
    all-gather serves both, so the all-gather pass fuses one call with both weights (not one call, and one gather
    of the same rows, per linear)."""

    def fn(x, a, w_o, g, w_1, w_3):
        h = aten.add.Tensor(x, all_reduce(linear(a, w_o), group()))
        n = rms_norm(h, g)
        return aten.mul.Tensor(linear(n, w_1), linear(n, w_3)), h

    args = _tp_block_args() + (torch.randn(24, 32),)
    gm = split_ar(trace(fn, *args), assume_replicated=True)
    # n and h: one gather each, whichever of n's reshapes a linear reads.
    assert count(gm, c10d.all_gather_into_tensor.default) == 2
    assert_all_vals(gm)
    run_passes(gm)
    (agmm,) = nodes(gm, AG_MM)
    # The all-gathers are the split's own: counted under "inserted", the user's all-reduce once (all_reduce_split).
    assert len(agmm.args[1]) == 2 and rewrite_stats()["inserted"]["fused"]["all_gather_matmul"] == 1
    assert fused("all_gather_matmul") == 0 and skipped("all_gather_matmul") == {}
    assert count(gm, c10d.all_gather_into_tensor.default) == 1  # h's


def test_all_reduce_split_counts_a_gather_the_cost_model_keeps_unfused_as_exposed():
    """Replicated, the norm's output gathered into the next matmul is hidden only if the all-gather pass fuses them:
    with the cost model vetoing all_gather_matmul the far plan exposes two gathers (n and h), so the all-reduce is
    confined (one gather, nothing sliced)."""
    from fluxinductor.passes.all_reduce_split import split_all_reduce

    asked = []

    def veto_all_gather_matmul(op, device, world, m, k, n, dtype, weight=None):
        asked.append((op, world, m, k, n))
        return "sequential here" if op == "all_gather_matmul" else None

    gm = trace(tp_residual_block(group()), *_tp_block_args())
    split_all_reduce(gm.graph, lambda name: True, veto_all_gather_matmul, assume_replicated=True)
    gm.graph.lint()
    assert fused("all_reduce_split") == 1
    assert ("all_gather_matmul", WORLD, 16, 32, 48) in asked  # the global GEMM: 16 rows, K=32, N=2*24
    assert count(gm, aten.slice.Tensor) == 0
    (ag,) = nodes(gm, c10d.all_gather_into_tensor.default)
    assert ag.args[0].args[0].target == c10d.reduce_scatter_tensor.default


def test_all_reduce_split_row_sum_becomes_a_local_sum_and_a_small_all_reduce():
    def fn(a, w_o, g):
        y = all_reduce(linear(a, w_o), group())
        grad_g = aten.sum.dim_IntList(aten.mul.Tensor(y, g), [0, 1], True)  # a norm weight's gradient
        return aten.reshape.default(grad_g, [32]), aten.mul.Tensor(y, 2.0)

    gm = split_ar(trace(fn, torch.randn(2, 8, 16), torch.randn(32, 16), torch.randn(32)))
    assert fused("all_reduce_split") == 1
    (ar,) = nodes(gm, c10d.all_reduce.default)
    assert ar.args[0].meta["val"].shape == (1, 1, 32)
    (local,) = nodes(gm, aten.sum.dim_IntList)
    assert local.args[1:] == ([0], True) and local.args[0].meta["val"].shape == (8, 32)


def test_all_reduce_of_a_non_matmul_is_left_alone():
    def fn(x):
        return aten.add.Tensor(all_reduce(aten.mul.Tensor(x, 2.0), group()), 1.0)

    gm = split_ar(trace(fn, torch.randn(16, 32)))
    assert count(gm, c10d.all_reduce.default) == 1 and count(gm, c10d.reduce_scatter_tensor.default) == 0
    assert skipped("all_reduce_split") == {"reduce_scatter input is not a matmul": 1}


def test_all_reduce_split_rows_that_do_not_split_are_left_alone():
    def fn(a, w):
        return all_reduce(aten.mm.default(a, aten.permute.default(w, [1, 0])), group())

    gm = split_ar(trace(fn, torch.randn(3, 16), torch.randn(32, 16)))
    assert count(gm, c10d.all_reduce.default) == 1
    assert skipped("all_reduce_split") == {"rows do not split over the group": 1}


def test_all_reduce_split_gathers_at_once_where_sharding_on_would_gather_more():
    def fn(a, w):
        y = all_reduce(linear(a, w), group())
        # Three row-wise results, each a graph output: sharding on would gather three tensors of y's size.
        return aten.mul.Tensor(y, 2.0), aten.mul.Tensor(y, 3.0), aten.mul.Tensor(y, 4.0)

    gm = split_ar(trace(fn, torch.randn(2, 8, 16), torch.randn(32, 16)))
    assert fused("all_reduce_split") == 1 and count(gm, c10d.all_reduce.default) == 0
    # Confined: one gather, right after the reduce-scatter; the three muls read the whole tensor.
    (ag,) = nodes(gm, c10d.all_gather_into_tensor.default)
    assert ag.args[0].target == c10d.wait_tensor.default
    assert ag.args[0].args[0].target == c10d.reduce_scatter_tensor.default
    assert [tuple(n.meta["val"].shape) for n in nodes(gm, aten.mul.Tensor)] == [(2, 8, 32)] * 3
    assert_all_vals(gm)
    run_passes(gm)
    assert count(gm, MM_RS) == 1


def test_all_reduce_split_confines_each_all_reduce_on_its_own():
    def fn(a, w, b, v):
        y = all_reduce(linear(a, w), group())
        z = all_reduce(linear(b, v), group())
        # y: two row-wise outputs (sharding on gathers twice, confined once); z: one (the same either way, so its
        # row-wise op runs on this rank's rows).
        return aten.mul.Tensor(y, 2.0), aten.mul.Tensor(y, 3.0), aten.mul.Tensor(z, 4.0)

    args = (torch.randn(2, 8, 16), torch.randn(32, 16), torch.randn(2, 8, 16), torch.randn(24, 16))
    gm = split_ar(trace(fn, *args))
    assert fused("all_reduce_split") == 2
    gathered = sorted(tuple(n.args[0].meta["val"].shape) for n in nodes(gm, c10d.all_gather_into_tensor.default))
    assert gathered == [(8, 24), (8, 32)]
    (z_ag,) = [n for n in nodes(gm, c10d.all_gather_into_tensor.default) if n.args[0].meta["val"].shape == (8, 24)]
    assert z_ag.args[0].target == aten.mul.Tensor  # z's rows went on through the mul
    assert sorted(tuple(n.meta["val"].shape) for n in nodes(gm, aten.mul.Tensor)) == [(2, 8, 32), (2, 8, 32), (8, 24)]
    assert_all_vals(gm)


def test_all_reduce_split_layer_norm_runs_on_this_ranks_rows_when_replicated():
    """``var_mean`` (a post-grad LayerNorm) and its getitems keep the rows sharded; its tuple-valued meta is read."""

    def fn(x, a, w_o, g, b, w_q):
        h = aten.add.Tensor(x, all_reduce(linear(a, w_o), group()))
        var, mean = aten.var_mean.correction(h, [2], correction=0, keepdim=True)
        n = aten.mul.Tensor(aten.sub.Tensor(h, mean), aten.rsqrt.default(aten.add.Tensor(var, 1e-5)))
        return linear(aten.add.Tensor(aten.mul.Tensor(n, g), b), w_q)

    args = (torch.randn(2, 8, 32), torch.randn(2, 8, 16), torch.randn(32, 16), torch.randn(32), torch.randn(32),
            torch.randn(24, 32))
    gm = split_ar(trace(fn, *args), assume_replicated=True)
    assert fused("all_reduce_split") == 1
    (vm,) = nodes(gm, aten.var_mean.correction)
    assert vm.args[0].meta["val"].shape == (8, 32) and [t.shape for t in vm.meta["val"]] == [(8, 1), (8, 1)]
    (ag,) = nodes(gm, c10d.all_gather_into_tensor.default)
    assert ag.args[0].meta["val"].shape == (8, 32)
    assert_all_vals(gm)
    run_passes(gm)
    assert count(gm, MM_RS) == 1 and count(gm, AG_MM) == 1


def test_all_reduce_split_respects_the_group_restriction():
    gm = split_ar(trace(tp_residual_block(group()), *_tp_block_args()), allowed=lambda name: False)
    assert count(gm, c10d.all_reduce.default) == 1
    assert skipped("all_reduce_split") == {"group not allowed": 1}


def test_split_all_reduce_setting(flux_settings):
    """The per-compile option, its process-wide default and their values; each value its own cache key."""
    from fluxinductor import settings
    from fluxinductor.passes import FluxPassManager

    assert FluxPassManager().split_all_reduce == "exact"
    for value, mode in (("", "off"), ("0", "off"), ("1", "exact"), ("exact", "exact"), ("replicated", "replicated"),
                        ("off", "off")):
        flux_settings(split_all_reduce=value)
        assert settings.current.split_all_reduce == mode and FluxPassManager().split_all_reduce == mode
        assert FluxPassManager(split_all_reduce="exact").split_all_reduce == "exact"  # the option wins
    with pytest.raises(ValueError, match="split_all_reduce='sometimes': expected one of exact, replicated, off"):
        flux_settings(split_all_reduce="sometimes")
    with pytest.raises(ValueError, match=r"options\['split_all_reduce'\]='sometimes'"):
        FluxPassManager(split_all_reduce="sometimes")
    uuids = {FluxPassManager(split_all_reduce=mode).uuid() for mode in ("off", "exact", "replicated")}
    assert len(uuids) == 3


def test_all_reduce_split_symbolic_rows_become_one_matmul_all_reduce():
    """Dynamic shapes: the rows may not split over the group, so nothing is sharded; the all-reduce of a biased
    row-parallel linear becomes one matmul_all_reduce, which decides at run time."""
    def fn(a, w, b):
        return aten.add.Tensor(all_reduce(aten.addmm.default(b, aten.reshape.default(a, [-1, 16]),
                                                             aten.permute.default(w, [1, 0])), group()), 1.0)

    gm = _trace_dynamic(fn, (torch.randn(6, 16), torch.randn(32, 16), torch.randn(32)), 0)
    assert not isinstance(nodes(gm, c10d.all_reduce.default)[0].args[0].meta["val"].shape[0], int)
    shape_env = m_val(gm).shape_env
    guards_before = len(shape_env.guards)
    split_ar(gm)
    assert len(shape_env.guards) == guards_before  # nothing assumed about the rows
    assert fused("all_reduce_split") == 1
    (op,) = nodes(gm, torch.ops.fluxinductor.matmul_all_reduce.default)
    assert op.args[3:] == ("sum", group()) and op.args[2].op == "placeholder"  # the bias
    assert count(gm, c10d.all_reduce.default) == 0 and count(gm, c10d.reduce_scatter_tensor.default) == 0
    assert count(gm, aten.addmm.default) == 0
    assert_all_vals(gm)


def test_all_reduce_split_symbolic_rows_not_a_matmul_are_left_alone():
    def fn(x):
        return all_reduce(aten.mul.Tensor(x, 2.0), group())

    gm = split_ar(_trace_dynamic(fn, (torch.randn(6, 16),), 0))
    assert count(gm, c10d.all_reduce.default) == 1
    assert skipped("all_reduce_split") == {"reduce_scatter input is not a matmul": 1}
