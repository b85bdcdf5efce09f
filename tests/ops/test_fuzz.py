"""A seeded fuzz of the fused ops' decomposed path (CPU, 2 gloo ranks) against an fp32 reference.

The cases (tests/_fuzz.py) draw M, K, N from sizes around tiles and primes (1, 3, 7, 127, 128, 129, ...), a dtype
(bf16, fp16, fp32), a bias or none, non-contiguous operands (a transposed weight, a strided shard), 1-3 weights per
all-gather, gather and scatter dims of 3-D operands, ``sum`` / ``avg`` and autocast's fp32 reduction (``out_dtype``).
Every rank builds every rank's operands from the case's seed, so the reference needs no communication.  A failure
names the case's seed: ``_case(seed)`` rebuilds it.

The suite runs seeds ``SEED`` .. ``SEED + CASES - 1``.  As a script it runs more, from seeds the suite never uses
(``MAIN_SEED`` on), and writes a JSON summary::

    python tests/ops/test_fuzz.py --cases 2000 --out benchmarks/results/fuzz/cpu_gloo_2rank.json
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Dict, List, Sequence, Tuple

if __name__ == "__main__":  # as a script: tests/ holds the shared helpers (the spawned ranks inherit the path)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from _dist import run_ranks
from _fuzz import OPS, SIZES, TOLERANCE, check_outputs, describe, make_case, reference, run_op

WORLD = 2
SEED = 20260
CASES = 400
MAIN_SEED = 1_000_000  # the script's first seed: disjoint from the suite's


def _case(seed: int, sizes: Sequence[int] = SIZES, world: int = WORLD, device="cpu") -> Dict[str, object]:
    """The case drawn from ``seed`` (:func:`_fuzz.make_case`): op, arguments and every rank's operands."""
    return make_case(seed, sizes, world, device)


def _fuzz_job(rank: int, world: int, first_seed: int, count: int) -> Dict[str, object]:
    import torch.distributed as dist

    import fluxinductor.ops  # noqa: F401 - registers torch.ops.fluxinductor

    name = dist.group.WORLD.group_name
    failures: List[str] = []
    counted: Dict[str, int] = {}
    by_dtype: Dict[str, int] = {}
    worst: Dict[str, float] = {}
    cpu_seconds: Dict[str, float] = {}
    start = time.process_time()
    with torch.no_grad():
        for seed in range(first_seed, first_seed + count):
            case = _case(seed, world=world)
            where = f"{case['op']} {str(case['dtype']).replace('torch.', '')}"
            counted[case["op"]] = counted.get(case["op"], 0) + 1
            by_dtype[where] = by_dtype.get(where, 0) + 1
            expected = reference(case, rank)
            op_start = time.process_time()
            try:
                got = run_op(case, rank, name)
            except Exception as e:  # noqa: BLE001 - every rank reports; the case is the same on every rank
                failures.append(f"{describe(case)}: raised {type(e).__name__}: {e}")
                continue
            finally:
                cpu_seconds[where] = cpu_seconds.get(where, 0.0) + time.process_time() - op_start
            found, err = check_outputs(case, got, expected)
            failures += found
            worst[where] = max(worst.get(where, 0.0), err) if err == err else float("nan")
    cpu_seconds["total"] = time.process_time() - start
    return {"failures": failures, "cases": counted, "cases_by_dtype": by_dtype, "worst_error": worst,
            "cpu_seconds": cpu_seconds}


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
        assert min(r["cases"].get(op, 0) for op in OPS) >= CASES // 5, r["cases"]


def test_a_case_is_rebuilt_from_its_seed():
    a, b = _case(SEED + 7), _case(SEED + 7)
    assert a["op"] == b["op"] and a["dtype"] == b["dtype"]
    key = "shards" if a["op"] == "all_gather_matmul" else "partials"
    assert all(torch.equal(x, y) for x, y in zip(a[key], b[key]))


