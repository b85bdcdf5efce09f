"""Thousands of fused-op calls whose shape changes on every call, on 2 gloo ranks (the decomposed path): the host caches
stay bounded and the Python heap does not grow.

The dispatcher's kernel module is a stand-in that declines every call (``dispatch="fused"``), so that the dispatcher
decides and remembers a plan for each signature as it does on a GPU (on CPU tensors it returns before the plan cache);
each call then runs the decomposition.  Shapes come (seeded, the same on every rank) from a set: rows 1..257 with odd
ones and tile edges, a few (K, N), a bias or none, each of the three ops; no two consecutive calls have the same shape.

* The first pass calls every signature once; after it, ``CALLS`` random calls: the agreement exchange ran once per
  signature and never after the first pass, ``agreement._agreed``, ``dispatch._plans`` and ``matmul_all_reduce``'s
  ``ops._all_reduce_plans`` hold one entry per signature and do not grow, and the Python heap (``tracemalloc``, from a point after the first pass) grows by at most
  ``HEAP_BOUND`` bytes; every ``CHECK_EVERY``-th result matches an fp32 reference.
* With the caps lowered to ``SMALL_CAP``, calls with a new signature each: no cache ever holds more than the cap, each
  was cleared on reaching it, and every call exchanged once.

On GPUs the same holds with device memory and the symmetric workspaces: tests/gpu/run_memory_flat.py.
"""

from __future__ import annotations

import functools
import gc
import random
import types
from typing import Dict, List

import torch

from _dist import count_calls, run_ranks

WORLD = 2
SEED = 34
ROWS = (1, 2, 3, 5, 7, 8, 13, 16, 31, 32, 63, 64, 65, 127, 128, 129, 255, 256, 257)
DIMS = ((8, 4), (16, 24), (24, 8))  # (K, N)
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
CALLS = 2500
CHECK_EVERY = 10
# tracemalloc starts after HEAP_START random calls and is first sampled after HEAP_FROM.  Each sample follows a full
# garbage collection, which also empties Python's free lists (tuples, dicts): tracemalloc counts their blocks as live,
# and how full they are depends on how many objects of each size a call frees at once, not on any leak.
HEAP_START = 200
HEAP_FROM = 1000
HEAP_EVERY = 250
HEAP_BOUND = 32 << 10  # bytes over the last 1500 calls: a leak of 22 bytes or more per call exceeds it
SMALL_CAP = 32
NEW_SIGNATURES = 300


def _operands(world: int) -> Dict[str, object]:
    g = torch.Generator().manual_seed(SEED)
    ks, ns = sorted({k for k, _ in DIMS}), sorted({n for _, n in DIMS})
    rows = world * (max(ROWS) + NEW_SIGNATURES)
    return {"a": {k: [torch.randn(rows, k, generator=g) for _ in range(world)] for k in ks},
            "w": {(k, n): [torch.randn(n, k, generator=g).t() for _ in range(world)] for k, n in DIMS},
            "b": {n: [torch.randn(n, generator=g) for _ in range(world)] for n in ns}}


def _call(sig: tuple, ops: Dict[str, object], rank: int, world: int, name: str) -> torch.Tensor:
    op, rows, (k, n), bias = sig
    a, w = ops["a"][k][rank], ops["w"][(k, n)][rank]
    b = ops["b"][n][rank] if bias else None
    if op == "all_gather_matmul":
        (out,), _ = torch.ops.fluxinductor.all_gather_matmul(a[:rows], [w], [b], 0, name, False)
        return out
    if op == "matmul_reduce_scatter":
        return torch.ops.fluxinductor.matmul_reduce_scatter(a[:world * rows], w, b, "sum", 0, name)
    return torch.ops.fluxinductor.matmul_all_reduce(a[:rows], w, b, "sum", name)


