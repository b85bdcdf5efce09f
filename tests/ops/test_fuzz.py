"""A seeded fuzz of the fused ops' decomposed path (CPU, 2 gloo ranks) against an fp32 reference.

Each case draws M, K, N from sizes around tiles and primes (1, 3, 7, 127, 128, 129, ...), a dtype (bf16, fp16, fp32),
a bias or none, non-contiguous operands (a transposed weight, a strided shard), 1-3 weights per all-gather, gather and
scatter dims of 3-D operands, ``sum`` / ``avg`` and autocast's fp32 reduction (``out_dtype``).  Every rank builds every
rank's operands from the case's seed, so the reference (the gathered or reduced matmul in fp32 from the same rounded
operands) needs no communication.  A failure names the case's seed: ``_case(seed)`` rebuilds it.
"""

from __future__ import annotations

import functools
import random
import time
from typing import Dict, List, Tuple

import torch

from _dist import run_ranks

WORLD = 2
SEED = 20260
CASES = 400
SIZES = (1, 2, 3, 5, 7, 8, 13, 16, 31, 64, 127, 128, 129)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# ||out - ref|| / ||ref|| allowed: the op rounds its matmul (and, for a reduction, each partial and the sum) to dtype.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-5}


def _randn(shape, g: torch.Generator, dtype, transposed: bool = False, strided: bool = False) -> torch.Tensor:
    """Values offset from zero (a dropped term shows); ``transposed``: a [.., a, b] view of a [.., b, a] tensor;
    ``strided``: every other column of a wider tensor."""
    shape = list(shape)
    if transposed and len(shape) >= 2:
        return _randn(shape[:-2] + [shape[-1], shape[-2]], g, dtype).transpose(-1, -2)
    if strided:
        return _randn(shape[:-1] + [2 * shape[-1]], g, dtype)[..., ::2]
    return (torch.randn(shape, generator=g) + 0.5).to(dtype)


def _case(seed: int) -> Dict[str, object]:
    """The case drawn from ``seed``: op, arguments and every rank's operands (the same on every rank)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    op = rng.choice(("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"))
    dtype = rng.choice(DTYPES)
    k, n = rng.choice(SIZES), rng.choice(SIZES)
    three_d = rng.random() < 0.4
    layout = {"transposed": rng.random() < 0.3, "strided": rng.random() < 0.3}
    case: Dict[str, object] = {"seed": seed, "op": op, "dtype": dtype, "k": k, "n": n, "layout": layout}
    if op == "all_gather_matmul":
        rows = rng.choice(SIZES)
        shape = (rng.choice((1, 2, 3)), rows, k) if three_d else (rows, k)
        widths = [rng.choice(SIZES) for _ in range(rng.choice((1, 1, 2, 3)))]
        has_bias = [rng.random() < 0.5 for _ in widths]
        case.update(gather_dim=rng.randrange(len(shape) - 1), return_gathered=rng.random() < 0.5,
                    shards=[_randn(shape, g, dtype, **layout) for _ in range(WORLD)],
                    weights=[[_randn((k, w), g, dtype, transposed=rng.random() < 0.5) for w in widths]
                             for _ in range(WORLD)],
                    biases=[[_randn((w,), g, dtype) if b else None for w, b in zip(widths, has_bias)]
                            for _ in range(WORLD)])
        # Column parallel: the weights and biases are this rank's; every rank's have the same shapes.
        return case
    rows = rng.choice(SIZES)
    if op == "matmul_reduce_scatter":
        scatter_dim = rng.randrange(3 if three_d else 2)
        shape = [rng.choice((1, 2, 3)), rows, k] if three_d else [rows, k]
        if scatter_dim < len(shape) - 1:
            shape[scatter_dim] *= WORLD  # the scattered dim splits over the ranks
        elif n % WORLD:
            n += 1  # scattering the output's last (N) dim
        case.update(scatter_dim=scatter_dim, n=n)
    else:
        shape = [rng.choice((1, 2, 3)), rows, k] if three_d else [rows, k]
    with_bias = rng.random() < 0.5
    case.update(reduce_op=rng.choice(("sum", "avg")),
                out_dtype=torch.float32 if dtype != torch.float32 and rng.random() < 0.3 else None,
                partials=[_randn(shape, g, dtype, **layout) for _ in range(WORLD)],
                weights=[_randn((k, n), g, dtype, transposed=rng.random() < 0.5) for _ in range(WORLD)],
                biases=[_randn((n,), g, dtype) if with_bias else None for _ in range(WORLD)])
    return case


def _reference(case: Dict[str, object], rank: int) -> List[torch.Tensor]:
    """The op's outputs on ``rank`` in fp32, from the same (rounded) operands."""
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    if case["op"] == "all_gather_matmul":
        gathered = torch.cat([s.float() for s in case["shards"]], dim=case["gather_dim"])
        outs = [gathered @ w.float() + (0 if b is None else b.float())
                for w, b in zip(case["weights"][rank], case["biases"][rank])]
        return outs + ([gathered] if case["return_gathered"] else [])
    total = sum(a.float() @ w.float() + (0 if b is None else f32(b))
                for a, w, b in zip(case["partials"], case["weights"], case["biases"]))
    if case["reduce_op"] == "avg":
        total = total / WORLD
    if case["op"] == "matmul_all_reduce":
        return [total]
    return [total.chunk(WORLD, dim=case["scatter_dim"])[rank]]


