"""Fused GEMM + reduce-scatter on Hopper (``fluxinductor._C.gemm_rs_run``), Flux's method.

Row-parallel linear: every rank holds ``a2d`` [M, K/world] and ``weight`` [K/world, N]; the result on rank r is
rows [r*M/world, (r+1)*M/world) of ``sum_q (a2d_q @ weight_q + bias)`` (divided by world for "avg").

One persistent CUTLASS sm90a GEMM per rank, batched over the world row segments of A.  Its tile scheduler
walks the peers' segments first (rank r+1, r+2, ...) and its own segment last; the epilogue stores a peer's
tile (staged in shared memory, written with 16-byte stores) straight into that peer's symmetric buffer
(slot r) over NVLink and raises one flag per tile to the call's epoch.  The own segment's epilogue waits for those flags, adds the peers' slots and the bias and
writes the output, so the reduction needs no extra kernel and no extra pass over memory.

How the peer tiles travel (``transport``: the dispatcher passes the cost model's choice per shape;
``settings.tuning.gemm_rs_push``, when set, decides for every call; ranks that differ get an error):
  - ``store``: as above, 16-byte NVLink stores from the epilogue and one flag per tile;
  - ``copy``: the epilogue stores a peer's tile in a local outbox and counts it per band of tile rows
    (``settings.tuning.gemm_rs_bands`` bands per segment, default 4); a copy stream waits for each band's
    count, copies the band into the owner's slot with the copy engine (no SMs) and raises the owner's flag
    of that band.  It wins where the output per rank is largest (docs/design_gemm_rs.md);
  - ``split`` (N a multiple of 8): one stock CUTLASS GEMM per row segment instead of one kernel
    with our own epilogue, in a ring.  Step s computes segment (r + 1 + s) % world: the first (the peer GEMM)
    from scratch (+ bias) into the outbox, counting each tile per band once its TMA stores landed; the middle
    ones (relays, more than two ranks) add, waiting per band for its flag, the partial sum rank r + 1 sent for
    the same segment; each of these goes to rank r - 1 band by band on the copy stream, as in ``copy``.  The
    last step computes this rank's rows and adds rank r + 1's partial sum of them as its source C.  Its GEMM is
    AG+GEMM's, which runs at cuBLAS's speed (csrc/include/fluxinductor/gemm_rs/split.cuh).  Where a call does
    not qualify, ``copy`` runs instead (logged under FLUXINDUCTOR_LOG=1).

Per call a one-block handshake kernel exchanges (epoch, problem signature) with every peer: it makes buffer
reuse race-free (a peer is in call e only once it finished call e-1, which read its slots) and catches ranks
that disagree on the shape.  Every wait has a timeout (``FLUXINDUCTOR_TIMEOUT_S``, default 10 s); a timeout or
a disagreement writes a code into a host-mapped error word and the call is aborted on the device (no hang);
the next call on the group raises, and so does :func:`check_error`.

Buffers come from ``torch.distributed._symmetric_memory``, one per (group, device), grown to the next power of
two bytes.  Shapes are checked to agree across ranks (through the c10d store, with a timeout) the first time a
rank sees them, so a growth (a collective) never leaves one rank waiting alone.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fluxinductor import log, settings
from fluxinductor.kernels import symm as _symm
# The pieces of the kernel, its transports and its workspace, re-exported: this module is the GEMM+RS interface.
from fluxinductor.kernels.gemm_rs_copy import CopyEngineWorkspace, bands  # noqa: F401
from fluxinductor.kernels.gemm_rs_group import _GroupState, _generations, _state, _states, check_error, reset  # noqa: F401
from fluxinductor.kernels.gemm_rs_kernel import (  # noqa: F401
    _DTYPES, _ELEMENT_SIZES, _ERRORS, _MIN_BUFFER_BYTES, CAPTURE_EPOCH, HEADER_BYTES, MAX_WORLD, REDUCE_OPS,
    _extension, _layout, _tile_shape, _tile_shapes, _weight_layout, buffer_layout, error_message, signature)
from fluxinductor.kernels.symm import ErrorWord, timeout_ns  # noqa: F401 - gemm_rs.ErrorWord for the GPU tests
from fluxinductor.kernels.gemm_rs_split import (  # noqa: F401
    _TAIL_SPLIT_CONFIGS, SPLIT_CONFIGS, resolve_split_config, slabs_reason, split_configs, split_reason,
    tail_split_parts)
from fluxinductor.kernels.tail_split import OFF as tail_split_off
from fluxinductor.kernels.tail_split import kernel_args as tail_split_args

PUSH_MODES = settings.GEMM_RS_PUSH_MODES


def push_mode(default: str = "store") -> str:
    """"store", "copy" or "split": how this call's peer tiles travel (module docstring).
    ``settings.tuning.gemm_rs_push``, when set, decides for every call; else ``default`` (the dispatcher passes the
    cost model's choice)."""
    return settings.tuning.gemm_rs_push or default



# ---------------------------------------------------------------------------------------------------
# Launch (raw pointers: also what the single-GPU N-rank tests drive).
# ---------------------------------------------------------------------------------------------------


def launch(
    a: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    out: Tensor,
    *,
    m: int,
    world: int,
    rank: int,
    buffers: Sequence[int],
    epoch: int,
    sig: int,
    error_address: int,
    out_scale: float = 1.0,
    timeout: Optional[int] = None,
    sm_count: int = 0,
    stream: Optional[torch.cuda.Stream] = None,
    copy: Optional[CopyEngineWorkspace] = None,
    split: bool = False,
    split_source: Optional[Tensor] = None,
    split_counters: Optional[Tensor] = None,
    tail_split: Optional[int] = None,
    split_config: Optional[int] = None,
    capture: bool = False,
    batch_rows: int = 0,
    more: Sequence[Tuple[Tensor, Tensor]] = (),
) -> None:
    """Enqueue one rank's kernel.  a: [m, K] row-major, weight: [K, N], out: [m/world, N] row-major.

    ``buffers`` are every rank's buffer base addresses as mapped on this device (``buffer_layout`` bytes).
    ``copy``: move the peer tiles with the copy engine, with these resources (None: NVLink stores).
    ``split``: the split transport (needs ``copy``; :func:`split_reason` must have returned None).  With world 1
    (``gemm_only``) its two GEMMs run with communication off, the second reading ``split_source`` (zeros, at least
    [m - m/2, N]) as its source C, the first counting its tiles per band in ``split_counters`` (int32, at least
    ``GEMM_RS_MAX_BANDS``) where given, as the peer GEMM does.  ``tail_split``: the split transport's most parts per
    tail tile (default :func:`tail_split_parts`; 1 = off; the ping-pong configuration has none).  ``split_config``:
    the split GEMMs' configuration chosen for the call (:func:`resolve_split_config` applies the override and the
    dtype).
    ``capture``: a call that CUDA graph replays repeat (the stores or the split transport, no tail split, ``epoch``
    :data:`CAPTURE_EPOCH`): the handshake sets its words back to 0, flags must equal the epoch and failed waits trap;
    the caller zeroes this rank's flags after it.
    ``batch_rows`` > 0: ``a`` is batch-major ([B, S, K] flattened, scattered on S; :func:`batch_major_reason`), and
    ``out`` this rank's [B, S/world, N].  ``more``: further terms (a_i [m, K_i] row-major, w_i [K_i, N]) of a sum
    ``a @ weight + sum(a_i @ w_i)`` the split GEMMs run as K slabs (``split``; :func:`slabs_reason`; with ``batch_rows``
    every a_i is batch-major as ``a`` is).
    """
    b_k_major, ldb = _weight_layout(weight)
    more_slabs = []
    for a_i, w_i in more:
        more_slabs += [a_i.data_ptr(), a_i.stride(0), w_i.data_ptr(), _weight_layout(w_i)[1], a_i.shape[1]]
    k = _total_k(a, more)
    n = weight.shape[1]
    flags_offset, data_offset, _ = buffer_layout(m, n, world, a.dtype)
    stream = stream if stream is not None else torch.cuda.current_stream(a.device)
    if world > 1 and copy is not None:
        transfer = (copy.outbox_address(m * n * a.element_size()), copy.counters.data_ptr(), bands(),
                    copy.stream.cuda_stream)
    elif world == 1 and split:
        transfer = (split_source.data_ptr(), 0 if split_counters is None else split_counters.data_ptr(), bands(), 0)
    else:
        transfer = (0, 0, 0, 0)
        split = False
    bias_scaled = bias
    if split and bias is not None and out_scale != 1.0:
        bias_scaled = (bias.float() * out_scale).to(bias.dtype)  # the second GEMM adds the bias unscaled
        bias_scaled.record_stream(stream)
    config = resolve_split_config(a.dtype, split_config) if split else 0
    # Only the cooperative configuration has a tail split; the ping-pong one keeps its programmatic launches, which a
    # tail split's shared scratch would turn off.
    # (Not under CUDA graph capture either: the scratch is per stream and its flags take new epochs per launch.)
    tails = tail_split_args(a.device, stream, sm_count, tail_split_parts() if tail_split is None else tail_split,
                            launches=max(world, 2)) \
        if split and config in _TAIL_SPLIT_CONFIGS and not _symm.capturing() else tail_split_off
    tuning = settings.tuning
    _extension().gemm_rs_run(  # positional: pybind11 keyword parsing costs microseconds per call
        _DTYPES[a.dtype], m, n, k, world, rank,
        a.data_ptr(), a.stride(0), weight.data_ptr(), ldb, b_k_major,
        0 if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), out_scale,
        list(buffers) if world > 1 else [], flags_offset, data_offset, epoch, sig, error_address,
        timeout_ns() if timeout is None else timeout, sm_count, stream.cuda_stream,
        *transfer, split, 0 if bias_scaled is None else bias_scaled.data_ptr(), True, *tails,  # True: split_pdl
        config, out.dtype != a.dtype, capture, tuning.gemm_rs_config,
        0 if tuning.gemm_rs_swizzle is None else tuning.gemm_rs_swizzle,
        -1 if tuning.gemm_rs_raster is None else tuning.gemm_rs_raster, batch_rows, a.shape[1], more_slabs,
    )


