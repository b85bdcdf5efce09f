"""What a newcomer sees around the output: warnings from the decomposed ops, log lines, and the rewrite counts.

* The decomposition (every CPU call) raises no warning: torch 2.13 deprecates ``all_gather_into_tensor`` and
  ``reduce_scatter_tensor`` with a FutureWarning on every call, and the ops must not call them.
* Every log line names its rank; compile-time decisions are INFO on rank 0 only (DEBUG elsewhere), warnings stay on
  every rank.
* ``rewrite_stats()`` counts each of the user's collectives once: a split all-reduce is one ``all_reduce_split``,
  and what the later passes do with its halves is counted under ``inserted`` (not as user-visible fusions or skips).
"""

from __future__ import annotations

import io
import logging
import warnings

import pytest
import torch

from _dist import run_ranks
from _pass_graphs import (  # noqa: F401 - fake_world: the fake 2-rank default group (autouse, module scope)
    aten,
    c10d,
    count,
    fake_world,
    group,
    run_passes,
    split_ar,
    trace,
    tp_residual_block,
    tp_block_args,
    all_gather,
    linear,
)
from fluxinductor import log

AG_MM = "all_gather_matmul"
MM_RS = "matmul_reduce_scatter"


@pytest.fixture(autouse=True)
def fresh_stats():
    log.reset_rewrite_stats()
    yield


# ------------------------------------------------------------------------------------------------
# rewrite_stats on a plain-TP graph
# ------------------------------------------------------------------------------------------------


def test_split_all_reduce_counts_once_and_its_halves_as_inserted():
    """Plain TP (exact split): the all-reduce counts once; its reduce-scatter half fused with the matmul is an
    inserted fusion, its all-gather (read by the residual add, no matmul) an inserted skip, not a user's skip."""
    gm = trace(tp_residual_block(group()), *tp_block_args())
    split_ar(gm)
    run_passes(gm)
    assert count(gm, torch.ops.fluxinductor.matmul_reduce_scatter.default) == 1
    stats = log.rewrite_stats()
    assert stats["fused"] == {"all_reduce_split": 1}, stats
    assert stats["skipped"] == {}, stats
    assert stats["inserted"] == {"fused": {MM_RS: 1},
                                 "skipped": {AG_MM: {"no matmul reads the gathered tensor": 1}}}, stats


def test_a_users_own_collectives_still_count_beside_a_split():
    """The user's all-gather next to a split all-reduce: it counts (fused) as the user's; the split counts once."""

    def fn(x, a, w_o, g, w_q, shard, w_up):
        h = aten.add.Tensor(x, c10d.wait_tensor.default(c10d.all_reduce.default(linear(a, w_o), "sum", group())))
        up = linear(all_gather(shard, 0, 2, group()), w_up)
        return linear(h, w_q), up

    args = tp_block_args() + (torch.randn(4, 32), torch.randn(24, 32))
    gm = trace(fn, *args)
    split_ar(gm)
    run_passes(gm)
    stats = log.rewrite_stats()
    assert stats["fused"] == {"all_reduce_split": 1, AG_MM: 1}, stats
    assert stats["skipped"] == {}, stats
    assert stats["inserted"]["fused"] == {MM_RS: 1}, stats


def test_rewrite_stats_delta_keeps_inserted_apart():
    before = log.rewrite_stats()
    gm = trace(tp_residual_block(group()), *tp_block_args())
    split_ar(gm)
    run_passes(gm)
    delta = log.rewrite_stats_delta(log.rewrite_stats(), before)
    assert delta["fused"] == {"all_reduce_split": 1}
    assert delta["inserted"]["fused"] == {MM_RS: 1}
    assert log.rewrite_stats_delta(log.rewrite_stats(), log.rewrite_stats())["inserted"] == {"fused": {}, "skipped": {}}


# ------------------------------------------------------------------------------------------------
# Log records: rank prefix, once-per-job decisions
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def captured(monkeypatch):
    """``capture(rank)``: the fluxinductor logger's lines (formatted as FLUXINDUCTOR_LOG does) and records at every
    level, as rank ``rank``."""
    stream, records = io.StringIO(), []
    handler = log.stream_handler(stream)
    handler.addFilter(lambda r: records.append(r) or True)
    previous = log.logger.level

    def capture(rank):
        monkeypatch.setattr(log, "_rank", lambda: rank)
        log.logger.setLevel(logging.DEBUG)
        log.logger.addHandler(handler)
        return stream, records

    yield capture
    log.logger.removeHandler(handler)
    log.logger.setLevel(previous)


