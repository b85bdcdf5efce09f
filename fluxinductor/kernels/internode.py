"""AG+GEMM and GEMM+RS for a group whose ranks span nodes: NVSHMEM puts on a communication stream, the GEMM waiting
on per-rank flags as on one node.

The transport is NVSHMEM through PyTorch's symmetric memory (its NVSHMEM backend bootstraps NVSHMEM over the default
process group's c10d store: no MPI, no launcher of its own) and NVSHMEM's stream-ordered host API, called through
ctypes on the library PyTorch loaded: ``nvshmemx_putmem_on_stream`` and ``nvshmemx_quiet_on_stream``.  NVSHMEM picks
the wire per peer: NVLink (peer-to-peer) inside a node, its remote transport (InfiniBand: IBRC or IBGDA; UCX;
libfabric) between nodes.  A rank's data put is followed by a quiet, then by a 4-byte put of the call's epoch into the
receiver's flag for this rank: the flag lands after the data on every transport, with no atomic (NVSHMEM's UCX
transport refuses atomics without GDRCopy).

One workspace per (group, device): one symmetric allocation holding the flags (two parities), the epoch word the
flag puts read, and two parities of data slots.  Call e uses parity e % 2.  A rank starts call e's puts only after its
stream finished call e - 1, which waited for flags its peers raised only after their streams finished call e - 2: so
no put of call e lands in a slot a peer may still read (that peer's call e - 2 used the same parity).

Nodes of equal size go by rails (GPU i of a node talks to GPU i of the others), so a chunk crosses between two nodes
once per rank, as NCCL's rings do; elsewhere (one GPU a node, nodes of different sizes) a rank puts to every peer.

* AG+GEMM: this rank's shard is copied into its receive slot and put into the same slot of its rails and of its
  node's peers; each shard a rail delivers (a stream wait on its flag) is forwarded to the node's peers.  The fused
  AG+GEMM kernel reads the receive slots as the gathered A, each tile waiting for the flag of the rank its rows come
  from (its own rows need none).  The other weights of a multi-weight call run on cuBLAS once the kernel saw every
  flag.  A forwarding wait has no timeout of its own: the kernel's wait times out, and the next call (or
  :func:`check_errors`) raises the stuck flags before it raises, which frees the stream.
* GEMM+RS (:func:`reduce_scatter_plan`): the partials of other nodes' rows first, each computed (cuBLAS, bias added
  on every rank) into a slot and put to the rank of this node in its owner's place, while the next is computed; that
  rank sums its node's partials (csrc/internode/reduce_arrivals.h: waits for their flags with a timeout, sums in a
  fixed order) and puts the one sum to the owner; then the partials of this node's ranks, put straight to them; this
  rank's own last.  The final reduction sums this node's partials and the other nodes' sums.

A wait past ``FLUXINDUCTOR_TIMEOUT_S`` writes an error word and gives up; the next call raises (or
:func:`check_errors`).  NVSHMEM puts address a peer's memory by the local address of the same symmetric object, so
every rank must allocate the workspace in the same order: its base address is checked to agree across the group.
A process has one symmetric-memory backend: the inter-node path sets NVSHMEM's at its first call and refuses to run
(the call decomposes) where another backend was already in use.  Calls under CUDA graph capture decompose.

The topology (which ranks share a node) comes from the peer check (:mod:`fluxinductor.kernels.peers`), or, under
``settings.tuning.emulate_nodes`` = g, ranks in consecutive groups of g are nodes, which runs this path on one host.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from fluxinductor.kernels import loader, symm
from fluxinductor.kernels.symm import ErrorWord

_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1}
_ALIGN = 256
_FLAG_BYTES = 4096  # 2 parities of Workspace.flag_words int32 flags; the epoch word in the last 16 bytes


class InternodeError(RuntimeError):
    """An inter-node call failed on the device (a peer's data never arrived within the timeout)."""


# ---------------------------------------------------------------------------------------------------
# NVSHMEM's host API, from the library PyTorch loaded.
# ---------------------------------------------------------------------------------------------------


class _Nvshmem:
    def __init__(self, lib: ctypes.CDLL):
        self.put = lib.nvshmemx_putmem_on_stream
        self.put.restype = None
        self.put.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.quiet = lib.nvshmemx_quiet_on_stream
        self.quiet.restype = None
        self.quiet.argtypes = [ctypes.c_void_p]
        self.my_pe = lib.nvshmem_my_pe
        self.my_pe.restype = ctypes.c_int
        self.my_pe.argtypes = []


_nvshmem: Optional[_Nvshmem] = None


def _load_nvshmem() -> _Nvshmem:
    """The host API of the NVSHMEM library PyTorch initialized (call after the first NVSHMEM allocation)."""
    global _nvshmem
    if _nvshmem is None:
        name = "libnvshmem_host.so.3"
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL | getattr(os, "RTLD_NOLOAD", 0))
        except OSError:
            import nvidia  # the nvidia-nvshmem-cu* wheel PyTorch depends on

            found = [f for p in nvidia.__path__ for f in glob.glob(os.path.join(p, "nvshmem", "lib", name))]
            if not found:
                raise RuntimeError(f"{name} is neither loaded nor in the nvidia-nvshmem wheel") from None
            lib = ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
        _nvshmem = _Nvshmem(lib)
    return _nvshmem


