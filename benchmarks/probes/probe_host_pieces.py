"""Host cost of the pieces an AG+GEMM call is made of, and of a whole GEMM+RS call (torchrun, any world size, CUDA),
without a profiler.

``host_overhead.py`` times whole calls and, with ``--profile``, attributes them under cProfile, which inflates
every Python call.  This times each layer and each stream operation on its own, the GPU kept busy by a sleep
kernel so that nothing waits for it: the op through ``torch.ops`` (the custom-op wrapper included), the
dispatcher, the kernel module's call, and the pieces of that call (stream joins, the GEMM launch, a copy-engine
copy, a stream memory operation, an output allocation).  Least of ``--reps`` runs of ``--calls`` calls each, in
microseconds per call (the collective layers also back to back, wall time per call); rank 0 prints a table and
writes JSON.

Usage: torchrun --nproc-per-node 2 benchmarks/probes/probe_host_pieces.py --shape 1024x8192x8192 --out pieces.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import git_sha, init_gpu_ranks, write_json  # noqa: E402


def least_us(fn, calls: int, reps: int, collective: bool) -> float:
    """Least over ``reps`` runs of the host time per call of ``calls`` calls enqueued behind a sleep kernel."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        if collective:
            dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return best


def back_to_back_us(fn, calls: int, reps: int) -> float:
    """Least over ``reps`` runs of the wall time per call of ``calls`` calls back to back, synchronized at the end:
    what a stream of such calls costs when host and device overlap (host-bound calls show their host time)."""
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) * 1e6 / calls)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1024x8192x8192", help="global MxKxN of the AG+GEMM")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="also cProfile --calls op-level calls on rank 0 (behind a "
                   "sleep kernel) and print the top functions by cumulative and by own time")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    rank, world, device, group_name = init_gpu_ranks()
    import torch.distributed._functional_collectives as funcol

    from fluxinductor import dispatch
    from fluxinductor.kernels import ag_gemm, symm

    m, k, n = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    dtype = torch.bfloat16
    shard = torch.randn(1, m // world, k, device=device, dtype=dtype, generator=gen)
    shard2d = shard.view(m // world, k)
    weight = (torch.randn(n // world, k, device=device, dtype=dtype, generator=gen) / k**0.5).t()
    a_full = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
    out = torch.empty(m, n // world, device=device, dtype=dtype)
    main_stream = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    word = torch.zeros(64, dtype=torch.int32, device=device)
    ext = symm.extension()
    op = torch.ops.fluxinductor.all_gather_matmul
    # The GEMM+RS of the same sizes: a [M, K / world] @ [K / world, N], reduce-scattered over M.
    rs_op = torch.ops.fluxinductor.matmul_reduce_scatter
    a_rs = torch.randn(m, k // world, device=device, dtype=dtype, generator=gen)
    w_rs = (torch.randn(n, k // world, device=device, dtype=dtype, generator=gen) / k**0.5).t()

    collective = {
        "op (torch.ops, FLUXINDUCTOR_DISPATCH=fused)": lambda: op(shard, [weight], [None], 1, group_name, False),
        "dispatch.all_gather_matmul": lambda: dispatch.all_gather_matmul(shard, [weight], [None], 1, group_name,
                                                                         False),
        "kernels.ag_gemm.all_gather_matmul": lambda: ag_gemm.all_gather_matmul(shard2d, [weight], [None], group_name,
                                                                               False, checked=True),
        "nccl_seq (funcol all_gather, torch.matmul)": lambda: torch.matmul(
            funcol.all_gather_tensor(shard, 1, group_name), weight),
        "op again (order effects)": lambda: op(shard, [weight], [None], 1, group_name, False),
        "GEMM+RS op (torch.ops, FLUXINDUCTOR_DISPATCH=fused)": lambda: rs_op(a_rs, w_rs, None, "sum", 0, group_name),
        "GEMM+RS nccl_seq (torch.matmul, funcol reduce_scatter)": lambda: funcol.wait_tensor(
            funcol.reduce_scatter_tensor(torch.matmul(a_rs, w_rs), "sum", 0, group_name)),
    }
    local = {
        "launch_gemm (plain GEMM, no flags)": lambda: ag_gemm.launch_gemm(a_full, weight, None, out),
        "torch.matmul (cuBLAS)": lambda: torch.matmul(a_full, weight),
        "new_empty [M, N]": lambda: shard2d.new_empty((m, n // world)),
        "torch.cuda.current_stream": lambda: torch.cuda.current_stream(device),
        "Stream.wait_stream": lambda: side.wait_stream(main_stream),
        "ag_memcpy_async (4 bytes)": lambda: ext.ag_memcpy_async(word.data_ptr(), word.data_ptr() + 128, 4,
                                                                 side.cuda_stream),
        "ag_stream_write_value32": lambda: ext.ag_stream_write_value32(word.data_ptr(), 1, side.cuda_stream),
        "symm.capturing": symm.capturing,
    }
    rows = []
    from fluxinductor import ops, settings

    settings.configure(dispatch="fused")
    # The op's layers above the kernel module, once a replay of the signature is remembered: the replay's key and
    # lookup, the remembered call on its own, and the custom op's wrapper (its refusal of inputs needing a gradient).
    op(shard, [weight], [None], 1, group_name, False)
    key_args = ("all_gather_matmul", group_name, (1, False, 1), (shard, weight, None))
    remembered = dispatch.replay(dispatch.replay_key(*key_args))
    if remembered is not None:
        collective["replay (remembered call alone)"] = lambda: remembered(shard, [weight], [None])
        local["replay_key + lookup"] = lambda: dispatch.replay(dispatch.replay_key(*key_args))
    local["custom-op wrapper's refusal check"] = lambda: ops._refuse_grad("all_gather_matmul", shard, [weight],
                                                                            [None], 1, group_name, False)
    for name, fn in collective.items():
        rows.append({"piece": name, "host_us": least_us(fn, args.calls, args.reps, True),
                     "b2b_us": back_to_back_us(fn, args.calls, args.reps)})
    for name, fn in local.items():
        rows.append({"piece": name, "host_us": least_us(fn, args.calls, args.reps, False)})
    if args.profile:
        import cProfile
        import io
        import pstats

        fn = collective["op (torch.ops, FLUXINDUCTOR_DISPATCH=fused)"]
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        profiler = cProfile.Profile()
        if rank == 0:
            profiler.enable()
        for _ in range(args.calls):
            fn()
        if rank == 0:
            profiler.disable()
            for order in ("cumulative", "tottime"):
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(30)
                print(f"--- cProfile of {args.calls} op-level calls by {order} (seconds in all) ---\n{text.getvalue()}")
        torch.cuda.synchronize()
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        print(f"host us per call, least of {args.reps} x {args.calls} calls, AG+GEMM {args.shape} on {world} ranks")
        for i, row in enumerate(rows):
            b2b = " ".join(f"{r[i]['b2b_us']:8.1f}" for r in everyone) if "b2b_us" in row else ""
            print(f"  {row['piece']:48s} " + " ".join(f"{r[i]['host_us']:8.1f}" for r in everyone)
                  + (f"   back to back {b2b}" if b2b else ""))
        if args.out:
            sha, dirty = git_sha()
            write_json(args.out, {"schema": "fluxinductor.probe_host_pieces/1", "device": torch.cuda.get_device_name(),
                                  "world": world, "shape": args.shape, "calls": args.calls, "reps": args.reps,
                                  "git_sha": sha, "git_dirty": dirty, "rows_by_rank": everyone})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
