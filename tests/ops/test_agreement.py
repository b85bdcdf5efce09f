"""Ranks that call a fused op with different inputs get the same clear error on every rank (fluxinductor.agreement).

On 2 gloo ranks (the decomposed path every CPU and non-fused GPU call takes): rows that differ per rank, fp32 on one
rank and fp64 on the other, the same bytes in another shape, a weight whose dtype differs from the input on one rank
only, a weight held K-major on one rank and N-major on the other.  In each case every rank raises (none returns, none hangs: the job has a hard timeout), the message names the
ranks and what differs, and the group goes on working with a good call afterwards.  A signature the group agreed on
costs no communication on later calls.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict

import pytest
import torch

from _dist import count_calls, run_ranks


def _outcome(fn: Callable[[], object]) -> Dict[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": "", "message": "returned"}


def _job(rank: int, world: int) -> Dict[str, object]:
    import torch.distributed as dist

    import fluxinductor.ops as ops_module
    from fluxinductor import agreement

    name = dist.group.WORLD.group_name
    agm = torch.ops.fluxinductor.all_gather_matmul
    mrs = torch.ops.fluxinductor.matmul_reduce_scatter
    mar = torch.ops.fluxinductor.matmul_all_reduce

    exchanges = count_calls(dist, "all_gather_object")
    data_gathers = count_calls(ops_module, "_all_gather_single")

    def ones(*shape, dtype=torch.float32):
        return torch.ones(*shape, dtype=dtype)

    def good_call():
        """A call every rank agrees on, after each failure: the group is still in step.  Its signature is none of the
        cases': a rank whose side of a case the group had agreed on would skip the exchange its peer joins."""
        (out,), _ = agm(ones(2, 5), [ones(5, 3)], [None], 0, name, False)
        return bool(torch.equal(out, torch.full((4, 3), 5.0)))

    cases = {
        "rows_differ": lambda: agm(ones(4 if rank == 0 else 6, 8), [ones(8, 6)], [None], 0, name, False),
        "fp32_vs_fp64": lambda: agm(ones(4, 8, dtype=torch.float32 if rank == 0 else torch.float64),
                                    [ones(8, 6, dtype=torch.float32 if rank == 0 else torch.float64)], [None], 0, name,
                                    False),
        "same_bytes_other_shape": lambda: agm(ones(4, 8) if rank == 0 else ones(8, 4),
                                              [ones(8, 6) if rank == 0 else ones(4, 6)], [None], 0, name, False),
        "gather_dim_differs": lambda: agm(ones(2, 4, 8), [ones(8, 6)], [None], rank, name, False),
        "mrs_rows_differ": lambda: mrs(ones(4 if rank == 0 else 6, 8), ones(8, 6), None, "sum", 0, name),
        "mrs_reduce_op_differs": lambda: mrs(ones(4, 8), ones(8, 6), None, "sum" if rank == 0 else "avg", 0, name),
        "mar_bias_on_one_rank": lambda: mar(ones(4, 8), ones(8, 6), ones(6) if rank == 1 else None, "sum", name),
        # A K-major weight on one rank, N-major on the other: on a GPU the fused kernel may take one and not the
        # other, and the ranks would run different collectives (a wrong answer on one, a timeout on the other).
        "mar_weight_layout_differs": lambda: mar(ones(4, 8), ones(8, 6) if rank == 0 else ones(6, 8).t(), None,
                                                 "sum", name),
    }
    out: Dict[str, object] = {}
    for case, fn in cases.items():
        before = exchanges["n"]
        out[case] = _outcome(fn)
        out[case]["exchanges"] = exchanges["n"] - before
        out[case]["good_after"] = good_call()

    # A weight whose dtype differs from the input's, on rank 1 only: rank 1 refuses before any collective; rank 0,
    # which would otherwise wait in the all-gather, learns of it in the exchange and raises too.
    before = data_gathers["n"]
    out["weight_dtype_on_one_rank"] = _outcome(
        lambda: agm(ones(4, 8), [ones(8, 6, dtype=torch.float64 if rank == 1 else torch.float32)], [None], 0, name,
                    False))
    out["weight_dtype_on_one_rank"]["data_gathers"] = data_gathers["n"] - before
    out["weight_dtype_on_one_rank"]["good_after"] = good_call()

    # 100 calls of one signature per op: one exchange, on the first; each call's own collective every time; a new
    # shape: one exchange more.
    hundred = {}
    all_reduce, reduce_scatter_single = dist.all_reduce, ops_module._reduce_scatter_single
    collectives = count_calls(dist, "all_reduce")
    count_calls(ops_module, "_reduce_scatter_single", collectives)
    calls = {
        "all_gather_matmul": lambda rows: agm(ones(rows, 8), [ones(8, 6)], [None], 0, name, False),
        "matmul_reduce_scatter": lambda rows: mrs(ones(2 * rows, 8), ones(8, 6), None, "sum", 0, name),
        "matmul_all_reduce": lambda rows: mar(ones(rows, 8), ones(8, 6), None, "sum", name),
    }
    try:
        for op, call in calls.items():
            agreement.forget()
            before, gathers_before, collectives_before = exchanges["n"], data_gathers["n"], collectives["n"]
            for _ in range(100):
                call(9)
            after_hundred = exchanges["n"] - before
            data = data_gathers["n"] - gathers_before + collectives["n"] - collectives_before
            call(11)
            after_new_shape = exchanges["n"] - before
            for _ in range(10):
                call(9)
                call(11)
            hundred[op] = {"exchanges": after_hundred, "op_collectives": data, "after_new_shape": after_new_shape,
                           "after_both_repeated": exchanges["n"] - before}
    finally:
        dist.all_reduce = all_reduce
        ops_module._reduce_scatter_single = reduce_scatter_single
    out["hundred_calls"] = hundred

    # An agreed signature: one exchange on its first call, none after; a new signature exchanges again.
    agreement.forget()
    counts = []
    for shape in ((3, 8), (3, 8), (3, 8), (5, 8), (5, 8)):
        before = exchanges["n"]
        agm(ones(*shape), [ones(8, 6)], [None], 0, name, False)
        counts.append(exchanges["n"] - before)
    out["exchanges_per_call"] = counts

    # Under CUDA graph capture (simulated: there is no GPU here) no exchange runs: a signature agreed on eagerly needs
    # none, a new one is run unchecked and that is logged.
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    agreement.logger.addHandler(handler)
    agreement._capturing = lambda: True
    before = exchanges["n"]
    try:
        agm(ones(3, 8), [ones(8, 6)], [None], 0, name, False)
        agm(ones(7, 8), [ones(8, 6)], [None], 0, name, False)
        agm(ones(7, 8), [ones(8, 6)], [None], 0, name, False)
    finally:
        agreement.logger.removeHandler(handler)
    out["capture"] = {"exchanges": exchanges["n"] - before, "warnings": [r.getMessage() for r in records]}
    return out


