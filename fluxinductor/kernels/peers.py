"""Whether a process group's GPUs can reach each other the way the fused kernels need.

The kernels read and write peers' memory through symmetric-memory mappings (copy-engine pulls, NVLink stores,
flags), so every rank of the group must be on this host and every pair of their GPUs joined by NVLink.  A group
that spans hosts (the CUDA symmetric-memory rendezvous cannot map a remote GPU), puts two ranks on one GPU, or
joins GPUs over PCIe only runs the decomposition instead, and the reason is logged.

The check runs once per (group, device), on the first call that could run a fused kernel, and exchanges its data
through the group's c10d store (no collective on the group, so it cannot be mismatched with one of the model's):

1. each rank posts (host name and boot id, the PCI bus id of its GPU) and reads everyone's;
2. each rank judges the group from that list: one host, distinct GPUs, and NVML (``libnvidia-ml``, which sees
   every GPU of the host whatever ``CUDA_VISIBLE_DEVICES`` says) reporting NVLink between every pair;
3. the ranks post their verdicts and all take the first objection, in rank order.  Step 3 keeps the ranks in
   agreement where their views differ (say, one container whose NVML cannot see a peer's GPU): a rank that runs
   the fused kernel while its peer decomposes would wait for flags that never come.

Where NVML cannot answer (a container started without the driver's utility libraries has no ``libnvidia-ml``), the
group decomposes; ``FLUXINDUCTOR_ASSUME_NVLINK=1`` vouches for the links instead (the one-host and one-GPU-per-rank
checks still run).

A rank that does not post within ``settings.tuning.peer_check_timeout_s`` (default 600 s: a peer may still be
compiling) makes the check raise :class:`PeerCheckError` naming it: the ranks disagree on whether to take the fused
path (``FLUXINDUCTOR_DISPATCH`` or the extension differs between them), and going on would hang.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import socket
import threading
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from fluxinductor import settings
from fluxinductor.log import logger


class Identity(NamedTuple):
    host: str      # host name and boot id: two containers of one host share the boot id, not the name
    bus_id: str    # the GPU's PCI bus id, "0000:18:00.0"


def identity(device: torch.device) -> Identity:
    """This process's host and the PCI bus id of ``device``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    props = torch.cuda.get_device_properties(device)
    bus_id = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    return Identity(f"{socket.gethostname()}/{boot}", bus_id)


# ---------------------------------------------------------------------------------------------------
# NVML through ctypes: the driver ships libnvidia-ml.so.1; pynvml is not a dependency.
# ---------------------------------------------------------------------------------------------------

_NVML_SUCCESS = 0
_NVML_P2P_CAPS_INDEX_NVLINK = 2  # nvmlGpuP2PCapsIndex_t
_NVML_P2P_STATUS_OK = 0          # nvmlGpuP2PStatus_t

_nvml: Optional[ctypes.CDLL] = None
_nvml_reason: Optional[str] = None
_nvml_lock = threading.Lock()


def _load_nvml() -> Tuple[Optional[ctypes.CDLL], Optional[str]]:
    """(library, None) once ``nvmlInit_v2`` succeeded, else (None, why); tried once per process."""
    global _nvml, _nvml_reason
    with _nvml_lock:
        if _nvml is None and _nvml_reason is None:
            try:
                lib = ctypes.CDLL("libnvidia-ml.so.1")
                rc = lib.nvmlInit_v2()
                if rc != _NVML_SUCCESS:
                    _nvml_reason = f"nvmlInit_v2 returned {rc}"
                else:
                    _nvml = lib
            except (OSError, AttributeError) as e:
                _nvml_reason = f"libnvidia-ml.so.1 does not load ({e})"
        return _nvml, _nvml_reason


def _nvml_handle(lib: ctypes.CDLL, bus: str) -> Tuple[Optional[ctypes.c_void_p], str]:
    """(NVML's handle of the GPU at PCI bus id ``bus``, "") or (None, why)."""
    handle = ctypes.c_void_p()
    rc = lib.nvmlDeviceGetHandleByPciBusId_v2(ctypes.c_char_p(bus.encode()), ctypes.byref(handle))
    if rc != _NVML_SUCCESS:
        return None, f"NVML does not see the GPU at {bus} (error {rc})"
    return handle, ""


def nvml_nvlink(bus_a: str, bus_b: str) -> Tuple[Optional[bool], str]:
    """(True | False, detail) whether NVML reports NVLink peer access between two GPUs of this host given by PCI
    bus id; (None, why) when NVML cannot answer."""
    lib, why = _load_nvml()
    if lib is None:
        return None, why
    handles = []
    for bus in (bus_a, bus_b):
        handle, why = _nvml_handle(lib, bus)
        if handle is None:
            return None, why
        handles.append(handle)
    status = ctypes.c_int(-1)
    rc = lib.nvmlDeviceGetP2PStatus(handles[0], handles[1], _NVML_P2P_CAPS_INDEX_NVLINK, ctypes.byref(status))
    if rc != _NVML_SUCCESS:
        return None, f"nvmlDeviceGetP2PStatus({bus_a}, {bus_b}) returned error {rc}"
    return status.value == _NVML_P2P_STATUS_OK, f"NVML NVLink P2P status {status.value}"