def backend_reason(device: torch.device) -> Optional[str]:
    """Why this process cannot run the inter-node path on ``device`` (no NVSHMEM in this PyTorch, or symmetric memory
    allocated on another backend already), or None, after making NVSHMEM's the backend of this process's symmetric
    memory.  Never collective."""
    import torch.distributed._symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        return "this PyTorch build has no NVSHMEM (torch.distributed._symmetric_memory.is_nvshmem_available())"
    if symm_mem.get_backend(device) != "NVSHMEM":
        try:
            symm_mem.set_backend("NVSHMEM")
        except Exception as e:  # noqa: BLE001 - refused once a buffer exists: the path is not for this process
            return (f"this process's symmetric memory is on the {symm_mem.get_backend(device)} backend already "
                    f"(the inter-node path needs NVSHMEM's: {type(e).__name__}: {e})")
    return None


def operand_reason(a2d: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]]) -> Optional[str]:
    """Why the inter-node path cannot take these operands, or None (the AG+GEMM kernel's own checks come on top)."""
    if a2d.dtype not in _DTYPE_CODES:
        return f"{a2d.dtype} (the inter-node path takes bf16 and fp16)"
    for t in (*weights, *(b for b in biases if b is not None)):
        if t.dtype != a2d.dtype or t.device != a2d.device:
            return "operands of different dtypes or devices"
    if symm.capturing():
        return "CUDA graph capture (the inter-node path runs eagerly)"
    return None


# ---------------------------------------------------------------------------------------------------
# The workspace.
# ---------------------------------------------------------------------------------------------------


def _round_up(x: int, to: int = _ALIGN) -> int:
    return (x + to - 1) // to * to


