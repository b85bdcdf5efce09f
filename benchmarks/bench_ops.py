#!/usr/bin/env python3
"""Op-level benchmark: fused AG+GEMM / GEMM+RS against cuBLAS, NCCL and torch async-TP, side by side.

Run (one process per GPU; any world size):

    torchrun --nproc-per-node 2 benchmarks/bench_ops.py --out benchmarks/results/h200x2_tp2_ops \\
        --emit-tuning auto

CPU smoke run (gloo, tiny shapes, perf_counter timing; the GPU-only contenders record "unavailable"):

    torchrun --nproc-per-node 2 benchmarks/bench_ops.py --device cpu --quick --out /tmp/ops_cpu

Shapes are *global* GEMMs (M, K, N) in the convention of shared/anchors/README.md:
AG+GEMM: each rank holds A_shard [M/w, K] and B [K, N/w], out [M, N/w];
GEMM+RS: each rank holds A [M, K/w] and B [K/w, N], out [M/w, N].

Contenders (``--contenders``), each timed on the same inputs:
  gemm          cuBLAS ``torch.mm`` on the per-rank problem (AG: the gathered A [M, K] @ B)
  comm          the NCCL collective alone (all_gather_into_tensor / reduce_scatter_tensor)
  nccl_seq      collective then GEMM (AG), GEMM then collective (RS)
  asynctp       torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter (PyTorch async-TP)
  fused         torch.ops.fluxinductor.* with FLUXINDUCTOR_DISPATCH=fused (a call that falls back to the
                decomposition is reported as unavailable, with the fallback's reason)
  fused_copy    GEMM+RS only: as ``fused``, with FLUXINDUCTOR_GEMM_RS_PUSH=copy (peer tiles moved by the copy
                engine; the cost model may pick this transport per shape)
  fused_split   GEMM+RS only: as ``fused``, with FLUXINDUCTOR_GEMM_RS_PUSH=split (a ring of stock CUTLASS GEMMs,
                one per segment, the copy engine between them), in configuration 0 (cooperative 128x256)
  fused_split2  GEMM+RS only: ``fused_split`` in configuration 2 (ping-pong 128x192, bf16); the tuning table keeps
                the faster of the two per shape (``split_config``) and the dispatcher runs that one
  fused_nocomm  fluxinductor.kernels.{ag_gemm,gemm_rs}.gemm_only(a, b, None): the fused kernel, communication off
  split_nocomm  GEMM+RS only: gemm_rs.gemm_only(a, b, None, split=True): the split transport's two GEMMs,
                communication off (configuration 0); split2_nocomm: the same in configuration 2
  auto          torch.ops.fluxinductor.* with FLUXINDUCTOR_DISPATCH=auto (cost model; what users get)

Timing (as the anchors): CUDA events around each call, dist.barrier + cuda synchronize before each
iteration, median of ``--iters`` after ``--warmup`` warm-ups per rank, max over ranks.  Unlike the anchors, on GPUs
a one-element all-reduce sits between the host-hiding sleep and the start event (``--align-start``, default on;
``--no-align-start`` for the old way): without it the host's skew leaving the barrier (up to ~40 us) was timed on
whichever rank started first, once the op synchronized the ranks (``benchmarks/results/align_start_ab/``).
Every contender's output is checked once per shape against an fp32 reference: ||out - ref|| / ||ref||, max over
ranks.

Order (``--interleave``, default): per shape, every contender but auto is checked (gemm, comm, nccl_seq, then
fluxinductor's, then asynctp), then timed in ``--rounds`` rounds (default 4), each round a share of every
contender's calls, the order rotated by one per round.  An H200 under sustained GEMM load slows down within
seconds to a minute; timed one after another, the contenders that ran first (cuBLAS) had the cooler GPU.  Then auto,
every shape, in its own phase.  ``--no-interleave``: the old phases, every shape per phase: (gemm, comm,
nccl_seq), then (fused_nocomm, split_nocomm, fused, fused_copy, fused_split), then (asynctp), then (auto), each
contender's calls back to back.  Either way fluxinductor allocates before async-TP: torch's symmetric memory lets a
backend be chosen (``set_backend``) only before its first allocation, and async-TP allocates with the default
backend.  With ``--emit-tuning`` the cost-model table is written from this run's numbers before the auto
phase, so ``auto`` measures what users get with that table.  A CUDA error that breaks the context loses
only the later shapes and phases: ``<out>.json`` is rewritten after every shape (``"complete": false`` until the
end).

Outputs on rank 0: ``<out>.json`` (device, versions, git sha, every raw number), ``<out>.png`` (needs
matplotlib; skipped with a note otherwise), optionally the cost-model table (``--emit-tuning``), and the
table printed last.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import importlib
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from _common import DTYPES, ContextBroken, git_sha, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

OPS = ("ag_gemm", "gemm_rs")
OP_LABEL = {"ag_gemm": "AG+GEMM", "gemm_rs": "GEMM+RS"}
OP_NAME = {"ag_gemm": "all_gather_matmul", "gemm_rs": "matmul_reduce_scatter"}
CONTENDERS = ("gemm", "comm", "nccl_seq", "asynctp", "fused_nocomm", "split_nocomm", "split2_nocomm", "fused",
              "fused_copy", "fused_split", "fused_split2", "auto")
PHASES = (("gemm", "comm", "nccl_seq"), ("fused_nocomm", "split_nocomm", "split2_nocomm", "fused", "fused_copy",
                                         "fused_split", "fused_split2"),
          ("asynctp",), ("auto",))
# Contenders whose overlap efficiency and speedups are reported.
OVERLAPPED = ("fused", "fused_copy", "fused_split", "fused_split2", "auto", "asynctp")
# Contenders that may run fluxinductor's kernels (whose device-side errors are checked after they run).
KERNEL_CONTENDERS = ("fused", "fused_copy", "fused_split", "fused_split2", "auto", "fused_nocomm", "split_nocomm",
                     "split2_nocomm")
# Contenders that go through the dispatcher: the FLUXINDUCTOR_DISPATCH mode and extra variables of each.
DISPATCHED = {"fused": ("fused", {}), "fused_copy": ("fused", {"FLUXINDUCTOR_GEMM_RS_PUSH": "copy"}),
              "fused_split": ("fused", {"FLUXINDUCTOR_GEMM_RS_PUSH": "split", "FLUXINDUCTOR_GEMM_RS_SPLIT_CONFIG": "0"}),
              "fused_split2": ("fused", {"FLUXINDUCTOR_GEMM_RS_PUSH": "split", "FLUXINDUCTOR_GEMM_RS_SPLIT_CONFIG": "2"}),
              "auto": ("auto", {})}

# shared/anchors/README.md shapes, M in {512, 3072} at K=8192 N=28672, and Flux's GEMM+RS demo shape.
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

# ||out - ref|| / ||ref|| against the fp32 reference (issue 3: <= 1e-2 for bf16).
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}



# ---------------------------------------------------------------------------------------------------
# Process group and run context
# ---------------------------------------------------------------------------------------------------


class Ctx:
    def __init__(self, args: argparse.Namespace):
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", str(self.rank)))
        want = args.device
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        self.is_cuda = want == "cuda"
        self.hide_host = args.host_overhead == "hidden"
        self.align_start = args.align_start
        if self.is_cuda:
            if not torch.cuda.is_available():
                raise SystemExit("--device cuda but CUDA is not available")
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self.dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if self.is_cuda else torch.float32)
        self.backend = "nccl" if self.is_cuda else "gloo"
        timeout = datetime.timedelta(seconds=args.pg_timeout)
        if "MASTER_ADDR" not in os.environ:  # a plain `python bench_ops.py`: one rank
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29517")
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        kwargs = dict(backend=self.backend, timeout=timeout)
        if self.is_cuda:
            kwargs["device_id"] = self.device
        try:
            dist.init_process_group(**kwargs)
        except TypeError:  # older torch without device_id
            kwargs.pop("device_id", None)
            dist.init_process_group(**kwargs)
        self.group = dist.group.WORLD
        self.align_token = torch.zeros(1, device=self.device) if self.is_cuda else None
        self.group_name = self.group.group_name
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.warmup = args.warmup
        self.iters = args.iters
        self.b_layout = args.b_layout
        self.seed = args.seed
        self.broken: Optional[str] = None

    def barrier(self) -> None:
        if self.is_cuda:
            dist.barrier(device_ids=[self.local_rank])
        else:
            dist.barrier()

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()

    def gather(self, obj):
        """Every rank's ``obj``, in rank order (pickled; small objects only)."""
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.is_cuda else "cpu"


