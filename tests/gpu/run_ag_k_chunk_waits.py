"""One GPU: the K-chunked AG+GEMM kernel when its producer really waits in the middle of every tile's K loop.

    python tests/gpu/run_ag_k_chunk_waits.py [--calls 20]

Rank 0 of a simulated world of 2 on cuda:0: the GEMM is launched first (a full persistent grid of 128x256 tiles,
one wave, clusters of two CTAs), then the host releases the peer's shard one column block at a time (copy-engine
2-D copy, then the block's flag), sleeping between blocks, so every producer warp stops between blocks of its K
loop.  An early version hung here past its flag timeout (the warp entered the wait split, its issuing lane still
at the previous block).  Run by tests/gpu/test_ag_gemm.py in a subprocess with a timeout: a hang fails the test
instead of wedging the pytest process.  Prints "K-CHUNK WAITS OK" on success.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--shard-rows", type=int, default=1024)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=2048)
    args = parser.parse_args()

    from fluxinductor.kernels import ag_gemm, symm

    device = torch.device("cuda", 0)
    world, rank, peer = 2, 0, 1
    rows, k, n = args.shard_rows, args.k, args.n
    m = world * rows
    torch.manual_seed(3)
    main_stream, side = torch.cuda.Stream(device), torch.cuda.Stream(device)
    flags = torch.zeros(world * symm.MAX_CHUNKS_PER_RANK, dtype=torch.int32, device=device)
    weight = torch.randn(n, k, dtype=torch.bfloat16, device=device).t()  # nn.Linear's transposed view
    for call in range(args.calls):
        k_chunks = (2, 4)[call % 2]
        epoch = call + 1
        full = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        peer_buffer = full.clone()                                   # the peer's slot holds its rows
        buffer = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device=device)
        buffer[rank * rows:(rank + 1) * rows].copy_(full[rank * rows:(rank + 1) * rows])
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
        torch.cuda.synchronize()
        ag_gemm.launch_gemm(buffer, weight, None, out, flags=flags, epoch=epoch, rank=rank, world=world,
                            shard_rows=rows, k_chunks=k_chunks, timeout_s=5.0, stream=main_stream)
        for block in range(k_chunks):
            time.sleep(0.002)  # the kernel is running and waiting for this block by now
            ag_gemm.pull_k_block(buffer, peer_buffer, peer, rows, k_chunks, block, flags, epoch, side)
        main_stream.synchronize()
        side.synchronize()
        ag_gemm.check_errors(device, synchronize=True)
        ref = full.float() @ weight.float()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if out.isnan().any() or err > 1e-2:
            raise SystemExit(f"call {call} (k_chunks {k_chunks}): relative error {err}, nan {out.isnan().any()}")
    print(f"K-CHUNK WAITS OK ({args.calls} calls, shard {rows}x{k}, N {n})", flush=True)


if __name__ == "__main__":
    main()
