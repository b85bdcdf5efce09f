"""The peer check: a group runs the fused kernels only when its GPUs are on one host and joined by NVLink, every
rank reaches the same verdict, and the dispatcher runs the decomposition (with the reason logged) otherwise.

The identities and NVML's answers are injected here; ``tests/gpu/test_peers_gpu.py`` asks the real NVML about a real
GPU and the two-rank GPU scripts check the verdict on the 2xH200 machine.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from fluxinductor import dispatch, settings
from fluxinductor.kernels import peers, symm
from _dist import run_ranks

Identity = peers.Identity


def _linked(pairs_without_nvlink=(), unknown=()):
    asked = []

    def query(a, b):
        asked.append((a, b))
        if (a, b) in unknown:
            return None, "NVML does not see the GPU"
        return (a, b) not in pairs_without_nvlink, "test"

    return query, asked


def test_one_host_all_pairs_linked():
    ids = [Identity("h/boot", f"0000:{i:02x}:00.0") for i in range(4)]
    query, asked = _linked()
    assert peers.judge(ids, query) is None
    assert len(asked) == 6  # every pair once


def test_objections_name_what_is_wrong():
    a, b, c = (Identity("h/boot", f"0000:{i:02x}:00.0") for i in range(3))
    query, _ = _linked()
    assert "spans 2 hosts (h, other)" in peers.judge([a, Identity("other/boot", a.bus_id)], query)
    # same name, another boot: another machine (or the same one rebooted under a stale rendezvous)
    assert "spans 2 hosts" in peers.judge([a, Identity("h/boot2", b.bus_id)], query)
    assert "ranks 0 and 2 share the GPU at 0000:00:00.0" in peers.judge([a, b, a], query)
    assert "rank 1 could not identify its GPU" in peers.judge([a, None, c], query)
    query, _ = _linked(pairs_without_nvlink={(b.bus_id, c.bus_id)})
    assert "ranks 1 and 2 (0000:01:00.0, 0000:02:00.0) are not joined by NVLink" in peers.judge([a, b, c], query)
    query, _ = _linked(unknown={(a.bus_id, c.bus_id)})
    assert "cannot tell whether ranks 0 and 2 are joined by NVLink: NVML does not see" in peers.judge([a, b, c], query)


def _verdicts_on_two_ranks(rank, world):
    """Each scenario on a fresh group of both ranks (the verdict is remembered per group)."""
    import torch.distributed as dist

    from fluxinductor.kernels import peers

    host = "h/boot"
    cpu = torch.device("cpu")
    out = {}

    def ask(identify, nvlink=lambda a, b: (True, "test"), local_reason=None):
        group = dist.new_group([0, 1])
        return peers.group_reason(group.group_name, cpu, identify=identify, nvlink=nvlink, local_reason=local_reason)

    out["ok"] = ask(lambda d: Identity(host, f"0000:0{rank}:00.0"))
    out["hosts"] = ask(lambda d: Identity(f"node{rank}/boot{rank}", "0000:00:00.0"))
    out["shared"] = ask(lambda d: Identity(host, "0000:07:00.0"))
    out["pcie"] = ask(lambda d: Identity(host, f"0000:0{rank}:00.0"), lambda a, b: (False, "status 5"))
    # rank 1's NVML cannot see rank 0's GPU; rank 0's can: both must decompose, or rank 0 would wait on flags forever
    out["disagree"] = ask(lambda d: Identity(host, f"0000:0{rank}:00.0"),
                          lambda a, b: (True, "test") if rank == 0 else (None, "NVML does not see the GPU"))

    # rank 1 has no fused kernels (say, an install without the extension): the whole group decomposes
    out["local"] = ask(lambda d: Identity(host, f"0000:0{rank}:00.0"),
                       local_reason="fluxinductor._C is not built" if rank == 1 else None)

    def identify_fails(d):
        if rank == 0:
            raise RuntimeError("no PCI bus id")
        return Identity(host, "0000:01:00.0")

    out["raises"] = ask(identify_fails)
    # remembered: the second call for a group makes no collective and does not identify again
    group = dist.new_group([0, 1])
    calls = []

    def counting(d):
        calls.append(d)
        return Identity(host, f"0000:0{rank}:00.0")

    linked = lambda a, b: (True, "test")  # noqa: E731
    first = peers.group_reason(group.group_name, cpu, identify=counting, nvlink=linked)
    second = peers.group_reason(group.group_name, cpu, identify=counting, nvlink=linked)
    out["remembered"] = (first, second, len(calls))
    alone = dist.new_group([0])  # every rank creates every group
    out["self"] = peers.group_reason(alone.group_name, cpu, identify=counting) if rank == 0 else None
    # a group re-created under the same name is checked afresh (the old verdict belonged to another group object)
    peers._verdicts[(group.group_name, -1)] = (object(), "a stale verdict")
    out["recreated"] = (peers.group_reason(group.group_name, cpu, identify=counting, nvlink=linked), len(calls))
    # only rank 0 asks (rank 1 decomposes, say): rank 0 gets an error naming rank 1 instead of waiting forever
    lonely = dist.new_group([0, 1])
    try:
        with settings.override(peer_check_timeout_s=2):
            peers.group_reason(lonely.group_name, cpu, identify=counting, nvlink=linked) if rank == 0 else None
        out["lonely"] = None
    except peers.PeerCheckError as e:
        out["lonely"] = str(e)
    # the real NVML query: on a CPU machine the library is missing; on a GPU machine it finds no GPU at these bus ids
    out["no_nvml"] = peers.group_reason(dist.new_group([0, 1]).group_name, cpu,
                                        identify=lambda d: Identity(host, f"0000:0{rank}:00.0"))
    # FLUXINDUCTOR_ASSUME_NVLINK=1 vouches for the links where NVML cannot answer, and only for the links
    with settings.override(assume_nvlink=True):
        out["assumed"] = ask(lambda d: Identity(host, f"0000:0{rank}:00.0"), lambda a, b: (None, "no NVML"))
        out["assumed_pcie"] = ask(lambda d: Identity(host, f"0000:0{rank}:00.0"), lambda a, b: (False, "status 5"))
        out["assumed_shared"] = ask(lambda d: Identity(host, "0000:07:00.0"))
        out["assumed_hosts"] = ask(lambda d: Identity(f"node{rank}/boot{rank}", "0000:00:00.0"))
    return out


def test_group_verdict_is_the_same_on_every_rank():
    r0, r1 = run_ranks(_verdicts_on_two_ranks, 2, timeout=180)
    lonely = r0.pop("lonely")
    assert "group" in lonely and "rank(s) [1] did not reach the fused kernels' peer check within 2 s" in lonely
    assert r1.pop("lonely") is None
    assert r0 == r1
    assert r0["ok"] is None
    assert "the group spans 2 hosts (node0, node1)" in r0["hosts"]
    assert "ranks 0 and 1 share the GPU at 0000:07:00.0" in r0["shared"]
    assert "ranks 0 and 1 (0000:00:00.0, 0000:01:00.0) are not joined by NVLink (status 5)" in r0["pcie"]
    assert r0["disagree"].startswith("rank 1 objects: cannot tell whether ranks 0 and 1 are joined by NVLink")
    assert r0["local"] == "rank 1 objects: fluxinductor._C is not built"
    assert r0["raises"].startswith("rank 0 objects: could not identify its GPU (RuntimeError: no PCI bus id)")
    assert r0["remembered"] == (None, None, 1)
    assert r0["recreated"] == (None, 2)  # identified again
    assert r0["self"] is None  # a one-rank group has no peers to check
    assert "cannot tell whether ranks 0 and 1 are joined by NVLink" in r0["no_nvml"]
    assert r0["assumed"] is None and r0["assumed_pcie"] is None  # NVML is not asked
    assert "ranks 0 and 1 share the GPU" in r0["assumed_shared"] and "spans 2 hosts" in r0["assumed_hosts"]


@pytest.fixture
def fake_kernels(flux_settings, monkeypatch):
    """Kernel modules that would run (unsupported_reason None) and record the call if they did."""
    ran = []
    module = types.SimpleNamespace(
        unsupported_reason=lambda *args: None,
        split_reason=lambda *args: None,
        all_gather_matmul=lambda *args, **kw: ran.append("ag"),
        matmul_reduce_scatter=lambda *args, **kw: ran.append("rs"),
    )
    monkeypatch.setattr(dispatch, "_kernels_for", lambda op, operand: module)
    monkeypatch.setattr(dispatch, "_world_size", lambda group_name: 2)
    flux_settings(dispatch="fused")
    return ran


def test_dispatcher_decomposes_when_the_peers_object(fake_kernels, monkeypatch, caplog):
    reason = "the group spans 2 hosts (node0, node1); the fused kernels reach peers over NVLink within one host"
    monkeypatch.setattr(dispatch, "_peers_reason", lambda group_name, device: reason)
    from fluxinductor import log

    log.reset_rewrite_stats()
    with caplog.at_level(logging.INFO, logger="fluxinductor"):
        assert dispatch.all_gather_matmul(torch.randn(4, 8), [torch.randn(8, 6)], [None], 0, "g", False) is None
        assert dispatch.matmul_reduce_scatter(torch.randn(8, 4), torch.randn(4, 6), None, "sum", 0, "g") is None
    assert fake_kernels == []
    fallbacks = log.rewrite_stats()["fallbacks"]
    assert fallbacks == {"all_gather_matmul": {reason: 1}, "matmul_reduce_scatter": {reason: 1}}
    assert f"all_gather_matmul runs decomposed: {reason}" in caplog.text


def test_dispatcher_asks_before_the_call_checks(fake_kernels, monkeypatch):
    """Whether a rank joins the check's collective must not depend on anything its peers might see differently."""
    asked = []
    monkeypatch.setattr(dispatch, "_peers_reason", lambda group_name, device: asked.append(group_name))
    monkeypatch.setattr(dispatch, "_kernels_for", lambda op, operand: types.SimpleNamespace(
        unsupported_reason=lambda *args: "a shape the kernel does not take"))
    assert dispatch.matmul_reduce_scatter(torch.randn(8, 4), torch.randn(4, 6), None, "sum", 0, "g") is None
    assert dispatch.all_gather_matmul(torch.randn(4, 8), [torch.randn(8, 6)], [None], 0, "g", False) is None
    assert asked == ["g", "g"]


