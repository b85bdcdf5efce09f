"""The pass manager inductor calls on every post-grad graph (forward and backward)."""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import List, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass


# The global Ms at which the veto asks the cost model about a match whose M is symbolic.
SYMBOLIC_M_PROBES = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class FluxPassManager(CustomGraphPass):
    """Runs fluxinductor's rewrites on a post-grad FX graph, in this order:

    0. ``all_reduce_split``: ``all_reduce(matmul)`` into a reduce-scatter and an all-gather placed before the
       next reader that needs the whole tensor (plain tensor parallelism has nothing else to fuse).  Runs first so
       that the two rewrites below fuse what it makes.  An all-reduce it keeps whole as one ``matmul_all_reduce``
       then takes the residual add and RMSNorm after it (``all_reduce_norm``: ``matmul_all_reduce_rms_norm``).
    1. ``all_gather_matmul``: ``all_gather -> mm`` (and the reshape/split/cat forms) into
       ``fluxinductor.all_gather_matmul``.  Runs before the reduce-scatter pass so a gathered tensor feeding
       several matmuls is fused once with all of them.
    2. ``matmul_reduce_scatter``: ``mm -> reduce_scatter`` into ``fluxinductor.matmul_reduce_scatter``.

    ``tp_group_names`` (a snapshot taken when the model is compiled) restricts both to those process
    groups; ``None`` allows every group.  ``fuse_matmul_sums``, ``split_all_reduce`` and ``cuda_graphs``: the
    per-compile options (None: ``fluxinductor.settings.current``'s).  The uuid covers the passes' source, these
    options and every setting (``fluxinductor.settings.compute_hash()``), so inductor's FX graph cache never returns
    a graph rewritten by other code or settings.
    """

    def __init__(self, tp_group_names: Optional[frozenset] = None, fuse_matmul_sums: Optional[bool] = None,
                 split_all_reduce: Optional[str] = None, cuda_graphs: Optional[bool] = None):
        from fluxinductor import settings

        options = {name: value for name, value in (("fuse_matmul_sums", fuse_matmul_sums),
                                                   ("split_all_reduce", split_all_reduce),
                                                   ("cuda_graphs", cuda_graphs)) if value is not None}
        self.tp_group_names = tp_group_names
        self.fuse_matmul_sums = settings.compile_option(options, "fuse_matmul_sums")
        self.split_all_reduce = settings.compile_option(options, "split_all_reduce")
        self.cuda_graphs = settings.compile_option(options, "cuda_graphs")
        self.dispatch_mode = settings.current.dispatch
        # Graphs the passes ran on since the backend last asked (see fluxinductor.backend._report_cache_hits).
        self._ran = 0

    def take_ran(self) -> bool:
        """Whether the passes ran since the last call: False for a graph served from inductor's caches."""
        ran, self._ran = self._ran > 0, 0
        return ran

    def group_allowed(self, group_name: str) -> bool:
        return self.tp_group_names is None or group_name in self.tp_group_names

    def not_worth_fusing(self, op: str, device: torch.device, world: int, m: Optional[int], k: int, n: int, dtype,
                         weight: Optional[torch.Tensor] = None, replaces_all_reduce: bool = False,
                         out_dtype: Optional[torch.dtype] = None) -> Optional[str]:
        """Why a match on ``device`` of the global GEMM (m, k, n) should stay unfused, or None to fuse it.
        ``weight`` (GEMM+RS): a fake of the [K/world, N] weight the fused op will get (None: unknown); the split
        transport is a candidate only where it can take that weight and the result's dtype (``out_dtype``, when it is
        not the operands').  ``m`` None: M is symbolic (dynamic shapes),
        and the graph serves every M, so the match stays unfused only if the cost model picks the sequential path
        at every M of :data:`SYMBOLIC_M_PROBES` (elsewhere the dispatcher chooses per call).

        On a GPU under ``FLUXINDUCTOR_DISPATCH=auto`` a fused op that would run decomposed anyway (no
        kernel, or the measured cost model says the fused kernel loses there) is slower than the graph
        inductor already has, whose collective can overlap other work (measured: a Llama-style block ran
        2-7% slower with such rewrites).  So the rewrite is kept only where the cost model picks an
        overlapped path: the fused kernel, or PyTorch's async-TP op (which the fused op then runs).  Where no table
        row answers, the cost model's roofline estimate decides here, and the op's first call measures the shape
        (``fluxinductor.calibration``), so a wrong estimate costs one decomposed op, not a slower kernel.
        Elsewhere (CPU, ``fused`` or ``decomposed`` modes) every match is rewritten.

        ``replaces_all_reduce``: the GEMM+RS is half of a split all-reduce, so it is weighed against the all-reduce
        it replaces: its saving must outweigh the all-gather the split adds (``cost_model.split_all_reduce_veto``).

        ``op`` "matmul_all_reduce" (an all-reduce the split pass will not split, kept whole as that op): None where
        the op's one-shot all-reduce kernel could run (a GPU that runs the fused kernels, the kernel built, a dtype,
        world and N it takes) under the ``fused`` dispatch; the op then runs that kernel.  Under ``auto`` only in a
        graph inductor captures in CUDA graphs (``triton.cudagraphs``, ``reduce-overhead``) with the fused ops
        captured (``cuda_graphs``), for a static output small enough for the one-shot kernel
        (:func:`fluxinductor.kernels.one_shot.small_enough`): captured, the op runs that kernel
        (``ops._captured_one_shot``), whose replay costs less than c10d's all-reduce's.  Without CUDA graphs the
        all-reduce stays inductor's: in the decode steps of bench_model (2xH200, plain TP, 64 tokens) the op ran
        0.90x inductor's step in default mode, its per-call host cost exceeding the kernel's saving.  Elsewhere (CPU
        included) the all-reduce stays as it is, and so it does on a GPU that NVML finds no NVLink peer for (the op's
        one-shot kernel could never run there, and its sequential path inside captured graphs costs more than
        inductor's).
        """
        if op == "matmul_all_reduce":
            why = self._whole_all_reduce_reason(device, world, m, n, dtype)
            if why is not None:
                return why
            try:
                from fluxinductor import dispatch
                from fluxinductor.kernels import one_shot, peers

                return (dispatch._local_reason(device.index) or one_shot.static_reason(world, n, dtype)
                        or peers.local_nvlink_reason(device))
            except Exception as e:  # noqa: BLE001 - no answer means no rewrite, never a failed compile
                return f"one-shot all-reduce unavailable ({type(e).__name__}: {e})"
        if device.type != "cuda" or self.dispatch_mode != "auto":
            return None
        from fluxinductor import cost_model, dispatch

        kernels, why = dispatch._kernels(op)
        if kernels is None:
            return why
        split_eligible = op != "matmul_reduce_scatter" or (
            weight is not None and kernels.split_reason(world, weight, None, None, out_dtype) is None)
        paths = dispatch.overlapped_paths(op, split_eligible=split_eligible)
        name = torch.cuda.get_device_name(device)
        probes = (m,) if m is not None else SYMBOLIC_M_PROBES
        choices = []
        try:
            for rows in probes:
                choice, reason, _ = cost_model.decide(op, name, world, rows, k, n, dtype, paths)
                if choice != "sequential" and replaces_all_reduce:
                    veto = cost_model.split_all_reduce_veto(name, world, rows, k, n, dtype, paths)
                    choice, reason = ("sequential", veto) if veto is not None else (choice, reason)
                choices.append((choice, reason))
        except Exception as e:  # noqa: BLE001 - an unreadable table must not stop compilation
            return f"cost model failed ({type(e).__name__}: {e})"
        if any(choice != "sequential" for choice, _ in choices):
            return None
        if m is None:
            return (f"cost model chose sequential at every M from {SYMBOLIC_M_PROBES[0]} to {SYMBOLIC_M_PROBES[-1]} "
                    f"(symbolic M); at M={SYMBOLIC_M_PROBES[-1]}: {choices[-1][1]}")
        return f"cost model chose sequential: {choices[0][1]}"

    def _whole_all_reduce_reason(self, device: torch.device, world: int, m: Optional[int], n: int,
                                 dtype) -> Optional[str]:
        """Why the dispatch mode and the compile keep an all-reduce that will not be split as it is, rather than as
        one ``matmul_all_reduce`` op (see :meth:`not_worth_fusing`); None to ask the kernel."""
        if device.type != "cuda" or self.dispatch_mode not in ("auto", "fused"):
            return (f"the all-reduce stays whole under FLUXINDUCTOR_DISPATCH={self.dispatch_mode} on "
                    f"{device.type} (the one-shot op is taken under the fused dispatch, or auto in CUDA graphs)")
        if self.dispatch_mode == "fused":
            return None
        if not (self.cuda_graphs and torch._inductor.config.triton.cudagraphs):
            return ("the all-reduce stays inductor's outside CUDA graphs under FLUXINDUCTOR_DISPATCH=auto "
                    "(the one-shot op's host cost exceeds its saving at decode sizes)")
        from fluxinductor.kernels import one_shot

        if m is None or not one_shot.small_enough(m, n, dtype, world):
            return (f"the all-reduce's output ({'symbolic' if m is None else m} x {n} {dtype}) is not known to be "
                    f"small enough for the one-shot kernel")
        return None

    def sum_per_term(self, device: torch.device, world: int, m: int, ks: List[int], n: int, dtype,
                     copied_bytes: int) -> bool:
        """Whether a GEMM+RS of a sum of matmuls on ``device`` (global M, each term's K, N) runs one fused op per
        term rather than one over the concatenated K, which copies ``copied_bytes`` each call
        (:func:`fluxinductor.cost_model.sum_per_term`).  Elsewhere than on a GPU, and under the ``decomposed``
        dispatch (where each op would run its own unhidden reduce-scatter): concatenated."""
        if device.type != "cuda" or self.dispatch_mode == "decomposed":
            return False
        from fluxinductor import cost_model

        name = torch.cuda.get_device_name(device)
        return cost_model.sum_per_term(world, m, ks, n, dtype, copied_bytes, cost_model.rates_for(name, world))

    def sum_as_slabs(self, device: torch.device, world: int, m: int, k: int, n: int, dtype) -> bool:
        """Whether a GEMM+RS of a sum of matmuls that fits the split transport's K slabs goes to the op as them
        (global M, the terms' K together, N).  The slabs run on the split transport only, so where the cost model
        picks another overlapped path for the concatenated shape (the stores transport at 512-1024 rows), the sum
        takes the per-term or concatenated form, whose ops can run that path.  Elsewhere than on a GPU under
        ``auto``: as K slabs."""
        if device.type != "cuda" or self.dispatch_mode != "auto":
            return True
        from fluxinductor import cost_model, dispatch

        op = "matmul_reduce_scatter"
        try:
            choice = cost_model.decide(op, torch.cuda.get_device_name(device), world, m, k, n, dtype,
                                       dispatch.overlapped_paths(op)).path
        except Exception:  # noqa: BLE001 - an unreadable table must not stop compilation: the slabs, as elsewhere
            return True
        return choice == "sequential" or choice.startswith("fused_split")

    def __call__(self, graph: torch.fx.Graph) -> None:
        from fluxinductor.passes.all_gather_matmul import fuse_all_gather_matmul
        from fluxinductor.passes.all_reduce_norm import fuse_all_reduce_rms_norm
        from fluxinductor.passes.all_reduce_split import split_all_reduce
        from fluxinductor.passes.matmul_reduce_scatter import fuse_matmul_reduce_scatter

        self._ran += 1
        promised = output_layouts(graph)
        if self.split_all_reduce != "off":
            split_all_reduce(graph, self.group_allowed, self.not_worth_fusing,
                             assume_replicated=self.split_all_reduce == "replicated", fuse_sums=self.fuse_matmul_sums)
            # The matmul_all_reduce ops it kept whole take the residual add and the RMSNorm after them.
            fuse_all_reduce_rms_norm(graph)
        fuse_all_gather_matmul(graph, self.group_allowed, self.not_worth_fusing)
        fuse_matmul_reduce_scatter(graph, self.group_allowed, self.not_worth_fusing, fuse_sums=self.fuse_matmul_sums,
                                   sum_per_term=self.sum_per_term, sum_as_slabs=self.sum_as_slabs)
        keep_output_layouts(graph, promised)
        graph.lint()

    def uuid(self) -> bytes:
        import fluxinductor.ops

        here = os.path.dirname(os.path.abspath(__file__))
        # The passes, and the ops they emit (their schemas and fake implementations shape the graph).
        sources = [os.path.join(here, name) for name in sorted(os.listdir(here)) if name.endswith(".py")]
        sources.append(fluxinductor.ops.__file__)
        # What not_worth_fusing reads: the cost model, its measured tables, the device and the extension.
        import fluxinductor.cost_model
        import fluxinductor.dispatch

        sources += [fluxinductor.cost_model.__file__, fluxinductor.dispatch.__file__]  # + the paths it offers
        import fluxinductor.kernels.one_shot  # its static_reason: whether an all-reduce is kept whole as an op

        sources.append(fluxinductor.kernels.one_shot.__file__)
        tuning = fluxinductor.cost_model.tuning_dir()
        if os.path.isdir(tuning):
            sources += [os.path.join(tuning, f) for f in sorted(os.listdir(tuning)) if f.endswith(".json")]
        digest = hashlib.sha256()
        for path in sources:
            with open(path, "rb") as f:
                digest.update(os.path.basename(path).encode() + b"\0" + f.read())
        groups = "*" if self.tp_group_names is None else ",".join(sorted(self.tp_group_names))
        from fluxinductor import dispatch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        kernels = dispatch._kernels("all_gather_matmul")[0] is not None, dispatch._kernels("matmul_reduce_scatter")[0] is not None
        from fluxinductor.kernels import loader

        try:
            one_shot = hasattr(loader.extension(), "one_shot_all_reduce")
        except Exception:  # noqa: BLE001 - no extension: no one-shot kernel
            one_shot = False
        asynctp = dispatch._asynctp_ops() is not None  # settings.tuning.asynctp: the veto may keep more matches
        # all_reduce_split under "replicated" writes this rank's rows into the graph (its slices): ranks sharing an FX
        # graph cache must not share its entries.
        import torch.distributed as dist

        rank = (dist.get_rank() if self.split_all_reduce == "replicated" and dist.is_available()
                and dist.is_initialized() else None)
        from fluxinductor import settings

        digest.update(f"tp_groups={groups};fuse_matmul_sums={self.fuse_matmul_sums};dispatch={self.dispatch_mode};"
                      f"device={device};kernels={kernels};one_shot={one_shot};asynctp={asynctp};cuda_graphs={self.cuda_graphs};"
                      f"split_all_reduce={self.split_all_reduce};rank={rank};"
                      f"settings={settings.compute_hash()};"
                      f"calibration={fluxinductor.cost_model.calibration_digest()}".encode())
        return digest.digest()



