"""Dynamic shapes end to end: ``torch.compile(model, backend="flux")`` with a symbolic token/sequence dim, on
2 gloo CPU ranks.

A model fed inputs of changing length (variable sequence lengths, a last partial batch) gets a graph with a
symbolic size: with ``dynamic=True`` from the first compile, and by default (automatic dynamic shapes) from
the recompile that the second length triggers.  Both graphs must still get the fused ops, and the one
compiled graph must be right at every length.  Per case: three input lengths, outputs and (for the training
models) input and parameter gradients against the same model run eagerly; the patterns fused in the
forward and backward compiles; and no compile after the one that made the dim symbolic.  Models are those of
tests/compile/test_compile_numerics.py.
"""

from __future__ import annotations

import functools
import traceback
from typing import Dict, List, Tuple

import pytest
import torch

from _dist import run_ranks
from test_compile_numerics import AG_MM, MM_RS, MODELS, check_errors, error_of, stats_delta

# (model, torch.compile's dynamic=): True from the start; None is the default (static, then automatic dynamic).
CASES: List[Tuple[str, object]] = [
    ("sp_mlp", True),
    ("attention_qkv", True),
    ("funcol_swiglu", True),
    ("c10d_mlp", True),
    ("sp_mlp", None),
    ("funcol_swiglu", None),
]
LENGTHS = (1, 2, 3)  # the input shard is this many copies of the model's base shard, along the sharded dim


def _input(make_input, length: int, backward: bool) -> torch.Tensor:
    parts = [make_input(100 + i) for i in range(length)]
    x = torch.cat(parts, dim=1 if parts[0].dim() == 3 else 0)
    return x.requires_grad_(backward)


def _build(rank: int, world: int, name: str, dynamic):
    """(runs backward, the eager model, its input maker, the model compiled, the compiled callable)."""
    from torch.distributed.device_mesh import init_device_mesh

    builder, backward, _, _ = MODELS[name]
    mesh = init_device_mesh("cpu", (world,))
    torch._dynamo.reset()
    eager_model, make_input = builder(mesh, torch.float32, rank, world)
    flux_model, _ = builder(mesh, torch.float32, rank, world)
    return backward, eager_model, make_input, flux_model, torch.compile(flux_model, backend="flux", dynamic=dynamic)


def _uncached():
    """A compile served from inductor's caches runs no pass and counts nothing (the same graph was compiled by an
    earlier case of this process): compile every case afresh."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


def _run(rank: int, world: int, name: str, dynamic) -> Dict[str, object]:
    backward, eager_model, make_input, flux_model, compiled = _build(rank, world, name, dynamic)
    with _uncached():
        steps = [_step(eager_model, compiled, flux_model, make_input, length, backward, rank) for length in LENGTHS]
    return {"steps": steps}


def _step(eager_model, compiled, flux_model, make_input, length: int, backward: bool, rank: int) -> dict:
    """One input length: the compiled model against eager, forward (and backward), and the stats it added."""
    x_eager = _input(make_input, length, backward)
    grad_seed = 7 + rank + length
    return {"shape": tuple(x_eager.shape), **_compare(eager_model, compiled, flux_model, x_eager, backward, grad_seed)}


def _compare(eager_model, compiled, flux_model, x_eager, backward: bool, grad_seed: int) -> dict:
    """The compiled model against eager on ``x_eager``, forward (and backward with a gradient from ``grad_seed``):
    errors and the stats the call added."""
    import fluxinductor

    x_flux = x_eager.detach().clone().requires_grad_(backward)
    s0 = fluxinductor.rewrite_stats()
    with torch.set_grad_enabled(backward):
        y_eager, y_flux = eager_model(x_eager), compiled(x_flux)
    errors = {"out": error_of(y_flux, y_eager)}
    if backward:
        grad_out = torch.randn(y_eager.shape, generator=torch.Generator().manual_seed(grad_seed))
        y_eager.backward(grad_out)
        y_flux.backward(grad_out)
        errors["grad_input"] = error_of(x_flux.grad, x_eager.grad)
        flux_params = dict(flux_model.named_parameters())
        for pname, p in eager_model.named_parameters():
            errors[f"grad_{pname}"] = error_of(flux_params[pname].grad, p.grad)
            p.grad = None
            flux_params[pname].grad = None
    return {"errors": errors, "stats": stats_delta(fluxinductor.rewrite_stats(), s0)}


def _job(rank: int, world: int, cases, run=_run) -> Dict[Tuple[str, object], object]:
    out = {}
    for name, dynamic in cases:
        try:
            out[(name, dynamic)] = run(rank, world, name, dynamic)
        except Exception:  # noqa: BLE001 - reported per case
            out[(name, dynamic)] = {"error": traceback.format_exc()}
    return out


def _checked_steps(results, name: str, dynamic, label):
    """(index, step, where) of every rank's steps of (name, dynamic), after checking that the rank did not raise and
    that the step's numbers match eager's; ``label(step)`` names the step's input in messages."""
    for rank, per_rank in enumerate(results):
        r = per_rank[(name, dynamic)]
        assert "error" not in r, f"{name} rank {rank} raised:\n{r.get('error')}"
        for i, step in enumerate(r["steps"]):
            where = f"{name} dynamic={dynamic} rank={rank} {label(step)}"
            check_errors(step["errors"], "fp32", where)
            yield i, step, where


