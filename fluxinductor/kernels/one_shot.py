"""One-shot all-reduce of a row-parallel matmul for small outputs (decode): ``fluxinductor._C.one_shot_all_reduce``.

Every rank's matmul writes its partial ``a2d @ weight`` [rows, N] into a local buffer (``torch.mm(..., out=)``), then
one kernel per rank pushes it into a slot of every peer's symmetric receive buffer over NVLink (16-byte stores the
sender does not wait for), signals each peer, waits for each peer's push, and sums its own partial and the received
ones in fp32 in rank order (every rank writes the same bits), scales for ``avg``, adds an optional residual, and writes
the result; every load is local.  A bias goes into each rank's partial (``torch.addmm(bias, ..., out=)``), as the
graph added it on every rank: the result is the exact ``all_reduce(a2d @ weight + bias)`` whatever bias each rank
holds (adding one rank's own bias ``world`` times instead would give the ranks different results, and wrong ones,
wherever their biases differ).  For the small outputs of decode this costs one kernel and one NVLink crossing each
way, where NCCL's all-reduce is latency bound (csrc/allreduce/one_shot.h has the protocol).

The workspace of one (process group, device): the local partial buffer and one symmetric receive buffer of 2 x world
slots (allocated on first use, each slot grown to the next power of two bytes: a collective step, which every rank
takes on the same call because the op checks that the ranks' shapes agree first), one symmetric allocation of signal
words (per block and peer), the call counters on the device, and a host-mapped error word.  The kernel takes its
epoch from the counters and advances it itself, so the host passes no epoch: a call captured in a CUDA graph takes the
next epoch on every replay, and eager calls and replays interleave freely.  Calls alternate between the two halves of
the receive buffer by their epoch's parity, which makes a barrier at the end of a call unnecessary: a peer writes a
half again only two calls later, after this rank has entered the call in between.

A wait past ``FLUXINDUCTOR_TIMEOUT_S`` writes its code into the error word and the kernel gives up (a call
captured in a CUDA graph traps instead: no host code would see the word); the next call on the group raises
RuntimeError, and so does :func:`check_error`, after which :func:`reset` lets the group start afresh (collectively).

Under CUDA graph capture a call needs an eager call of at least its size first (capture may not grow the buffer) and
``settings.kernels_under_capture()`` (as the other fused ops: the workspace is allocated outside CUDA graph trees'
pools only then).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fluxinductor import settings
from fluxinductor.kernels import symm as _symm
from fluxinductor.kernels.loader import extension
from fluxinductor.kernels.symm import ErrorWord, timeout_ns

# The element types the kernel takes (its dtype codes), and the partials' dtype -> what the output may be.
DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
OUT_DTYPES = {torch.bfloat16: (torch.bfloat16, torch.float32), torch.float16: (torch.float16, torch.float32),
              torch.float32: (torch.float32,)}
REDUCE_OPS = ("sum", "avg")
MAX_WORLD = 8
# The kernel's grid: at most this many blocks of 512 threads (each block carries its own barrier words; the kernel
# allows up to the extension's ONE_SHOT_MAX_BLOCKS).  64 blocks keep a 4 MiB bf16 output (256 x 8192) at 8 vectors
# per thread and a decode row (8192 bf16) on 2 blocks.
DEFAULT_MAX_BLOCKS = 64
# Under FLUXINDUCTOR_DISPATCH=fused (and under auto until a measurement decides), the one-shot path takes a call whose
# remote stores, (world - 1) x the output's bytes per rank, are at most this many, and the split path larger ones.  The
# one-shot kernel moves world / 2 times the bytes of a reduce-scatter + all-gather (every rank pushes its whole partial to
# every peer) but pays one kernel and one NVLink crossing each way (a few us) where NCCL's all-reduce costs ~50-100 us of
# latency at decode sizes (2xH200).  4 MiB of stores take ~10 us at NVLink's ~400 GB/s, still well below that latency:
# at TP=2 every decode output up to 256 x 8192 bf16 (4 MiB) goes one-shot, at TP=8 up to ~0.6 MiB (vLLM's custom
# all-reduce stops its one-shot at 512 KB on 8 GPUs for the same reason).
FUSED_MAX_REMOTE_BYTES = 4 << 20
_MIN_BYTES = 1 << 20
_ERRORS = {
    1: "a peer never entered the call (it crashed, hung, or made a different sequence of calls)",
}


def error_message(code: int) -> str:
    return f"one-shot all-reduce failed (code {code}): {_ERRORS.get(code, 'unknown error')}"


def _extension():
    """The extension with the one-shot kernel built in; RuntimeError with the reason otherwise."""
    ext = extension()
    if not hasattr(ext, "one_shot_all_reduce"):
        raise RuntimeError("fluxinductor._C was built without the one-shot all-reduce")
    return ext


# ---------------------------------------------------------------------------------------------------
# The workspace of one (group, device).
# ---------------------------------------------------------------------------------------------------


class OneShotWorkspace:
    """The local partial buffer, the symmetric receive buffer, the signal words, the call counters and the error word
    of one group on one device (see the module docstring)."""

    def __init__(self, group_name: str, device: torch.device):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        self.group_name = group_name
        self.group = _resolve_process_group(group_name)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.device = device
        self.capacity = 0  # bytes of one slot, and of the partial buffer
        self.partials: Optional[Tensor] = None  # this rank's partial (local)
        self.buffer: Optional[Tensor] = None  # the receive buffer: 2 x world slots of `capacity` bytes
        self.handle = None
        self.buffer_ptrs: List[int] = []
        self.retired: list = []  # buffers a captured graph may still use
        self.captured = False
        self.signals: Optional[Tensor] = None
        self._signal_handle = None
        self.signal_ptrs: List[int] = []
        self.counters: Optional[Tensor] = None
        # Per call signature (rows, n, dtype, out_dtype, reduce_op, max_blocks, norm): the partial's view of the partial
        # buffer and the kernel's arguments that do not change between calls (:func:`matmul_all_reduce`); emptied on
        # growth.
        self.calls: Dict[tuple, tuple] = {}
        with torch.cuda.device(device):
            self.error = ErrorWord()

    def raise_if_error(self) -> None:
        code = self.error.read()
        if code:
            raise RuntimeError(error_message(code) + f" on group {self.group_name!r} rank {self.rank}; "
                               "fluxinductor.kernels.one_shot.reset(group_name) on every rank starts afresh")

    def ready_for(self, nbytes: int) -> bool:
        """Whether a call of ``nbytes`` needs no collective step (what a call under CUDA graph capture requires)."""
        return self.signals is not None and nbytes <= self.capacity

    def reserve(self, nbytes: int) -> None:
        """Make a slot (and the partial buffer) hold ``nbytes`` (collective on the first call and on growth)."""
        if not self.ready_for(nbytes):
            _symm.outside_graph_pools(lambda: self._grow(nbytes), self.device)

    def _grow(self, nbytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        _symm._enable_group(self.group_name)
        ext = _extension()
        if self.signals is None:
            signals = symm_mem.empty(ext.ONE_SHOT_SIGNAL_WORDS, dtype=torch.int32, device=self.device)
            signals.zero_()  # below every epoch, before any peer can write them
            self.counters = torch.zeros(ext.ONE_SHOT_COUNTER_WORDS, dtype=torch.int32, device=self.device)
            torch.cuda.synchronize(self.device)
            self._signal_handle = symm_mem.rendezvous(signals, self.group_name)
            self.signals = signals
            self.signal_ptrs = [int(p) for p in self._signal_handle.buffer_ptrs]
            self._signal_handle.barrier(channel=0, timeout_ms=timeout_ns() // 1_000_000)  # every rank zeroed
        if nbytes <= self.capacity:
            return
        if self.handle is not None:
            # Once this device drained, every push into the old buffer has landed (its kernels waited for each), and
            # once every peer drained (the barrier), nothing reads or writes it any more.
            _symm.drain(self.handle, self.device)
            if self.captured:
                self.retired.append((self.buffer, self.handle, self.partials))
        capacity = max(_MIN_BYTES, 1 << (int(nbytes) - 1).bit_length())
        buffer, handle, _ = _symm.new_symmetric_bytes(2 * self.world * capacity, 0, self.group_name, self.device)
        self.calls.clear()
        self.partials = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self.buffer, self.handle, self.capacity = buffer, handle, capacity
        self.buffer_ptrs = [int(p) for p in handle.buffer_ptrs]

    def partial(self, rows: int, n: int, dtype: torch.dtype) -> Tensor:
        """This rank's [rows, n] ``dtype`` partial: a view of the start of its partial buffer."""
        return self.partials[:rows * n * dtype.itemsize].view(dtype).view(rows, n)

    def call(self, rows: int, n: int, dtype: torch.dtype, out_dtype: torch.dtype, reduce_op: str,
             max_blocks: int, norm: bool = False) -> tuple:
        """(partial, the kernel's leading arguments up to the bias, out_scale, error address, grid) of a call
        signature (``norm``: with RMSNorm, one block per row), built once (the buffers must hold it: :meth:`reserve`
        first)."""
        key = (rows, n, dtype, out_dtype, reduce_op, max_blocks, norm)
        found = self.calls.get(key)
        if found is None:
            if not self.ready_for(rows * n * dtype.itemsize):
                raise RuntimeError(f"one-shot all-reduce: the group's buffer ({self.capacity} bytes) does not hold a "
                                   f"[{rows}, {n}] {dtype} partial (an eager call of this size first)")
            partial = self.partial(rows, n, dtype)
            head = (DTYPES[dtype], out_dtype != dtype, rows, n, self.world, self.rank, list(self.buffer_ptrs),
                    self.capacity, list(self.signal_ptrs), self.counters.data_ptr(), partial.data_ptr(),
                    0)  # 0: the bias is in the partials
            found = self.calls[key] = (partial, head, 1.0 / self.world if reduce_op == "avg" else 1.0,
                                       self.error.device, blocks_for(rows, n, dtype, max_blocks, norm))
        return found


