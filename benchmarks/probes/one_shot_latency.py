"""A row-parallel matmul and its all-reduce at decode sizes: NCCL, PyTorch's symmetric-memory one-shot all-reduce and
fluxinductor's one-shot kernel (torchrun, 2+ GPUs).

For each M (tokens) of x [M, K_local] @ w [K_local, N], bf16 (default N=8192, K_local=14336: a Llama-70B-like down
projection at TP=2), four contenders:

  mm                    the matmul alone (the no-communication bound);
  mm_nccl_all_reduce    the matmul, then NCCL's all_reduce of its output;
  mm_symm_mem_one_shot  the matmul into a symmetric buffer, then torch.ops.symm_mem.one_shot_all_reduce (where torch
                        has it);
  fluxinductor_one_shot fluxinductor.kernels.one_shot.matmul_all_reduce: the matmul into this rank's partial buffer,
                        then the one-shot kernel.

Two timings each, medians of ``--rounds`` rounds with the contenders alternated (collective_latency.py's method):
exposed_us (a barrier, then CUDA events around one call) and graph_us (the call replayed in a CUDA graph, ``--calls``
replays between events, per call).  The JSON goes to --out.

Usage: torchrun --nproc-per-node 2 benchmarks/probes/one_shot_latency.py --out one_shot_latency.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from collective_latency import time_contenders  # noqa: E402
from harness import Timer, git_sha, init_gpu_ranks, write_json  # noqa: E402

ROWS = (1, 8, 32, 64, 128, 256)


def contenders(rows: int, k: int, n: int, device: torch.device, group_name: str) -> dict:
    from fluxinductor.kernels import one_shot

    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(rows, k, device=device, generator=gen).to(torch.bfloat16)
    w = (torch.randn(k, n, device=device, generator=gen) / k**0.5).to(torch.bfloat16)
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=device)

    def nccl():
        torch.mm(x, w, out=out)
        dist.all_reduce(out)

    fns = {"mm": lambda: torch.mm(x, w, out=out), "mm_nccl_all_reduce": nccl}
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(rows * n, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buf, group_name)
        partial = buf.view(rows, n)

        def symm_one_shot():
            torch.mm(x, w, out=partial)
            # the op reduces the flat buffer it is given and returns that shape: [rows * n] -> [rows, n]
            return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name).view(rows, n)

        symm_one_shot()
        fns["mm_symm_mem_one_shot"] = symm_one_shot
    except Exception as e:  # noqa: BLE001 - reported, not fatal: PyTorch's op may not run here
        if dist.get_rank() == 0:
            print(f"symm_mem one-shot all-reduce unavailable: {type(e).__name__}: {e}", flush=True)
    reason = one_shot.unsupported_reason(x, w, None, "sum", group_name)
    if reason is None:
        fns["fluxinductor_one_shot"] = lambda: one_shot.matmul_all_reduce(x, w, None, "sum", group_name, checked=True)
    elif dist.get_rank() == 0:
        print(f"fluxinductor one-shot unavailable: {reason}", flush=True)
    return fns


def check(rows: int, k: int, n: int, device: torch.device, group_name: str, fns: dict) -> dict:
    """Each all-reduce contender's relative error against the fp32 all-reduce of the same partials."""
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(rows, k, device=device, generator=gen).to(torch.bfloat16)
    w = (torch.randn(k, n, device=device, generator=gen) / k**0.5).to(torch.bfloat16)
    ref = (x @ w).float()
    dist.all_reduce(ref)
    errors = {}
    for name in ("mm_symm_mem_one_shot", "fluxinductor_one_shot"):
        if name in fns:
            got = fns[name]()
            if got.shape != ref.shape:  # a wrong shape would broadcast (M=1) or raise (M>1) below
                raise RuntimeError(f"{name} returned {list(got.shape)}, not {list(ref.shape)}")
            errors[name] = ((got.float() - ref).norm() / ref.norm()).item()
    return errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k-local", type=int, default=14336)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rank, world, device, group_name = init_gpu_ranks()
    from fluxinductor import settings

    settings.configure(cuda_graphs=True)  # the one-shot kernel runs under torch.cuda.graph capture too
    timer = Timer(device)
    results = []
    for rows in ROWS:
        fns = contenders(rows, args.k_local, args.n, device, group_name)
        errors = check(rows, args.k_local, args.n, device, group_name, fns)
        timed = time_contenders(fns, timer, args.rounds, args.calls, rank, f"M={rows}")
        for name, t in timed.items():
            row = {"m": rows, "k_local": args.k_local, "n": args.n, "contender": name,
                   "output_bytes": rows * args.n * 2, **t}
            if name in errors:
                row["rel_err"] = errors[name]
            results.append(row)
            if rank == 0:
                print(f"M={rows:>4} {name:<24} exposed {row['exposed_us']:8.1f} us   graph "
                      f"{row.get('graph_us', float('nan')):8.1f} us   rel err {row.get('rel_err', float('nan')):.2e}",
                      flush=True)
    from fluxinductor.kernels import one_shot

    one_shot.check_error(group_name, device)
    if rank == 0 and args.out:
        sha, dirty = git_sha()
        write_json(args.out, {"benchmark": "one_shot_latency", "device": torch.cuda.get_device_name(device),
                              "world": world, "dtype": "bf16", "torch": torch.__version__,
                              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "git_sha": sha,
                              "git_dirty": dirty, "rounds": args.rounds, "calls": args.calls, "results": results})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
