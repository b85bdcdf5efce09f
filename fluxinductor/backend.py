"""``torch.compile(model, backend="flux")``: inductor plus fluxinductor's passes.

Registered through the ``torch_dynamo_backends`` entry point, so ``backend="flux"`` works without
importing fluxinductor first.
"""

from __future__ import annotations

import collections
import functools
import re
from typing import Any, Dict, List, Optional

import torch

from fluxinductor import settings
from fluxinductor.log import logger, record_served


def flux_backend(gm: torch.fx.GraphModule, example_inputs: List[Any], options: Optional[Dict[str, Any]] = None,
                 mode: Optional[str] = None):
    """Compile ``gm`` with inductor, with fluxinductor's pass manager as the post-grad custom pass.

    ``options`` (from ``torch.compile(..., options=...)``): fluxinductor's per-compile options (docs/settings.md),
    taken out before the rest become inductor config patches:

    - ``"tp_group"`` (a group name, ProcessGroup, 1-D DeviceMesh or a list of them) restricts fusion to that group,
      overriding :func:`fluxinductor.set_tp_group`;
    - ``"split_all_reduce"`` (``"exact"``, ``"replicated"``, ``"off"``), ``"fuse_matmul_sums"`` (bool): what the
      passes rewrite;
    - ``"cuda_graphs"`` (bool, default True): whether the fused ops may be captured in CUDA graphs with the rest of
      the graph.  Off, a compile with CUDA graphs on (``mode="reduce-overhead"``) is left to plain inductor: running
      the ops between captured partitions costs more than it hides at the sizes CUDA graphs serve.  See :mod:`fluxinductor.settings` for what it cannot change per compile.

    Each defaults to ``fluxinductor.settings.current``.  Forward and backward graphs are both rewritten: inductor
    applies the same config patches to the backward compile.  ``mode`` (``torch.compile(..., mode=...)``; torch
    accepts it or ``options``, not both) means what it means for inductor (:func:`torch._inductor.list_mode_options`):
    ``"reduce-overhead"`` and ``"max-autotune"`` turn on CUDA graphs.
    """
    from torch._inductor.compile_fx import compile_fx

    # Registering the ops here makes graphs from the entry point (no `import fluxinductor`) work too.
    import fluxinductor.ops  # noqa: F401 - registers torch.ops.fluxinductor
    from fluxinductor.passes import FluxPassManager

    patches = dict(options or {})
    if mode is not None:
        patches = _mode_options(mode)
    # Taken out before the patches reach inductor, which rejects keys it does not know.
    tp_group = patches.pop("tp_group", None)
    split_all_reduce = settings.compile_option(patches, "split_all_reduce")
    fuse_matmul_sums = settings.compile_option(patches, "fuse_matmul_sums")
    cuda_graphs = settings.compile_option(patches, "cuda_graphs")
    if settings.current.disable:
        logger.info("FLUXINDUCTOR_DISABLE is set: compiling with plain inductor")
        return compile_fx(gm, example_inputs, config_patches=patches or None)

    if tp_group is not None:
        settings.set_tp_group(tp_group)
    user_pass = patches.get("post_grad_custom_post_pass", torch._inductor.config.post_grad_custom_post_pass)
    if user_pass is not None:
        raise ValueError(
            "backend='flux' installs inductor's post_grad_custom_post_pass itself; another one is already set"
        )
    cudagraphs = patches.get("triton.cudagraphs", torch._inductor.config.triton.cudagraphs)
    if cudagraphs and not cuda_graphs:
        # The fused ops would have to run between captured partitions: each split costs a replay and an eager call,
        # more than the communication of the small steps such graphs serve (decode).  The graph stays inductor's.
        logger.info("CUDA graphs are on and the fused ops may not be captured (cuda_graphs=False): compiling with "
                    "plain inductor")
        return compile_fx(gm, example_inputs, config_patches=patches or None)
    if cuda_graphs:
        settings.note_cuda_graphs_compile()  # the ops' kernels may run where this graph is captured
    patches["post_grad_custom_post_pass"] = FluxPassManager(settings.tp_group_names(), fuse_matmul_sums,
                                                            split_all_reduce, cuda_graphs)
    _report_cache_hits()
    return compile_fx(gm, example_inputs, config_patches=patches)


# A call site in the generated wrapper (``buf0 = torch.ops.fluxinductor.all_gather_matmul.default(...)``); the same
# name also appears in its size asserts and comments.
_FUSED_OP_CALL = re.compile(r"=\s*torch\.ops\.fluxinductor\.(\w+)\.\w+\(")


def fused_op_calls(source_code: str) -> Dict[str, int]:
    """``{op: n}``: how often inductor's generated ``source_code`` calls each ``torch.ops.fluxinductor`` op."""
    return dict(collections.Counter(_FUSED_OP_CALL.findall(source_code or "")))


def _report_cache_hits() -> None:
    """Make graphs served from inductor's FX graph or AOTAutograd cache say what they run.

    A served graph skips the post-grad passes, so nothing reaches :func:`fluxinductor.rewrite_stats` or the log.
    Torch (2.11-2.13) has no post-load hook, but every compiled graph, fresh or loaded from either cache, goes through
    ``CompiledFxGraph.post_compile`` with the compile's inductor config in force: there, a graph compiled under a
    :class:`FluxPassManager` whose pass did not run since the last one was served from a cache, and its generated
    code's fused-op calls are counted (``rewrite_stats()["from_cache"]``) and logged.  Installed once per process.
    """
    from torch._inductor.output_code import CompiledFxGraph

    if getattr(CompiledFxGraph.post_compile, "_fluxinductor", False):
        return
    original = CompiledFxGraph.post_compile

    @functools.wraps(original)
    def post_compile(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        from fluxinductor.passes import FluxPassManager

        manager = torch._inductor.config.post_grad_custom_post_pass
        if isinstance(manager, FluxPassManager) and not manager.take_ran():
            record_served(fused_op_calls(getattr(self, "source_code", "")))
        return result

    post_compile._fluxinductor = True  # type: ignore[attr-defined]
    CompiledFxGraph.post_compile = post_compile


def _mode_options(mode: str) -> Dict[str, Any]:
    """Inductor's config for a ``torch.compile`` mode (torch checks the mode only for its own backend)."""
    from torch._inductor import list_mode_options

    modes = list_mode_options()
    if mode not in modes:
        raise ValueError(f"torch.compile mode {mode!r} is not one of {sorted(modes)}")
    return dict(list_mode_options(mode))
