#!/usr/bin/env python3
"""The split GEMM+RS transport on two ranks: both row segments in one GEMM launch against one launch per segment
(``settings.tuning.gemm_rs_split_one_launch``), with communication on and off, beside cuBLAS on the per-rank problem
and NCCL then cuBLAS.  Contenders alternate in rounds (the order rotated each round); per contender and shape the
median over rounds of each round's time per call (``--iters`` calls back to back, max over ranks).

    torchrun --nproc-per-node 2 benchmarks/probes/probe_split_one_launch.py --out $OUT/split_one_launch.json

Shapes are global ``MxKxN`` (this rank holds [M, K/2] @ [K/2, N]): by default the GEMM+RS calls of the Llama-style
layers at hidden 8192 and 4096 (attention output, down projection, the Q/K/V input gradient).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import git_sha, init_gpu_ranks, write_json  # noqa: E402

SHAPES = "4096x8192x8192,8192x8192x8192,4096x10240x8192,4096x28672x8192,16384x4096x4096,16384x6144x4096"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--configs", default="0,2", help="split configurations to time (0 cooperative, 2 ping-pong)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    rank, world, device, group_name = init_gpu_ranks()
    if world != 2:
        raise SystemExit("the one-launch split runs on two ranks")
    from fluxinductor import settings
    from fluxinductor.kernels import gemm_rs

    def timed(contender) -> float:
        overrides, fn = contender
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with settings.override(**overrides):
            start.record()
            for _ in range(args.iters):
                fn()
            end.record()
        torch.cuda.synchronize()
        ms = torch.tensor([start.elapsed_time(end) / args.iters], device=device)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        return ms.item()

    rows = []
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        gen = torch.Generator(device=device).manual_seed(17 + rank)
        a = torch.randn(m, k // world, device=device, generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, k // world, device=device, generator=gen) / (k // world) ** 0.5).to(torch.bfloat16).t()
        partial = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        scattered = torch.empty(m // world, n, device=device, dtype=torch.bfloat16)

        def split(config: int, one: bool):
            return ({"gemm_rs_split_one_launch": one, "gemm_rs_split_config": config},
                    lambda: gemm_rs.matmul_reduce_scatter(a, w, None, "sum", group_name, transport="split"))

        def nocomm(config: int, ranks: int):
            return {}, lambda: gemm_rs.gemm_only(a, w, None, split=True, split_config_choice=config, world=ranks)

        def nccl_seq():
            torch.mm(a, w, out=partial)
            dist.reduce_scatter_tensor(scattered, partial)

        contenders = {"cublas": ({}, lambda: torch.mm(a, w, out=partial)), "nccl_seq": ({}, nccl_seq)}
        for config in (int(c) for c in args.configs.split(",")):
            contenders[f"one_launch{config}"] = split(config, True)
            contenders[f"two_launches{config}"] = split(config, False)
            contenders[f"one_launch{config}_nocomm"] = nocomm(config, 2)
            contenders[f"two_launches{config}_nocomm"] = nocomm(config, 4)  # the ring's two GEMMs, any world > 2
        ref = None
        for name in ("one_launch0", "two_launches0"):  # correctness of the two forms against each other
            overrides, fn = contenders[name]
            with settings.override(**overrides):
                out = fn().float()
            ref = out if ref is None else ref
            assert ((out - ref).norm() / ref.norm()).item() < 1e-2, name
        for overrides, fn in contenders.values():  # warm-up: kernels loaded, buffers grown, clocks at the cap
            with settings.override(**overrides):
                for _ in range(3):
                    fn()
        times = {name: [] for name in contenders}
        names = list(contenders)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(timed(contenders[name]))
        gemm_rs.check_error(group_name)
        row = {"shape": [m, k, n], "ms": {name: statistics.median(t) for name, t in times.items()},
               "rounds_ms": times}
        rows.append(row)
        if rank == 0:
            ms = row["ms"]
            print(f"{shape}: " + " ".join(f"{name} {ms[name]:.3f}" for name in names), flush=True)
            for config in (int(c) for c in args.configs.split(",")):
                print(f"    config {config}: one launch / two, comm on {ms[f'one_launch{config}'] / ms[f'two_launches{config}']:.3f}"
                      f", off {ms[f'one_launch{config}_nocomm'] / ms[f'two_launches{config}_nocomm']:.3f}; "
                      f"one launch off / cuBLAS {ms[f'one_launch{config}_nocomm'] / ms['cublas']:.3f}", flush=True)
    if rank == 0 and args.out:
        sha, dirty = git_sha()
        write_json(args.out, {"schema": "fluxinductor.probe_split_one_launch/1", "device": torch.cuda.get_device_name(),
                              "world": world, "iters": args.iters, "rounds": args.rounds, "git_sha": sha,
                              "git_dirty": dirty, "rows": rows})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
