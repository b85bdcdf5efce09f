"""One GPU: the AG+GEMM kernel when its producer warps really wait for a peer's data in the middle of their work.

    python tests/gpu/run_ag_k_chunk_waits.py [--calls 20] [--mode k|rows]

Rank 0 of a simulated world of 2 on cuda:0: the GEMM is launched first, then the host releases the peer's shard one
piece at a time (a copy-engine copy, then the piece's flag), sleeping between pieces, so the kernel is running and
waiting for each piece when it lands.
  --mode k (default): K chunks.  A one-wave problem (a full persistent grid of 128x256 tiles, clusters of two CTAs);
    the pieces are column blocks, so every producer warp stops between blocks of its K loop.  An early version hung
    here past its flag timeout (the warp entered the wait split, its issuing lane still at the previous block).
  --mode rows: row chunks.  A multi-wave problem; the pieces are row chunks, so the producers stop in the tile
    scheduler's per-tile wait, entered right after issuing the previous tile's loads.  Each chunk moves as two 2-D
    copies of half its columns (--copy 2d, the default), as one cudaMemcpyAsync (--copy 1d: between two buffers of
    one GPU the driver may run that as a kernel, which cannot start beside a full persistent grid, so the GEMM waits
    until its timeout; between GPUs it is a copy-engine copy), or is in place before the launch with only its flag
    released late (--copy none).  Its grid leaves two SMs free (see the comment at sm_count below).
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
    parser.add_argument("--copy", choices=("2d", "1d", "none"), default="2d", help="--mode rows: how chunks move")
    parser.add_argument("--shard-rows", type=int, default=None, help="default 1024 (k), 2048 (rows)")
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=None, help="default 2048 (k), 4096 (rows)")
    parser.add_argument("--pieces", type=int, default=None, help="chunks per shard (default: 2 and 4, alternating)")
    parser.add_argument("--sleep-ms", type=float, default=2.0, help="host sleep before each piece's release")
    parser.add_argument("--sm-count", type=int, default=None,
                        help="persistent grid size (0: every SM; default: every SM but two with --mode rows)")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="the kernel's flag-wait timeout")
    args = parser.parse_args()

    from fluxinductor.kernels import ag_gemm, symm

    device = torch.device("cuda", 0)
    ext = symm.extension()
    world, rank, peer = 2, 0, 1
    rows = args.shard_rows or (1024 if args.mode == "k" else 2048)
    k, n = args.k, args.n or (2048 if args.mode == "k" else 4096)
    m = world * rows
    sm_count = args.sm_count
    if sm_count is None:
        # On one GPU, copies and flag writes enqueued *after* a persistent grid that holds every SM did not run
        # until its CTAs exited (even flag writes alone: the waits timed out; two SMs left free: no timeout).  The op
        # enqueues its pull before the GEMM; this test releases the pieces after the launch, so it leaves SMs free.
        # The one-wave K-chunk problem (128 CTAs) leaves them free by itself.
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count - 2 if args.mode == "rows" else 0
    torch.manual_seed(3)
    main_stream, side = torch.cuda.Stream(device), torch.cuda.Stream(device)
    flags = torch.zeros(world * symm.MAX_CHUNKS_PER_RANK, dtype=torch.int32, device=device)
    weight = torch.randn(n, k, dtype=torch.bfloat16, device=device).t()  # nn.Linear's transposed view
    for call in range(args.calls):
        pieces = args.pieces or (2, 4)[call % 2]
        epoch = call + 1
        full = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        peer_buffer = full.clone()                                   # the peer's slot holds its rows
        buffer = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device=device)
        buffer[rank * rows:(rank + 1) * rows].copy_(full[rank * rows:(rank + 1) * rows])
        if args.copy == "none":
            buffer.copy_(full)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
        torch.cuda.synchronize()
        if args.mode == "k":
            ag_gemm.launch_gemm(buffer, weight, None, out, flags=flags, epoch=epoch, rank=rank, world=world,
                                shard_rows=rows, k_chunks=pieces, timeout_s=args.timeout_s, sm_count=sm_count,
                                stream=main_stream)
        else:
            ag_gemm.launch_gemm(buffer, weight, None, out, flags=flags, epoch=epoch, rank=rank, world=world,
                                shard_rows=rows, chunks_per_rank=pieces, timeout_s=args.timeout_s,
                                sm_count=sm_count, stream=main_stream)
        for piece in range(pieces):
            time.sleep(args.sleep_ms / 1e3)  # the kernel is running and waiting for this piece by now
            if args.mode == "k":
                ag_gemm.pull_k_block(buffer, peer_buffer, peer, rows, pieces, piece, flags, epoch, side)
            elif args.copy == "1d":
                ag_gemm.pull_row_chunk(buffer, peer_buffer, peer, rows, pieces, piece, flags, epoch, side)
            else:
                start, end = ag_gemm.chunk_bounds(rows, pieces)[piece]
                first, count = peer * rows + start, end - start
                row_bytes, half = buffer.stride(0) * 2, (k // 2) * 2
                for c0, width in ((0, half), (half, k * 2 - half)):
                    offset = first * row_bytes + c0
                    if count and width:
                        ext.ag_memcpy2d_async(buffer.data_ptr() + offset, peer_buffer.data_ptr() + offset, row_bytes,
                                              width, count, side.cuda_stream)
                ext.ag_stream_write_value32(flags.data_ptr() + 4 * (peer * pieces + piece), epoch, side.cuda_stream)
        main_stream.synchronize()
        side.synchronize()
        try:
            ag_gemm.check_errors(device, synchronize=True)
        except ag_gemm.AllGatherGemmError as error:
            raise SystemExit(f"call {call} ({pieces} pieces, mode {args.mode}): {error}")
        ref = full.float() @ weight.float()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if out.isnan().any() or err > 1e-2:
            raise SystemExit(f"call {call} ({pieces} pieces, mode {args.mode}): relative error {err}, "
                             f"nan {out.isnan().any()}")
    label = "K-CHUNK" if args.mode == "k" else "ROW-CHUNK"
    copy = f", copy {args.copy}" if args.mode == "rows" else ""
    print(f"{label} WAITS OK ({args.calls} calls, shard {rows}x{k}, N {n}{copy})", flush=True)


if __name__ == "__main__":
    main()
