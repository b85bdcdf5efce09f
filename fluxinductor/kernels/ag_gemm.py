"""All-gather + GEMM on Hopper: copy-engine transfers overlapped with one persistent CUTLASS GEMM.

Per call, on rank r of W (shard: [S, K], M = W * S), with buffer = this call's symmetric buffer [M, K], when S is
a multiple of the kernel's tile M (the push, the default):

1. main stream: the call's arrival (``SymmetricWorkspace.arrive``, csrc/ag_gemm/arrival.cu), one warp: write the call's
   epoch into this rank's arrival word on every peer, check that every peer has reached the previous call (so its
   GEMM of two calls ago, the last reader of the buffer parity we are about to write into, is done), then release
   the side stream.  In a healthy run that check finds the word already set: this rank's previous GEMM waited for
   chunks the peers pushed after their previous arrival.
2. side stream (copy engine, no SMs), once the arrival has passed: for q = r-1, r-2, ... (mod W, the order in which
   the peers' tile walks reach rank r's rows), push the shard straight from the caller's tensor into rows [r*S, (r+1)*S) of peer q's
   buffer, chunk by chunk; after each chunk, copy the call's epoch into that chunk's flag on peer q.
3. main stream: the fused GEMM (csrc/ag_gemm/ag_gemm.cu) of the widest weight, launched as a programmatic dependent
   of the arrival so that it starts at once (it reads nothing the arrival writes), reading this rank's rows from the
   shard itself (a second TMA descriptor, so the shard is never copied into the buffer first) and the peers' rows from
   ``buffer``; its tile scheduler walks this rank's rows first, then q = r+1, ... and waits per tile for the chunk
   flags its rows need.  It also writes the A tiles it loads into the gathered A (if asked; else this rank's rows
   into ``buffer``'s own rows where other weights need them), from shared memory.  Then every other weight's GEMM
   runs on cuBLAS over the complete A (it could only start once every row had arrived anyway).  Where the kernel
   variant cannot write A (its cluster multicasts A) the side stream copies the shard there after its pushes and
   the main stream the peers' rows out of ``buffer`` after the GEMM, each a same-device copy that runs on SMs.
4. main stream waits for the side stream.

Otherwise (the pull): main copies the shard into ``buffer[r*S:(r+1)*S]`` before the arrival, which then waits for
every peer to reach this call (every slot written), the side stream
pulls each peer's rows out of that peer's buffer into ours and raises our own flags, the GEMM reads every row
from ``buffer``, and the side stream copies the gathered buffer out.  The pull puts the shard copy (an SM
kernel: a same-device copy) in front of the GEMM on the main stream, 5 us at 8 MB and 0.15 ms at 235 MB on an
H200, which is most of what the fused op costs over its GEMM (docs/design_ag_gemm.md).

A wait that times out writes an error code to a host-mapped word and the kernel goes on; the next call (or
``check_errors``) raises.  An arrival that times out traps (a peer more than FLUXINDUCTOR_TIMEOUT_S behind: the side
stream may neither write into that peer nor wait forever), as torch symmetric memory's barrier does.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fluxinductor import settings
from fluxinductor.kernels import loader, symm
# The variants and the shard transfers, re-exported: this module is the AG+GEMM interface.
from fluxinductor.kernels.ag_gemm_transfer import (  # noqa: F401
    _MIN_K_BLOCK_BYTES, _push_flag, assemble_gathered, chunk_bounds, k_chunk_bounds, pull_k_block, pull_row_chunk,
    pull_shards, push_call, push_shards, shard_row_copies, use_k_chunks)
from fluxinductor.kernels.ag_gemm_variants import (  # noqa: F401
    _K_TILE, _TAIL_SPLITTING, _TILES, WIDE_MIN_GAIN, _automatic_variant, _cluster_row_height, _forced_variant,
    _has_variants, _tile_m, _weight_layout, group_cluster_rows, kernel_variant, maps_batch_major, modelled_time)
from fluxinductor.kernels.tail_split import kernel_args as tail_split_args

_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1}
_ERROR_SPLIT_TIMEOUT = 3  # ag_gemm_scheduler.cuh kErrorSplitTimeout
_ERROR_ARRIVAL_TIMEOUT = 4  # ag_gemm.h kErrorArrivalTimeout


class AllGatherGemmError(RuntimeError):
    """A fused all-gather + GEMM failed on the device (a peer never delivered its shard in time)."""


# ---------------------------------------------------------------------------------------------------
# Checks.
# ---------------------------------------------------------------------------------------------------


def _kernel_reason(m: int, k: int, lda: int, a_ptr: int, weight: Tensor, bias: Optional[Tensor], out_ptr: int,
                   ldo: int) -> Optional[str]:
    layout = _weight_layout(weight)
    if layout is None:
        return f"weight strides {tuple(weight.stride())} have no contiguous dim"
    k_contiguous, ldb = layout
    why = loader.extension().ag_gemm_unsupported(
        dtype=_DTYPE_CODES[weight.dtype], a=a_ptr, m=m, k=k, lda=lda, b=weight.data_ptr(), n=weight.shape[1],
        ldb=ldb, b_k_contiguous=k_contiguous, bias=0 if bias is None else bias.data_ptr(), out=out_ptr, ldo=ldo)
    return why or None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _operand_reason(a2d: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]]) -> Optional[str]:
    reason = loader.extension_available()
    if reason is not None:
        return reason
    if not a2d.is_cuda:
        return "tensors are not on a CUDA device"
    capability = _capability(a2d.device.index)
    if capability != (9, 0):
        return f"the kernel is built for sm_90a; device has capability {capability}"
    if a2d.dtype not in _DTYPE_CODES:
        return f"dtype {a2d.dtype} (the kernel supports bfloat16 and float16)"
    if a2d.dim() != 2 or not a2d.is_contiguous():
        return "the activation must be a contiguous 2-D tensor"
    if len(weights) == 0 or len(weights) != len(biases):
        return "need one bias entry (or None) per weight"
    for weight, bias in zip(weights, biases):
        if weight.dtype != a2d.dtype or weight.device != a2d.device:
            return f"weight {weight.dtype} on {weight.device} does not match the activation"
        if weight.dim() != 2 or weight.shape[0] != a2d.shape[1]:
            return f"weight shape {tuple(weight.shape)} does not match K={a2d.shape[1]}"
        if bias is not None and (bias.dtype != a2d.dtype or bias.device != a2d.device or bias.dim() != 1
                                 or bias.shape[0] != weight.shape[1] or not bias.is_contiguous()):
            return f"bias {tuple(bias.shape)} {bias.dtype} is not a contiguous [N] vector of the activation dtype"
    return None


def unsupported_reason(shard2d: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                       group_name: str) -> Optional[str]:
    """None if the fused kernel can run ``all_gather_matmul`` on these arguments, else why not.

    shard2d: [M/world, K]; weights[i]: [K, N_i]; biases[i]: [N_i] or None.  Cheap: no communication.
    """
    reason = _operand_reason(shard2d, weights, biases)
    if reason is not None:
        return reason
    try:
        world = _group_size(group_name)
    except Exception as e:  # noqa: BLE001 - any failure to resolve the group means "not here"
        return f"cannot resolve process group {group_name!r} ({e})"
    reason = _shapes_reason(shard2d, weights, biases, world)
    if reason is not None:
        return reason
    if symm.capturing():
        return capture_reason(shard2d, weights, group_name, world)
    return None


def _shapes_reason(shard2d: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                   world: int) -> Optional[str]:
    """Why the kernels cannot take these operands' shapes gathered from ``world`` ranks (None: they can)."""
    if shard2d.shape[0] == 0:
        return "empty shard"
    m, k = world * shard2d.shape[0], shard2d.shape[1]
    # The gathered buffer and the outputs are fresh allocations (16-byte aligned); check the shapes.
    for weight, bias in zip(weights, biases):
        why = _kernel_reason(m, k, k, 256, weight, bias, 256, weight.shape[1])
        if why is not None:
            return why
    return None