@pytest.mark.parametrize("rank,decision_level", [(0, "INFO"), (1, "DEBUG"), (None, "INFO")])
def test_log_lines_name_the_rank_and_decisions_are_info_on_rank_0_only(captured, rank, decision_level):
    stream, records = captured(rank)
    log.record_skip("all_gather_matmul", "a reason", "a node")
    log.logger.warning("a warning")
    prefix = "[fluxinductor]" if rank is None else f"[fluxinductor rank {rank}]"
    assert stream.getvalue().splitlines() == [f"{prefix} skipped all_gather_matmul: a reason (a node)",
                                              f"{prefix} a warning"]
    assert [r.levelname for r in records] == [decision_level, "WARNING"]
    assert [r.rank for r in records] == [rank, rank]


def test_decisions_about_inserted_collectives_log_at_debug(captured):
    stream, records = captured(0)
    with log.collective_inserted_by("all_reduce_split"):
        log.record_skip("all_gather_matmul", "no matmul reads the gathered tensor")
        log.record_fused("matmul_reduce_scatter")
    assert [r.levelname for r in records] == ["DEBUG", "DEBUG"]
    assert "(a collective all_reduce_split inserted)" in stream.getvalue()
    stats = log.rewrite_stats()
    assert stats["fused"] == {} and stats["skipped"] == {}
    assert stats["inserted"]["fused"] == {"matmul_reduce_scatter": 1}


# ------------------------------------------------------------------------------------------------
# The decomposed ops on 2 gloo ranks: no warning, right answers, rank-prefixed log lines
# ------------------------------------------------------------------------------------------------


def _decomposed_ops_job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import fluxinductor.ops  # noqa: F401 - registers torch.ops.fluxinductor
    from fluxinductor import log as flux_log

    name = dist.group.WORLD.group_name
    ops = torch.ops.fluxinductor
    g = torch.Generator().manual_seed(0)
    # Every rank builds every rank's operands (same seed) so the reference needs no communication.
    shards = [torch.randn(4, 8, generator=g) for _ in range(world)]
    w = torch.randn(8, 6, generator=g)
    partials = [torch.randn(4, 6, generator=g) for _ in range(world)]
    w_rs = torch.randn(6, 10, generator=g)
    stream = io.StringIO()
    handler = flux_log.stream_handler(stream)
    flux_log.logger.addHandler(handler)
    flux_log.logger.setLevel(logging.DEBUG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            (ag_out,), _ = ops.all_gather_matmul(shards[rank], [w], [None], 0, name, False)
            rs_out = ops.matmul_reduce_scatter(partials[rank], w_rs, None, "sum", 0, name)
            ar_out = ops.matmul_all_reduce(partials[rank], w_rs, None, "sum", name)
    flux_log.logger.removeHandler(handler)
    reduced = sum(p @ w_rs for p in partials)
    return {
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "ag_error": (ag_out - torch.cat(shards) @ w).abs().max().item(),
        "rs_error": (rs_out - reduced.chunk(world)[rank]).abs().max().item(),
        "ar_error": (ar_out - reduced).abs().max().item(),
        "log": stream.getvalue().splitlines(),
    }


@pytest.fixture(scope="module")
def decomposed_results():
    return run_ranks(_decomposed_ops_job, 2, timeout=240)


def test_decomposed_ops_raise_no_warning(decomposed_results):
    for rank, r in enumerate(decomposed_results):
        assert r["warnings"] == [], f"rank {rank}: {r['warnings']}"


def test_decomposed_ops_are_right(decomposed_results):
    for rank, r in enumerate(decomposed_results):
        for what in ("ag_error", "rs_error", "ar_error"):
            assert r[what] <= 1e-5, f"rank {rank}: {what} {r[what]}"


def test_log_lines_of_a_job_name_their_rank(decomposed_results):
    for rank, r in enumerate(decomposed_results):
        assert r["log"], f"rank {rank}: nothing logged"
        assert all(line.startswith(f"[fluxinductor rank {rank}] ") for line in r["log"]), r["log"]
        assert any("all_gather_matmul runs decomposed" in line for line in r["log"]), r["log"]
