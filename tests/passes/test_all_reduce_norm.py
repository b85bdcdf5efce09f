"""The matmul_all_reduce -> residual add -> RMSNorm rewrite (passes/all_reduce_norm.py): both norm forms (Hugging
Face's Llama casts before the weight, ``F.rms_norm`` after it), 2-D and 3-D graphs, what is left alone and why, and
the pass manager's call.

The graphs hold a ``fluxinductor.matmul_all_reduce`` as all_reduce_split leaves it and are traced for the 1-rank gloo
group of tests/_pass_graphs.py, so the original and the rewritten graph both run (the op's reference paths) and their
``h`` and normed outputs are compared.
"""

from __future__ import annotations

import collections

import pytest
import torch

from _pass_graphs import WORLD1_GROUP, assert_all_vals, aten, count, fused, nodes, skipped, trace
from fluxinductor.passes.all_reduce_norm import PATTERN, fuse_all_reduce_rms_norm

MAR = torch.ops.fluxinductor.matmul_all_reduce.default
FUSED = torch.ops.fluxinductor.matmul_all_reduce_rms_norm.default
CONVERT = torch.ops.prims.convert_element_type.default
B, S, K, N = 2, 4, 16, 32
EPS = 1e-6


def rms_norm(h, g, dtype, after_cast, weight_first, eps=EPS, dim=-1, keepdim=True, extra=None):
    """The RMSNorm of ``h`` as the post-grad graph writes it.  ``extra`` (a list): the intermediates are appended
    to it by name, for a test to return one as a second reader."""
    hf = CONVERT(h, torch.float32)
    sq = aten.pow.Tensor_Scalar(hf, 2)
    ms = aten.mean.dim(sq, [dim], keepdim)
    if not keepdim:
        ms = aten.unsqueeze.default(ms, -1)
    rs = aten.rsqrt.default(aten.add.Tensor(ms, eps))
    x = aten.mul.Tensor(hf, rs)
    if extra is not None:
        extra.update(upcast=hf, pow=sq, rsqrt=rs, mul=x)
    if after_cast:  # Hugging Face's Llama: (x.to(dtype)) * g
        xc = CONVERT(x, dtype)
        return aten.mul.Tensor(g, xc) if weight_first else aten.mul.Tensor(xc, g)
    # F.rms_norm: (x * g).to(dtype)
    return CONVERT(aten.mul.Tensor(g, x) if weight_first else aten.mul.Tensor(x, g), dtype)


def block(shape="2d", bias=True, residual_first=False, weight_first=False, after_cast=True, out_dtype=None,
          returned=(), **norm):
    """matmul_all_reduce (-> views) -> h = y + r -> RMSNorm; returns (h, normed, *the intermediates named in
    ``returned``: "y", "pow", "rsqrt", ...)."""

    def fn(a, w, b, r, g):
        kwargs = {} if out_dtype is None else {"out_dtype": out_dtype}
        y = MAR(a, w, b if bias else None, "sum", WORLD1_GROUP, **kwargs)
        v = y
        if shape == "3d_view":  # [B*S, N] -> [B, S, N]
            v = aten.view.default(y, [B, S, N])
        elif shape == "3d_views":  # a chain of views ending in [B, S, N]
            v = aten.reshape.default(aten.view.default(aten._unsafe_view.default(y, [B, S, N]), [B * S, N]),
                                     [B, S, N])
        h = aten.add.Tensor(r, v) if residual_first else aten.add.Tensor(v, r)
        extra = {"y": y}
        out = rms_norm(h, g, h.dtype, after_cast, weight_first, extra=extra, **norm)
        return (h, out) + tuple(extra[name] for name in returned)

    return fn


def block_args(shape="2d", dtype=torch.bfloat16, norm_dtype=None, residual_dtype=None):
    """Random non-zero inputs for :func:`block`: a [B*S, K] (or [B, S, K] for "3d_op"), w [K, N], b [N], the residual
    and the norm weight [N]."""
    gen = torch.Generator().manual_seed(0)
    lead = [B, S] if shape != "2d" else [B * S]
    a_lead = [B, S] if shape == "3d_op" else [B * S]

    def rand(*size, dt=dtype):
        return (torch.randn(*size, generator=gen) + 0.1).to(dt)

    return (rand(*a_lead, K), rand(K, N), rand(N), rand(*lead, N, dt=residual_dtype or dtype),
            rand(N, dt=norm_dtype or dtype))