class Workspace:
    """One (group, device)'s symmetric allocation, streams, epoch and error word (module docstring)."""

    def __init__(self, group_name: str, device: torch.device, nodes: Sequence[int]):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        self.group_name, self.device = group_name, device
        self.group = _resolve_process_group(group_name)
        self.rank, self.world = self.group.rank(), self.group.size()
        self.pes = [dist.get_global_rank(self.group, q) for q in range(self.world)]
        self.order = send_order(self.rank, nodes, remote_first=False)  # AG+GEMM: the peers this rank sends to
        self.local = [q for q in self.order if nodes[q] == nodes[self.rank]]
        self.rails = rail_peers(self.rank, nodes)  # AG+GEMM's hierarchical sends; None: a put to every peer
        self.rs_plan = reduce_scatter_plan(self.rank, nodes)
        self.flag_words = max(self.world, self.rs_plan.flags)
        if 8 * self.flag_words > _FLAG_BYTES - 16:
            raise ValueError(f"inter-node path: a group of {self.world} ranks needs {self.flag_words} flags a call "
                             f"(at most {(_FLAG_BYTES - 16) // 8})")
        self.comm = torch.cuda.Stream(device)
        self.error = ErrorWord()
        self.epoch = 0
        self.buffer: Optional[Tensor] = None
        self.capacity = 0  # bytes of one parity's data

    def reserve(self, data_bytes: int) -> None:
        """Grow (a collective step every rank takes on the same call) until one parity holds ``data_bytes``."""
        if data_bytes <= self.capacity:
            return
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        capacity = max(1 << 20, 1 << (int(data_bytes) - 1).bit_length())
        if self.buffer is not None:
            torch.cuda.synchronize(self.device)  # this rank's streams are done with the old allocation
        self.buffer, self.capacity = None, 0
        why = backend_reason(self.device)
        if why is not None:
            raise RuntimeError(f"inter-node path: {why}")
        try:
            buffer = symm_mem.empty(_FLAG_BYTES + 2 * capacity, dtype=torch.uint8, device=self.device)
        except RuntimeError as e:
            raise RuntimeError(
                f"inter-node path: NVSHMEM could not allocate {_FLAG_BYTES + 2 * capacity} bytes of symmetric memory "
                f"({e}); the heap's size is NVSHMEM_SYMMETRIC_SIZE (default 1 GiB)") from e
        buffer[:_FLAG_BYTES].zero_()
        torch.cuda.synchronize(self.device)
        symm_mem.rendezvous(buffer, self.group_name)  # collective: every rank's flags are zero past this
        bases = [None] * self.world
        dist.all_gather_object(bases, buffer.data_ptr(), group=self.group)
        if len(set(bases)) != 1:
            raise RuntimeError(f"inter-node path: the ranks' symmetric buffers sit at different addresses ({bases}); "
                               "NVSHMEM puts need every rank to allocate in the same order")
        nvshmem = _load_nvshmem()
        if nvshmem.my_pe() != self.pes[self.rank]:
            raise RuntimeError(f"inter-node path: NVSHMEM PE {nvshmem.my_pe()} is not this rank's global rank "
                               f"{self.pes[self.rank]}")
        self.buffer, self.capacity = buffer, capacity
        self.base = buffer.data_ptr()

    def next_epoch(self) -> int:
        self.epoch = (self.epoch + 1) & 0xFFFFFFFF or 1  # flags compare by signed 32-bit difference: wraps safely
        return self.epoch

    def flags(self, parity: int) -> Tensor:
        return self.buffer[parity * 4 * self.flag_words:(parity + 1) * 4 * self.flag_words].view(torch.int32)

    def flag_address(self, parity: int, index: int) -> int:
        return self.base + 4 * (parity * self.flag_words + index)

    @property
    def epoch_word_address(self) -> int:
        return self.base + _FLAG_BYTES - 16

    def slot_address(self, parity: int, index: int, slot_bytes: int) -> int:
        """Address of slot ``index`` of ``parity`` (slots ``slot_bytes`` apart)."""
        return self.base + _FLAG_BYTES + parity * self.capacity + index * slot_bytes

    def slots(self, parity: int, first: int, count: int, slot_bytes: int, rows: int, cols: int,
              dtype: torch.dtype) -> Tensor:
        """Slots [first, first + count) of ``parity`` as a [count, rows, cols] tensor."""
        start = _FLAG_BYTES + parity * self.capacity + first * slot_bytes
        raw = self.buffer[start:start + count * slot_bytes].view(dtype).view(count, -1)
        return raw[:, :rows * cols].view(count, rows, cols)

    def release_waits(self) -> None:
        """After a timed-out wait: raise the flags of the latest call on this rank, so a communication stream still
        waiting for a rail's flag (AG+GEMM's forwarding) goes on instead of holding every later call."""
        epoch = self.epoch - (1 << 32) if self.epoch >= 1 << 31 else self.epoch
        with torch.cuda.stream(torch.cuda.Stream(self.device)):  # not behind the waiting stream
            self.flags(self.epoch & 1).fill_(epoch)

    def raise_if_error(self) -> None:
        code = self.error.read()
        if code or symm.read_error(self.device.index):
            self.release_waits()
        if code:
            self.error.clear()
            raise InternodeError(
                f"inter-node call on group {self.group_name}: a peer's data did not arrive within "
                f"{symm.timeout_seconds()} s (error code {code}); the call's outputs were wrong")

    def send(self, parity: int, q: int, dst: int, src: int, nbytes: int, flag: Optional[int] = None) -> None:
        """On the communication stream: put ``nbytes`` from ``src`` to peer q at ``dst`` (local symmetric address),
        quiet, then put this call's epoch into q's flag ``flag`` (default: this rank's)."""
        nvshmem, stream = _load_nvshmem(), self.comm.cuda_stream
        nvshmem.put(dst, src, nbytes, self.pes[q], stream)
        nvshmem.quiet(stream)
        address = self.flag_address(parity, self.rank if flag is None else flag)
        nvshmem.put(address, self.epoch_word_address, 4, self.pes[q], stream)


