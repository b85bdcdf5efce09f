#!/usr/bin/env python3
"""Op-level benchmark: fused AG+GEMM / GEMM+RS against cuBLAS, NCCL and torch async-TP, side by side.

Run (one process per GPU; any world size):

    torchrun --nproc-per-node 2 benchmarks/bench_ops.py --out $OUT/h200x2_tp2_ops --emit-tuning auto

CPU smoke run (gloo, tiny shapes, perf_counter timing; the GPU-only contenders record "unavailable"):

    torchrun --nproc-per-node 2 benchmarks/bench_ops.py --device cpu --quick --out /tmp/ops_cpu

Shapes are *global* GEMMs (M, K, N), as in docs/performance.md:
AG+GEMM: each rank holds A_shard [M/w, K] and B [K, N/w], out [M, N/w];
GEMM+RS: each rank holds A [M, K/w] and B [K/w, N], out [M/w, N].

Contenders (``--contenders``), each timed on the same inputs:
  gemm          cuBLAS ``torch.mm`` on the per-rank problem (AG: the gathered A [M, K] @ B)
  comm          the NCCL collective alone (all_gather_into_tensor / reduce_scatter_tensor)
  nccl_seq      collective then GEMM (AG), GEMM then collective (RS)
  asynctp       torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter (PyTorch async-TP)
  fused         torch.ops.fluxinductor.* with FLUXINDUCTOR_DISPATCH=fused (a call that falls back to the
                decomposition is reported as unavailable, with the fallback's reason)
  fused_copy    GEMM+RS only: as ``fused``, with tuning gemm_rs_push=copy (peer tiles moved by the copy
                engine; the cost model may pick this transport per shape)
  fused_split   GEMM+RS only: as ``fused``, with tuning gemm_rs_push=split (a ring of stock CUTLASS GEMMs,
                one per segment, the copy engine between them), in configuration 0 (cooperative 128x256)
  fused_split2  GEMM+RS only: ``fused_split`` in configuration 2 (ping-pong 128x192, bf16); the tuning table keeps
                the faster of the two per shape (``split_config``) and the dispatcher runs that one
  fused_nocomm  fluxinductor.kernels.{ag_gemm,gemm_rs}.gemm_only(a, b, None): the fused kernel, communication off
  split_nocomm  GEMM+RS only: gemm_rs.gemm_only(a, b, None, split=True): the split transport's two GEMMs,
                communication off (configuration 0); split2_nocomm: the same in configuration 2
  auto          torch.ops.fluxinductor.* with FLUXINDUCTOR_DISPATCH=auto (cost model; what users get)

Timing (docs/performance.md): CUDA events around each call, dist.barrier + cuda synchronize before each
iteration, median of ``--iters`` after ``--warmup`` warm-ups per rank, max over ranks.  On GPUs a one-element
all-reduce sits between the host-hiding sleep and the start event (``--align-start``, default on): without it the
host's skew leaving the barrier (up to ~40 us) was timed on whichever rank started first, once the op synchronized
the ranks.
Every contender's output is checked once per shape against an fp32 reference: ||out - ref|| / ||ref||, max over
ranks.

Order (``--interleave``, default): per shape, every contender but auto is checked (gemm, comm, nccl_seq, then
fluxinductor's, then asynctp), then timed in ``--rounds`` rounds (default 4), each round a share of every
contender's calls, the order rotated by one per round.  An H200 under sustained GEMM load slows down within
seconds to a minute; timed one after another, the contenders that ran first (cuBLAS) had the cooler GPU.  Before a
phase's first shape is timed, its contenders run untimed, in turn, for ``--settle-s`` seconds (default 5 on CUDA, 0 on
CPU; the shape's ``settle`` in the JSON), so that the first round does not run at an idle GPU's top clock.  Then auto,
every shape, in its own phase.  ``--no-interleave``: phases, every shape per phase: (gemm, comm,
nccl_seq), then (fused_nocomm, split_nocomm, fused, fused_copy, fused_split), then (asynctp), then (auto), each
contender's calls back to back.  Either way fluxinductor allocates before async-TP: torch's symmetric memory lets a
backend be chosen (``set_backend``) only before its first allocation, and async-TP allocates with the default
backend.  With ``--emit-tuning`` the cost-model table is written from this run's numbers before the auto
phase, so ``auto`` measures what users get with that table.  A CUDA error that breaks the context loses
only the later shapes and phases: ``<out>.json`` is rewritten after every shape (``"complete": false`` until the
end).

``--tuning key=value[,...]`` sets fluxinductor's kernel-tuning fields (``fluxinductor.settings.set_tuning``) on every
rank for the whole run, e.g. ``--tuning ag_variant=5`` (a tuning build's AG+GEMM variant); the JSON records them.

Outputs on rank 0: ``<out>.json`` (device, versions, git sha, every raw number), ``<out>.png`` (needs
matplotlib; skipped with a note otherwise), optionally the cost-model table (``--emit-tuning``), and the
table printed last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from harness import (
    DTYPES,
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
    per_rank_summary,
    settle as settle_turns,
    time_iterations,
    watchdog,
    write_json,
)
from op_contenders import (  # noqa: F401 - the contenders' names stay importable from here
    CONTENDERS,
    DISPATCHED,
    KERNEL_CONTENDERS,
    OP_LABEL,
    OP_NAME,
    OPS,
    OVERLAPPED,
    PHASES,
    TOLERANCE,
    Problem,
    _fallbacks,
    _path_label,
    _reset_fallbacks,
    contender_settings,
    kernel_error_check,
    rel_err,
    setup_error,
)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# The reference shapes of docs/performance.md, M in {512, 3072} at K=8192 N=28672, and Flux's GEMM+RS demo shape.
ANCHOR_SHAPES = [(4096, 12288, 49152), (8192, 8192, 28672), (2048, 8192, 28672), (16384, 8192, 28672),
                 (1024, 8192, 8192)]
EXTRA_SHAPES = [(512, 8192, 28672), (3072, 8192, 28672), (4096, 49152, 12288)]
DEFAULT_SHAPES = ANCHOR_SHAPES + EXTRA_SHAPES
# Flux's demo shapes (arXiv 2406.06858, its TP=8 table on H800), each for one op: `--shapes flux`.
FLUX_M = (1024, 2048, 4096, 8192, 16384)
FLUX_DEMO = [("ag_gemm", (m, 12288, 49152)) for m in FLUX_M] + [("gemm_rs", (m, 49152, 12288)) for m in FLUX_M]
OP_PREFIX = {"ag": "ag_gemm", "ag_gemm": "ag_gemm", "rs": "gemm_rs", "gemm_rs": "gemm_rs"}
QUICK_CUDA_SHAPES = [(1024, 8192, 8192), (2048, 8192, 28672)]
# Divisible by 2, 4 and 8 ranks; odd enough that a transposed or misindexed operand shows.
QUICK_CPU_SHAPES = [(64, 40, 48), (96, 64, 56)]



# ---------------------------------------------------------------------------------------------------
# Process group and run context
# ---------------------------------------------------------------------------------------------------


class Ctx(RunContext):
    """One rank of a bench_ops run: the process group, the dtype, the timing settings."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(args.device, args.pg_timeout, default_port=29517)
        self.hide_host = args.host_overhead == "hidden"
        self.align_start = args.align_start
        self.dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if self.is_cuda else torch.float32)
        self.group = dist.group.WORLD
        self.align_token = torch.zeros(1, device=self.device) if self.is_cuda else None
        self.group_name = self.group.group_name
        self.warmup = args.warmup
        self.iters = args.iters
        self.b_layout = args.b_layout
        self.seed = args.seed
        self.settle_s = args.settle_s if args.settle_s is not None else (5.0 if self.is_cuda else 0.0)


