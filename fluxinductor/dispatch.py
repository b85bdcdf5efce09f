"""Run time choice between a fused kernel and the decomposition, for each call of a fused op.

Each function returns the op's result when it ran a fused kernel, or ``None`` (after recording why with
:func:`fluxinductor.log.record_fallback`, shown under ``FLUXINDUCTOR_LOG=1``) so the op runs its
reference decomposition: the collective through the process group, then the matmul (plain sequential).

``FLUXINDUCTOR_DISPATCH`` (``fluxinductor.settings.current.dispatch``, read at every call):
  - ``auto`` (default): the path the measured cost model (:mod:`fluxinductor.cost_model`) found fastest for
    this device, world size and shape: the fused kernel (where it is eligible) or the decomposition; with
    ``settings.tuning.asynctp`` (experimental, off by default) also PyTorch's async-TP op
    (``torch.ops.symm_mem.fused_*``).  Measured on 4xH200 (benchmarks/results/h200x4_tp4_model_asynctp_path.json):
    the op benchmark gained up to 1.5x over NCCL-sequential through it, but in compiled models the same
    choice ran the 2-layer Llama forward at 0.60x inductor's speed: with torch 2.11 each async-TP call costs
    0.5-1.1 ms of host time (benchmarks/host_overhead.py; most of it in symm_mem.get_buffer), more than the
    GPU time of those layers, so it stays opt-in;
  - ``fused``: the fused kernel wherever it is eligible (benchmarks and tests);
  - ``decomposed``: never the fused kernel.

A fused kernel runs only for a group whose GPUs share a host and NVLink (:mod:`fluxinductor.kernels.peers`, asked
once per group); other groups always take the decomposition.

A call's decision (fused or not, which transport, the reason for a fallback) is made on the first call of its
signature and remembered (:data:`_plans`); later calls of that signature repeat it without asking again.  Where it ran a
fused kernel, the op's later calls of the signature skip this module's and the op's own per-call work (the replays,
:data:`_replays`).

The kernels take 2-D operands with the collective on dim 0.  Other layouts are brought to that form
here: the gathered (or scattered) dim moves to the front, which is a free view when it is the leading
non-unit dim (e.g. ``[1, S, H]`` sharded on S) and one copy otherwise.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fluxinductor import agreement, calibration, cost_model, settings
from fluxinductor.kernels import loader, symm
from fluxinductor.log import record_fallback

MODES = settings.DISPATCH_MODES


def mode() -> str:
    """The dispatch mode (validated when the settings were read)."""
    return settings.current.dispatch


@functools.lru_cache(maxsize=None)
def _kernels(op: str):
    """The kernel module for ``op``, or the reason it cannot be used."""
    try:
        if op == "all_gather_matmul":
            from fluxinductor.kernels import ag_gemm as module
        else:
            from fluxinductor.kernels import gemm_rs as module
    except Exception as e:  # noqa: BLE001 - an absent or broken extension means "decompose"
        return None, f"fused kernels unavailable ({type(e).__name__}: {e})"
    return module, None


def _world_size(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def _peers_reason(group_name: str, device: torch.device) -> Optional[str]:
    """Why the group's GPUs cannot run the fused kernels together (another host, a shared GPU, no NVLink), or None;
    a collective on the group's first call (:func:`fluxinductor.kernels.peers.group_reason`).

    Asked before the call's own checks, so that whether a rank joins that collective depends only on what every rank
    shares (the dispatch mode, CUDA operands).  Under CUDA graph capture only a remembered answer counts (a capture
    takes no collective step; an eager call before it asked)."""
    from fluxinductor.kernels import peers

    if symm.capturing():
        known, why = peers.remembered_group_reason(group_name, device)
        return why if known else "CUDA graph capture before an eager call checked the group's GPUs"

    return peers.group_reason(group_name, device, local_reason=_local_reason(device.index))


@functools.lru_cache(maxsize=None)
def _local_reason(index: int) -> Optional[str]:
    """Why this process cannot run the fused kernels on GPU ``index`` at all, or None (see :func:`_peers_reason`)."""
    why = loader.extension_available()
    capability = torch.cuda.get_device_capability(index)
    if why is None and capability != (9, 0):
        why = f"the fused kernels are built for sm_90a; cuda:{index} has capability {capability}"
    return why


def _internode_plan(device: torch.device, group_name: str, why_not: Callable[[], Optional[str]]
                    ) -> Optional[Tuple[str, Optional[str]]]:
    """For a group whose ranks span nodes (or nodes emulated on one host, ``settings.tuning.emulate_nodes``):
    ("internode", None) where the inter-node path takes the call, ("decomposed", why) where it cannot (``why_not()``:
    the call's own objection, its operands' or the kernel's); None for a group on one node.  Asked after
    :func:`_peers_reason`, which found the nodes."""
    from fluxinductor.kernels import peers

    nodes = peers.nodes(group_name, device)
    if nodes is None or len(set(nodes)) < 2:
        return None
    from fluxinductor.kernels import internode

    why = _local_reason(device.index) or internode.backend_reason(device) or why_not()
    return ("internode", None) if why is None else ("decomposed", f"inter-node path: {why}")


def _internode_measured(op: str, device: torch.device, group_name: str, world: int, m: int, k: int, n: int, dtype,
                        sequential: Callable[[], object], fused: Callable[[], object]) -> Tuple[str, Optional[str]]:
    """Under ``auto`` dispatch: the inter-node path against the sequential one, timed on the call's operands at the
    first call of a signature and agreed by every rank (:func:`fluxinductor.calibration.choose_measured`; the cost
    model's tables know NVLink only).  ("internode", None) or ("decomposed", why).  With calibration off, or under
    the ``fused`` dispatch: the inter-node path."""
    if mode() != "auto" or not settings.tuning.calibrate or symm.capturing():
        return "internode", None
    path, reason = calibration.choose_measured(f"internode_{op}", device, group_name, world, m, k, n, dtype,
                                               {"sequential": sequential, "internode": fused})
    return ("internode", None) if path == "internode" else ("decomposed", f"inter-node path: calibration chose "
                                                                            f"{path}, {reason}")


def _cost_model_says(op: str, device: torch.device, world: int, m: int, k: int, n: int, dtype,
                     fused_eligible: bool = True, split_eligible: bool = True, group_name: Optional[str] = None,
                     run_path: Optional[Callable[[str], Callable[[], object]]] = None,
                     split_configs: Tuple[int, ...] = (), slabs: bool = False) -> Tuple[str, str]:
    """(path, reason): the cost model's choice among the paths that can run here.

    Where that choice is only an estimate (no table measured the shape: a seed row or the roofline) and ``run_path``
    can run each path on the call's operands (``run_path(path)`` returns a zero-argument callable), the call is
    measured instead, once per signature and agreed by every rank (:mod:`fluxinductor.calibration`): first the
    device's rates, and if the estimate with them still leaves a fused path in the running, every candidate on the
    call itself; the split transport in each of ``split_configs`` (``run_path`` gets
    ``calibration.split_candidate(config)``) where there are two or more.  ``slabs``: a sum of matmuls as K slabs,
    which only the split transport runs."""
    name = _device_name(device.index)
    paths = ("fused_split",) if slabs else overlapped_paths(op, fused_eligible, split_eligible)
    decision = cost_model.decide(op, name, world, m, k, n, dtype, paths)
    fused_paths = tuple(p for p in paths if p != "asynctp")
    if (decision.estimated and run_path is not None and fused_paths and settings.tuning.calibrate
            and not symm.capturing()):
        calibration.ensure_rates(device, group_name, world)
        decision = cost_model.decide(op, name, world, m, k, n, dtype, paths)
        if decision.path != "sequential":
            names = ("sequential",) + paths
            if "fused_split" in paths and len(split_configs) > 1:
                at = names.index("fused_split")
                names = names[:at] + tuple(calibration.split_candidate(c) for c in split_configs) + names[at + 1:]
            candidates = {p: run_path(p) for p in names}
            path, reason = calibration.choose_measured(op, device, group_name, world, m, k, n, dtype, candidates)
            return path, f"calibration chose {path}: {reason}"
    return decision.path, f"cost model chose {decision.path}: {decision.reason}"


def split_all_reduce_veto(a: Tensor, weight: Tensor, world: int) -> Optional[str]:
    """Why the all-reduce of ``a @ weight`` should run whole rather than as a fused reduce-scatter and an all-gather
    (``cost_model.split_all_reduce_veto``: the fused half must save more than the added all-gather costs), or None.
    Only under ``auto`` dispatch on a GPU; the other modes do as they are told."""
    if mode() != "auto" or a.device.type != "cuda":
        return None
    rows = a.numel() // a.shape[-1] if a.shape[-1] else 0
    return cost_model.split_all_reduce_veto(_device_name(a.device.index), world, rows, a.shape[-1] * world,
                                            weight.shape[1], a.dtype, overlapped_paths("matmul_reduce_scatter"))


def _split_config_choice(device: torch.device, world: int, m: int, k: int, n: int, dtype) -> Optional[int]:
    return cost_model.split_config(_device_name(device.index), world, m, k, n, dtype)


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def overlapped_paths(op: str, fused_eligible: bool = True, split_eligible: bool = True) -> Tuple[str, ...]:
    """The cost model's paths this process can run for ``op``: the fused kernel where it is eligible (GEMM+RS
    with any transport: ``fused_copy`` is its copy-engine one, ``fused_split`` its two-GEMM one, offered only where
    ``split_eligible``: ``gemm_rs.split_reason`` found nothing against the call), async-TP (opt-in).  Under CUDA graph
    capture the fused kernel with NVLink stores, and for GEMM+RS the split transport: the transports a graph can
    replay."""
    rs = op == "matmul_reduce_scatter"
    if symm.capturing():
        return (("fused",) + (("fused_split",) if rs and split_eligible else ())) if fused_eligible else ()
    split = ("fused_split",) if split_eligible else ()
    fused = (("fused", "fused_copy") + split if rs else ("fused",)) if fused_eligible else ()
    return fused + (("asynctp",) if _asynctp_ops() is not None else ())


@functools.lru_cache(maxsize=None)
def _asynctp_registered():
    try:
        import torch.distributed._symmetric_memory  # noqa: F401 - registers torch.ops.symm_mem

        return torch.ops.symm_mem.fused_all_gather_matmul, torch.ops.symm_mem.fused_matmul_reduce_scatter
    except Exception:  # noqa: BLE001 - an older or CPU-only torch: the path is simply not offered
        return None


def _asynctp_ops():
    """PyTorch's async-TP ops (all-gather matmul, matmul reduce-scatter) when ``settings.tuning.asynctp`` and torch
    has them, else None."""
    if not settings.tuning.asynctp:
        return None
    return _asynctp_registered()


_asynctp_groups: set = set()


def _asynctp_group(group_name: str) -> None:
    """torch <= 2.11 needs a group registered with symmetric memory before its async-TP ops run on it."""
    if group_name not in _asynctp_groups:
        from fluxinductor.kernels.symm import _enable_group

        _enable_group(group_name)
        _asynctp_groups.add(group_name)


def _asynctp_all_gather_matmul(shard, weights, biases, gather_dim, group_name, return_gathered):
    _asynctp_group(group_name)
    gathered, outs = _asynctp_ops()[0](shard, list(weights), gather_dim, group_name, return_A=return_gathered)
    outs = [o if b is None else o + b for o, b in zip(outs, biases)]
    if not return_gathered or gathered is None:
        gathered = shard.new_empty(0)
    return outs, gathered


def _asynctp_matmul_reduce_scatter(a, weight, bias, reduce_op, scatter_dim, group_name, world):
    _asynctp_group(group_name)
    out = _asynctp_ops()[1](a, weight, reduce_op, scatter_dim, group_name)
    if bias is not None:
        # every rank adds the bias before the reduction: world times in a sum, once in an average
        out = out + (bias * world if reduce_op == "sum" else bias)
    return out


def _leading_ones(shape, dim: int) -> bool:
    """Whether every dim of ``shape`` before ``dim`` has size 1 (batch 1 of a sequence-parallel [B, S, H]): moving
    ``dim`` to the front then changes no element's position."""
    return all(shape[d] == 1 for d in range(dim))


def _rows_first(t: Tensor, dim: int) -> Tensor:
    """``t`` with ``dim`` moved to the front and flattened to 2-D: [t.size(dim) * rest, t.size(-1)], contiguous."""
    if _leading_ones(t.shape, dim):  # the move is a no-op: skip its views (host time on every call)
        flat = t.reshape(-1, t.shape[-1])
        return flat if flat.is_contiguous() else flat.contiguous()
    return t.movedim(dim, 0).contiguous().reshape(-1, t.shape[-1])


def _restore(out2d: Tensor, lead: int, rest: Tuple[int, ...], dim: int) -> Tensor:
    """Inverse of :func:`_rows_first` for a result whose moved dim now has size ``lead``, with the contiguous strides
    the ops' fake implementations promise.  Where only size-1 dims come before ``dim`` (batch 1 of a sequence-parallel
    [B, S, H]) the moved view is already in row-major order, but its size-1 dims keep strides no contiguous tensor has
    ([1, S, H] as (H, H, 1)); those reach the caller (inductor reuses the op's buffer for the pointwise op after it),
    and dynamo's guards compare every stride: the next compiled block saw a new input layout and recompiled dynamic."""
    if _leading_ones(rest, dim) and out2d.is_contiguous():
        return out2d.view(rest[:dim] + (lead,) + rest[dim:] + (out2d.shape[-1],))
    out = out2d.view((lead,) + rest + (out2d.shape[-1],)).movedim(0, dim)
    if out.is_contiguous() and out2d.is_contiguous():
        return out2d.view(out.shape)
    return out.contiguous()


# ---------------------------------------------------------------------------------------------------
# Decisions remembered per call signature.
# ---------------------------------------------------------------------------------------------------

# A model repeats a few call signatures every step, and deciding a call afresh (the group's verdict, the kernel
# module's checks, the cost model's lookup) took 60-190 us of host time per call on the 2xH200 machine
# (benchmarks/host_overhead.py --profile).  So the decision is made on a signature's first call and
# remembered, keyed by all it depends on: the dispatch mode; the operands' shapes, strides, dtypes, devices and
# 16-byte alignment; the op's other arguments; the group's name and size; in ``auto`` mode the async-TP setting and
# the cost model's table version (its file's mtime, looked up at most once a second: an edited table counts within a
# second).  What is per call stays per call: the fallback is counted (FLUXINDUCTOR_LOG), the kernel module checks its
# workspace.  Calls under CUDA graph capture decide afresh: whether they can run fused depends on the workspaces an
# eager call set up.
_plans: Dict[tuple, tuple] = {}
_MAX_PLANS = 4096


def clear_plans() -> None:
    """Forget the remembered decisions (tests that replace the dispatcher's pieces between calls), the all-reduce
    op's (``ops.matmul_all_reduce``) and the replays included."""
    from fluxinductor import ops

    _plans.clear()
    _replays.clear()
    ops.clear_plans()


def _operand_key(t: Optional[Tensor]) -> Optional[tuple]:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def _auto_key(device: torch.device, world: int) -> tuple:
    """What an ``auto`` decision depends on beyond the call: whether async-TP is offered, and the table's version."""
    return settings.tuning.asynctp, cost_model.table_version(_device_name(device.index), world)


def _remember(key: Optional[tuple], plan: tuple) -> tuple:
    if key is not None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan


# ---------------------------------------------------------------------------------------------------
# Replays: a signature whose plan runs a fused kernel on one node, called again.
# ---------------------------------------------------------------------------------------------------

# The layers above a kernel (the op's agreement fields, the plan's key, the kernel module's per-signature checks and
# launch choices) cost much of a fused call's host time, which a host-bound step pays on every layer.  So once a
# signature's plan ran a fused kernel, its later calls go from the op straight to what the kernel module prepared for
# it (``prepare_*``: the per-call work only, epochs, outputs, pointers).  The replay's key (:func:`replay_key`) holds
# what the op's agreement and the plan read: every operand's shape, strides, dtype, device and 16-byte alignment, the
# op's other arguments, and the generations of the settings, of the agreement and of the cost model's tables.  An
# entry serves for ``REPLAY_S`` seconds; the call after takes the full path once (the plan's key asks the table's
# version again, as every call did before replays) and renews it.  Calls under CUDA graph capture have no replay.  A
# compiled 2xH200 Llama forward step enqueued in 2.6-3.0 ms against 3.1-3.7 without replays (docs/performance.md,
# "Replays"; its GPU time, the longer, did not change).
_replays: Dict[tuple, Tuple[float, Callable]] = {}
REPLAY_S = 1.0


def replay_key(op: str, group_name: str, args: tuple, operands: tuple) -> Optional[tuple]:
    """The key of a call's replay: ``args`` the op's arguments that are not tensors, ``operands`` its tensors (or
    None) in a fixed order; None under CUDA graph capture."""
    if symm.capturing():
        return None
    return (op, group_name, args, settings.generation(), agreement.generation, cost_model.generation(),
            tuple(map(_operand_key, operands)))


def replay(key: Optional[tuple]) -> Optional[Callable]:
    """The replay remembered under ``key`` (:func:`replay_key`), or None."""
    if key is None:
        return None
    found = _replays.get(key)
    if found is None or found[0] < _clock():
        return None
    return found[1]


def _remember_replay(key: Optional[tuple], run: Callable) -> None:
    if key is not None:
        if len(_replays) >= _MAX_PLANS:
            _replays.clear()
        _replays[key] = (_clock() + REPLAY_S, run)


def _clock() -> float:
    return time.monotonic()


def _kernels_for(op: str, operand: Tensor):
    """The kernel module that may run ``op`` on ``operand``, or None after recording why not."""
    if not operand.is_cuda:
        record_fallback(op, f"{operand.device.type} tensors have no fused kernel")
        return None
    kernels, why = _kernels(op)
    if kernels is None:
        record_fallback(op, why)
    return kernels


def all_gather_matmul(
    shard: Tensor,
    weights: List[Tensor],
    biases: List[Optional[Tensor]],
    gather_dim: int,
    group_name: str,
    return_gathered: bool,
    replay_as: Optional[tuple] = None,
) -> Optional[Tuple[List[Tensor], Tensor]]:
    """The fused path of ``ops.all_gather_matmul``, or None (the caller decomposes).  ``replay_as``: the call's
    :func:`replay_key`, under which a fused kernel's later calls are remembered."""
    op = "all_gather_matmul"
    dispatch_mode = mode()
    if dispatch_mode == "decomposed":
        record_fallback(op, "FLUXINDUCTOR_DISPATCH=decomposed")
        return None
    kernels = _kernels_for(op, shard)
    if kernels is None:
        return None
    gather_dim %= shard.dim()
    world = _world_size(group_name)
    rest = tuple(shard.shape[d] for d in range(shard.dim() - 1) if d != gather_dim)
    # shard2d: [S * prod(rest), K], rank-major once gathered on dim 0; or, where the fused kernel can keep the
    # batch-major layout (batch_rows > 0), the shard as it is, flattened (rows_first() then gives the rank-major one).
    batch_rows = _batch_rows(shard, gather_dim)
    shard2d = shard.view(-1, shard.shape[-1]) if batch_rows else _rows_first(shard, gather_dim)

    def rows_first() -> Tensor:
        return _rows_first(shard, gather_dim) if batch_rows else shard2d

    key = None if symm.capturing() else (
        op, dispatch_mode, _auto_key(shard.device, world) if dispatch_mode == "auto" else None, group_name, world,
        gather_dim, return_gathered, _operand_key(shard), tuple(map(_operand_key, weights)),
        tuple(map(_operand_key, biases)))
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        plan = _remember(key, _decide_all_gather_matmul(kernels, dispatch_mode, shard, shard2d, weights, biases,
                                                         group_name, world, gather_dim, return_gathered, batch_rows))
    path, why = plan
    if path == "asynctp":
        record_fallback(op, why, "PyTorch async-TP")
        return _asynctp_all_gather_matmul(shard, weights, biases, gather_dim, group_name, return_gathered)
    if path == "internode":
        from fluxinductor.kernels import internode

        outputs2d, gathered2d = internode.all_gather_matmul(rows_first(), weights, biases, group_name,
                                                            return_gathered)
    elif path != "fused":
        record_fallback(op, why)
        return None
    elif batch_rows and kernels.batch_major_reason(shard2d, weights, batch_rows) is None:
        gathered_shape = list(shard.shape)
        gathered_shape[gather_dim] *= world
        run = kernels.prepare_all_gather_matmul(shard2d, weights, biases, group_name, return_gathered, batch_rows) \
            if replay_as is not None else None
        if run is None:
            outputs2d, gathered2d = kernels.all_gather_matmul(shard2d, weights, biases, group_name, return_gathered,
                                                              checked=True, batch_rows=batch_rows)
        else:
            outputs2d, gathered2d = run(shard2d, weights, biases)
            _remember_replay(replay_as, _batch_major_replay(run, gathered_shape, return_gathered))
        return _batch_major_results(outputs2d, gathered2d, gathered_shape, return_gathered)
    else:
        shard2d = rows_first()
        run = kernels.prepare_all_gather_matmul(shard2d, weights, biases, group_name, return_gathered) \
            if replay_as is not None else None
        if run is None:
            outputs2d, gathered2d = kernels.all_gather_matmul(shard2d, weights, biases, group_name, return_gathered,
                                                              checked=True)
        else:
            outputs2d, gathered2d = run(shard2d, weights, biases)
            _remember_replay(replay_as, _all_gather_matmul_replay(run, world * shard.shape[gather_dim], rest,
                                                                  gather_dim, return_gathered))
    lead = world * shard.shape[gather_dim]
    outputs = [_restore(o, lead, rest, gather_dim) for o in outputs2d]
    gathered = _restore(gathered2d, lead, rest, gather_dim) if return_gathered else shard.new_empty(0)
    return outputs, gathered


def _batch_rows(shard: Tensor, gather_dim: int) -> int:
    """For a contiguous shard gathered on a dim after a batch dim of more than one ([B, S/w, ..., K] gathered on S,
    B > 1): the rows of each of its B blocks once flattened, prod(shape[gather_dim:-1]), which the fused kernel can
    place batch-major in the gathered A (kernels' ``batch_major_reason``).  0 otherwise (the rank-major layout needs no
    permute, or the shard is not laid out for it)."""
    if gather_dim == 0 or _leading_ones(shard.shape, gather_dim) or not shard.is_contiguous():
        return 0
    rows = 1
    for size in shard.shape[gather_dim:-1]:
        rows *= size
    return rows


def _batch_major_results(outputs2d: List[Tensor], gathered2d: Tensor, gathered_shape: List[int],
                         return_gathered: bool) -> Tuple[List[Tensor], Tensor]:
    """The batch-major kernel's results as the op returns them: views of the gathered shape (the last dim N_i)."""
    outputs = [o.view(gathered_shape[:-1] + [o.shape[-1]]) for o in outputs2d]
    return outputs, gathered2d.view(gathered_shape) if return_gathered else gathered2d


def _batch_major_replay(run: Callable, gathered_shape: List[int], return_gathered: bool) -> Callable:
    """:func:`all_gather_matmul`'s batch-major path for the later calls of a signature (``run``: prepared)."""

    def replay(shard: Tensor, weights: List[Tensor], biases: List[Optional[Tensor]]) -> Tuple[List[Tensor], Tensor]:
        outputs2d, gathered2d = run(shard.view(-1, shard.shape[-1]), weights, biases)
        return _batch_major_results(outputs2d, gathered2d, gathered_shape, return_gathered)

    return replay


def _all_gather_matmul_replay(run: Callable, lead: int, rest: Tuple[int, ...], gather_dim: int,
                              return_gathered: bool) -> Callable:
    """:func:`all_gather_matmul`'s fused path for the later calls of a signature: ``run`` prepared by the kernel
    module, between the operand's move to rows-first and the results' move back."""

    def replay(shard: Tensor, weights: List[Tensor], biases: List[Optional[Tensor]]) -> Tuple[List[Tensor], Tensor]:
        outputs2d, gathered2d = run(_rows_first(shard, gather_dim), weights, biases)
        outputs = [_restore(o, lead, rest, gather_dim) for o in outputs2d]
        return outputs, _restore(gathered2d, lead, rest, gather_dim) if return_gathered else shard.new_empty(0)

    return replay


def _decide_all_gather_matmul(kernels, dispatch_mode: str, shard: Tensor, shard2d: Tensor, weights: List[Tensor],
                              biases: List[Optional[Tensor]], group_name: str, world: int, gather_dim: int,
                              return_gathered: bool, batch_rows: int = 0) -> Tuple[str, Optional[str]]:
    """(path, reason): "fused" (reason None), "asynctp", or "decomposed" with the reason.  ``shard2d``: the shard as
    the fused path gets it (flattened as it is when ``batch_rows`` > 0, see :func:`all_gather_matmul`)."""
    why = _peers_reason(group_name, shard.device)
    from fluxinductor.kernels import internode

    inter = _internode_plan(shard.device, group_name, lambda: internode.operand_reason(shard2d, weights, biases)
                            or kernels.unsupported_reason(shard2d, weights, biases, group_name))
    if inter is not None and inter[0] == "internode":
        from fluxinductor import ops

        return _internode_measured(
            "all_gather_matmul", shard.device, group_name, world, world * shard2d.shape[0], shard2d.shape[1],
            world * sum(w.shape[1] for w in weights), shard.dtype,
            lambda: ops.all_gather_matmul_reference(shard, weights, biases, gather_dim, group_name),
            lambda: internode.all_gather_matmul(shard2d, weights, biases, group_name, return_gathered))
    if inter is not None:
        return inter
    why = kernels.unsupported_reason(shard2d, weights, biases, group_name) or why
    if dispatch_mode == "auto":
        n_global = world * sum(w.shape[1] for w in weights)

        def run_path(path: str) -> Callable[[], object]:
            if path == "sequential":
                from fluxinductor import ops

                return lambda: ops.all_gather_matmul_reference(shard, weights, biases, gather_dim, group_name)
            if path == "asynctp":
                return lambda: _asynctp_all_gather_matmul(shard, weights, biases, gather_dim, group_name,
                                                          return_gathered)
            batch = batch_rows if batch_rows and kernels.batch_major_reason(shard2d, weights, batch_rows) is None else 0
            return lambda: kernels.all_gather_matmul(shard2d, weights, biases, group_name, return_gathered,
                                                     checked=True, batch_rows=batch)

        path, reason = _cost_model_says("all_gather_matmul", shard.device, world, world * shard2d.shape[0],
                                        shard2d.shape[1], n_global, shard.dtype, fused_eligible=why is None,
                                        group_name=group_name, run_path=run_path)
        if path == "asynctp":
            return path, reason
        if why is None and path != "fused":
            why = reason
    return ("decomposed", why) if why is not None else ("fused", None)


# The GEMM+RS kernel's transport for each fused path of the cost model.
_TRANSPORTS = {"fused": "store", "fused_copy": "copy", "fused_split": "split"}


def matmul_reduce_scatter(
    a: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, scatter_dim: int, group_name: str,
    out_dtype: Optional[torch.dtype] = None, replay_as: Optional[tuple] = None,
    more_a: Sequence[Tensor] = (), more_weights: Sequence[Tensor] = (),
) -> Optional[Tensor]:
    """The fused path of ``ops.matmul_reduce_scatter``, or None (the caller decomposes).  ``replay_as``: the call's
    :func:`replay_key`, under which a fused kernel's later calls are remembered.  ``more_a``, ``more_weights``: the
    sum's further terms, which only the split transport takes (as K slabs of its GEMMs, rows-first)."""
    op = "matmul_reduce_scatter"
    dispatch_mode = mode()
    if dispatch_mode == "decomposed":
        record_fallback(op, "FLUXINDUCTOR_DISPATCH=decomposed")
        return None
    kernels = _kernels_for(op, a)
    if kernels is None:
        return None
    scatter_dim %= a.dim()
    if scatter_dim == a.dim() - 1:
        record_fallback(op, "scatter over the output's last (N) dim has no fused kernel")
        return None
    world = _world_size(group_name)
    if a.shape[scatter_dim] % world:
        record_fallback(op, f"dim {scatter_dim} of size {a.shape[scatter_dim]} does not split over {world} ranks")
        return None
    rest = tuple(a.shape[d] for d in range(a.dim() - 1) if d != scatter_dim)
    # a2d: [D * prod(rest), K_local]; rank r owns rows [r, r+1) * (D / world) * prod(rest).  Or, where the fused kernel
    # can read a batch-major operand in place (batch_rows > 0: [B, D, ..., K] scattered on D, B > 1; every further
    # term's alike), the operand as it is, flattened: rank r owns its blocks of batch_rows rows (rows_first() then
    # gives the rank-major one).  more2d: the further terms (K slabs) laid out as a2d.
    batch_rows = _batch_rows(a, scatter_dim) // world if a.shape[scatter_dim] % world == 0 and all(
        a_i.shape[:-1] == a.shape[:-1] and _batch_rows(a_i, scatter_dim) for a_i in more_a) else 0
    a2d = a.view(-1, a.shape[-1]) if batch_rows else _rows_first(a, scatter_dim)
    more2d = [(a_i.view(-1, a_i.shape[-1]) if batch_rows else _rows_first(a_i, scatter_dim), w_i)
              for a_i, w_i in zip(more_a, more_weights)]

    def rows_first() -> Tensor:
        return _rows_first(a, scatter_dim) if batch_rows else a2d

    def more_rows_first() -> List[Tuple[Tensor, Tensor]]:
        return [(_rows_first(a_i, scatter_dim), w_i) for a_i, w_i in zip(more_a, more_weights)] if batch_rows \
            else more2d

    out_dtype = None if out_dtype == a.dtype else out_dtype
    key = None if symm.capturing() else (
        op, dispatch_mode, _auto_key(a.device, world) if dispatch_mode == "auto" else None, group_name, world,
        scatter_dim, reduce_op, out_dtype, _operand_key(a), _operand_key(weight), _operand_key(bias),
        tuple(map(_operand_key, (*more_a, *more_weights))))
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        plan = _remember(key, _decide_matmul_reduce_scatter(kernels, dispatch_mode, a, a2d, weight, bias, reduce_op,
                                                            group_name, world, out_dtype, scatter_dim, batch_rows,
                                                            more2d, more_a))
    path, why, transport, split_config = plan
    if path == "asynctp":
        record_fallback(op, why, "PyTorch async-TP")
        return _asynctp_matmul_reduce_scatter(a, weight, bias, reduce_op, scatter_dim, group_name, world)
    if path == "internode":
        from fluxinductor.kernels import internode

        out2d = internode.matmul_reduce_scatter(rows_first(), weight, bias, reduce_op, group_name)
        return _restore(out2d, a.shape[scatter_dim] // world, rest, scatter_dim)
    if path != "fused":
        record_fallback(op, why)
        return None
    extra = {} if out_dtype is None else {"out_dtype": out_dtype}
    if batch_rows and kernels.batch_major_reason(a2d, batch_rows, world) is None:
        out_shape = list(a.shape[:-1]) + [weight.shape[1]]
        out_shape[scatter_dim] //= world
        if more2d:
            extra["more"] = more2d
        run = kernels.prepare_matmul_reduce_scatter(a2d, weight, bias, reduce_op, group_name, transport=transport,
                                                    split_config_choice=split_config, batch_rows=batch_rows,
                                                    **extra) if replay_as is not None else None
        if run is None:
            out2d = kernels.matmul_reduce_scatter(a2d, weight, bias, reduce_op, group_name, checked=True,
                                                  transport=transport, split_config_choice=split_config,
                                                  batch_rows=batch_rows, **extra)
        else:
            out2d = run(a2d, weight, bias, None, more2d) if more2d else run(a2d, weight, bias)
            _remember_replay(replay_as, _batch_major_rs_replay(run, out_shape))
        return out2d.view(out_shape)
    a2d = rows_first()
    more2d = more_rows_first()
    if more2d:
        extra["more"] = more2d
    run = kernels.prepare_matmul_reduce_scatter(a2d, weight, bias, reduce_op, group_name, transport=transport,
                                                split_config_choice=split_config, **extra) \
        if replay_as is not None else None
    if run is None:
        out2d = kernels.matmul_reduce_scatter(a2d, weight, bias, reduce_op, group_name, checked=True,
                                              transport=transport, split_config_choice=split_config, **extra)
    else:
        out2d = run(a2d, weight, bias, None, more2d) if more2d else run(a2d, weight, bias)
        _remember_replay(replay_as, _matmul_reduce_scatter_replay(run, a.shape[scatter_dim] // world, rest,
                                                                  scatter_dim))
    return _restore(out2d, a.shape[scatter_dim] // world, rest, scatter_dim)


def _batch_major_rs_replay(run: Callable, out_shape: List[int]) -> Callable:
    """:func:`matmul_reduce_scatter`'s batch-major path for the later calls of a signature (``run``: prepared)."""

    def replay(a: Tensor, weight: Tensor, bias: Optional[Tensor], more_a: Sequence[Tensor] = (),
               more_weights: Sequence[Tensor] = ()) -> Tensor:
        a2d = a.view(-1, a.shape[-1])
        if more_a:
            more = [(a_i.view(-1, a_i.shape[-1]), w_i) for a_i, w_i in zip(more_a, more_weights)]
            return run(a2d, weight, bias, None, more).view(out_shape)
        return run(a2d, weight, bias).view(out_shape)

    return replay


def _matmul_reduce_scatter_replay(run: Callable, lead: int, rest: Tuple[int, ...], scatter_dim: int) -> Callable:
    """:func:`matmul_reduce_scatter`'s fused path for the later calls of a signature (see
    :func:`_all_gather_matmul_replay`)."""

    def replay(a: Tensor, weight: Tensor, bias: Optional[Tensor], more_a: Sequence[Tensor] = (),
               more_weights: Sequence[Tensor] = ()) -> Tensor:
        a2d = _rows_first(a, scatter_dim)
        if more_a:
            more = [(_rows_first(a_i, scatter_dim), w_i) for a_i, w_i in zip(more_a, more_weights)]
            return _restore(run(a2d, weight, bias, None, more), lead, rest, scatter_dim)
        return _restore(run(a2d, weight, bias), lead, rest, scatter_dim)

    return replay


def _decide_matmul_reduce_scatter(kernels, dispatch_mode: str, a: Tensor, a2d: Tensor, weight: Tensor,
                                  bias: Optional[Tensor], reduce_op: str, group_name: str, world: int,
                                  out_dtype: Optional[torch.dtype], scatter_dim: int = 0, batch_rows: int = 0,
                                  more2d: Sequence[Tuple[Tensor, Tensor]] = (), more_a: Sequence[Tensor] = ()
                                  ) -> Tuple[str, Optional[str], str, Optional[int]]:
    """(path, reason, transport, split configuration): path "fused" (reason None) with the kernel's transport,
    "asynctp", or "decomposed" with the reason.  ``a2d``: the operand as the fused path gets it (flattened as it is
    when ``batch_rows`` > 0, see :func:`matmul_reduce_scatter`); ``more2d``: a sum's further terms laid out as
    ``a2d``, which only the split transport takes; ``more_a``: their operands as the op got them."""
    if more2d:
        return _decide_k_slabs(kernels, dispatch_mode, a, a2d, weight, bias, reduce_op, group_name, world, out_dtype,
                               scatter_dim, more_a, more2d, batch_rows)
    why = _peers_reason(group_name, a.device)
    from fluxinductor.kernels import internode

    inter = _internode_plan(a.device, group_name, lambda: internode.operand_reason(a2d, [weight], [bias]) or (
        f"an {out_dtype} output" if out_dtype is not None else None) or (
        f"reduce op {reduce_op!r}" if reduce_op not in ("sum", "avg") else None))
    if inter is not None and inter[0] == "internode":
        from fluxinductor import ops

        inter = _internode_measured(
            "matmul_reduce_scatter", a.device, group_name, world, a2d.shape[0], world * a2d.shape[1], weight.shape[1],
            a.dtype,
            lambda: ops.matmul_reduce_scatter_reference(a, weight, bias, reduce_op, scatter_dim, group_name, out_dtype),
            lambda: internode.matmul_reduce_scatter(a2d, weight, bias, reduce_op, group_name))
    if inter is not None:
        return (*inter, "store", None)
    extra = () if out_dtype is None else (out_dtype,)
    why = kernels.unsupported_reason(a2d, weight, bias, reduce_op, group_name, *extra) or why
    transport = "store"
    if dispatch_mode == "auto":
        # Where the split transport cannot take the call (N not a multiple of 8, a misaligned bias), the cost model
        # chooses among the others: its measured split time says nothing about them, and the copy transport the
        # kernel would otherwise fall back to can lose to NCCL-then-cuBLAS where split wins.
        split_eligible = why is None and kernels.split_reason(world, weight, bias, None, out_dtype) is None
        m, k, n = a2d.shape[0], world * a2d.shape[1], weight.shape[1]
        extra_kw = {} if out_dtype is None else {"out_dtype": out_dtype}

        def run_path(path: str) -> Callable[[], object]:
            if path == "sequential":
                from fluxinductor import ops

                return lambda: ops.matmul_reduce_scatter_reference(a, weight, bias, reduce_op, scatter_dim, group_name,
                                                                   out_dtype)
            if path == "asynctp":
                return lambda: _asynctp_matmul_reduce_scatter(a, weight, bias, reduce_op, scatter_dim, group_name,
                                                              world)
            path, config = calibration.parse_candidate(path)
            if config is None:
                config = _split_config_choice(a.device, world, m, k, n, a.dtype)
            batch = batch_rows if batch_rows and kernels.batch_major_reason(a2d, batch_rows, world) is None else 0
            return lambda: kernels.matmul_reduce_scatter(a2d, weight, bias, reduce_op, group_name, checked=True,
                                                         transport=_TRANSPORTS[path], split_config_choice=config,
                                                         batch_rows=batch, **extra_kw)

        path, reason = _cost_model_says("matmul_reduce_scatter", a.device, world, m, k, n, a.dtype,
                                        fused_eligible=why is None, split_eligible=split_eligible,
                                        group_name=group_name, run_path=run_path,
                                        split_configs=kernels.split_configs(a.dtype) if split_eligible else ())
        if path == "asynctp":
            return path, reason, transport, None
        if path in _TRANSPORTS:
            transport = _TRANSPORTS[path]
        elif why is None:
            why = reason  # sequential
    if why is not None:
        return "decomposed", why, transport, None
    # The split GEMMs' configuration measured fastest for the shape (the table's split_config; used only if the
    # call runs the split transport, by the cost model's choice or settings.tuning.gemm_rs_push="split").
    split_config = _split_config_choice(a.device, world, a2d.shape[0], world * a2d.shape[1], weight.shape[1],
                                        a.dtype)
    return "fused", None, transport, split_config


def _decide_k_slabs(kernels, dispatch_mode: str, a: Tensor, a2d: Tensor, weight: Tensor, bias: Optional[Tensor],
                    reduce_op: str, group_name: str, world: int, out_dtype: Optional[torch.dtype], scatter_dim: int,
                    more_a: Sequence[Tensor], more2d: Sequence[Tuple[Tensor, Tensor]], batch_rows: int = 0
                    ) -> Tuple[str, Optional[str], str, Optional[int]]:
    """:func:`_decide_matmul_reduce_scatter` for a sum of matmuls: the split transport with the terms as K slabs of
    its GEMMs where it can take them and (``auto``) the cost model, on the concatenated K, finds it faster than the
    sequential path; else the decomposition.  The other transports, async-TP and the inter-node path take one
    matmul."""
    why = _peers_reason(group_name, a.device)  # across nodes too: K slabs run on one node's split transport
    extra = () if out_dtype is None else (out_dtype,)
    why = why or kernels.unsupported_reason(a2d, weight, bias, reduce_op, group_name, *extra) or \
        kernels.split_reason(world, weight, bias, None, out_dtype) or kernels.slabs_reason(a2d, weight, more2d)
    if why is None and symm.capturing():
        why = kernels.captured_slabs_reason(a2d, weight, bias, group_name, more2d)
    m, n = a2d.shape[0], weight.shape[1]
    k = world * (a2d.shape[1] + sum(a_i.shape[1] for a_i, _ in more2d))
    if why is None and dispatch_mode == "auto":
        more_weights = [w_i for _, w_i in more2d]
        out_kw = {} if out_dtype is None else {"out_dtype": out_dtype}

        def run_path(path: str) -> Callable[[], object]:
            if path == "sequential":
                from fluxinductor import ops

                return lambda: ops.matmul_reduce_scatter_reference(a, weight, bias, reduce_op, scatter_dim, group_name,
                                                                   out_dtype, more_a, more_weights)
            config = calibration.parse_candidate(path)[1]
            if config is None:
                config = _split_config_choice(a.device, world, m, k, n, a.dtype)
            batch = batch_rows if batch_rows and kernels.batch_major_reason(a2d, batch_rows, world) is None else 0
            a_run, more_run = (a2d, more2d) if batch or not batch_rows else (
                _rows_first(a, scatter_dim), [(_rows_first(a_i, scatter_dim), w_i) for a_i, w_i in
                                              zip(more_a, more_weights)])
            return lambda: kernels.matmul_reduce_scatter(a_run, weight, bias, reduce_op, group_name, checked=True,
                                                         transport="split", split_config_choice=config,
                                                         batch_rows=batch, more=more_run, **out_kw)

        path, reason = _cost_model_says("matmul_reduce_scatter", a.device, world, m, k, n, a.dtype,
                                        group_name=group_name, run_path=run_path, split_configs=kernels.split_configs(
                                            a.dtype), slabs=True)
        if path != "fused_split":
            why = reason
    if why is not None:
        return "decomposed", why, "split", None
    return "fused", None, "split", _split_config_choice(a.device, world, m, k, n, a.dtype)