def capture_reason(shard2d: Tensor, weights: Sequence[Tensor], group_name: str, world: int) -> Optional[str]:
    """Why a call under CUDA graph capture cannot run the fused kernels (None: it can, see :func:`captured_push_call`).

    A capture may not take a collective step, so an eager call of the same shape must have set up the group's
    workspace first (CUDA graph trees and ``torch.cuda.graph`` users warm up eagerly before capturing); every rank
    sees the same calls, so every rank gives the same answer."""
    if not settings.kernels_under_capture():
        return "CUDA graph capture (the per-compile option cuda_graphs=True captures the fused kernels)"
    if world == 1:
        return None  # nothing to gather: the call is its GEMMs
    if not use_push(shard2d, weights):
        return "CUDA graph capture of a pull (shard rows not a multiple of the kernel's tile M)"
    ws = symm.existing_workspace(group_name, shard2d.device)
    nbytes = ws.world * shard2d.numel() * shard2d.element_size() if ws is not None else 0
    if ws is None or not ws.ready_for(nbytes, _layout_key(shard2d, True)):
        return "CUDA graph capture before an eager call of this shape set up the group's buffers"
    return None


def check_errors(device: Optional[torch.device] = None, synchronize: bool = False) -> None:
    """Raise AllGatherGemmError if a kernel on ``device`` reported a timed-out wait (then clear it)."""
    index = torch.cuda.current_device() if device is None else torch.device(device).index
    if synchronize:
        torch.cuda.synchronize(index)
    code = symm.read_error(index)
    if code:
        symm.clear_error(index)
        what = {_ERROR_SPLIT_TIMEOUT: "a tail tile's last part waited too long for its other parts",
                _ERROR_ARRIVAL_TIMEOUT: "a peer did not reach the call (the arrival timed out and trapped)",
                }.get(code, "a wait for a peer's shard timed out")
        raise AllGatherGemmError(
            f"all_gather_matmul on cuda:{index}: {what} (error code {code}, timeout {symm.timeout_seconds()} s); "
            "its outputs were wrong")