# ---------------------------------------------------------------------------------------------------
# The interface dispatch.py calls.
# ---------------------------------------------------------------------------------------------------

_capability_ok: Dict[int, bool] = {}
_world_sizes: Dict[str, int] = {}


def unsupported_reason(
    a2d: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, group_name: Optional[str],
    out_dtype: Optional[torch.dtype] = None,
) -> Optional[str]:
    """None when the fused kernel can run this call, else why not (cheap, never collective).  ``out_dtype``: the
    result's dtype when it is not the operands' (float32: see :func:`matmul_reduce_scatter`)."""
    try:
        _extension()
    except RuntimeError as e:
        return str(e)
    if not (a2d.is_cuda and weight.is_cuda):
        return "tensors are not on a CUDA device"
    if a2d.device != weight.device or (bias is not None and bias.device != a2d.device):
        return "tensors are on different devices"
    index = a2d.device.index
    if index not in _capability_ok:
        _capability_ok[index] = torch.cuda.get_device_capability(a2d.device) == (9, 0)
    if not _capability_ok[index]:
        return "the GEMM+RS kernel is built for sm90a (Hopper) only"
    if a2d.dtype not in _DTYPES or weight.dtype != a2d.dtype:
        return f"dtypes {a2d.dtype}/{weight.dtype}: the kernel takes bf16 or fp16, both operands the same"
    if out_dtype not in (None, a2d.dtype, torch.float32):
        return f"a {out_dtype} result of {a2d.dtype} operands (the kernel writes the operands' dtype or fp32)"
    if a2d.dim() != 2 or weight.dim() != 2 or a2d.shape[1] != weight.shape[0]:
        return f"shapes {tuple(a2d.shape)} @ {tuple(weight.shape)} are not a 2-D matmul"
    if reduce_op not in REDUCE_OPS:
        return f"reduce_op {reduce_op!r} is not one of {REDUCE_OPS}"
    m, k = a2d.shape
    n = weight.shape[1]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        return f"bias of shape {tuple(bias.shape)} is not [N={n}]"
    world = 1
    if group_name is not None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        world = _world_sizes.get(group_name)
        if world is None:
            try:
                world = dist.get_world_size(_resolve_process_group(group_name))
            except Exception as e:  # noqa: BLE001
                return f"group {group_name!r} does not resolve ({e})"
            _world_sizes[group_name] = world
        if world > MAX_WORLD:
            return f"world size {world} > {MAX_WORLD}"
    if m == 0 or n == 0 or k == 0:
        return "empty matmul"
    if m % world:
        return f"M={m} rows do not split over {world} ranks"
    if max(m, n, k) >= 2**31:
        return "a dimension does not fit in int32"
    if k % 8:
        return f"K={k} is not a multiple of 8 (TMA needs 16-byte rows of A)"
    layout = _weight_layout(weight)
    if layout is None:
        return f"weight strides {weight.stride()}: neither K nor N is contiguous"
    if layout[1] % 8:
        return f"weight leading stride {layout[1]} is not a multiple of 8 elements (16-byte TMA alignment)"
    if weight.data_ptr() % 16:
        return "weight is not 16-byte aligned"
    if group_name is not None and world > 1 and _symm.capturing():
        return capture_reason(a2d, weight, group_name)
    return None


