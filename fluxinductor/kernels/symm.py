"""The symmetric-memory workspaces of the fused kernels (the extension comes from :mod:`.loader`).

A workspace belongs to one (process group, CUDA device).  It holds two symmetric buffers from
``torch.distributed._symmetric_memory`` (used by alternate calls, so a call never overwrites what a peer
may still be reading from the call before), the per-chunk arrival flags the GEMM waits on (symmetric too:
the copy stream that delivers a chunk raises its flag, this rank's after a pull, a peer's after a push), the
per-rank arrival words of the calls' barrier (``arrive``), a monotonically increasing call epoch (a flag is set when
it holds the current epoch, so flags are never reset), a side stream for the copy engine, and a
host-mapped error word the kernel writes when a wait times out.

Calls captured in a CUDA graph (``fluxinductor.kernels.ag_gemm``, ``settings.kernels_under_capture()``) replay with
the epoch they were captured with, so they have flags and arrival words of their own, which go back to 0 after each call
instead of carrying epochs; they use buffer 0 behind a full barrier.  Once a call was captured, the buffers a graph
holds are never freed (a growth keeps them), and eager calls wait for every peer to reach the call (a replay on a peer
may have read either buffer since this rank's previous eager call).

Buffers are allocated on first use and grow (to the next power of two bytes) when a call needs more; a
growth is a collective step that all ranks take on the same call because they check their shapes agree
first (see ``fluxinductor.kernels.ag_gemm``).  Before any capture a growth drops every reference to the old buffers
(their handles, views and cached addresses), so their memory goes back to torch's symmetric-memory allocator.
:func:`workspace_bytes` tells how much the workspaces hold.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

import torch

from fluxinductor import settings
from fluxinductor.kernels.loader import extension, extension_available  # noqa: F401 - re-exported for tools


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False where CUDA is not initialized: no capture can have
    begun).  Asked several times per fused call: ``torch.cuda.is_available`` consults the environment and NVML on
    every call, ``is_initialized`` reads a flag."""
    return torch.cuda.is_initialized() and torch._C._cuda_isCurrentStreamCapturing()


T = TypeVar("T")


def outside_graph_pools(fn: Callable[[], T], device: torch.device) -> T:
    """``fn()``, which allocates what the kernels keep across calls (workspace words, scratch, an outbox, symmetric
    buffers), with its allocations in the caching allocator's ordinary pool.  Inductor's CUDA graph trees route every
    allocation of the thread running a warm-up to the graph's private pool, where state that outlives the graph is an
    error ("not tracked as outputs").  Under ``settings.kernels_under_capture()``, the one case where the fused ops run
    inside those warm-ups, ``fn`` runs on a helper thread, which waits for its stream before returning; otherwise
    here."""
    if capturing():
        raise RuntimeError("fluxinductor: kernel state would be allocated during CUDA graph capture")
    if not settings.kernels_under_capture():
        return fn()
    results: list = []

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            results.append(fn())
            torch.cuda.current_stream(device).synchronize()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            results.append(e)

    helper = threading.Thread(target=run, name="fluxinductor-allocate")
    helper.start()
    helper.join()
    if isinstance(results[0], BaseException):
        raise results[0]
    return results[0]