# ---------------------------------------------------------------------------------------------------
# Low-level pieces (also driven directly by the single-GPU N-rank tests).
# ---------------------------------------------------------------------------------------------------


def launch_gemm(a: Tensor, weight: Tensor, bias: Optional[Tensor], out: Tensor, *, flags: Optional[Tensor] = None,
                epoch: int = 0, rank: int = 0, world: int = 1, shard_rows: int = 0,
                chunks_per_rank: Optional[int] = None, k_chunks: int = 1, sm_count: int = 0,
                group_rows: Optional[int] = None, variant: Optional[int] = None,
                timeout_s: Optional[float] = None, stream: Optional[torch.cuda.Stream] = None,
                tail_split: Optional[int] = None, a_local: Optional[Tensor] = None, pdl: bool = False,
                trap_on_timeout: bool = False, capturing: Optional[bool] = None, batch_rows: int = 0) -> Tensor:
    """out[M, N] = a[M, K] @ weight[K, N] (+ bias) with the fused kernel, on ``stream`` (default: current).

    With ``flags`` ([world * chunks_per_rank] int32 on a's device), each tile first waits until the flags of
    the chunks its rows come from hold ``epoch`` (rows of ``rank`` are taken as present).  With ``k_chunks`` > 1
    (flags [world * k_chunks], see :func:`pull_shards`) it waits instead before each column block of its K loop.
    ``a_local`` ([shard_rows, K], with ``flags``; shard_rows a multiple of the tile's M): this rank's rows are read
    from it instead of from ``a``.  ``pdl``: launch as a programmatic dependent of the kernel before it on ``stream``
    (the call's arrival), which lets it start while that kernel runs; it must read nothing that kernel writes.
    ``trap_on_timeout``: a wait that times out traps after writing its error code (calls in CUDA graphs).  Under
    CUDA graph capture the tail split is off (``capturing``: whether the caller knows it is capturing; None: ask).
    ``batch_rows`` > 0 (with ``flags``): ``a`` and ``out`` are batch-major, each shard ``shard_rows //
    batch_rows`` blocks of ``batch_rows`` rows and block b of rank q at rows (b * world + q) * batch_rows (a [B, S/w,
    ...] shard gathered on S); ``a_local`` is the shard as it is.
    ``chunks_per_rank``/``group_rows``/``variant``/``tail_split`` default to ``settings.tuning`` (ag_chunks,
    ag_group_rows, kernel_variant, ag_tail_split: the most parts a tile of a partial last wave is split into along K;
    1 = off).
    """
    stream = torch.cuda.current_stream(a.device) if stream is None else stream
    args = gemm_args(a, weight, bias, out, flags=flags, epoch=epoch, rank=rank, world=world, shard_rows=shard_rows,
                     chunks_per_rank=chunks_per_rank, k_chunks=k_chunks, sm_count=sm_count, group_rows=group_rows,
                     variant=variant, timeout_s=timeout_s, stream=stream, tail_split=tail_split, a_local=a_local,
                     pdl=pdl, trap_on_timeout=trap_on_timeout, capturing=capturing, batch_rows=batch_rows)
    loader.extension().ag_gemm_run(*args, stream.cuda_stream)
    return out


