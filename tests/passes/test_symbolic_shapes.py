"""Both GEMM rewrites on graphs with symbolic sizes: a symbolic row (token or sequence) dim is fused with no new
guard and the rewritten graph is right at every size; a symbolic K or N is left alone with its reason."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

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
    fuse_all_gather_matmul,
    fuse_matmul_reduce_scatter,
    fused,
    graph_fake_mode,
    group,
    nodes,
    reduce_scatter,
    run_passes,
    skipped,
    trace_dynamic,
)
from fluxinductor.log import rewrite_stats


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


@pytest.mark.parametrize("gather_dim", [0, 1])
def test_symbolic_rows_fused(gather_dim):
    """Dynamic shapes: a symbolic token (or sequence) dim with static K and N is fused, the new nodes carry
    symbolic meta['val']s equal to what they replace, and no guard is added."""
    gm = trace_dynamic(sp_mlp_dynamic(WORLD, group(), gather_dim), _sp_mlp_dynamic_args(gather_dim, 4), gather_dim)
    outputs = [n for n in gm.graph.nodes if n.op == "output"][0]
    before = [tuple(m_.meta["val"].shape) for m_ in outputs.args[0]]
    shape_env = graph_fake_mode(gm).shape_env
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
    gm = trace_dynamic(sp_mlp_dynamic(WORLD, group(), gather_dim), _sp_mlp_dynamic_args(gather_dim, 4), gather_dim)
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


@pytest.mark.parametrize("gather_dim", [0, 1])
def test_numerics_symbolic_rows_world1(gather_dim):
    """One graph traced with a symbolic row dim, rewritten, then run at three sizes: the -1 reshapes the
    rewrite writes for symbolic sizes are right for each (1-rank gloo group: the collectives are identities)."""
    torch.manual_seed(4)
    fn = sp_mlp_dynamic(1, WORLD1_GROUP, gather_dim)
    original = trace_dynamic(fn, _sp_mlp_dynamic_args(gather_dim, 4), gather_dim)
    rewritten = run_passes(trace_dynamic(fn, _sp_mlp_dynamic_args(gather_dim, 4), gather_dim))
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

    original = trace_dynamic(fn, args(3, 4), 1, {0, 1})
    rewritten = run_passes(trace_dynamic(fn, args(3, 4), 1, {0, 1}))
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