def output_layouts(graph: torch.fx.Graph) -> list:
    """Per output of ``graph``: ``(shape, stride, dtype)`` of its ``meta['val']``, None where it is no tensor."""
    layouts = []
    for arg in _output_args(graph):
        val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        layouts.append((tuple(val.shape), tuple(val.stride()), val.dtype) if isinstance(val, torch.Tensor) else None)
    return layouts


def keep_output_layouts(graph: torch.fx.Graph, promised: list) -> int:
    """Make every output of the rewritten ``graph`` keep the shape, dtype and strides it had before the passes.

    Inductor lays out each graph output as its node's ``meta['val']`` says; only the user-visible outputs get the
    strides recorded before the post-grad passes.  The others (a training forward's activations saved for backward,
    read by a backward graph compiled for the old strides) and the strides a caller sees decide whether the next
    call hits dynamo's cache: a block whose output changed layout feeds the next block an input whose strides differ
    from the last call's, and automatic dynamic shapes turns the recompile dynamic.  A changed shape or dtype is a
    pass bug (AssertionError); a changed stride is restored with ``prims.inductor_force_stride_order`` (a copy only
    where the layouts differ) and logged.  Returns how many outputs were restored.
    """
    from torch._inductor import inductor_prims
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    from fluxinductor.log import logger

    output = graph.find_nodes(op="output")[0]
    args = _output_args(graph)
    if len(args) != len(promised):
        raise AssertionError(f"fluxinductor passes changed the number of graph outputs: {len(promised)} -> {len(args)}")
    restored = 0
    replacements = {}
    for index, (arg, layout) in enumerate(zip(args, promised)):
        if layout is None:
            continue
        shape, stride, dtype = layout
        val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dtype != dtype or len(val.shape) != len(shape) or not all(
                statically_known_true(a == b) for a, b in zip(val.shape, shape)):
            raise AssertionError(f"fluxinductor passes changed graph output {index} from {dtype}{list(shape)} to "
                                 f"{getattr(val, 'dtype', None)}{list(getattr(val, 'shape', []))}")
        if all(statically_known_true(a == b) for a, b in zip(val.stride(), stride)):
            continue
        with graph.inserting_before(output):
            kept = graph.call_function(inductor_prims.force_stride_order, (arg, list(stride)))
        with torch._guards.detect_fake_mode([val]) or contextlib.nullcontext():
            kept.meta["val"] = torch.empty_strided(shape, stride, dtype=dtype, device=val.device)
        replacements[index] = kept
        restored += 1
        logger.info("graph output %d kept its strides %s (the rewrite gave %s)", index, list(stride),
                    list(val.stride()))
    if replacements:
        outputs = list(args)
        for index, kept in replacements.items():
            outputs[index] = kept
        single = isinstance(output.args[0], torch.fx.Node)
        output.args = (outputs[0],) if single else (type(output.args[0])(outputs),)
    return restored


def _output_args(graph: torch.fx.Graph) -> list:
    output = graph.find_nodes(op="output")[0]
    return [output.args[0]] if isinstance(output.args[0], torch.fx.Node) else list(output.args[0])

