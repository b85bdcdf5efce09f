"""Graph builders and inspectors for the graph-pass tests (tests/passes/; tests/ops/test_noise.py reuses them).

As PyTorch's test/distributed/tensor/parallel/test_micro_pipeline_tp.py does, graphs are traced with
``make_fx(tracing_mode="fake")`` on a fake process group of 2 ranks (:func:`fake_world`), so no communication
happens.  The builders call the same aten / _c10d_functional ops, in the same forms, as the post-grad graphs
inductor produced for DTensor sequence-parallel MLP and attention blocks (forward and backward), funcol and plain
``dist`` collectives (see passes/README.md).

The numeric tests run a graph traced for a 1-rank gloo group (``WORLD1_GROUP``), where every collective is the
identity, before and after the rewrite on random data (:func:`numeric_case`): that checks the wiring and reshapes
with no communication.  Multi-rank numerics through torch.compile are in tests/compile/test_compile_*.py.
"""

from __future__ import annotations

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


def sum_of_matmuls(world, name, scatter_dim, lead=(2, 8)):
    """Backward of separate Q/K/V (or gate/up) linears: the input gradient is a sum of mms, written as
    inductor leaves it: ``addmm(mm(a1, w1), a2, w2)`` (its mm + add folding) plus a reshaped 3-D add ([*lead, N])."""

    def fn(a1, a2, a3, w1, w2, w3):
        two = aten.addmm.default(aten.mm.default(a1, w1), a2, w2)  # [B*S, N]
        shape = list(lead) + [w1.shape[1]]
        three = aten.add.Tensor(aten.reshape.default(two, shape), aten.reshape.default(aten.mm.default(a3, w3), shape))
        return reduce_scatter(three, scatter_dim, world, name)

    return fn


def sum_of_matmuls_args(ks=(8, 8, 4), rows=16, n=16):
    return (*(torch.randn(rows, k) for k in ks), *(torch.randn(k, n) for k in ks))


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


def tp_block_args():
    return (torch.randn(2, 8, 32), torch.randn(2, 8, 16), torch.randn(32, 16), torch.randn(32), torch.randn(24, 32))


# ------------------------------------------------------------------------------------------------
# Tracing, running the passes, inspecting the result.
# ------------------------------------------------------------------------------------------------


def trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _symbolic(fake_mode, t: torch.Tensor, dynamic_dims=()) -> torch.Tensor:
    """A FakeTensor of ``t`` whose ``dynamic_dims`` are symbolic (the others static), as dynamo marks them."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    dims = [DimDynamic.DYNAMIC if i in dynamic_dims else DimDynamic.STATIC for i in range(t.dim())]
    return fake_mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))


def trace_dynamic(fn, args, gather_dim, dynamic_dims=None):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    dims = {gather_dim} if dynamic_dims is None else dynamic_dims
    fakes = [_symbolic(fake_mode, args[0], dims)] + [_symbolic(fake_mode, a) for a in args[1:]]
    return make_fx(fn, tracing_mode="fake")(*fakes)


def graph_fake_mode(gm):
    """The fake mode of a traced graph."""
    from fluxinductor.passes._match import fake_mode_of

    return fake_mode_of(gm.graph)


def run_passes(gm, allowed=lambda name: True):
    """The pass manager's order: all_gather_matmul, then matmul_reduce_scatter."""
    fuse_all_gather_matmul(gm.graph, allowed)
    fuse_matmul_reduce_scatter(gm.graph, allowed)
    gm.graph.lint()
    gm.recompile()
    return gm


def split_ar(gm, assume_replicated=False, allowed=lambda name: True):
    from fluxinductor.passes.all_reduce_split import split_all_reduce

    split_all_reduce(gm.graph, allowed, assume_replicated=assume_replicated)
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


def numeric_case(fn, args):
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
