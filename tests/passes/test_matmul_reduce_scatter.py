"""The matmul -> reduce_scatter rewrite (passes/matmul_reduce_scatter.py) on traced post-grad graph forms: single
matmuls, sums of matmuls (one op over the concatenated K) and autocast's fp32 reductions of half-precision matmuls.

Each test asserts the match count, which ops are present before and absent after, ``meta['val']`` of the new nodes
and the skip reasons (graph builders: tests/_pass_graphs.py).
"""

from __future__ import annotations

import pytest
import torch

from _pass_graphs import (
    MM_RS,
    WORLD,
    WORLD1_GROUP,
    assert_all_vals,
    aten,
    c10d,
    count,
    fuse_all_gather_matmul,
    fuse_matmul_reduce_scatter,
    fused,
    group,
    linear,
    nodes,
    numeric_case,
    reduce_scatter,
    rows_first_source,
    run_passes,
    skipped,
    sum_of_matmuls,
    sum_of_matmuls_args,
    trace,
)


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


@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_numerics_reduce_scatter_world1(scatter_dim):
    torch.manual_seed(3)

    def fn(h, w, b):
        y = linear(h, w, b)
        out = reduce_scatter(y, scatter_dim, 1, WORLD1_GROUP)
        return out * 2, out.sum()

    numeric_case(fn, (torch.randn(3, 4, 32), torch.randn(16, 32), torch.randn(16)))


# ------------------------------------------------------------------------------------------------
# Sums of matmuls: one op over the concatenated K.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_reduce_scatter_of_sum_of_matmuls(scatter_dim):
    """sum_i a_i @ w_i -> reduce_scatter becomes one op on cat(a_i, 1) and cat(w_i, 0)."""
    gm = trace(sum_of_matmuls(WORLD, group(), scatter_dim), *sum_of_matmuls_args())
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