def _reference(sig: tuple, ops: Dict[str, object], rank: int, world: int) -> torch.Tensor:
    op, rows, (k, n), bias = sig
    a = [ops["a"][k][r].double() for r in range(world)]

    def term(x: torch.Tensor, r: int) -> torch.Tensor:
        out = x @ ops["w"][(k, n)][r].double()
        return out + ops["b"][n][r].double() if bias else out

    if op == "all_gather_matmul":
        return term(torch.cat([a[r][:rows] for r in range(world)]), rank)
    if op == "matmul_reduce_scatter":
        return sum(term(a[r][rank * rows:(rank + 1) * rows], r) for r in range(world))
    return sum(term(a[r][:rows], r) for r in range(world))


def _job(rank: int, world: int) -> Dict[str, object]:
    import tracemalloc

    import torch.distributed as dist

    from fluxinductor import agreement, dispatch, settings
    from fluxinductor import ops as ops_module  # registers torch.ops.fluxinductor

    name = dist.group.WORLD.group_name
    declined = types.SimpleNamespace(unsupported_reason=lambda *args: "a stand-in kernel module declines every call",
                                     split_reason=lambda *args: None, split_configs=lambda dtype: ())
    dispatch._kernels_for = lambda op, operand: declined
    dispatch._peers_reason = lambda group_name, device: None
    exchanges = count_calls(dist, "all_gather_object")
    ops = _operands(world)
    wrong: List[str] = []
    checked = {"n": 0}

    def one(sig: tuple, check: bool) -> None:
        out = _call(sig, ops, rank, world, name)
        if check:
            checked["n"] += 1
            ref = _reference(sig, ops, rank, world)
            if out.shape != ref.shape or not torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-4):
                wrong.append(f"{sig}: {tuple(out.shape)} vs {tuple(ref.shape)}")

    out: Dict[str, object] = {}
    agreement.forget()
    dispatch.clear_plans()
    rng = random.Random(SEED)
    shapes = [(op, rows, dims, bias) for rows in ROWS for dims in DIMS for op in OPS for bias in (False, True)]
    with settings.override(dispatch="fused"), torch.no_grad():
        for sig in shapes:  # the first pass: every signature once
            one(sig, check=True)
        out["signatures"] = len(shapes)
        out["first_pass"] = {"exchanges": exchanges["n"], "agreed": len(agreement._agreed),
                             "plans": len(dispatch._plans), "all_reduce_plans": len(ops_module._all_reduce_plans)}
        before = exchanges["n"]
        series = []
        previous = shapes[-1]
        for i in range(CALLS):
            sig = previous
            while sig == previous:
                sig = (rng.choice(OPS), rng.choice(ROWS), rng.choice(DIMS), rng.random() < 0.5)
            one(sig, check=i % CHECK_EVERY == 0)
            previous = sig
            if i + 1 == HEAP_START:
                tracemalloc.start()
            if i + 1 >= HEAP_FROM and (i + 1 - HEAP_FROM) % HEAP_EVERY == 0:
                gc.collect()
                series.append({"call": i + 1, "heap": tracemalloc.get_traced_memory()[0],
                               "agreed": len(agreement._agreed), "plans": len(dispatch._plans),
                               "all_reduce_plans": len(ops_module._all_reduce_plans)})
        tracemalloc.stop()
        out["random"] = {"exchanges": exchanges["n"] - before, "series": series}

        # Caps lowered: a new signature on every call.
        saved = agreement._MAX_AGREED, dispatch._MAX_PLANS, ops_module._MAX_PLANS
        agreement._MAX_AGREED = dispatch._MAX_PLANS = ops_module._MAX_PLANS = SMALL_CAP
        agreement.forget()
        dispatch.clear_plans()
        ops_module._all_reduce_plans.clear()
        try:
            before = exchanges["n"]
            sizes = []
            for i in range(NEW_SIGNATURES):
                one((OPS[i % 3], max(ROWS) + 1 + i, DIMS[0], False), check=i % CHECK_EVERY == 0)
                sizes.append((len(agreement._agreed), len(dispatch._plans), len(ops_module._all_reduce_plans)))
            out["capped"] = {"exchanges": exchanges["n"] - before, "sizes": sizes}
        finally:
            agreement._MAX_AGREED, dispatch._MAX_PLANS, ops_module._MAX_PLANS = saved
    out["wrong"] = wrong
    out["checked"] = checked["n"]
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return run_ranks(_job, WORLD, timeout=240)