_workspaces: Dict[Tuple[str, int], OneShotWorkspace] = {}


def workspace(group_name: str, device: torch.device) -> OneShotWorkspace:
    """The workspace of ``group_name`` on ``device`` (created on first use; its buffers on the first call)."""
    key = (group_name, device.index)
    ws = _workspaces.get(key)
    if ws is None:
        ws = _workspaces[key] = OneShotWorkspace(group_name, device)
    return ws


def check_error(group_name: str, device: Optional[torch.device] = None, synchronize: bool = True) -> None:
    """Raise RuntimeError if a one-shot call on ``group_name`` failed (after syncing the device when
    ``synchronize``)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    if synchronize:
        torch.cuda.synchronize(device)
    ws = _workspaces.get((group_name, device.index))
    if ws is not None:
        ws.raise_if_error()


def reset(group_name: str) -> None:
    """Forget the workspaces of ``group_name`` (after an error, on every rank; the next call allocates new ones,
    collectively).  A CUDA graph that captured a call must not be replayed afterwards."""
    for key in [k for k in _workspaces if k[0] == group_name]:
        del _workspaces[key]


# ---------------------------------------------------------------------------------------------------
# Launch (raw pointers: also what the single-GPU N-rank tests drive).
# ---------------------------------------------------------------------------------------------------


def launch(
    *,
    dtype: torch.dtype,
    out: Tensor,
    rows: int,
    n: int,
    world: int,
    rank: int,
    partial: int,
    buffers: Sequence[int],
    slot_bytes: int,
    signals: Sequence[int],
    counters: int,
    bias: Optional[Tensor] = None,
    residual: Optional[Tensor] = None,
    out_scale: float = 1.0,
    bias_scale: float = 1.0,
    error_address: int = 0,
    timeout: Optional[int] = None,
    trap_on_timeout: bool = False,
    blocks: int = 0,
    stream: Optional[torch.cuda.Stream] = None,
    norm_weight: Optional[Tensor] = None,
    normed: Optional[Tensor] = None,
    eps: float = 1e-5,
    weight_after_cast: bool = True,
) -> None:
    """Enqueue one rank's kernel: out [rows, n] = out_scale * sum_q partial_q + bias_scale * bias + residual.

    ``partial``: this rank's partial ([rows, n] ``dtype``, contiguous); ``buffers``/``signals``: every rank's receive
    buffer (2 x world slots of ``slot_bytes``) and signal words (``ONE_SHOT_SIGNAL_WORDS`` int32, zeroed before first
    use), addresses as mapped on this device, in rank order; ``counters``: this rank's ``ONE_SHOT_COUNTER_WORDS`` int32
    call counters (zeroed before first use).  bias: [n] ``dtype``; residual: [rows, n]
    in out's dtype, contiguous.  ``blocks``: the grid (0: :func:`blocks_for`'s choice; every rank must launch the
    same).  ``timeout`` in ns (None: FLUXINDUCTOR_TIMEOUT_S).  With ``norm_weight`` ([n], ``dtype``; out in ``dtype``)
    the kernel also writes ``normed`` = RMSNorm of out (:func:`fluxinductor.ops.rms_norm_reference`)."""
    stream = stream if stream is not None else torch.cuda.current_stream(out.device)
    _extension().one_shot_all_reduce(  # positional: pybind11's keyword parsing costs microseconds
        DTYPES[dtype], out.dtype != dtype, rows, n, world, rank, list(buffers), slot_bytes, list(signals), counters,
        partial, 0 if bias is None else bias.data_ptr(), 0 if residual is None else residual.data_ptr(), out.data_ptr(),
        out_scale, bias_scale, error_address, timeout_ns() if timeout is None else timeout, trap_on_timeout,
        blocks or blocks_for(rows, n, dtype, norm=norm_weight is not None), stream.cuda_stream,
        0 if norm_weight is None else norm_weight.data_ptr(), 0 if normed is None else normed.data_ptr(), eps,
        weight_after_cast)


_blocks: Dict[tuple, int] = {}


def blocks_for(rows: int, n: int, dtype: torch.dtype, max_blocks: int = DEFAULT_MAX_BLOCKS, norm: bool = False) -> int:
    """The grid of a call: one 512-thread block per 512 16-byte vectors of the output (``norm``: per row), at most
    ``max_blocks``."""
    key = (rows, n, dtype, max_blocks, norm)
    found = _blocks.get(key)
    if found is None:
        found = _blocks[key] = _extension().one_shot_blocks(rows, n, dtype.itemsize, max_blocks, norm)
    return found


# ---------------------------------------------------------------------------------------------------
# The interface the op calls.
# ---------------------------------------------------------------------------------------------------


def small_enough(rows: int, n: int, dtype: torch.dtype, world: int) -> bool:
    """Whether a [rows, n] ``dtype`` all-reduce over ``world`` ranks is small enough for the one-shot path without a
    measurement (:data:`FUSED_MAX_REMOTE_BYTES`)."""
    return (world - 1) * rows * n * dtype.itemsize <= FUSED_MAX_REMOTE_BYTES


def shape_reason(n: int, dtype: torch.dtype, out_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why the kernel cannot take a [*, n] output of ``dtype`` partials (and an ``out_dtype`` result), or None: what
    a compile-time check can know (no tensors, no group)."""
    if dtype not in DTYPES:
        return f"dtype {dtype}: the one-shot all-reduce takes bf16, fp16 or fp32"
    if out_dtype is not None and out_dtype not in OUT_DTYPES[dtype]:
        return f"a {out_dtype} result of {dtype} partials (the one-shot all-reduce writes {OUT_DTYPES[dtype]})"
    if n <= 0 or (n * dtype.itemsize) % 16:
        return f"N={n} of {dtype}: a row of {n * dtype.itemsize} bytes is not a multiple of 16 (16-byte vectors)"
    return None


