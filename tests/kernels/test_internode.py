"""The inter-node path's decisions, on any machine: the order each rank sends in, the nodes the peer check finds,
and when the dispatcher takes the path (fluxinductor/kernels/internode.py, fluxinductor/dispatch.py).  The GPU side
(NVSHMEM puts, the kernels) is tests/gpu/test_internode_gpu.py."""

from __future__ import annotations

import pytest
import torch

from fluxinductor import dispatch, settings
from fluxinductor.kernels import internode, peers
from _dist import run_ranks

Identity = peers.Identity


def test_send_order_node_local_first_or_last():
    nodes = [0, 0, 1, 1]
    assert internode.send_order(0, nodes, remote_first=False) == [1, 2, 3]
    assert internode.send_order(0, nodes, remote_first=True) == [2, 3, 1]
    assert internode.send_order(3, nodes, remote_first=False) == [2, 0, 1]
    assert internode.send_order(3, nodes, remote_first=True) == [0, 1, 2]
    # every GPU its own node: the ring from the next rank
    assert internode.send_order(1, [0, 1, 2], remote_first=True) == [2, 0]
    assert internode.send_order(0, [0], remote_first=True) == []


def _nodes_on_two_ranks(rank, world):
    import torch.distributed as dist

    cpu = torch.device("cpu")
    linked = lambda a, b: (True, "test")  # noqa: E731
    out = {}
    group = dist.new_group([0, 1])
    out["before"] = peers.nodes(group.group_name, cpu)
    peers.group_reason(group.group_name, cpu, identify=lambda d: Identity(f"node{rank}/b{rank}", "0000:00:00.0"),
                       nvlink=linked)
    out["two hosts"] = peers.nodes(group.group_name, cpu)
    one = dist.new_group([0, 1])
    peers.group_reason(one.group_name, cpu, identify=lambda d: Identity("h/b", f"0000:0{rank}:00.0"), nvlink=linked)
    out["one host"] = peers.nodes(one.group_name, cpu)
    with settings.override(emulate_nodes=1):
        out["emulated"] = peers.nodes(one.group_name, cpu)
    return out


def test_nodes_come_from_the_peer_check():
    r0, r1 = run_ranks(_nodes_on_two_ranks, 2, timeout=120)
    assert r0 == r1
    assert r0 == {"before": None, "two hosts": [0, 1], "one host": [0, 0], "emulated": [0, 1]}


@pytest.fixture
def spans(monkeypatch):
    """dispatch._internode_plan with the nodes, the local check and NVSHMEM's answer injected."""

    def setup(nodes, local=None, backend=None):
        monkeypatch.setattr(peers, "nodes", lambda group_name, device: nodes)
        monkeypatch.setattr(dispatch, "_local_reason", lambda index: local)
        monkeypatch.setattr(internode, "backend_reason", lambda device: backend)
        return lambda why_not=None: dispatch._internode_plan(torch.device("cpu"), "g", lambda: why_not)

    return setup


def test_dispatcher_takes_the_path_only_across_nodes(spans):
    assert spans([0, 0])() is None  # one node: the NVLink kernels' business
    assert spans(None)() is None  # the peer check has not run (or a rank could not identify itself)
    assert spans([0, 1])() == ("internode", None)
    assert spans([0, 0, 1, 1])() == ("internode", None)


def test_dispatcher_says_why_it_decomposes_across_nodes(spans):
    assert spans([0, 1], local="fluxinductor._C is not built")() == (
        "decomposed", "inter-node path: fluxinductor._C is not built")
    plan = spans([0, 1], backend="this PyTorch build has no NVSHMEM")()
    assert plan == ("decomposed", "inter-node path: this PyTorch build has no NVSHMEM")
    assert spans([0, 1])("an torch.float32 output") == ("decomposed", "inter-node path: an torch.float32 output")


def test_operand_reasons():
    a = torch.zeros(4, 8, dtype=torch.bfloat16)
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert internode.operand_reason(a, [w], [None]) is None
    assert "bf16 and fp16" in internode.operand_reason(a.float(), [w.float()], [None])
    assert "different dtypes" in internode.operand_reason(a, [w.half()], [None])