@pytest.mark.parametrize("scatter_dim,lead", [(0, (16, 1)), (1, (1, 16)), (1, (2, 8)), (1, (2, 4 * 128))])
def test_reduce_scatter_of_sum_as_k_slabs(scatter_dim, lead):
    """A sum whose terms' K (per rank) are multiples of the split GEMMs' tile K, all but the last, becomes one op
    that gets the terms as they are (its K slabs: ``more_a``, ``more_weights``): no operand concatenated, the weights
    the graph's own, each operand reshaped (and, rows-first, permuted) as a single operand would be.  At B > 1 with
    whole 128-row tiles per rank (the last case) every operand goes batch-major, as it is, scattered on dim 1."""
    ks = (64, 64, 8)
    rows = lead[0] * lead[1]
    gm = trace(sum_of_matmuls(WORLD, group(), scatter_dim, lead), *sum_of_matmuls_args(ks, rows=rows))
    run_passes(gm)
    assert fused("matmul_reduce_scatter") == 1
    assert count(gm, aten.cat.default) == 0 and count(gm, aten.add.Tensor) == 0
    assert count(gm, aten.mm.default) == 0 and count(gm, aten.addmm.default) == 0
    (node,) = nodes(gm, MM_RS)
    operands = [node.args[0]] + list(node.kwargs["more_a"])
    weights = [node.args[1]] + list(node.kwargs["more_weights"])
    assert [w.op for w in weights] == ["placeholder"] * 3
    assert [tuple(w.meta["val"].shape) for w in weights] == [(k, 16) for k in ks]
    assert [o.meta["val"].shape[-1] for o in operands] == list(ks)
    if lead == (2, 8):
        assert rows_first_source(operands[1], [1, 0, 2], 64).meta["val"].shape == (2, 8, 64)
        assert node.args[4] == 0
    if lead == (2, 512):  # batch-major: no permute anywhere, the result the graph's [B, S/w, N]
        assert [tuple(o.meta["val"].shape) for o in operands] == [(2, 512, k) for k in ks]
        assert node.args[4] == 1 and tuple(node.meta["val"].shape) == (2, 512 // WORLD, 16)
        assert count(gm, aten.permute.default) == 0
    assert tuple(node.meta["val"].shape[-1:]) == (16,)
    assert_all_vals(gm)


def test_sum_left_to_other_forms_where_the_split_transport_is_not_wanted():
    """``sum_as_slabs`` is asked for a slab-shaped sum (the global shape, the terms' K together); where it says no (the
    cost model prefers another transport, which the K slabs cannot run) the sum takes the concatenated form."""
    asked = []

    def sum_as_slabs(device, world, m, k, n, dtype):
        asked.append((device.type, world, m, k, n, dtype))
        return False

    gm = trace(sum_of_matmuls(WORLD, group(), 0, (16, 1)), *sum_of_matmuls_args((64, 64, 8)))
    fuse_matmul_reduce_scatter(gm.graph, lambda name: True, sum_as_slabs=sum_as_slabs)
    (node,) = nodes(gm, MM_RS)
    assert node.args[1].target == aten.cat.default and not node.kwargs.get("more_a")
    assert asked == [("cpu", WORLD, 16, WORLD * (64 + 64 + 8), 16, torch.float32)]


@pytest.mark.parametrize("choice,slabs", [("fused_split", True), ("sequential", True), ("fused", False),
                                          ("fused_copy", False), ("asynctp", False)])
def test_manager_takes_k_slabs_where_the_cost_model_picks_the_split_transport(monkeypatch, choice, slabs):
    """The pass manager's answer on a GPU under ``auto``: K slabs where the cost model picks the split transport for
    the concatenated shape (or nothing: the op then decomposes either way), another form where it picks another
    overlapped path; elsewhere (CPU) K slabs."""
    from fluxinductor import cost_model
    from fluxinductor.passes.manager import FluxPassManager

    seen = []

    def decide(op, name, world, m, k, n, dtype, paths):
        seen.append((op, name, world, m, k, n))
        return cost_model.Decision(choice, "test", False)

    monkeypatch.setattr(cost_model, "decide", decide)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    manager = FluxPassManager()
    manager.dispatch_mode = "auto"
    assert manager.sum_as_slabs(torch.device("cuda", 0), 2, 1024, 2 * 8192, 8192, torch.bfloat16) is slabs
    assert seen == [("matmul_reduce_scatter", "NVIDIA H200", 2, 1024, 2 * 8192, 8192)]
    assert manager.sum_as_slabs(torch.device("cpu"), 2, 1024, 2 * 8192, 8192, torch.bfloat16)


@pytest.mark.parametrize("scatter_dim,lead", [(0, (16, 1)), (1, (2, 8))])
def test_numerics_sum_as_k_slabs_world1(scatter_dim, lead):
    torch.manual_seed(6)
    numeric_case(sum_of_matmuls(1, WORLD1_GROUP, scatter_dim, lead), sum_of_matmuls_args((64, 128, 72)))


def test_sum_not_slab_shaped_stays_concatenated():
    """K slabs need every term's K but the last a multiple of 64 and N a multiple of 8; a sum of three terms at most;
    otherwise the sum is concatenated as before."""
    for ks, n in (((64, 72, 64), 16), ((64, 64, 8), 12)):
        gm = trace(sum_of_matmuls(WORLD, group(), 0, (16, 1)), *sum_of_matmuls_args(ks, n=n))
        run_passes(gm)
        (node,) = nodes(gm, MM_RS)
        assert node.args[1].target == aten.cat.default and not node.kwargs.get("more_a")


def test_veto_sees_the_concatenated_weight_of_a_sum():
    """The veto gets the weight the fused op will be given: for a sum of matmuls, the concatenation of the weights
    along K (contiguous, N-major), as a meta tensor; the global shape counts every term's K."""
    gm = trace(sum_of_matmuls(WORLD, group(), 0), *sum_of_matmuls_args())
    seen = []

    def veto(op, device, world, m, k, n, dtype, weight=None):
        seen.append((op, m, k, n, tuple(weight.shape), weight.stride(), weight.device.type))
        return None

    fuse_matmul_reduce_scatter(gm.graph, lambda name: True, veto)
    assert seen == [("matmul_reduce_scatter", 16, WORLD * 20, 16, (20, 16), (16, 1), "meta")]
    assert fused("matmul_reduce_scatter") == 1


@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_reduce_scatter_of_sum_fused_per_term(scatter_dim):
    """Where ``sum_per_term`` says so, a sum becomes one op per term and the adds of their results (no cat), since
    rs(a1 @ w1 + a2 @ w2) == rs(a1 @ w1) + rs(a2 @ w2); the question carries the global shapes and the bytes the
    concatenation would copy (here every operand is a graph input)."""
    gm = trace(sum_of_matmuls(WORLD, group(), scatter_dim), *sum_of_matmuls_args())
    asked = []

    def per_term(device, world, m, ks, n, dtype, copied):
        asked.append((device.type, world, m, ks, n, dtype, copied))
        return True

    fuse_matmul_reduce_scatter(gm.graph, lambda name: True, sum_per_term=per_term)
    # a: 2 x [16, 8] + [16, 4], w: 2 x [8, 16] + [4, 16], fp32
    assert asked == [("cpu", WORLD, 16, [WORLD * 8, WORLD * 8, WORLD * 4], 16, torch.float32, 4 * (320 + 320))]
    assert fused("matmul_reduce_scatter") == 1
    ops = nodes(gm, MM_RS)
    assert len(ops) == 3 and count(gm, aten.cat.default) == 0
    assert [tuple(op.args[1].meta["val"].shape) for op in ops] == [(8, 16), (8, 16), (4, 16)]
    assert count(gm, aten.add.Tensor) == 2 and count(gm, c10d.reduce_scatter_tensor.default) == 0
    assert count(gm, aten.mm.default) == 0 and count(gm, aten.addmm.default) == 0
    assert_all_vals(gm)


def test_sum_stays_concatenated_where_a_term_alone_is_vetoed():
    gm = trace(sum_of_matmuls(WORLD, group(), 0), *sum_of_matmuls_args())

    def veto(op, device, world, m, k, n, dtype, weight=None):
        return "too small alone" if k < WORLD * 20 else None

    fuse_matmul_reduce_scatter(gm.graph, lambda name: True, veto, sum_per_term=lambda *args: True)
    (node,) = nodes(gm, MM_RS)
    assert node.args[1].target == aten.cat.default


@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_numerics_sum_fused_per_term_world1(scatter_dim):
    torch.manual_seed(5)
    fn, args = sum_of_matmuls(1, WORLD1_GROUP, scatter_dim), sum_of_matmuls_args()
    rewritten = trace(fn, *args)
    fuse_matmul_reduce_scatter(rewritten.graph, lambda name: True, sum_per_term=lambda *a: True)
    rewritten.recompile()
    assert count(rewritten, MM_RS) == 3
    expected, got = trace(fn, *args)(*args), rewritten(*args)
    assert expected.shape == got.shape and ((got - expected).norm() / expected.norm()).item() < 1e-5


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


@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_numerics_sum_of_matmuls_world1(scatter_dim):
    torch.manual_seed(4)
    numeric_case(sum_of_matmuls(1, WORLD1_GROUP, scatter_dim), sum_of_matmuls_args())


def test_reduce_scatter_of_sum_of_matmuls_can_be_turned_off():
    gm = trace(sum_of_matmuls(WORLD, group(), 0), *sum_of_matmuls_args())
    fuse_all_gather_matmul(gm.graph, lambda name: True)
    fuse_matmul_reduce_scatter(gm.graph, lambda name: True, fuse_sums=False)
    assert fused("matmul_reduce_scatter") == 0
    assert skipped("matmul_reduce_scatter") == {"sum of matmuls (fuse_matmul_sums=False)": 1}
    assert count(gm, c10d.reduce_scatter_tensor.default) == 1


# ------------------------------------------------------------------------------------------------
# Autocast: a half-precision matmul reduced in fp32 (out_dtype).
# ------------------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduce_scatter_of_a_slab_shaped_upcast_sum(dtype):
    """An upcast sum whose terms fit the K slabs (first K a multiple of 64, N-major weights): at two ranks from bf16
    the split transport writes the fp32 result, so the op gets the terms as its slabs with out_dtype=float32; from
    fp16 (which the split GEMMs write in fp16 only) the sum stays concatenated."""
    args = (torch.randn(8, 64, dtype=dtype), torch.randn(64, 16, dtype=dtype),
            torch.randn(8, 72, dtype=dtype), torch.randn(72, 16, dtype=dtype))
    gm = trace(_reduce_scatter_of_upcast_sum, *args)
    original = trace(_reduce_scatter_of_upcast_sum, *args)
    run_passes(gm)
    (op,) = nodes(gm, MM_RS)
    if dtype == torch.bfloat16:
        assert op.kwargs["out_dtype"] == torch.float32 and len(op.kwargs["more_a"]) == 1
        assert count(gm, aten.cat.default) == 0
    else:
        assert op.args[6] == torch.float32 and op.args[1].target == aten.cat.default
    assert op.meta["val"].dtype == torch.float32
    assert_all_vals(gm)
    got, expected = gm(*args), original(*args)
    exact = (args[0].double() @ args[1].double() + args[2].double() @ args[3].double())[:8 // WORLD]
    assert got.dtype == torch.float32
    for result in (got, expected):  # each within a rounding of the exact sum to the operands' dtype
        assert ((result.double() - exact).norm() / exact.norm()).item() < 4e-3


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