def test_every_checked_result_is_right():
    for rank, r in enumerate(_results()):
        assert r["checked"] >= r["signatures"] + CALLS // CHECK_EVERY, r["checked"]
        assert r["wrong"] == [], f"rank {rank}: {r['wrong'][:10]}"


def test_the_caches_hold_one_entry_per_signature_and_stop_growing():
    for rank, r in enumerate(_results()):
        first, n = r["first_pass"], r["signatures"]
        assert first["exchanges"] == n, f"rank {rank}: {first}"
        assert first["agreed"] == n, f"rank {rank}: {first}"
        # a plan per all-gather and reduce-scatter signature, and one for each all-reduce whose rows split (its
        # reduce-scatter half), shared with the reduce-scatter signature of the same operand where there is one
        assert n // 3 * 2 <= first["plans"] <= n, f"rank {rank}: {first}"
        assert first["all_reduce_plans"] == n // 3, f"rank {rank}: {first}"  # one per matmul_all_reduce signature
        assert r["random"]["exchanges"] == 0, f"rank {rank}: {r['random']['exchanges']} exchanges after the first pass"
        for s in r["random"]["series"]:
            assert {k: s[k] for k in ("agreed", "plans", "all_reduce_plans")} == \
                {k: first[k] for k in ("agreed", "plans", "all_reduce_plans")}, f"rank {rank}: {s}"


def test_the_python_heap_does_not_grow():
    for rank, r in enumerate(_results()):
        heap = [s["heap"] for s in r["random"]["series"]]
        assert len(heap) == (CALLS - HEAP_FROM) // HEAP_EVERY + 1, heap
        assert max(heap) - heap[0] <= HEAP_BOUND, f"rank {rank}: heap bytes {heap}"


def test_the_caches_stay_within_their_caps():
    for rank, r in enumerate(_results()):
        capped = r["capped"]
        assert capped["exchanges"] == NEW_SIGNATURES, f"rank {rank}: {capped['exchanges']}"
        for sizes in zip(*capped["sizes"]):  # agreed, plans, all-reduce plans after each call
            assert max(sizes) <= SMALL_CAP, f"rank {rank}: {sizes}"
            # reached the cap and was cleared (a drop from the cap to one entry), more than once
            drops = [i for i in range(1, len(sizes)) if sizes[i] < sizes[i - 1]]
            assert len(drops) >= 2 and all(sizes[i - 1] == SMALL_CAP and sizes[i] == 1 for i in drops), sizes


def test_workspace_bytes_counts_the_buffers_a_workspace_keeps(monkeypatch):
    """``symm.workspace_bytes()``, which tests/gpu/run_memory_flat.py samples: both buffers, the retired ones and the
    flags' allocation of every workspace (stand-ins on CPU: the accessor only reads them)."""
    from fluxinductor.kernels import symm

    monkeypatch.setattr(symm, "_workspaces", {})
    assert symm.workspace_bytes() == 0
    ws = object.__new__(symm.SymmetricWorkspace)
    ws.world = 2
    ws.buffers = [torch.empty(1 << 20, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8)]
    ws.retired = [([torch.empty(1 << 19, dtype=torch.uint8), torch.empty(1 << 19, dtype=torch.uint8)], None)]
    ws.flags = torch.zeros(3, 2 * symm.MAX_CHUNKS_PER_RANK, dtype=torch.int32)
    symm._workspaces[("g", 0)] = ws
    flags = (3 * 2 * symm.MAX_CHUNKS_PER_RANK + 2 * 2) * 4
    assert symm.workspace_bytes() == 2 * (1 << 20) + 2 * (1 << 19) + flags
    fresh = object.__new__(symm.SymmetricWorkspace)  # created, no call reserved yet
    fresh.world, fresh.buffers, fresh.retired, fresh.flags = 2, [None, None], [], None
    symm._workspaces[("h", 0)] = fresh
    assert symm.workspace_bytes() == 2 * (1 << 20) + 2 * (1 << 19) + flags
