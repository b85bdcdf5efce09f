#!/usr/bin/env python3
"""Model-level benchmark: eager, inductor, inductor + async-TP and ``backend="flux"`` on tensor-parallel models,
against the same per-rank work with no communication, alternated in rounds with the host exposed.

Run (one process per GPU; the lead's device call is 2 x H200):

    PYTHONUNBUFFERED=1 torchrun --nproc-per-node 2 benchmarks/bench_model.py --out $OUT/h200x2_tp2_model

Decode-size steps (plain TP, 64 tokens of one position, forward, CUDA graphs):

    torchrun --nproc-per-node 2 benchmarks/bench_model.py --models llama2 --tp plain --seq 1 --batch 64 \\
        --phases fwd --modes inductor,asynctp,flux,nocomm --compile-mode reduce-overhead --out $OUT/decode64_ro

CPU smoke run (gloo, tiny config, fp32, perf_counter timing, 2 rounds):

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

Modes (``--modes``), each on a model instance of its own (same weights), all alive for the whole run of a model:
  eager       the DTensor model as is (also the reference for every error)
  inductor    torch.compile(backend="inductor")
  asynctp     inductor with torch._inductor.config._micro_pipeline_tp = True (PyTorch async-TP), as a backend
              callable of its own (``inductor_asynctp``, registered with dynamo: dynamo tells cached code apart by the
              backend callable only, and applies the config to the forward and the lazily compiled backward);
              symmetric memory enabled for the TP group first where torch has enable_symm_mem_for_group
  flux        torch.compile(backend="flux"), FLUXINDUCTOR_DISPATCH=auto (what users get)
  flux_fused  flux's compiler under a backend callable of its own (``flux_fused``), run under
              FLUXINDUCTOR_DISPATCH=fused (fused kernel wherever eligible)
  nocomm      the same per-rank work with no collective (``models.build_nocomm``), torch.compile(backend="inductor"):
              each rank runs its TP shard as plain modules on its own GPU: column-parallel linears with
              out_features / world (Q/K/V: heads / world query and KV heads), row-parallel linears with
              in_features / world, sequence-parallel norms on S / world rows.  Plain TP: the all-reduces removed,
              exact.  Sequence parallel: each all-gather replaced by a local tile of the rank's rows and each
              reduce-scatter by a view of the rank's rows of the partial sum (backward: the mirror images), so the
              GEMM / attention / norm work is exact and only the collectives' data movement and summation are gone
              (the JSON's ``nocomm`` entry says so per run).  A model whose heads, KV heads, FFN or sequence do not
              divide by the world size has no exact replica: nocomm records an error and G is not reported.
``--tuning key=value[,...]`` sets fluxinductor's kernel-tuning fields (``fluxinductor.settings.set_tuning``) on every
rank for the whole run; the JSON records them (``environment.tuning``).

Order.  Per (model, phase): every mode is compiled and checked first (one call, compared with eager's, then
``--warmup`` untimed steps), in the order eager, inductor, nocomm, flux, flux_fused, asynctp (fluxinductor before
async-TP, as in bench_ops.py, so async-TP's symmetric-memory workspace is allocated last); no
``torch._dynamo.reset()`` between modes (once per model, before its modes are built).  Then the modes that compiled
run untimed rounds for ``--settle-s`` seconds (default 5 on CUDA: the GPU's clock settles at its power cap before
any step is timed; ``rounds[].settle``), then timed in ``--rounds`` rounds (default 5 on CUDA, 2 on CPU or with
--quick), the order rotated by one each round (recorded: ``rounds[].order``, and when each mode's round began,
``rounds[].start_s``), each mode ``--round-warmup`` untimed steps then ``--iters`` timed steps per round.  These
machines are noisy (the GPU's clock drifts under load): alternating spreads drift over all modes alike, and the
spread says how far apart two modes must be to count.  The FX graph cache and the AOTAutograd cache
are off so every mode really compiles and runs its passes; dynamo's recompile limit is raised (every mode adds
cache entries to the model's forward) and automatic dynamic shapes are off (every step has static shapes; a
recompile must not turn a mode's graph dynamic).  ``compiles_while_timed`` counts graphs compiled during a
mode's settling and timed rounds (0 expected), ``graphs_compiled_first_call`` those compiled by its first call in a
phase (at least 1 for a compiled mode: it did not inherit another mode's code).

Timing (``host_exposed``: true).  Each step: gradients dropped (and, with ``--compile-mode reduce-overhead``,
``torch.compiler.cudagraph_mark_step_begin()``), ``dist.barrier`` + ``cuda.synchronize``, then CUDA events around
the step: host time shows where it is not covered by GPU work, as a training or serving loop sees it (the ranks'
skew leaving the barrier, a few microseconds, is in it for every mode alike).  A step's time is the maximum over
ranks; ``ms`` is the median over all steps of all rounds, with ``spread`` (min, p10, p90, max, n) and
``round_median_ms`` (one median per round).  Beside it, never instead of it, ``hidden_host_ms``: in the same
rounds, after the exposed steps, ``--iters`` more steps with the host hidden (``torch.cuda._sleep`` before the start
event, so the host enqueues the step while the GPU sleeps and the events measure device time).  A sleep of so many
cycles is shorter under load than on the idle GPU, so the sleep is sized to outlast the slowest host-exposed
enqueue by half again at the fastest clock a sleep ran at (``--sleep-cycles`` at least), the same for every contender
once each has run a round (a sleep also lets the clock recover from the power cap), and a one-element all-reduce
behind it starts the step on every rank together (GPUs whose clocks differ end the same sleep apart).  Each step's
sleep (with the alignment) is measured, ``hidden_host_sleep_ms`` is their median and ``hidden_host_covered`` the share of steps whose
sleep outlasted their enqueue (the first steps' may not: the idle GPU's clock is the first guess; ``--sleep-cycles
0``: no hidden-host figure).  On CPU: ``time.perf_counter`` around the step after a barrier (host exposed; no
hidden-host figure).

G.  Per (model, phase), from the host-exposed medians: ``G = (T_inductor - T_mode) / (T_inductor - T_nocomm)``,
the share of inductor's communication cost that a mode removes (1: all of it, 0: none, < 0: slower than inductor),
for flux, flux_fused and asynctp, with G per round (from the round medians of the same round) and its min and max
(``gain`` in each result and the JSON's top-level ``gain``); also from the hidden-host medians
(``gain_hidden_host``).  Call a difference real only when it outlasts the spread.

Recorded per (model, phase, mode) besides the times: first-call seconds (compile + one call, max over ranks), the
largest error against eager (max |out - ref| / max |ref| and ||out - ref|| / ||ref||, for the output and, with
backward, the input and parameter gradients; max over ranks; nocomm has none: other weights, partial sums), for
flux modes ``fluxinductor.rewrite_stats()`` deltas (fused and skipped while compiling the forward and the backward;
run-time fallbacks to the decomposition while timed), and for inductor modes (nocomm included) a census of the
collective / fused ops left in each post-grad graph (``symm_mem`` ops = async-TP fired).

A mode that raises is recorded with its error and left out of the rounds (or, raising while timed, of the later
rounds, its times dropped); a mode that hangs past ``--contender-timeout`` seconds (its compile, or one round of
it) ends the run (every thread's stack dumped) with the JSON written so far.  ``<out>.json`` (device, versions, git
sha, settings, every raw number) is rewritten after every compile and round (``"complete": false`` until the end);
the table is printed last: host-exposed median and spread first, then the hidden-host median, G and its range.
"""