def test_auto_dispatch_measures_the_path_against_the_sequential_one(monkeypatch):
    from fluxinductor import calibration

    asked = []

    def choose(op, device, group_name, world, m, k, n, dtype, candidates):
        asked.append((op, m, k, n, tuple(candidates)))
        return verdict, "measured"

    monkeypatch.setattr(calibration, "choose_measured", choose)
    def call():
        return dispatch._internode_measured("all_gather_matmul", torch.device("cpu"), "g", 2, 4098, 12288, 49152,
                                            torch.bfloat16, lambda: None, lambda: None)
    with settings.override(dispatch="auto"):
        verdict = "internode"
        assert call() == ("internode", None)
        verdict = "sequential"
        assert call() == ("decomposed", "inter-node path: calibration chose sequential, measured")
        with settings.override(calibrate=False):
            assert call() == ("internode", None)
    with settings.override(dispatch="fused"):
        assert call() == ("internode", None)
    assert asked == [("internode_all_gather_matmul", 4098, 12288, 49152, ("sequential", "internode"))] * 2


def test_rail_peers():
    assert internode.rail_peers(0, [0, 0, 1, 1]) == [2]
    assert internode.rail_peers(3, [0, 0, 1, 1]) == [1]
    assert internode.rail_peers(1, [0, 0, 1, 1, 2, 2]) == [3, 5]
    assert internode.rail_peers(4, [0, 0, 1, 1, 2, 2]) == [0, 2]  # nearest node first, around the ring
    assert internode.rail_peers(0, [0, 1]) is None  # one GPU a node: nothing to forward
    assert internode.rail_peers(0, [0, 0, 0, 1]) is None  # nodes of different sizes: a put to every peer
    assert internode.rail_peers(0, [0, 0]) is None


def _simulate(nodes):
    """Every rank's plan run on numbers: partial (r, q) is 1000 r + q; every put lands, flags counted.  Returns what
    each rank's final reduction sums, and the puts that cross between nodes."""
    world = len(nodes)
    plans = [internode.reduce_scatter_plan(r, nodes) for r in range(world)]
    memory = [dict() for _ in range(world)]
    raised = [set() for _ in range(world)]
    crossing = 0

    def run(kind):
        nonlocal crossing
        for r, plan in enumerate(plans):
            for step in plan.steps:
                if not isinstance(step, kind):
                    continue
                if isinstance(step, internode.Partial):
                    memory[r][step.here] = 1000 * r + step.owner
                else:
                    slots = range(step.first, step.first + step.count)
                    assert all(s in raised[r] for s in slots if s != step.first + step.own), (r, step)
                    memory[r][step.here] = sum(memory[r][s] for s in slots)
                if step.peer is not None:
                    assert step.there < plans[step.peer].flags
                    memory[step.peer][step.there] = memory[r][step.here]
                    raised[step.peer].add(step.there)
                    crossing += nodes[step.peer] != nodes[r]

    run(internode.Partial)  # every partial before any sum: the sums wait for them (flags), as on the device
    run(internode.Aggregate)
    finals = []
    for r, plan in enumerate(plans):
        assert all(s in raised[r] for s in range(plan.final) if s != plan.own)
        assert max(list(memory[r]) + [0]) < plan.slots
        finals.append(sum(memory[r][s] for s in range(plan.final)))
    return finals, crossing


@pytest.mark.parametrize("nodes", [[0, 1], [0, 1, 2, 3], [0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 2, 2],
                                   [0, 0, 0, 1], [5, 5, 2, 2]])
def test_reduce_scatter_plan_sums_every_partial_once(nodes):
    world = len(nodes)
    finals, crossing = _simulate(nodes)
    assert finals == [sum(1000 * r + q for r in range(world)) for q in range(world)]
    groups = len(set(nodes))
    if internode.rail_peers(0, nodes) is not None:  # one sum per (rank, other node) crosses
        assert crossing == world * (groups - 1)
    else:
        assert crossing == sum(nodes[r] != nodes[q] for r in range(world) for q in range(world))