# ---------------------------------------------------------------------------------------------------
# Measuring one contender
# ---------------------------------------------------------------------------------------------------


def time_calls(ctx: Ctx, fn: Callable[[], object], warmup: Optional[int] = None,
               iters: Optional[int] = None) -> List[float]:
    """Per-iteration times in ms after ``warmup`` warm-ups (default ``ctx.warmup``; ``iters`` default
    ``ctx.iters``), barrier + synchronize before each."""
    warmup = ctx.warmup if warmup is None else warmup
    iters = ctx.iters if iters is None else iters
    # Hidden host: a GPU sleep keeps the GPU busy while the host enqueues the call, so every contender's number is its
    # device time; host-side launch cost (larger for the fused ops' Python) stays out.
    sleep_cycles = 2_000_000 if ctx.is_cuda and ctx.hide_host else None
    align = None
    if ctx.is_cuda and ctx.align_start:
        def align():
            align_ranks(ctx.align_token, ctx.group)

    return time_iterations(ctx, fn, warmup, iters, sleep_cycles=sleep_cycles, before_start=align)[0]


def check_contender(ctx: Ctx, problem: Problem, name: str) -> Tuple[dict, Optional[Callable[[], object]]]:
    """Build one contender and check its output once on every rank.  Returns (record, fn): the record all ranks
    agree on so far, and the callable to time, None when the record holds an error (on every rank alike, so no
    rank waits for a peer that skips it)."""
    op = problem.op
    local: dict = {"error": None, "rel_err": None, "path": None}
    err = setup_error(name, op, ctx)
    uses_dispatch = name in DISPATCHED
    fn = None
    if err is None:
        try:
            with contender_settings(name if uses_dispatch else None):
                fn, ref = problem.contender(name)
                if uses_dispatch:
                    _reset_fallbacks()
                out = fn()
                ctx.sync()
                if name in KERNEL_CONTENDERS and ctx.is_cuda:
                    kernel_error_check(op, ctx)
                local["rel_err"] = rel_err(out, ref)
                del out
                if uses_dispatch:
                    fell_back = _fallbacks(op)
                    local["path"] = _path_label(fell_back) if fell_back else "fused"
                    if name != "auto" and fell_back:
                        local["error"] = "unavailable: the op fell back to the decomposition: " + "; ".join(fell_back)
        except Exception as e:  # noqa: BLE001
            local["error"] = f"{type(e).__name__}: {e}"
            local["traceback"] = traceback.format_exc(limit=6)
            if not ctx.context_ok():
                raise ContextBroken(f"{name} on {OP_LABEL[op]} broke the CUDA context: {ctx.broken}") from e
    else:
        local["error"] = err

    # Every rank must agree whether to time it, or the ranks would wait on each other forever.
    everyone, error = agree(ctx, {"error": local["error"], "rel_err": local["rel_err"], "path": local["path"]})
    record: dict = {"ms": None, "error": None, "rel_err": None, "path": local["path"]}
    if error is not None:
        record["error"] = error
        if "traceback" in local:
            record["traceback_rank%d" % ctx.rank] = local["traceback"]
        return record, None
    record["rel_err"] = max(r["rel_err"] for r in everyone)
    record["paths"] = [r["path"] for r in everyone]
    return record, fn