def _run(case: Dict[str, object], rank: int, group_name: str) -> List[torch.Tensor]:
    ops = torch.ops.fluxinductor
    if case["op"] == "all_gather_matmul":
        outs, gathered = ops.all_gather_matmul(case["shards"][rank], case["weights"][rank], case["biases"][rank],
                                               case["gather_dim"], group_name, case["return_gathered"])
        return list(outs) + ([gathered] if case["return_gathered"] else [])
    args = (case["partials"][rank], case["weights"][rank], case["biases"][rank], case["reduce_op"])
    if case["op"] == "matmul_reduce_scatter":
        return [ops.matmul_reduce_scatter(*args, case["scatter_dim"], group_name, case["out_dtype"])]
    return [ops.matmul_all_reduce(*args, group_name, case["out_dtype"])]


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _describe(case: Dict[str, object]) -> str:
    keys = ("op", "dtype", "k", "n", "gather_dim", "scatter_dim", "reduce_op", "out_dtype", "return_gathered", "layout")
    shapes = [tuple(t.shape) for t in case.get("shards", case.get("partials"))[:1]]
    return f"seed {case['seed']}: " + ", ".join(f"{k}={case[k]}" for k in keys if k in case) + f", operand {shapes}"


def _fuzz_job(rank: int, world: int, first_seed: int, count: int) -> Dict[str, object]:
    import torch.distributed as dist

    import fluxinductor.ops  # noqa: F401 - registers torch.ops.fluxinductor

    name = dist.group.WORLD.group_name
    failures: List[str] = []
    counted: Dict[str, int] = {}
    cpu_seconds: Dict[str, float] = {}
    start = time.process_time()
    with torch.no_grad():
        for seed in range(first_seed, first_seed + count):
            case = _case(seed)
            counted[case["op"]] = counted.get(case["op"], 0) + 1
            expected = _reference(case, rank)
            op_start = time.process_time()
            try:
                got = _run(case, rank, name)
            except Exception as e:  # noqa: BLE001 - every rank reports; the case is the same on every rank
                failures.append(f"{_describe(case)}: raised {type(e).__name__}: {e}")
                continue
            finally:
                where = f"{case['op']} {str(case['dtype']).replace('torch.', '')}"
                cpu_seconds[where] = cpu_seconds.get(where, 0.0) + time.process_time() - op_start
            out_dtype = case.get("out_dtype") or case["dtype"]
            for i, (out, ref) in enumerate(zip(got, expected)):
                if out.shape != ref.shape or out.dtype != out_dtype:
                    failures.append(f"{_describe(case)}: output {i} is {tuple(out.shape)} {out.dtype}, expected "
                                    f"{tuple(ref.shape)} {out_dtype}")
                    continue
                err = _error(out, ref)
                if not err <= TOLERANCE[case["dtype"]]:
                    failures.append(f"{_describe(case)}: output {i} error {err:.3g}")
    cpu_seconds["total"] = time.process_time() - start
    return {"failures": failures, "cases": counted, "cpu_seconds": cpu_seconds}


@functools.lru_cache(maxsize=None)
def _results() -> Tuple[Dict[str, object], ...]:
    return tuple(run_ranks(_fuzz_job, WORLD, SEED, CASES, timeout=240))


def test_fuzz_decomposed_ops_match_an_fp32_reference():
    for rank, r in enumerate(_results()):
        assert r["failures"] == [], f"rank {rank}: {len(r['failures'])} of {CASES} failed:\n" + "\n".join(
            r["failures"][:20])


def test_fuzz_covers_every_op():
    for r in _results():
        assert sum(r["cases"].values()) == CASES
        assert min(r["cases"].get(op, 0) for op in ("all_gather_matmul", "matmul_reduce_scatter",
                                                     "matmul_all_reduce")) >= CASES // 5, r["cases"]


def test_a_case_is_rebuilt_from_its_seed():
    a, b = _case(SEED + 7), _case(SEED + 7)
    assert a["op"] == b["op"] and a["dtype"] == b["dtype"]
    key = "shards" if a["op"] == "all_gather_matmul" else "partials"
    assert all(torch.equal(x, y) for x, y in zip(a[key], b[key]))
