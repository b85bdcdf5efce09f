"""The dispatcher decides a call signature once: later calls of the signature run what the first one chose without
asking the group, the kernel module or the cost model again, and anything the decision depends on makes a new
signature (kernel module, group verdict and cost model replaced by counting fakes; the real ones need Hopper GPUs)."""

from __future__ import annotations

import os
import types

import pytest
import torch

from fluxinductor import cost_model, dispatch, log
from fluxinductor.kernels import symm


@pytest.fixture
def counted(flux_settings, monkeypatch):
    """Fakes that count what the dispatcher asks; ``counted.choice`` is what the cost model says."""
    counts = types.SimpleNamespace(peers=0, checks=0, cost=0, runs=[], choice="fused_copy")

    def unsupported_reason(*args):
        counts.checks += 1
        return None

    def matmul_reduce_scatter(a2d, weight, bias, reduce_op, group_name, *, checked=False, transport="store",
                              split_config_choice=None):
        counts.runs.append(transport)
        return (a2d @ weight)[: a2d.shape[0] // 2]

    def all_gather_matmul(shard2d, weights, biases, group_name, return_gathered, *, checked=False):
        counts.runs.append("ag")
        full = torch.cat([shard2d, shard2d])
        return [full @ w for w in weights], full if return_gathered else shard2d.new_empty(0)

    def peers_reason(group_name, device):
        counts.peers += 1
        return None

    def says(op, device, world, m, k, n, dtype, fused_eligible=True, split_eligible=True, **_):
        counts.cost += 1
        return counts.choice, f"cost model chose {counts.choice}: test"

    module = types.SimpleNamespace(unsupported_reason=unsupported_reason, split_reason=lambda *args: None,
                                   split_configs=lambda dtype: (),
                                   matmul_reduce_scatter=matmul_reduce_scatter, all_gather_matmul=all_gather_matmul)
    monkeypatch.setattr(dispatch, "_kernels_for", lambda op, operand: module)
    monkeypatch.setattr(dispatch, "_world_size", lambda group_name: 2)
    monkeypatch.setattr(dispatch, "_peers_reason", peers_reason)
    monkeypatch.setattr(dispatch, "_cost_model_says", says)
    monkeypatch.setattr(dispatch, "_device_name", lambda index: "a device with no tuning table")
    flux_settings(dispatch="auto")
    flux_settings(asynctp=False)
    return counts


def rs(a, w, bias=None):
    return dispatch.matmul_reduce_scatter(a, w, bias, "sum", 0, "g")


def test_a_signature_is_decided_once(counted):
    for _ in range(3):
        a, w = torch.randn(8, 4), torch.randn(6, 4).t()  # new tensors, the same signature
        torch.testing.assert_close(rs(a, w), (a @ w)[:4])
    assert (counted.peers, counted.checks, counted.cost) == (1, 1, 1)
    assert counted.runs == ["copy"] * 3

    counted.choice = "fused"
    for _ in range(2):
        shard, weights = torch.randn(1, 4, 8), [torch.randn(5, 8).t(), torch.randn(3, 8).t()]
        outs, gathered = dispatch.all_gather_matmul(shard, weights, [None, None], 1, "g", False)
        torch.testing.assert_close(outs[1], torch.cat([shard, shard], 1) @ weights[1])
    assert (counted.peers, counted.checks, counted.cost) == (2, 2, 2)
    assert counted.runs == ["copy"] * 3 + ["ag"] * 2


def test_every_call_of_a_remembered_fallback_is_counted(counted):
    counted.choice = "sequential"
    before = log.rewrite_stats()
    for _ in range(4):
        assert rs(torch.randn(8, 4), torch.randn(4, 6)) is None
    delta = log.rewrite_stats_delta(log.rewrite_stats(), before)["fallbacks"]
    assert delta == {"matmul_reduce_scatter": {"cost model chose sequential: test": 4}}
    assert counted.cost == 1 and counted.runs == []


def test_what_the_decision_depends_on_makes_a_new_signature(flux_settings, counted, monkeypatch, tmp_path):
    a = torch.randn(8, 4)
    rs(a, torch.randn(6, 4).t())
    decided = 1
    # another weight layout (N-major), shape, dtype, a bias, a weight 4 bytes off 16-byte alignment
    rs(a, torch.randn(4, 6))
    rs(torch.randn(8, 5), torch.randn(5, 6))
    rs(a.double(), torch.randn(4, 6, dtype=torch.float64))
    rs(a, torch.randn(4, 6), torch.randn(6))
    rs(a, torch.randn(4 * 6 + 1)[1:].view(4, 6))
    decided += 5
    assert counted.cost == decided
    # the environment: async-TP offered, the fused mode (no cost model), another table directory
    flux_settings(asynctp="1")
    rs(a, torch.randn(4, 6))
    flux_settings(tuning_dir=str(tmp_path))
    rs(a, torch.randn(4, 6))
    decided += 2
    assert counted.cost == decided
    flux_settings(dispatch="fused")
    rs(a, torch.randn(4, 6))
    assert counted.checks == decided + 1 and counted.cost == decided
    # back to auto: remembered; then the table file appears, and changes (seen at the next call here: the table's
    # version is looked up again after TABLE_RECHECK_S, see the test below)
    monkeypatch.setattr(cost_model, "TABLE_RECHECK_S", 0.0)
    flux_settings(dispatch="auto")
    rs(a, torch.randn(4, 6))
    assert counted.cost == decided
    table = tmp_path / "a_device_with_no_tuning_table_tp2.json"
    row = dict(op="matmul_reduce_scatter", m=8, k=8, n=6, fused_ms=1.0, sequential_ms=2.0)
    cost_model.write_table(str(table), cost_model.make_table("a device", 2, torch.float32, [row]), merge=False)
    rs(a, torch.randn(4, 6))
    stat = os.stat(table)
    os.utime(table, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    rs(a, torch.randn(4, 6))
    assert counted.cost == decided + 2


def test_the_table_version_is_looked_up_at_most_once_a_second(counted, monkeypatch):
    """Every ``auto`` call keys its plan by the table's version, its file's mtime; asking the file system on every call
    cost host time, so a version serves the calls of the next TABLE_RECHECK_S, and ``cost_model.clear_cache()`` asks
    again at once."""
    looked = []
    mtime = cost_model._mtime
    monkeypatch.setattr(cost_model, "_mtime", lambda path: looked.append(path) or mtime(path))
    clock = [100.0]
    monkeypatch.setattr(cost_model, "_clock", lambda: clock[0])
    cost_model.clear_cache()  # no version an earlier test looked up on the real clock
    for _ in range(5):
        rs(torch.randn(8, 4), torch.randn(4, 6))
    assert len(looked) == 1
    clock[0] += cost_model.TABLE_RECHECK_S / 2
    rs(torch.randn(8, 4), torch.randn(4, 6))
    assert len(looked) == 1
    clock[0] += cost_model.TABLE_RECHECK_S / 2
    rs(torch.randn(8, 4), torch.randn(4, 6))
    assert len(looked) == 2
    cost_model.clear_cache()
    rs(torch.randn(8, 4), torch.randn(4, 6))
    assert len(looked) == 3
    assert counted.cost == 2  # the plan was made again only where the version could have changed: clear_cache()


def test_calls_under_capture_decide_every_time(counted, monkeypatch):
    monkeypatch.setattr(symm, "capturing", lambda: True)
    for _ in range(3):
        rs(torch.randn(8, 4), torch.randn(4, 6))
    assert counted.cost == 3 and dispatch._plans == {}