def gemm_args(a: Tensor, weight: Tensor, bias: Optional[Tensor], out: Tensor, *, stream: torch.cuda.Stream,
              flags: Optional[Tensor] = None, epoch: int = 0, rank: int = 0, world: int = 1, shard_rows: int = 0,
              chunks_per_rank: Optional[int] = None, k_chunks: int = 1, sm_count: int = 0,
              group_rows: Optional[int] = None, variant: Optional[int] = None, timeout_s: Optional[float] = None,
              tail_split: Optional[int] = None, a_local: Optional[Tensor] = None, pdl: bool = False,
              trap_on_timeout: bool = False, capturing: Optional[bool] = None, batch_rows: int = 0) -> tuple:
    """The arguments of :func:`launch_gemm`'s launch on ``stream`` as ag_gemm_run takes them, but the stream: the
    binding's order (csrc/bindings.cpp), passed positionally, as keyword parsing of its 35 arguments costs pybind11
    several microseconds per launch.  The tail split's epochs are taken from ``stream``'s scratch here, so the
    launch must follow on that stream (ag_push_call takes a list of these)."""
    tuning = settings.tuning
    chunks_per_rank = tuning.ag_chunks if chunks_per_rank is None else chunks_per_rank
    tail_split = tuning.ag_tail_split if tail_split is None else tail_split
    if tail_split > 1 and (symm.capturing() if capturing is None else capturing):
        tail_split = 1  # its scratch is per stream and its flags take a new epoch per launch: not for a graph
    key = (a.device.index, a.dtype, weight.shape, weight.stride(), a.shape[0],
           shard_rows if flags is not None else None, sm_count, variant, group_rows, tuning, batch_rows)
    choices = _launch_choices.get(key)
    if choices is None:
        if len(_launch_choices) >= 4096:
            _launch_choices.clear()
        choices = _launch_choices[key] = _choose_launch(a, weight, key[5], sm_count, variant, group_rows, batch_rows)
    k_contiguous, ldb, variant, group_rows = choices
    _, error_device = symm.error_word(a.device.index)
    timeout_s = symm.timeout_seconds() if timeout_s is None else timeout_s
    return (
        _DTYPE_CODES[a.dtype], a.data_ptr(), a.shape[0], a.shape[1], a.stride(0),  # dtype, a, m, k, lda
        weight.data_ptr(), weight.shape[1], ldb, k_contiguous,  # b, n, ldb, b_k_contiguous
        0 if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),  # bias, out, ldo
        0 if flags is None else flags.data_ptr(), epoch, rank, world, shard_rows,  # flags, epoch, rank, world, ...
        chunks_per_rank, k_chunks, group_rows, sm_count, int(timeout_s * 1e9), error_device, variant,
        *tail_split_args(a.device, stream, sm_count, tail_split),  # split partials, flags, epoch, max parts, waves
        0 if a_local is None else a_local.data_ptr(), 0 if a_local is None else a_local.stride(0),  # a_local, lda
        pdl, trap_on_timeout, batch_rows if flags is not None else 0)


# Positions in gemm_args' tuple of the fields that change between calls of one signature (_PushCall fills them in).
_ARG_A, _ARG_B, _ARG_BIAS, _ARG_OUT, _ARG_FLAGS, _ARG_EPOCH, _ARG_A_LOCAL = 1, 5, 9, 10, 12, 13, 29
_ARG_TAIL_SPLIT = slice(24, 29)

# (k_contiguous, ldb, variant, group_rows) per launch shape and the tuning it reads (settings.tuning, hashed once per
# value): the variant choice's wave model and the weight's layout cost ~10 us of host time per launch.
_launch_choices: Dict[tuple, Tuple[bool, int, int, int]] = {}


def _choose_launch(a: Tensor, weight: Tensor, shard_rows: Optional[int], sm_count: int, variant: Optional[int],
                   group_rows: Optional[int], batch_rows: int = 0) -> Tuple[bool, int, int, int]:
    layout = _weight_layout(weight)
    if layout is None:
        raise ValueError(f"weight strides {tuple(weight.stride())} have no contiguous dim")
    if variant is None:
        with torch.cuda.device(a.device):  # a batch-major A keeps whole tiles per block, not only per shard
            variant = kernel_variant(a.dtype, weight, a.shape[0], batch_rows or shard_rows, sm_count or None)
        if batch_rows and not maps_batch_major(variant):
            variant = 0
    if group_rows is None:
        group_rows = (group_cluster_rows(shard_rows, variant) if shard_rows is not None
                      else settings.tuning.ag_group_rows)
    return layout[0], layout[1], variant, group_rows


def batch_major_reason(shard2d: Tensor, weights: Sequence[Tensor], batch_rows: int) -> Optional[str]:
    """Why a pushing call cannot keep a batch-major layout (None: it can): ``shard2d`` is a [B, S/w, ...] shard
    flattened to [B * batch_rows, K] and gathered on S, so its blocks of ``batch_rows`` rows land batch-major in the
    gathered A (:func:`launch_gemm`), with no permute of the shard or of the results.  That needs the push, and blocks
    of whole tiles of every launch."""
    rows = shard2d.shape[0]
    if batch_rows <= 0 or rows % batch_rows:
        return f"{rows} shard rows are not whole blocks of {batch_rows}"
    if symm.capturing():
        return "CUDA graph capture (the captured push is rank-major)"
    if not use_push(shard2d, weights):
        return "the call pulls"
    if any(batch_rows % _tile_m(_forced_variant(shard2d.dtype, w)) for w in weights):
        return f"blocks of {batch_rows} rows are not whole tiles"
    if not all(maps_batch_major(_forced_variant(shard2d.dtype, w)) for w in weights):
        return f"kernel variant {settings.tuning.ag_variant} (settings.tuning.ag_variant) takes no batch-major A"
    return None