@functools.lru_cache(maxsize=None)
def _results():
    return run_ranks(_job, 2, CASES, timeout=900)


@pytest.mark.parametrize("name,dynamic", CASES, ids=[f"{n}-dynamic={d}" for n, d in CASES])
def test_symbolic_length_fuses_and_matches_eager(name, dynamic):
    _, backward, fwd_expected, bwd_expected = MODELS[name]
    # The compile that makes the length symbolic: the first with dynamic=True, the second (the recompile on a
    # new length) by default.
    symbolic_step = 0 if dynamic else 1
    for i, step, where in _checked_steps(_results(), name, dynamic, lambda step: f"input {step['shape']}"):
        stats = step["stats"]
        for pattern in (AG_MM, MM_RS):
            # The fused op ran at every length (on CPU each call is a counted fallback to the decomposition).
            assert stats["calls"].get(pattern, 0) >= 1, f"{where}: {pattern} not called; {stats}"
        if i == symbolic_step:
            expected = {p: fwd_expected.get(p, 0) + (bwd_expected.get(p, 0) if backward else 0)
                        for p in (AG_MM, MM_RS)}
            for pattern, minimum in expected.items():
                got = stats["fused"].get(pattern, 0)
                assert got >= minimum, f"{where}: fused {pattern} {got} times, expected >= {minimum}; {stats}"
            assert "symbolic shape" not in str(stats["skipped"]), f"{where}: {stats['skipped']}"
        elif i > symbolic_step:
            assert stats["fused"] == {}, f"{where}: recompiled after the length became symbolic: {stats}"


# ---------------------------------------------------------------------------------------------------
# Plain tensor parallelism under dynamic shapes: the all-reduce split's matmul_all_reduce.
# ---------------------------------------------------------------------------------------------------

# (model, dynamic=): a training model symbolic from the start, an inference one symbolic from its recompile.
PLAIN_CASES: List[Tuple[str, object]] = [("megatron_mlp", True), ("megatron_mlp_infer", None)]
# Sequence lengths of a [1, S, H] input: 8 and 6 rows split over 2 ranks, 5 and 3 do not (the op then runs the
# matmul and the all-reduce).
PLAIN_LENGTHS = (8, 6, 5, 3)


def _plain_run(rank: int, world: int, name: str, dynamic) -> Dict[str, object]:
    backward, eager_model, make_input, flux_model, compiled = _build(rank, world, name, dynamic)
    full = torch.cat([make_input(100), make_input(101)], dim=1)  # [2, 16, H], the same on every rank
    steps = []
    with _uncached():
        for length in PLAIN_LENGTHS:
            # The output is replicated: the same gradient on every rank, as a loss computed alike gives.
            x_eager = full[:1, :length].clone().requires_grad_(backward)
            steps.append({"length": length,
                          **_compare(eager_model, compiled, flux_model, x_eager, backward, 7 + length)})
    return {"steps": steps}


@functools.lru_cache(maxsize=None)
def _plain_results():
    return run_ranks(_job, 2, PLAIN_CASES, _plain_run, timeout=900)


@pytest.mark.parametrize("name,dynamic", PLAIN_CASES, ids=[f"{n}-dynamic={d}" for n, d in PLAIN_CASES])
def test_symbolic_rows_all_reduce_runs_fused_where_rows_split(name, dynamic):
    """Each row-parallel all-reduce (and, training, each input-gradient one) becomes one matmul_all_reduce: the
    reduce-scatter path ran at even row counts, the matmul and the all-reduce at odd ones, eager's numbers at all."""
    _, backward, _, _ = MODELS[name]
    symbolic_step = 0 if dynamic else 1
    for i, step, where in _checked_steps(_plain_results(), name, dynamic, lambda step: f"length {step['length']}"):
        stats = step["stats"]
        if step["length"] % 2 == 0:
            # On CPU the op's reduce-scatter path is a counted fallback of the dispatcher's matmul_reduce_scatter.
            assert stats["calls"].get(MM_RS, 0) >= 1, f"{where}: the reduce-scatter path did not run; {stats}"
        elif i >= symbolic_step:
            assert stats["calls"].get("matmul_all_reduce", 0) >= 1, f"{where}: no odd-rows fallback; {stats}"
            assert stats["calls"].get(MM_RS, 0) == 0, f"{where}: {stats}"
        if i == symbolic_step:
            expected = 4 if backward else 2
            got = stats["fused"].get("all_reduce_split", 0)
            assert got >= expected, f"{where}: {got} all-reduces rewritten, expected >= {expected}; {stats}"
            assert "symbolic shape" not in str(stats["skipped"]), f"{where}: {stats['skipped']}"
        elif i > symbolic_step:
            assert stats["fused"] == {}, f"{where}: recompiled after the length became symbolic: {stats}"
