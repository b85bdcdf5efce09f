#!/usr/bin/env python3
"""Model-level benchmark: eager, inductor, inductor + async-TP and ``backend="flux"`` on tensor-parallel models.

Run (one process per GPU; the lead's device call is 2 x H200):

    PYTHONUNBUFFERED=1 torchrun --nproc-per-node 2 benchmarks/bench_model.py --out $OUT/h200x2_tp2_model

CPU smoke run (gloo, tiny config, fp32, perf_counter timing):

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_model.py --device cpu --quick --out /tmp/model_cpu

Models (``--models``), both sequence parallel with ``torch.distributed.tensor.parallel`` over all ranks:
  mlp     ColwiseParallel(input_layouts=Shard(d)) up H -> F, gelu, RowwiseParallel(output_layouts=Shard(d)) down
          (full: 4096 tokens, H 8192, F 28672; ``--mlp-shard-dim 0`` (default, x: [T, H]) or 1 (x: [1, T, H]));
          the reference "torch.compile of a sequence-parallel MLP" setup (docs/performance.md).
  llama2  two Llama-style decoder layers (RMSNorm, RoPE, GQA attention with separate Q/K/V, SwiGLU), full:
          hidden 8192, ffn 28672, 64 heads, 8 KV heads, B=1, S=4096; SequenceParallel norms,
          PrepareModuleInput (Shard(1) -> Replicate) before attention and MLP, Colwise Q/K/V/w1/w3,
          Rowwise(output Shard(1)) o/w2: the reference model-level setup (docs/performance.md).
``--tp plain`` builds both in plain tensor parallelism instead (replicated input and activations, default Colwise
and Rowwise, an all-reduce after each row-parallel linear; every rank draws the same input and gradient), which
fluxinductor's all-reduce split turns into fusable reduce-scatters and all-gathers (compile option
``split_all_reduce``; ``--flux-options`` passes the flux modes' compile options).
Phases: ``fwd`` (under torch.no_grad) and ``fwd_bwd`` (forward, then backward of a fixed random grad).

Modes (``--modes``), each after ``torch._dynamo.reset()`` with a fresh ``torch.compile``:
  eager       the DTensor model as is (also the reference for every error)
  inductor    torch.compile(backend="inductor")
  asynctp     inductor with torch._inductor.config._micro_pipeline_tp = True (PyTorch async-TP; symmetric
              memory enabled for the TP group first where torch has enable_symm_mem_for_group)
  flux        torch.compile(backend="flux"), FLUXINDUCTOR_DISPATCH=auto (what users get)
  flux_fused  torch.compile(backend="flux"), FLUXINDUCTOR_DISPATCH=fused (fused kernel wherever eligible)
``--tuning key=value[,...]`` sets fluxinductor's kernel-tuning fields (``fluxinductor.settings.set_tuning``) on every
rank for the whole run; the JSON records them (``environment.tuning``).
Modes run in the order eager, inductor, flux, flux_fused, asynctp (fluxinductor before async-TP, as in
bench_ops.py, so async-TP's symmetric-memory workspace is allocated last).  The FX graph cache and the
AOTAutograd cache are off so every mode really compiles and runs its passes (kernel caches stay warm, so
later modes' first calls do not pay for compiling identical Triton kernels again).

Recorded per (model, phase, mode): first-call seconds (compile + one call, max over ranks), steady-state
time (median of ``--iters`` after ``--warmup`` warm-ups per rank, max over ranks; every per-rank
per-iteration time is kept), the largest error against eager (max |out - ref| / max |ref| and
||out - ref|| / ||ref||, for the output and, with backward, the input and parameter gradients; max over
ranks), for flux modes ``fluxinductor.rewrite_stats()`` deltas (fused and skipped while compiling the
forward and the backward; run-time fallbacks to the decomposition while timed), and for inductor modes a
census of the collective / fused ops left in each post-grad graph (``symm_mem`` ops = async-TP fired).

Timing on CUDA: before every iteration gradients are dropped, then ``dist.barrier`` + ``cuda.synchronize``,
then ``torch.cuda._sleep(--sleep-cycles)`` (default 2,000,000 cycles) before the start event, so the host
enqueues the step while the GPU sleeps and the events measure device time (host enqueue time is recorded
separately, ``host_enqueue_ms``, with the measured sleep length, so a step whose enqueue outlasts the sleep
shows).  On CPU: ``time.perf_counter`` around the step after a barrier.

A mode that raises is recorded with its error and the run goes on; a mode that hangs past
``--contender-timeout`` seconds ends the run (every thread's stack dumped) with the JSON written so far.
``<out>.json`` (device, versions, git sha, settings, every raw number) is rewritten after every mode
(``"complete": false`` until the end); the table is printed last.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import statistics
import sys
import time
import traceback
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from harness import (
    DTYPES,
    ENV_PREFIXES,
    ContextBroken,
    RunContext,
    add_tuning_argument,
    agree,
    apply_tuning,
    cell,
    environment,
    exit_now,
    parse_tuning,
    per_rank_summary,
    time_iterations,
    watchdog,
    write_json,
)
from model_modes import FLUX_DISPATCH, MODES, RUN_ORDER, compare, mode_setup, snapshot
from models import CONFIGS, MODELS, build_model, input_shape

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:  # fluxinductor from this checkout when it is not installed (backend="flux" needs it installed)
    sys.path.append(REPO)

PHASES = ("fwd", "fwd_bwd")
# Norm-relative error against eager that counts as "ok" (the compiled graph reorders bf16 math).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}

# Reference times of eager, inductor and async-TP, ms, measured on 2 x H200 (torch 2.11, bf16, TP=2, full config,
# S = 4096 tokens, mlp Shard(0)) with a barrier before each iteration but no GPU sleep, so host enqueue time is in them.
ANCHOR_MS = {
    ("mlp", "fwd"): {"eager": 3.228, "inductor": 3.276, "asynctp": 3.427},
    ("llama2", "fwd"): {"eager": 26.82, "inductor": 12.82, "asynctp": 12.60},
    ("llama2", "fwd_bwd"): {"eager": 41.14, "inductor": 39.18, "asynctp": 38.93},
}

# ---------------------------------------------------------------------------------------------------
# Run context
# ---------------------------------------------------------------------------------------------------


class Ctx(RunContext):
    """One rank of a bench_model run: the process group, a gloo control group, the device mesh, dtypes, timing."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(args.device, args.pg_timeout, default_port=29518)
        # Agreement and result exchange go over a gloo group of their own, never interleaved with the model's
        # collectives (NCCL on GPUs, the default gloo group on CPU).
        self.ctrl = dist.new_group(backend="gloo")
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (self.world,))
        self.group_name = self.mesh.get_group().group_name
        self.dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if self.is_cuda else torch.float32)
        # --autocast: fp32 weights and inputs, each step under torch.autocast in this dtype (mixed-precision training)
        self.autocast = DTYPES[args.autocast] if args.autocast else None
        if self.autocast is not None:
            if args.dtype not in (None, "fp32"):
                raise SystemExit(f"--autocast runs an fp32 model; --dtype {args.dtype} contradicts it")
            self.dtype = torch.float32
        self.warmup, self.iters, self.sleep_cycles = args.warmup, args.iters, args.sleep_cycles
        self.profile, self.profile_trace, self.profile_seq = args.profile, args.profile_trace, 0
        self.compile_kwargs = {} if args.compile_mode is None else {"mode": args.compile_mode}
        self.flux_options = parse_tuning(args.flux_options)