def test_no_check_while_capturing_a_cuda_graph(monkeypatch):
    """A capture takes no collective step: under capture the dispatcher only uses an answer an eager call got, and
    without one the call decomposes (an eager call of the group before the capture asks)."""
    monkeypatch.setattr(symm, "capturing", lambda: True)
    monkeypatch.setattr(peers, "group_reason", lambda *args, **kw: pytest.fail("checked during capture"))
    remembered = {}
    monkeypatch.setattr(peers, "remembered_group_reason", lambda group, device: remembered[group])
    remembered.update(ok=(True, None), pcie=(True, "no NVLink"), new=(False, None))
    device = torch.device("cuda", 0)
    assert dispatch._peers_reason("ok", device) is None
    assert dispatch._peers_reason("pcie", device) == "no NVLink"
    assert "before an eager call checked" in dispatch._peers_reason("new", device)


class _FakeNvml:
    """NVML's calls that :func:`peers.nvml_nvlink_peers` makes, over a host of GPUs given by bus id, with the pairs
    joined by NVLink (ctypes arguments written through ``byref(x)._obj``, as the C library writes them)."""

    def __init__(self, buses, linked, failing_pair=None):
        self.buses, self.linked, self.failing_pair = list(buses), set(linked), failing_pair

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.buses)
        return 0

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus, handle):
        if bus.value.decode() not in self.buses:
            return 6  # NVML_ERROR_NOT_FOUND
        handle._obj.value = 1000 + self.buses.index(bus.value.decode())
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = 1000 + index
        return 0

    def nvmlDeviceGetP2PStatus(self, a, b, caps, status):
        pair = frozenset((a.value - 1000, b.value - 1000))
        if pair == self.failing_pair:
            return 3  # NVML_ERROR_NOT_SUPPORTED
        status._obj.value = 0 if pair in self.linked else 4
        return 0