from __future__ import annotations

import argparse
import collections
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
    align_ranks,
    apply_tuning,
    cell,
    environment,
    exit_now,
    output_prefix,
    parse_tuning,
    settle as settle_turns,
    time_iterations,
    watchdog,
    write_json,
)
from model_modes import DEFAULT_MODES, FLUX_DISPATCH, GAIN_MODES, MODES, RUN_ORDER, compare, mode_setup, snapshot
from models import (CONFIGS, MODELS, NOCOMM_METHOD, build_model, build_nocomm, input_shape, nocomm_approximation,
                    solo_mesh, tokens_shape)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:  # fluxinductor from this checkout when it is not installed (backend="flux" needs it installed)
    sys.path.append(REPO)

PHASES = ("fwd", "fwd_bwd")
# Norm-relative error against eager that counts as "ok" (the compiled graph reorders bf16 math).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}
# Every mode adds dynamo cache entries to the model's forward (per backend, per grad mode): torch's default limit
# (8) would send the last modes to eager without a word.
RECOMPILE_LIMIT = 64

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
        self.solo_mesh = solo_mesh(self.device.type)  # nocomm's: this rank alone
        self.group_name = self.mesh.get_group().group_name
        self.dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if self.is_cuda else torch.float32)
        # --autocast: fp32 weights and inputs, each step under torch.autocast in this dtype (mixed-precision training)
        self.autocast = DTYPES[args.autocast] if args.autocast else None
        if self.autocast is not None:
            if args.dtype not in (None, "fp32"):
                raise SystemExit(f"--autocast runs an fp32 model; --dtype {args.dtype} contradicts it")
            self.dtype = torch.float32
        self.warmup, self.iters, self.sleep_cycles = args.warmup, args.iters, args.sleep_cycles
        self.rounds = args.rounds if args.rounds is not None else (5 if self.is_cuda and not args.quick else 2)
        self.round_warmup = args.round_warmup
        self.settle_s = args.settle_s if args.settle_s is not None else (5.0 if self.is_cuda else 0.0)
        # The hidden-host figure: CUDA only, off with --sleep-cycles 0.
        self.hidden = self.is_cuda and self.sleep_cycles > 0
        self.sleep_ms: Optional[float] = None  # --sleep-cycles on the idle GPU, measured at the start
        self.sleep_rate = 0.0  # the fastest clock a hidden-host sleep has run at, cycles per ms
        self.hidden_cycles = 0  # this phase's hidden-host sleep so far (hidden_sleep_cycles)
        self.align_token = torch.zeros(1, device=self.device) if self.hidden else None
        self.profile, self.profile_trace, self.profile_seq = args.profile, args.profile_trace, 0
        self.profile_exposed = args.profile_exposed
        self.compile_kwargs = {} if args.compile_mode is None else {"mode": args.compile_mode}
        if args.dynamic:
            self.compile_kwargs["dynamic"] = True
        self.cudagraphs = args.compile_mode == "reduce-overhead"
        self.flux_options = parse_tuning(args.flux_options)
        self.t0 = time.monotonic()  # the run's start: rounds record when each mode's round began (``start_s``)

    def before_step(self, model: nn.Module, x: torch.Tensor) -> None:
        """Before every step, outside the timed region: gradients dropped; with CUDA graph trees a new step begun
        (the modes' graphs alternate; no output of an earlier step is held)."""
        _drop_grads(model, x)
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()


# ---------------------------------------------------------------------------------------------------
# One step, its statistics
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


def spread(times: List[float]) -> dict:
    """Median, min, p10, p90, max and count of ``times`` (nearest-rank percentiles)."""
    ordered = sorted(times)
    n = len(ordered)
    pick = lambda q: ordered[min(n - 1, max(0, int(round(q * (n - 1)))))]  # noqa: E731
    return {"median_ms": statistics.median(ordered), "min_ms": ordered[0], "p10_ms": pick(0.1),
            "p90_ms": pick(0.9), "max_ms": ordered[-1], "n": n}


def _step_max(per_rank_rounds: List[List[List[float]]]) -> List[List[float]]:
    """Per round, each step's time as the maximum over ranks (``per_rank_rounds[rank][round][step]``)."""
    return [[max(col) for col in zip(*(rank[r] for rank in per_rank_rounds))]
            for r in range(len(per_rank_rounds[0]))]


def _add_counts(total: dict, delta: dict) -> dict:
    """``{op: {reason: n}}`` sums (run-time fallbacks over several rounds)."""
    for op, reasons in delta.items():
        mine = total.setdefault(op, {})
        for reason, n in reasons.items():
            mine[reason] = mine.get(reason, 0) + n
    return total


def _compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ---------------------------------------------------------------------------------------------------
# Contenders: one mode on one model instance
# ---------------------------------------------------------------------------------------------------


