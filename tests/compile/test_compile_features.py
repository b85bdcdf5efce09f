"""End to end through ``torch.compile(backend="flux")``: the off switch, inductor's FX graph cache, inputs
the passes must leave alone, and fusion restricted to the tensor-parallel group of a 2-D mesh.

* ``FLUXINDUCTOR_DISABLE=1``: no fluxinductor op in the generated code, nothing fused, same numerics.
* FX graph cache: a second compile in fresh processes with the same ``TORCHINDUCTOR_CACHE_DIR`` is served
  from the cache (no pass runs, so nothing is counted as fused) and still calls the fused ops and gives
  the right answer; a compile under other fusion settings must not be served the fused graph.
* Bad inputs (uneven sequence shards, integer matmuls) compile, run correctly, and are logged as skips.
* Activation checkpointing: the recomputed forward in the backward graph is fused too.
* bf16 and fp16 autocast: the backward's fp32 reduce-scatter of a half-precision matmul is fused (``out_dtype``).
* 2x2 (dp, tp) mesh on 4 ranks: with the tp group set (``options={"tp_group": mesh["tp"]}`` or
  :func:`fluxinductor.set_tp_group`) only tp collectives are fused, the dp ones are skipped with a reason.
"""

from __future__ import annotations

import functools
import tempfile
import traceback
from typing import Dict, Optional

import pytest
import torch
import torch.nn as nn

from _codegen import check_rows_first_mlp
from _dist import run_ranks
from test_compile_numerics import (
    AG_MM,
    BATCH,
    CODE_CASE,
    HIDDEN,
    MLP,
    MM_RS,
    _numerics_results,
    _seeded_full,
    build_sp_mlp,
    check_errors,
    check_fused,
    error_of,
    run_case,
    stats_delta,
)


def _guarded(fn, *args) -> Dict[str, object]:
    """Run one check inside a rank; a failure becomes {"error": traceback} so the other checks still run."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}


def _assert_ok(result: Dict[str, object], where: str) -> None:
    assert "error" not in result, f"{where} raised:\n{result['error']}"


# ---------------------------------------------------------------------------------------------------
# FLUXINDUCTOR_DISABLE and the generated code.
# ---------------------------------------------------------------------------------------------------


def _code_job(rank: int, world: int) -> Dict[str, object]:
    """Compile the SP MLP (forward and backward) capturing inductor's generated code."""
    from torch._inductor.utils import run_and_get_code

    result, codes = run_and_get_code(run_case, rank, world, "sp_mlp", "fp32")
    result["code_mentions_fluxinductor"] = sum("fluxinductor" in code for code in codes)
    result["n_codes"] = len(codes)
    return result


@functools.lru_cache(maxsize=None)
def _code_results(disabled: bool):
    if not disabled:
        # The enabled compile is one of the numerics cases; it captures its code too (saves a job).
        assert CODE_CASE == ("sp_mlp", "fp32")
        return [per_rank[CODE_CASE] for per_rank in _numerics_results(2)]
    return run_ranks(_code_job, 2, env={"FLUXINDUCTOR_DISABLE": "1"}, timeout=300)


def test_enabled_code_calls_fused_ops():
    for rank, r in enumerate(_code_results(False)):
        where = f"enabled rank={rank}"
        _assert_ok(r, where)
        check_errors(r["errors"], "fp32", where)
        assert r["n_codes"] >= 2, f"{where}: expected forward and backward code, got {r['n_codes']}"
        assert r["code_mentions_fluxinductor"] >= 2, f"{where}: forward and backward code should call the fused ops"
        check_fused(r["forward"], {AG_MM: 1, MM_RS: 1}, where + " forward")
        check_fused(r["backward"], {AG_MM: 1, MM_RS: 1}, where + " backward")