def test_gpu_fuzz_records_prepared_kernel_calls(monkeypatch):
    """tests/gpu/run_fuzz_2rank.py's path recorder counts the kernel calls the dispatcher makes through the function
    the kernel module prepared (a signature's first call and its replays), not only direct calls, and a call the
    module did not prepare for stays the direct call's to record."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu"))
    import run_fuzz_2rank

    from fluxinductor import dispatch, ops
    from fluxinductor.kernels import ag_gemm, gemm_rs

    for module, name in ((dispatch, "record_fallback"), (ops, "record_fallback"), (gemm_rs, "matmul_reduce_scatter"),
                         (ag_gemm, "all_gather_matmul")):
        monkeypatch.setattr(module, name, getattr(module, name))  # the recorder replaces them: restored after
    ran = []
    monkeypatch.setattr(gemm_rs, "prepare_matmul_reduce_scatter",
                        lambda *args, transport, **kwargs: (lambda: ran.append("rs")) if transport == "split" else None)
    monkeypatch.setattr(ag_gemm, "prepare_all_gather_matmul", lambda *args, **kwargs: lambda: ran.append("ag"))
    monkeypatch.setattr(run_fuzz_2rank.PathRecorder, "_rs_transport", lambda self, *args: "gemm_rs:split0")
    monkeypatch.setattr(run_fuzz_2rank.PathRecorder, "_ag_variant", lambda self, *args: "ag_gemm:push/v0")
    recorder = run_fuzz_2rank.PathRecorder()
    rs = gemm_rs.prepare_matmul_reduce_scatter(None, None, None, "sum", "group", transport="split")
    rs()
    rs()  # a replay
    assert gemm_rs.prepare_matmul_reduce_scatter(None, None, None, "sum", "group", transport="store") is None
    ag_gemm.prepare_all_gather_matmul(None, [], [], "group", False)()
    assert ran == ["rs", "rs", "ag"]
    assert recorder.events == [("kernel", "gemm_rs:split0")] * 2 + [("kernel", "ag_gemm:push/v0")]
    assert recorder.path() == "gemm_rs:split0+ag_gemm:push/v0"


def _git_sha() -> str:
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def main(argv=None) -> int:
    """Run ``--cases`` cases from ``--first-seed`` on 2 gloo ranks; write the JSON summary to ``--out``; exit status 1
    where a case failed."""
    import argparse
    import json
    import platform

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--first-seed", type=int, default=MAIN_SEED)
    parser.add_argument("--out", required=True, help="the JSON summary's path")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds before the ranks are killed")
    args = parser.parse_args(argv)
    if args.first_seed < SEED + CASES and args.first_seed + args.cases > SEED:
        parser.error(f"seeds {args.first_seed}.. overlap the suite's {SEED}..{SEED + CASES - 1}")
    start = time.monotonic()
    results = run_ranks(_fuzz_job, WORLD, args.first_seed, args.cases, timeout=args.timeout)
    failures = {f"rank {rank}": r["failures"] for rank, r in enumerate(results)}
    summary = {
        "what": "fluxinductor fused ops, decomposed path, CPU, 2 gloo ranks, against an fp32 reference "
                "(tests/_fuzz.py cases)",
        "command": "python tests/ops/test_fuzz.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "seeds": [args.first_seed, args.first_seed + args.cases - 1],
        "cases": args.cases,
        "world": WORLD,
        "sizes": list(SIZES),
        "tolerance": {str(k).replace("torch.", ""): v for k, v in TOLERANCE.items()},
        "cases_by_op": results[0]["cases"],
        "cases_by_op_dtype": results[0]["cases_by_dtype"],
        "worst_error_by_op_dtype": {f"rank {rank}": r["worst_error"] for rank, r in enumerate(results)},
        "failed": sum(len(v) for v in failures.values()),
        "failures": failures,
        "cpu_seconds_by_op_dtype": {f"rank {rank}": r["cpu_seconds"] for rank, r in enumerate(results)},
        "wall_seconds": round(time.monotonic() - start, 1),
        "git": _git_sha(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    print(f"{args.cases} cases (seeds {args.first_seed}..{args.first_seed + args.cases - 1}): {summary['failed']} "
          f"failures, {summary['wall_seconds']} s; {args.out}")
    for rank, found in failures.items():
        for line in found[:20]:
            print(f"{rank}: {line}")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