def context_ok(ctx: Ctx) -> bool:
    """False once a CUDA error has made the context unusable (later work would only fail or hang)."""
    if not ctx.is_cuda:
        return True
    try:
        torch.cuda.synchronize()
        return True
    except Exception as e:  # noqa: BLE001
        ctx.broken = ctx.broken or f"{type(e).__name__}: {e}"
        return False


# ---------------------------------------------------------------------------------------------------
# Problems: inputs, fp32 references and one callable per contender
# ---------------------------------------------------------------------------------------------------


def _randn(shape, ctx: Ctx, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, device=ctx.device, dtype=torch.float32)
    return (t * scale).to(ctx.dtype)


def _make_b(k: int, n: int, ctx: Ctx, gen: torch.Generator) -> torch.Tensor:
    """B: [k, n].  Layout "t" is what nn.Linear graphs pass (weight [n, k] transposed, column major)."""
    scale = 1.0 / math.sqrt(k)
    if ctx.b_layout == "t":
        return _randn((n, k), ctx, gen, scale).t()
    return _randn((k, n), ctx, gen, scale)


def _all_gather(t: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    out = t.new_empty((ctx.world * t.shape[0],) + tuple(t.shape[1:]))
    dist.all_gather_into_tensor(out, t.contiguous(), group=ctx.group)
    return out


def _reduce_scatter(t: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    out = t.new_empty((t.shape[0] // ctx.world,) + tuple(t.shape[1:]))
    dist.reduce_scatter_tensor(out, t.contiguous(), group=ctx.group)
    return out


class Problem:
    """One op at one global shape on this rank: inputs, fp32 references, contender callables.

    ``contender(name)`` returns ``(fn, ref)``: ``fn()`` runs the contender once and returns its output,
    ``ref`` is the fp32 tensor that output must match.
    """

    def __init__(self, op: str, shape: Tuple[int, int, int], ctx: Ctx):
        self.op, self.ctx = op, ctx
        m, k, n = shape
        w = ctx.world
        gen = torch.Generator(device=ctx.device)
        # Same inputs in every phase and run; different on every rank.
        gen.manual_seed(zlib.crc32(f"{ctx.seed}:{op}:{m}x{k}x{n}".encode()) * 131 + ctx.rank)
        if op == "ag_gemm":
            self.shard = _randn((m // w, k), ctx, gen)  # shard: [M/w, K]
            self.b = _make_b(k, n // w, ctx, gen)  # b: [K, N/w]
            self.gathered = _all_gather(self.shard, ctx)  # [M, K], exact (a copy)
            self.ref_out = self.gathered.float() @ self.b.float()  # [M, N/w]
            self.local_shapes = {"a_shard": [m // w, k], "b": [k, n // w], "out": [m, n // w]}
        else:
            self.a = _randn((m, k // w), ctx, gen)  # a: [M, K/w]
            self.b = _make_b(k // w, n, ctx, gen)  # b: [K/w, N]
            self.ref_partial = self.a.float() @ self.b.float()  # [M, N]
            self.ref_out = _reduce_scatter(self.ref_partial, ctx)  # [M/w, N]
            self.partial = torch.mm(self.a, self.b)  # the bf16 partial the comm contender scatters
            self.local_shapes = {"a": [m, k // w], "b": [k // w, n], "out": [m // w, n]}
        ctx.sync()

    def contender(self, name: str) -> Tuple[Callable[[], torch.Tensor], torch.Tensor]:
        ctx, group = self.ctx, self.ctx.group
        w = ctx.world
        if self.op == "ag_gemm":
            shard, b, gathered = self.shard, self.b, self.gathered
            m, k = gathered.shape
            if name == "gemm":
                return (lambda: torch.mm(gathered, b)), self.ref_out
            if name == "comm":
                buf = torch.empty_like(gathered)

                def comm():
                    dist.all_gather_into_tensor(buf, shard, group=group)
                    return buf

                return comm, gathered.float()
            if name == "nccl_seq":

                def nccl_seq():
                    full = shard.new_empty((m, k))
                    dist.all_gather_into_tensor(full, shard, group=group)
                    return torch.mm(full, b)

                return nccl_seq, self.ref_out
            if name == "asynctp":
                fused_ag = torch.ops.symm_mem.fused_all_gather_matmul
                gn = ctx.group_name
                return (lambda: fused_ag(shard, [b], 0, gn, return_A=False)[1][0]), self.ref_out
            if name in ("fused", "auto"):
                op = torch.ops.fluxinductor.all_gather_matmul
                gn = ctx.group_name
                return (lambda: op(shard, [b], [None], 0, gn, False)[0][0]), self.ref_out
            if name == "fused_nocomm":
                gemm_only = importlib.import_module("fluxinductor.kernels.ag_gemm").gemm_only
                return (lambda: gemm_only(gathered, b, None)), self.ref_out
        else:
            a, b, partial = self.a, self.b, self.partial
            m, n = partial.shape
            if name == "gemm":
                return (lambda: torch.mm(a, b)), self.ref_partial
            if name == "comm":
                buf = partial.new_empty((m // w, n))

                def comm():
                    dist.reduce_scatter_tensor(buf, partial, group=group)
                    return buf

                return comm, self.ref_out
            if name == "nccl_seq":

                def nccl_seq():
                    p = torch.mm(a, b)
                    out = p.new_empty((m // w, n))
                    dist.reduce_scatter_tensor(out, p, group=group)
                    return out

                return nccl_seq, self.ref_out
            if name == "asynctp":
                fused_rs = torch.ops.symm_mem.fused_matmul_reduce_scatter
                gn = ctx.group_name
                return (lambda: fused_rs(a, b, "sum", 0, gn)), self.ref_out
            if name in DISPATCHED:
                op = torch.ops.fluxinductor.matmul_reduce_scatter
                gn = ctx.group_name
                return (lambda: op(a, b, None, "sum", 0, gn)), self.ref_out
            if name in ("fused_nocomm", "split_nocomm", "split2_nocomm"):
                gemm_only = importlib.import_module("fluxinductor.kernels.gemm_rs").gemm_only
                split = name != "fused_nocomm"
                config = 2 if name == "split2_nocomm" else 0
                return (lambda: gemm_only(a, b, None, split=split, split_config_choice=config)), self.ref_partial
        raise ValueError(f"unknown contender {name!r}")


def rel_err(out, ref: torch.Tensor) -> float:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"returned {type(out).__name__}, expected a tensor")
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    ref_norm = ref.norm().item()
    err = (out.float() - ref).norm().item()
    if not math.isfinite(err):
        return float("inf")
    return err / ref_norm if ref_norm > 0 else err


# ---------------------------------------------------------------------------------------------------
# Availability and dispatch mode per contender
# ---------------------------------------------------------------------------------------------------

_setup_errors: Dict[str, Optional[str]] = {}


def _import_fluxinductor() -> Optional[str]:
    try:
        import fluxinductor  # noqa: F401  (registers torch.ops.fluxinductor.*)
        from fluxinductor import log  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"import fluxinductor failed: {type(e).__name__}: {e}"
    return None


def _setup_asynctp(ctx: Ctx) -> Optional[str]:
    if not ctx.is_cuda:
        return "unavailable: async-TP needs CUDA tensors and torch symmetric memory"
    try:
        from fluxinductor.kernels.symm import _enable_group  # registers the group where torch needs it

        _enable_group(ctx.group_name)
        torch.ops.symm_mem.fused_all_gather_matmul  # noqa: B018 - raises if the op is not registered
        torch.ops.symm_mem.fused_matmul_reduce_scatter  # noqa: B018
    except Exception as e:  # noqa: BLE001
        return f"unavailable: async-TP setup failed: {type(e).__name__}: {e}"
    return None


def setup_error(name: str, op: str, ctx: Ctx) -> Optional[str]:
    """Why ``name`` cannot run at all here (None when it can be tried)."""
    key = f"{name}:{op}"
    if key in _setup_errors:
        return _setup_errors[key]
    err: Optional[str] = None
    if name == "asynctp":
        if "asynctp:*" not in _setup_errors:
            _setup_errors["asynctp:*"] = _setup_asynctp(ctx)
        err = _setup_errors["asynctp:*"]
    elif name == "fused_copy" and op != "gemm_rs":
        err = "unavailable: the copy-engine transport is GEMM+RS's"
    elif name in ("fused_split", "fused_split2") and op != "gemm_rs":
        err = "unavailable: the split transport is GEMM+RS's"
    elif name in DISPATCHED:
        err = _import_fluxinductor()
    elif name in ("split_nocomm", "split2_nocomm") and op != "gemm_rs":
        err = "unavailable: the split transport is GEMM+RS's"
    elif name in ("fused_nocomm", "split_nocomm", "split2_nocomm"):
        if not ctx.is_cuda:
            err = "unavailable: the fused kernel needs CUDA"
        else:
            module = "fluxinductor.kernels." + ("ag_gemm" if op == "ag_gemm" else "gemm_rs")
            try:
                if not hasattr(importlib.import_module(module), "gemm_only"):
                    err = f"unavailable: {module} has no gemm_only"
            except Exception as e:  # noqa: BLE001
                err = f"unavailable: import {module} failed: {type(e).__name__}: {e}"
    _setup_errors[key] = err
    return err


class DispatchMode:
    """Set FLUXINDUCTOR_DISPATCH (and the contender's other variables, :data:`DISPATCHED`) for one contender;
    the dispatcher reads os.environ at call time.  ``None``: a contender that does not go through it."""

    def __init__(self, name: Optional[str]):
        mode, extra = DISPATCHED.get(name, (None, {})) if name is not None else (None, {})
        self.values = dict(extra, **({"FLUXINDUCTOR_DISPATCH": mode} if mode is not None else {}))
        self.prev: Dict[str, Optional[str]] = {}

    def __enter__(self):
        self.prev = {key: os.environ.get(key) for key in self.values}
        os.environ.update(self.values)
        return self

    def __exit__(self, *exc):
        for key, value in self.prev.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        return False


def _fallbacks(op: str) -> Dict[str, int]:
    from fluxinductor.log import rewrite_stats

    return dict(rewrite_stats().get("fallbacks", {}).get(OP_NAME[op], {}))


def kernel_error_check(op: str, ctx: "Ctx") -> None:
    """Raise the error a fused kernel reported on the device (a timed-out flag wait shows only here or on
    the next call).  Best effort: a kernel module without this API is not checked."""
    try:
        if op == "ag_gemm":
            check = importlib.import_module("fluxinductor.kernels.ag_gemm").check_errors
            call = lambda: check(ctx.device, synchronize=True)  # noqa: E731
        else:
            check = importlib.import_module("fluxinductor.kernels.gemm_rs").check_error
            call = lambda: check(ctx.group_name, ctx.device, synchronize=True)  # noqa: E731
    except (ImportError, AttributeError):
        return
    call()


def _path_label(fell_back: Dict[str, int]) -> str:
    """"asynctp: ..." when every call the dispatcher did not fuse ran PyTorch's async-TP op, else
    "decomposed: ..." (with the recorded reasons)."""
    kind = "asynctp" if all(r.startswith("cost model chose asynctp") for r in fell_back) else "decomposed"
    return f"{kind}: " + "; ".join(fell_back)


def _reset_fallbacks() -> None:
    from fluxinductor.log import reset_rewrite_stats

    reset_rewrite_stats()


# ---------------------------------------------------------------------------------------------------
# Measuring one contender
# ---------------------------------------------------------------------------------------------------


def time_calls(ctx: Ctx, fn: Callable[[], object], warmup: Optional[int] = None,
               iters: Optional[int] = None) -> List[float]:
    """Per-iteration times in ms after ``warmup`` warm-ups (default ``ctx.warmup``; ``iters`` default
    ``ctx.iters``), barrier + synchronize before each."""
    warmup = ctx.warmup if warmup is None else warmup
    iters = ctx.iters if iters is None else iters
    times: List[float] = []
    if ctx.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(warmup + iters):
        ctx.barrier()
        ctx.sync()
        if ctx.is_cuda:
            if ctx.hide_host:
                # Keep the GPU busy while the host enqueues the call, so every contender's number is its
                # device time; host-side launch cost (larger for the fused ops' Python) stays out.
                torch.cuda._sleep(2_000_000)
            if ctx.align_start:
                # A one-element all-reduce behind the sleep: every GPU's start event waits for the slowest rank,
                # so the host's skew between ranks leaving the barrier is not timed (it lands on whichever rank
                # starts first once the op synchronizes the ranks).
                dist.all_reduce(ctx.align_token, group=ctx.group)
            start.record()
            fn()
            end.record()
            end.synchronize()
            t = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            t = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(float(t))
    return times


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
            with DispatchMode(name if uses_dispatch else None):
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
            if not context_ok(ctx):
                raise ContextBroken(f"{name} on {OP_LABEL[op]} broke the CUDA context: {ctx.broken}") from e
    else:
        local["error"] = err

    # Every rank must agree whether to time it, or the ranks would wait on each other forever.
    everyone = ctx.gather({"error": local["error"], "rel_err": local["rel_err"], "path": local["path"]})
    errors = [r["error"] for r in everyone]
    record: dict = {"ms": None, "error": None, "rel_err": None, "path": local["path"]}
    if any(e is not None for e in errors):
        first = next(e for e in errors if e is not None)
        failed = [i for i, e in enumerate(errors) if e is not None]
        record["error"] = first if len(failed) == ctx.world else f"rank(s) {failed}: {first}"
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
        with DispatchMode(name if uses_dispatch else None):
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
        if not context_ok(ctx):
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
    per_rank = record["iter_ms"]
    medians = [statistics.median(t) for t in per_rank]
    record["ms"] = max(medians)
    record["rank_median_ms"] = medians
    record["iter_max_median_ms"] = statistics.median(max(col) for col in zip(*per_rank))


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


def measure_interleaved(ctx: Ctx, problem: Problem, names: Sequence[str], rounds: int) -> Dict[str, dict]:
    """Check every contender, then time them in ``rounds`` rounds, each round a share of every contender's calls,
    the order rotated by one per round.  The GPU's clock drifts over a run (heat, power); timed one contender
    after another, the first ones ran on a cooler GPU.  Interleaved, every contender sees the same drift.  The
    first round has ``ctx.warmup`` warm-ups per contender, later rounds one."""
    records: Dict[str, dict] = {}
    fns: Dict[str, Callable[[], object]] = {}
    for name in names:
        records[name], fn = check_contender(ctx, problem, name)
        if fn is not None:
            fns[name] = fn
    live = list(fns)
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
    return records


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


def environment(ctx: Ctx, args: argparse.Namespace) -> dict:
    sha, dirty = git_sha()
    env = {
        "device": ctx.device_name(),
        "world": ctx.world,
        "backend": ctx.backend,
        "dtype": str(ctx.dtype).replace("torch.", ""),
        "b_layout": ctx.b_layout,
        "timer": "cuda_events" if ctx.is_cuda else "perf_counter",
        "host_overhead": ("hidden" if ctx.hide_host else "exposed") if ctx.is_cuda else "exposed",
        "align_start": bool(ctx.align_start and ctx.is_cuda),
        "warmup": ctx.warmup,
        "iters": ctx.iters,
        "order": (f"interleaved, {len(round_sizes(ctx.iters, args.rounds))} rounds" if args.interleave
                  else "phases"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_sha": sha,
        "git_dirty": dirty,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "argv": sys.argv,
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("NCCL_", "TORCH_SYMM_MEM", "NVSHMEM_", "FLUXINDUCTOR_", "CUDA_VISIBLE"))},
    }
    if ctx.is_cuda:
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001
            pass
        props = torch.cuda.get_device_properties(ctx.device)
        env["sm_count"] = props.multi_processor_count
        env["total_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["capability"] = f"{props.major}.{props.minor}"
    try:
        importlib.import_module("fluxinductor._C")
        env["fluxinductor_extension"] = "loaded"
    except Exception as e:  # noqa: BLE001
        env["fluxinductor_extension"] = f"not loaded: {type(e).__name__}: {e}"
    return env


def _f(x, fmt: str = "{:.3f}", width: int = 8) -> str:
    s = "-" if x is None else fmt.format(x)
    return s.rjust(width)


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
            + "".join(_f(ms.get(c)) for c in ("gemm", "comm", "nccl_seq", "asynctp", "fused_nocomm",
                                               "split_nocomm", "split2_nocomm", "fused", "fused_copy",
                                               "fused_split", "fused_split2", "auto"))
            + " |" + "".join(_f(E.get(c), "{:.2f}", 6) for c in ("fused", "auto", "asynctp"))
            + " |" + _f(s_seq.get("fused"), "{:.2f}x") + _f(s_atp.get("fused"), "{:.2f}x")
            + _f(s_seq.get("auto"), "{:.2f}x") + _f(r.get("fused_nocomm_over_gemm"), "{:.3f}")
            + " |" + _f(maxerr, "{:.1e}") + ("!" if bad else " ") + auto_path
        )
    lines.append("E = 1 - (T - T_gemm)/(T_nccl_seq - T_gemm); x/y = speedup of x over y (T_y / T_x); "
                 "nc/gemm = fused_nocomm / cuBLAS; '!' = an output failed its check; '-' = not measured")
    return "\n".join(lines)


def split_columns(c: dict, ok) -> dict:
    """A tuning row's split transport columns: the faster configuration's time (configuration 2 only where it beat 0
    by more than the cost model's noise margin), which one (``split_config``), and both times for the record."""
    from fluxinductor import cost_model

    times = {cfg: c.get(name, {}).get("ms") for cfg, name in ((0, "fused_split"), (2, "fused_split2"))}
    oks = {cfg: ok(name) for cfg, name in ((0, "fused_split"), (2, "fused_split2"))}
    usable = {cfg: t for cfg, t in times.items() if t is not None and oks[cfg] is not False}
    config = 0
    if 2 in usable and (0 not in usable or usable[2] < usable[0] * (1.0 - cost_model.MIN_GAIN)):
        config = 2
    cols = {"fused_split_ms": times[config], "fused_split_ok": oks[config]}
    if times[2] is not None or oks[2] is not None:
        cols.update(split_config=config, fused_split_config_ms={str(cfg): t for cfg, t in times.items()})
    return cols


def tuning_table(data: dict, out_json: str):
    from fluxinductor import cost_model

    env = data["environment"]
    entries = []
    for r in data["results"]:
        c = r["contenders"]
        seq = c.get("nccl_seq", {}).get("ms")
        if seq is None:
            continue

        def ok(name: str) -> Optional[bool]:  # None where the path has no time to judge
            rec = c.get(name, {})
            return rec.get("rel_ok") if rec.get("ms") is not None else None

        entries.append({
            "op": OP_NAME[r["op_key"]], "m": r["M"], "k": r["K"], "n": r["N"],
            "fused_ms": c.get("fused", {}).get("ms"),
            "fused_ok": ok("fused"),
            "fused_error": c.get("fused", {}).get("error"),
            "sequential_ms": seq,
            "gemm_ms": c.get("gemm", {}).get("ms"),
            "fused_copy_ms": c.get("fused_copy", {}).get("ms"),
            "fused_copy_ok": ok("fused_copy"),
            **split_columns(c, ok),
            "asynctp_ms": c.get("asynctp", {}).get("ms"),
            "asynctp_ok": ok("asynctp"),
            "fused_nocomm_ms": c.get("fused_nocomm", {}).get("ms"),
        })
    source = {"bench_json": os.path.relpath(out_json, REPO) if out_json.startswith(REPO) else out_json,
              "git_sha": env["git_sha"], "timestamp": env["timestamp"], "torch": env["torch"],
              "nccl": env["nccl"], "b_layout": env["b_layout"], "iters": env["iters"]}
    return cost_model, cost_model.make_table(env["device"], env["world"], env["dtype"], entries, source)


def emit_tuning(data: dict, out_json: str, path_spec: str, merge: bool) -> str:
    cost_model, table = tuning_table(data, out_json)
    if path_spec == "auto":
        path_spec = os.path.join(REPO, "fluxinductor", "tuning", "{device_key}_tp{world}.json")
    path = path_spec.format(device_key=table["device_key"], world=table["world"])
    cost_model.write_table(path, table, merge=merge)
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
    p.add_argument("--out", required=True, help="output prefix: writes <out>.json and <out>.png")
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
                   "first, so times are device times; exposed: the GPU idles while the host launches (the "
                   "anchors' method), so host-side launch cost is in every number")
    p.add_argument("--align-start", action=argparse.BooleanOptionalAction, default=True,
                   help="GPU only (default on): start each timed call after a one-element all-reduce, so every "
                        "rank's start event follows the slowest rank's (the host's skew between ranks is not timed)")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                   help="default on: per shape, time every contender but auto in --rounds rounds of a share of its "
                        "calls each, the order rotated per round, so clock drift over the run hits all alike; "
                        "--no-interleave: each contender's calls back to back, in phases (every shape per phase)")
    p.add_argument("--rounds", type=int, default=4, help="rounds per shape with --interleave (default 4)")
    p.add_argument("--seed", type=int, default=0)
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
    return args


def main(argv=None) -> int:
    args = build_args(argv)
    # torch >= 2.12 deprecates all_gather_into_tensor / reduce_scatter_tensor by name; 2.11 has no successor.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    ctx = Ctx(args)
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

    data = {"schema": "fluxinductor.bench_ops/1", "complete": False, "environment": environment(ctx, args),
            "contenders": contenders, "notes": notes, "results": []}
    by_key: Dict[Tuple[str, Tuple[int, int, int]], dict] = {}
    for op, (m, k, n) in work:
        entry = {"op": OP_LABEL[op], "op_key": op, "M": m, "K": k, "N": n, "contenders": {}}
        by_key[(op, (m, k, n))] = entry
        data["results"].append(entry)
    out_json = os.path.abspath(args.out + ".json")
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

    progress = os.path.abspath(args.out + ".progress")
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
            for op, shape in work:
                entry = by_key[(op, shape)]
                problem = Problem(op, shape, ctx)
                label = f"{OP_LABEL[op]} {shape[0]}x{shape[1]}x{shape[2]}"
                together = args.interleave and len(names) > 1
                for group in ([names] if together else [[name] for name in names]):
                    mark(f"{label} {','.join(group)}")
                    # A contender that hangs (a flag never set, a peer stuck in a collective) must not eat
                    # the whole device call: dump every thread's stack and exit; the JSON is already saved.
                    faulthandler.dump_traceback_later(args.contender_timeout * len(group), exit=True)
                    try:
                        if together:
                            records = measure_interleaved(ctx, problem, group, args.rounds)
                        else:
                            records = {group[0]: measure(ctx, problem, group[0])}
                    finally:
                        faulthandler.cancel_dump_traceback_later()
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
        sys.stdout.flush()
        os._exit(3)  # collectives cannot run any more; the peers fail on their own timeouts

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
            messages.append(try_plot(data, os.path.abspath(args.out + ".png")))
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
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written; skip process-group and symmetric-memory teardown, which has hung at exit
    # in some torch/NVSHMEM versions and would cost a device call its outputs' time.
    os._exit(rc)