_workspaces: Dict[Tuple[str, int], Workspace] = {}
_lock = threading.Lock()


def send_order(rank: int, nodes: Sequence[int], remote_first: bool) -> List[int]:
    """The peers of ``rank`` (``nodes[q]``: the node of rank q), nearest-first around the ring within each class:
    ranks of this rank's node before the others (``remote_first``: after)."""
    world = len(nodes)
    ring = [(rank + i) % world for i in range(1, world)]
    local = [q for q in ring if nodes[q] == nodes[rank]]
    remote = [q for q in ring if nodes[q] != nodes[rank]]
    return remote + local if remote_first else local + remote


def _members(nodes: Sequence[int]) -> Dict[int, List[int]]:
    """The ranks of each node, nodes in order of first appearance, ranks in rank order."""
    members: Dict[int, List[int]] = {}
    for q, node in enumerate(nodes):
        members.setdefault(node, []).append(q)
    return members


def rail_peers(rank: int, nodes: Sequence[int]) -> Optional[List[int]]:
    """The ranks of the other nodes that hold this rank's place in their node (its rails: GPU i of one node talks to
    GPU i of the others), nearest node first; None where the hierarchical sends do not apply (one node, one GPU a node,
    or nodes of different sizes)."""
    members = _members(nodes)
    sizes = {len(m) for m in members.values()}
    if len(members) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    order = list(members)
    mine = order.index(nodes[rank])
    place = members[nodes[rank]].index(rank)
    return [members[order[(mine + i) % len(order)]][place] for i in range(1, len(order))]


class Partial(NamedTuple):
    """GEMM+RS: compute the partial of ``owner``'s rows into slot ``here``; with ``peer``, put it into that peer's slot
    ``there`` (and raise its flag ``there``)."""
    owner: int
    here: int
    peer: Optional[int] = None
    there: int = 0


class Aggregate(NamedTuple):
    """GEMM+RS between nodes: once the ``count`` slots from ``first`` (this node's partials of ``peer``'s rows, this
    rank's own at index ``own``) arrived, sum them into slot ``here`` and put that into ``peer``'s slot ``there``."""
    first: int
    count: int
    own: int
    here: int
    peer: int
    there: int


class ReduceScatterPlan(NamedTuple):
    """Where one rank's GEMM+RS partials go, in slot indices of one parity (a receive slot's flag has its index)."""
    steps: List[Union[Partial, Aggregate]]  # in the order this rank runs them
    final: int       # the final reduction sums receive slots [0, final)
    own: int         # ... this rank's own partial in slot ``own``
    slots: int       # slots a parity holds
    flags: int       # flag words a parity needs