class Contender:
    """One mode of one model: its own model instance, its callable (compiled at the first call), its context and
    census; what it measured in the current phase (this rank's)."""

    def __init__(self, mode: str, model: nn.Module, ctx: Ctx):
        self.mode, self.model = mode, model
        self.is_flux = mode in FLUX_DISPATCH
        self.notes: List[str] = []
        fn, self.make_context, self.census = mode_setup(mode, model, ctx, self.notes)
        self.fn = _under_autocast(fn, ctx.device.type, ctx.autocast) if ctx.autocast is not None else fn
        self.reset_phase()

    def reset_phase(self) -> None:
        self.exposed: List[List[float]] = []
        self.host: List[List[float]] = []
        self.hidden: List[List[float]] = []
        self.hidden_host: List[List[float]] = []
        self.sleeps: List[List[float]] = []
        self.fallbacks: dict = {}
        self.compiles = 0
        self.profile_top: Optional[List[dict]] = None


def build_contenders(ctx: Ctx, model_name: str, cfg: dict, args, modes: List[str], log) -> Dict[str, Contender]:
    """Eager (always: the reference) and every mode in ``modes``, each on a model instance of its own.  A mode whose
    model cannot be built is returned as an error string in place of the contender."""
    out: Dict[str, object] = {}
    for mode in ("eager",) + tuple(m for m in modes if m != "eager"):
        local = {"error": None}
        try:
            if mode == "nocomm":
                model = build_nocomm(model_name, cfg, ctx.world, ctx.device, ctx.dtype, args.mlp_shard_dim, args.tp,
                                     ctx.solo_mesh)
            else:
                model = build_model(model_name, cfg, ctx.mesh, ctx.device, ctx.dtype, args.mlp_shard_dim, args.tp)
            cont = Contender(mode, model, ctx)
        except Exception as e:  # noqa: BLE001
            local["error"] = f"building {model_name} for {mode} failed: {type(e).__name__}: {e}"
            local["traceback"] = traceback.format_exc(limit=8)
            if not ctx.context_ok():
                raise ContextBroken(local["error"]) from e
        everyone, error = agree(ctx, {"error": local["error"]})
        if error is not None:
            if mode == "eager":
                raise RuntimeError(error + "\n" + local.get("traceback", ""))
            log(f"{model_name} {mode}: {error}")
            out[mode] = error
        else:
            out[mode] = cont
    return out


PROFILE_LEAD, PROFILE_STEPS = 6, 2  # steps run back to back before the profiled ones; steps profiled