def capture_reason(a2d: Tensor, weight: Tensor, group_name: str) -> Optional[str]:
    """Why a call under CUDA graph capture cannot run the fused kernel (None: it can, with the stores transport and
    the constant :data:`CAPTURE_EPOCH`; see :func:`matmul_reduce_scatter`).  A capture may not grow the symmetric
    buffer (a collective step), so an eager call of this shape, with any transport, must have grown it first; every
    rank sees the same calls, so every rank gives the same answer.  (The shape's agreement through the c10d store is
    not needed: the handshake checks the signature on the device every call, and traps on a mismatch when captured.)"""
    if not settings.kernels_under_capture():
        return "CUDA graph capture (the per-compile option cuda_graphs=True captures the fused kernels)"
    state = _states.get((group_name, a2d.device.index))
    m, n = a2d.shape[0], weight.shape[1]
    if state is None or buffer_layout(m, n, state.world, a2d.dtype)[2] > state.capacity:
        return "CUDA graph capture before an eager call of this shape set up the group's buffer"
    return None


def _prepare(a2d: Tensor, bias: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    if a2d.stride(1) != 1 or a2d.stride(0) % 8 or a2d.data_ptr() % 16:
        a2d = a2d.contiguous()
    if bias is not None:
        bias = bias.to(a2d.dtype).contiguous()
    return a2d, bias


def _prepare_more(more: Sequence[Tuple[Tensor, Tensor]]) -> List[Tuple[Tensor, Tensor]]:
    return [(_prepare(a_i, None)[0], w_i) for a_i, w_i in more]


def _total_k(a2d: Tensor, more: Sequence[Tuple[Tensor, Tensor]]) -> int:
    """The K of a call's GEMM: ``a2d``'s and every further term's (K slabs)."""
    return a2d.shape[1] + sum(a_i.shape[1] for a_i, _ in more)


def batch_major_reason(a2d: Tensor, batch_rows: int, world: int) -> Optional[str]:
    """Why an eager call cannot read a batch-major operand in place (None: it can): ``a2d`` is a [B, S, ..., K]
    operand flattened, scattered on S, each owner's rows B blocks of ``batch_rows`` rows (S/world times the dims
    between S and K), read block by block (csrc/include/fluxinductor/common/blocked_rows.cuh), so the result is this
    rank's [B, S/world, ...] with no permute.  That needs two or more ranks outside CUDA graph capture, and blocks of
    whole 128-row tiles (every transport's tile M divides 128)."""
    rows = a2d.shape[0]
    if world < 2 or _symm.capturing():
        return "one rank, or CUDA graph capture (whose stores transport runs rank-major)"
    if batch_rows <= 0 or (rows // world) % batch_rows or rows % world:
        return f"{rows} rows are not {world} owners' whole blocks of {batch_rows}"
    if batch_rows % 128:
        return f"blocks of {batch_rows} rows are not whole 128-row tiles"
    return None


def matmul_reduce_scatter(
    a2d: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, group_name: str, *,
    out: Optional[Tensor] = None, checked: bool = False, transport: str = "store", split_config_choice: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None, batch_rows: int = 0, more: Sequence[Tuple[Tensor, Tensor]] = (),
) -> Tensor:
    """reduce_scatter(a2d @ weight + bias) over ``group_name`` along rows, fused.

    a2d: [M, K/world] (this rank's partial operand), weight: [K/world, N], bias: [N] or None (added on every
    rank before the reduction).  Returns [M/world, N]: rows [rank*M/world, (rank+1)*M/world) of the sum over
    ranks (divided by world for "avg").  ``out`` (tests): a [M/world, N] row-major tensor to write into.
    Raises RuntimeError when an earlier fused call on the group failed (see module docstring).
    ``checked``: the caller has just had ``unsupported_reason`` return None for these arguments (the
    dispatcher does), so it is not asked again.  ``transport``: "store", "copy" or "split", used unless
    ``settings.tuning.gemm_rs_push`` is set (every rank must pass the same; the handshake checks it).  A call that the
    split transport cannot take runs with "copy" (logged).  ``split_config_choice``: the split GEMMs' configuration
    the cost model picked for the shape (see :func:`resolve_split_config`).  ``out_dtype`` (or ``out``'s dtype):
    torch.float32 reduces as autocast's ``reduce_scatter(mm(a, w).float())`` does: each rank's partial is rounded to
    the operands' dtype, bf16 or fp16 (and crosses in it, half the bytes of the fp32 reduce-scatter), the sum is fp32.
    The split transport writes it at two ranks from bf16 operands and an N-major weight (its own partial added
    unrounded, :func:`float_result_reason`); elsewhere such calls take "copy".  ``batch_rows`` > 0: a batch-major
    operand (:func:`batch_major_reason` must have returned None), every further term's alike.  ``more``: further
    terms (a_i [M, K_i/world], w_i [K_i/world, N]) of the reduce-scattered sum ``a2d @ weight + sum(a_i @ w_i) +
    bias``, run by the split transport as K slabs of its GEMMs, whatever ``transport`` says (:func:`slabs_reason`
    must have returned None; with ``checked``, the caller asked, as the dispatcher does).
    """
    if out is not None:
        out_dtype = out.dtype
    reason = None if checked else (unsupported_reason(a2d, weight, bias, reduce_op, group_name, out_dtype)
                                   or slabs_reason(a2d, weight, more))
    if reason is not None:
        raise ValueError(f"fused matmul_reduce_scatter cannot run: {reason}")
    state = _state(group_name, a2d.device)
    batch_reason = batch_major_reason(a2d, batch_rows, state.world) if batch_rows else None
    if batch_reason is not None:
        raise ValueError(f"fused matmul_reduce_scatter cannot read the batch-major operand: {batch_reason}")
    if state.world > 1 and not _symm.capturing():  # (the call raises an earlier call's error first)
        return _EagerCall(state, a2d, weight, bias, reduce_op, transport, split_config_choice, out_dtype,
                          out, batch_rows, more)(a2d, weight, bias, out, more)
    state.raise_if_error()
    # One rank (the stores transport), or under capture, where unsupported_reason (ours, or the caller's: checked)
    # found the call capturable: the stores transport, or the split one where asked for and set up.
    a2d, bias = _prepare(a2d, bias)
    more = _prepare_more(more)
    m = a2d.shape[0]
    n = weight.shape[1]
    world = state.world
    if out is None:
        out = torch.empty((m // world, n), dtype=out_dtype or a2d.dtype, device=a2d.device)
    capturing = world > 1  # here: 2 or more ranks only under capture
    if more and not capturing:
        raise ValueError("fused matmul_reduce_scatter runs K slabs on 2 or more ranks only")
    split = False
    if capturing and (more or push_mode(transport) == "split"):
        why = captured_split_reason(state, a2d, weight, bias, out, more)
        split = why is None
        if more and not split:
            raise ValueError(f"fused matmul_reduce_scatter cannot run K slabs under CUDA graph capture: {why}")
        if not split:
            log.note_once(f"matmul_reduce_scatter runs the stores transport under CUDA graph capture: {why}")
    config = resolve_split_config(a2d.dtype, split_config_choice) if split else 0
    sig = signature(m, n, _total_k(a2d, more), world, a2d.dtype,
                    _transport_signature("split" if split else "store", config, a2d.dtype, out.dtype, 0, more))
    flags_offset, data_offset, nbytes = buffer_layout(m, n, world, a2d.dtype)
    launch(a2d, weight, bias, out, m=m, world=world, rank=state.rank, buffers=state.buffer_ptrs,
           epoch=CAPTURE_EPOCH if capturing else 0, sig=sig, error_address=state.error.device,
           out_scale=(1.0 / world) if reduce_op == "avg" else 1.0, capture=capturing,
           copy=state.copy_workspace() if split else None, split=split, split_config=config, more=more)
    if capturing:
        # Every peer's flags of this call were read by the own tiles (or the own GEMM); clear them for the next replay
        # (a peer sets them again only after the next call's handshake, which this rank enters after this).
        state.buffer[flags_offset:data_offset].zero_()
    return out


def captured_slabs_reason(a2d: Tensor, weight: Tensor, bias: Optional[Tensor], group_name: str,
                          more: Sequence[Tuple[Tensor, Tensor]]) -> Optional[str]:
    """Why a sum of matmuls under CUDA graph capture cannot run as the split transport's K slabs (None: it can; see
    :func:`captured_split_reason`)."""
    state = _states.get((group_name, a2d.device.index))
    if state is None:
        return "CUDA graph capture before an eager call set up the group"
    return captured_split_reason(state, a2d, weight, bias, None, more)


def captured_split_reason(state: _GroupState, a2d: Tensor, weight: Tensor, bias: Optional[Tensor],
                          out: Optional[Tensor], more: Sequence[Tuple[Tensor, Tensor]] = ()) -> Optional[str]:
    """Why a call under CUDA graph capture cannot run the split transport (None: it can, without a tail split).  A
    capture may not grow the outbox (an allocation that outlives the graph), so an eager split call of at least this
    size must have grown it first."""
    why = split_reason(state.world, weight, bias, out) or slabs_reason(a2d, weight, more)
    if why is not None:
        return why
    copy = state.copy
    if copy is None or copy.outbox is None or copy.outbox.numel() < a2d.shape[0] * weight.shape[1] * a2d.element_size():
        return "no eager split call of this size set up the outbox"
    return None


def prepare_matmul_reduce_scatter(a2d: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str,
                                  group_name: str, *, transport: str = "store",
                                  split_config_choice: Optional[int] = None,
                                  out_dtype: Optional[torch.dtype] = None, batch_rows: int = 0,
                                  more: Sequence[Tuple[Tensor, Tensor]] = ()):
    """For a call that :func:`unsupported_reason` accepts, outside CUDA graph capture, on 2 or more ranks: a function
    ``run(a2d, weight, bias, out=None, more=())`` that runs it as :func:`matmul_reduce_scatter` does (``more``: its
    further terms, as there), and any later call of its signature
    (operands of the same shapes, strides, dtypes and 16-byte alignment; the dispatcher's replays) with the per-call
    work only.  None otherwise: the caller runs :func:`matmul_reduce_scatter`."""
    if _symm.capturing():
        return None
    state = _state(group_name, a2d.device)
    if state.world < 2 or (batch_rows and batch_major_reason(a2d, batch_rows, state.world) is not None):
        return None
    return _EagerCall(state, a2d, weight, bias, reduce_op, transport, split_config_choice, out_dtype,
                      batch_rows=batch_rows, more=_prepare_more(more))


class _EagerCall:
    """An eager call's signature on 2 or more ranks, worked out once: its transport (module docstring), the split
    configuration, the handshake's signature, the buffer it needs.  Calling it runs one call of the signature: the
    group's error and agreement are checked (the group's state is looked up per call: :func:`reset` replaces it), the
    buffer grown if another signature has not, then the launch."""

    def __init__(self, state: _GroupState, a2d: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str,
                 transport: str, split_config_choice: Optional[int], out_dtype: Optional[torch.dtype],
                 out: Optional[Tensor] = None, batch_rows: int = 0, more: Sequence[Tuple[Tensor, Tensor]] = ()):
        if bias is not None:
            bias = bias.to(a2d.dtype).contiguous()  # as _prepare gives it to the launch
        self.group_name, self.device = state.group_name, a2d.device
        self.m = a2d.shape[0]
        n = weight.shape[1]
        world = state.world
        self.out_dtype = out_dtype or a2d.dtype
        self.out_shape = (self.m // world, n)
        self.out_scale = (1.0 / world) if reduce_op == "avg" else 1.0
        mode = "split" if more else push_mode(transport)
        if mode == "split":
            reason = split_reason(world, weight, bias, out, self.out_dtype)
            if reason is not None and more:
                raise ValueError(f"fused matmul_reduce_scatter cannot run K slabs: {reason}")
            if reason is not None:
                log.note_once(f"matmul_reduce_scatter runs the copy transport instead of split: {reason}")
                mode = "copy"
        self.mode = mode
        self.config = resolve_split_config(a2d.dtype, split_config_choice) if mode == "split" else 0
        self.batch_rows = batch_rows
        self.sig = signature(self.m, n, _total_k(a2d, more), world, a2d.dtype,
                             _transport_signature(mode, self.config, a2d.dtype, self.out_dtype, batch_rows, more))
        self.nbytes = buffer_layout(self.m, n, world, a2d.dtype)[2]

    def __call__(self, a2d: Tensor, weight: Tensor, bias: Optional[Tensor], out: Optional[Tensor] = None,
                 more: Sequence[Tuple[Tensor, Tensor]] = ()) -> Tensor:
        state = _state(self.group_name, self.device)
        state.raise_if_error()
        a2d, bias = _prepare(a2d, bias)
        if more:
            more = _prepare_more(more)
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        state.agree(self.sig)
        state.reserve(self.nbytes)
        launch(a2d, weight, bias, out, m=self.m, world=state.world, rank=state.rank, buffers=state.buffer_ptrs,
               epoch=state.next_epoch(), sig=self.sig, error_address=state.error.device, out_scale=self.out_scale,
               copy=state.copy_workspace() if self.mode != "store" else None, split=self.mode == "split",
               split_config=self.config, batch_rows=self.batch_rows, more=more)
        return out


def _transport_signature(mode: str, config: int, dtype: torch.dtype, out_dtype: torch.dtype, batch_rows: int,
                         more: Sequence[Tuple[Tensor, Tensor]]) -> str:
    """What the handshake's signature says of a call's transport, beyond its shape: every rank must run the same."""
    sig = f"{mode}{config or ''}/{bands()}" if mode != "store" else "store"
    if out_dtype != dtype:
        sig += f"/{out_dtype}"
    if batch_rows:  # the rows each rank reads for an owner
        sig += f"/batch{batch_rows}"
    if more:  # where the slabs meet
        sig += "/slabs" + ",".join(str(a_i.shape[1]) for a_i, _ in more)
    return sig


_gemm_only_errors: Dict[int, ErrorWord] = {}


_split_zeros: Dict[Tuple[int, torch.dtype, int], Tensor] = {}
_count_scratch: Dict[int, Tensor] = {}  # gemm_only(count_bands=True): counts nothing reads


def gemm_only(a2d: Tensor, weight: Tensor, bias: Optional[Tensor], *, out: Optional[Tensor] = None,
              split: bool = False, tail_split: Optional[int] = None, sm_count: int = 0,
              split_config_choice: Optional[int] = None, out_dtype: Optional[torch.dtype] = None,
              more: Sequence[Tuple[Tensor, Tensor]] = (), count_bands: bool = False) -> Tensor:
    """a2d @ weight + bias with the same kernel and communication off (benchmarks).  Returns [M, N].

    ``split``: the split transport's two GEMMs instead (rows [0, M/2), then rows [M/2, M) reading an [M/2, N] zero
    buffer as their source, as the transport's second GEMM reads the peer's partial); ``tail_split`` and
    ``sm_count`` (CTAs of the persistent grid, 0: every SM) as for :func:`launch`; ``split_config_choice`` as for
    :func:`matmul_reduce_scatter`; ``more``: further terms (a_i [M, K_i], w_i [K_i, N]) of the sum, as K slabs of the
    split GEMMs (``split``); ``count_bands``: the first GEMM also counts its stored tiles per band as the peer GEMM
    does for the copy stream (``split``; nothing waits for the counts).  A kernel error (a tail split's timed-out
    wait) is reported by :func:`check_gemm_only`."""
    if out is not None:
        out_dtype = out.dtype
    reason = unsupported_reason(a2d, weight, bias, "sum", None, out_dtype)
    if reason is None and more and not split:
        reason = "K slabs run on the split transport's GEMMs (split=True)"
    if reason is None and split:
        reason = split_reason(2, weight, bias, out) or slabs_reason(a2d, weight, more) or (
            f"the split transport's GEMMs with communication off write {a2d.dtype}, not {out_dtype}"
            if out_dtype not in (None, a2d.dtype) else None)
        if reason is None and a2d.shape[0] < 2:
            reason = "the split transport's GEMMs need M >= 2"
    if reason is not None:
        raise ValueError(f"gemm_only cannot run: {reason}")
    a2d, bias = _prepare(a2d, bias)
    m = a2d.shape[0]
    n = weight.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype or a2d.dtype, device=a2d.device)
    zeros = None
    if split:
        key = (a2d.device.index, a2d.dtype, n)
        zeros = _split_zeros.get(key)
        if zeros is None or zeros.shape[0] < m - m // 2:
            zeros = _split_zeros[key] = _symm.persistent(
                lambda: torch.zeros((m - m // 2, n), dtype=a2d.dtype, device=a2d.device), a2d.device)
    counters = None
    if split and count_bands:
        counters = _count_scratch.get(a2d.device.index)
        if counters is None:
            counters = _count_scratch[a2d.device.index] = _symm.persistent(
                lambda: torch.zeros(_extension().GEMM_RS_MAX_BANDS, dtype=torch.int32, device=a2d.device), a2d.device)
    launch(a2d, weight, bias, out, m=m, world=1, rank=0, buffers=[], epoch=0, sig=0,
           error_address=_gemm_only_error(a2d.device).device, sm_count=sm_count, split=split, split_source=zeros,
           split_counters=counters,
           tail_split=tail_split, split_config=split_config_choice, more=_prepare_more(more))
    return out


def _gemm_only_error(device: torch.device) -> ErrorWord:
    word = _gemm_only_errors.get(device.index)
    if word is None:
        word = _gemm_only_errors[device.index] = ErrorWord()
    return word


def check_gemm_only(device: Optional[torch.device] = None) -> None:
    """Synchronize ``device`` (default: the current one); raise RuntimeError, and clear the error, if a
    :func:`gemm_only` launch there reported one."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    torch.cuda.synchronize(device)
    word = _gemm_only_error(device)
    code = word.read()
    if code:
        word.clear()
        raise RuntimeError(error_message(code).replace("matmul_reduce_scatter", "gemm_only"))