def reduce_scatter_plan(rank: int, nodes: Sequence[int]) -> ReduceScatterPlan:
    """Across nodes of equal size (``rail_peers``): this rank's partials of another node's rows go to the rank of its
    node in that owner's place, which sums the node's partials and puts one sum across, so one chunk per rank crosses
    between two nodes; partials for the node's own ranks go straight to them.  Otherwise a put to every owner, the
    other nodes' first.  Receive slots: the final reduction's (by sender place, then one per other node), then one
    area per other node for the sums this rank makes; send slots after them."""
    world = len(nodes)
    if rail_peers(rank, nodes) is None:  # receive slot q: sender q; send slot world + q: the partial of owner q
        steps: List[Union[Partial, Aggregate]] = [Partial(q, world + q, q, rank)
                                                  for q in send_order(rank, nodes, remote_first=True)]
        return ReduceScatterPlan(steps + [Partial(rank, rank)], world, rank, 2 * world, world)
    members = _members(nodes)
    order = list(members)
    count, g = len(order), len(members[nodes[rank]])
    node, place = order.index(nodes[rank]), members[nodes[rank]].index(rank)
    final = g + count - 1  # [0, g): from this node's ranks by place; g + e - 1: the sum from the node e before
    sends = final + (count - 1) * g  # area d (1..count-1): [final + (d - 1) g, + g), the node d after's partials
    steps = []
    for d in range(1, count):
        owners = members[order[(node + d) % count]]
        area = final + (d - 1) * g
        for j, q in enumerate(owners):
            aggregator = members[nodes[rank]][j]
            steps.append(Partial(q, area + place) if aggregator == rank else Partial(q, sends + q, aggregator,
                                                                                     area + place))
    for d in range(1, count):
        steps.append(Aggregate(final + (d - 1) * g, g, place, sends + world + d - 1,
                               members[order[(node + d) % count]][place], g + count - d - 1))
    for q in send_order(rank, nodes, remote_first=False)[:g - 1]:  # this node's ranks
        steps.append(Partial(q, sends + q, q, place))
    steps.append(Partial(rank, place))
    return ReduceScatterPlan(steps, final, place, sends + world + count - 1, sends)


def workspace(group_name: str, device: torch.device) -> Workspace:
    """The group's workspace on ``device``, made at its first call from the nodes the peer check found."""
    key = (group_name, device.index)
    ws = _workspaces.get(key)
    if ws is None:
        from fluxinductor.kernels import peers

        with _lock:
            ws = _workspaces.get(key)
            if ws is None:
                nodes = peers.nodes(group_name, device)
                if nodes is None:
                    raise RuntimeError(f"inter-node path: the nodes of group {group_name} are not known (the peer "
                                       "check has not run)")
                ws = _workspaces[key] = Workspace(group_name, device, nodes)
    return ws


def check_errors(device: Optional[torch.device] = None, synchronize: bool = False) -> None:
    """Raise :class:`InternodeError` if an inter-node call on ``device`` reported a timed-out wait (tests)."""
    from fluxinductor.kernels import ag_gemm

    index = torch.cuda.current_device() if device is None else torch.device(device).index
    if synchronize:  # the caller's stream only: a communication stream may wait for a flag that never comes
        torch.cuda.current_stream(index).synchronize()
    for (_, dev), ws in list(_workspaces.items()):
        if dev == index:
            ws.raise_if_error()
    ag_gemm.check_errors(torch.device("cuda", index))


def _start(ws: Workspace, data_bytes: int) -> Tuple[int, int, torch.cuda.Stream]:
    """The call's (epoch, parity, stream), after the checks and the growth; the communication stream has written the
    epoch word and waits for the caller's stream."""
    from fluxinductor.kernels import ag_gemm

    ws.raise_if_error()
    ag_gemm.check_errors(ws.device)
    ws.reserve(data_bytes)
    stream = torch.cuda.current_stream(ws.device)
    stream.wait_stream(ws.comm)  # the previous call's puts read slots this call may overwrite
    epoch = ws.next_epoch()
    loader.extension().ag_stream_write_value32(ws.epoch_word_address, epoch, ws.comm.cuda_stream)
    return epoch, epoch & 1, stream


# ---------------------------------------------------------------------------------------------------
# The ops.
# ---------------------------------------------------------------------------------------------------