def test_disable_env_compiles_plain_inductor():
    for rank, r in enumerate(_code_results(True)):
        where = f"FLUXINDUCTOR_DISABLE=1 rank={rank}"
        check_errors(r["errors"], "fp32", where)
        assert r["n_codes"] >= 2, f"{where}: expected forward and backward code, got {r['n_codes']}"
        assert r["code_mentions_fluxinductor"] == 0, f"{where}: generated code mentions fluxinductor"
        for phase in ("forward", "backward", "second_call"):
            nothing = {"fused": {}, "inserted": {}, "calls": {}, "skipped": {}}
            assert r[phase] == nothing, f"{where} {phase}: {r[phase]}"


# ---------------------------------------------------------------------------------------------------
# Inductor's FX graph cache.
# ---------------------------------------------------------------------------------------------------


# A model without DTensor: in torch 2.13 DTensor graphs take the DeviceMesh as an opaque graph input
# whose pickled form differs per process, so their FX graph cache keys never match across processes.
CACHE_MODEL = "funcol_swiglu"


def _cache_job(rank: int, world: int, restrict_to_other_group: bool) -> Dict[str, object]:
    import fluxinductor
    from torch._dynamo.utils import counters

    counters.clear()
    options = {"tp_group": "no-such-group"} if restrict_to_other_group else None
    try:
        result = run_case(rank, world, CACHE_MODEL, "fp32", compile_options=options)
    finally:
        fluxinductor.set_tp_group(None)
    result["inductor_counters"] = dict(counters["inductor"])
    result["aot_autograd_counters"] = dict(counters["aot_autograd"])
    return result


@functools.lru_cache(maxsize=None)
def _cache_results():
    """Three jobs over one cache dir: cold compile, warm compile, warm compile under another setting."""
    with tempfile.TemporaryDirectory(prefix="fluxinductor-cache-test-") as cache_dir:
        cold = run_ranks(_cache_job, 2, False, cache_dir=cache_dir, timeout=300)
        warm = run_ranks(_cache_job, 2, False, cache_dir=cache_dir, timeout=300)
        other = run_ranks(_cache_job, 2, True, cache_dir=cache_dir, timeout=300)
    return cold, warm, other


def test_fx_graph_cache_hit_still_runs_fused_ops():
    cold, warm, _ = _cache_results()
    for rank, (c, w) in enumerate(zip(cold, warm)):
        where = f"rank={rank}"
        check_errors(c["errors"], "fp32", where + " cold")
        check_fused(c["forward"], {AG_MM: 1, MM_RS: 1}, where + " cold forward")
        check_fused(c["backward"], {AG_MM: 1, MM_RS: 1}, where + " cold backward")
        assert c["inductor_counters"].get("fxgraph_cache_miss", 0) >= 2, f"{where}: cold {c['inductor_counters']}"
        assert c["inductor_counters"].get("fxgraph_cache_hit", 0) == 0, f"{where}: cold {c['inductor_counters']}"

        # Warm: served from the cache (forward and backward graphs), so no pass ran ...
        assert w["inductor_counters"].get("fxgraph_cache_hit", 0) >= 2, (
            f"{where}: warm compile missed the FX graph cache: {w['inductor_counters']} {w['aot_autograd_counters']}"
        )
        assert w["forward"]["fused"] == {} and w["backward"]["fused"] == {}, f"{where}: warm {w}"
        # ... yet the cached graphs call the fused ops, and the answer is right.
        for phase in ("forward", "backward"):
            for op in (AG_MM, MM_RS):
                assert w[phase]["calls"].get(op, 0) >= 1, f"{where} warm {phase}: {op} never called: {w[phase]}"
        check_errors(w["errors"], "fp32", where + " warm")


