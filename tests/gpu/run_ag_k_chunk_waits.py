"""One GPU: the AG+GEMM kernel when its producer warps really wait for a peer's data in the middle of their work.

    python tests/gpu/run_ag_k_chunk_waits.py [--calls 20] [--mode k|rows]

Rank 0 of a simulated world of 2 on cuda:0: the GEMM is launched first, then the host releases the peer's shard one
piece at a time (a copy-engine copy, then the piece's flag), sleeping between pieces, so the kernel is running and
waiting for each piece when it lands.
  --mode k (default): K chunks.  A one-wave problem (a full persistent grid of 128x256 tiles, clusters of two CTAs);
    the pieces are column blocks, so every producer warp stops between blocks of its K loop.  An early version hung
    here past its flag timeout (the warp entered the wait split, its issuing lane still at the previous block).
  --mode rows: row chunks.  A multi-wave problem; the pieces are row chunks, so the producers stop in the tile
    scheduler's per-tile wait, entered right after issuing the previous tile's loads.
Run by tests/gpu/test_ag_gemm.py in a subprocess with a timeout: a hang fails the test instead of wedging the pytest
process.  Prints "K-CHUNK WAITS OK" or "ROW-CHUNK WAITS OK" on success.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--mode", choices=("k", "rows"), default="k")
    parser.add_argument("--shard-rows", type=int, default=None, help="default 1024 (k), 2048 (rows)")
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=None, help="default 2048 (k), 4096 (rows)")
    args = parser.parse_args()

    from fluxinductor.kernels import ag_gemm, symm

    device = torch.device("cuda", 0)
    world, rank, peer = 2, 0, 1
    rows = args.shard_rows or (1024 if args.mode == "k" else 2048)
    k, n = args.k, args.n or (2048 if args.mode == "k" else 4096)
    m = world * rows
    torch.manual_seed(3)
    main_stream, side = torch.cuda.Stream(device), torch.cuda.Stream(device)
    flags = torch.zeros(world * symm.MAX_CHUNKS_PER_RANK, dtype=torch.int32, device=device)
    weight = torch.randn(n, k, dtype=torch.bfloat16, device=device).t()  # nn.Linear's transposed view
    for call in range(args.calls):
        pieces = (2, 4)[call % 2]
        epoch = call + 1
        full = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        peer_buffer = full.clone()                                   # the peer's slot holds its rows
        buffer = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device=device)
        buffer[rank * rows:(rank + 1) * rows].copy_(full[rank * rows:(rank + 1) * rows])
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
        torch.cuda.synchronize()
        if args.mode == "k":
            ag_gemm.launch_gemm(buffer, weight, None, out, flags=flags, epoch=epoch, rank=rank, world=world,
                                shard_rows=rows, k_chunks=pieces, timeout_s=5.0, stream=main_stream)
        else:
            ag_gemm.launch_gemm(buffer, weight, None, out, flags=flags, epoch=epoch, rank=rank, world=world,
                                shard_rows=rows, chunks_per_rank=pieces, timeout_s=5.0, stream=main_stream)
        for piece in range(pieces):
            time.sleep(0.002)  # the kernel is running and waiting for this piece by now
            if args.mode == "k":
                ag_gemm.pull_k_block(buffer, peer_buffer, peer, rows, pieces, piece, flags, epoch, side)
            else:
                ag_gemm.pull_row_chunk(buffer, peer_buffer, peer, rows, pieces, piece, flags, epoch, side)
        main_stream.synchronize()
        side.synchronize()
        ag_gemm.check_errors(device, synchronize=True)
        ref = full.float() @ weight.float()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if out.isnan().any() or err > 1e-2:
            raise SystemExit(f"call {call} ({pieces} pieces, mode {args.mode}): relative error {err}, "
                             f"nan {out.isnan().any()}")
    label = "K-CHUNK" if args.mode == "k" else "ROW-CHUNK"
    print(f"{label} WAITS OK ({args.calls} calls, shard {rows}x{k}, N {n})", flush=True)


if __name__ == "__main__":
    main()
