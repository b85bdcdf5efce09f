"""The fused ops on CPU/gloo: numerics against an independent fp32 reference, opcheck, bad inputs.

Every rank builds every rank's random inputs from a shared seed, so the reference (``torch.cat`` of all
shards then a matmul, or the sum of all ranks' partial products) is computed locally without any
communication: a bug in the ops' collectives cannot also hide in the oracle.  One spawned job per world
size runs all cases and returns their errors; the parametrized tests below read them.
"""

from __future__ import annotations

import functools
import zlib
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from _dist import run_ranks

FP32_TOL = 1e-5
BF16_TOL = 2e-2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (case id, shard shape per rank, gather_dim, weight widths N_i, which weights have a bias, return_gathered, dtype)
ALL_GATHER_MATMUL_CASES = [
    ("2d_dim0_one_weight", (3, 5), 0, (7,), (False,), False, "fp32"),
    ("2d_dim0_three_weights_bias", (4, 8), 0, (6, 9, 3), (True, False, True), True, "fp32"),
    ("3d_dim0", (2, 3, 5), 0, (4,), (True,), True, "fp32"),
    ("3d_dim1_two_weights", (2, 3, 8), 1, (5, 7), (True, True), True, "fp32"),
    ("3d_dim_minus2", (2, 3, 8), -2, (5,), (False,), False, "fp32"),
    ("3d_dim1_noncontiguous", (2, 3, 8), 1, (6,), (True,), True, "fp32"),
    ("2d_dim0_bf16", (8, 16), 0, (16, 8), (True, False), True, "bf16"),
    ("3d_dim1_bf16", (2, 4, 16), 1, (24,), (True,), False, "bf16"),
]

# (case id, partial shape per rank [..., K], N, bias, reduce_op, scatter_dim, dtype)
MATMUL_REDUCE_SCATTER_CASES = [
    ("2d_sum_dim0", (12, 5), 7, False, "sum", 0, "fp32"),
    ("2d_avg_dim0_bias", (12, 5), 7, True, "avg", 0, "fp32"),
    ("2d_sum_dim1_bias", (5, 6), 12, True, "sum", 1, "fp32"),
    ("3d_sum_dim1_bias", (2, 12, 8), 6, True, "sum", 1, "fp32"),
    ("3d_avg_dim0", (4, 3, 8), 6, False, "avg", 0, "fp32"),
    ("3d_sum_dim_minus2", (2, 12, 8), 6, False, "sum", -2, "fp32"),
    ("2d_sum_dim0_bf16", (24, 16), 32, True, "sum", 0, "bf16"),
    ("3d_avg_dim1_bf16", (2, 12, 16), 8, True, "avg", 1, "bf16"),
    # a sum of matmuls (more_a, more_weights): further terms of these K
    ("3d_sum_dim1_bias_sum_of_3", (2, 12, 8), 6, True, "sum", 1, (4, 12), "fp32"),
    ("2d_avg_dim0_sum_of_2_bf16", (24, 16), 32, False, "avg", 0, (8,), "bf16"),
]

# (case id, partial operand shape per rank [..., K], N, bias, reduce_op, dtype); rows 5 and 2*3 = 6 do not split over
# 4 ranks (5 not over 2 either): those calls take the matmul and the all-reduce.
MATMUL_ALL_REDUCE_CASES = [
    ("2d_sum", (12, 5), 7, False, "sum", "fp32"),
    ("2d_avg_bias", (12, 5), 7, True, "avg", "fp32"),
    ("2d_odd_rows_bias", (5, 8), 6, True, "sum", "fp32"),
    ("3d_sum_bias", (2, 3, 8), 6, True, "sum", "fp32"),
    ("3d_avg_bf16", (2, 4, 16), 8, True, "avg", "bf16"),
]