def time_contender(ctx: Ctx, op: str, name: str, fn: Callable[[], object], record: dict, warmup: int,
                   iters: int) -> bool:
    """Time ``iters`` calls of a checked contender on every rank and append them to ``record["iter_ms"]`` (one list
    per rank); an error (on any rank) goes to ``record["error"]``.  Returns whether the record is still good."""
    uses_dispatch = name in DISPATCHED
    local: dict = {"error": None, "times": None, "path": record.get("path")}
    try:
        with contender_settings(name if uses_dispatch else None):
            if uses_dispatch:
                _reset_fallbacks()
            times = time_calls(ctx, fn, warmup, iters)
            if name in KERNEL_CONTENDERS and ctx.is_cuda:
                kernel_error_check(op, ctx)
            if uses_dispatch:
                fell_back = _fallbacks(op)
                if fell_back:
                    local["path"] = _path_label(fell_back)
                    if name != "auto":
                        local["error"] = "the op fell back to the decomposition while timed: " + "; ".join(fell_back)
        local["times"] = times
    except Exception as e:  # noqa: BLE001
        local["error"] = f"while timing: {type(e).__name__}: {e}"
        if not ctx.context_ok():
            raise ContextBroken(f"{name} on {OP_LABEL[op]} broke the CUDA context: {ctx.broken}") from e
    everyone = ctx.gather({"error": local["error"], "times": local["times"], "path": local["path"]})
    errors = [r["error"] for r in everyone]
    if any(e is not None for e in errors):
        record["error"] = next(e for e in errors if e is not None)
        record["ms"] = None
        return False
    previous = record.get("iter_ms") or [[] for _ in everyone]
    record["iter_ms"] = [old + r["times"] for old, r in zip(previous, everyone)]
    record["path"] = everyone[0]["path"]
    record["paths"] = [r["path"] for r in everyone]
    return True