# ---------------------------------------------------------------------------------------------------
# Measuring one mode
# ---------------------------------------------------------------------------------------------------


def _drop_grads(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    x.grad = None


def _under_autocast(fn: Callable, device_type: str, dtype: torch.dtype) -> Callable:
    """``fn`` run under ``torch.autocast(device_type, dtype)``, its output cast to fp32 (the loss's dtype)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, dtype=dtype):
            return fn(x).float()

    return run


def _step(fn: Callable, x: torch.Tensor, grad: Optional[torch.Tensor]) -> torch.Tensor:
    if grad is None:
        with torch.no_grad():
            return fn(x)
    out = fn(x)
    out.backward(grad)
    return out


def time_steps(ctx: Ctx, fn: Callable, model: nn.Module, x: torch.Tensor, grad) -> Tuple[List[float], List[float]]:
    """(device ms per timed iteration, host enqueue ms per timed iteration).  On CUDA the GPU sleeps while the host
    enqueues the step: the events bracket device time only."""
    return time_iterations(ctx, lambda: _step(fn, x, grad), ctx.warmup, ctx.iters, sleep_cycles=ctx.sleep_cycles,
                           before_iter=lambda: _drop_grads(model, x))


def profile_step(ctx: Ctx, fn: Callable, model: nn.Module, x: torch.Tensor, grad, top: int) -> List[dict]:
    """One more step under torch.profiler: this rank's ``top`` GPU kernels by total device time (name, calls, us)."""
    from torch.profiler import ProfilerActivity, profile

    _drop_grads(model, x)
    ctx.barrier()
    ctx.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(fn, x, grad)
        ctx.sync()
    if ctx.profile_trace:
        prof.export_chrome_trace(f"{ctx.profile_trace}_{ctx.profile_seq}_rank{ctx.rank}.json")
        ctx.profile_seq += 1
    rows = [{"name": e.key[:120], "calls": e.count, "us": round(e.device_time_total, 1)}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us"])[:top]


def measure_mode(ctx: Ctx, model: nn.Module, mode: str, x: torch.Tensor, grad, ref: Optional[dict],
                 tol: float, time_it: bool = True) -> Tuple[dict, Optional[Dict[str, torch.Tensor]]]:
    """Compile (fresh), first call, check against ``ref``, time (unless ``time_it`` is False).

    Returns (the record every rank agrees on, this rank's output / gradient snapshot from the first call).
    """
    import fluxinductor
    from fluxinductor.log import rewrite_stats_delta

    backward = grad is not None
    local: dict = {"error": None, "notes": []}
    is_flux = mode in FLUX_DISPATCH
    fn = census = None
    stack = contextlib.ExitStack()
    try:
        torch._dynamo.reset()
        if os.environ.get("BENCH_MODEL_INJECT_ERROR") == f"{mode}:{'fwd_bwd' if backward else 'fwd'}":
            # Test hook (tests/benchmarks/test_bench_model.py): a mode that fails on every rank before it runs.
            raise RuntimeError("injected by BENCH_MODEL_INJECT_ERROR")
        fn, mode_ctx, census = mode_setup(mode, model, ctx, local["notes"])
        if ctx.autocast is not None:
            fn = _under_autocast(fn, ctx.device.type, ctx.autocast)
        stack.enter_context(mode_ctx)
        _drop_grads(model, x)
        s0 = fluxinductor.rewrite_stats()
        ctx.barrier()
        ctx.sync()
        t0 = time.perf_counter()
        out = fn(x) if backward else _step(fn, x, None)
        s1 = fluxinductor.rewrite_stats()
        if backward:
            out.backward(grad)
        ctx.sync()
        local["first_call_s"] = time.perf_counter() - t0
        s2 = fluxinductor.rewrite_stats()
        snap = snapshot(model, out, x, backward)
        del out
        local["errors"] = compare(snap, ref) if ref is not None else None
        local["snapshot"] = snap
        if is_flux:
            fwd, bwd = rewrite_stats_delta(s1, s0), rewrite_stats_delta(s2, s1)
            local["rewrite_stats"] = {
                "fused_forward": fwd["fused"], "fused_backward": bwd["fused"],
                "skipped_forward": fwd["skipped"], "skipped_backward": bwd["skipped"],
                "fallbacks_first_call": rewrite_stats_delta(s2, s0)["fallbacks"],
            }
        if census is not None:
            local["graph_census"] = list(census.graphs)
    except Exception as e:  # noqa: BLE001
        local["error"] = f"{type(e).__name__}: {e}"
        local["traceback"] = traceback.format_exc(limit=8)
        if not ctx.context_ok():
            stack.close()
            raise ContextBroken(f"{mode} broke the CUDA context: {ctx.broken}") from e

    snap = local.pop("snapshot", None)
    everyone, error = agree(ctx, {k: v for k, v in local.items() if k != "traceback"})
    record: dict = {"mode": mode, "ms": None, "error": None, "notes": everyone[0]["notes"]}
    if error is not None:
        record["error"] = error
        if "traceback" in local:
            record["traceback_rank%d" % ctx.rank] = local["traceback"]
        stack.close()
        return record, None
    record["first_call_s"] = max(r["first_call_s"] for r in everyone)
    record["rank_first_call_s"] = [r["first_call_s"] for r in everyone]
    if everyone[0].get("errors") is not None:
        merged: Dict[str, dict] = {}
        for key in everyone[0]["errors"]:
            per_rank = [r["errors"][key] for r in everyone]
            worst = max(range(ctx.world), key=lambda i: per_rank[i]["norm_rel"])
            merged[key] = dict(per_rank[worst], max_rel=max(p["max_rel"] for p in per_rank),
                               norm_rel=max(p["norm_rel"] for p in per_rank))
        record["errors"] = merged
        record["max_error"] = max(e["max_rel"] for e in merged.values())
        record["max_norm_error"] = max(e["norm_rel"] for e in merged.values())
        record["error_ok"] = bool(record["max_norm_error"] <= tol)
    if is_flux:
        record["rewrite_stats"] = everyone[0]["rewrite_stats"]
        record["rewrite_stats_per_rank_equal"] = all(r["rewrite_stats"] == everyone[0]["rewrite_stats"]
                                                     for r in everyone)
    if census is not None:
        record["graph_census"] = everyone[0]["graph_census"]
    if not time_it:
        stack.close()
        _drop_grads(model, x)
        del fn
        torch._dynamo.reset()
        return record, snap

    # Timing.
    local = {"error": None}
    try:
        s0 = fluxinductor.rewrite_stats()
        times, host = time_steps(ctx, fn, model, x, grad)
        local.update(times=times, host=host)
        if ctx.profile and ctx.is_cuda:
            local["profile_top"] = profile_step(ctx, fn, model, x, grad, ctx.profile)
        if is_flux:
            local["fallbacks_timed"] = rewrite_stats_delta(fluxinductor.rewrite_stats(), s0)["fallbacks"]
    except Exception as e:  # noqa: BLE001
        local["error"] = f"while timing: {type(e).__name__}: {e}"
        if not ctx.context_ok():
            stack.close()
            raise ContextBroken(f"{mode} broke the CUDA context while timed: {ctx.broken}") from e
    finally:
        stack.close()
        _drop_grads(model, x)
        del fn
        torch._dynamo.reset()
    everyone = ctx.gather(local)
    errors = [r["error"] for r in everyone]
    if any(e is not None for e in errors):
        record["error"] = next(e for e in errors if e is not None)
        return record, snap
    per_rank = [r["times"] for r in everyone]
    record.update(per_rank_summary(per_rank))
    record["iter_ms"] = per_rank
    record["host_enqueue_ms"] = [statistics.median(r["host"]) for r in everyone]
    if "profile_top" in everyone[0]:
        record["profile_top"] = [r["profile_top"] for r in everyone]
    if is_flux:
        record["fallbacks_timed"] = everyone[0]["fallbacks_timed"]
        # Which path the timed calls took: "fused" when no call fell back to the decomposition.
        fb = everyone[0]["fallbacks_timed"]
        record["path"] = "fused" if not fb else "decomposed: " + "; ".join(
            f"{op}: {reason} (x{n})" for op, reasons in fb.items() for reason, n in reasons.items())
    return record, snap


# ---------------------------------------------------------------------------------------------------
# Environment, JSON, table
# ---------------------------------------------------------------------------------------------------


def measure_sleep_ms(ctx: Ctx) -> Optional[float]:
    if not ctx.is_cuda:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(ctx.sleep_cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def run_environment(ctx: Ctx, tuning_values: dict) -> dict:
    env = environment(ctx, ctx.dtype, {
        "autocast": None if ctx.autocast is None else str(ctx.autocast).replace("torch.", ""),
        "triton": None,
    }, env_prefixes=ENV_PREFIXES + ("TORCHINDUCTOR_",), tuning_values=tuning_values)
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    return env


def anchors_apply(data: dict) -> bool:
    """Whether this run has the reference setup (so ``ANCHOR_MS`` is a like-for-like reference)."""
    env, s = data["environment"], data["settings"]
    models = s["models"]
    return (env["world"] == 2 and "H200" in env["device"] and env["dtype"] == "bfloat16" and not env.get("autocast")
            and s["config"] == "full" and s["mlp_shard_dim"] == 0 and s.get("tp", "sequence") == "sequence"
            and not s.get("compile_mode")
            and models.get("mlp", CONFIGS["full"]["mlp"]) == CONFIGS["full"]["mlp"]
            and models.get("llama2", CONFIGS["full"]["llama2"]) == CONFIGS["full"]["llama2"])


def derive(data: dict) -> None:
    """Speedups of every mode over eager and over inductor, per (model, phase); the reference time."""
    use_anchors = anchors_apply(data)
    data["anchors"] = {"source": "ANCHOR_MS in benchmarks/bench_model.py", "applies": use_anchors,
                       "method": "no GPU sleep before the start event (host enqueue exposed); the reference model "
                                 "code is not in the repository (bias, RoPE details may differ)"}
    by_key: Dict[Tuple[str, str], Dict[str, dict]] = collections.defaultdict(dict)
    for r in data["results"]:
        by_key[(r["model"], r["phase"])][r["mode"]] = r
    for rows in by_key.values():
        eager = rows.get("eager", {}).get("ms")
        inductor = rows.get("inductor", {}).get("ms")
        for r in rows.values():
            t = r.get("ms")
            r["speedup_vs_eager"] = (eager / t) if (t and eager) else None
            r["speedup_vs_inductor"] = (inductor / t) if (t and inductor) else None
            anchor = ANCHOR_MS.get((r["model"], r["phase"]), {}).get(r["mode"]) if use_anchors else None
            r["anchor_ms"] = anchor


def _fused_summary(r: dict) -> str:
    if "rewrite_stats" in r:
        rs = r["rewrite_stats"]
        short = {"all_gather_matmul": "ag", "matmul_reduce_scatter": "rs"}
        f = " ".join(f"{short.get(k, k)}{v}" for k, v in sorted(rs["fused_forward"].items())) or "-"
        b = " ".join(f"{short.get(k, k)}{v}" for k, v in sorted(rs["fused_backward"].items())) or "-"
        skips = sum(n for reasons in list(rs["skipped_forward"].values()) + list(rs["skipped_backward"].values())
                    for n in reasons.values())
        path = (r.get("path") or "-").split(":")[0]
        return f"fwd[{f}] bwd[{b}] skip{skips} {path}"
    if "graph_census" in r:
        n = sum(v for g in r["graph_census"] for k, v in g.items() if "symm_mem" in k)
        return f"symm_mem ops {n} in {len(r['graph_census'])} graphs"
    return ""


def format_table(data: dict) -> str:
    env, s = data["environment"], data["settings"]
    lines = [
        f"bench_model: {env['device']} x{env['world']} {env['backend']} {env['dtype']}"
        f"{' autocast ' + env['autocast'] if env.get('autocast') else ''} torch {env['torch']} "
        f"sha {env['git_sha']} config {s['config']}"
        f"{' compile mode ' + s['compile_mode'] if s.get('compile_mode') else ''} "
        f"(median of {s['iters']} after {s['warmup']} warm-ups, max over ranks; {s['timing']})",
    ]
    head = (f"{'model':7}{'phase':8}{'mode':11}|{'ms':>9}{'anchor':>8}{'first_s':>9}{'/eager':>8}{'/induct':>8} |"
            f"{'max_err':>9}{'norm_err':>9} | notes")
    lines += [head, "-" * len(head)]
    for r in data["results"]:
        if r.get("error"):
            note = "ERROR " + r["error"][:100]
        else:
            note = _fused_summary(r)
        lines.append(
            f"{r['model']:7}{r['phase']:8}{r['mode']:11}|{cell(r.get('ms'), width=9)}"
            f"{cell(r.get('anchor_ms'), '{:.2f}', 8)}{cell(r.get('first_call_s'), '{:.1f}', 9)}"
            f"{cell(r.get('speedup_vs_eager'), '{:.2f}x', 8)}{cell(r.get('speedup_vs_inductor'), '{:.2f}x', 8)} |"
            f"{cell(r.get('max_error'), '{:.1e}', 9)}{cell(r.get('max_norm_error'), '{:.1e}', 9)}"
            f"{'!' if r.get('error_ok') is False else ' '}| {note}")
    lines.append("ms = steady-state time per step; anchor = reference time (ANCHOR_MS; no GPU sleep: "
                 "host time included); first_s = first call incl. compile; /x = T_x / T; "
                 "errors vs eager (max |d|/max|ref|, ||d||/||ref||; '!' over tolerance); "
                 "fwd/bwd[...] = patterns fused by flux (ag = all_gather_matmul, rs = matmul_reduce_scatter)")
    for r in data["results"]:
        for rank, top in enumerate(r.get("profile_top") or ()):
            lines.append(f"profile {r['model']} {r['phase']} {r['mode']} rank {rank}: "
                         + "; ".join(f"{k['name'][:60]} x{k['calls']} {k['us'] / 1e3:.3f} ms" for k in top))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------


def build_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output prefix: writes <out>.json")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--autocast", choices=("bf16", "fp16"), default=None,
                   help="fp32 weights and inputs, every step under torch.autocast in this dtype")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of " + ",".join(PHASES))
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--config", choices=tuple(CONFIGS), default=None, help="default full on cuda, small on cpu")
    p.add_argument("--seq", type=int, default=None, help="override llama2 S and mlp tokens")
    p.add_argument("--layers", type=int, default=None, help="override the llama2 decoder layer count (2)")
    p.add_argument("--batch", type=int, default=None,
                   help="llama2 batch B (default 1), and the mlp's with --mlp-shard-dim 1 (x [B, T/w, H]): B > 1 "
                        "puts the sequence dim behind the batch dim, which the passes rewrite rows-first")
    p.add_argument("--mlp-shard-dim", type=int, choices=(0, 1), default=0,
                   help="mlp input layout: 0 = x [T/w, H] Shard(0) (the reference setup), 1 = x [1, T/w, H] Shard(1)")
    p.add_argument("--tp", choices=("sequence", "plain"), default="sequence",
                   help="sequence: sequence parallel (the default); plain: replicated activations and all-reduces, "
                        "which fluxinductor's all-reduce split (compile option split_all_reduce) turns into fusable "
                        "reduce-scatters and all-gathers; --mlp-shard-dim does not apply")
    p.add_argument("--compile-mode", default=None, choices=("default", "reduce-overhead", "max-autotune",
                                                             "max-autotune-no-cudagraphs"),
                   help="torch.compile(mode=...) for every compiled mode (default: none given); with reduce-overhead "
                        "the fused ops run between CUDA graph partitions, or inside the graphs with "
                        "fluxinductor.settings' cuda_graphs default on")
    p.add_argument("--flux-options", default=None, metavar="KEY=VALUE[,KEY=VALUE]",
                   help="torch.compile(backend='flux', options={...}) for the flux modes, e.g. "
                        "split_all_reduce=replicated,cuda_graphs=true (torch takes options or --compile-mode, not both)")
    add_tuning_argument(p)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per mode (default 5; --quick 1)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per mode (default 20; --quick 3)")
    p.add_argument("--quick", action="store_true", help="fewer iterations")
    p.add_argument("--sleep-cycles", type=int, default=2_000_000,
                   help="torch.cuda._sleep cycles before each start event (hides host enqueue; 0 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing a mode, profile one more step and record each rank's N costliest GPU kernels "
                        "(JSON profile_top; printed under the table)")
    p.add_argument("--profile-trace", default=None, metavar="PREFIX",
                   help="with --profile: also write each profiled step's Chrome trace to PREFIX_<i>_rank<r>.json")
    p.add_argument("--pg-timeout", type=float, default=180.0, help="process-group timeout, seconds")
    p.add_argument("--contender-timeout", type=float, default=150.0,
                   help="seconds one mode (compile + check + timing) may take before the run exits")
    args = p.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    args.iters = args.iters if args.iters is not None else (3 if args.quick else 20)
    for flag, allowed in (("models", MODELS), ("phases", PHASES), ("modes", MODES)):
        for name in getattr(args, flag).split(","):
            if name not in allowed:
                p.error(f"unknown {flag[:-1]} {name!r} (choose from {','.join(allowed)})")
    try:
        parse_tuning(args.tuning)
        if parse_tuning(args.flux_options) and args.compile_mode:
            p.error("--flux-options and --compile-mode: torch.compile takes options or a mode, not both")
    except ValueError as e:
        p.error(str(e).replace("--tuning", "--tuning/--flux-options"))
    return args


def main(argv=None) -> int:
    args = build_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    # Every mode compiles from scratch and runs its passes: no FX graph / AOTAutograd cache hits.
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    for cfg_module, attr in ((inductor_config, "fx_graph_cache"), (inductor_config, "fx_graph_remote_cache"),
                             (functorch_config, "enable_autograd_cache"),
                             (functorch_config, "enable_remote_autograd_cache")):
        if hasattr(cfg_module, attr):
            setattr(cfg_module, attr, False)

    ctx = Ctx(args)
    tuning_values = apply_tuning(args.tuning)
    config_name = args.config or ("full" if ctx.is_cuda else "small")
    configs = {name: dict(CONFIGS[config_name][name]) for name in MODELS}
    if args.seq:
        configs["mlp"]["tokens"] = args.seq
        configs["llama2"]["seq"] = args.seq
    if args.layers:
        configs["llama2"]["layers"] = args.layers
    if args.batch:
        configs["llama2"]["batch"] = args.batch
        if args.mlp_shard_dim == 1:
            configs["mlp"]["batch"] = args.batch
    models = [m for m in MODELS if m in args.models.split(",")]
    phases = [p for p in PHASES if p in args.phases.split(",")]
    modes = [m for m in RUN_ORDER if m in args.modes.split(",")]
    tol = TOLERANCE[ctx.autocast or ctx.dtype]
    timing = ("cuda_events: dist.barrier + cuda.synchronize before each iteration, then "
              f"torch.cuda._sleep({ctx.sleep_cycles}) before the start event (host enqueue hidden); "
              "per-rank median, max over ranks") if ctx.is_cuda else \
        "perf_counter around each step after dist.barrier; per-rank median, max over ranks"
    data = {
        "schema": "fluxinductor.bench_model/1",
        "complete": False,
        "environment": run_environment(ctx, tuning_values),
        "settings": {"config": config_name, "models": {m: configs[m] for m in models}, "phases": phases,
                     "modes": modes, "mlp_shard_dim": args.mlp_shard_dim, "tp": args.tp,
                     "compile_mode": args.compile_mode,
                     "flux_options": ctx.flux_options, "warmup": ctx.warmup,
                     "iters": ctx.iters, "sleep_cycles": ctx.sleep_cycles if ctx.is_cuda else None,
                     "sleep_ms": measure_sleep_ms(ctx), "timing": timing, "tolerance_norm_rel": tol,
                     "fx_graph_cache": False, "autograd_cache": False,
                     "contender_timeout_s": args.contender_timeout},
        "results": [],
    }
    out_json = os.path.abspath(args.out + ".json")

    def log(msg: str) -> None:
        if ctx.rank == 0:
            print(f"[bench_model] {msg}", flush=True)

    def save() -> None:
        if ctx.rank == 0:
            derive(data)
            write_json(out_json, data)

    save()
    try:
        for model_name in models:
            cfg = configs[model_name]
            try:
                model = build_model(model_name, cfg, ctx.mesh, ctx.device, ctx.dtype, args.mlp_shard_dim, args.tp)
            except Exception as e:  # noqa: BLE001
                msg = f"building {model_name} failed: {type(e).__name__}: {e}"
                log(msg)
                data.setdefault("model_errors", {})[model_name] = msg + "\n" + traceback.format_exc(limit=8)
                save()
                if not ctx.context_ok():
                    raise ContextBroken(msg) from e
                continue
            shape = input_shape(model_name, cfg, ctx.world, args.mlp_shard_dim, args.tp)
            # Plain TP: the input and the output's gradient are replicated, so every rank draws the same ones.
            gen = torch.Generator().manual_seed(args.seed * 1000 + (0 if args.tp == "plain" else ctx.rank))
            x = torch.randn(shape, generator=gen).to(device=ctx.device, dtype=ctx.dtype)
            grad_out = torch.randn(shape, generator=gen).to(device=ctx.device, dtype=ctx.dtype)
            for phase in phases:
                grad = grad_out if phase == "fwd_bwd" else None
                x.requires_grad_(grad is not None)
                ref = None
                for mode in modes if "eager" in modes else ("eager",) + tuple(modes):
                    step_name = f"{model_name} {phase} {mode}"
                    with watchdog(args.contender_timeout):
                        record, snap = measure_mode(ctx, model, mode, x, grad, ref, tol, time_it=mode in modes)
                    if mode == "eager":
                        ref = snap
                        if "eager" not in modes:
                            continue
                    record.update(model=model_name, phase=phase)
                    data["results"].append(record)
                    status = record["error"] or (
                        f"{record['ms']:.3f} ms, first call {record['first_call_s']:.1f} s, "
                        + (f"err {record['max_error']:.1e} " if "max_error" in record else "reference ")
                        + _fused_summary(record))
                    log(f"{step_name}: {status}")
                    del snap
                    gc.collect()
                    if ctx.is_cuda:
                        torch.cuda.empty_cache()
                    save()
                ref = None
            del model, x, grad_out
            gc.collect()
            if ctx.is_cuda:
                torch.cuda.empty_cache()
    except ContextBroken as e:
        data["context_broken"] = str(e)
        log(f"STOPPING: {e}")
        save()
        if ctx.rank == 0:
            print(format_table(data), flush=True)
        exit_now(3)  # no collective can run any more; peers fail on their own timeouts

    data["complete"] = True
    save()
    if ctx.rank == 0:
        print(f"[bench_model] wrote {out_json}", flush=True)
        print(format_table(data), flush=True)
    try:
        ctx.barrier()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    # Everything is written; skip process-group and symmetric-memory teardown (it has hung at exit).
    exit_now(main())