def profile_step(ctx: Ctx, cont: Contender, x: torch.Tensor, grad, top: int) -> List[dict]:
    """Profile the steady state: ``PROFILE_LEAD`` steps back to back, then the same again under torch.profiler,
    with no synchronization between steps, so the GPU never idles and runs at the clocks a training loop holds (a
    lone step after an idle GPU runs faster than the timed ones).  With ``--profile-exposed``, the steps are the timed
    host-exposed ones instead (a barrier and a synchronization before each): the trace's runtime calls then show
    where the GPU waited for the host.  Returns this rank's ``top`` GPU kernels by total device time over the
    profiled steps (name, calls, us)."""
    from torch.profiler import ProfilerActivity, profile

    def steps(count: int) -> None:
        for _ in range(count):
            if ctx.profile_exposed:
                ctx.barrier()
                ctx.sync()
            ctx.before_step(cont.model, x)
            _step(cont.fn, x, grad)

    ctx.barrier()
    ctx.sync()
    steps(PROFILE_LEAD)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps(PROFILE_STEPS)
        ctx.sync()
    if ctx.profile_trace:
        prof.export_chrome_trace(f"{ctx.profile_trace}_{ctx.profile_seq}_rank{ctx.rank}.json")
        ctx.profile_seq += 1
    rows = [{"name": e.key[:120], "calls": e.count, "us": round(e.device_time_total, 1)}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us"])[:top]


# ---------------------------------------------------------------------------------------------------
# Compile and check one mode; time one round of it
# ---------------------------------------------------------------------------------------------------


def first_call(ctx: Ctx, cont: Contender, phase: str, x: torch.Tensor, grad, ref: Optional[dict],
               tol: float) -> Tuple[dict, Optional[Dict[str, torch.Tensor]]]:
    """The phase's first call (compiles), checked against ``ref``, then ``ctx.warmup`` untimed steps.

    Returns (the record every rank agrees on, this rank's output / gradient snapshot from the first call; None for
    nocomm, whose numbers are not eager's).
    """
    import fluxinductor
    from fluxinductor.log import rewrite_stats_delta

    mode, model, backward = cont.mode, cont.model, grad is not None
    local: dict = {"error": None, "notes": list(cont.notes)}
    census_from = len(cont.census.graphs) if cont.census is not None else 0
    snap = None
    try:
        if os.environ.get("BENCH_MODEL_INJECT_ERROR") == f"{mode}:{phase}":
            # Test hook (tests/benchmarks/test_bench_model.py): a mode that fails on every rank before it runs.
            raise RuntimeError("injected by BENCH_MODEL_INJECT_ERROR")
        graphs0 = _compiled_graphs()
        with cont.make_context():
            ctx.before_step(model, x)
            s0 = fluxinductor.rewrite_stats()
            ctx.barrier()
            ctx.sync()
            t0 = time.perf_counter()
            out = cont.fn(x) if backward else _step(cont.fn, x, None)
            s1 = fluxinductor.rewrite_stats()
            if backward:
                out.backward(grad)
            ctx.sync()
            local["first_call_s"] = time.perf_counter() - t0
            local["graphs_compiled"] = _compiled_graphs() - graphs0
            s2 = fluxinductor.rewrite_stats()
            if mode == "nocomm":
                local["errors"] = None
                local["notes"].append("no errors: the replica has other weights and returns partial sums")
            else:
                snap = snapshot(model, out, x, backward)
                local["errors"] = compare(snap, ref) if ref is not None else None
            del out
            for _ in range(ctx.warmup):
                ctx.before_step(model, x)
                _step(cont.fn, x, grad)
            ctx.sync()
        if cont.is_flux:
            fwd, bwd = rewrite_stats_delta(s1, s0), rewrite_stats_delta(s2, s1)
            local["rewrite_stats"] = {
                "fused_forward": fwd["fused"], "fused_backward": bwd["fused"],
                "skipped_forward": fwd["skipped"], "skipped_backward": bwd["skipped"],
                "fallbacks_first_call": rewrite_stats_delta(s2, s0)["fallbacks"],
            }
        if cont.census is not None:
            local["graph_census"] = list(cont.census.graphs[census_from:])
    except Exception as e:  # noqa: BLE001
        local["error"] = f"{type(e).__name__}: {e}"
        local["traceback"] = traceback.format_exc(limit=8)
        snap = None
        if not ctx.context_ok():
            raise ContextBroken(f"{mode} broke the CUDA context: {ctx.broken}") from e
    finally:
        _drop_grads(model, x)

    everyone, error = agree(ctx, {k: v for k, v in local.items() if k != "traceback"})
    record: dict = {"mode": mode, "ms": None, "error": None, "notes": everyone[0]["notes"]}
    if error is not None:
        record["error"] = error
        if "traceback" in local:
            record["traceback_rank%d" % ctx.rank] = local["traceback"]
        return record, None
    record["first_call_s"] = max(r["first_call_s"] for r in everyone)
    record["rank_first_call_s"] = [r["first_call_s"] for r in everyone]
    # Graphs dynamo compiled in the first call: >= 1 for a compiled mode, so it did not reuse another mode's code.
    record["graphs_compiled_first_call"] = max(r["graphs_compiled"] for r in everyone)
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
    if cont.is_flux:
        record["rewrite_stats"] = everyone[0]["rewrite_stats"]
        record["rewrite_stats_per_rank_equal"] = all(r["rewrite_stats"] == everyone[0]["rewrite_stats"]
                                                     for r in everyone)
    if cont.census is not None:
        record["graph_census"] = everyone[0]["graph_census"]
    return record, snap


def hidden_sleep_cycles(ctx: Ctx, host_ms: float) -> int:
    """The GPU sleep, in cycles, before each host-hidden step: enough to outlast ``host_ms`` (this round's slowest
    host-exposed enqueue) by half again at the fastest clock a sleep has run at (cycles per ms; before any, the rate
    measured on the idle GPU at the start, which runs slower, so the first steps may sleep too little: each step's
    sleep and enqueue are recorded, ``hidden_host_covered`` counts the steps whose sleep outlasted their enqueue),
    ``--sleep-cycles`` at least.  It only grows within a phase, so from the round in which every contender has run
    they all sleep alike: a sleep also lets the GPU's clock recover from its power cap."""
    rate = ctx.sleep_rate or (ctx.sleep_cycles / ctx.sleep_ms if ctx.sleep_ms else 0.0)
    ctx.hidden_cycles = max(ctx.hidden_cycles, ctx.sleep_cycles, int(1.5 * host_ms * rate))
    return ctx.hidden_cycles


def time_round(ctx: Ctx, cont: Contender, x: torch.Tensor, grad, record: bool = True) -> Optional[str]:
    """One round of ``cont``: ``ctx.round_warmup`` untimed steps, ``ctx.iters`` host-exposed steps, then (CUDA, sleep
    on) ``ctx.iters`` host-hidden steps, appended to the contender's lists (``record``; else dropped: a settling
    round).  Returns this rank's error, if any."""
    import fluxinductor
    from fluxinductor.log import rewrite_stats_delta

    before = lambda: ctx.before_step(cont.model, x)  # noqa: E731
    step = lambda: _step(cont.fn, x, grad)  # noqa: E731
    graphs0 = _compiled_graphs()
    s0 = fluxinductor.rewrite_stats()
    try:
        with cont.make_context():
            times, host = time_iterations(ctx, step, ctx.round_warmup, ctx.iters, sleep_cycles=None,
                                          before_iter=before)
            hidden = hidden_host = None
            sleeps: List[float] = []
            if ctx.hidden:
                cycles = hidden_sleep_cycles(ctx, max(host))
                align = (lambda: align_ranks(ctx.align_token)) if ctx.world > 1 else None
                hidden, hidden_host = time_iterations(ctx, step, 0, ctx.iters, sleep_cycles=cycles,
                                                      before_start=align, before_iter=before, sleeps=sleeps)
                ctx.sleep_rate = max([ctx.sleep_rate] + [cycles / ms for ms in sleeps if ms > 0])
    except Exception as e:  # noqa: BLE001
        if not ctx.context_ok():
            raise ContextBroken(f"{cont.mode} broke the CUDA context while timed: {ctx.broken}") from e
        return f"while timing: {type(e).__name__}: {e}"
    finally:
        _drop_grads(cont.model, x)
    cont.compiles += _compiled_graphs() - graphs0
    if not record:
        return None
    cont.exposed.append(times)
    cont.host.append(host)
    if hidden is not None:
        cont.hidden.append(hidden)
        cont.hidden_host.append(hidden_host)
        cont.sleeps.append(sleeps)
    if cont.is_flux:
        _add_counts(cont.fallbacks, rewrite_stats_delta(fluxinductor.rewrite_stats(), s0)["fallbacks"])
    return None


def settle(ctx: Ctx, conts: List[Contender], x: torch.Tensor, grad) -> dict:
    """Untimed rounds of every contender in turn (a round's steps, host exposed and hidden, their times dropped), until
    rank 0 has run them for ``ctx.settle_s`` seconds; every rank runs the same rounds.  Stops early where a contender
    fails (the timed rounds then record it).  Returns the rounds run and the seconds taken (rank 0's).

    An idle GPU starts at its top clock; once its power reaches the cap the clock falls for some seconds below where
    the rounds' mix of steps and sleeps then holds it (2×H200, S 16384: a median of 1635 MHz over the first 3 s at 690
    W, 1830 in the rounds after).  Without this the contenders of round 1 ran 0.5–2 ms a step slower, and the first of them, before the
    cap, faster (``benchmarks/results/settle_ab/``)."""

    def turn(cont: Contender):
        return lambda: None if agree(ctx, {"error": time_round(ctx, cont, x, grad, record=False)})[1] is None \
            else "a contender failed"

    return settle_turns(ctx, [turn(cont) for cont in conts], ctx.settle_s)


def summarize(ctx: Ctx, cont: Contender, record: dict) -> None:
    """Gather every rank's round times of ``cont`` into ``record``: host-exposed ``ms`` (median over all steps of
    each step's maximum over ranks), its ``spread`` and ``round_median_ms``, and the hidden-host figures."""
    local = {"exposed": cont.exposed, "host": cont.host, "hidden": cont.hidden, "hidden_host": cont.hidden_host,
             "sleeps": cont.sleeps,
             "fallbacks": cont.fallbacks, "compiles": cont.compiles, "profile_top": cont.profile_top}
    everyone = ctx.gather(local)
    if not everyone[0]["exposed"]:
        return
    rounds = _step_max([r["exposed"] for r in everyone])
    steps = [t for rnd in rounds for t in rnd]
    record["ms"] = statistics.median(steps)
    record["host_exposed"] = True
    record["spread"] = spread(steps)
    record["round_median_ms"] = [statistics.median(rnd) for rnd in rounds]
    record["iter_max_median_ms"] = record["ms"]
    record["iter_ms"] = [[t for rnd in r["exposed"] for t in rnd] for r in everyone]
    record["rank_median_ms"] = [statistics.median(t) for t in record["iter_ms"]]
    record["host_enqueue_ms"] = [statistics.median(t for rnd in r["host"] for t in rnd) for r in everyone]
    record["compiles_while_timed"] = max(r["compiles"] for r in everyone)
    if everyone[0]["hidden"]:
        hidden_rounds = _step_max([r["hidden"] for r in everyone])
        hidden_steps = [t for rnd in hidden_rounds for t in rnd]
        record["hidden_host_ms"] = statistics.median(hidden_steps)
        record["hidden_host_spread"] = spread(hidden_steps)
        record["hidden_host_round_median_ms"] = [statistics.median(rnd) for rnd in hidden_rounds]
        record["hidden_host_iter_ms"] = [[t for rnd in r["hidden"] for t in rnd] for r in everyone]
        record["hidden_host_enqueue_ms"] = [statistics.median(t for rnd in r["hidden_host"] for t in rnd)
                                            for r in everyone]
        pairs = [(s, h) for r in everyone for srnd, hrnd in zip(r["sleeps"], r["hidden_host"])
                 for s, h in zip(srnd, hrnd)]
        if pairs:
            record["hidden_host_sleep_ms"] = statistics.median(s for s, _ in pairs)
            record["hidden_host_covered"] = sum(s > h for s, h in pairs) / len(pairs)
    if everyone[0]["profile_top"] is not None:
        record["profile_top"] = [r["profile_top"] for r in everyone]
    if cont.is_flux:
        fb = everyone[0]["fallbacks"]
        record["fallbacks_timed"] = fb
        # Which path the timed calls took: "fused" when no call fell back to the decomposition.
        record["path"] = "fused" if not fb else "decomposed: " + "; ".join(
            f"{op}: {reason} (x{n})" for op, reasons in fb.items() for reason, n in reasons.items())


def run_phase(ctx: Ctx, conts: Dict[str, object], model_name: str, phase: str, modes: List[str], x: torch.Tensor,
              grad, tol: float, timeout: float, data: dict, log, save) -> None:
    """Compile and check every mode for ``phase``, then time them in rotating rounds; results into ``data``."""
    records: Dict[str, dict] = {}
    ref = None
    ctx.hidden_cycles = 0
    for mode in ("eager",) + tuple(m for m in RUN_ORDER if m in modes and m != "eager"):
        cont = conts.get(mode)
        if isinstance(cont, str):  # its model could not be built
            record = {"mode": mode, "ms": None, "error": cont, "notes": []}
        else:
            cont.reset_phase()
            with watchdog(timeout):
                record, snap = first_call(ctx, cont, phase, x, grad, ref, tol)
            if mode == "eager":
                ref = snap
                if ref is None:
                    log(f"{model_name} {phase} eager failed: {record['error']}; no errors against eager")
            del snap
        record.update(model=model_name, phase=phase)
        if mode in modes:
            records[mode] = record
            data["results"].append(record)
            status = record["error"] or (
                f"first call {record['first_call_s']:.1f} s, "
                + (f"err {record['max_error']:.1e} " if "max_error" in record else "")
                + _fused_summary(record))
            log(f"{model_name} {phase} {mode}: {status}")
        gc.collect()
        save()
    ref = None
    gc.collect()

    live = [m for m in RUN_ORDER if m in records and records[m]["error"] is None]
    rounds_entry = {"model": model_name, "phase": phase, "order": [], "start_s": []}
    data["rounds"].append(rounds_entry)
    if ctx.settle_s > 0 and live:
        with watchdog(timeout):
            rounds_entry["settle"] = settle(ctx, [conts[m] for m in live], x, grad)
        log(f"{model_name} {phase} settled: {rounds_entry['settle']['rounds']} untimed rounds in "
            f"{rounds_entry['settle']['s']:.1f} s")
    for r in range(ctx.rounds):
        order = [m for m in live[r % len(live):] + live[:r % len(live)] if records[m]["error"] is None] if live else []
        rounds_entry["order"].append(order)
        rounds_entry["start_s"].append({})
        for mode in order:
            rounds_entry["start_s"][-1][mode] = round(time.monotonic() - ctx.t0, 3)
            with watchdog(timeout):
                error = time_round(ctx, conts[mode], x, grad)
            _, error = agree(ctx, {"error": error})
            if error is not None:
                records[mode]["error"] = f"round {r}: {error}"
                log(f"{model_name} {phase} {mode}: {records[mode]['error']}")
        if ctx.is_cuda:
            torch.cuda.empty_cache()
        log(f"{model_name} {phase} round {r + 1}/{ctx.rounds}: {','.join(order)}")
        save()
    for mode in live:
        cont, record = conts[mode], records[mode]
        if record["error"] is not None:
            continue
        if ctx.profile and ctx.is_cuda:
            with cont.make_context():
                cont.profile_top = profile_step(ctx, cont, x, grad, ctx.profile)
            _drop_grads(cont.model, x)
        summarize(ctx, cont, record)
        cont.reset_phase()
        hidden = f", host hidden {record['hidden_host_ms']:.3f}" if "hidden_host_ms" in record else ""
        log(f"{model_name} {phase} {mode}: {record['ms']:.3f} ms host exposed (p10 {record['spread']['p10_ms']:.3f}, "
            f"p90 {record['spread']['p90_ms']:.3f}){hidden}")
    save()


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


def gain(t_inductor: Optional[float], t: Optional[float], t_nocomm: Optional[float]) -> Optional[float]:
    """G = (T_inductor - T) / (T_inductor - T_nocomm); None where a time is missing or inductor's communication
    cost (T_inductor - T_nocomm) is not positive."""
    if t_inductor is None or t is None or t_nocomm is None or t_inductor - t_nocomm <= 0:
        return None
    return (t_inductor - t) / (t_inductor - t_nocomm)


def derive(data: dict) -> None:
    """Per (model, phase): speedups of every mode over eager and over inductor, the reference time, and G of each
    mode in GAIN_MODES (host exposed; per round; host hidden), also gathered in ``data["gain"]``."""
    use_anchors = anchors_apply(data)
    data["anchors"] = {"source": "ANCHOR_MS in benchmarks/bench_model.py", "applies": use_anchors,
                       "method": "no GPU sleep before the start event (host enqueue exposed); the reference model "
                                 "code is not in the repository (bias, RoPE details may differ)"}
    by_key: Dict[Tuple[str, str], Dict[str, dict]] = collections.defaultdict(dict)
    for r in data["results"]:
        by_key[(r["model"], r["phase"])][r["mode"]] = r
    data["gain"] = []
    for (model, phase), rows in by_key.items():
        eager = rows.get("eager", {}).get("ms")
        inductor = rows.get("inductor", {}).get("ms")
        for r in rows.values():
            t = r.get("ms")
            r["speedup_vs_eager"] = (eager / t) if (t and eager) else None
            r["speedup_vs_inductor"] = (inductor / t) if (t and inductor) else None
            anchor = ANCHOR_MS.get((r["model"], r["phase"]), {}).get(r["mode"]) if use_anchors else None
            r["anchor_ms"] = anchor
        ind, noc = rows.get("inductor", {}), rows.get("nocomm", {})
        entry = {"model": model, "phase": phase, "inductor_ms": ind.get("ms"), "nocomm_ms": noc.get("ms"),
                 "comm_ms": None, "comm_share": None, "host_exposed": True,
                 "nocomm_approximation": data["settings"]["nocomm"]["approximation"].get(model.split("@")[0]),
                 "modes": {}}
        if ind.get("ms") is not None and noc.get("ms") is not None:
            entry["comm_ms"] = ind["ms"] - noc["ms"]
            entry["comm_share"] = entry["comm_ms"] / ind["ms"]
        for mode in GAIN_MODES:
            r = rows.get(mode)
            if r is None:
                continue
            g = gain(ind.get("ms"), r.get("ms"), noc.get("ms"))
            per_round = [gain(a, b, c) for a, b, c in zip(ind.get("round_median_ms") or (),
                                                          r.get("round_median_ms") or (),
                                                          noc.get("round_median_ms") or ())]
            known = [v for v in per_round if v is not None]
            r["gain"] = g
            r["gain_rounds"] = per_round
            r["gain_min"] = min(known) if known else None
            r["gain_max"] = max(known) if known else None
            r["gain_hidden_host"] = gain(ind.get("hidden_host_ms"), r.get("hidden_host_ms"),
                                         noc.get("hidden_host_ms"))
            entry["modes"][mode] = {"ms": r.get("ms"), "G": g, "G_rounds": per_round, "G_min": r["gain_min"],
                                    "G_max": r["gain_max"], "G_hidden_host": r["gain_hidden_host"]}
        if entry["modes"] or noc:
            data["gain"].append(entry)


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
        colls = sum(v for g in r["graph_census"] for k, v in g.items()
                    if any(c in k for c in ("all_gather", "reduce_scatter", "all_reduce")))
        return f"symm_mem ops {n}, collectives {colls} in {len(r['graph_census'])} graphs"
    return ""


def _gain_cell(r: dict) -> str:
    if r.get("gain") is None:
        return "-"
    lo, hi = r.get("gain_min"), r.get("gain_max")
    return f"{r['gain']:.2f}" + (f" [{lo:.2f},{hi:.2f}]" if lo is not None else "")


def format_table(data: dict) -> str:
    env, s = data["environment"], data["settings"]
    lines = [
        f"bench_model: {env['device']} x{env['world']} {env['backend']} {env['dtype']}"
        f"{' autocast ' + env['autocast'] if env.get('autocast') else ''} torch {env['torch']} "
        f"sha {env['git_sha']} config {s['config']}"
        f"{' compile mode ' + s['compile_mode'] if s.get('compile_mode') else ''}"
        f"{' dynamic' if s.get('dynamic') else ''} "
        f"({s['rounds']} rounds x {s['iters']} steps per mode, order rotated each round; {s['timing']})",
    ]
    width = max([7] + [len(r["model"]) + 1 for r in data["results"]])
    head = (f"{'model':{width}}{'phase':8}{'mode':11}|{'ms':>9}{'p10':>8}{'p90':>8}{'min':>8}{'max':>8} |{'hidden':>8} |"
            f"{'G [round min,max]':>20} |{'/induct':>8}{'anchor':>8}{'first_s':>8} |{'max_err':>8}{'norm_err':>9} "
            f"| round medians; notes")
    lines += [head, "-" * len(head)]
    for r in data["results"]:
        sp = r.get("spread") or {}
        if r.get("error"):
            note = "ERROR " + " ".join(r["error"].split())[:100]
        else:
            rounds = " ".join(f"{t:.3f}" for t in r.get("round_median_ms") or ())
            note = (rounds + "; " if rounds else "") + _fused_summary(r)
        lines.append(
            f"{r['model']:{width}}{r['phase']:8}{r['mode']:11}|{cell(r.get('ms'), width=9)}{cell(sp.get('p10_ms'))}"
            f"{cell(sp.get('p90_ms'))}{cell(sp.get('min_ms'))}{cell(sp.get('max_ms'))} |"
            f"{cell(r.get('hidden_host_ms'))} |{_gain_cell(r):>20} |"
            f"{cell(r.get('speedup_vs_inductor'), '{:.2f}x', 8)}{cell(r.get('anchor_ms'), '{:.2f}', 8)}"
            f"{cell(r.get('first_call_s'), '{:.1f}', 8)} |"
            f"{cell(r.get('max_error'), '{:.1e}', 8)}{cell(r.get('max_norm_error'), '{:.1e}', 9)}"
            f"{'!' if r.get('error_ok') is False else ' '}| {note}")
    for g in data.get("gain") or ():
        parts = [f"{m} {_gain_cell_from(v)}" for m, v in g["modes"].items()]
        comm = (("- (no nocomm time)" if g["nocomm_ms"] is None else "-") if g["comm_ms"] is None else
                f"{g['comm_ms']:.3f} ms ({100 * g['comm_share']:.0f}% of inductor)")
        lines.append(f"G {g['model']} {g['phase']}: communication cost T_inductor - T_nocomm = {comm}; "
                     + ("; ".join(parts) if parts else "no mode to compare"))
    for rd in data.get("rounds") or ():
        lines.append(f"rounds {rd['model']} {rd['phase']}: " + " | ".join(",".join(o) for o in rd["order"]))
    lines.append("ms = steady-state time per step, host exposed (barrier, then CUDA events around the step; a step "
                 "= max over ranks), median over all rounds, p10/p90/min/max over the same steps; hidden = the same "
                 "steps with the host hidden (GPU sleep before the start event: device time); "
                 "G = (T_inductor - T) / (T_inductor - T_nocomm) from the host-exposed medians of all rounds, "
                 "[min,max] of G from each round's own medians; anchor = reference time (ANCHOR_MS, host exposed); first_s = first call incl. compile; "
                 "/induct = T_inductor / T; errors vs eager (max |d|/max|ref|, ||d||/||ref||; '!' over tolerance); "
                 "fwd/bwd[...] = patterns fused by flux (ag = all_gather_matmul, rs = matmul_reduce_scatter)")
    for r in data["results"]:
        for rank, top in enumerate(r.get("profile_top") or ()):
            lines.append(f"profile {r['model']} {r['phase']} {r['mode']} rank {rank}: "
                         + "; ".join(f"{k['name'][:60]} x{k['calls']} {k['us'] / 1e3:.3f} ms" for k in top))
    return "\n".join(lines)


def _gain_cell_from(v: dict) -> str:
    if v.get("G") is None:
        return "G -"
    out = f"G {v['G']:.2f}"
    if v.get("G_min") is not None:
        out += f" [{v['G_min']:.2f},{v['G_max']:.2f}]"
    if v.get("G_hidden_host") is not None:
        out += f" (host hidden {v['G_hidden_host']:.2f})"
    return out


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------


def build_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output prefix: writes <out>.json (a path ending in .json names that file)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--autocast", choices=("bf16", "fp16"), default=None,
                   help="fp32 weights and inputs, every step under torch.autocast in this dtype")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of " + ",".join(PHASES))
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help="comma-separated subset of " + ",".join(MODES) + " (default: all but inductor_overlap)")
    p.add_argument("--config", choices=tuple(CONFIGS), default=None, help="default full on cuda, small on cpu")
    p.add_argument("--seq", type=int, default=None, help="override llama2 S and mlp tokens")
    p.add_argument("--layers", type=int, default=None, help="override the llama2 decoder layer count (2)")
    p.add_argument("--dynamic", action="store_true",
                   help="torch.compile(dynamic=True): one graph per mode serves every size of a --tokens sweep (a "
                        "serving loop's dynamic batch; CUDA graphs are still recorded per size)")
    p.add_argument("--tokens", default=None, metavar="N[,N...]",
                   help="llama2 only: time each of these tokens per step as a row of its own, 'llama2@N' (plain TP: "
                        "a batch of N one-token sequences, as in decode; sequence parallel: one sequence of N tokens), "
                        "every contender built once and compiled for each size (static shapes, as a serving loop "
                        "that compiles per batch size; CUDA graphs per size where the compile mode makes them)")
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
    p.add_argument("--rounds", type=int, default=None,
                   help="timing rounds, the modes' order rotated each round (default 5 on cuda; 2 on cpu or --quick)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per mode after its first call (default 5; --quick 1)")
    p.add_argument("--round-warmup", type=int, default=1, help="untimed steps per mode at the start of each round")
    p.add_argument("--settle-s", type=float, default=None,
                   help="before a phase's timed rounds, run untimed rounds of every mode for at least this many "
                        "seconds, so that the GPU's clock settles at its power cap before any step is timed "
                        "(default 5 on cuda, 0 on cpu)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed steps per mode per round (default 10; --quick 3), host exposed; as many again with "
                        "the host hidden on cuda")
    p.add_argument("--quick", action="store_true", help="fewer rounds and iterations")
    p.add_argument("--sleep-cycles", type=int, default=2_000_000,
                   help="the least torch.cuda._sleep cycles before each start event of the hidden-host steps, "
                        "more where the host's enqueue needs them (0 = no hidden-host figure)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the rounds, profile two steps per mode in the steady state (after six back to back) "
                        "and record each rank's N costliest GPU kernels (JSON profile_top; printed under the table)")
    p.add_argument("--profile-exposed", action="store_true",
                   help="with --profile: profile host-exposed steps (a barrier and a synchronization before each, as "
                        "the timed steps) instead of steps back to back")
    p.add_argument("--profile-trace", default=None, metavar="PREFIX",
                   help="with --profile: also write each profiled step's Chrome trace to PREFIX_<i>_rank<r>.json")
    p.add_argument("--pg-timeout", type=float, default=180.0, help="process-group timeout, seconds")
    p.add_argument("--contender-timeout", type=float, default=150.0,
                   help="seconds one mode's compile (first call, check, warm-ups) or one round of it may take "
                        "before the run exits")
    args = p.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    args.iters = args.iters if args.iters is not None else (3 if args.quick else 10)
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.iters < 1:
        p.error("--iters must be at least 1")
    for flag, allowed in (("models", MODELS), ("phases", PHASES), ("modes", MODES)):
        for name in getattr(args, flag).split(","):
            if name not in allowed:
                p.error(f"unknown {flag[:-1]} {name!r} (choose from {','.join(allowed)})")
    if args.tokens is not None:
        try:
            tokens = [int(t) for t in args.tokens.split(",")]
        except ValueError:
            p.error(f"--tokens takes positive integers, got {args.tokens!r}")
        if min(tokens) < 1:
            p.error(f"--tokens takes positive integers, got {args.tokens!r}")
        if args.models != "llama2" or args.seq is not None or args.batch is not None:
            p.error("--tokens sweeps llama2's tokens per step: give --models llama2 and neither --seq nor --batch")
        args.tokens = sorted(set(tokens))
    try:
        parse_tuning(args.tuning)
        if parse_tuning(args.flux_options) and args.compile_mode:
            p.error("--flux-options and --compile-mode: torch.compile takes options or a mode, not both")
    except ValueError as e:
        p.error(str(e).replace("--tuning", "--tuning/--flux-options"))
    return args


