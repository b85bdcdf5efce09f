"""The fused ops' seeded fuzz, shared by the CPU suite (tests/ops/test_fuzz.py: 2 gloo ranks, the decomposed path) and
the GPU run (tests/gpu/run_fuzz_2rank.py: 2 NCCL ranks, the fused kernels and their transports).

Each case draws M, K, N from a size set (around tiles and primes), a dtype (bf16, fp16, fp32), a bias or none,
non-contiguous operands (a transposed weight, a strided shard), 1-3 weights per all-gather, gather and scatter dims of
3-D operands, ``sum`` / ``avg`` and autocast's fp32 reduction (``out_dtype``).  Every rank builds every rank's operands
from the case's seed, so the reference (the gathered or reduced matmul in fp32 from the same rounded operands) needs no
communication.  ``make_case(seed, sizes, world, device, max_work)`` rebuilds a case: the draws come from
``random.Random(seed)`` and the operands from a ``torch.Generator`` of ``device`` seeded with ``seed``, so a seed names
the same case on the same kind of device.
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Sequence, Tuple

import torch

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
SIZES = (1, 2, 3, 5, 7, 8, 13, 16, 31, 64, 127, 128, 129)  # the CPU suite's
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# ||out - ref|| / ||ref|| allowed: the op rounds its matmul (and, for a reduction, each partial and the sum) to dtype.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-5}


def randn(shape, g: torch.Generator, dtype, transposed: bool = False, strided: bool = False) -> torch.Tensor:
    """Values offset from zero (a dropped term shows) on ``g``'s device; ``transposed``: a [.., a, b] view of a
    [.., b, a] tensor; ``strided``: every other column of a wider tensor."""
    shape = list(shape)
    if transposed and len(shape) >= 2:
        return randn(shape[:-2] + [shape[-1], shape[-2]], g, dtype).transpose(-1, -2)
    if strided:
        return randn(shape[:-1] + [2 * shape[-1]], g, dtype)[..., ::2]
    return (torch.randn(shape, generator=g, device=g.device) + 0.5).to(dtype)


def draw(rng: random.Random, sizes: Sequence[int], world: int,
         dim_sizes: Optional[Sequence[int]] = None) -> Dict[str, object]:
    """Every random choice of a case but its operands' values, in the order the suite's seeds were drawn in: rows from
    ``sizes``, K and N (each weight's width) from ``dim_sizes`` (default ``sizes``)."""
    dim_sizes = sizes if dim_sizes is None else dim_sizes
    op = rng.choice(OPS)
    dtype = rng.choice(DTYPES)
    k, n = rng.choice(dim_sizes), rng.choice(dim_sizes)
    three_d = rng.random() < 0.4
    layout = {"transposed": rng.random() < 0.3, "strided": rng.random() < 0.3}
    spec: Dict[str, object] = {"op": op, "dtype": dtype, "k": k, "n": n, "layout": layout, "world": world}
    rows = rng.choice(sizes)
    if op == "all_gather_matmul":
        shape = (rng.choice((1, 2, 3)), rows, k) if three_d else (rows, k)
        widths = [rng.choice(dim_sizes) for _ in range(rng.choice((1, 1, 2, 3)))]
        has_bias = [rng.random() < 0.5 for _ in widths]
        spec.update(shape=shape, widths=widths, has_bias=has_bias, gather_dim=rng.randrange(len(shape) - 1),
                    return_gathered=rng.random() < 0.5,
                    transposed_weights=_same_on_every_rank([[rng.random() < 0.5 for _ in widths]
                                                            for _ in range(world)]))
        return spec
    if op == "matmul_reduce_scatter":
        scatter_dim = rng.randrange(3 if three_d else 2)
        shape = [rng.choice((1, 2, 3)), rows, k] if three_d else [rows, k]
        if scatter_dim < len(shape) - 1:
            shape[scatter_dim] *= world  # the scattered dim splits over the ranks
        elif n % world:
            n += world - n % world  # scattering the output's last (N) dim
        spec.update(scatter_dim=scatter_dim, n=n)
    else:
        shape = [rng.choice((1, 2, 3)), rows, k] if three_d else [rows, k]
    spec.update(shape=shape, with_bias=rng.random() < 0.5, reduce_op=rng.choice(("sum", "avg")),
                out_dtype=torch.float32 if dtype != torch.float32 and rng.random() < 0.3 else None,
                transposed_weights=_same_on_every_rank([rng.random() < 0.5 for _ in range(world)]))
    return spec


def _same_on_every_rank(per_rank: list) -> list:
    """Rank 0's draw for every rank (the draws stay, so every later choice of a seed is unchanged): the ranks of a
    tensor-parallel program hold their operands in one layout, and ranks that do not are refused by the agreement
    check (``tests/ops/test_agreement.py``), not fuzzed."""
    return [per_rank[0]] * len(per_rank)


def work(spec: Dict[str, object]) -> int:
    """M * K * N of the case's global matmul(s): gathered rows x K x the weights' widths for an all-gather, rows x
    (world * K) x N for a reduction."""
    rows = 1
    for size in spec["shape"][:-1]:
        rows *= size
    if spec["op"] == "all_gather_matmul":
        return spec["world"] * rows * spec["k"] * sum(spec["widths"])
    return rows * spec["world"] * spec["k"] * spec["n"]


def make_case(seed: int, sizes: Sequence[int] = SIZES, world: int = 2, device="cpu",
              max_work: Optional[int] = None, dim_sizes: Optional[Sequence[int]] = None) -> Dict[str, object]:
    """The case drawn from ``seed``: op, arguments and every rank's operands on ``device`` (the same on every rank);
    rows from ``sizes``, K and N from ``dim_sizes`` (default ``sizes``).  Where :func:`work` exceeds ``max_work`` the
    choices are drawn again (from ``"<seed>/<attempt>"``) until it does not; the operands always come from ``seed``."""
    spec = draw(random.Random(seed), sizes, world, dim_sizes)
    attempt = 0
    while max_work is not None and work(spec) > max_work:
        attempt += 1
        spec = draw(random.Random(f"{seed}/{attempt}"), sizes, world, dim_sizes)
    g = torch.Generator(device=device).manual_seed(seed)
    dtype, k, n, layout, shape = spec["dtype"], spec["k"], spec["n"], spec["layout"], spec["shape"]
    case = {key: spec[key] for key in ("op", "dtype", "k", "n", "layout", "world", "gather_dim", "return_gathered",
                                      "scatter_dim", "reduce_op", "out_dtype") if key in spec}
    case.update(seed=seed, attempt=attempt)
    if spec["op"] == "all_gather_matmul":
        # Column parallel: the weights and biases are this rank's; every rank's have the same shapes.
        case["shards"] = [randn(shape, g, dtype, **layout) for _ in range(world)]
        case["weights"] = [[randn((k, w), g, dtype, transposed=t) for w, t in zip(spec["widths"], transposed)]
                           for transposed in spec["transposed_weights"]]
        case["biases"] = [[randn((w,), g, dtype) if b else None for w, b in zip(spec["widths"], spec["has_bias"])]
                          for _ in range(world)]
        return case
    case["partials"] = [randn(shape, g, dtype, **layout) for _ in range(world)]
    case["weights"] = [randn((k, n), g, dtype, transposed=t) for t in spec["transposed_weights"]]
    case["biases"] = [randn((n,), g, dtype) if spec["with_bias"] else None for _ in range(world)]
    return case


def reference(case: Dict[str, object], rank: int) -> List[torch.Tensor]:
    """The op's outputs on ``rank`` in fp32, from the same (rounded) operands."""
    world = case["world"]
    if case["op"] == "all_gather_matmul":
        gathered = torch.cat([s.float() for s in case["shards"]], dim=case["gather_dim"])
        outs = [gathered @ w.float() + (0 if b is None else b.float())
                for w, b in zip(case["weights"][rank], case["biases"][rank])]
        return outs + ([gathered] if case["return_gathered"] else [])
    total = sum(a.float() @ w.float() + (0 if b is None else b.float())
                for a, w, b in zip(case["partials"], case["weights"], case["biases"]))
    if case["reduce_op"] == "avg":
        total = total / world
    if case["op"] == "matmul_all_reduce":
        return [total]
    return [total.chunk(world, dim=case["scatter_dim"])[rank]]


def run_op(case: Dict[str, object], rank: int, group_name: str) -> List[torch.Tensor]:
    """The op's outputs on ``rank`` (the all-gather's gathered input last, where returned)."""
    ops = torch.ops.fluxinductor
    if case["op"] == "all_gather_matmul":
        outs, gathered = ops.all_gather_matmul(case["shards"][rank], case["weights"][rank], case["biases"][rank],
                                               case["gather_dim"], group_name, case["return_gathered"])
        return list(outs) + ([gathered] if case["return_gathered"] else [])
    args = (case["partials"][rank], case["weights"][rank], case["biases"][rank], case["reduce_op"])
    if case["op"] == "matmul_reduce_scatter":
        return [ops.matmul_reduce_scatter(*args, case["scatter_dim"], group_name, case["out_dtype"])]
    return [ops.matmul_all_reduce(*args, group_name, case["out_dtype"])]


def error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32 (NaN where ``out`` holds a NaN)."""
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_outputs(case: Dict[str, object], got: List[torch.Tensor], expected: List[torch.Tensor]
                  ) -> Tuple[List[str], float]:
    """(failures, the largest error): each output's shape, dtype and error against the reference within
    :data:`TOLERANCE` of the case's dtype."""
    failures: List[str] = []
    worst = 0.0
    out_dtype = case.get("out_dtype") or case["dtype"]
    if len(got) != len(expected):
        failures.append(f"{describe(case)}: {len(got)} outputs, expected {len(expected)}")
    for i, (out, ref) in enumerate(zip(got, expected)):
        if out.shape != ref.shape or out.dtype != out_dtype:
            failures.append(f"{describe(case)}: output {i} is {tuple(out.shape)} {out.dtype}, expected "
                            f"{tuple(ref.shape)} {out_dtype}")
            continue
        err = error(out, ref)
        worst = max(worst, err) if err == err else float("nan")
        if not err <= TOLERANCE[case["dtype"]]:
            failures.append(f"{describe(case)}: output {i} error {err:.3g}")
    return failures, worst


def describe(case: Dict[str, object]) -> str:
    keys = ("op", "dtype", "k", "n", "gather_dim", "scatter_dim", "reduce_op", "out_dtype", "return_gathered", "layout")
    shapes = [tuple(t.shape) for t in case.get("shards", case.get("partials"))[:1]]
    weights = case["weights"][0] if case["op"] == "all_gather_matmul" else case["weights"][:1]
    widths = [tuple(w.shape) for w in weights]
    return (f"seed {case['seed']}: " + ", ".join(f"{k}={case[k]}" for k in keys if k in case)
            + f", operand {shapes}, weights {widths}")
