#!/usr/bin/env python3
"""The inter-node path (fluxinductor/kernels/internode.py) on one host, every GPU a node of its own
(``settings.tuning.emulate_nodes``), against the decomposition over the same links: NCCL's collective then cuBLAS.

Per problem (global M, K, N; Flux's shapes, M swept) and op, the contenders run alternated in ``--rounds`` rounds:
  * ``op``: torch.ops.fluxinductor.* under the ``auto`` dispatch, which times the inter-node path against the
    sequential one at the first call and keeps the faster (the row's ``op_path``);
  * ``internode``: the same op under the ``fused`` dispatch, which always takes the inter-node path;
  * ``sequential``: NCCL all-gather then cuBLAS (AG+GEMM), cuBLAS then NCCL reduce-scatter (GEMM+RS);
  * ``gemm``: the per-rank cuBLAS GEMM alone (T_gemm).
Each time is the device time of one call (a barrier, a GPU sleep while the host enqueues it, CUDA events around
it), the median over iterations per rank, the maximum over ranks; the JSON keeps every round.  Overlap efficiency
E = 1 - (T - T_gemm) / (T_seq - T_gemm), from the medians over rounds, for ``op`` and ``internode``.

Which wire NVSHMEM and NCCL use is the environment's: NVSHMEM_DISABLE_P2P=1 with a remote transport
(NVSHMEM_REMOTE_TRANSPORT) takes NVSHMEM off NVLink; NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 does the same for NCCL.
The JSON records that environment.  With ``--gpus-per-node`` g > 1 (4 GPUs, g = 2: two nodes of two) the AG+GEMM
takes its hierarchical sends (rails and forwarding inside a node).

    torchrun --nproc-per-node 2 benchmarks/bench_internode.py --out benchmarks/results/internode/h200x2_tp2.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (ENV_PREFIXES, RunContext, dispatch_mode, environment, exit_now, parse_problems,  # noqa: E402
                     per_rank_summary, time_iterations, watchdog, write_json)

OPS = ("all_gather_matmul", "matmul_reduce_scatter")
FLUX_SHAPES = {"all_gather_matmul": (12288, 49152), "matmul_reduce_scatter": (49152, 12288)}
DEFAULT_MS = (1024, 4096, 8192)  # and world * 2049: odd rows per rank
CONTENDERS = ("op", "internode", "sequential", "gemm")


def make_calls(op: str, m: int, k: int, n: int, ctx: RunContext, group_name: str):
    """{contender: zero-argument call} for one problem, and a check of the inter-node output against fp32."""
    w, rank, dev, dt = ctx.world, ctx.rank, ctx.device, torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(1 + rank)
    ops = torch.ops.fluxinductor
    if op == "all_gather_matmul":
        shard = torch.randn(m // w, k, device=dev, generator=gen).to(dt)
        weight = (torch.randn(k, n // w, device=dev, generator=gen) / k**0.5).to(dt)
        full = torch.empty(m, k, device=dev, dtype=dt)

        def fused():
            return ops.all_gather_matmul(shard, [weight], [None], 0, group_name, False)[0][0]

        def sequential():
            dist.all_gather_into_tensor(full, shard)
            return full @ weight

        def check():
            dist.all_gather_into_tensor(full, shard)
            ref = full.float() @ weight.float()
            with dispatch_mode("fused"):
                return ((fused().float() - ref).norm() / ref.norm()).item()

        gemm = lambda: full @ weight  # noqa: E731
    else:
        a = torch.randn(m, k // w, device=dev, generator=gen).to(dt)
        weight = (torch.randn(k // w, n, device=dev, generator=gen) / k**0.5).to(dt)
        out = torch.empty(m // w, n, device=dev, dtype=dt)

        def fused():
            return ops.matmul_reduce_scatter(a, weight, None, "sum", 0, group_name)

        def sequential():
            dist.reduce_scatter_tensor(out, a @ weight)
            return out

        def check():
            partial = (a @ weight).float()
            dist.all_reduce(partial)
            ref = partial[rank * (m // w):(rank + 1) * (m // w)]
            with dispatch_mode("fused"):
                return ((fused().float() - ref).norm() / ref.norm()).item()

        gemm = lambda: a @ weight  # noqa: E731
    def under(mode):
        def call():
            with dispatch_mode(mode):
                return fused()
        return call

    return {"op": under("auto"), "internode": under("fused"), "sequential": sequential, "gemm": gemm}, check


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default=None, help="global M values, comma-separated (default: 1024,4096,8192 and world*2049)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPUs of each emulated node (1: every GPU a node)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    ctx = RunContext("cuda", pg_timeout_s=300, default_port=29531)
    from fluxinductor import settings

    settings.set_tuning(emulate_nodes=args.gpus_per_node)
    from fluxinductor import dispatch
    group_name = dist.group.WORLD.group_name
    ms = [p[0] for p in parse_problems(args.ms, [(m,) for m in (*DEFAULT_MS, ctx.world * 2049)])]
    rows = []
    with torch.no_grad(), watchdog(1500):
        for op in args.ops.split(","):
            k, n = FLUX_SHAPES[op]
            for m in ms:
                calls, check = make_calls(op, m, k, n, ctx, group_name)
                err = max(ctx.gather(check()))
                rounds = {c: [] for c in CONTENDERS}
                for _ in range(args.rounds):
                    for name in CONTENDERS:
                        times, _ = time_iterations(ctx, calls[name], args.warmup, args.iters, sleep_cycles=2_000_000)
                        rounds[name].append(per_rank_summary(ctx.gather(times))["ms"])
                med = {c: statistics.median(v) for c, v in rounds.items()}

                def efficiency(c):
                    span = med["sequential"] - med["gemm"]
                    return 1 - (med[c] - med["gemm"]) / span if span > 0 else None

                plans = [p for key, p in dispatch._plans.items() if key[0] == op and key[1] == "auto"]
                row = {"op": op, "m": m, "k": k, "n": n, "rel_err": err, "rounds_ms": rounds, "median_ms": med,
                       "op_path": plans[-1][0] if plans else None,
                       "speedup_vs_sequential": {c: med["sequential"] / med[c] for c in ("op", "internode")},
                       "overlap_efficiency": {c: None if efficiency(c) is None else round(efficiency(c), 3)
                                              for c in ("op", "internode")}}
                rows.append(row)
                if ctx.rank == 0:
                    sp, e = row["speedup_vs_sequential"], row["overlap_efficiency"]
                    print(f"{op:22s} M {m:6d}: op ({row['op_path']}) {med['op']:.3f} ms {sp['op']:.2f}x, internode "
                          f"{med['internode']:.3f} {sp['internode']:.2f}x E {e['internode']}, sequential "
                          f"{med['sequential']:.3f}, gemm {med['gemm']:.3f}; rel err {err:.1e}", flush=True)
    if ctx.rank == 0 and args.out:
        write_json(args.out, {"environment": environment(ctx, torch.bfloat16, {"emulate_nodes": args.gpus_per_node},
                                                          env_prefixes=(*ENV_PREFIXES, "UCX_")),
                              "rows": rows})
    exit_now(0)


if __name__ == "__main__":
    main()