@functools.lru_cache(maxsize=None)
def _results():
    # A hang (a rank left waiting in a collective) ends the job at the timeout and fails every test.
    return run_ranks(_job, 2, timeout=180)


DISAGREEMENTS = {
    "rows_differ": "shard shape: rank 0 [4, 8], rank 1 [6, 8]",
    "fp32_vs_fp64": "dtype: rank 0 float32, rank 1 float64",
    "same_bytes_other_shape": "shard shape: rank 0 [4, 8], rank 1 [8, 4]",
    "gather_dim_differs": "gather_dim: rank 0 0, rank 1 1",
    "mrs_rows_differ": "input shape: rank 0 [4, 8], rank 1 [6, 8]",
    "mrs_reduce_op_differs": "reduce_op: rank 0 'sum', rank 1 'avg'",
    "mar_bias_on_one_rank": "bias shape: rank 0 None, rank 1 [6]",
    "mar_weight_layout_differs": "layouts (strides, 16-byte aligned) of input, weight, bias: rank 0 (((8, 1), True), "
                                 "((6, 1), True), None), rank 1 (((8, 1), True), ((1, 8), True), None)",
}


@pytest.mark.parametrize("case", sorted(DISAGREEMENTS))
def test_disagreeing_ranks_all_raise_the_same_clear_error(case):
    results = _results()
    messages = set()
    for rank, r in enumerate(results):
        o = r[case]
        assert o["raised"] == "RanksDisagreeError", f"rank {rank}: {o}"
        assert DISAGREEMENTS[case] in o["message"], f"rank {rank}: {o['message']}"
        assert o["exchanges"] == 1, f"rank {rank}: {o}"
        assert o["good_after"], f"rank {rank}: the next good call was wrong"
        messages.add(o["message"])
    assert len(messages) == 1, messages


