"""The all_reduce -> reduce_scatter + all_gather split (passes/all_reduce_split.py): exact and replicated modes,
what is left alone, the group restriction and symbolic rows (graph builders: tests/_pass_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from _pass_graphs import (
    AG_MM,
    MM_RS,
    WORLD,
    all_reduce,
    assert_all_vals,
    aten,
    back_through_views,
    c10d,
    count,
    fused,
    graph_fake_mode,
    group,
    linear,
    nodes,
    rms_norm,
    run_passes,
    skipped,
    split_ar,
    tp_block_args,
    tp_residual_block,
    trace,
    trace_dynamic,
)
from fluxinductor.log import rewrite_stats


def test_all_reduce_split_exact_fuses_the_reduce_scatter_and_slices_nothing():
    gm = trace(tp_residual_block(group()), *tp_block_args())
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
    gm = trace(tp_residual_block(group()), *tp_block_args())
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

    args = tp_block_args() + (torch.randn(24, 32),)
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

    def veto_all_gather_matmul(op, device, world, m, k, n, dtype, weight=None, replaces_all_reduce=False):
        asked.append((op, world, m, k, n))
        return "sequential here" if op == "all_gather_matmul" else None

    gm = trace(tp_residual_block(group()), *tp_block_args())
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
    gm = split_ar(trace(tp_residual_block(group()), *tp_block_args()), allowed=lambda name: False)
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

    gm = trace_dynamic(fn, (torch.randn(6, 16), torch.randn(32, 16), torch.randn(32)), 0)
    assert not isinstance(nodes(gm, c10d.all_reduce.default)[0].args[0].meta["val"].shape[0], int)
    shape_env = graph_fake_mode(gm).shape_env
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

    gm = split_ar(trace_dynamic(fn, (torch.randn(6, 16),), 0))
    assert count(gm, c10d.all_reduce.default) == 1
    assert skipped("all_reduce_split") == {"reduce_scatter input is not a matmul": 1}


def _one_shot_veto(one_shot_reason=None):
    """A GPU-like veto: the split is vetoed (decode sizes: the added all-gather costs more than the fused half saves),
    and the whole all-reduce as matmul_all_reduce is worth it unless ``one_shot_reason``."""
    asked = []

    def veto(op, device, world, m, k, n, dtype, weight=None, replaces_all_reduce=False):
        asked.append((op, world, m, k, n, dtype, replaces_all_reduce))
        if op == "matmul_all_reduce":
            return one_shot_reason
        return "split_all_reduce_veto: the added all-gather costs more" if replaces_all_reduce else None

    return veto, asked


def _row_parallel(rows):
    def fn(a, w, b):
        return aten.add.Tensor(all_reduce(aten.addmm.default(b, a, aten.permute.default(w, [1, 0])), group()), 1.0)

    return trace(fn, torch.randn(rows, 16), torch.randn(32, 16), torch.randn(32))


@pytest.mark.parametrize("rows", [4, 3], ids=["split_vetoed", "rows_do_not_split"])
def test_all_reduce_split_kept_whole_as_matmul_all_reduce_where_the_one_shot_kernel_could_run(rows):
    """Where the split is out (vetoed, or the rows do not split over the group) but the one-shot kernel could run, the
    all-reduce becomes one matmul_all_reduce (which chooses one-shot or sequential per call); asked with the global
    GEMM shape."""
    from fluxinductor.passes.all_reduce_split import split_all_reduce

    gm = _row_parallel(rows)
    veto, asked = _one_shot_veto()
    assert split_all_reduce(gm.graph, lambda name: True, veto) == 1
    gm.graph.lint()
    assert ("matmul_all_reduce", WORLD, rows, WORLD * 16, 32, torch.float32, False) in asked
    assert fused("all_reduce_split") == 1 and skipped("all_reduce_split") == {}
    (op,) = nodes(gm, torch.ops.fluxinductor.matmul_all_reduce.default)
    assert op.args[3:] == ("sum", group()) and op.args[2].op == "placeholder"  # the bias
    assert op.meta["val"].shape == (rows, 32)
    assert count(gm, c10d.all_reduce.default) == 0 and count(gm, c10d.reduce_scatter_tensor.default) == 0
    assert count(gm, c10d.all_gather_into_tensor.default) == 0 and count(gm, aten.addmm.default) == 0
    assert_all_vals(gm)


@pytest.mark.parametrize("rows", [4, 3], ids=["split_vetoed", "rows_do_not_split"])
def test_all_reduce_split_left_alone_where_neither_the_split_nor_the_one_shot_kernel_runs(rows):
    from fluxinductor.passes.all_reduce_split import split_all_reduce

    gm = _row_parallel(rows)
    veto, _ = _one_shot_veto("no one-shot all-reduce on cpu")
    assert split_all_reduce(gm.graph, lambda name: True, veto) == 0
    assert count(gm, c10d.all_reduce.default) == 1 and count(gm, aten.addmm.default) == 1
    assert count(gm, torch.ops.fluxinductor.matmul_all_reduce.default) == 0
    expected = "not worth fusing here" if rows == 4 else "rows do not split over the group"
    assert skipped("all_reduce_split") == {expected: 1}


def test_all_reduce_split_still_splits_where_the_split_pays():
    """The one-shot question is asked only where the split is out: a split that pays is taken as before."""
    from fluxinductor.passes.all_reduce_split import split_all_reduce

    gm = _row_parallel(4)
    asked = []

    def veto(op, *args, **kwargs):
        asked.append(op)
        return None

    assert split_all_reduce(gm.graph, lambda name: True, veto) == 1
    assert "matmul_all_reduce" not in asked
    assert count(gm, c10d.reduce_scatter_tensor.default) == 1
    assert count(gm, torch.ops.fluxinductor.matmul_all_reduce.default) == 0


def test_manager_offers_matmul_all_reduce_only_where_the_one_shot_kernel_could_run(flux_settings, monkeypatch):
    """The pass manager's answer for op "matmul_all_reduce": never on CPU or under the decomposed dispatch; under auto
    only in a graph captured in CUDA graphs, for a static output small enough for the one-shot kernel; under the
    fused dispatch on a GPU where the fused kernels run, wherever the one-shot kernel takes the dtype, world and N (a
    row a multiple of 16 bytes)."""
    from fluxinductor import dispatch
    from fluxinductor.kernels import one_shot
    from fluxinductor.passes import FluxPassManager

    cuda = torch.device("cuda", 0)
    ask = lambda manager, device, n=8192, dtype=torch.bfloat16, world=2: manager.not_worth_fusing(  # noqa: E731
        "matmul_all_reduce", device, world, 64, 28672, n, dtype)
    flux_settings(dispatch="auto")
    assert "cpu" in ask(FluxPassManager(), torch.device("cpu"))
    monkeypatch.setattr(dispatch, "_local_reason", lambda index: None)
    monkeypatch.setattr(one_shot, "_extension", lambda: object())
    assert "outside CUDA graphs under FLUXINDUCTOR_DISPATCH=auto" in ask(FluxPassManager(), cuda)
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        assert ask(FluxPassManager(), cuda) is None
        assert "outside CUDA graphs" in ask(FluxPassManager(cuda_graphs=False), cuda)
        big = one_shot.FUSED_MAX_REMOTE_BYTES // (8192 * 2) + 1  # rows past the one-shot kernel's size
        assert "not known to be small enough" in FluxPassManager().not_worth_fusing(
            "matmul_all_reduce", cuda, 2, big, 28672, 8192, torch.bfloat16)
        assert "symbolic" in FluxPassManager().not_worth_fusing(
            "matmul_all_reduce", cuda, 2, None, 28672, 8192, torch.bfloat16)
        assert "world size 16" in ask(FluxPassManager(), cuda, n=256, world=16)
    flux_settings(dispatch="fused")
    manager = FluxPassManager()
    assert ask(manager, cuda) is None
    assert ask(manager, cuda, n=8200) is None  # 16400 bytes a row
    assert "multiple of 16" in ask(manager, cuda, n=4100)
    assert ask(manager, cuda, n=4100, dtype=torch.float32) is None
    assert "takes bf16, fp16 or fp32" in ask(manager, cuda, dtype=torch.float64)
    assert "world size 16" in ask(manager, cuda, world=16)
    from fluxinductor.kernels import peers

    monkeypatch.setattr(peers, "identity", lambda device: peers.Identity("host", "0000:1b:00.0"))
    monkeypatch.setattr(peers, "nvml_nvlink_peers", lambda bus: (0, "NVLink peers: 0 of 7 other GPUs"))
    assert "no NVLink peer" in ask(manager, cuda)
    monkeypatch.setattr(peers, "nvml_nvlink_peers", lambda bus: (None, "no NVML"))
    assert ask(manager, cuda) is None  # NVML cannot tell: the group's run-time check decides
    monkeypatch.setattr(peers, "nvml_nvlink_peers", lambda bus: (7, "NVLink peers: 7 of 7 other GPUs"))
    assert ask(manager, cuda) is None
    monkeypatch.setattr(peers, "nvml_nvlink_peers", lambda bus: (0, "NVLink peers: 0 of 7 other GPUs"))
    flux_settings(dispatch="fused", assume_nvlink=True)
    assert ask(FluxPassManager(), cuda) is None  # FLUXINDUCTOR_ASSUME_NVLINK=1 skips NVML
    flux_settings(dispatch="fused")
    monkeypatch.setattr(dispatch, "_local_reason", lambda index: "built for sm_90a")
    assert ask(manager, cuda) == "built for sm_90a"
    flux_settings(dispatch="decomposed")
    assert "decomposed" in ask(FluxPassManager(), cuda)
