"""Seeded fuzz of the fused kernels with N ranks simulated on one GPU.

tests/_fuzz.py fuzzes the ops between real ranks (two GPUs); this fuzzes the kernels' own combinations on one, through
the simulations the kernel tests use (tests/gpu/test_gemm_rs.py's ``_simulate``, tests/gpu/test_ag_gemm.py's
``run_ranks_on_one_gpu``: every rank's buffers on the one device, each rank on its own streams).

* GEMM+RS cases draw the transport (NVLink stores, copy engine, split), the split's configuration, tail split and
  bands, 2-4 ranks, rows per rank around the tiles, K and N, both weight layouts, bias, ``sum`` / ``avg``, autocast's
  fp32 result, a batch-major operand, and a sum's further terms as K slabs of the split GEMMs.
* AG+GEMM cases draw the push (step by step, or one host call with each of its gathered-A modes; rank-major or
  batch-major blocks) or the pull, row chunks or column (K) chunks, 1-3 weights of both layouts, bias.

A case the kernel module refuses (its ``*_reason`` functions) is counted with the reason and not run.  Every other
case must write every output (poisoned with NaN first) within 1e-2 (the norm of the difference over the reference's)
of the fp32 reference, with no error word and no timed-out wait (5 s).  An fp32 result of half-precision operands
must also hold the arithmetic it promises (:func:`fp32_result_error`).

``pytest tests/gpu/test_kernel_fuzz.py`` runs the first :data:`CASES` seeds of each op.  A campaign:
``python tests/gpu/test_kernel_fuzz.py --cases 2000 --out fuzz.json`` (per op and kind of case, how many passed and
the worst error; every failed case's draw; ``--per-case``: every case's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from typing import Dict, List, Optional

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # run as a script: the kernel tests' simulations are siblings
    sys.path.insert(0, HERE)

CASES = 300  # per op, in the GPU suite (about 2 s each on an H200)

ROWS = (1, 7, 64, 127, 128, 129, 200, 256, 300, 640, 1000, 2049)  # per rank, around the 128-row tiles
KS = (8, 16, 64, 72, 128, 264, 520, 1032, 2048)  # multiples of 8 (TMA's 16-byte rows)
NS = (8, 16, 136, 192, 256, 520, 1000, 1001, 1032, 1280, 2048)  # 192: the ping-pong tile; 1001: odd
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _pick(rng: random.Random, options, weights):
    return rng.choices(options, weights=weights)[0]


def draw_gemm_rs(seed: int) -> Dict[str, object]:
    """Every choice of a GEMM+RS case (JSON-able; the operands come from ``_simulate``'s seeds)."""
    rng = random.Random(seed)
    world = _pick(rng, (2, 3, 4), (2, 1, 1))
    transport = _pick(rng, ("store", "copy", "split"), (1, 1, 2))
    dtype = _pick(rng, ("bf16", "fp16"), (3, 1))
    k_major = rng.random() < 0.5
    batch_rows = rng.choice((128, 256)) if rng.random() < 0.25 else 0
    rows = batch_rows * rng.choice((1, 2, 3)) if batch_rows else rng.choice(ROWS)
    slab_ks: List[int] = []
    if transport == "split" and rng.random() < 0.3:  # every term's K but the last a multiple of the tile K (64)
        k = rng.choice((64, 128, 256, 512))
        slab_ks = [rng.choice((64, 128, 256)) for _ in range(rng.choice((0, 1)))] + [rng.choice((8, 72, 128, 264))]
    else:
        k = rng.choice(KS)
    n = rng.choice(NS)
    if n % 8 and (transport == "split" or not k_major):  # 16-byte rows of the N-major weight, the split's stores
        n += 8 - n % 8
    split_fp32 = transport == "split" and dtype == "bf16" and world == 2 and not k_major
    out_fp32 = rng.random() < (0.4 if split_fp32 else 0.25 if transport != "split" else 0)
    spec = {"op": "matmul_reduce_scatter", "seed": seed, "world": world, "transport": transport, "dtype": dtype,
            "rows": rows, "k": k, "n": n, "k_major": k_major, "bias": rng.random() < 0.5,
            "reduce_op": rng.choice(("sum", "avg")), "out_fp32": out_fp32, "batch_rows": batch_rows,
            "slab_ks": slab_ks, "bands": rng.choice((1, 3, 4, 32)), "config": None, "tail_split": None}
    if transport == "split":
        spec["config"] = rng.choice((0, 2)) if dtype == "bf16" else 0
        spec["tail_split"] = rng.choice((1, 2, 4)) if spec["config"] == 0 else 1
    return spec


def draw_all_gather(seed: int) -> Dict[str, object]:
    """Every choice of an AG+GEMM case."""
    rng = random.Random(seed)
    world = _pick(rng, (2, 3, 4), (2, 1, 1))
    push = rng.random() < 0.7
    k_chunks = _pick(rng, (1, 2, 4, 16), (5, 1, 1, 1))
    batch_rows = rng.choice((128, 256)) if push and rng.random() < 0.3 else 0
    if batch_rows:
        shard_rows = batch_rows * rng.choice((1, 2, 3))
    elif push:  # the push takes shards of whole 128-row tiles
        shard_rows = 128 * rng.choice((1, 2, 3, 5, 8))
    else:
        shard_rows = rng.choice((1, 7, 100, 129, 300, 1000))
    return {"op": "all_gather_matmul", "seed": seed, "world": world, "dtype": _pick(rng, ("bf16", "fp16"), (3, 1)),
            "push": push, "one_call": rng.choice((False, "gathered", "copies", "buffer")) if push else False,
            "shard_rows": shard_rows, "batch_rows": batch_rows, "k": rng.choice(KS),
            "ns": [rng.choice([n for n in NS if n % 8 == 0]) for _ in range(_pick(rng, (1, 2, 3), (2, 1, 1)))],
            "bias": rng.random() < 0.5, "k_chunks": k_chunks, "chunks": 1 if k_chunks > 1 else rng.choice((1, 2, 3))}


def _gemm_rs_refusal(spec: Dict[str, object]) -> Optional[str]:
    """The kernel module's reason for not running the case, or None (shapes and layouts only: checked on empty
    tensors of the case's shapes)."""
    from fluxinductor.kernels import gemm_rs, gemm_rs_split
    from test_gemm_rs import make_weight

    dtype, world = DTYPES[spec["dtype"]], spec["world"]
    m = world * spec["rows"]
    a = torch.empty(m, spec["k"], dtype=dtype, device="cuda")
    w = make_weight(spec["k"], spec["n"], spec["k_major"], dtype, "cuda")
    bias = torch.empty(spec["n"], dtype=dtype, device="cuda") if spec["bias"] else None
    out_dtype = torch.float32 if spec["out_fp32"] else None
    why = gemm_rs.unsupported_reason(a, w, bias, spec["reduce_op"], None, out_dtype)
    if why is None and spec["transport"] == "split":
        why = gemm_rs_split.split_reason(world, w, bias, None, out_dtype)
        if why is None and spec["slab_ks"]:
            more = [(torch.empty(m, ks, dtype=dtype, device="cuda"), make_weight(ks, spec["n"], spec["k_major"],
                                                                                 dtype, "cuda"))
                    for ks in spec["slab_ks"]]
            why = gemm_rs_split.slabs_reason(a, w, more)
    if why is None and spec["batch_rows"]:
        why = gemm_rs.batch_major_reason(a, spec["batch_rows"], world)
    return why


def run_gemm_rs(spec: Dict[str, object]) -> Dict[str, object]:
    """Run one GEMM+RS case: {"refused": reason} or {"error": relative error}; raises on a failed call."""
    from fluxinductor import settings
    from test_gemm_rs import _simulate

    why = _gemm_rs_refusal(spec)
    if why is not None:
        return {"refused": why}
    dtype = DTYPES[spec["dtype"]]
    split = spec["transport"] == "split"
    tuning = {"gemm_rs_bands": spec["bands"]}
    if split:
        tuning.update(gemm_rs_split_config=spec["config"], gemm_rs_tail_split=spec["tail_split"])
    measure = fp32_result_error if spec["out_fp32"] else None
    with settings.override(**tuning):
        error = _simulate(spec["world"], spec["world"] * spec["rows"], spec["k"], spec["n"], dtype=dtype,
                          k_major=spec["k_major"], with_bias=spec["bias"], reduce_op=spec["reduce_op"], calls=2,
                          copy_engine=spec["transport"] == "copy", split=split,
                          out_dtype=torch.float32 if spec["out_fp32"] else None, batch_rows=spec["batch_rows"],
                          slab_ks=tuple(spec["slab_ks"]), own_exact=split and spec["out_fp32"], measure=measure)
    return {"error": error}


def fp32_result_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """A rank's fp32 result against the fp32 sum of its partials, rounded as the transport rounds them: the relative
    error of the whole, after checking that the elements agree to fp32 precision (median relative error under 1e-5;
    a result stored in the operands' dtype is off by about 1e-3 in every element).  The norm alone cannot tell at
    K in the thousands: the reference's partials come from torch's fp32 matmul, whose sum order is not the kernel's,
    and about one element in a few thousand then rounds to the neighbouring bf16 value (1e-4 to 2e-4 of the norm
    at K = 2048), while a tiny output with one such element is off by more than a rounded result."""
    from test_gemm_rs import relative_error

    elementwise = ((out.float() - ref).abs() / ref.abs().clamp_min(1e-30)).median().item()
    assert elementwise < 1e-5, f"fp32 result: median elementwise relative error {elementwise:.3g}, not fp32's"
    return relative_error(out, ref)


def _all_gather_refusal(spec: Dict[str, object]) -> Optional[str]:
    from fluxinductor.kernels import ag_gemm
    from test_gemm_rs import make_weight

    dtype, k = DTYPES[spec["dtype"]], spec["k"]
    shard = torch.empty(spec["shard_rows"], k, dtype=dtype, device="cuda")
    # the simulation's weights alternate layouts: K-major first
    weights = [make_weight(k, n, i % 2 == 0, dtype, "cuda") for i, n in enumerate(spec["ns"])]
    biases = [torch.empty(n, dtype=dtype, device="cuda") if spec["bias"] else None for n in spec["ns"]]
    why = ag_gemm._operand_reason(shard, weights, biases) or ag_gemm._shapes_reason(shard, weights, biases,
                                                                                     spec["world"])
    if why is None and spec["push"] and not ag_gemm.use_push(shard, weights):
        why = "the shard's rows are not whole tiles of every launch (the call pulls)"
    if why is None and spec["batch_rows"]:
        why = ag_gemm.batch_major_reason(shard, weights, spec["batch_rows"])
    return why


def run_all_gather(spec: Dict[str, object]) -> Dict[str, object]:
    """Run one AG+GEMM case: {"refused": reason} or {"error": the worst relative error}; raises on a failed call or an
    output or gathered A that is wrong."""
    from test_ag_gemm import _check_ranks, run_ranks_on_one_gpu
    from test_gemm_rs import relative_error

    why = _all_gather_refusal(spec)
    if why is not None:
        return {"refused": why}
    torch.manual_seed(spec["seed"])
    outputs, refs, gathered, full = run_ranks_on_one_gpu(
        spec["world"], spec["shard_rows"], spec["k"], spec["ns"], spec["bias"], chunks=spec["chunks"],
        dtype=DTYPES[spec["dtype"]], k_chunks=spec["k_chunks"], push=spec["push"], one_call=spec["one_call"],
        batch_rows=spec["batch_rows"], timeout_s=5.0)
    _check_ranks(outputs, refs, gathered, full)
    return {"error": max(relative_error(out, ref) for rank in outputs for out, ref in zip(rank, refs))}


OPS = {"matmul_reduce_scatter": (draw_gemm_rs, run_gemm_rs), "all_gather_matmul": (draw_all_gather, run_all_gather)}


def run_case(op: str, seed: int) -> Dict[str, object]:
    """Draw and run one case; the outcome says ``passed``, ``refused`` or ``failed`` (with why)."""
    draw, run = OPS[op]
    spec = draw(seed)
    try:
        outcome = run(spec)
    except Exception as e:  # noqa: BLE001 - every failure of a case is recorded with its draw
        return {**spec, "outcome": "failed", "why": f"{type(e).__name__}: {e}"}
    if "refused" in outcome:
        return {**spec, "outcome": "refused", "why": outcome["refused"]}
    tolerance = 1e-2
    passed = outcome["error"] <= tolerance
    return {**spec, "outcome": "passed" if passed else "failed", "error": outcome["error"],
            **({} if passed else {"why": f"relative error {outcome['error']:.3g} over {tolerance:g}"})}


def test_fp32_result_error_tells_rounded_results():
    """The fp32 check passes the promised arithmetic with a few elements one bf16 rounding off, and fails a result
    stored in bf16 (or fp16) however close its norm."""
    torch.manual_seed(0)
    ref = torch.randn(300, 520) * 3
    flipped = ref.clone()
    flipped.view(-1)[::997] *= 1 + 2**-8  # one element in about a thousand off by one bf16 rounding
    assert fp32_result_error(flipped, ref) < 1e-3
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(AssertionError, match="not fp32's"):
            fp32_result_error(ref.to(dtype).float(), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(OPS))
def test_kernel_fuzz(op):
    results = [run_case(op, seed) for seed in range(CASES)]
    failed = [r for r in results if r["outcome"] == "failed"]
    assert not failed, f"{len(failed)} of {CASES} cases failed; the first: {failed[:3]}"
    assert sum(r["outcome"] == "passed" for r in results) >= CASES * 3 // 4, "the draw mostly makes refused cases"


def kind(result: Dict[str, object]) -> str:
    """What a case exercises, for the campaign's counts: the transport or the all-gather's path and its options."""
    if result["op"] == "matmul_reduce_scatter":
        parts = [result["transport"]]
        if result["transport"] == "split":
            parts.append(f"configuration {result['config']}" + (", tail split" if result["tail_split"] > 1 else ""))
        parts += [label for flag, label in ((result["out_fp32"], "fp32 result"), (result["slab_ks"], "K slabs"),
                                            (result["batch_rows"], "batch-major")) if flag]
    else:
        parts = ["push" + (f", one call ({result['one_call']})" if result["one_call"] else "") if result["push"]
                 else "pull"]
        parts += [label for flag, label in ((result["batch_rows"], "batch-major"),
                                            (result["k_chunks"] > 1, "K chunks")) if flag]
    return ", ".join(parts)


def summarize(results: List[Dict[str, object]]) -> Dict[str, Dict[str, Dict[str, object]]]:
    """Per op and :func:`kind`: cases passed, refused and failed, and the worst relative error of those that ran."""
    summary: Dict[str, Dict[str, Dict[str, object]]] = {}
    for result in results:
        entry = summary.setdefault(result["op"], {}).setdefault(
            kind(result), {"passed": 0, "refused": 0, "failed": 0, "worst_error": 0.0})
        entry[result["outcome"]] += 1
        entry["worst_error"] = max(entry["worst_error"], result.get("error") or 0.0)
    return {op: dict(sorted(kinds.items())) for op, kinds in sorted(summary.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="cases per op")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--ops", default=",".join(sorted(OPS)))
    parser.add_argument("--out", help="the campaign's JSON")
    parser.add_argument("--per-case", action="store_true", help="every case's draw and outcome in the JSON")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop starting cases after this long, the time split evenly between the ops")
    args = parser.parse_args()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # as tests/gpu/conftest.py: many streams wait at once
    started = time.time()
    summary: Dict[str, Dict[str, int]] = {}
    results = []
    ops = args.ops.split(",")
    for i, op in enumerate(ops):
        counts = summary.setdefault(op, {"passed": 0, "refused": 0, "failed": 0})
        stop = None if args.max_seconds is None else started + args.max_seconds * (i + 1) / len(ops)
        for seed in range(args.first_seed, args.first_seed + args.cases):
            if stop is not None and time.time() > stop:
                break
            result = run_case(op, seed)
            counts[result["outcome"]] += 1
            results.append(result)
            if result["outcome"] == "failed":
                print(f"FAILED {op} seed {seed}: {result['why']}\n  {result}", flush=True)
        print(f"{op}: {counts}", flush=True)
    report = {"schema": 1, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "git_sha": os.environ.get("FLUXINDUCTOR_GIT_SHA"), "python": platform.python_version(),
              "command": " ".join(sys.argv), "seconds": round(time.time() - started, 1), "summary": summary,
              "kinds": summarize(results), "failed": [r for r in results if r["outcome"] == "failed"]}
    if args.per_case:
        report["results"] = results
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if any(c["failed"] for c in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
