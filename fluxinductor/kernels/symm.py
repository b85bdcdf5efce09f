"""The extension loader and the symmetric-memory workspaces of the fused kernels.

A workspace belongs to one (process group, CUDA device).  It holds two symmetric buffers from
``torch.distributed._symmetric_memory`` (used by alternate calls, so a call never overwrites what a peer
may still be reading from the call before), the per-chunk arrival flags the GEMM waits on (symmetric too:
the copy stream that delivers a chunk raises its flag, this rank's after a pull, a peer's after a push), a
monotonically increasing call epoch (a flag is set when
it holds the current epoch, so flags are never reset), a side stream for the copy engine, and a
host-mapped error word the kernel writes when a wait times out.

Buffers are allocated on first use and grow (to the next power of two bytes) when a call needs more; a
growth is a collective step that all ranks take on the same call because they check their shapes agree
first (see ``fluxinductor.kernels.ag_gemm``).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Dict, List, Optional, Tuple

import torch

_extension = None
_extension_reason: Optional[str] = None
_extension_tried = False
_lock = threading.Lock()


def extension():
    """The loaded ``fluxinductor._C`` module; raises RuntimeError with the reason when it is not there."""
    reason = extension_available()
    if reason is not None:
        raise RuntimeError(reason)
    return _extension


def extension_available() -> Optional[str]:
    """None when ``fluxinductor._C`` imports, else why it does not (checked once, lazily)."""
    global _extension, _extension_reason, _extension_tried
    if not _extension_tried:
        with _lock:
            if not _extension_tried:
                try:
                    from fluxinductor import _C  # noqa: PLC0415 - lazy on purpose

                    _extension = _C
                except ImportError as e:
                    _extension_reason = f"fluxinductor._C is not built or does not load ({e})"
                _extension_tried = True
    return _extension_reason


def timeout_seconds() -> float:
    """How long a flag wait or barrier may take before the call fails (FLUXINDUCTOR_TIMEOUT_S, default 10)."""
    return float(os.environ.get("FLUXINDUCTOR_TIMEOUT_S", "10"))


# ---------------------------------------------------------------------------------------------------
# The host-mapped error word (one per device).
# ---------------------------------------------------------------------------------------------------

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
        # the call's epoch on this device, written by the side stream, the source of the flag copies into peers
        self.epoch_word = torch.zeros(1, dtype=torch.int32, device=device)
        self.epoch = 0
        self.side_stream = torch.cuda.Stream(device=device)
        self.checked_layouts: set = set()
        self._views: Dict[tuple, torch.Tensor] = {}

    def next_epoch(self) -> int:
        self.epoch = (self.epoch + 1) & 0x7FFFFFFF or 1
        return self.epoch

    def reserve(self, nbytes: int) -> None:
        """Make both buffers hold at least ``nbytes`` (collective when it grows)."""
        if nbytes <= self.capacity_bytes:
            return
        import torch.distributed._symmetric_memory as symm_mem

        if self._flag_handle is None:
            self._allocate_flags()

        capacity = max(_MIN_BYTES, 1 << (int(nbytes) - 1).bit_length())
        if self.handles[0] is not None:
            # Peers may still read the old buffers: drain this device, then wait for every rank to do so.
            torch.cuda.synchronize(self.device)
            for handle in self.handles:
                handle.barrier(channel=0, timeout_ms=int(timeout_seconds() * 1000))
            torch.cuda.synchronize(self.device)
        self._views.clear()
        _enable_group(self.group_name)
        self.buffers = [None, None]
        self.handles = [None, None]
        for parity in range(2):
            buffer = symm_mem.empty(capacity, dtype=torch.uint8, device=self.device)
            self.handles[parity] = symm_mem.rendezvous(buffer, self.group_name)
            self.buffers[parity] = buffer
        self.capacity_bytes = capacity

    def _allocate_flags(self) -> None:
        """The arrival flags, in symmetric memory (collective: the first reserve, on every rank), zeroed before any
        peer can write them (peers push only after a later barrier)."""
        import torch.distributed._symmetric_memory as symm_mem

        _enable_group(self.group_name)
        shape = (2, self.world * MAX_CHUNKS_PER_RANK)
        flags = symm_mem.empty(shape[0] * shape[1], dtype=torch.int32, device=self.device)
        flags.zero_()
        self._flag_handle = symm_mem.rendezvous(flags, self.group_name)
        torch.cuda.synchronize(self.device)
        self.flags = flags.view(shape)
        self._peer_flags = [self.flags if q == self.rank else self._flag_handle.get_buffer(q, shape, torch.int32, 0)
                            for q in range(self.world)]

    def peer_flags(self, parity: int, rank: int) -> torch.Tensor:
        """``rank``'s flags of ``parity`` ([world * MAX_CHUNKS_PER_RANK] int32), mapped into this device."""
        return self._peer_flags[rank][parity]

    def view(self, parity: int, rank: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, cols] ``dtype`` view of ``rank``'s buffer ``parity`` (mapped into this device)."""
        key = (parity, rank, rows, cols, dtype)
        view = self._views.get(key)
        if view is None:
            view = self.handles[parity].get_buffer(rank, (rows, cols), dtype, 0)
            self._views[key] = view
        return view

    def barrier(self, parity: int) -> None:
        """Every rank reached this point of its current stream (torch symmetric memory; times out)."""
        self.handles[parity].barrier(channel=0, timeout_ms=int(timeout_seconds() * 1000))


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


def workspace(group_name: str, device: torch.device) -> SymmetricWorkspace:
    """The workspace of ``group_name`` on ``device`` (created on first use)."""
    key = (group_name, device.index)
    ws = _workspaces.get(key)
    if ws is None:
        ws = SymmetricWorkspace(group_name, device)
        _workspaces[key] = ws
    return ws
