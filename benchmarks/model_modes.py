"""bench_model.py's modes: what each compiles (eager, inductor, inductor + async-TP, ``backend="flux"`` with dispatch
``auto`` or ``fused``, and ``nocomm``: inductor on the no-communication replica), a census of the collectives left in
inductor's graphs, and each mode's errors against eager.  ``inductor_overlap`` is inductor with PyTorch's overlap
scheduler (``aten_distributed_optimizations.enable_overlap_scheduling``: collectives started early, their waits sunk
past independent compute), for comparison.

Every mode's callable stays alive for the whole run of its model (the contenders are timed in alternating rounds),
so each must keep its own compiled code: torch.compile keys dynamo's cache entries by code object and tells
backends apart by the backend callable only (two ``torch.compile`` calls with the same backend share compiled code
across model instances), while inductor reads its config when it compiles.  So async-TP gets a backend callable of
its own (``inductor_asynctp``, registered with dynamo) that applies ``_micro_pipeline_tp`` to the forward and
backward compiles it makes (the overlap scheduler likewise, ``inductor_overlap``), ``flux_fused`` another
(``flux_fused``: flux's compiler under a second callable), the
no-communication replica a root module of its own (``models.LocalReplica``), and every mode gets its context
(dispatch mode, config patches) back each time it runs (``make_context``)."""

from __future__ import annotations

import collections
import contextlib
import math
import warnings
from typing import Dict, List, Optional

import torch
import torch.nn as nn
from harness import RunContext, dispatch_mode

MODES = ("eager", "inductor", "inductor_overlap", "asynctp", "flux", "flux_fused", "nocomm")
# inductor_overlap (PyTorch's overlap scheduler) is opt-in: it needs triton, and it removed nothing in the runs recorded
# in docs/performance.md.
DEFAULT_MODES = tuple(m for m in MODES if m != "inductor_overlap")
# Compile order: eager first (the reference), fluxinductor before async-TP (as in bench_ops.py), so async-TP's
# symmetric-memory workspace is allocated last.  Timing rounds rotate this order.
RUN_ORDER = ("eager", "inductor", "inductor_overlap", "nocomm", "flux", "flux_fused", "asynctp")
FLUX_DISPATCH = {"flux": "auto", "flux_fused": "fused"}
# Modes whose share of the communication cost removed, G = (T_inductor - T) / (T_inductor - T_nocomm), is reported.
GAIN_MODES = ("inductor_overlap", "asynctp", "flux", "flux_fused")


# ---------------------------------------------------------------------------------------------------
# Per-mode compile settings and graph census
# ---------------------------------------------------------------------------------------------------

try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # older torch: a plain callable is accepted
    _PassBase = object

CENSUS_KEYS = ("all_gather", "reduce_scatter", "all_reduce", "symm_mem", "fluxinductor")


class GraphCensus(_PassBase):
    """A post-grad pass that only counts collective and fused-op nodes, one dict per compiled graph.

    It runs after inductor's micro-pipeline TP pass, so ``symm_mem.fused_*`` counts show async-TP fired.
    """

    def __init__(self):
        self.graphs: List[Dict[str, int]] = []

    def __call__(self, graph) -> None:
        counts: collections.Counter = collections.Counter()
        for node in graph.nodes:
            if node.op == "call_function":
                target = str(node.target)
                if any(key in target for key in CENSUS_KEYS):
                    counts[target] += 1
        self.graphs.append(dict(counts))

    def uuid(self):
        return "fluxinductor-bench-model-graph-census-1"


