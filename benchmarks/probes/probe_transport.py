"""NVLink transport probe (torchrun, any world size, CUDA): how fast each way of moving a GEMM+RS
partial to its owner is, alone and beside the GEMM that produces it.

Ways (all between symmetric-memory buffers from ``torch.distributed._symmetric_memory``):
  ce_push  copy engine, this rank writes into the peer's buffer   (cudaMemcpyAsync, no SMs)
  ce_pull  copy engine, this rank reads the peer's buffer         (what PyTorch's async-TP does)
  sm_push  an elementwise kernel storing into the peer's buffer   (what the fused epilogue does)
  sm_pull  an elementwise kernel loading from the peer's buffer
Patterns: ``shift1`` (every rank moves one chunk with rank+1), ``all`` (every rank moves one chunk with
each peer at once, one stream per peer).  GB/s counts the bytes each rank moves, max time over ranks.
With ``--gemm MxKxN`` each way also runs beside a cuBLAS GEMM of that per-rank shape started at the same
time on another stream: the table shows both times then, against each alone.

Usage: torchrun --nproc-per-node 4 benchmarks/probes/probe_transport.py --chunk-mb 117 --gemm 8192x2048x28672
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

WAYS = ("ce_push", "ce_pull", "sm_push", "sm_pull")
PATTERNS = ("shift1", "all")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunk-mb", type=float, default=117.0, help="bytes per (source, destination) pair")
    p.add_argument("--gemm", default="8192x2048x28672", help="per-rank GEMM run beside, '' for none")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    rank, world, device, group_name = init_gpu_ranks()
    import torch.distributed._symmetric_memory as symm_mem

    elems = int(args.chunk_mb * 2**20) // 2 // 4096 * 4096
    # Symmetric buffer: slot s holds what rank s sends here (push) or what this rank offers to s (pull).
    buf = symm_mem.empty(world * elems, dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(buf, group_name)
    buf.normal_()
    local = torch.randn(world * elems, dtype=torch.bfloat16, device=device)

    def remote(peer: int, slot: int) -> torch.Tensor:
        return handle.get_buffer(peer, (elems,), torch.bfloat16, slot * elems)

    def peers(pattern: str):
        return [(rank + 1) % world] if pattern == "shift1" else [(rank + s) % world for s in range(1, world)]

    def move(way: str, peer: int) -> None:
        mine = local[peer * elems:(peer + 1) * elems]
        if way == "ce_push":
            remote(peer, rank).copy_(mine)
        elif way == "ce_pull":
            mine.copy_(remote(peer, rank))
        elif way == "sm_push":
            torch.neg(mine, out=remote(peer, rank))
        else:
            torch.neg(remote(peer, rank), out=mine)

    gemm = None
    if args.gemm:
        gm, gk, gn = (int(v) for v in args.gemm.split("x"))
        ga = torch.randn(gm, gk, dtype=torch.bfloat16, device=device)
        gb = torch.randn(gn, gk, dtype=torch.bfloat16, device=device).t()
        gout = torch.empty(gm, gn, dtype=torch.bfloat16, device=device)
        gemm = lambda: torch.mm(ga, gb, out=gout)  # noqa: E731

    streams = [torch.cuda.Stream(device=device) for _ in range(world)]
    main_stream = torch.cuda.current_stream()

    def timed(way, pattern, with_gemm: bool):
        """(transfer ms, gemm ms, both ms), medians over iterations, max over ranks."""
        xs, gs, bs = [], [], []
        for it in range(args.iters + 2):
            dist.barrier()
            torch.cuda.synchronize()
            torch.cuda._sleep(1_000_000)
            t0 = torch.cuda.Event(enable_timing=True)
            t0.record()
            x_end, g_end = [], None
            if way is not None:
                for i, peer in enumerate(peers(pattern)):
                    s = streams[i]
                    s.wait_stream(main_stream)
                    with torch.cuda.stream(s):
                        move(way, peer)
                        e = torch.cuda.Event(enable_timing=True)
                        e.record()
                        x_end.append(e)
            if with_gemm:
                gemm()
                g_end = torch.cuda.Event(enable_timing=True)
                g_end.record()
            for s in streams:
                main_stream.wait_stream(s)
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            done.synchronize()
            if it >= 2:
                xs.append(max(t0.elapsed_time(e) for e in x_end) if x_end else None)
                gs.append(t0.elapsed_time(g_end) if g_end else None)
                bs.append(t0.elapsed_time(done))
        med = lambda v: statistics.median(v) if v and v[0] is not None else None  # noqa: E731
        mine = [med(xs), med(gs), med(bs)]
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        return [max((e[i] for e in everyone if e[i] is not None), default=None) for i in range(3)]

    rows = []
    gemm_alone = timed(None, "shift1", True)[1] if gemm else None
    if rank == 0:
        print(f"world {world}, chunk {elems * 2 / 2**20:.1f} MiB, gemm {args.gemm or '-'} alone "
              f"{gemm_alone if gemm_alone is None else round(gemm_alone, 3)} ms", flush=True)
    for pattern in PATTERNS:
        if pattern == "all" and world == 2:
            continue
        for way in WAYS:
            x_ms = timed(way, pattern, False)[0]
            moved = len(peers(pattern)) * elems * 2
            row = {"pattern": pattern, "way": way, "bytes_per_rank": moved, "ms": x_ms,
                   "gb_s": moved / x_ms / 1e6, "gemm_alone_ms": gemm_alone}
            if gemm:
                x2, g2, both = timed(way, pattern, True)
                row.update({"conc_transfer_ms": x2, "conc_gemm_ms": g2, "conc_both_ms": both,
                            "conc_gb_s": moved / x2 / 1e6})
            rows.append(row)
            if rank == 0:
                extra = "" if not gemm else (f" | beside GEMM: transfer {row['conc_transfer_ms']:.3f} ms "
                                             f"({row['conc_gb_s']:.0f} GB/s), GEMM {row['conc_gemm_ms']:.3f} ms, "
                                             f"both {row['conc_both_ms']:.3f} ms")
                print(f"{pattern:6s} {way:8s} {moved / 2**20:7.1f} MiB {x_ms:7.3f} ms {row['gb_s']:6.0f} GB/s{extra}",
                      flush=True)
    if rank == 0 and args.out:
        sha, dirty = git_sha()
        write_json(args.out, {"schema": "fluxinductor.probe_transport/1", "device": torch.cuda.get_device_name(),
                              "world": world, "torch": torch.__version__, "git_sha": sha, "git_dirty": dirty,
                              "chunk_bytes": elems * 2, "gemm": args.gemm, "iters": args.iters,
                              "timing": "events from a common start after barrier+sync+sleep; median, max over ranks",
                              "rows": rows})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