def _randn(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Offset from zero so a dropped term or a missing bias shows in the relative error.
    return (torch.randn(shape, generator=g) + 0.25).to(dtype)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


def _seed_of(name: str) -> int:
    # The same on every rank (str hash() is salted per process).
    return 1000 * (zlib.crc32(name.encode()) % 1000)


def _all_gather_matmul_case(rank: int, world: int, case) -> Dict[str, object]:
    import torch.distributed as dist

    name, shard_shape, gather_dim, widths, has_bias, return_gathered, dtype_name = case
    dtype = DTYPES[dtype_name]
    seed = _seed_of(name)
    K = shard_shape[-1]
    shards = [_randn(shard_shape, seed + r, dtype) for r in range(world)]
    weights = [_randn((K, n), seed + 100 + i, dtype) for i, n in enumerate(widths)]
    biases: List[Optional[torch.Tensor]] = [
        _randn((n,), seed + 200 + i, dtype) if b else None for i, (n, b) in enumerate(zip(widths, has_bias))
    ]
    shard = shards[rank]
    if name.endswith("noncontiguous"):
        # Same values, transposed storage: [B, S, K] viewed from a [K, S, B] tensor.
        shard = shard.permute(2, 1, 0).contiguous().permute(2, 1, 0)
        assert not shard.is_contiguous()

    outputs, gathered = torch.ops.fluxinductor.all_gather_matmul(
        shard, weights, biases, gather_dim, dist.group.WORLD.group_name, return_gathered
    )

    # Reference: concatenate all ranks' shards in fp32, multiply in fp32.
    full = torch.cat([s.float() for s in shards], dim=gather_dim)
    refs = [full @ w.float() + (b.float() if b is not None else 0.0) for w, b in zip(weights, biases)]
    result: Dict[str, object] = {
        "n_outputs": len(outputs),
        "shapes": [tuple(o.shape) for o in outputs],
        "ref_shapes": [tuple(r.shape) for r in refs],
        "dtypes_ok": all(o.dtype == dtype for o in outputs),
        "rel_err": max(_rel_err(o, r) for o, r in zip(outputs, refs)),
        "max_abs_err": max(_max_abs_err(o, r) for o, r in zip(outputs, refs)),
    }
    if return_gathered:
        result["gathered_shape"] = tuple(gathered.shape)
        result["gathered_ref_shape"] = tuple(full.shape)
        result["gathered_err"] = _max_abs_err(gathered, full.to(dtype)) if gathered.shape == full.shape else None
    else:
        result["gathered_numel"] = gathered.numel()
    return result

# (case id, a shape per rank, N, bias, reduce_op, weight_after_cast, dtype) of matmul_all_reduce_rms_norm
MATMUL_ALL_REDUCE_RMS_NORM_CASES = [
    ("2d_after_cast", (12, 5), 16, False, "sum", True, "fp32"),
    ("3d_before_cast_bias", (2, 3, 8), 24, True, "sum", False, "fp32"),
    ("2d_avg_odd_rows", (5, 8), 8, True, "avg", True, "fp32"),
    ("3d_bf16_after_cast", (2, 4, 16), 32, True, "sum", True, "bf16"),
    ("3d_bf16_before_cast", (2, 4, 16), 32, False, "sum", False, "bf16"),
]


def _partials(a_shape, n: int, has_bias: bool, seed: int, dtype, world: int):
    """Every rank's partial operand [..., K], weight shard [K, n] and bias [n] (or None): the op adds each rank's."""
    k = a_shape[-1]
    a_all = [_randn(a_shape, seed + r, dtype) for r in range(world)]
    w_all = [_randn((k, n), seed + 100 + r, dtype) for r in range(world)]
    b_all = [_randn((n,), seed + 200 + r, dtype) if has_bias else None for r in range(world)]
    return a_all, w_all, b_all


def _matmul_reduce_scatter_case(rank: int, world: int, case) -> Dict[str, object]:
    import torch.distributed as dist

    name, a_shape, n, has_bias, reduce_op, scatter_dim, *more_ks, dtype_name = case
    more_ks = more_ks[0] if more_ks else ()
    dtype = DTYPES[dtype_name]
    a_all, w_all, b_all = _partials(a_shape, n, has_bias, _seed_of(name) + 7, dtype, world)
    more = [_partials(a_shape[:-1] + (k,), n, False, _seed_of(name) + 11 + i, dtype, world)[:2]
            for i, k in enumerate(more_ks)]

    out = torch.ops.fluxinductor.matmul_reduce_scatter(
        a_all[rank], w_all[rank], b_all[rank], reduce_op, scatter_dim, dist.group.WORLD.group_name,
        **({"more_a": [m[0][rank] for m in more], "more_weights": [m[1][rank] for m in more]} if more else {})
    )

    total = sum(
        a.float() @ w.float() + (b.float() if b is not None else 0.0) for a, w, b in zip(a_all, w_all, b_all)
    )
    for more_a, more_w in more:
        total = total + sum(a.float() @ w.float() for a, w in zip(more_a, more_w))
    if reduce_op == "avg":
        total = total / world
    ref = total.chunk(world, dim=scatter_dim)[rank]
    return {
        "shape": tuple(out.shape),
        "ref_shape": tuple(ref.shape),
        "dtype_ok": out.dtype == dtype,
        "rel_err": _rel_err(out, ref) if out.shape == ref.shape else float("inf"),
        "max_abs_err": _max_abs_err(out, ref) if out.shape == ref.shape else float("inf"),
    }


def _matmul_all_reduce_case(rank: int, world: int, case, reduce_scatter_path: bool) -> Dict[str, object]:
    """``reduce_scatter_path``: the dispatcher's matmul_reduce_scatter is replaced by the reference reduce-scatter, as
    if a fused kernel took every call whose rows split, so the op's reduce-scatter + all-gather path runs on CPU."""
    import torch.distributed as dist

    from fluxinductor import dispatch, ops

    name, a_shape, n, has_bias, reduce_op, dtype_name = case
    dtype = DTYPES[dtype_name]
    a_all, w_all, b_all = _partials(a_shape, n, has_bias, _seed_of(name) + 11, dtype, world)
    taken = []

    def fused_reduce_scatter(a, weight, bias, op, scatter_dim, group_name, out_dtype=None):
        taken.append(tuple(a.shape))
        return ops.matmul_reduce_scatter_reference(a, weight, bias, op, scatter_dim, group_name, out_dtype)

    original = dispatch.matmul_reduce_scatter
    if reduce_scatter_path:
        dispatch.matmul_reduce_scatter = fused_reduce_scatter
    try:
        out = torch.ops.fluxinductor.matmul_all_reduce(a_all[rank], w_all[rank], b_all[rank], reduce_op,
                                                       dist.group.WORLD.group_name)
    finally:
        dispatch.matmul_reduce_scatter = original
    total = sum(a.float() @ w.float() + (b.float() if b is not None else 0.0) for a, w, b in zip(a_all, w_all, b_all))
    ref = total / world if reduce_op == "avg" else total
    rows = total.numel() // n
    return {
        "shape": tuple(out.shape),
        "ref_shape": tuple(ref.shape),
        "dtype_ok": out.dtype == dtype,
        "rel_err": _rel_err(out, ref) if out.shape == ref.shape else float("inf"),
        "took_reduce_scatter": bool(taken),
        "rows_split": rows % world == 0,
    }


def _matmul_all_reduce_rms_norm_case(rank: int, world: int, case) -> Dict[str, object]:
    """The op on this rank's operands against fp32: h = residual + all_reduce(a @ w + b) rounded to the dtype, and
    RMSNorm of that h in fp32 (the residual and the norm weight the same on every rank, as replicated activations
    are)."""
    import torch.distributed as dist

    name, a_shape, n, has_bias, reduce_op, after_cast, dtype_name = case
    dtype = DTYPES[dtype_name]
    a_all, w_all, b_all = _partials(a_shape, n, has_bias, _seed_of(name) + 13, dtype, world)
    residual = _randn(tuple(a_shape[:-1]) + (n,), _seed_of(name) + 300, dtype)
    norm_weight = (1 + 0.1 * _randn((n,), _seed_of(name) + 301)).to(dtype)
    h, normed = torch.ops.fluxinductor.matmul_all_reduce_rms_norm(
        a_all[rank], w_all[rank], b_all[rank], reduce_op, dist.group.WORLD.group_name, residual, norm_weight, 1e-5,
        after_cast)
    total = sum(a.float() @ w.float() + (b.float() if b is not None else 0.0) for a, w, b in zip(a_all, w_all, b_all))
    h_ref = ((total / world if reduce_op == "avg" else total) + residual.float()).to(dtype).float()
    normed_ref = h_ref * torch.rsqrt(h_ref.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight.float()
    return {
        "shapes": (tuple(h.shape), tuple(normed.shape)),
        "ref_shape": tuple(h_ref.shape),
        "dtype_ok": h.dtype == dtype and normed.dtype == dtype,
        "contiguous": h.is_contiguous() and normed.is_contiguous(),
        "rel_err": max(_rel_err(h, h_ref), _rel_err(normed, normed_ref)) if h.shape == h_ref.shape else float("inf"),
    }


def _expect_error(fn, exc_type, match: str) -> Optional[str]:
    """None if ``fn()`` raised ``exc_type`` whose message contains ``match``; else what happened."""
    try:
        fn()
    except exc_type as e:  # noqa: PERF203
        return None if match in str(e) else f"{type(e).__name__} without {match!r}: {e}"
    except Exception as e:  # noqa: BLE001
        return f"raised {type(e).__name__} instead of {exc_type.__name__}: {e}"
    return "did not raise"


def _bad_input_checks(rank: int, world: int) -> Dict[str, Optional[str]]:
    """Each bad input must raise a ValueError naming the problem, before any communication."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    group = dist.group.WORLD.group_name
    agm = torch.ops.fluxinductor.all_gather_matmul
    mrs = torch.ops.fluxinductor.matmul_reduce_scatter
    mar = torch.ops.fluxinductor.matmul_all_reduce
    marn = torch.ops.fluxinductor.matmul_all_reduce_rms_norm

    def shard():
        # Made inside each check, so under FakeTensorMode it is a fake tensor too.
        return _randn((4, 8), 1)

    checks = {
        "mismatched_k": lambda: agm(shard(), [_randn((6, 5), 2)], [None], 0, group, False),
        "gather_dim_last": lambda: agm(shard(), [_randn((8, 5), 2)], [None], 1, group, False),
        "gather_dim_out_of_range": lambda: agm(shard(), [_randn((8, 5), 2)], [None], 2, group, False),
        "bias_mismatch": lambda: agm(shard(), [_randn((8, 5), 2)], [_randn((4,), 3)], 0, group, False),
        "weights_biases_lengths": lambda: agm(shard(), [_randn((8, 5), 2)], [], 0, group, False),
        "no_weights": lambda: agm(shard(), [], [], 0, group, False),
        "mrs_mismatched_k": lambda: mrs(_randn((4, 8), 1), _randn((6, 5), 2), None, "sum", 0, group),
        "bad_reduce_op": lambda: mrs(_randn((4, 8), 1), _randn((8, 4), 2), None, "max", 0, group),
        # 5 rows do not split over 2 or 4 ranks.
        "non_dividing_scatter": lambda: mrs(_randn((5, 8), 1), _randn((8, 4), 2), None, "sum", 0, group),
        "more_term_mismatched_n": lambda: mrs(_randn((4, 8), 1), _randn((8, 4), 2), None, "sum", 0, group, None,
                                              [_randn((4, 6), 3)], [_randn((6, 5), 4)]),
        "more_term_rows": lambda: mrs(_randn((4, 8), 1), _randn((8, 4), 2), None, "sum", 0, group, None,
                                      [_randn((2, 6), 3)], [_randn((6, 4), 4)]),
        "more_lengths": lambda: mrs(_randn((4, 8), 1), _randn((8, 4), 2), None, "sum", 0, group, None,
                                    [_randn((4, 6), 3)], []),
        "mar_mismatched_k": lambda: mar(_randn((4, 8), 1), _randn((6, 5), 2), None, "sum", group),
        "mar_bad_reduce_op": lambda: mar(_randn((4, 8), 1), _randn((8, 4), 2), None, "max", group),
        "norm_residual_shape": lambda: marn(_randn((4, 8), 1), _randn((8, 4), 2), None, "sum", group,
                                            _randn((4, 5), 3), _randn((4,), 4), 1e-5, True),
        "norm_weight_shape": lambda: marn(_randn((4, 8), 1), _randn((8, 4), 2), None, "sum", group,
                                          _randn((4, 4), 3), _randn((5,), 4), 1e-5, True),
        "norm_residual_dtype": lambda: marn(_randn((4, 8), 1), _randn((8, 4), 2), None, "sum", group,
                                            _randn((4, 4), 3, torch.bfloat16), _randn((4,), 4), 1e-5, True),
    }
    expected = {
        "mismatched_k": "does not match",
        "gather_dim_last": "last",
        "gather_dim_out_of_range": "out of range",
        "bias_mismatch": "does not match",
        "weights_biases_lengths": "biases",
        "no_weights": "at least one weight",
        "mrs_mismatched_k": "cannot multiply",
        "bad_reduce_op": "reduce_op",
        "non_dividing_scatter": "does not split",
        "more_term_mismatched_n": "cannot add",
        "more_term_rows": "does not match",
        "more_lengths": "further weights",
        "mar_mismatched_k": "cannot multiply",
        "mar_bad_reduce_op": "reduce_op",
        "norm_residual_shape": "does not match the output",
        "norm_weight_shape": "norm weight of shape",
        "norm_residual_dtype": "input's dtype",
    }
    out: Dict[str, Optional[str]] = {}
    for name, fn in checks.items():
        out[name] = _expect_error(fn, ValueError, expected[name])

    # The fake (meta) implementations are what torch.compile sees: they must refuse the same inputs
    # rather than invent an output shape.
    with FakeTensorMode() as mode:
        for name, fn in checks.items():
            out["fake_" + name] = _expect_error(fn, ValueError, expected[name])
    del mode
    return out


def _opcheck(rank: int, world: int) -> Dict[str, str]:
    """torch.library.opcheck on both ops (schema, fake impl, AOT dispatch); {test: error} on failure."""
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    samples = {
        "all_gather_matmul_2d": (
            torch.ops.fluxinductor.all_gather_matmul.default,
            (_randn((3, 8), 1), [_randn((8, 5), 2), _randn((8, 4), 3)], [_randn((5,), 4), None], 0, group, True),
        ),
        "all_gather_matmul_3d_dim1": (
            torch.ops.fluxinductor.all_gather_matmul.default,
            (_randn((2, 3, 8), 1), [_randn((8, 5), 2)], [None], 1, group, False),
        ),
        "matmul_reduce_scatter_2d": (
            torch.ops.fluxinductor.matmul_reduce_scatter.default,
            (_randn((4 * world, 8), 1), _randn((8, 6), 2), _randn((6,), 3), "sum", 0, group),
        ),
        "matmul_reduce_scatter_3d_avg_dim1": (
            torch.ops.fluxinductor.matmul_reduce_scatter.default,
            (_randn((2, 2 * world, 8), 1), _randn((8, 6), 2), None, "avg", 1, group),
        ),
        "matmul_reduce_scatter_sum_of_2": (
            torch.ops.fluxinductor.matmul_reduce_scatter.default,
            (_randn((2, 2 * world, 8), 1), _randn((8, 6), 2), _randn((6,), 3), "sum", 1, group, None,
             [_randn((2, 2 * world, 4), 4)], [_randn((4, 6), 5)]),
        ),
        "matmul_all_reduce_2d": (
            torch.ops.fluxinductor.matmul_all_reduce.default,
            (_randn((4 * world, 8), 1), _randn((8, 6), 2), _randn((6,), 3), "sum", group),
        ),
        "matmul_all_reduce_3d_avg": (
            torch.ops.fluxinductor.matmul_all_reduce.default,
            (_randn((2, 3, 8), 1), _randn((8, 6), 2), None, "avg", group),
        ),
        "matmul_all_reduce_rms_norm_3d": (
            torch.ops.fluxinductor.matmul_all_reduce_rms_norm.default,
            (_randn((2, 3, 8), 1), _randn((8, 6), 2), _randn((6,), 3), "sum", group, _randn((2, 3, 6), 4),
             _randn((6,), 5), 1e-5, False),
        ),
    }
    failures: Dict[str, str] = {}
    for name, (op, args) in samples.items():
        results = torch.library.opcheck(op, args)
        for test, status in results.items():
            if status != "SUCCESS":
                failures[f"{name}:{test}"] = str(status)
    return failures


def _ops_job(rank: int, world: int) -> Dict[str, object]:
    import fluxinductor  # noqa: F401  (registers the ops)

    torch.manual_seed(0)
    result: Dict[str, object] = {"agm": {}, "mrs": {}, "mar": {}, "marn": {}}
    for case in ALL_GATHER_MATMUL_CASES:
        result["agm"][case[0]] = _all_gather_matmul_case(rank, world, case)
    for case in MATMUL_REDUCE_SCATTER_CASES:
        result["mrs"][case[0]] = _matmul_reduce_scatter_case(rank, world, case)
    for case in MATMUL_ALL_REDUCE_CASES:
        for rs_path in (False, True):
            result["mar"][(case[0], rs_path)] = _matmul_all_reduce_case(rank, world, case, rs_path)
    for case in MATMUL_ALL_REDUCE_RMS_NORM_CASES:
        result["marn"][case[0]] = _matmul_all_reduce_rms_norm_case(rank, world, case)
    result["bad"] = _bad_input_checks(rank, world)
    result["opcheck"] = _opcheck(rank, world)
    return result


@functools.lru_cache(maxsize=None)
def _ops_results(world: int) -> Tuple[Dict[str, object], ...]:
    return tuple(run_ranks(_ops_job, world, timeout=240))


WORLDS = [1, 2, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ALL_GATHER_MATMUL_CASES, ids=[c[0] for c in ALL_GATHER_MATMUL_CASES])
def test_all_gather_matmul_matches_reference(world, case):
    name, _, _, widths, _, return_gathered, dtype_name = case
    tol = FP32_TOL if dtype_name == "fp32" else BF16_TOL
    for rank, per_rank in enumerate(_ops_results(world)):
        r = per_rank["agm"][name]
        assert r["n_outputs"] == len(widths)
        assert r["shapes"] == r["ref_shapes"], f"rank {rank}"
        assert r["dtypes_ok"], f"rank {rank}: output dtype differs from the input dtype"
        assert r["rel_err"] <= tol, f"rank {rank}: relative error {r['rel_err']:.3g} > {tol}"
        if dtype_name == "fp32":
            assert r["max_abs_err"] <= FP32_TOL * 100, f"rank {rank}: max abs error {r['max_abs_err']:.3g}"
        if return_gathered:
            assert r["gathered_shape"] == r["gathered_ref_shape"], f"rank {rank}"
            assert r["gathered_err"] == 0.0, f"rank {rank}: gathered tensor differs from torch.cat of shards"
        else:
            assert r["gathered_numel"] == 0, f"rank {rank}: return_gathered=False must return an empty tensor"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "case", MATMUL_REDUCE_SCATTER_CASES, ids=[c[0] for c in MATMUL_REDUCE_SCATTER_CASES]
)
def test_matmul_reduce_scatter_matches_reference(world, case):
    name, dtype_name = case[0], case[-1]
    tol = FP32_TOL if dtype_name == "fp32" else BF16_TOL
    for rank, per_rank in enumerate(_ops_results(world)):
        r = per_rank["mrs"][name]
        assert r["shape"] == r["ref_shape"], f"rank {rank}"
        assert r["dtype_ok"], f"rank {rank}: output dtype differs from the input dtype"
        assert r["rel_err"] <= tol, f"rank {rank}: relative error {r['rel_err']:.3g} > {tol}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("reduce_scatter_path", [False, True], ids=["dispatch", "fused_reduce_scatter"])
@pytest.mark.parametrize("case", MATMUL_ALL_REDUCE_CASES, ids=[c[0] for c in MATMUL_ALL_REDUCE_CASES])
def test_matmul_all_reduce_matches_reference(world, case, reduce_scatter_path):
    name, dtype_name = case[0], case[-1]
    tol = FP32_TOL if dtype_name == "fp32" else BF16_TOL
    for rank, per_rank in enumerate(_ops_results(world)):
        r = per_rank["mar"][(name, reduce_scatter_path)]
        assert r["shape"] == r["ref_shape"], f"rank {rank}"
        assert r["dtype_ok"], f"rank {rank}: output dtype differs from the input dtype"
        assert r["rel_err"] <= tol, f"rank {rank}: relative error {r['rel_err']:.3g} > {tol}"
        # The reduce-scatter path is asked only where the rows split over the group.
        assert r["took_reduce_scatter"] == (reduce_scatter_path and r["rows_split"]), f"rank {rank}: {r}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", MATMUL_ALL_REDUCE_RMS_NORM_CASES, ids=[c[0] for c in MATMUL_ALL_REDUCE_RMS_NORM_CASES])
def test_matmul_all_reduce_rms_norm_matches_reference(world, case):
    tol = FP32_TOL if case[-1] == "fp32" else BF16_TOL
    for rank, per_rank in enumerate(_ops_results(world)):
        r = per_rank["marn"][case[0]]
        assert r["shapes"] == (r["ref_shape"], r["ref_shape"]), f"rank {rank}: {r}"
        assert r["dtype_ok"] and r["contiguous"], f"rank {rank}: {r}"
        assert r["rel_err"] <= tol, f"rank {rank}: relative error {r['rel_err']:.3g} > {tol}"


@pytest.mark.parametrize("world", [1, 2])
def test_opcheck(world):
    for rank, per_rank in enumerate(_ops_results(world)):
        assert per_rank["opcheck"] == {}, f"rank {rank}: opcheck failures {per_rank['opcheck']}"


BAD_INPUTS = [
    "mismatched_k",
    "gather_dim_last",
    "gather_dim_out_of_range",
    "bias_mismatch",
    "weights_biases_lengths",
    "no_weights",
    "mrs_mismatched_k",
    "bad_reduce_op",
    "non_dividing_scatter",
    "more_term_mismatched_n",
    "more_term_rows",
    "more_lengths",
    "mar_mismatched_k",
    "mar_bad_reduce_op",
    "norm_residual_shape",
    "norm_weight_shape",
    "norm_residual_dtype",
]


@pytest.mark.parametrize("path", ["eager", "fake"])
@pytest.mark.parametrize("check", BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(check, path):
    key = check if path == "eager" else "fake_" + check
    for rank, per_rank in enumerate(_ops_results(2)):
        assert per_rank["bad"][key] is None, f"rank {rank}, {path}: {check}: {per_rank['bad'][key]}"


@pytest.mark.parametrize("op, args", [
    ("all_gather_matmul", lambda w: (torch.randn(4, 8), [w], [None], 0, "no-group", False)),
    ("matmul_reduce_scatter", lambda w: (torch.randn(4, 8), w, None, "sum", 0, "no-group")),
    ("matmul_all_reduce", lambda w: (torch.randn(4, 8), w, None, "sum", "no-group")),
    ("matmul_all_reduce_rms_norm", lambda w: (torch.randn(4, 8), w, None, "sum", "no-group", torch.randn(4, 6),
                                              torch.randn(6), 1e-5, True)),
])
def test_ops_refuse_inputs_that_need_grad(op, args):
    """The ops have no autograd formula (the passes insert them into graphs AOTAutograd has already differentiated):
    an input that needs a gradient is refused with a clear error, not given a silently wrong (missing) gradient."""
    weight = torch.randn(8, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="has no autograd formula"):
        getattr(torch.ops.fluxinductor, op)(*args(weight))
    with torch.no_grad(), pytest.raises(Exception) as info:  # past the refusal: the group does not exist
        getattr(torch.ops.fluxinductor, op)(*args(weight))
    assert "autograd" not in str(info.value)