def test_a_local_error_on_one_rank_raises_on_every_rank_before_the_all_gather():
    rank0, rank1 = (r["weight_dtype_on_one_rank"] for r in _results())
    assert rank1["raised"] == "ValueError" and "weight dtype torch.float64 differs" in rank1["message"], rank1
    assert rank0["raised"] == "RanksDisagreeError", rank0
    assert "rank 1 refused the call: weight dtype torch.float64 differs" in rank0["message"], rank0
    for r in (rank0, rank1):
        assert r["data_gathers"] == 0, r
        assert r["good_after"]


def test_an_agreed_signature_costs_no_exchange_after_its_first_call():
    for rank, r in enumerate(_results()):
        assert r["exchanges_per_call"] == [1, 0, 0, 1, 0], f"rank {rank}: {r['exchanges_per_call']}"


def test_a_hundred_calls_of_one_signature_exchange_once_and_a_new_shape_once_more():
    for rank, r in enumerate(_results()):
        for op, counts in r["hundred_calls"].items():
            # the op's own collective ran on every call (rows 9 do not split over 2 ranks: the all-reduce runs whole)
            assert counts == {"exchanges": 1, "op_collectives": 100, "after_new_shape": 2,
                              "after_both_repeated": 2}, f"rank {rank} {op}: {counts}"


def test_no_exchange_under_capture_and_an_unchecked_signature_is_logged_once():
    for rank, r in enumerate(_results()):
        capture = r["capture"]
        assert capture["exchanges"] == 0, f"rank {rank}: {capture}"
        assert len(capture["warnings"]) == 1, f"rank {rank}: {capture}"
        assert "not checked for agreement" in capture["warnings"][0] and "[7, 8]" in capture["warnings"][0]


def test_an_agreed_signature_skips_its_local_check():
    """The input checks run on a signature's first call only (host time on every call of a model's step): the
    signature holds everything they read."""
    import types

    from fluxinductor import agreement

    agreement.forget()
    group = types.SimpleNamespace(size=lambda: 1)
    calls = []
    for _ in range(3):
        agreement.check("op", group, "g", {"shape": (2, 3)}, lambda: calls.append(1))
    agreement.check("op", group, "g", {"shape": (2, 4)}, lambda: calls.append(2))
    assert calls == [1, 2]
    agreement.forget()


def _bias_dtype_job(rank: int, world: int) -> Dict[str, Dict[str, str]]:
    import torch.distributed as dist

    import fluxinductor.ops  # noqa: F401 - defines the ops

    name = dist.group.WORLD.group_name
    mrs, agm = torch.ops.fluxinductor.matmul_reduce_scatter, torch.ops.fluxinductor.all_gather_matmul
    a, w = torch.ones(4, 8), torch.ones(8, 6)
    mrs(a, w, torch.ones(6), "sum", 0, name)  # the signatures agreed with an fp32 bias
    agm(a, [w], [torch.ones(6)], 0, name, False)
    fp64 = torch.ones(6, dtype=torch.float64)
    return {"matmul_reduce_scatter": _outcome(lambda: mrs(a, w, fp64, "sum", 0, name)),
            "all_gather_matmul": _outcome(lambda: agm(a, [w], [fp64], 0, name, False))}


def test_a_bias_of_another_dtype_after_an_agreed_call_still_gets_the_input_error():
    for rank, result in enumerate(run_ranks(_bias_dtype_job, 2)):
        for op, o in result.items():
            assert o["raised"] == "ValueError" and "bias dtype torch.float64 differs" in o["message"], (rank, op, o)