def nvml_nvlink_peers(bus: str) -> Tuple[Optional[int], str]:
    """(how many other GPUs of this host NVML reports as NVLink peers of the GPU at PCI bus id ``bus``, detail), by the
    P2P status :func:`nvml_nvlink` asks; (None, why) when NVML cannot answer for some pair."""
    lib, why = _load_nvml()
    if lib is None:
        return None, why
    count = ctypes.c_uint(0)
    rc = lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
    if rc != _NVML_SUCCESS:
        return None, f"nvmlDeviceGetCount_v2 returned error {rc}"
    own, why = _nvml_handle(lib, bus)
    if own is None:
        return None, why
    peers = 0
    for index in range(count.value):
        other = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(other)) != _NVML_SUCCESS:
            return None, f"NVML has no handle for GPU {index}"
        if other.value == own.value:
            continue
        status = ctypes.c_int(-1)
        rc = lib.nvmlDeviceGetP2PStatus(own, other, _NVML_P2P_CAPS_INDEX_NVLINK, ctypes.byref(status))
        if rc != _NVML_SUCCESS:
            return None, f"nvmlDeviceGetP2PStatus({bus}, GPU {index}) returned error {rc}"
        peers += status.value == _NVML_P2P_STATUS_OK
    return peers, f"NVLink peers of {bus}: {peers} of {count.value - 1} other GPUs"


def local_nvlink_reason(device: torch.device) -> Optional[str]:
    """Why no group of ``device`` could be NVLink peers, known without asking the peers (at compile time): NVML
    reports no other GPU of this host as its NVLink peer (the P2P status the group's check on its first call asks).
    None where it has one, where NVML cannot tell (that check still decides) and under
    ``FLUXINDUCTOR_ASSUME_NVLINK=1``."""
    if assume_nvlink():
        return None
    try:
        bus = identity(device).bus_id
    except Exception:  # noqa: BLE001 - no device properties: the run-time check decides
        return None
    peers, detail = nvml_nvlink_peers(bus)
    if peers == 0:
        return f"cuda:{device.index} has no NVLink peer on this host ({detail}), so its group cannot run the fused kernels"
    return None


# ---------------------------------------------------------------------------------------------------
# The verdict.
# ---------------------------------------------------------------------------------------------------

NvlinkQuery = Callable[[str, str], Tuple[Optional[bool], str]]


def judge(identities: Sequence[Optional[Identity]], nvlink: NvlinkQuery = nvml_nvlink) -> Optional[str]:
    """None if ranks with these identities (in rank order) can run the fused kernels together, else why not.

    ``nvlink(bus_a, bus_b)`` answers for one pair as :func:`nvml_nvlink` does.
    """
    if any(i is None for i in identities):
        missing = ", ".join(str(r) for r, i in enumerate(identities) if i is None)
        return f"rank {missing} could not identify its GPU"
    hosts = {i.host for i in identities}
    if len(hosts) > 1:
        names = ", ".join(sorted({h.split("/")[0] for h in hosts}))
        return (f"the group spans {len(hosts)} hosts ({names}); the fused kernels reach peers over NVLink within one "
                "host")
    seen: Dict[str, int] = {}
    for rank, ident in enumerate(identities):
        if ident.bus_id in seen:
            return f"ranks {seen[ident.bus_id]} and {rank} share the GPU at {ident.bus_id}"
        seen[ident.bus_id] = rank
    for a in range(len(identities)):
        for b in range(a + 1, len(identities)):
            linked, detail = nvlink(identities[a].bus_id, identities[b].bus_id)
            if linked is None:
                return f"cannot tell whether ranks {a} and {b} are joined by NVLink: {detail}"
            if not linked:
                return (f"ranks {a} and {b} ({identities[a].bus_id}, {identities[b].bus_id}) are not joined by NVLink "
                        f"({detail})")
    return None


class PeerCheckError(RuntimeError):
    """Some rank of the group did not reach the peer check in time."""


def assume_nvlink() -> bool:
    """``FLUXINDUCTOR_ASSUME_NVLINK=1``: take every pair of the group's GPUs as NVLink peers without asking NVML."""
    return settings.current.assume_nvlink


def _assumed_nvlink(bus_a: str, bus_b: str) -> Tuple[Optional[bool], str]:
    return True, "assumed (FLUXINDUCTOR_ASSUME_NVLINK=1)"


def timeout_seconds() -> float:
    """How long a rank waits for its peers at the group's check (``settings.tuning.peer_check_timeout_s``)."""
    return settings.tuning.peer_check_timeout_s


def _store(group):
    from torch.distributed import distributed_c10d as c10d

    get = getattr(c10d, "_get_process_group_store", None)
    return get(group) if get is not None else c10d._world.pg_map[group][1]