def summarize(record: dict) -> None:
    """ms (the maximum over ranks of each rank's median), per-rank medians and the median of per-call maxima, from
    the record's per-rank times."""
    record.update(per_rank_summary(record["iter_ms"]))


def measure(ctx: Ctx, problem: Problem, name: str) -> dict:
    """Check and time one contender on every rank; returns the record all ranks agree on."""
    record, fn = check_contender(ctx, problem, name)
    if fn is not None and time_contender(ctx, problem.op, name, fn, record, ctx.warmup, ctx.iters):
        summarize(record)
    return record


def round_sizes(iters: int, rounds: int) -> List[int]:
    """``iters`` timed calls split over at most ``rounds`` rounds, as evenly as possible (no empty round)."""
    rounds = max(1, min(rounds, iters))
    return [iters // rounds + (1 if r < iters % rounds else 0) for r in range(rounds)]


def settle(ctx: Ctx, op: str, fns: Dict[str, Callable[[], object]], settle_s: float) -> dict:
    """Untimed calls of every contender in ``fns`` in turn (two each, timed as the rounds time them, the times
    dropped) until rank 0 has run them for ``settle_s`` seconds; every rank runs the same calls.  Stops early where a
    contender fails (the timed rounds then record it).  Returns the turns run and the seconds rank 0 took.

    An idle GPU starts at its top clock and slows once its power reaches the cap: the first shape's first round ran
    cuBLAS at 3.19-3.23 ms against 3.22-3.26 in later rounds (4096x12288x49152, 2xH200), against the fused ops; the model
    benchmark measured the transient (``bench_model.settle``, ``benchmarks/results/settle_ab/``)."""

    def turn(name: str, fn: Callable[[], object]):
        return lambda: None if time_contender(ctx, op, name, fn, {"error": None}, 0, 2) else f"{name} failed"

    return settle_turns(ctx, [turn(name, fn) for name, fn in fns.items()], settle_s)


def measure_interleaved(ctx: Ctx, problem: Problem, names: Sequence[str], rounds: int,
                        settle_s: float = 0.0) -> Tuple[Dict[str, dict], Optional[dict]]:
    """Check every contender, then time them in ``rounds`` rounds, each round a share of every contender's calls,
    the order rotated by one per round.  The GPU's clock drifts over a run (heat, power); timed one contender
    after another, the first ones ran on a cooler GPU.  Interleaved, every contender sees the same drift.  The
    first round has ``ctx.warmup`` warm-ups per contender, later rounds one.  With ``settle_s`` > 0 the checked
    contenders first run untimed for that long (:func:`settle`).  Returns the records and the settle's summary
    (None without one)."""
    records: Dict[str, dict] = {}
    fns: Dict[str, Callable[[], object]] = {}
    for name in names:
        records[name], fn = check_contender(ctx, problem, name)
        if fn is not None:
            fns[name] = fn
    live = list(fns)
    settled = settle(ctx, problem.op, fns, settle_s) if settle_s > 0 and live else None
    for r, size in enumerate(round_sizes(ctx.iters, rounds)):
        if not live:
            break
        shift = r % len(live)
        for name in live[shift:] + live[:shift]:
            if records[name]["error"] is None:
                time_contender(ctx, problem.op, name, fns[name], records[name], ctx.warmup if r == 0 else 1, size)
    for name in live:
        if records[name]["error"] is None:
            summarize(records[name])
    return records, settled


# ---------------------------------------------------------------------------------------------------
# Derived numbers, JSON, table, tuning
# ---------------------------------------------------------------------------------------------------


def derive(entry: dict) -> None:
    """Overlap efficiency and speedups for the overlapped contenders (None where a number is missing)."""
    ms = {name: rec.get("ms") for name, rec in entry["contenders"].items()}
    entry["ms"] = ms
    t_gemm, t_seq, t_atp = ms.get("gemm"), ms.get("nccl_seq"), ms.get("asynctp")
    entry["E"], entry["speedup_vs_nccl_seq"], entry["speedup_vs_asynctp"] = {}, {}, {}
    for name in OVERLAPPED:
        t = ms.get(name)
        e = None
        if t is not None and t_gemm is not None and t_seq is not None and t_seq - t_gemm > 0:
            e = 1.0 - (t - t_gemm) / (t_seq - t_gemm)
        entry["E"][name] = e
        entry["speedup_vs_nccl_seq"][name] = (t_seq / t) if (t and t_seq) else None
        entry["speedup_vs_asynctp"][name] = (t_atp / t) if (t and t_atp and name != "asynctp") else None
    t_nc = ms.get("fused_nocomm")
    entry["fused_nocomm_over_gemm"] = (t_nc / t_gemm) if (t_nc and t_gemm) else None
    t_snc = ms.get("split_nocomm")
    entry["split_nocomm_over_gemm"] = (t_snc / t_gemm) if (t_snc and t_gemm) else None
    t_snc2 = ms.get("split2_nocomm")
    entry["split2_nocomm_over_gemm"] = (t_snc2 / t_gemm) if (t_snc2 and t_gemm) else None


def run_environment(ctx: Ctx, args: argparse.Namespace, tuning_values: dict) -> dict:
    return environment(ctx, ctx.dtype, {
        "b_layout": ctx.b_layout,
        "timer": "cuda_events" if ctx.is_cuda else "perf_counter",
        "host_overhead": ("hidden" if ctx.hide_host else "exposed") if ctx.is_cuda else "exposed",
        "align_start": bool(ctx.align_start and ctx.is_cuda),
        "warmup": ctx.warmup,
        "iters": ctx.iters,
        "order": (f"interleaved, {len(round_sizes(ctx.iters, args.rounds))} rounds" if args.interleave
                  else "phases"),
        "settle_s": ctx.settle_s if args.interleave else 0.0,
    }, tuning_values=tuning_values)


def format_table(data: dict) -> str:
    env = data["environment"]
    lines = [
        f"bench_ops: {env['device']} x{env['world']} {env['backend']} {env['dtype']} B={env['b_layout']} "
        f"torch {env['torch']} nccl {env['nccl']} sha {env['git_sha']} "
        f"(median of {env['iters']} after {env['warmup']} warm-ups, max over ranks; ms)",
    ]
    head = (f"{'op':8}{'M':>6}{'K':>6}{'N':>6} |{'gemm':>8}{'comm':>8}{'seq':>8}{'asynctp':>8}{'nocomm':>8}"
            f"{'sp_nc':>8}{'sp2_nc':>8}{'fused':>8}{'f_copy':>8}{'f_split':>8}{'f_spl2':>8}{'auto':>8} |{'E_fus':>6}{'E_aut':>6}{'E_atp':>6} |{'fus/seq':>8}{'fus/atp':>8}"
            f"{'aut/seq':>8}{'nc/gemm':>8} |{'maxerr':>8} path(auto)")
    lines += [head, "-" * len(head)]
    for r in data["results"]:
        ms, E = r.get("ms", {}), r.get("E", {})
        s_seq, s_atp = r.get("speedup_vs_nccl_seq", {}), r.get("speedup_vs_asynctp", {})
        errs = [c.get("rel_err") for c in r["contenders"].values() if c.get("rel_err") is not None]
        maxerr = max(errs) if errs else None
        bad = any(c.get("rel_ok") is False for c in r["contenders"].values())
        auto_path = (r["contenders"].get("auto", {}).get("path") or "-").split(":")[0]
        lines.append(
            f"{r['op']:8}{r['M']:>6}{r['K']:>6}{r['N']:>6} |"
            + "".join(cell(ms.get(c)) for c in ("gemm", "comm", "nccl_seq", "asynctp", "fused_nocomm",
                                               "split_nocomm", "split2_nocomm", "fused", "fused_copy",
                                               "fused_split", "fused_split2", "auto"))
            + " |" + "".join(cell(E.get(c), "{:.2f}", 6) for c in ("fused", "auto", "asynctp"))
            + " |" + cell(s_seq.get("fused"), "{:.2f}x") + cell(s_atp.get("fused"), "{:.2f}x")
            + cell(s_seq.get("auto"), "{:.2f}x") + cell(r.get("fused_nocomm_over_gemm"), "{:.3f}")
            + " |" + cell(maxerr, "{:.1e}") + ("!" if bad else " ") + auto_path
        )
    lines.append("E = 1 - (T - T_gemm)/(T_nccl_seq - T_gemm); x/y = speedup of x over y (T_y / T_x); "
                 "nc/gemm = fused_nocomm / cuBLAS; '!' = an output failed its check; '-' = not measured")
    return "\n".join(lines)


def emit_tuning(data: dict, out_json: str, path_spec: str, merge: bool) -> str:
    """Write this run's cost-model table (fluxinductor.tuning_table) where ``path_spec`` says ("auto": the packaged
    folder; {device_key} and {world} are substituted); returns the path."""
    from fluxinductor import tuning_table

    bench_json = os.path.relpath(out_json, REPO) if out_json.startswith(REPO) else out_json
    table = tuning_table.table_from_bench(data, bench_json)
    if path_spec == "auto":
        path = tuning_table.table_file(os.path.join(REPO, "fluxinductor", "tuning"), table)
    else:
        path = path_spec.format(device_key=table["device_key"], world=table["world"])
    tuning_table.write_table(path, table, merge=merge)
    return path


def try_plot(data: dict, png: str) -> str:
    try:
        sys.path.insert(0, HERE)
        import plot as bench_plot  # benchmarks/plot.py

        return bench_plot.plot_results(data, png)
    except ImportError as e:
        return f"plot skipped: {e}"
    except Exception as e:  # noqa: BLE001 - a plot must never cost the numbers
        return f"plot failed: {type(e).__name__}: {e}"


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------


def parse_shapes(spec: Optional[str], default: Sequence[Tuple[int, int, int]]) -> List[Tuple[int, int, int]]:
    """``--shapes``: comma-separated ``MxKxN``; ``*`` in a field filters the default list, a full shape
    that is not in the default list is added."""
    if not spec:
        return list(default)
    chosen: List[Tuple[int, int, int]] = []
    for item in spec.split(","):
        item = item.strip().lower()
        if not item:
            continue
        parts = item.split("x")
        if len(parts) != 3:
            raise SystemExit(f"--shapes: {item!r} is not MxKxN")
        if "*" in parts:
            want = [None if p == "*" else int(p) for p in parts]
            matches = [s for s in default if all(w is None or w == v for w, v in zip(want, s))]
        else:
            matches = [tuple(int(p) for p in parts)]
        for s in matches:
            if s not in chosen:
                chosen.append(s)
    return chosen


def parse_work(spec: Optional[str], default: Sequence[Tuple[int, int, int]],
               ops: Sequence[str]) -> List[Tuple[str, Tuple[int, int, int]]]:
    """(op, shape) pairs to run, grouped by op in ``ops`` order.  ``--shapes`` items as parse_shapes takes
    them run for every op in ``ops``; ``ag:MxKxN`` / ``rs:MxKxN`` (wildcards allowed) for that op only;
    ``flux`` is Flux's demo set (AG+GEMM Mx12288x49152, GEMM+RS Mx49152x12288, M 1024..16384)."""
    pairs: List[Tuple[str, Tuple[int, int, int]]] = []
    items = [i.strip().lower() for i in spec.split(",") if i.strip()] if spec else [None]
    for item in items:
        if item == "flux":
            found = list(FLUX_DEMO)
        else:
            only = None
            if item is not None and ":" in item:
                prefix, item = item.split(":", 1)
                if prefix not in OP_PREFIX:
                    raise SystemExit(f"--shapes: unknown op prefix {prefix!r} (one of {', '.join(OP_PREFIX)})")
                only = OP_PREFIX[prefix]
            found = [(op, s) for s in parse_shapes(item, default) for op in OPS if only in (None, op)]
        pairs.extend(p for p in found if p[0] in ops and p not in pairs)
    return [p for op in ops for p in pairs if p[0] == op]


def build_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output prefix: writes <out>.json and <out>.png (a path ending in .json names the JSON)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    p.add_argument("--shapes", default=None,
                   help="comma-separated MxKxN (global); '*' wildcards filter the defaults; 'ag:' / 'rs:' before "
                        "a shape runs it for that op only; 'flux' = Flux's demo shapes")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset of " + ",".join(CONTENDERS))
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per contender (default 5)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per contender (default 20)")
    p.add_argument("--quick", action="store_true", help="small shapes and fewer iterations (CPU: tiny shapes)")
    p.add_argument("--b-layout", choices=("t", "kn"), default="t",
                   help="B as nn.Linear graphs give it (weight[N,K].t(), default) or row-major [K,N]")
    p.add_argument("--emit-tuning", default=None,
                   help="write the cost-model table here ('auto' = fluxinductor/tuning/<device_key>_tp<w>.json; "
                        "{device_key} and {world} are substituted)")
    p.add_argument("--no-merge-tuning", action="store_true", help="overwrite the tuning table instead of merging rows")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--host-overhead", choices=("hidden", "exposed"), default="hidden",
                   help="hidden (default): a GPU sleep before the start event lets the host enqueue each call "
                   "first, so times are device times; exposed: the GPU idles while the host launches, so host-side launch cost is in every number")
    p.add_argument("--align-start", action=argparse.BooleanOptionalAction, default=True,
                   help="GPU only (default on): start each timed call after a one-element all-reduce, so every "
                        "rank's start event follows the slowest rank's (the host's skew between ranks is not timed)")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                   help="default on: per shape, time every contender but auto in --rounds rounds of a share of its "
                        "calls each, the order rotated per round, so clock drift over the run hits all alike; "
                        "--no-interleave: each contender's calls back to back, in phases (every shape per phase)")
    p.add_argument("--rounds", type=int, default=4, help="rounds per shape with --interleave (default 4)")
    p.add_argument("--settle-s", type=float, default=None,
                   help="with --interleave: before a phase's first shape is timed, run its contenders untimed for "
                        "this many seconds (default 5 on CUDA, 0 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    add_tuning_argument(p)
    p.add_argument("--pg-timeout", type=float, default=120.0, help="process-group timeout, seconds")
    p.add_argument("--contender-timeout", type=float, default=180.0,
                   help="seconds one contender (check + warm-ups + timed calls) may take before the run exits")
    args = p.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    args.iters = args.iters if args.iters is not None else (5 if args.quick else 20)
    for name in args.contenders.split(","):
        if name not in CONTENDERS:
            p.error(f"unknown contender {name!r}")
    for name in args.ops.split(","):
        if name not in OPS:
            p.error(f"unknown op {name!r}")
    try:
        parse_tuning(args.tuning)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    args = build_args(argv)
    # torch >= 2.12 deprecates all_gather_into_tensor / reduce_scatter_tensor by name; 2.11 has no successor.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    ctx = Ctx(args)
    tuning_values = apply_tuning(args.tuning)
    ops = [o for o in OPS if o in args.ops.split(",")]
    contenders = [c for c in CONTENDERS if c in args.contenders.split(",")]
    default = (QUICK_CUDA_SHAPES if ctx.is_cuda else QUICK_CPU_SHAPES) if args.quick else DEFAULT_SHAPES
    if not ctx.is_cuda and not args.quick and not args.shapes:
        default = QUICK_CPU_SHAPES  # the GPU shapes take minutes per GEMM on a CPU
    notes: List[str] = []
    work: List[Tuple[str, Tuple[int, int, int]]] = []
    for op, (m, k, n) in parse_work(args.shapes, default, ops):
        divisible = (m % ctx.world == 0 and n % ctx.world == 0) if op == "ag_gemm" else \
            (m % ctx.world == 0 and k % ctx.world == 0)
        if divisible:
            work.append((op, (m, k, n)))
        else:
            notes.append(f"skipped {OP_LABEL[op]} {m}x{k}x{n}: does not split over {ctx.world} ranks")

    data = {"schema": "fluxinductor.bench_ops/1", "complete": False, "environment": run_environment(ctx, args, tuning_values),
            "contenders": contenders, "notes": notes, "results": []}
    by_key: Dict[Tuple[str, Tuple[int, int, int]], dict] = {}
    for op, (m, k, n) in work:
        entry = {"op": OP_LABEL[op], "op_key": op, "M": m, "K": k, "N": n, "contenders": {}}
        by_key[(op, (m, k, n))] = entry
        data["results"].append(entry)
    out_json = os.path.abspath(output_prefix(args.out) + ".json")
    tol = TOLERANCE[ctx.dtype]
    data["tolerance"] = tol

    def log(msg: str) -> None:
        if ctx.rank == 0:
            print(f"[bench_ops] {msg}", flush=True)

    def save() -> None:
        if ctx.rank == 0:
            for entry in data["results"]:
                derive(entry)
            write_json(out_json, data)

    progress = os.path.abspath(output_prefix(args.out) + ".progress")
    if ctx.rank == 0:
        os.makedirs(os.path.dirname(progress), exist_ok=True)
        if os.path.exists(progress):
            os.remove(progress)

    def mark(step: str) -> None:
        # Where a run that hangs or dies stopped (the JSON holds everything up to the previous shape).
        if ctx.rank == 0:
            with open(progress, "a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} {step}\n")

    messages: List[str] = []
    # Interleaved, everything but auto is one phase (auto needs the table written from the others' numbers).
    phases = ((tuple(c for phase in PHASES[:-1] for c in phase), PHASES[-1]) if args.interleave else PHASES)
    try:
        for phase in phases:
            names = [c for c in phase if c in contenders]
            if not names:
                continue
            if "auto" in names and args.emit_tuning:
                # The table from this run's numbers, in place before "auto" runs (dispatch reads it).
                if ctx.rank == 0:
                    for entry in data["results"]:
                        derive(entry)
                    try:
                        path = emit_tuning(data, out_json, args.emit_tuning, not args.no_merge_tuning)
                        messages.append(f"wrote tuning table {path} (before the auto phase)")
                        data["tuning_table"] = path
                    except Exception as e:  # noqa: BLE001
                        messages.append(f"tuning table NOT written: {type(e).__name__}: {e}")
                ctx.barrier()
                try:
                    from fluxinductor import cost_model

                    cost_model.clear_cache()
                except Exception:  # noqa: BLE001
                    pass
            for index, (op, shape) in enumerate(work):
                entry = by_key[(op, shape)]
                problem = Problem(op, shape, ctx)
                label = f"{OP_LABEL[op]} {shape[0]}x{shape[1]}x{shape[2]}"
                together = args.interleave and len(names) > 1
                for group in ([names] if together else [[name] for name in names]):
                    mark(f"{label} {','.join(group)}")
                    with watchdog(args.contender_timeout * len(group)):
                        if together:
                            records, settled = measure_interleaved(ctx, problem, group, args.rounds,
                                                                   ctx.settle_s if index == 0 else 0.0)
                            if settled is not None:
                                entry["settle"] = settled
                                log(f"{label} settled: {settled['rounds']} untimed turns in {settled['s']:.1f} s")
                        else:
                            records = {group[0]: measure(ctx, problem, group[0])}
                    for name in group:
                        record = records[name]
                        if record.get("rel_err") is not None:
                            record["rel_ok"] = bool(record["rel_err"] <= tol)
                        entry["contenders"][name] = record
                        status = record["error"] or f"{record['ms']:.4f} ms, err {record['rel_err']:.1e}"
                        log(f"{label} {name}: {status}")
                del problem
                save()
    except ContextBroken as e:
        data["context_broken"] = str(e)
        log(f"STOPPING: {e}")
        if ctx.rank == 0:
            save()
            print(format_table(data), flush=True)
        exit_now(3)  # collectives cannot run any more; the peers fail on their own timeouts

    data["complete"] = True
    save()
    if ctx.rank == 0:
        messages.append(f"wrote {out_json}")
        if args.emit_tuning and "tuning_table" not in data:  # no auto phase ran: write it now
            try:
                messages.append(f"wrote tuning table {emit_tuning(data, out_json, args.emit_tuning, not args.no_merge_tuning)}")
            except Exception as e:  # noqa: BLE001
                messages.append(f"tuning table NOT written: {type(e).__name__}: {e}")
        if not args.no_plot:
            messages.append(try_plot(data, os.path.abspath(output_prefix(args.out) + ".png")))
        unavailable = sorted({f"{name}: {rec['error']}" for r in data["results"]
                              for name, rec in r["contenders"].items() if rec.get("error")})
        for line in notes + [f"not measured: {u[:300]}" for u in unavailable] + messages:
            print(f"[bench_ops] {line}", flush=True)
        print(format_table(data), flush=True)
    mark("done")
    try:
        ctx.barrier()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    # Everything is written; skip process-group and symmetric-memory teardown.
    exit_now(main())
