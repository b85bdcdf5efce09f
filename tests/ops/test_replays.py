"""A signature whose plan ran a fused kernel replays: its later calls go from the op to what the kernel module prepared
for it (no agreement fields, no plan key), and anything the agreement or the plan depends on sends the call the full
way again (fluxinductor/dispatch.py, "Replays").  The kernel module, the group's verdict and the cost model are counting
fakes, as in test_dispatch_plans.py (the real kernels need Hopper GPUs: tests/gpu run them through the same path); the
op runs on a one-rank gloo group."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from _dist import free_port
from fluxinductor import agreement, cost_model, dispatch, ops
from fluxinductor.kernels import symm


@pytest.fixture(scope="module")
def group_name():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    if created:
        dist.destroy_process_group()


@pytest.fixture
def counted(flux_settings, monkeypatch, group_name):
    """Fakes that count: ``full`` calls through the agreement check (the full path), ``prepared`` kernel-module
    preparations, ``runs`` of what they prepared, ``unprepared`` kernel calls without one, ``decided`` cost-model
    answers.  ``counted.prepare = False``: the kernel module prepares nothing (the AG+GEMM's pull, one rank)."""
    counts = types.SimpleNamespace(full=0, prepared=0, runs=0, unprepared=0, decided=0, choice="fused", prepare=True,
                                   group=group_name)

    def all_gather(shard2d, weights, biases, return_gathered):
        full = torch.cat([shard2d, shard2d])  # the fakes' world is 2: every rank holds the same shard
        return [full @ w if b is None else full @ w + b for w, b in zip(weights, biases)], \
            full if return_gathered else shard2d.new_empty(0)

    def prepare_all_gather_matmul(shard2d, weights, biases, group_name, return_gathered):
        counts.prepared += 1

        def run(shard2d, weights, biases):
            counts.runs += 1
            return all_gather(shard2d, weights, biases, return_gathered)

        return run if counts.prepare else None

    def all_gather_matmul(shard2d, weights, biases, group_name, return_gathered, *, checked=False):
        counts.unprepared += 1
        return all_gather(shard2d, weights, biases, return_gathered)

    def prepare_matmul_reduce_scatter(a2d, weight, bias, reduce_op, group_name, *, transport, split_config_choice,
                                      out_dtype=None):
        counts.prepared += 1

        def run(a2d, weight, bias):
            counts.runs += 1
            return (2 * (a2d @ weight))[: a2d.shape[0] // 2]  # both ranks' partials, as a sum

        return run if counts.prepare else None

    def matmul_reduce_scatter(a2d, weight, bias, reduce_op, group_name, *, checked=False, transport="store",
                              split_config_choice=None, out_dtype=None):
        counts.unprepared += 1
        return (2 * (a2d @ weight))[: a2d.shape[0] // 2]

    def says(op, device, world, m, k, n, dtype, **_):
        counts.decided += 1
        return counts.choice, f"cost model chose {counts.choice}: test"

    check = agreement.check

    def counting_check(*args, **kwargs):
        counts.full += 1
        return check(*args, **kwargs)

    module = types.SimpleNamespace(
        unsupported_reason=lambda *args: None, split_reason=lambda *args: None, split_configs=lambda dtype: (),
        prepare_all_gather_matmul=prepare_all_gather_matmul, all_gather_matmul=all_gather_matmul,
        prepare_matmul_reduce_scatter=prepare_matmul_reduce_scatter, matmul_reduce_scatter=matmul_reduce_scatter)
    monkeypatch.setattr(dispatch, "_kernels_for", lambda op, operand: module)
    monkeypatch.setattr(dispatch, "_world_size", lambda group_name: 2)
    monkeypatch.setattr(dispatch, "_peers_reason", lambda group_name, device: None)
    monkeypatch.setattr(dispatch, "_cost_model_says", says)
    monkeypatch.setattr(dispatch, "_device_name", lambda index: "a device with no tuning table")
    monkeypatch.setattr(agreement, "check", counting_check)
    monkeypatch.setattr(dispatch, "_clock", lambda: 100.0)  # a replay lasts REPLAY_S: no test waits that long here
    flux_settings(dispatch="auto", asynctp=False)
    return counts


def rs(counted, a, weight, bias=None):
    return ops.matmul_reduce_scatter(a, weight, bias, "sum", 1, counted.group)


def ag(counted, shard, weights, return_gathered=True):
    return ops.all_gather_matmul(shard, weights, [None] * len(weights), 1, counted.group, return_gathered)


def test_later_calls_of_a_fused_signature_replay(counted):
    for _ in range(4):
        a, w = torch.randn(1, 8, 4), torch.randn(6, 4).t()  # new tensors, one signature; scattered on dim 1
        torch.testing.assert_close(rs(counted, a, w), 2 * (a @ w)[:, :4])
    assert (counted.full, counted.decided, counted.prepared, counted.runs) == (1, 1, 1, 4)

    for _ in range(3):
        shard, weights = torch.randn(1, 4, 8), [torch.randn(5, 8).t(), torch.randn(3, 8).t()]
        outs, gathered = ag(counted, shard, weights)
        full = torch.cat([shard, shard], 1)
        torch.testing.assert_close(gathered, full)
        torch.testing.assert_close(outs[1], full @ weights[1])
        assert outs[0].shape == (1, 8, 5) and outs[0].is_contiguous()
    assert (counted.full, counted.decided, counted.prepared, counted.runs) == (2, 2, 2, 7)
    assert counted.unprepared == 0


def test_what_a_replay_depends_on_sends_the_call_the_full_way(counted, flux_settings):
    a = torch.randn(1, 8, 4)
    rs(counted, a, torch.randn(4, 6))
    full = 1

    def once_more(expect_full: bool) -> None:
        nonlocal full
        before = counted.runs
        rs(counted, torch.randn(1, 8, 4), torch.randn(4, 6))
        full += expect_full
        assert counted.full == full and counted.runs == before + 1

    once_more(False)
    # operands: another weight layout (K-major), shape, dtype, a bias, a weight 4 bytes off 16-byte alignment
    for operands in ((a, torch.randn(6, 4).t()), (torch.randn(1, 8, 5), torch.randn(5, 6)),
                     (a.double(), torch.randn(4, 6, dtype=torch.float64)), (a, torch.randn(4, 6), torch.randn(6)),
                     (a, torch.randn(4 * 6 + 1)[1:].view(4, 6))):
        rs(counted, *operands)
        full += 1
        assert counted.full == full
    once_more(False)  # the first signature still replays
    # the settings, the agreement, the plans, the cost model's tables
    flux_settings(ag_chunks=3)
    once_more(True)
    once_more(False)
    agreement.forget()
    once_more(True)
    dispatch.clear_plans()
    once_more(True)
    cost_model.clear_cache()
    once_more(True)
    once_more(False)


def test_a_replay_serves_for_REPLAY_S_then_the_full_path_renews_it(counted, monkeypatch):
    """The call after that asks the plan again, keyed by the table's version: an edited table counts as it did
    before replays."""
    clock = [100.0]
    monkeypatch.setattr(dispatch, "_clock", lambda: clock[0])
    for _ in range(3):
        rs(counted, torch.randn(1, 8, 4), torch.randn(4, 6))
    assert (counted.full, counted.prepared) == (1, 1)
    clock[0] += dispatch.REPLAY_S + 0.01
    for _ in range(3):
        rs(counted, torch.randn(1, 8, 4), torch.randn(4, 6))
    assert (counted.full, counted.prepared, counted.runs, counted.decided) == (2, 2, 6, 1)


def test_no_replay_under_capture_nor_for_a_decomposed_or_unprepared_plan(counted, monkeypatch):
    counted.prepare = False  # e.g. the AG+GEMM's pull: the kernel module's own entry point, every call
    for _ in range(3):
        ag(counted, torch.randn(1, 4, 8), [torch.randn(8, 5)])
    assert (counted.full, counted.prepared, counted.unprepared, counted.runs) == (3, 3, 3, 0)

    counted.choice = "sequential"  # the reference runs on the one-rank group
    for _ in range(3):
        a, w = torch.randn(1, 8, 4), torch.randn(4, 6)
        torch.testing.assert_close(rs(counted, a, w), a @ w)
    assert counted.full == 6 and counted.decided == 2 and dispatch._replays == {}

    counted.choice, counted.prepare = "fused", True
    monkeypatch.setattr(symm, "capturing", lambda: True)
    for _ in range(3):
        rs(counted, torch.randn(1, 8, 4), torch.randn(6, 4).t())
    assert (counted.full, counted.unprepared, counted.runs) == (9, 6, 0) and dispatch._replays == {}
