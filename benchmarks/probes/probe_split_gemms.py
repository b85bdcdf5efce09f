#!/usr/bin/env python3
"""Where the split GEMM+RS transport's time goes with communication off (one GPU).

    python3 benchmarks/probes/probe_split_gemms.py --out $OUT/probe_split_gemms.json

Per per-rank problem [M, K] @ [K, N] (default: the TP=2 problems of the shapes whose tails split), timed round-robin
as in sweep_kernels.py: cuBLAS on the whole problem and on half its rows (alone and as addmm with a source, which is
what the split's second GEMM does), AG+GEMM's kernel on half the rows (the split's first GEMM: the same mainloop and
tile order, no source), and the split's two GEMMs (``gemm_only(split=True)``).  The second GEMM's time is estimated as
the split's minus the first's.  ``--configs`` adds the two GEMMs in given configurations, ``--counted`` each of those
with the first GEMM counting its tiles per band as the peer GEMM does for the copy stream (``count_bands=True``).
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

PROBLEMS = [(8192, 4096, 28672), (4096, 6144, 49152), (16384, 4096, 28672), (4096, 4096, 57344), (3072, 4096, 28672)]


def main(argv=None) -> int:
    from fluxinductor.kernels import ag_gemm, gemm_rs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", default=None, help="M,K,N;M,K,N (per-rank problems); default: " + str(PROBLEMS))
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--n-major", action="store_true",
                   help="also the split GEMMs and cuBLAS with the weight N-major (as a backward's grad @ W gives it)")
    p.add_argument("--configs", default="",
                   help="comma-separated split configurations to time as well (split<c>_nocomm), e.g. 0,2")
    p.add_argument("--counted", action="store_true",
                   help="also each configuration's GEMMs with the first counting its tiles per band, as the peer GEMM "
                        "does for the copy stream (split<c>_counted)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    split_configs = [int(c) for c in args.configs.split(",") if c]
    problems = parse_problems(args.problems, PROBLEMS)
    dev = torch.device("cuda")
    sha, dirty = git_sha()
    data = {"schema": 1, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "git_sha": sha,
            "dirty": dirty, "iters": args.iters, "rounds": args.rounds, "results": []}
    for m, k, n in problems:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5).t()
        h = m // 2
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        out_half = torch.empty(h, n, device=dev, dtype=torch.bfloat16)
        source = torch.zeros(h, n, device=dev, dtype=torch.bfloat16)
        fns = {
            "cublas_full": lambda: torch.mm(a, w),
            "cublas_half": lambda: torch.mm(a[:h], w),
            "cublas_half_addmm": lambda: torch.addmm(source, a[:h], w),
            "first_gemm": lambda: ag_gemm.launch_gemm(a[:h], w, None, out_half),
            "split_nocomm": lambda: gemm_rs.gemm_only(a, w, None, out=out, split=True),
        }
        if args.n_major:
            w_n = w.contiguous()  # the same [K, N] values, N-major
            fns["cublas_full_n_major"] = lambda: torch.mm(a, w_n)
            fns["split_nocomm_n_major"] = lambda: gemm_rs.gemm_only(a, w_n, None, out=out, split=True)
        for c in split_configs:
            fns[f"split{c}_nocomm"] = lambda c=c: gemm_rs.gemm_only(a, w, None, out=out, split=True,
                                                                  split_config_choice=c)
            if args.counted:
                fns[f"split{c}_counted"] = lambda c=c: gemm_rs.gemm_only(a, w, None, out=out, split=True,
                                                                       split_config_choice=c, count_bands=True)
        times = time_round_robin(fns, 3, args.iters, args.rounds)
        ref = torch.mm(a.float(), w.float())
        for name in [f for f in fns if f.startswith("split")]:
            out.fill_(float("nan"))
            fns[name]()
            gemm_rs.check_gemm_only(dev)
            err = float((out.float() - ref).norm() / ref.norm())
            if not err < 1e-2:
                raise RuntimeError(f"{name} at {m}x{k}x{n}: relative error {err}")
        ms = {name: statistics.median([t for r in rounds for t in r]) for name, rounds in times.items()}
        second = ms["split_nocomm"] - ms["first_gemm"]
        row = {"problem": [m, k, n], "ms": ms,
               "per_round_ms": {name: [statistics.median(r) for r in rounds] for name, rounds in times.items()}, "second_gemm_ms": second,
               "second_over_first": second / ms["first_gemm"], "split_over_cublas": ms["split_nocomm"] / ms["cublas_full"]}
        data["results"].append(row)
        print(f"{m}x{k}x{n}: " + " ".join(f"{name} {t:.3f}" for name, t in ms.items()) +
              f" | second GEMM {second:.3f} ms = {row['second_over_first']:.3f}x the first; "
              f"split / cuBLAS {row['split_over_cublas']:.3f}", flush=True)
        write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
