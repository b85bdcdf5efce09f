#!/usr/bin/env python3
"""When the split GEMM+RS transport's two GEMMs start and end, communication off, one GPU.

    python3 benchmarks/probes/probe_split_timeline.py --shapes "4096,4096,8192;16384,2048,4096" --out t.json

Per-rank problems (M, K, N): ``gemm_only(split=True)`` runs the peer GEMM over rows [0, M/2) and the own GEMM over
[M/2, M), in configuration 2 as a programmatic dependent (``--split-config``; the tail split is configuration 0's).
For each ``--tail-splits`` value (alternated, ``--rounds`` times), 10 calls behind a GPU sleep under the profiler; per
call, from the peer GEMM's start: its end, the own GEMM's start (in configuration 2, when the first of the peer's CTAs
has left an SM) and the own GEMM's end, medians in µs; beside them cuBLAS's time for the whole problem (CUDA events).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import git_sha, parse_problems, write_json  # noqa: E402


def timeline(call, calls: int = 10):
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.cuda._sleep(500000)
            call()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "device_kernel" in e.name),
                     key=lambda e: e.time_range.start)
    rows = []
    for peer, own in zip(kernels[0::2], kernels[1::2]):
        t0 = peer.time_range.start
        rows.append((peer.time_range.end - t0, own.time_range.start - t0, own.time_range.end - t0))
    return [statistics.median(x) for x in zip(*rows)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", required=True, help="per-rank M,K,N;M,K,N")
    p.add_argument("--tail-splits", default="1,4")
    p.add_argument("--split-config", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from fluxinductor.kernels import gemm_rs

    torch.manual_seed(0)
    results = []
    for m, k, n in parse_problems(args.shapes, []):
        a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda").t()
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        runs = {}
        for _ in range(args.rounds):
            for tail in (int(t) for t in args.tail_splits.split(",")):
                med = timeline(lambda: gemm_rs.gemm_only(a, w, None, out=out, split=True, tail_split=tail,
                                                         split_config_choice=args.split_config))
                runs.setdefault(tail, []).append(dict(zip(("peer_end_us", "own_start_us", "own_end_us"), med)))
                print(f"{m}x{k}x{n} tail_split={tail}: peer end {med[0]:.1f}, own start {med[1]:.1f}, "
                      f"own end {med[2]:.1f} us", flush=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            torch.cuda._sleep(500000)
            start.record()
            torch.mm(a, w)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000)
        print(f"  cuBLAS {statistics.median(times):.1f} us", flush=True)
        results.append({"problem": [m, k, n], "runs": {str(t): r for t, r in runs.items()},
                        "cublas_us": statistics.median(times)})
    if args.out:
        sha, dirty = git_sha()
        write_json(args.out, {"schema": 1, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "git_sha": sha, "dirty": dirty, "split_config": args.split_config,
                              "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