def _enable_symm_mem(group_name: str) -> Optional[str]:
    """Register the TP group with torch symmetric memory (needed on torch 2.11); the error, if any."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is None:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(group_name)
    except Exception as e:  # noqa: BLE001
        return f"enable_symm_mem_for_group failed: {type(e).__name__}: {e}"
    return None


class PatchedInductor:
    """Inductor with config ``patches`` and this run's graph census, as a backend callable of its own, registered with
    dynamo as ``name``: ``inductor_asynctp`` (``_micro_pipeline_tp`` on: PyTorch async-TP) and ``inductor_overlap``
    (PyTorch's overlap scheduler: each collective started early, its wait sunk past independent compute).  The patches
    go to ``compile_fx(config_patches=...)``, which applies them to the forward compile and to the backward compile
    whenever AOTAutograd makes it; ``mode`` / ``options`` (from ``torch.compile(..., mode=...)``) mean what they mean
    for ``backend="inductor"``."""

    def __init__(self, name: str, patches: dict):
        self.__name__ = name
        self.patches = dict(patches)
        self.census: Optional[GraphCensus] = None

    def __call__(self, gm, example_inputs, mode: Optional[str] = None, options: Optional[dict] = None):
        from torch._inductor.compile_fx import compile_fx

        # What backend="inductor" would apply for this mode and options (CUDA graphs for reduce-overhead, ...).
        patches = dict(torch._TorchCompileInductorWrapper(mode, options, None).config)
        patches.update(self.patches)
        if self.census is not None:
            patches["post_grad_custom_post_pass"] = self.census
        return compile_fx(gm, example_inputs, config_patches=patches)


PATCHED_BACKENDS = {
    "asynctp": PatchedInductor("inductor_asynctp", {"_micro_pipeline_tp": True}),
    "inductor_overlap": PatchedInductor("inductor_overlap",
                                        {"aten_distributed_optimizations.enable_overlap_scheduling": True}),
}


def patched_backend(mode: str) -> PatchedInductor:
    """The backend callable of ``mode`` (a key of :data:`PATCHED_BACKENDS`), registered with dynamo under its name
    (once per process)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    backend = PATCHED_BACKENDS[mode]
    if _COMPILER_FNS.get(backend.__name__) is not backend:
        register_backend(backend, name=backend.__name__)
    return backend


def flux_fused(gm, example_inputs, **kwargs):
    """``backend="flux"`` under a callable of its own, for the ``flux_fused`` mode: flux and flux_fused differ only in
    the dispatch mode they run under, so with one backend callable dynamo would hand flux_fused flux's compiled code
    (and, with CUDA graphs, graphs captured under flux's dispatch)."""
    from fluxinductor.backend import flux_backend

    return flux_backend(gm, example_inputs, **kwargs)


def flux_backend_for(mode: str):
    """The backend for a flux mode: ``"flux"`` (what users write) or the registered ``flux_fused`` callable."""
    if mode == "flux":
        return "flux"
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if _COMPILER_FNS.get("flux_fused") is not flux_fused:
        register_backend(flux_fused, name="flux_fused")
    return flux_fused


def mode_setup(mode: str, model: nn.Module, ctx: RunContext, notes: List[str]):
    """(callable, make_context, census or None) for ``mode`` on ``model`` (for ``nocomm``: the no-communication
    replica); ``make_context()`` gives a fresh context manager for every stretch of calls (compile and timing).
    Compiling happens at the first call."""
    import torch._inductor.config as inductor_config

    if mode == "eager":
        return model, contextlib.nullcontext, None
    if mode in ("inductor", "nocomm"):
        census = GraphCensus()
        fn = torch.compile(model, backend="inductor", **ctx.compile_kwargs)
        return fn, lambda: inductor_config.patch({"post_grad_custom_post_pass": census}), census
    if mode in PATCHED_BACKENDS:
        if mode == "asynctp" and ctx.is_cuda:
            err = _enable_symm_mem(ctx.group_name)
            if err:
                notes.append(err)
        elif mode == "asynctp":
            notes.append("cpu: symmetric memory is CUDA only; the async-TP pass cannot fuse here")
        backend = patched_backend(mode)
        census = backend.census = GraphCensus()
        return torch.compile(model, backend=backend, **ctx.compile_kwargs), contextlib.nullcontext, census
    if mode in FLUX_DISPATCH:
        import fluxinductor  # noqa: F401  (registers the ops and the backend)

        def make_context():
            stack = contextlib.ExitStack()
            stack.enter_context(dispatch_mode(FLUX_DISPATCH[mode]))
            # backend="flux" installs its own post_grad_custom_post_pass and refuses a foreign one.
            stack.enter_context(inductor_config.patch({"post_grad_custom_post_pass": None}))
            return stack

        options = {"options": ctx.flux_options} if ctx.flux_options else {}
        return (torch.compile(model, backend=flux_backend_for(mode), **ctx.compile_kwargs, **options), make_context,
                None)
    raise ValueError(f"unknown mode {mode!r}")


# ---------------------------------------------------------------------------------------------------
# Errors against eager, rewrite statistics
# ---------------------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return (to_local() if to_local is not None else t).detach()


def error_of(out: Optional[torch.Tensor], ref: Optional[torch.Tensor]) -> Dict[str, float]:
    """max |out - ref| / max |ref| and ||out - ref|| / ||ref|| (inf when missing or mis-shaped)."""
    if out is None or ref is None or tuple(out.shape) != tuple(ref.shape):
        return {"max_rel": float("inf"), "norm_rel": float("inf")}
    out, ref = out.float(), ref.float()
    diff = out - ref
    max_rel = (diff.abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    norm_rel = (diff.norm() / ref.norm().clamp_min(1e-30)).item()
    return {"max_rel": max_rel if math.isfinite(max_rel) else float("inf"),
            "norm_rel": norm_rel if math.isfinite(norm_rel) else float("inf")}


def snapshot(model: nn.Module, out: torch.Tensor, x: torch.Tensor, backward: bool) -> Dict[str, torch.Tensor]:
    """This rank's output (and input / parameter gradients) from one call, as plain local tensors."""
    snap = {"output": _local(out).clone()}
    if backward:
        snap["grad_input"] = None if x.grad is None else x.grad.detach().clone()
        for name, p in model.named_parameters():
            snap["grad:" + name] = None if p.grad is None else _local(p.grad).clone()
    return snap


def compare(snap: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, float]]:
    """Errors per output: "output", "grad_input" and "grad_params" (the worst parameter gradient)."""
    errors = {}
    for key in ("output", "grad_input"):
        if key in ref:
            errors[key] = error_of(snap.get(key), ref[key])
    params = [k for k in ref if k.startswith("grad:")]
    if params:
        per = {k: error_of(snap.get(k), ref[k]) for k in params}
        worst = max(per, key=lambda k: per[k]["norm_rel"])
        errors["grad_params"] = dict(per[worst], worst=worst[len("grad:"):])
    return errors
