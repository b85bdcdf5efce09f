#!/usr/bin/env python3
"""What the split GEMM+RS transport costs over its own GEMMs, on one GPU (the loopback).

    python3 benchmarks/probes/probe_split_loopback.py --out $OUT/loopback.json

Per per-rank problem [M, K] @ [K, N] of TP=2 (default: the GEMM+RS shapes of the op benchmark), timed round-robin
as in sweep_kernels.py, in each split configuration (``--configs``): cuBLAS on the whole problem, the transport's two
GEMMs with communication off (``gemm_rs.gemm_only(split=True)``) and the transport run by this GPU alone as both
ranks (``gemm_rs.split_loopback``: the peer GEMM's counted stores, the copy stream's band waits, copies and flags,
the own GEMM's band waits and its source C).  The loopback over the GEMMs alone is the transport's cost on the
device, the copies' bytes included (they go device to device here, over NVLink between two GPUs); what two GPUs add
to it is the link and the other rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import git_sha, parse_problems, write_json  # noqa: E402
from sweep_kernels import time_round_robin  # noqa: E402

# (M, K, N) per rank at TP=2 of the op benchmark's GEMM+RS shapes (h200x2_tp2_ops_rs.json), the Llama layers' first
PROBLEMS = [(4096, 4096, 8192), (4096, 5120, 8192), (4096, 14336, 8192), (16384, 2048, 4096), (16384, 3072, 4096),
            (16384, 7168, 4096), (4096, 4096, 10240), (2048, 4096, 28672), (3072, 4096, 28672), (4096, 4096, 28672),
            (8192, 4096, 28672), (4096, 4096, 57344), (4096, 6144, 49152), (4096, 24576, 12288)]


def main(argv=None) -> int:
    from fluxinductor.kernels import gemm_rs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", default=None, help="M,K,N;M,K,N (per-rank problems); default: " + str(PROBLEMS))
    p.add_argument("--configs", default="0,2", help="comma-separated split configurations")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    configs = [int(c) for c in args.configs.split(",") if c]
    problems = parse_problems(args.problems, PROBLEMS)
    dev = torch.device("cuda")
    sha, dirty = git_sha()
    data = {"schema": 1, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "git_sha": sha,
            "dirty": dirty, "iters": args.iters, "rounds": args.rounds, "configs": configs, "results": []}
    for m, k, n in problems:
        torch.manual_seed(0)
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5).t()
        h = m // 2
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        out_half = torch.empty(h, n, device=dev, dtype=torch.bfloat16)
        fns = {"cublas": lambda: torch.mm(a, w)}
        for c in configs:
            fns[f"nocomm{c}"] = lambda c=c: gemm_rs.gemm_only(a, w, None, out=out, split=True, split_config_choice=c)
            fns[f"loopback{c}"] = lambda c=c: gemm_rs.split_loopback(a, w, None, out=out_half, split_config_choice=c)
        ref = torch.mm(a.float(), w.float())
        ref_sum = ref[:h] + ref[h:]
        for name, fn in fns.items():  # each contender's result, before and after the timing
            if name == "cublas":
                continue
            target, expected = (out_half, ref_sum) if name.startswith("loopback") else (out, ref)
            target.fill_(float("nan"))
            fn()
            gemm_rs.check_gemm_only(dev)
            err = float((target.float() - expected).norm() / expected.norm())
            if not err < 1e-2:
                raise RuntimeError(f"{name} at {m}x{k}x{n}: relative error {err}")
        times = time_round_robin(fns, 3, args.iters, args.rounds)
        gemm_rs.check_gemm_only(dev)
        ms = {name: statistics.median([t for r in rounds for t in r]) for name, rounds in times.items()}
        row = {"problem": [m, k, n], "ms": ms,
               "per_round_ms": {name: [statistics.median(r) for r in rounds] for name, rounds in times.items()},
               "nocomm_over_cublas": {c: ms[f"nocomm{c}"] / ms["cublas"] for c in configs},
               "loopback_over_nocomm": {c: ms[f"loopback{c}"] / ms[f"nocomm{c}"] for c in configs},
               "loopback_over_cublas": {c: ms[f"loopback{c}"] / ms["cublas"] for c in configs}}
        data["results"].append(row)
        print(f"{m}x{k}x{n}: cuBLAS {ms['cublas']:.3f} ms | " + " | ".join(
            f"config {c}: GEMMs {ms[f'nocomm{c}']:.3f} ({row['nocomm_over_cublas'][c]:.3f}x), loopback "
            f"{ms[f'loopback{c}']:.3f} ({row['loopback_over_nocomm'][c]:.3f}x the GEMMs)" for c in configs),
            flush=True)
        write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
