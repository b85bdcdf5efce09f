"""The GEMM+RS workspace of one (process group, device): the symmetric buffer (grown collectively), the call epoch,
the error word, the shapes known to agree across ranks, and the copy transport's resources.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from fluxinductor.kernels import symm as _symm
from fluxinductor.kernels.gemm_rs_copy import CopyEngineWorkspace
from fluxinductor.kernels.gemm_rs_kernel import _MIN_BUFFER_BYTES, CAPTURE_EPOCH, error_message
from fluxinductor.kernels.symm import ErrorWord, timeout_ns


class _GroupState:
    def __init__(self, group_name: str, device: torch.device):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        self.group_name = group_name
        self.group = _resolve_process_group(group_name)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.device = device
        self.capacity = 0
        self.buffer: Optional[Tensor] = None
        self.handle = None
        self.buffer_ptrs: List[int] = []
        self.retired: list = []  # earlier buffers: a peer may still touch them until the device drains
        self.epoch = 0
        self.agreed: set = set()
        self.agree_calls = 0
        self.generation = _generations.get(group_name, 0)  # store keys of a reset state never collide
        self.copy: Optional[CopyEngineWorkspace] = None
        with torch.cuda.device(device):
            self.error = ErrorWord()

    def raise_if_error(self) -> None:
        code = self.error.read()
        if code:
            raise RuntimeError(error_message(code) + f" on group {self.group_name!r} rank {self.rank}")

    def agree(self, sig: int) -> None:
        """Check, once per new signature, that every rank is in the same call with the same problem."""
        if sig in self.agreed or self.world == 1:
            return
        import torch.distributed as dist
        from datetime import timedelta

        store = dist.distributed_c10d._get_default_store()
        self.agree_calls += 1
        prefix = f"fluxinductor/gemm_rs/{self.group_name}/{self.generation}/{self.agree_calls}"
        store.set(f"{prefix}/{self.rank}", str(sig))
        old_timeout = store.timeout
        try:
            store.set_timeout(timedelta(seconds=timeout_ns() / 1e9))
            keys = [f"{prefix}/{r}" for r in range(self.world)]
            try:
                store.wait(keys)
            except Exception as e:  # noqa: BLE001 - the store raises its own timeout types
                raise RuntimeError(
                    f"matmul_reduce_scatter: not every rank of group {self.group_name!r} reached the same call "
                    f"within the timeout ({e})"
                ) from e
            values = [int(store.get(key)) for key in keys]
        finally:
            store.set_timeout(old_timeout)
        if any(v != sig for v in values):
            raise RuntimeError(
                f"matmul_reduce_scatter: ranks of group {self.group_name!r} disagree on the problem "
                "(shape, dtype or world); every rank must call with the same shapes"
            )
        self.agreed.add(sig)

    def reserve(self, nbytes: int) -> None:
        """Make the symmetric buffer hold ``nbytes`` (collective on growth; every rank grows on the same call
        because shapes were agreed first)."""
        if nbytes > self.capacity and self.world > 1:
            _symm.outside_graph_pools(lambda: self._grow(nbytes), self.device)

    def _grow(self, nbytes: int) -> None:
        if self.handle is not None:
            _symm.drain(self.handle, self.device)
            self.retired.append((self.buffer, self.handle))
        buffer, handle, capacity = _symm.new_symmetric_bytes(nbytes, _MIN_BUFFER_BYTES, self.group_name, self.device)
        buffer.zero_()  # hello words, status and flags start below every epoch
        handle.barrier(channel=0, timeout_ms=timeout_ns() // 1_000_000)  # peers zeroed before anyone writes
        self.buffer, self.handle, self.capacity = buffer, handle, capacity
        self.buffer_ptrs = [int(p) for p in handle.buffer_ptrs]

    def copy_workspace(self) -> CopyEngineWorkspace:
        if self.copy is None:
            self.copy = CopyEngineWorkspace(self.device, self.world)
        return self.copy

    def next_epoch(self) -> int:
        """1, 2, ... 0xFFFFFFFD, 1, ...: never 0 (a zeroed word), CAPTURE_EPOCH or the aborted status."""
        self.epoch = (self.epoch % (CAPTURE_EPOCH - 1)) + 1
        return self.epoch


_states: Dict[Tuple[str, int], _GroupState] = {}
_generations: Dict[str, int] = {}


def _state(group_name: str, device: torch.device) -> _GroupState:
    key = (group_name, device.index)
    state = _states.get(key)
    if state is None:
        state = _GroupState(group_name, device)
        _states[key] = state
    return state


def check_error(group_name: str, device: Optional[torch.device] = None, synchronize: bool = True) -> None:
    """Raise if a fused call on ``group_name`` failed (after syncing the device when ``synchronize``)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    if synchronize:
        torch.cuda.synchronize(device)
    state = _states.get((group_name, device.index))
    if state is not None:
        state.raise_if_error()


def reset(group_name: str) -> None:
    """Forget the state of ``group_name`` (after an error; the next call starts afresh, collectively)."""
    for key in [k for k in _states if k[0] == group_name]:
        del _states[key]
    _generations[group_name] = _generations.get(group_name, 0) + 1