def use_push(shard2d: Tensor, weights: Sequence[Tensor]) -> bool:
    """Whether a call pushes (see the module docstring): the shard's rows a multiple of every launch's tile M (a tile
    never straddles this rank's rows and a peer's).  The automatic variant choice takes 256-row tiles only for shards
    of whole 256-row tiles, so without ``settings.tuning.ag_variant`` the 128-row tile decides."""
    rows = shard2d.shape[0]
    return shard2d.is_contiguous() and all(rows % _tile_m(_forced_variant(shard2d.dtype, w)) == 0
                                                    for w in weights)


# ---------------------------------------------------------------------------------------------------
# The interface dispatch.py calls.
# ---------------------------------------------------------------------------------------------------


def _group_size(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def _layout_key(shard2d: Tensor, push: bool) -> tuple:
    return shard2d.shape[0], shard2d.shape[1], shard2d.dtype, int(push)


def _check_layout_agrees(ws: symm.SymmetricWorkspace, shard2d: Tensor, push: bool, batch_rows: int = 0) -> None:
    """Once per (rows, K, dtype, push, batch_rows): make sure every rank calls with the same layout and moves shards
    the same way (a pulling rank would read a pushing peer's slot, which that peer never fills, e.g. with another
    ``settings.tuning.ag_variant``; a batch-major push writes other rows than a rank-major one): else raise, not hang
    or compute with stale rows.  Agreement on a batch-major layout implies it on the call's (rows, K, dtype, push),
    the key a captured call of the shape looks for."""
    key = _layout_key(shard2d, push) + (batch_rows,)
    if key in ws.checked_layouts:
        return
    import torch.distributed as dist

    mine = torch.tensor([shard2d.shape[0], shard2d.shape[1], _DTYPE_CODES[shard2d.dtype], int(push), batch_rows],
                        dtype=torch.int64, device=shard2d.device)
    everyone = torch.empty(ws.world * 5, dtype=torch.int64, device=shard2d.device)
    dist.all_gather_into_tensor(everyone, mine, group=ws.group)
    rows = everyone.view(ws.world, 5).tolist()
    if any(r != rows[0] for r in rows):
        raise ValueError("all_gather_matmul: ranks disagree on (shard rows, K, dtype code, push, batch rows): "
                         f"{rows}")
    ws.checked_layouts.update((key, _layout_key(shard2d, push)))


def all_gather_matmul(shard2d: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                      group_name: str, return_gathered: bool, *, checked: bool = False,
                      batch_rows: int = 0) -> Tuple[List[Tensor], Tensor]:
    """Fused ``A = all_gather(shard2d, dim 0)``; ``outputs[i] = A @ weights[i] + biases[i]``.

    shard2d: [M/world, K] contiguous bf16/fp16 CUDA; weights[i]: [K, N_i] (either dim contiguous, read in
    place); biases[i]: [N_i] or None.  Returns (outputs [M, N_i], A [M, K] or an empty tensor).  ``batch_rows`` > 0:
    shard2d is a [B, S/w, ...] shard flattened, and A and the outputs are batch-major, the gathered [B, S, ...]
    flattened (:func:`batch_major_reason` says when a call can).
    Raises ValueError when unsupported (see ``unsupported_reason``) or when ranks disagree on the layout,
    AllGatherGemmError when an earlier call's wait timed out.  ``checked``: the caller has just had
    ``unsupported_reason`` return None for these arguments (the dispatcher does), so it is not asked again.
    """
    reason = None if checked else unsupported_reason(shard2d, weights, biases, group_name)
    if reason is not None:
        raise ValueError(f"all_gather_matmul cannot run fused: {reason}")
    device = shard2d.device
    check_errors(device)
    if batch_rows:
        reason = batch_major_reason(shard2d, weights, batch_rows)
        if reason is not None:
            raise ValueError(f"all_gather_matmul cannot keep the batch-major layout: {reason}")
    capturing = symm.capturing()
    if capturing:  # unsupported_reason (ours, or the caller's: checked) found the call capturable
        if _group_size(group_name) == 1:
            outputs = [launch_gemm(shard2d, w, b, shard2d.new_empty((shard2d.shape[0], w.shape[1])))
                       for w, b in zip(weights, biases)]
            return outputs, shard2d.clone() if return_gathered else shard2d.new_empty(0)
        return _captured_call(symm.existing_workspace(group_name, device), shard2d, weights, biases, return_gathered)
    ws = symm.workspace(group_name, device)
    push = use_push(shard2d, weights)
    _check_layout_agrees(ws, shard2d, push, batch_rows)
    if push:
        return _PushCall(ws, shard2d, weights, biases, return_gathered, batch_rows)(shard2d, weights, biases)
    rank, world = ws.rank, ws.world
    shard_rows, k = shard2d.shape
    m = world * shard_rows
    dtype = shard2d.dtype
    # As in _PushCall, only the widest GEMM overlaps the transfer; the others run on cuBLAS over the gathered A.
    widest = max(range(len(weights)), key=lambda i: weights[i].shape[1])
    rest = [i for i in range(len(weights)) if i != widest]
    ws.reserve(m * k * shard2d.element_size())
    epoch = ws.next_epoch()
    parity = epoch & 1
    chunks = max(1, min(settings.tuning.ag_chunks, symm.MAX_CHUNKS_PER_RANK))
    main = torch.cuda.current_stream(device)
    buffer = ws.view(parity, rank, m, k, dtype)  # this rank's gathered A: [M, K]
    buffer[rank * shard_rows:(rank + 1) * shard_rows].copy_(shard2d)
    gathered = shard2d.new_empty((m, k)) if return_gathered else shard2d.new_empty(0)
    flags = ws.flags[parity]
    side = ws.side_stream
    k_chunks = use_k_chunks(m, weights[widest].shape[1], loader.extension().ag_device_sm_count(),
                            shard2d.numel() * shard2d.element_size())
    out = shard2d.new_empty((m, weights[widest].shape[1]))
    if k_chunks > 1:
        # One wave: the peers' tiles wait for the first column block from the start, so the pull's start is the
        # critical path, and the side stream follows the arrival through an event (a stream wait on the passed
        # word started the pull later: docs/design_ag_gemm.md).
        ws.arrive(epoch, epoch, main)
        side.wait_stream(main)
    else:
        # Off the GEMM's path: the side stream waits for the arrival, the GEMM is its programmatic dependent.
        side.wait_stream(main)
        ws.arrive(epoch, epoch, main)
        ws.wait_passed(epoch, side)
    peers = [ws.view(parity, q, m, k, dtype) if q != rank else buffer for q in range(world)]
    pull_shards(buffer, peers, rank, shard_rows, flags, epoch, side, chunks, gathered, k_chunks)
    launch_gemm(buffer, weights[widest], biases[widest], out, flags=flags, epoch=epoch, rank=rank, world=world,
                shard_rows=shard_rows, chunks_per_rank=chunks, k_chunks=k_chunks, stream=main,
                pdl=k_chunks == 1, capturing=False)
    outputs: List[Optional[Tensor]] = [None] * len(weights)
    outputs[widest] = out
    for i in rest:  # complete once the GEMM has waited for every chunk
        outputs[i] = (torch.mm(buffer, weights[i]) if biases[i] is None else
                      torch.addmm(biases[i], buffer, weights[i]))
    main.wait_stream(side)
    return outputs, gathered if return_gathered else shard2d.new_empty(0)


def prepare_all_gather_matmul(shard2d: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                              group_name: str, return_gathered: bool, batch_rows: int = 0):
    """For a call that :func:`unsupported_reason` accepts and that pushes, outside CUDA graph capture, on 2 or more
    ranks: a function ``run(shard2d, weights, biases)`` that runs it as :func:`all_gather_matmul` does, and any later
    call of its signature (operands of the same shapes, strides, dtypes and 16-byte alignment; the dispatcher's
    replays) with the per-call work only.  None otherwise: the caller runs :func:`all_gather_matmul`.  Collective on
    a new layout (:func:`_check_layout_agrees`)."""
    if symm.capturing() or _group_size(group_name) == 1 or not use_push(shard2d, weights):
        return None
    if batch_rows and batch_major_reason(shard2d, weights, batch_rows) is not None:
        return None
    check_errors(shard2d.device)
    ws = symm.workspace(group_name, shard2d.device)
    _check_layout_agrees(ws, shard2d, True, batch_rows)
    return _PushCall(ws, shard2d, weights, biases, return_gathered, batch_rows)


def _raw_stream(index: int) -> int:
    """The current stream of device ``index`` as a cudaStream_t (an integer), without building a Stream object."""
    return torch._C._cuda_getCurrentRawStream(index)


class _PushCall:
    """An eager push call's signature, worked out once (module docstring, steps 1-4); calling it enqueues one call of
    the signature: an error left by an earlier call is raised first, then the per-call work (the epoch, the outputs,
    the pointers) and one host call into the extension (:func:`push_call`).  The buffers' growth and addresses are
    looked up per call (another signature may grow them); the GEMM's launch arguments are worked out on the first call
    and only their per-call fields filled in afterwards (the ``_ARG_*`` positions)."""

    def __init__(self, ws: symm.SymmetricWorkspace, shard2d: Tensor, weights: Sequence[Tensor],
                 biases: Sequence[Optional[Tensor]], return_gathered: bool, batch_rows: int = 0):
        self.ws = ws
        self.batch_rows = batch_rows  # > 0: batch-major buffers (all_gather_matmul)
        self.device = shard2d.device
        self.index = shard2d.device.index
        self.shard_rows, self.k = shard2d.shape
        self.m = ws.world * self.shard_rows
        self.dtype = shard2d.dtype
        self.row_bytes = self.k * shard2d.element_size()
        self.nbytes = self.m * self.row_bytes
        self.return_gathered = return_gathered
        # Only the widest GEMM overlaps the transfer: any other GEMM on the stream starts after it, when every row
        # has arrived, so it runs on cuBLAS (which tiles a narrow N, the K/V projections', across more SMs: 46
        # against 84 us for 4096x8192x512 on an H200) and reads the complete gathered A.
        self.widest = max(range(len(weights)), key=lambda i: weights[i].shape[1])
        self.rest = [i for i in range(len(weights)) if i != self.widest]
        self.n = weights[self.widest].shape[1]
        self.chunks = max(1, min(settings.tuning.ag_chunks, symm.MAX_CHUNKS_PER_RANK))
        self.k_chunks = use_k_chunks(self.m, self.n, loader.extension().ag_device_sm_count(), self.nbytes // ws.world)
        self.tail_split = settings.tuning.ag_tail_split
        self._gemm: Optional[list] = None  # gemm_args of the first call
        self._streams: Dict[int, torch.cuda.Stream] = {}

    def _main_stream(self) -> Tuple[int, torch.cuda.Stream]:
        """The current stream: its handle, and its Stream object (kept per handle: building one costs microseconds)."""
        handle = _raw_stream(self.index)
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = torch.cuda.current_stream(self.device)
        return handle, stream

    def _gemm_args(self, buffer: int, weight: Tensor, bias: Optional[Tensor], out: Tensor, flags: int, epoch: int,
                   shard2d: Tensor, main: torch.cuda.Stream) -> list:
        gemm = self._gemm
        if gemm is None:
            view = self.ws.view(0, self.ws.rank, self.m, self.k, self.dtype)
            gemm = self._gemm = list(gemm_args(
                view, weight, bias, out, stream=main, flags=self.ws.flags[0], epoch=epoch, rank=self.ws.rank,
                world=self.ws.world, shard_rows=self.shard_rows, chunks_per_rank=self.chunks, k_chunks=self.k_chunks,
                a_local=shard2d, capturing=False, batch_rows=self.batch_rows))
        gemm = gemm.copy()
        gemm[_ARG_A], gemm[_ARG_B], gemm[_ARG_BIAS], gemm[_ARG_OUT] = (
            buffer, weight.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr())
        gemm[_ARG_FLAGS], gemm[_ARG_EPOCH], gemm[_ARG_A_LOCAL] = flags, epoch, shard2d.data_ptr()
        gemm[_ARG_TAIL_SPLIT] = tail_split_args(self.device, main, 0, self.tail_split)
        return gemm

    def __call__(self, shard2d: Tensor, weights: Sequence[Tensor],
                 biases: Sequence[Optional[Tensor]]) -> Tuple[List[Tensor], Tensor]:
        if symm.read_error(self.index):
            check_errors(self.device)
        ws = self.ws
        ws.reserve(self.nbytes)
        m, k, dtype, rank = self.m, self.k, self.dtype, ws.rank
        epoch = ws.next_epoch()
        parity = epoch & 1
        main_handle, main = self._main_stream()
        # The barrier: every peer done with the buffer this call writes into (the peer reached the previous call).
        # Once calls were captured, a peer's replay may have read either buffer since the previous eager call: every
        # peer must reach this one.
        need = ws.previous_epoch() if not ws.captured else epoch
        peer_buffers, peer_flags = ws.peer_addresses(parity, m, k, dtype)  # this rank's buffer: its rows stay unwritten
        out = shard2d.new_empty((m, self.n))
        gemm = self._gemm_args(peer_buffers[rank], weights[self.widest], biases[self.widest], out,
                               ws.flags[parity].data_ptr(), epoch, shard2d, main)
        # This rank's rows go, after the push, into the gathered A (or, for the other GEMMs, into the buffer) while the
        # GEMM runs; the peers' rows are copied out of the buffer once the GEMM has waited for them (push_call).
        gathered = shard2d.new_empty((m, k)) if self.return_gathered else None
        buffer = ws.view(parity, rank, m, k, dtype) if self.rest and gathered is None else None
        a_full = gathered if gathered is not None else buffer
        push_call(shard2d, peer_buffers, peer_flags, ws.peer_arrival_words(), ws.arrivals, ws.passed, epoch, need,
                  rank, [tuple(gemm)], ws.push_events(), main_handle, ws.side_stream.cuda_stream, self.chunks,
                  self.k_chunks, own_into=0 if a_full is None else a_full.data_ptr(),
                  gathered=0 if gathered is None else gathered.data_ptr(), batch_rows=self.batch_rows)
        outputs: List[Optional[Tensor]] = [None] * len(weights)
        outputs[self.widest] = out
        for i in self.rest:
            outputs[i] = (torch.mm(a_full, weights[i]) if biases[i] is None else
                          torch.addmm(biases[i], a_full, weights[i]))
        return outputs, gathered if gathered is not None else shard2d.new_empty(0)


def _captured_call(ws: symm.SymmetricWorkspace, shard2d: Tensor, weights: Sequence[Tensor],
                   biases: Sequence[Optional[Tensor]], return_gathered: bool) -> Tuple[List[Tensor], Tensor]:
    """all_gather_matmul under CUDA graph capture: :func:`captured_push_call` on the workspace's captured-call flags,
    arrival words and buffer 0."""
    ws.captured = True
    rank, world = ws.rank, ws.world
    shard_rows, k = shard2d.shape
    m, dtype = world * shard_rows, shard2d.dtype
    parity = symm.CAPTURE_PARITY
    peers = [ws.view(parity, q, m, k, dtype) for q in range(world)]
    chunks = max(1, min(settings.tuning.ag_chunks, symm.MAX_CHUNKS_PER_RANK))
    k_chunks = use_k_chunks(m, weights[0].shape[1], loader.extension().ag_device_sm_count(),
                            shard2d.numel() * shard2d.element_size())
    outputs = [shard2d.new_empty((m, w.shape[1])) for w in weights]
    gathered = shard2d.new_empty((m, k)) if return_gathered else shard2d.new_empty(0)
    captured_push_call(shard2d, weights, biases, outputs, gathered, peers,
                       [ws.peer_flags(symm.CAPTURE_ROW, q) for q in range(world)],
                       arrive=ws.arrive_captured, rank=rank, chunks=chunks, k_chunks=k_chunks,
                       main=torch.cuda.current_stream(shard2d.device), side=ws.side_stream)
    return outputs, gathered


def captured_push_call(shard: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                       outputs: Sequence[Tensor], gathered: Tensor, peer_buffers: Sequence[Tensor],
                       peer_flags: Sequence[Tensor], *, arrive, rank: int, chunks: int,
                       k_chunks: int, main: torch.cuda.Stream, side: torch.cuda.Stream, sm_count: int = 0,
                       timeout_s: Optional[float] = None) -> None:
    """Enqueue one push call that every replay of a CUDA graph can repeat as it is: it carries no per-call epoch.

    ``arrive(stream)``: a full barrier that leaves its words at 0 (``SymmetricWorkspace.arrive_captured``): every peer
    has reached this call, so its earlier GEMMs, the last readers of its buffer, are done.  Then the side stream pushes
    the shard into each peer's buffer (peer_buffers[q], [M, K]) and sets its flags (peer_flags[q]) to
    ``symm.CAPTURE_EPOCH``; the GEMMs read this rank's rows from ``shard`` and its peers' from peer_buffers[rank] once
    their flags say so (no tail split: its scratch flags take a new epoch per launch), trapping if a wait times out
    (no host code runs between replays to raise the error word).  Last, main waits for every peer's flags of this call
    (the GEMMs waited for each chunk their tiles read) and sets them back to 0: a peer sets them again only after the
    next call's barrier, which this rank enters after the reset.  ``gathered`` (or an empty tensor): the gathered A."""
    world = len(peer_buffers)
    shard_rows = shard.shape[0]
    epoch = symm.CAPTURE_EPOCH
    flags = peer_flags[rank]
    arrive(main)
    side.wait_stream(main)
    push_shards(shard, peer_buffers, peer_flags, rank, epoch, side, chunks, k_chunks)
    with torch.cuda.stream(main):
        for weight, bias, out in zip(weights, biases, outputs):
            launch_gemm(peer_buffers[rank], weight, bias, out, flags=flags, epoch=epoch, rank=rank, world=world,
                        shard_rows=shard_rows, chunks_per_rank=chunks, k_chunks=k_chunks, sm_count=sm_count,
                        timeout_s=timeout_s, stream=main, tail_split=1, a_local=shard, trap_on_timeout=True)
        if gathered.numel():
            assemble_gathered(gathered, peer_buffers[rank], shard, rank)
        main.wait_stream(side)
        per_rank = k_chunks if k_chunks > 1 else chunks
        ext = loader.extension()
        for q in range(world):
            for c in range(per_rank if q != rank else 0):
                ext.ag_stream_wait_value32_eq(flags.data_ptr() + 4 * (q * per_rank + c), epoch, main.cuda_stream)
        flags[:world * per_rank].zero_()


def gemm_only(a2d: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """The fused kernel with communication off: a2d [M, K] @ weight [K, N] (+ bias [N]) -> [M, N]."""
    reason = _operand_reason(a2d, [weight], [bias])
    if reason is None:
        reason = _kernel_reason(a2d.shape[0], a2d.shape[1], a2d.stride(0), a2d.data_ptr(), weight, bias, 256,
                                weight.shape[1])
    if reason is not None:
        raise ValueError(f"gemm_only cannot run: {reason}")
    out = a2d.new_empty((a2d.shape[0], weight.shape[1]))
    return launch_gemm(a2d, weight, bias, out)