def _exchange(store, key: str, value, rank: int, world: int, group_name: str):
    """Post ``value`` (JSON) as this rank's ``key`` and return every rank's, in rank order."""
    store.set(f"{key}/{rank}", json.dumps(value))
    keys = [f"{key}/{q}" for q in range(world)]
    timeout = timeout_seconds()
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 - the store's timeout error type differs between torch versions
        missing = [q for q in range(world) if not store.check([keys[q]])]
        raise PeerCheckError(
            f"group {group_name}: rank(s) {missing or '?'} did not reach the fused kernels' peer check within "
            f"{timeout:g} s (settings.tuning.peer_check_timeout_s); do all ranks run with the same "
            "FLUXINDUCTOR_DISPATCH "
            f"and the extension built? ({type(e).__name__}: {e})") from e
    return [json.loads(store.get(k)) for k in keys]


# (group name, device index) -> (the group object checked, verdict); the object tells a group re-created under the same
# name (after destroy_process_group) from the one checked.
_verdicts: Dict[Tuple[str, int], Tuple[object, Optional[str]]] = {}
# checks made per group name in this process: part of the store keys, so a re-created group is checked afresh
_rounds: Dict[str, int] = {}
_hosts: Dict[Tuple[str, int], List[Optional[str]]] = {}  # the host of each rank, per (group, device)


def remembered_group_reason(group_name: str, device: torch.device) -> Tuple[bool, Optional[str]]:
    """(True, :func:`group_reason`'s answer) where a call already asked it for this group and device, else (False,
    None); never collective."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    known = _verdicts.get((group_name, -1 if device.index is None else device.index))
    if known is not None and known[0] is group:
        return True, known[1]
    if group.size() == 1:
        return True, None
    return False, None


def nodes(group_name: str, device: torch.device) -> Optional[List[int]]:
    """The node of each rank of the group (ranks of one host share a number, in order of first appearance), as the
    peer check saw them; under ``settings.tuning.emulate_nodes`` = g, ranks in consecutive groups of g; None before
    the group's first :func:`group_reason` (or where a rank could not identify itself, or the group is unknown).
    Never collective."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(group_name)
    except Exception:  # noqa: BLE001 - an unknown group has no nodes to report
        return None
    if settings.tuning.emulate_nodes:
        return [q // settings.tuning.emulate_nodes for q in range(group.size())]
    if group.size() == 1:
        return [0]
    hosts = _hosts.get((group_name, -1 if device.index is None else device.index))
    if hosts is None or any(h is None for h in hosts):
        return None
    numbers: Dict[str, int] = {}
    return [numbers.setdefault(h, len(numbers)) for h in hosts]


def group_reason(group_name: str, device: torch.device, *,
                 identify: Callable[[torch.device], Identity] = identity,
                 nvlink: NvlinkQuery = nvml_nvlink, local_reason: Optional[str] = None) -> Optional[str]:
    """None if the GPUs of ``group_name`` can run the fused kernels together, else why not (the same answer on every
    rank).  The first call for (group, device) waits for every rank of the group to make it too; the answer is
    remembered after that.  ``nvlink`` is not asked under ``FLUXINDUCTOR_ASSUME_NVLINK=1``.  ``local_reason``: why
    this rank cannot run the fused kernels at all (no extension, not a Hopper GPU), its objection for the whole group:
    with one rank decomposing, its peers' kernels would wait for it."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    key = (group_name, -1 if device.index is None else device.index)
    known = _verdicts.get(key)
    if known is not None and known[0] is group:
        return known[1]
    if group.size() == 1:
        verdict = None
    else:
        rounds = _rounds.get(group_name, 0)
        _rounds[group_name] = rounds + 1
        prefix = f"fluxinductor/peers/{group_name}/{rounds}"
        store, rank, world = _store(group), group.rank(), group.size()
        # Nothing this rank does between the two posts may raise: its peers would wait for its verdict in vain.
        try:
            ident: Optional[list] = list(identify(device))
            failure = None
        except Exception as e:  # noqa: BLE001
            ident, failure = None, f"could not identify its GPU ({type(e).__name__}: {e})"
        identities = [None if i is None else Identity(*i) for i in _exchange(store, f"{prefix}/id", ident, rank, world,
                                                                               group_name)]
        if assume_nvlink():
            nvlink = _assumed_nvlink
        try:
            mine = failure or local_reason or judge(identities, nvlink)
        except Exception as e:  # noqa: BLE001
            mine = f"the peer check failed ({type(e).__name__}: {e})"
        _hosts[key] = [None if i is None else i.host for i in identities]
        verdicts = _exchange(store, f"{prefix}/verdict", mine, rank, world, group_name)
        objections = [(r, v) for r, v in enumerate(verdicts) if v is not None]
        if not objections:
            verdict = None
        elif len(set(verdicts)) == 1:
            verdict = objections[0][1]
        else:  # the ranks saw the group differently: all take the first objection, naming its rank
            verdict = f"rank {objections[0][0]} objects: {objections[0][1]}"
        logger.info("group %s: %s", group_name, "peers joined by NVLink on one host" if verdict is None else verdict)
    _verdicts[key] = (group, verdict)
    return verdict