@pytest.mark.parametrize("linked, expected", [
    ({frozenset((0, 1)), frozenset((0, 2))}, 2),
    ({frozenset((1, 2))}, 0),
    (set(), 0),
])
def test_nvlink_peers_counted_from_the_p2p_status(monkeypatch, linked, expected):
    buses = ["0000:1b:00.0", "0000:2c:00.0", "0000:3d:00.0"]
    monkeypatch.setattr(peers, "_load_nvml", lambda: (_FakeNvml(buses, linked), None))
    count, detail = peers.nvml_nvlink_peers(buses[0])
    assert count == expected, detail
    assert peers.nvml_nvlink_peers("0000:ff:00.0")[0] is None  # a GPU NVML does not see: no answer
    monkeypatch.setattr(peers, "_load_nvml", lambda: (_FakeNvml(buses, linked, frozenset((0, 2))), None))
    assert peers.nvml_nvlink_peers(buses[0])[0] is None  # a pair NVML cannot answer for: no answer


def test_local_nvlink_reason_vetoes_only_a_gpu_without_nvlink_peers(monkeypatch, flux_settings):
    monkeypatch.setattr(peers, "identity", lambda device: peers.Identity("host", "0000:1b:00.0"))
    cuda = torch.device("cuda", 0)
    for answer, vetoed in (((0, "none"), True), ((1, "one"), False), ((None, "no NVML"), False)):
        monkeypatch.setattr(peers, "nvml_nvlink_peers", lambda bus, answer=answer: answer)
        assert (peers.local_nvlink_reason(cuda) is not None) == vetoed, answer
    monkeypatch.setattr(peers, "nvml_nvlink_peers", lambda bus: (0, "none"))
    flux_settings(assume_nvlink=True)
    assert peers.local_nvlink_reason(cuda) is None