def persistent(make: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """``make()``, a tensor the kernels keep across calls, allocated by :func:`outside_graph_pools` and recorded as
    used by the current stream."""
    tensor = outside_graph_pools(make, device)
    tensor.record_stream(torch.cuda.current_stream(device))
    return tensor


def timeout_seconds() -> float:
    """How long a flag wait or barrier may take before the call fails (FLUXINDUCTOR_TIMEOUT_S, default 10)."""
    return settings.current.timeout_s


def timeout_ns() -> int:
    """:func:`timeout_seconds` in nanoseconds, as the kernels take it."""
    return int(settings.current.timeout_s * 1e9)


def new_symmetric_bytes(nbytes: int, min_bytes: int, group_name: str, device: torch.device) -> tuple:
    """(buffer, handle, capacity): a symmetric uint8 buffer of the next power of two bytes that holds ``nbytes`` (at
    least ``min_bytes``), rendezvoused on the group: a collective step every rank takes on the same call."""
    import torch.distributed._symmetric_memory as symm_mem

    capacity = max(min_bytes, 1 << (int(nbytes) - 1).bit_length())
    buffer = symm_mem.empty(capacity, dtype=torch.uint8, device=device)
    return buffer, symm_mem.rendezvous(buffer, group_name), capacity


def drain(handle, device: torch.device) -> None:
    """Wait until this device and then every peer of ``handle``'s group have finished their work (so no peer still
    reads a buffer about to be replaced); the barrier fails after :func:`timeout_seconds`."""
    torch.cuda.synchronize(device)
    handle.barrier(channel=0, timeout_ms=int(timeout_seconds() * 1000))


# ---------------------------------------------------------------------------------------------------
# Host-mapped error words: one per workspace (ErrorWord), or one per device (error_word).
# ---------------------------------------------------------------------------------------------------


class ErrorWord:
    """A host-mapped int32 a kernel writes its error code into (zeroed); read without synchronizing."""

    def __init__(self) -> None:
        self.host, self.device = extension().ag_alloc_host_mapped_word()
        self._word = ctypes.c_int32.from_address(self.host)  # one ctypes view, read on every call

    def read(self) -> int:
        return self._word.value

    def clear(self) -> None:
        self._word.value = 0


_error_words: Dict[int, Tuple[int, int]] = {}


def error_word(device_index: int) -> Tuple[int, int]:
    """(host address, device address) of this device's error word, allocated on first use."""
    word = _error_words.get(device_index)
    if word is None:
        with torch.cuda.device(device_index):
            word = tuple(extension().ag_alloc_host_mapped_word())
        _error_words[device_index] = word
    return word


def read_error(device_index: int) -> int:
    """The error code the kernels left for this device (0: none); reading does not synchronize."""
    word = _error_words.get(device_index)
    return 0 if word is None else ctypes.c_int32.from_address(word[0]).value


def clear_error(device_index: int) -> None:
    word = _error_words.get(device_index)
    if word is not None:
        ctypes.c_int32.from_address(word[0]).value = 0


# ---------------------------------------------------------------------------------------------------
# Workspaces.
# ---------------------------------------------------------------------------------------------------

MAX_CHUNKS_PER_RANK = 16
_MIN_BYTES = 1 << 20
# Captured calls: their flags' row, the buffer parity they use, and their epoch (flags and arrival words hold it once
# set, 0 after the call).
CAPTURE_ROW = 2
CAPTURE_PARITY = 0
CAPTURE_EPOCH = 1


def _word(device: torch.device) -> torch.Tensor:
    return persistent(lambda: torch.zeros(1, dtype=torch.int32, device=device), device)


class SymmetricWorkspace:
    """Two symmetric byte buffers (call parity), arrival flags and an epoch for one group on one device."""

    def __init__(self, group_name: str, device: torch.device):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        self.group_name = group_name
        self.group = _resolve_process_group(group_name)
        self.rank = self.group.rank()
        self.world = dist.get_world_size(self.group)
        self.device = device
        self.capacity_bytes = 0
        self.buffers = [None, None]  # uint8 symmetric tensors
        self.handles = [None, None]  # _SymmetricMemory handles
        # flags: [parity, world * MAX_CHUNKS_PER_RANK] int32, set to the epoch when a chunk has landed; symmetric
        # (allocated with the first buffers), so that a peer pushing its shard can raise them (peer_flags)
        self.flags: Optional[torch.Tensor] = None
        self._flag_handle = None
        self._peer_flags: List[torch.Tensor] = []
        # arrivals: [world] int32 in the same symmetric allocation, [q] = the last call peer q reached (written by q's
        # ``arrive``); _peer_arrivals[q]: the address of this rank's word on peer q
        self.arrivals: Optional[torch.Tensor] = None
        self._peer_arrivals: List[int] = []
        # set to the call's epoch by ``arrive`` once the peers have reached the call it needs; the side stream waits
        # for it before writing into a peer
        self.passed = _word(device)
        self.epoch = 0
        self._previous_epoch = 0
        self.side_stream = torch.cuda.Stream(device=device)
        self.checked_layouts: set = set()
        self._views: Dict[tuple, torch.Tensor] = {}
        self._addresses: Dict[tuple, Tuple[List[int], List[int]]] = {}
        self._push_events: Optional[Tuple[int, int]] = None
        # Captured calls (see the module docstring): their arrival words (after the eager ones; their flags are row
        # CAPTURE_ROW of the flag allocation) and passed word.
        self.captured = False
        self.retired: list = []  # buffers a captured graph may still use
        self.capture_arrivals: Optional[torch.Tensor] = None
        self._peer_capture_arrivals: List[int] = []
        self.capture_passed = _word(device)

    def next_epoch(self) -> int:
        """The next call's epoch: 32-bit, never 0 (the flags' initial value).  The kernels compare epochs by their
        signed 32-bit difference, which stays right across the wrap as long as consecutive calls differ by 1 or 2."""
        self._previous_epoch = self.epoch
        self.epoch = (self.epoch + 1) & 0xFFFFFFFF or 1
        return self.epoch

    def previous_epoch(self) -> int:
        """The epoch of the call before the current one (0 before the first)."""
        return self._previous_epoch

    def reserve(self, nbytes: int) -> None:
        """Make both buffers hold at least ``nbytes`` (collective when it grows)."""
        if nbytes > self.capacity_bytes:
            outside_graph_pools(lambda: self._grow(nbytes), self.device)

    def _grow(self, nbytes: int) -> None:
        if self._flag_handle is None:
            self._allocate_flags()

        if self.handles[0] is not None:
            # Peers may still read the old buffers: drain this device, then wait for every rank to do so.
            for handle in self.handles:
                drain(handle, self.device)
            torch.cuda.synchronize(self.device)
        self._views.clear()
        self._addresses.clear()
        _enable_group(self.group_name)
        if self.captured and self.handles[0] is not None:
            self.retired.append((self.buffers, self.handles))
        self.buffers = [None, None]
        self.handles = [None, None]
        for parity in range(2):
            self.buffers[parity], self.handles[parity], capacity = new_symmetric_bytes(nbytes, _MIN_BYTES,
                                                                                       self.group_name, self.device)
        self.capacity_bytes = capacity

    def _allocate_flags(self) -> None:
        """The chunk flags and the arrival words, in one symmetric allocation (collective: the first reserve, on every
        rank), zeroed before the rendezvous, so before any peer can write them."""
        import torch.distributed._symmetric_memory as symm_mem

        _enable_group(self.group_name)
        shape = (3, self.world * MAX_CHUNKS_PER_RANK)  # parity 0, parity 1, captured calls (CAPTURE_ROW)
        count = shape[0] * shape[1]
        words = count + 2 * self.world  # then the arrival words: the eager calls', the captured calls'
        flags = symm_mem.empty(words, dtype=torch.int32, device=self.device)
        flags.zero_()
        torch.cuda.synchronize(self.device)
        self._flag_handle = symm_mem.rendezvous(flags, self.group_name)
        self.flags = flags[:count].view(shape)
        self.arrivals = flags[count:count + self.world]
        self.capture_arrivals = flags[count + self.world:]
        peers = [flags if q == self.rank else self._flag_handle.get_buffer(q, (words,), torch.int32, 0)
                 for q in range(self.world)]
        self._peer_flags = [peer[:count].view(shape) for peer in peers]
        self._peer_arrivals = [peer[count + self.rank].data_ptr() for peer in peers]
        self._peer_capture_arrivals = [peer[count + self.world + self.rank].data_ptr() for peer in peers]

    def peer_flags(self, parity: int, rank: int) -> torch.Tensor:
        """``rank``'s flags of ``parity`` ([world * MAX_CHUNKS_PER_RANK] int32), mapped into this device; parity
        CAPTURE_ROW: its flags of captured calls."""
        return self._peer_flags[rank][parity]

    def ready_for(self, nbytes: int, layout_key: tuple) -> bool:
        """Whether a call of ``nbytes`` per buffer and this layout needs no collective step (no growth, no layout
        check): what a call under CUDA graph capture requires."""
        return nbytes <= self.capacity_bytes and layout_key in self.checked_layouts

    def arrive_captured(self, stream: torch.cuda.Stream) -> None:
        """A captured call's arrival on ``stream``: a full barrier on the captured calls' words, which it sets back
        to 0 (see :func:`arrive`)."""
        arrive(self._peer_capture_arrivals, self.capture_arrivals, self.capture_passed, CAPTURE_EPOCH, CAPTURE_EPOCH,
               self.rank, stream, reset=True)

    def view(self, parity: int, rank: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, cols] ``dtype`` view of ``rank``'s buffer ``parity`` (mapped into this device)."""
        key = (parity, rank, rows, cols, dtype)
        view = self._views.get(key)
        if view is None:
            view = self.handles[parity].get_buffer(rank, (rows, cols), dtype, 0)
            self._views[key] = view
        return view

    def peer_addresses(self, parity: int, rows: int, cols: int, dtype: torch.dtype) -> Tuple[List[int], List[int]]:
        """(every rank's buffer ``parity`` as a [rows, cols] ``dtype`` view, every rank's flags of ``parity``): their
        addresses on this device, in rank order (this rank's own included)."""
        key = (parity, rows, cols, dtype)
        found = self._addresses.get(key)
        if found is None:
            found = ([self.view(parity, q, rows, cols, dtype).data_ptr() for q in range(self.world)],
                     [self.peer_flags(parity, q).data_ptr() for q in range(self.world)])
            self._addresses[key] = found
        return found

    def peer_arrival_words(self) -> List[int]:
        """Addresses of this rank's arrival word on every peer (see :func:`arrive`)."""
        return self._peer_arrivals

    def push_events(self) -> Tuple[int, int]:
        """Two CUDA events (timing off) of this device for the one-call push (its fork and join; never destroyed)."""
        if self._push_events is None:
            self._push_events = push_events(self.device)
        return self._push_events

    def arrive(self, epoch: int, need: int, stream: torch.cuda.Stream) -> None:
        """This rank's arrival at call ``epoch`` on ``stream``, then ``passed`` = epoch once every peer reached ``need``
        (see :func:`arrive`)."""
        arrive(self._peer_arrivals, self.arrivals, self.passed, epoch, need, self.rank, stream)

    def wait_passed(self, epoch: int, stream: torch.cuda.Stream) -> None:
        """Enqueue on ``stream`` a wait until the arrival of call ``epoch`` has passed (see :func:`wait_passed`)."""
        wait_passed(self.passed, epoch, stream)


def arrive(peer_arrivals: List[int], arrivals: torch.Tensor, passed: torch.Tensor, epoch: int, need: int, rank: int,
           stream: torch.cuda.Stream, timeout_s: Optional[float] = None, reset: bool = False) -> None:
    """Enqueue on ``stream`` the arrival of ``rank`` at call ``epoch`` (csrc/ag_gemm/ag_gemm.h arrive_and_wait): one warp
    writes ``epoch`` to the address peer_arrivals[q] (this rank's word on peer q; the entry for ``rank`` is unused),
    waits until every arrivals[q] (int32 [world], written by the peers) is at least ``need``, then sets ``passed``
    (one int32) to ``epoch``.  A kernel launched next on ``stream`` with ``pdl`` starts without waiting for it.  Past
    the timeout (FLUXINDUCTOR_TIMEOUT_S) it writes its code to the error word and traps.  ``reset`` (captured calls,
    whose epoch is a constant): arrivals[q] goes back to 0 once seen."""
    _, error_device = error_word(arrivals.device.index)
    timeout_s = timeout_seconds() if timeout_s is None else timeout_s
    extension().ag_arrive_and_wait(  # positional (the binding's order): pybind11's keyword parsing costs microseconds
        peer_arrivals, arrivals.data_ptr(), passed.data_ptr(), epoch, need, rank, int(timeout_s * 1e9), error_device,
        stream.cuda_stream, reset)


def wait_passed(passed: torch.Tensor, epoch: int, stream: torch.cuda.Stream) -> None:
    """Enqueue on ``stream`` a wait (a stream memory operation, no SM) until ``passed`` holds ``epoch``.  Equality, not
    >=: ``passed`` cannot move on to the next call before this wait returns (the main stream joins the side stream at
    the end of each call), and equality survives the epoch's wrap-around."""
    extension().ag_stream_wait_value32_eq(passed.data_ptr(), epoch, stream.cuda_stream)


def push_events(device: torch.device) -> Tuple[int, int]:
    """Two new CUDA events (cudaEvent_t as integers, timing off) on ``device``, for ``ag_gemm.push_call``; never
    destroyed."""
    with torch.cuda.device(device):
        return extension().ag_create_event(), extension().ag_create_event()


def _enable_group(group_name: str) -> None:
    """Older torch (2.11 included) needs a group registered with symmetric memory before a rendezvous."""
    import warnings

    import torch.distributed._symmetric_memory as symm_mem

    enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is None or (enabled is not None and enabled(group_name)):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable(group_name)


_workspaces: Dict[Tuple[str, int], SymmetricWorkspace] = {}


def existing_workspace(group_name: str, device: torch.device) -> Optional[SymmetricWorkspace]:
    """The workspace of ``group_name`` on ``device`` if a call created it, else None (never collective)."""
    return _workspaces.get((group_name, device.index))


def workspace(group_name: str, device: torch.device) -> SymmetricWorkspace:
    """The workspace of ``group_name`` on ``device`` (created on first use)."""
    key = (group_name, device.index)
    ws = _workspaces.get(key)
    if ws is None:
        ws = SymmetricWorkspace(group_name, device)
        _workspaces[key] = ws
    return ws


def workspace_bytes() -> int:
    """Bytes of symmetric memory the workspaces of this process hold now: each workspace's two buffers, the buffers
    kept for captured graphs (``retired``) and the allocation of its flags and arrival words.  Reads only (no
    collective, no allocation); 0 before any fused call."""
    total = 0
    for ws in _workspaces.values():
        kept = [b for b in ws.buffers if b is not None]
        kept += [b for buffers, _ in ws.retired for b in buffers if b is not None]
        total += sum(b.numel() * b.element_size() for b in kept)
        if ws.flags is not None:
            total += (ws.flags.numel() + 2 * ws.world) * ws.flags.element_size()
    return total