def rewrite(gm) -> int:
    n = fuse_all_reduce_rms_norm(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return n


def op_counts(gm) -> collections.Counter:
    return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def assert_close(expected, got, dtype):
    tol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5
    for e, g in zip(expected, got):
        assert e.shape == g.shape and e.dtype == g.dtype
        assert ((g.float() - e.float()).norm() / e.float().norm()).item() < tol


def assert_rewritten(gm):
    assert count(gm, FUSED) == 1 and count(gm, MAR) == 0
    assert count(gm, aten.rsqrt.default) == 0 and count(gm, aten.pow.Tensor_Scalar) == 0
    assert count(gm, aten.mean.dim) == 0 and count(gm, aten.add.Tensor) == 0
    assert_all_vals(gm)


FLAGS = [  # (bias, residual_first, weight_first): every value of each flag, in 4 combinations
    (False, False, False), (True, True, False), (True, False, True), (False, True, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", ["2d", "3d_view", "3d_views", "3d_op"])
@pytest.mark.parametrize("after_cast", [True, False], ids=["llama", "F.rms_norm"])
@pytest.mark.parametrize("bias,residual_first,weight_first", FLAGS,
                         ids=["plain", "bias-residual_first", "bias-weight_first", "residual_first-weight_first"])
def test_rewrites_and_matches_the_graph(dtype, shape, after_cast, bias, residual_first, weight_first):
    fn = block(shape, bias, residual_first, weight_first, after_cast)
    args = block_args(shape, dtype)
    original, gm = trace(fn, *args), trace(fn, *args)
    assert count(original, MAR) == 1 and count(original, aten.rsqrt.default) == 1
    assert rewrite(gm) == 1
    assert fused(PATTERN) == 1 and skipped(PATTERN) == {}
    assert_rewritten(gm)
    (op,) = nodes(gm, FUSED)
    a, w, b, reduce_op, group, residual, g, eps, weight_after_cast = op.args
    assert (reduce_op, group, eps, weight_after_cast) == ("sum", WORLD1_GROUP, EPS, after_cast)
    assert isinstance(eps, float) and (b is not None) == bias
    assert [a.op, w.op, g.op] == ["placeholder"] * 3 and g.name == "g_1"
    # The residual the op gets has the op's output shape: the [B, S, N] one reshaped where the op's rows are flat.
    assert residual.meta["val"].shape == op.meta["val"][0].shape == a.meta["val"].shape[:-1] + (N,)
    if shape in ("3d_view", "3d_views"):
        assert residual.target == aten.reshape.default and residual.args[0].name == "r_1"
    else:
        assert residual.name == "r_1"
    h_val, out_val = (o.meta["val"] for o in original.graph.find_nodes(op="output")[0].args[0])
    for result, val in zip(gm.graph.find_nodes(op="output")[0].args[0], (h_val, out_val)):
        assert result.meta["val"].shape == val.shape and result.meta["val"].dtype == val.dtype == dtype
    assert_close(original(*args), gm(*args), dtype)


def test_fp16_rewritten():
    fn = block("3d_view")
    args = block_args("3d_view", torch.float16)
    gm = trace(fn, *args)
    assert rewrite(gm) == 1
    assert_rewritten(gm)
    assert_close(trace(fn, *args)(*args), gm(*args), torch.float16)


def test_f_rms_norm_eps_as_add_scalar_and_positive_mean_dim():
    """F.rms_norm's decomposition: the mean over dim ndim-1 and, functionalized, ``add.Scalar(mean, eps)``."""

    def fn(a, w, b, r, g):
        h = aten.add.Tensor(aten.view.default(MAR(a, w, b, "avg", WORLD1_GROUP), [B, S, N]), r)
        hf = CONVERT(h, torch.float32)
        rs = aten.rsqrt.default(aten.add.Scalar(aten.mean.dim(aten.pow.Tensor_Scalar(hf, 2), [2], True), 1e-5))
        return h, CONVERT(aten.mul.Tensor(aten.mul.Tensor(hf, rs), g), torch.bfloat16)

    args = block_args("3d_view")
    gm = trace(fn, *args)
    assert rewrite(gm) == 1
    assert count(gm, FUSED) == 1 and count(gm, MAR) == 0 and count(gm, aten.add.Scalar) == 0
    (op,) = nodes(gm, FUSED)
    assert op.args[3] == "avg" and op.args[7:] == (1e-5, False)
    assert_close(trace(fn, *args)(*args), gm(*args), torch.bfloat16)


def test_h_read_again_by_the_next_residual_add():
    """h feeds the next layer's residual add too: still rewritten, that add reads the op's h."""

    def fn(a, w, b, r, g, mlp):
        h = aten.add.Tensor(aten.view.default(MAR(a, w, b, "sum", WORLD1_GROUP), [B, S, N]), r)
        normed = rms_norm(h, g, torch.bfloat16, True, True)
        return aten.add.Tensor(h, aten.mul.Tensor(normed, mlp))

    args = block_args("3d_view") + (torch.randn(B, S, N).to(torch.bfloat16),)
    original, gm = trace(fn, *args), trace(fn, *args)
    assert rewrite(gm) == 1
    (op,) = nodes(gm, FUSED)
    (next_add,) = nodes(gm, aten.add.Tensor)
    h = next_add.args[0]
    assert h.target == aten.reshape.default and h.args[1] == [B, S, N] and h.args[0].args == (op, 0)
    normed = next_add.args[1].args[0]
    assert normed.target == aten.reshape.default and normed.args[0].args == (op, 1)
    assert_all_vals(gm)
    assert_close([original(*args)], [gm(*args)], torch.bfloat16)


def test_two_layers_chain():
    """Layer 2's residual is layer 1's h: both rewritten, layer 2's op reads layer 1's h."""

    def fn(a, w, b, r, g, a2, g2):
        h1, n1 = block("2d")(a, w, b, r, g)
        y2 = MAR(aten.add.Tensor(a2, aten.mul.Tensor(n1, 0.5)[:, :K]), w, b, "sum", WORLD1_GROUP)
        h2 = aten.add.Tensor(h1, y2)
        return h2, rms_norm(h2, g2, torch.bfloat16, False, False)

    args = block_args("2d") + (torch.randn(B * S, K).to(torch.bfloat16), torch.rand(N).to(torch.bfloat16) + 0.5)
    original, gm = trace(fn, *args), trace(fn, *args)
    assert rewrite(gm) == 2 and fused(PATTERN) == 2
    first, second = nodes(gm, FUSED)
    assert second.args[5].args == (first, 0)
    assert count(gm, MAR) == 0 and count(gm, aten.rsqrt.default) == 0
    assert_close(original(*args), gm(*args), torch.bfloat16)


def test_norm_weight_computed_after_the_add_moves_up():
    def fn(a, w, b, r, g):
        h = aten.add.Tensor(MAR(a, w, b, "sum", WORLD1_GROUP), r)
        g2 = aten.add.Tensor(aten.mul.Tensor(g, 2.0), 1.0)  # traced after h
        return h, rms_norm(h, g2, torch.bfloat16, True, False)

    args = block_args("2d")
    original, gm = trace(fn, *args), trace(fn, *args)
    order = [n.target for n in gm.graph.nodes]
    assert order.index(aten.mul.Tensor) > order.index(aten.add.Tensor)
    assert rewrite(gm) == 1
    (op,) = nodes(gm, FUSED)
    assert op.args[6].target == aten.add.Tensor and op.args[6].args[0].target == aten.mul.Tensor
    assert_close(original(*args), gm(*args), torch.bfloat16)


def test_strided_residual_is_made_contiguous():
    """The op's results are contiguous (its fake implementation); a transposed residual reaches it as a contiguous
    copy, so the op's unfused path (h = residual + reduced) lays h out as the graph was told."""

    def fn(a, w, b, r_t, g):
        h = aten.add.Tensor(MAR(a, w, b, "sum", WORLD1_GROUP), aten.permute.default(r_t, [1, 0]))
        return h, rms_norm(h, g, torch.bfloat16, False, True)

    a, w, b, r, g = block_args("2d")
    args = (a, w, b, r.t().contiguous(), g)
    original, gm = trace(fn, *args), trace(fn, *args)
    assert rewrite(gm) == 1
    (op,) = nodes(gm, FUSED)
    residual = op.args[5]
    assert residual.target == aten.clone.default and residual.args[0].target == aten.permute.default
    assert residual.meta["val"].is_contiguous()
    h, normed = gm(*args)
    assert h.is_contiguous() and normed.is_contiguous()
    assert_close(original(*args), (h, normed), torch.bfloat16)


def test_symbolic_rows_rewritten_without_guards():
    """Dynamic shapes: a symbolic sequence length.  The residual's reshape to the op's flat rows and the results'
    reshape back take -1 for it; no guard is added, and the graph is right at another length."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from _pass_graphs import _symbolic

    def fn(a, w, b, r, g):
        y = MAR(aten.reshape.default(a, [-1, K]), w, b, "sum", WORLD1_GROUP)
        h = aten.add.Tensor(aten.view.default(y, [a.shape[0], a.shape[1], N]), r)
        return h, rms_norm(h, g, torch.bfloat16, True, False)

    def args_of(seq):
        gen = torch.Generator().manual_seed(seq)
        return tuple((torch.randn(*size, generator=gen) + 0.1).to(torch.bfloat16)
                     for size in ((B, seq, K), (K, N), (N,), (B, seq, N), (N,)))

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    dims = ({1}, set(), set(), {1}, set())
    fakes = [_symbolic(fake_mode, t, d) for t, d in zip(args_of(4), dims)]
    original, gm = make_fx(fn, tracing_mode="fake")(*fakes), make_fx(fn, tracing_mode="fake")(*fakes)
    guards = len(fake_mode.shape_env.guards)
    assert rewrite(gm) == 1
    assert len(fake_mode.shape_env.guards) == guards
    (op,) = nodes(gm, FUSED)
    assert op.args[5].target == aten.reshape.default and op.args[5].args[1] == [-1, N]
    assert_all_vals(gm)
    for seq in (4, 6):
        args = args_of(seq)
        assert_close(original(*args), gm(*args), torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# Left alone.
# ---------------------------------------------------------------------------------------------------------------


NEGATIVE = {
    "upcast read twice": (dict(returned=("upcast",)), {}, "norm intermediate has other users"),
    "pow read twice": (dict(returned=("pow",)), {}, "norm intermediate has other users"),
    "rsqrt read twice": (dict(returned=("rsqrt",)), {}, "norm intermediate has other users"),
    "normalized read twice": (dict(returned=("mul",)), {}, "norm intermediate has other users"),
    "mean over dim 0": (dict(dim=0), {}, "mean over a dim other than the last"),
    "mean over dim 1 of 3": (dict(shape="3d_view", dim=1), dict(shape="3d_view"), "mean over a dim other than the last"),
    "keepdim False": (dict(keepdim=False, shape="3d_op"), dict(shape="3d_op"), "mean without keepdim"),
    "out_dtype float32": (dict(out_dtype=torch.float32), dict(residual_dtype=torch.float32),
                          "matmul_all_reduce with out_dtype"),
    "fp32 norm weight, llama": (dict(after_cast=True), dict(norm_dtype=torch.float32),
                                "norm output dtype differs from the residual sum"),
    "fp32 norm weight, F.rms_norm": (dict(after_cast=False), dict(norm_dtype=torch.float32),
                                     "norm weight is not a [N] vector in the residual's dtype"),
    "y read twice": (dict(returned=("y",)), {}, "matmul_all_reduce output has other users"),
}


@pytest.mark.parametrize("case", list(NEGATIVE))
def test_left_alone(case):
    build, arg_kw, reason = NEGATIVE[case]
    fn, args = block(**build), block_args(**arg_kw)
    gm = trace(fn, *args)
    before = op_counts(gm)
    assert rewrite(gm) == 0
    assert op_counts(gm) == before
    assert fused(PATTERN) == 0 and skipped(PATTERN) == {reason: 1}
    assert_close(trace(fn, *args)(*args), gm(*args), torch.bfloat16)


def test_residual_of_another_shape_or_dtype_left_alone():
    """A broadcasting add ([N] bias-like residual) or one promoting the dtype is no residual add of the op."""

    def fn(a, w, r, g):
        h = aten.add.Tensor(MAR(a, w, None, "sum", WORLD1_GROUP), r)
        return h, rms_norm(h, g, h.dtype, True, False)

    a, w, _, _, g = block_args("2d")
    for r, gg in ((torch.randn(N).to(torch.bfloat16), g), (torch.randn(B * S, N), g.float())):
        gm = trace(fn, a, w, r, gg)
        before = op_counts(gm)
        assert rewrite(gm) == 0 and op_counts(gm) == before
    assert skipped(PATTERN) == {"residual does not match the reduced tensor": 2}


def test_residual_add_with_alpha_left_alone():
    def fn(a, w, r, g):
        h = aten.add.Tensor(MAR(a, w, None, "sum", WORLD1_GROUP), r, alpha=2)
        return h, rms_norm(h, g, h.dtype, True, False)

    a, w, _, r, g = block_args("2d")
    gm = trace(fn, a, w, r, g)
    before = op_counts(gm)
    assert rewrite(gm) == 0 and op_counts(gm) == before
    assert skipped(PATTERN) == {"residual add with alpha": 1}


def test_unrelated_readers_left_alone_silently():
    """A matmul_all_reduce read by something other than a residual add and a norm is no candidate: nothing logged."""

    def fn(a, w, r):
        y = MAR(a, w, None, "sum", WORLD1_GROUP)
        return aten.relu.default(y), aten.add.Tensor(y, r)

    a, w, _, r, _ = block_args("2d")
    gm = trace(fn, a, w, r)
    assert rewrite(gm) == 0 and count(gm, MAR) == 1
    assert skipped(PATTERN) == {} and fused(PATTERN) == 0


def test_weightless_norm_left_alone():
    def fn(a, w, r):
        h = aten.add.Tensor(MAR(a, w, None, "sum", WORLD1_GROUP), r)
        hf = CONVERT(h, torch.float32)
        rs = aten.rsqrt.default(aten.add.Tensor(aten.mean.dim(aten.pow.Tensor_Scalar(hf, 2), [-1], True), EPS))
        return h, CONVERT(aten.mul.Tensor(hf, rs), torch.bfloat16)

    a, w, _, r, _ = block_args("2d")
    gm = trace(fn, a, w, r)
    assert rewrite(gm) == 0 and count(gm, MAR) == 1 and count(gm, aten.rsqrt.default) == 1
    assert list(skipped(PATTERN)) == ["not an RMSNorm"]


def test_possible_mutation_in_between_left_alone():
    def fn(a, w, b, r, g, buf):
        h = aten.add.Tensor(MAR(a, w, b, "sum", WORLD1_GROUP), r)
        aten.add_.Tensor(buf, 1.0)
        return h, rms_norm(h, g, torch.bfloat16, True, False), buf

    args = block_args("2d") + (torch.zeros(3),)
    gm = trace(fn, *args)
    before = op_counts(gm)
    assert rewrite(gm) == 0 and op_counts(gm) == before
    assert skipped(PATTERN) == {"possible mutation between the matmul_all_reduce and the norm": 1}


# ---------------------------------------------------------------------------------------------------------------
# The pass manager.
# ---------------------------------------------------------------------------------------------------------------


def test_manager_calls_the_pass_after_split_all_reduce(monkeypatch):
    import fluxinductor.passes.all_reduce_norm as all_reduce_norm
    import fluxinductor.passes.all_reduce_split as all_reduce_split
    from fluxinductor.passes import FluxPassManager

    calls = []
    real_split = all_reduce_split.split_all_reduce
    monkeypatch.setattr(all_reduce_split, "split_all_reduce",
                        lambda graph, *a, **kw: calls.append("split") or real_split(graph, *a, **kw))
    monkeypatch.setattr(all_reduce_norm, "fuse_all_reduce_rms_norm", lambda graph: calls.append(("norm", graph)) or 0)
    gm = trace(block("2d"), *block_args("2d"))
    FluxPassManager(split_all_reduce="exact")(gm.graph)
    assert calls == ["split", ("norm", gm.graph)]
    calls.clear()
    FluxPassManager(split_all_reduce="off")(gm.graph)
    assert calls == []


@pytest.mark.parametrize("mode", ["exact", "replicated", "off"])
def test_manager_fuses_a_matmul_all_reduce_in_the_graph(mode):
    """A graph that already holds a matmul_all_reduce (on GPUs all_reduce_split makes it; on CPU it never does): the
    manager's run rewrites it unless the split pass is off, and keeps the outputs' layouts."""
    from fluxinductor.passes import FluxPassManager

    fn, args = block("3d_view"), block_args("3d_view")
    original, gm = trace(fn, *args), trace(fn, *args)
    FluxPassManager(split_all_reduce=mode)(gm.graph)
    gm.recompile()
    if mode == "off":
        assert count(gm, FUSED) == 0 and count(gm, MAR) == 1
        return
    assert_rewritten(gm)
    assert fused(PATTERN) == 1
    assert_close(original(*args), gm(*args), torch.bfloat16)
