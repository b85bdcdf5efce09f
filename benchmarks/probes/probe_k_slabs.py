#!/usr/bin/env python3
"""A reduce-scatter of a sum of matmuls (the input gradient of separate gate/up or Q/K/V linears): what each way of
running its GEMMs costs with communication off, on one GPU.

    python3 benchmarks/probes/probe_k_slabs.py --out $OUT/k_slabs.json

Per per-rank problem (M rows, the terms' K, N; N-major weights, as a backward's grad @ W gives them), timed round-robin
as in sweep_kernels.py:

* ``cublas``: mm, then addmm onto it per further term (what the no-communication graph runs);
* ``per_term``: the split transport's two GEMMs per term, then the adds (the fused ops per term and their sum);
* ``concat``: the operands and weights concatenated along K, then the split GEMMs over them (the copies included);
* ``slabs<c>``: the split GEMMs with the terms as K slabs, in configuration c (each operand read in place).

Every contender's result is checked against the fp32 reference of the sum.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import git_sha, write_json  # noqa: E402
from sweep_kernels import time_round_robin  # noqa: E402

# (M, (K_i...), N) per rank at TP=2: hidden 8192 (FFN 28672, 64/8 heads, 4096 tokens) and hidden 4096 (FFN 14336,
# 32/8 heads, 16384 tokens).
PROBLEMS = [(4096, (14336, 14336), 8192), (4096, (4096, 512, 512), 8192), (16384, (7168, 7168), 4096),
            (16384, (2048, 512, 512), 4096)]


def parse(text: str):
    problems = []
    for item in text.split(";"):
        m, ks, n = item.split("/")
        problems.append((int(m), tuple(int(k) for k in ks.split(",")), int(n)))
    return problems


def main(argv=None) -> int:
    from fluxinductor.kernels import gemm_rs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", default=None, help="M/K1,K2[,K3]/N;... per-rank problems; default: " + str(PROBLEMS))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    problems = parse(args.problems) if args.problems else PROBLEMS
    dev = torch.device("cuda")
    sha, dirty = git_sha()
    data = {"schema": 1, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "git_sha": sha,
            "dirty": dirty, "iters": args.iters, "rounds": args.rounds, "results": []}
    for m, ks, n in problems:
        a = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for k in ks]
        w = [(torch.randn(k, n, device=dev, dtype=torch.bfloat16) / sum(ks) ** 0.5) for k in ks]
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in ks]

        def cublas():
            y = torch.mm(a[0], w[0])
            for a_i, w_i in zip(a[1:], w[1:]):
                y = torch.addmm(y, a_i, w_i)
            return y

        def per_term():
            for a_i, w_i, o in zip(a, w, outs):
                gemm_rs.gemm_only(a_i, w_i, None, out=o, split=True)
            return sum(outs[1:], outs[0])

        def concat():
            return gemm_rs.gemm_only(torch.cat(a, 1), torch.cat(w, 0), None, out=out, split=True)

        fns = {"cublas": cublas, "per_term": per_term, "concat": concat}
        for c in gemm_rs.SPLIT_CONFIGS:
            fns[f"slabs{c}"] = lambda c=c: gemm_rs.gemm_only(a[0], w[0], None, out=out, split=True,
                                                             split_config_choice=c, more=list(zip(a[1:], w[1:])))
        ref = sum(a_i.float() @ w_i.float() for a_i, w_i in zip(a, w))
        errors = {}
        for name, fn in fns.items():
            out.fill_(float("nan"))
            got = fn()
            gemm_rs.check_gemm_only(dev)
            errors[name] = float((got.float() - ref).norm() / ref.norm())
            if not errors[name] < 1e-2:
                raise RuntimeError(f"{name} at {m}x{ks}x{n}: relative error {errors[name]}")
        times = time_round_robin(fns, 3, args.iters, args.rounds)
        ms = {name: statistics.median([t for r in rounds for t in r]) for name, rounds in times.items()}
        row = {"problem": [m, list(ks), n], "ms": ms, "rel_err": errors,
               "per_round_ms": {name: [statistics.median(r) for r in rounds] for name, rounds in times.items()}}
        data["results"].append(row)
        print(f"{m}x{ks}x{n}: " + " ".join(f"{name} {t:.3f}" for name, t in ms.items()), flush=True)
        write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
