"""bench_ops.py's contenders: the problem each one runs (inputs, fp32 references, one callable per contender),
whether it can run here, and the settings it runs under.

Shapes are *global* GEMMs (M, K, N) (docs/performance.md):
AG+GEMM: each rank holds A_shard [M/w, K] and B [K, N/w], out [M, N/w];
GEMM+RS: each rank holds A [M, K/w] and B [K/w, N], out [M/w, N].
"""

from __future__ import annotations

import contextlib
import importlib
import math
import zlib
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from harness import RunContext, overridden

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
# Contenders that go through the dispatcher: the dispatch mode (fluxinductor.settings' ``dispatch``) and the
# kernel-tuning fields (fluxinductor.settings.tuning) of each.
DISPATCHED = {"fused": ("fused", {}), "fused_copy": ("fused", {"gemm_rs_push": "copy"}),
              "fused_split": ("fused", {"gemm_rs_push": "split", "gemm_rs_split_config": 0}),
              "fused_split2": ("fused", {"gemm_rs_push": "split", "gemm_rs_split_config": 2}),
              "auto": ("auto", {})}

# ||out - ref|| / ||ref|| against the fp32 reference (bf16: <= 1e-2).
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}


# ---------------------------------------------------------------------------------------------------
# Problems: inputs, fp32 references and one callable per contender
# ---------------------------------------------------------------------------------------------------


def _randn(shape, ctx: RunContext, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, device=ctx.device, dtype=torch.float32)
    return (t * scale).to(ctx.dtype)


def _make_b(k: int, n: int, ctx: RunContext, gen: torch.Generator) -> torch.Tensor:
    """B: [k, n].  Layout "t" is what nn.Linear graphs pass (weight [n, k] transposed, column major)."""
    scale = 1.0 / math.sqrt(k)
    if ctx.b_layout == "t":
        return _randn((n, k), ctx, gen, scale).t()
    return _randn((k, n), ctx, gen, scale)


def _all_gather(t: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    out = t.new_empty((ctx.world * t.shape[0],) + tuple(t.shape[1:]))
    dist.all_gather_into_tensor(out, t.contiguous(), group=ctx.group)
    return out


def _reduce_scatter(t: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    out = t.new_empty((t.shape[0] // ctx.world,) + tuple(t.shape[1:]))
    dist.reduce_scatter_tensor(out, t.contiguous(), group=ctx.group)
    return out


class Problem:
    """One op at one global shape on this rank: inputs, fp32 references, contender callables.

    ``contender(name)`` returns ``(fn, ref)``: ``fn()`` runs the contender once and returns its output,
    ``ref`` is the fp32 tensor that output must match.
    """

    def __init__(self, op: str, shape: Tuple[int, int, int], ctx: RunContext):
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


def _setup_asynctp(ctx: RunContext) -> Optional[str]:
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


def setup_error(name: str, op: str, ctx: RunContext) -> Optional[str]:
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


@contextlib.contextmanager
def contender_settings(name: Optional[str]) -> Iterator[None]:
    """The dispatch mode and kernel-tuning fields of contender ``name`` (:data:`DISPATCHED`) for the ``with`` block,
    the previous ones restored after it.  ``None`` or a contender that does not go through the dispatcher: nothing
    changes."""
    mode, values = DISPATCHED.get(name, (None, {})) if name is not None else (None, {})
    with overridden(**values, **({} if mode is None else {"dispatch": mode})):
        yield


def _fallbacks(op: str) -> Dict[str, int]:
    from fluxinductor.log import rewrite_stats

    return dict(rewrite_stats().get("fallbacks", {}).get(OP_NAME[op], {}))


def kernel_error_check(op: str, ctx: RunContext) -> None:
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