def configure_compile() -> dict:
    """What every mode compiles under (recorded in the settings): no FX graph / AOTAutograd cache hits, so every mode
    compiles and runs its passes; room in dynamo's cache for every mode's entries; static shapes."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    for cfg_module, attr in ((inductor_config, "fx_graph_cache"), (inductor_config, "fx_graph_remote_cache"),
                             (functorch_config, "enable_autograd_cache"),
                             (functorch_config, "enable_remote_autograd_cache")):
        if hasattr(cfg_module, attr):
            setattr(cfg_module, attr, False)
    for attr in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, attr):
            setattr(dynamo_config, attr, max(getattr(dynamo_config, attr), RECOMPILE_LIMIT))
    dynamo_config.automatic_dynamic_shapes = False
    return {"recompile_limit": RECOMPILE_LIMIT, "automatic_dynamic_shapes": False}


def main(argv=None) -> int:
    args = build_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    dynamo_settings = configure_compile()

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
    sweep = args.tokens  # sorted sizes, or None
    if sweep:
        # Every contender is built once, for the largest size (its RoPE tables cover every sequence length).
        configs["llama2"].update(tokens_shape(args.tp, max(sweep)))
    phases = [p for p in PHASES if p in args.phases.split(",")]
    modes = [m for m in RUN_ORDER if m in args.modes.split(",")]
    tol = TOLERANCE[ctx.autocast or ctx.dtype]
    timing = ("cuda_events: per step, gradients dropped, dist.barrier + cuda.synchronize, then CUDA events around "
              "the step (host exposed); a step = max over ranks; median over all rounds") if ctx.is_cuda else \
        "perf_counter around each step after dist.barrier (host exposed); a step = max over ranks; median over all rounds"
    sleep_ms = ctx.sleep_ms = measure_sleep_ms(ctx) if ctx.hidden else None
    data = {
        "schema": "fluxinductor.bench_model/2",
        "complete": False,
        "environment": run_environment(ctx, tuning_values),
        "settings": {"config": config_name, "models": {m: configs[m] for m in models}, "phases": phases,
                     "modes": modes, "mlp_shard_dim": args.mlp_shard_dim, "tp": args.tp,
                     "compile_mode": args.compile_mode, "dynamic": args.dynamic, "tokens": sweep,
                     "tokens_skipped": [],
                     "flux_options": ctx.flux_options, "warmup": ctx.warmup, "round_warmup": ctx.round_warmup,
                     "settle_s": ctx.settle_s,
                     "rounds": ctx.rounds, "iters": ctx.iters, "host_exposed": True,
                     "order": "per (model, phase): every mode compiled and checked in RUN_ORDER, untimed rounds for "
                              "settle_s seconds (rounds[].settle), then timed in rounds, the order rotated by one "
                              "each round (rounds[].order)",
                     "hidden_host": ({"iters": ctx.iters, "sleep_cycles": ctx.sleep_cycles, "sleep_ms": sleep_ms,
                                      "method": "the same rounds, after the host-exposed steps: torch.cuda._sleep "
                                                "before the start event, so the events measure device time"}
                                     if ctx.hidden else None),
                     "sleep_cycles": ctx.sleep_cycles if ctx.is_cuda else None,
                     "sleep_ms": sleep_ms, "timing": timing, "tolerance_norm_rel": tol,
                     "nocomm": {"method": NOCOMM_METHOD,
                                "approximation": {m: nocomm_approximation(m, args.tp) or None for m in models},
                                "exact": {m: not nocomm_approximation(m, args.tp) for m in models}},
                     "gain_formula": "G = (T_inductor - T_mode) / (T_inductor - T_nocomm), host-exposed medians",
                     "fx_graph_cache": False, "autograd_cache": False, "dynamo": dynamo_settings,
                     "contender_timeout_s": args.contender_timeout,
                     "start_unix_s": round(time.time() - (time.monotonic() - ctx.t0), 3)},
        "results": [],
        "rounds": [],
    }
    out_json = os.path.abspath(output_prefix(args.out) + ".json")

    def log(msg: str) -> None:
        if ctx.rank == 0:
            print(f"[bench_model {time.monotonic() - ctx.t0:.1f}s] {msg}", flush=True)

    def save() -> None:
        if ctx.rank == 0:
            derive(data)
            write_json(out_json, data)

    save()
    try:
        for model_name in models:
            cfg = configs[model_name]
            torch._dynamo.reset()  # once per model, before its modes are built; never between modes
            try:
                conts = build_contenders(ctx, model_name, cfg, args, modes, log)
            except ContextBroken:
                raise
            except Exception as e:  # noqa: BLE001
                msg = f"building {model_name} failed: {type(e).__name__}: {e}"
                log(msg)
                data.setdefault("model_errors", {})[model_name] = msg
                save()
                continue
            for tokens in sweep or (None,):
                label, cfg_n = model_name, cfg
                if tokens is not None:
                    label, cfg_n = f"{model_name}@{tokens}", dict(cfg, **tokens_shape(args.tp, tokens))
                    if args.tp == "sequence" and tokens % ctx.world:
                        log(f"{label}: skipped (sequence parallel needs tokens divisible by {ctx.world})")
                        data["settings"]["tokens_skipped"].append(tokens)
                        continue
                shape = input_shape(model_name, cfg_n, ctx.world, args.mlp_shard_dim, args.tp)
                # Plain TP: the input and the output's gradient are replicated, so every rank draws the same ones.
                gen = torch.Generator().manual_seed(args.seed * 1000 + (0 if args.tp == "plain" else ctx.rank))
                x = torch.randn(shape, generator=gen).to(device=ctx.device, dtype=ctx.dtype)
                grad_out = torch.randn(shape, generator=gen).to(device=ctx.device, dtype=ctx.dtype)
                for phase in phases:
                    grad = grad_out if phase == "fwd_bwd" else None
                    x.requires_grad_(grad is not None)
                    run_phase(ctx, conts, label, phase, modes, x, grad, tol, args.contender_timeout, data, log, save)
                del x, grad_out
            del conts
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