def static_reason(world: int, n: int, dtype: torch.dtype) -> Optional[str]:
    """Why no call of ``world`` ranks producing [*, n] ``dtype`` could run the kernel, or None: what a compile-time
    check can know (the extension built with the kernel, the world, the dtype and N)."""
    try:
        _extension()
    except RuntimeError as e:
        return str(e)
    if world > MAX_WORLD:
        return f"world size {world} > {MAX_WORLD}"
    return shape_reason(n, dtype)


def unsupported_reason(a2d: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, group_name: str,
                       out_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """None when :func:`matmul_all_reduce` can run this call, else why not (cheap, never collective; the group's
    NVLink check is the dispatcher's).  Under CUDA graph capture also whether an eager call prepared the workspace."""
    try:
        _extension()
    except RuntimeError as e:
        return str(e)
    if not (a2d.is_cuda and weight.is_cuda) or (bias is not None and not bias.is_cuda):
        return "tensors are not on a CUDA device"
    if a2d.device != weight.device or (bias is not None and bias.device != a2d.device):
        return "tensors are on different devices"
    if a2d.dim() != 2 or weight.dim() != 2 or a2d.shape[1] != weight.shape[0]:
        return f"shapes {tuple(a2d.shape)} @ {tuple(weight.shape)} are not a 2-D matmul"
    if weight.dtype != a2d.dtype or (bias is not None and bias.dtype != a2d.dtype):
        return "operands of different dtypes"
    if reduce_op not in REDUCE_OPS:
        return f"reduce_op {reduce_op!r} is not one of {REDUCE_OPS}"
    rows, n = a2d.shape[0], weight.shape[1]
    why = shape_reason(n, a2d.dtype, out_dtype)
    if why is not None:
        return why
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        return f"bias of shape {tuple(bias.shape)} is not [N={n}]"
    ws = _workspaces.get((group_name, a2d.device.index))
    world = ws.world if ws is not None else _world(group_name)
    if isinstance(world, str):
        return world
    if world > MAX_WORLD:
        return f"world size {world} > {MAX_WORLD}"
    if _symm.capturing():
        if not settings.kernels_under_capture():
            return "CUDA graph capture (the per-compile option cuda_graphs=True captures the fused kernels)"
        if ws is None or not ws.ready_for(rows * n * a2d.element_size()):
            return "CUDA graph capture before an eager call of this size set up the group's one-shot buffer"
    return None


_world_sizes: Dict[str, int] = {}


def _world(group_name: str):
    """The group's size, or why it does not resolve."""
    world = _world_sizes.get(group_name)
    if world is None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        try:
            world = _world_sizes[group_name] = dist.get_world_size(_resolve_process_group(group_name))
        except Exception as e:  # noqa: BLE001
            return f"group {group_name!r} does not resolve ({e})"
    return world


def matmul_all_reduce(
    a2d: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, group_name: str,
    out_dtype: Optional[torch.dtype] = None, *, residual: Optional[Tensor] = None, out: Optional[Tensor] = None,
    checked: bool = False, max_blocks: int = DEFAULT_MAX_BLOCKS,
    norm: Optional[Tuple[Tensor, float, bool]] = None,
):
    """all_reduce(a2d @ weight + bias, reduce_op) over ``group_name`` (+ ``residual``), through the one-shot kernel.

    a2d: [rows, K/world] (this rank's partial operand), weight: [K/world, N], bias: [N] or None (this rank's, added
    to its partial before the reduction, as the graph did; the ranks' biases may differ).  ``out_dtype`` (None: a2d's;
    float32 for bf16/fp16 operands: the partials round to the operands' dtype, the sum is fp32, as autocast's
    ``all_reduce(mm(a, w).float())``).  residual: [rows, N] in the result's dtype, added after the reduction.
    ``out`` (tests): a contiguous, 16-byte aligned [rows, N] tensor of the result's dtype to write into.
    Returns [rows, N].  ``norm`` = (norm_weight [N] in a2d's dtype, eps, weight_after_cast): RMSNorm after the
    reduction and the residual add, in the same kernel (out_dtype must be a2d's); returns (result, normed), both
    [rows, N] (:func:`fluxinductor.ops.rms_norm_reference` is what normed means).  Every rank must call with the same
    shapes (the op checks that first); ``checked``: the caller just had :func:`unsupported_reason` return None.
    Raises RuntimeError when an earlier call on the group failed.
    """
    reason = None if checked else unsupported_reason(a2d, weight, bias, reduce_op, group_name, out_dtype)
    if reason is not None:
        raise ValueError(f"one-shot matmul_all_reduce cannot run: {reason}")
    # The per-call path: what does not change between calls of a signature comes from ws.call (built once); left per
    # call are the error word's check, the capture state, the matmul, the output and the launch.
    device = a2d.device
    ws = _workspaces.get((group_name, device.index))
    if ws is None:
        ws = workspace(group_name, device)
    ws.raise_if_error()
    rows, n = a2d.shape[0], weight.shape[1]
    dtype = a2d.dtype
    out_dtype = out_dtype or dtype
    capturing = torch.cuda.is_current_stream_capturing()
    if capturing:
        ws.captured = True  # the buffer's address is now in a graph: a growth keeps it
    elif not ws.ready_for(rows * n * dtype.itemsize):
        ws.reserve(rows * n * dtype.itemsize)
    if norm is not None and out_dtype != dtype:
        raise ValueError(f"one-shot matmul_all_reduce with RMSNorm writes {dtype}, not {out_dtype}")
    partial, head, out_scale, error_address, blocks = ws.call(rows, n, dtype, out_dtype, reduce_op, max_blocks,
                                                              norm is not None)
    if bias is None:
        torch.mm(a2d, weight, out=partial)
    else:  # every rank's own bias in its partial: the sum is the graph's all_reduce(a2d @ weight + bias)
        torch.addmm(bias, a2d, weight, out=partial)
    if out is None:
        out = torch.empty((rows, n), dtype=out_dtype, device=device)
    elif out.shape != (rows, n) or out.dtype != out_dtype or not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError(f"out {out.dtype}{list(out.shape)} is not a contiguous, 16-byte aligned "
                         f"{out_dtype}{[rows, n]}")
    normed = norm_tail = None
    if norm is not None:
        norm_weight, eps, weight_after_cast = norm
        if norm_weight.shape != (n,) or norm_weight.dtype != dtype:
            raise ValueError(f"norm weight {norm_weight.dtype}{list(norm_weight.shape)} is not {dtype}[{n}]")
        norm_weight = _kernel_ready(norm_weight)
        normed = torch.empty((rows, n), dtype=dtype, device=device)
        norm_tail = (norm_weight.data_ptr(), normed.data_ptr(), float(eps), bool(weight_after_cast))
    if rows == 0:
        return out if norm is None else (out, normed)
    residual_ptr = 0
    if residual is not None:
        if residual.shape != out.shape or residual.dtype != out_dtype:
            raise ValueError(f"residual {residual.dtype}{list(residual.shape)} is not {out_dtype}{list(out.shape)}")
        residual = _kernel_ready(residual)
        residual_ptr = residual.data_ptr()
    _extension().one_shot_all_reduce(  # positional: pybind11's keyword parsing costs microseconds
        *head, residual_ptr, out.data_ptr(), out_scale, 1.0, error_address, _timeout_ns(), capturing, blocks,
        _raw_stream(device.index), *(norm_tail or ()))
    return out if norm is None else (out, normed)


def _kernel_ready(t: Tensor) -> Tensor:
    """``t`` where the kernel can read it with 16-byte vectors (contiguous, 16-byte aligned), else such a copy."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


_timeout_cache: list = [None, 0]


def _timeout_ns() -> int:
    """:func:`timeout_ns`, recomputed only when ``settings.current`` changed (``settings.override`` replaces it)."""
    current = settings.current
    if _timeout_cache[0] is not current:
        _timeout_cache[1] = int(current.timeout_s * 1e9)
        _timeout_cache[0] = current
    return _timeout_cache[1]


def _raw_stream(index: int) -> int:
    """The current stream's cudaStream_t on device ``index`` as an int, without building a torch.cuda.Stream."""
    return torch._C._cuda_getCurrentRawStream(index)