def test_fx_graph_cache_not_served_across_fusion_settings():
    _, _, other = _cache_results()
    for rank, o in enumerate(other):
        where = f"rank={rank} tp_group=no-such-group"
        check_errors(o["errors"], "fp32", where)
        for phase in ("forward", "backward"):
            assert o[phase]["fused"] == {}, f"{where} {phase}: fused outside the tp group: {o[phase]}"
            assert o[phase]["calls"] == {}, f"{where} {phase}: the cached fused graph was served: {o[phase]}"
            skipped = o[phase]["skipped"]
            assert any("group" in reason for reasons in skipped.values() for reason in reasons), (
                f"{where} {phase}: skips should name the group: {skipped}"
            )


# ---------------------------------------------------------------------------------------------------
# Inputs the passes must leave alone (or handle): correct results, logged skips.
# ---------------------------------------------------------------------------------------------------


def _uneven_sequence_case(rank: int, world: int) -> Dict[str, object]:
    """SP MLP on a DTensor whose sequence (9) does not divide over the ranks."""
    import fluxinductor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    torch._dynamo.reset()

    def build():
        torch.manual_seed(4)
        model = MLP()
        plan = {
            "w1": ColwiseParallel(input_layouts=Shard(1)),
            "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
        return parallelize_module(model, mesh, plan)

    eager_model, flux_model = build(), build()
    compiled = torch.compile(flux_model, backend="flux")
    full = _seeded_full((BATCH, 9, HIDDEN), 300)
    x_eager = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_(True)
    x_flux = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_(True)
    s0 = fluxinductor.rewrite_stats()
    y_eager, y_flux = eager_model(x_eager), compiled(x_flux)
    s1 = fluxinductor.rewrite_stats()
    grad = _seeded_full((BATCH, 9, HIDDEN), 301)
    (y_eager.full_tensor() * grad).sum().backward()
    (y_flux.full_tensor() * grad).sum().backward()
    s2 = fluxinductor.rewrite_stats()
    errors = {"out": error_of(y_flux.full_tensor(), y_eager.full_tensor())}
    errors["grad_input"] = error_of(x_flux.grad.full_tensor(), x_eager.grad.full_tensor())
    flux_params = dict(flux_model.named_parameters())
    for name, p in eager_model.named_parameters():
        errors[f"grad_{name}"] = error_of(flux_params[name].grad.full_tensor(), p.grad.full_tensor())
    return {"errors": errors, "forward": stats_delta(s1, s0), "backward": stats_delta(s2, s1)}


class IntegerMatmuls(nn.Module):
    """all_gather -> integer mm -> reduce_scatter, written with functional collectives."""

    def __init__(self, world: int, rank: int):
        super().__init__()
        g = torch.Generator().manual_seed(60)
        self.register_buffer("w1", torch.randint(-3, 4, (HIDDEN, 16), generator=g).chunk(world, dim=1)[rank].clone())
        self.register_buffer("w2", torch.randint(-3, 4, (16, HIDDEN), generator=g).chunk(world, dim=0)[rank].clone())

    def forward(self, x):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        gathered = funcol.all_gather_tensor(x, 0, dist.group.WORLD)  # [M, H] int64
        partial = (gathered @ self.w1) @ self.w2  # [M, H] int64
        return funcol.reduce_scatter_tensor(partial, "sum", 0, dist.group.WORLD)


def _integer_case(rank: int, world: int) -> Dict[str, object]:
    import fluxinductor

    torch._dynamo.reset()
    model = IntegerMatmuls(world, rank)
    g = torch.Generator().manual_seed(61)
    x = torch.randint(-5, 6, (4 * world, HIDDEN), generator=g).chunk(world)[rank].contiguous()
    expected = model(x)
    s0 = fluxinductor.rewrite_stats()
    got = torch.compile(model, backend="flux")(x)
    return {
        "exact": bool(torch.equal(got, expected)),
        "dtype": str(got.dtype),
        "nonzero": bool(expected.abs().sum() > 0),
        "forward": stats_delta(fluxinductor.rewrite_stats(), s0),
    }


def _bad_inputs_job(rank: int, world: int) -> Dict[str, object]:
    return {"uneven": _guarded(_uneven_sequence_case, rank, world), "integer": _guarded(_integer_case, rank, world)}


@functools.lru_cache(maxsize=None)
def _bad_inputs_results():
    return run_ranks(_bad_inputs_job, 2, timeout=300)


def test_uneven_sequence_shards_are_correct():
    for rank, per_rank in enumerate(_bad_inputs_results()):
        r = per_rank["uneven"]
        where = f"uneven sequence rank={rank}"
        _assert_ok(r, where)
        check_errors(r["errors"], "fp32", where)
        # Every all-gather / reduce-scatter the passes saw was either fused (correctly, checked above)
        # or skipped with a reason: at least one of the two must have been recorded in each phase.
        for phase in ("forward", "backward"):
            seen = sum(r[phase]["fused"].values()) + sum(sum(v.values()) for v in r[phase]["skipped"].values())
            assert seen >= 1, f"{where} {phase}: no fusion decision recorded: {r[phase]}"


def test_integer_matmul_is_skipped_and_exact():
    for rank, per_rank in enumerate(_bad_inputs_results()):
        r = per_rank["integer"]
        where = f"integer matmul rank={rank}"
        _assert_ok(r, where)
        assert r["nonzero"], f"{where}: test data is all zeros"
        assert r["exact"], f"{where}: compiled result differs from eager"
        assert r["dtype"] == "torch.int64"
        assert r["forward"]["fused"] == {}, f"{where}: integer matmuls were fused: {r['forward']}"
        reasons = [reason for reasons in r["forward"]["skipped"].values() for reason in reasons]
        assert any("floating" in reason for reason in reasons), f"{where}: expected a dtype skip, got {reasons}"
        assert {AG_MM, MM_RS} <= set(r["forward"]["skipped"]), f"{where}: {r['forward']}"


# ---------------------------------------------------------------------------------------------------
# [B, S, H] activations sharded on S with B > 1: the ops run rows-first, the layout change is fused away.
# ---------------------------------------------------------------------------------------------------


def _sp_block(mesh, checkpointed: bool = False) -> nn.Module:
    """``x + w2(gelu(w1(x)))`` with the MLP sequence-parallel on ``mesh`` (x: [B, S/world, H] sharded on S); the MLP
    under activation checkpointing when ``checkpointed``."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP()

        def mlp_out(self, x):
            return self.mlp.w2(F.gelu(self.mlp.w1(x)))

        def forward(self, x):
            return x + (checkpoint(self.mlp_out, x, use_reentrant=False) if checkpointed else self.mlp_out(x))

    model = Block()
    parallelize_module(model.mlp, mesh, {
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    })
    return model


def _rows_first_job(rank: int, world: int) -> Dict[str, object]:
    """Inference through an SP MLP block with a residual, B = 4, capturing inductor's generated code."""
    import fluxinductor
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch._dynamo.reset()
    torch.manual_seed(5)
    model = _sp_block(mesh)
    x = distribute_tensor(_seeded_full((4, 8, HIDDEN), 500), mesh, [Shard(1)])
    s0 = fluxinductor.rewrite_stats()
    with torch.no_grad():
        expected = model(x)
        got, codes = run_and_get_code(torch.compile(model, backend="flux"), x)
    return {"errors": {"out": error_of(got.full_tensor(), expected.full_tensor())},
            "forward": stats_delta(fluxinductor.rewrite_stats(), s0), "code": "\n".join(codes)}


def test_sequence_dim_with_batch_runs_rows_first_without_copies():
    """Both ops get [S * B, H] operands (dim 0): the kernel computing gelu reads the all-gather's output through the
    permute and writes the reduce-scatter's operand in rows-first order, and the residual add reads the
    reduce-scatter's output directly; no other kernel touches them (no layout copy, where the op used to copy the
    operand and its result)."""
    for rank, r in enumerate(run_ranks(_rows_first_job, 2, timeout=300)):
        where = f"rows-first rank={rank}"
        _assert_ok(r, where)
        check_errors(r["errors"], "fp32", where)
        check_fused(r["forward"], {AG_MM: 1, MM_RS: 1}, where)
        calls = check_rows_first_mlp(r["code"])
        # Besides those two, only the copy of the graph's input shard into rows-first order.
        assert len(calls) == 3, f"{where}: {calls}"


def _training_step_job(rank: int, world: int, case: str) -> Dict[str, object]:
    """One training step through the SP MLP block, eager then compiled: ``case`` "checkpoint" (the MLP under activation
    checkpointing), "autocast" or "autocast_fp16" (fp32 weights and input, bf16 or fp16 autocast)."""
    import contextlib

    import fluxinductor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(5)
        model = _sp_block(mesh, checkpointed=case == "checkpoint")
        x = distribute_tensor(_seeded_full((2, 8, HIDDEN), 600), mesh, [Shard(1)]).requires_grad_(True)
        s0 = fluxinductor.rewrite_stats()
        run = torch.compile(model, backend="flux") if compiled else model
        autocast = {"autocast": torch.bfloat16, "autocast_fp16": torch.float16}.get(case)
        with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
            out = run(x)
        out.to_local().float().pow(2).sum().backward()
        results.append({"out": out.to_local().detach().float(), "x.grad": x.grad.to_local(),
                        "w1.grad": model.mlp.w1.weight.grad.to_local(), "w2.grad": model.mlp.w2.weight.grad.to_local(),
                        "stats": stats_delta(fluxinductor.rewrite_stats(), s0), "x.grad dtype": str(x.grad.dtype)})
    eager, flux = results
    return {"errors": {k: error_of(flux[k], eager[k]) for k in ("out", "x.grad", "w1.grad", "w2.grad")},
            "stats": flux["stats"], "dtypes": (eager["x.grad dtype"], flux["x.grad dtype"])}


def test_activation_checkpointing_fuses_the_recomputed_forward_too():
    """The backward graph recomputes the checkpointed all-gather -> matmul and fuses it as well: three AG+GEMMs
    (forward, recomputed forward, the gradient's all-gather) and two GEMM+RS, with eager's numerics."""
    for rank, r in enumerate(run_ranks(_training_step_job, 2, "checkpoint", timeout=300)):
        where = f"checkpoint rank={rank}"
        _assert_ok(r, where)
        check_errors(r["errors"], "fp32", where)
        check_fused(r["stats"], {AG_MM: 3, MM_RS: 2}, where)


@pytest.mark.parametrize("case", ["autocast", "autocast_fp16"])
def test_autocast_backward_reduce_scatter_in_fp32_is_fused(case):
    """Under bf16 (fp16) autocast the backward reduce-scatters the input gradient in fp32 (a bf16 (fp16) mm cast up):
    that GEMM+RS is fused with out_dtype=float32 like the forward's, within half-precision tolerance of eager."""
    for rank, r in enumerate(run_ranks(_training_step_job, 2, case, timeout=300)):
        where = f"{case} rank={rank}"
        _assert_ok(r, where)
        check_errors(r["errors"], "bf16", where)
        check_fused(r["stats"], {AG_MM: 2, MM_RS: 2}, where)
        assert r["stats"]["skipped"].get(MM_RS, {}) == {}, f"{where}: {r['stats']}"
        assert r["dtypes"] == ("torch.float32", "torch.float32")


def _autocast_attention_job(rank: int, world: int) -> Dict[str, object]:
    """Attention with separate Q/K/V projections (one all-gather feeds all three) under bf16 autocast, fp32 weights
    and input, forward and backward, eager then compiled."""
    return run_case(rank, world, "attention_qkv", "fp32", autocast=torch.bfloat16)


def test_autocast_qkv_input_gradient_sum_of_upcast_terms_is_fused():
    """Autocast casts the fp32 input once per projection, so its gradient is the fp32 sum of three bf16 matmuls each
    cast up, then reduce-scattered: fused as one GEMM+RS over the concatenated K with an fp32 result."""
    for rank, r in enumerate(run_ranks(_autocast_attention_job, 2, timeout=300)):
        where = f"autocast attention rank={rank}"
        _assert_ok(r, where)
        check_errors({k: r["errors"][k] for k in ("out", "grad_input")}, "bf16", where)
        check_fused(r["forward"], {AG_MM: 1, MM_RS: 1}, where + " forward")
        check_fused(r["backward"], {AG_MM: 1, MM_RS: 1}, where + " backward")
        assert r["backward"]["skipped"].get(MM_RS, {}) == {}, f"{where}: {r['backward']}"
        assert r["grad_input_dtype"] == "torch.float32"


def _inference_mode_job(rank: int, world: int) -> Dict[str, object]:
    """The SP block run eagerly and compiled under ``torch.inference_mode()`` (serving code), then compiled again
    with grad on (inference tensors may not be saved for backward: the second compile must not be handed them)."""
    import fluxinductor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch._dynamo.reset()
    torch.manual_seed(5)
    model = _sp_block(mesh)
    x = distribute_tensor(_seeded_full((2, 8, HIDDEN), 610), mesh, [Shard(1)])
    compiled = torch.compile(model, backend="flux")
    s0 = fluxinductor.rewrite_stats()
    with torch.inference_mode():
        eager, flux = model(x).to_local(), compiled(x).to_local()
        is_inference = flux.is_inference()
    stats = stats_delta(fluxinductor.rewrite_stats(), s0)
    x_grad = x.detach().clone().requires_grad_(True)
    compiled(x_grad).to_local().pow(2).sum().backward()
    return {"errors": {"out": error_of(flux, eager)}, "stats": stats, "is_inference": is_inference,
            "grad_ok": bool(x_grad.grad is not None and torch.isfinite(x_grad.grad.to_local()).all())}


def test_inference_mode_fuses_and_matches_eager():
    for rank, r in enumerate(run_ranks(_inference_mode_job, 2, timeout=300)):
        where = f"inference_mode rank={rank}"
        _assert_ok(r, where)
        check_errors(r["errors"], "fp32", where)
        check_fused(r["stats"], {AG_MM: 1, MM_RS: 1}, where)
        assert r["is_inference"] and r["grad_ok"], f"{where}: {r}"


# ---------------------------------------------------------------------------------------------------
# A 2x2 (dp, tp) mesh: only the tensor-parallel group's collectives are fused.
# ---------------------------------------------------------------------------------------------------


class TwoGroupModel(nn.Module):
    """A sequence-parallel MLP on the tp group followed by an all-gather -> matmul over the dp group."""

    def __init__(self, mlp: nn.Module, dp_group, rank: int):
        super().__init__()
        self.mlp = mlp
        self.dp_group = dp_group
        self.w_dp = nn.Parameter(_seeded_full((HIDDEN, 16), 70 + rank % 2) * HIDDEN**-0.5)

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        y = self.mlp(x)  # [B, S / tp, H] on the tp group
        # [B * S / tp, H] -> [dp * B * S / tp, H] over the dp group, then a matmul on it.
        gathered = funcol.all_gather_tensor(y.flatten(0, 1), 0, self.dp_group)
        return gathered @ self.w_dp


def _two_group_case(rank: int, world: int, mesh, how: str) -> Dict[str, object]:
    """how: "options" (tp_group compile option), "set_tp_group" (global setting), "all" (no restriction)."""
    import fluxinductor

    tp_rank = mesh["tp"].get_local_rank()
    dp_group = mesh["dp"].get_group()
    torch._dynamo.reset()
    fluxinductor.set_tp_group(None)

    def build():
        mlp, make_input = build_sp_mlp(mesh["tp"], torch.float32, tp_rank, world // 2)
        return TwoGroupModel(mlp, dp_group, rank), make_input

    (eager_model, make_input), (flux_model, _) = build(), build()
    options: Optional[dict] = None
    if how == "options":
        options = {"tp_group": mesh["tp"]}
    elif how == "set_tp_group":
        fluxinductor.set_tp_group(mesh["tp"])
    try:
        compiled = torch.compile(flux_model, backend="flux", options=options)
        x_eager = make_input(400 + mesh["dp"].get_local_rank()).requires_grad_(True)
        x_flux = x_eager.detach().clone().requires_grad_(True)
        s0 = fluxinductor.rewrite_stats()
        y_eager, y_flux = eager_model(x_eager), compiled(x_flux)
        s1 = fluxinductor.rewrite_stats()
        grad = _seeded_full(y_eager.shape, 410 + rank)
        y_eager.backward(grad)
        y_flux.backward(grad)
        s2 = fluxinductor.rewrite_stats()
    finally:
        fluxinductor.set_tp_group(None)
    errors = {"out": error_of(y_flux, y_eager), "grad_input": error_of(x_flux.grad, x_eager.grad)}
    flux_params = dict(flux_model.named_parameters())
    for name, p in eager_model.named_parameters():
        errors[f"grad_{name}"] = error_of(flux_params[name].grad, p.grad)
    return {
        "errors": errors,
        "forward": stats_delta(s1, s0),
        "backward": stats_delta(s2, s1),
        "tp_group": mesh["tp"].get_group().group_name,
        "dp_group": dp_group.group_name,
    }


def _two_group_job(rank: int, world: int) -> Dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    # One mesh for all cases: DTensor caches redistribution plans per (equal) mesh, so a second identical
    # mesh with new process groups would still be served collectives on the first mesh's groups.
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    # "options" and "set_tp_group" compile the same graph under the same fusion settings; without this
    # the second would (rightly) be served from the FX graph cache and run no pass to count.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    return {how: _guarded(_two_group_case, rank, world, mesh, how) for how in ("options", "set_tp_group", "all")}


@functools.lru_cache(maxsize=None)
def _two_group_results():
    return run_ranks(_two_group_job, 4, timeout=480)


@pytest.mark.parametrize("how", ["options", "set_tp_group"])
def test_2d_mesh_fuses_only_tp_group(how):
    for rank, per_rank in enumerate(_two_group_results()):
        r = per_rank[how]
        where = f"2x2 mesh, {how}, rank={rank}"
        _assert_ok(r, where)
        check_errors(r["errors"], "fp32", where)
        for phase in ("forward", "backward"):
            delta = r[phase]
            # Exactly the sequence-parallel MLP's pair; the dp all-gather -> matmul is left alone.
            assert delta["fused"] == {AG_MM: 1, MM_RS: 1}, f"{where} {phase}: {delta}"
            reasons = [reason for reasons in delta["skipped"].values() for reason in reasons]
            assert any("group" in reason for reason in reasons), f"{where} {phase}: no group skip in {delta}"


def test_2d_mesh_without_restriction_fuses_both_groups():
    for rank, per_rank in enumerate(_two_group_results()):
        r = per_rank["all"]
        where = f"2x2 mesh, no tp_group, rank={rank}"
        _assert_ok(r, where)
        check_errors(r["errors"], "fp32", where)
        # The dp all-gather -> matmul (forward) and its matmul -> reduce-scatter (backward) fuse too.
        check_fused(r["forward"], {AG_MM: 2, MM_RS: 1}, where + " forward")
        check_fused(r["backward"], {AG_MM: 1, MM_RS: 2}, where + " backward")


# ---------------------------------------------------------------------------------------------------
# Plain tensor parallelism: the all-reduce split (fluxinductor.passes.all_reduce_split).
# ---------------------------------------------------------------------------------------------------


def _all_reduce_split_job(rank: int, world: int) -> Dict[str, object]:
    """The plain-TP Llama-style block under each split_all_reduce setting (its process-wide default, which each
    compile reads)."""
    import test_compile_numerics

    from fluxinductor import settings

    out: Dict[str, object] = {}
    for mode in ("replicated", "0"):
        settings.configure(split_all_reduce=mode)
        out[mode] = _guarded(run_case, rank, world, "tp_block", "fp32")
    # Inference through LayerNorms (var_mean): nothing saved for a backward, so the rows stay sharded through the
    # residual add and the next block's norm.
    settings.configure(split_all_reduce="replicated")
    out["replicated_layer_norm"] = _guarded(run_case, rank, world, "megatron_mlp_infer", "fp32")
    # The default (exact) with a gradient that differs between ranks, which a replicated output never gets from a
    # real loss: the exact split must still give each rank eager's answer, as it slices nothing.
    settings.configure(split_all_reduce="exact")
    test_compile_numerics.REPLICATED_OUTPUTS.discard("tp_block")
    out["exact_rank_dependent_grad"] = _guarded(run_case, rank, world, "tp_block", "fp32")
    return out


@functools.lru_cache(maxsize=None)
def _all_reduce_split_results():
    return run_ranks(_all_reduce_split_job, 2, timeout=600)


def test_all_reduce_split_replicated_fuses_both_halves():
    """``replicated``: the reduce-scatters fuse with the o/down matmuls (input-gradient sums in the backward) and the
    all-gathers move past the residual add and the norm into the next matmuls, where they fuse too."""
    for rank, per_rank in enumerate(_all_reduce_split_results()):
        r, where = per_rank["replicated"], f"split replicated rank={rank}"
        _assert_ok(r, where)
        check_errors(r["errors"], "fp32", where)
        check_fused(r["forward"], {AG_MM: 1, MM_RS: 2}, where + " forward")
        check_fused(r["backward"], {AG_MM: 1, MM_RS: 2}, where + " backward")
        assert r["forward"]["fused"]["all_reduce_split"] == 2, r["forward"]


def test_all_reduce_split_replicated_shards_layer_norms_in_inference():
    """Two Megatron-style blocks: the first block's all-reduce stays sharded through the residual add and the second
    block's LayerNorm, whose all-gather then fuses into its column-parallel matmul; the last output is gathered."""
    for rank, per_rank in enumerate(_all_reduce_split_results()):
        r, where = per_rank["replicated_layer_norm"], f"split replicated LayerNorm rank={rank}"
        _assert_ok(r, where)
        check_errors(r["errors"], "fp32", where)
        check_fused(r["forward"], {AG_MM: 1, MM_RS: 2}, where + " forward")
        assert r["forward"]["fused"]["all_reduce_split"] == 2, r["forward"]


def test_all_reduce_split_exact_is_exact_even_for_rank_dependent_values():
    for rank, per_rank in enumerate(_all_reduce_split_results()):
        r, where = per_rank["exact_rank_dependent_grad"], f"split exact rank={rank}"
        _assert_ok(r, where)
        check_errors(r["errors"], "fp32", where)
        check_fused(r["forward"], {MM_RS: 2}, where + " forward")
        for phase in ("forward", "backward"):  # the split's all-gathers land before the residual adds: unfused
            assert r[phase]["fused"].get(AG_MM, 0) == 0 and r[phase]["inserted"].get(AG_MM, 0) == 0, r[phase]


def test_all_reduce_split_off_leaves_plain_tp_unfused():
    for rank, per_rank in enumerate(_all_reduce_split_results()):
        r, where = per_rank["0"], f"split off rank={rank}"
        _assert_ok(r, where)
        check_errors(r["errors"], "fp32", where)
        for phase in ("forward", "backward"):
            assert r[phase]["fused"] == {}, f"{where} {phase}: {r[phase]}"