def all_gather_matmul(shard2d: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                      group_name: str, return_gathered: bool) -> Tuple[List[Tensor], Tensor]:
    """(outputs [M, N_i], gathered [M, K] or empty): ``all_gather(shard2d) @ weights[i] + biases[i]``, rank-major
    rows, M = world * shard rows."""
    from fluxinductor.kernels import ag_gemm

    ws = workspace(group_name, shard2d.device)
    rows, k = shard2d.shape
    dtype, world, rank = shard2d.dtype, ws.world, ws.rank
    # Slots back to back (a row is a multiple of 16 bytes, as the kernel needs): the kernel reads them as one matrix.
    slot_bytes = rows * k * shard2d.element_size()
    epoch, parity, stream = _start(ws, world * slot_bytes)
    gathered = ws.slots(parity, 0, world, slot_bytes, rows, k, dtype)  # slot q: rank q's shard
    gathered[rank].copy_(shard2d)
    ws.comm.wait_stream(stream)
    own = ws.slot_address(parity, rank, slot_bytes)
    if ws.rails is None:
        for q in ws.order:
            ws.send(parity, q, own, own, slot_bytes)
    else:
        # Hierarchical: this rank's shard to its rails (between nodes) and its node's peers; each shard a rail
        # delivers is forwarded to the node's peers, so every shard crosses between two nodes once.
        for q in ws.rails + ws.local:
            ws.send(parity, q, own, own, slot_bytes)
        ext = loader.extension()
        for p in ws.rails:
            ext.ag_stream_wait_value32_eq(ws.flag_address(parity, p), epoch, ws.comm.cuda_stream)
            delivered = ws.slot_address(parity, p, slot_bytes)
            for q in ws.local:
                ws.send(parity, q, delivered, delivered, slot_bytes, flag=p)
    a = gathered.view(world * rows, k)
    first = torch.empty((world * rows, weights[0].shape[1]), dtype=dtype, device=shard2d.device)
    ag_gemm.launch_gemm(a, weights[0], biases[0], first, flags=ws.flags(parity), epoch=epoch, rank=rank, world=world,
                        shard_rows=rows, chunks_per_rank=1, stream=stream)
    # The kernel saw every flag before it finished: the rest of the stream reads complete slots.
    outputs = [first] + [torch.addmm(bias, a, weight) if bias is not None else torch.mm(a, weight)
                         for weight, bias in zip(weights[1:], biases[1:])]
    gathered_out = a.clone() if return_gathered else shard2d.new_empty(0)
    return outputs, gathered_out


def matmul_reduce_scatter(a2d: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str,
                          group_name: str) -> Tensor:
    """[M / world, N]: this rank's rows of ``sum over ranks (a2d @ weight + bias)`` (divided by world for "avg")."""
    ws = workspace(group_name, a2d.device)
    m, _ = a2d.shape
    n, dtype, world = weight.shape[1], a2d.dtype, ws.world
    rows = m // world
    nbytes = rows * n * a2d.element_size()
    slot_bytes = _round_up(nbytes)
    plan = ws.rs_plan
    epoch, parity, stream = _start(ws, plan.slots * slot_bytes)
    ext, elements = loader.extension(), slot_bytes // a2d.element_size()

    def slot(index: int) -> Tensor:
        return ws.slots(parity, index, 1, slot_bytes, rows, n, dtype)[0]

    def reduce(first: int, count: int, own: int, out: Tensor, scale: float) -> None:
        ext.reduce_arrivals(_DTYPE_CODES[dtype], rows, n, count, own, ws.slot_address(parity, first, slot_bytes),
                            elements, ws.flag_address(parity, first), epoch, out.data_ptr(), scale, ws.error.device,
                            symm.timeout_ns(), stream.cuda_stream)

    for step in plan.steps:
        if isinstance(step, Partial):
            a_rows = a2d[step.owner * rows:(step.owner + 1) * rows]
            out = slot(step.here)
            torch.mm(a_rows, weight, out=out) if bias is None else torch.addmm(bias, a_rows, weight, out=out)
        else:  # the sum of this node's partials of a peer's rows, one chunk across
            reduce(step.first, step.count, step.own, slot(step.here), 1.0)
        if step.peer is not None:
            ws.comm.wait_stream(stream)
            ws.send(parity, step.peer, ws.slot_address(parity, step.there, slot_bytes),
                    ws.slot_address(parity, step.here, slot_bytes), nbytes, flag=step.there)
    out = torch.empty((rows, n), dtype=dtype, device=a2d.device)
    reduce(0, plan.final, plan.own, out, (1.0 / world) if reduce_op == "avg" else 1.0)
    return out
