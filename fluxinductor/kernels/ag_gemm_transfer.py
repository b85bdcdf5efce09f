"""How AG+GEMM's shards move (copy engine, no SMs): row chunks or column blocks of each peer's shard, pulled into this
rank's buffer or pushed into the peers', each followed by its arrival flag; the one-call push (csrc/ag_gemm/ag_gemm.h
push_call); the gathered A assembled from the buffer and the shard.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fluxinductor import settings
from fluxinductor.kernels import loader, symm
from fluxinductor.kernels.ag_gemm_variants import _K_TILE

# Problems of at most one wave of tiles (every tile starts at once, so no tile order hides the pull): each peer's
# shard arrives in this many column blocks instead of row chunks, and the producer waits per block of a tile's K
# loop (docs/design_ag_gemm.md): 1024x8192x8192 at TP=2 0.150-0.160 -> 0.124 ms on 2xH200.
# settings.tuning.ag_k_chunks (default 4) blocks; 1 turns it off (row chunks for every shape).
# Each column block moves at least this many bytes; smaller shards keep row chunks.  The K-chunked pull was measured
# with blocks of 1-4 MB only, and a 2-D copy's fixed cost weighs more on smaller blocks.
_MIN_K_BLOCK_BYTES = 1 << 20


def chunk_bounds(shard_rows: int, chunks_per_rank: int) -> List[Tuple[int, int]]:
    """Row ranges [start, end) of the chunks of one shard (the kernel's split: ceil(S / chunks) rows each)."""
    rows = -(-shard_rows // chunks_per_rank)
    return [(min(c * rows, shard_rows), min((c + 1) * rows, shard_rows)) for c in range(chunks_per_rank)]


def k_chunk_bounds(k: int, k_chunks: int) -> List[Tuple[int, int]]:
    """Column ranges [start, end) of the K blocks (the kernel's split: ceil(K tiles / k_chunks) tiles each)."""
    k_tiles = -(-k // _K_TILE)
    cols = -(-k_tiles // k_chunks) * _K_TILE
    return [(min(c * cols, k), min((c + 1) * cols, k)) for c in range(k_chunks)]


def use_k_chunks(m: int, n: int, sm_count: int, shard_bytes: int) -> int:
    """The K blocks per shard for an [M, N] output: up to ``settings.tuning.ag_k_chunks`` when its 128x256 tiles fit
    one wave and each block keeps _MIN_K_BLOCK_BYTES of the shard's ``shard_bytes``, else 1 (row chunks)."""
    tiles = -(-m // 128) * -(-n // 256)
    chunks = min(settings.tuning.ag_k_chunks, symm.MAX_CHUNKS_PER_RANK, shard_bytes // _MIN_K_BLOCK_BYTES)
    return chunks if tiles <= sm_count and chunks >= 2 else 1


def pull_k_block(dst: Tensor, source: Tensor, peer: int, shard_rows: int, k_chunks: int, block: int, flags: Tensor,
                 epoch: int, stream: torch.cuda.Stream) -> None:
    """Enqueue on ``stream``: copy column block ``block`` (of ``k_chunks``, :func:`k_chunk_bounds`) of ``peer``'s
    shard rows from ``source`` into ``dst`` (a 2-D copy-engine copy), then set flags[peer * k_chunks + block] to
    ``epoch``.  dst, source: [M, K] with the same strides."""
    ext = loader.extension()
    row_bytes = dst.stride(0) * dst.element_size()
    c0, c1 = k_chunk_bounds(dst.shape[1], k_chunks)[block]
    offset = peer * shard_rows * row_bytes + c0 * dst.element_size()
    if c1 > c0:
        ext.ag_memcpy2d_async(dst.data_ptr() + offset, source.data_ptr() + offset, row_bytes,
                              (c1 - c0) * dst.element_size(), shard_rows, stream.cuda_stream)
    ext.ag_stream_write_value32(flags.data_ptr() + 4 * (peer * k_chunks + block), epoch, stream.cuda_stream)


def pull_row_chunk(dst: Tensor, source: Tensor, peer: int, shard_rows: int, chunks_per_rank: int, chunk: int,
                   flags: Tensor, epoch: int, stream: torch.cuda.Stream) -> None:
    """Enqueue on ``stream``: copy row chunk ``chunk`` (of ``chunks_per_rank``, :func:`chunk_bounds`) of ``peer``'s
    shard from ``source`` into ``dst`` (one copy-engine copy), then set flags[peer * chunks_per_rank + chunk] to
    ``epoch``.  dst, source: [M, K] with the same strides."""
    ext = loader.extension()
    row_bytes = dst.stride(0) * dst.element_size()
    start, end = chunk_bounds(shard_rows, chunks_per_rank)[chunk]
    offset = (peer * shard_rows + start) * row_bytes
    if end > start:
        ext.ag_memcpy_async(dst.data_ptr() + offset, source.data_ptr() + offset, (end - start) * row_bytes,
                            stream.cuda_stream)
    ext.ag_stream_write_value32(flags.data_ptr() + 4 * (peer * chunks_per_rank + chunk), epoch, stream.cuda_stream)


def pull_shards(dst: Tensor, sources: Sequence[Optional[Tensor]], rank: int, shard_rows: int, flags: Tensor,
                epoch: int, stream: torch.cuda.Stream, chunks_per_rank: Optional[int] = None,
                gathered_out: Optional[Tensor] = None, k_chunks: int = 1) -> None:
    """Enqueue on ``stream``: copy every peer's shard rows into ``dst`` and set their flags to ``epoch``.

    dst: [M, K] (this rank's gathered buffer); sources[q]: [M, K] view of rank q's buffer (only rows of q
    are read; sources[rank] is not used).  Peers are pulled in the order r+1, r+2, ... (the kernel's tile
    order); chunk c of rank q sets flags[q * chunks_per_rank + c].  With ``k_chunks`` > 1 the whole shard moves in
    column blocks instead (2-D copies), block c setting flags[q * k_chunks + c].  Then copies dst into
    ``gathered_out``.
    """
    chunks_per_rank = settings.tuning.ag_chunks if chunks_per_rank is None else chunks_per_rank
    world = len(sources)
    for step in range(1, world):
        peer = (rank + step) % world
        if k_chunks > 1:
            for c in range(k_chunks):
                pull_k_block(dst, sources[peer], peer, shard_rows, k_chunks, c, flags, epoch, stream)
        else:
            for c in range(chunks_per_rank):
                pull_row_chunk(dst, sources[peer], peer, shard_rows, chunks_per_rank, c, flags, epoch, stream)
    if gathered_out is not None and gathered_out.numel():
        loader.extension().ag_memcpy_async(gathered_out.data_ptr(), dst.data_ptr(), dst.numel() * dst.element_size(),
                                         stream.cuda_stream)


def shard_row_copies(rank: int, world: int, start: int, end: int, block: int) -> List[Tuple[int, int, int, int]]:
    """The copies that take rows [start, end) of ``rank``'s shard to where they lie in a gathered A of ``world`` ranks
    whose blocks of ``block`` rows are batch-major (block b of rank q at rows (b * world + q) * block; block = the
    shard's rows: rank-major), as (row in A, row in the shard, rows, blocks): a part of one block (blocks = 1), or
    whole blocks (a 2-D copy, A's pitch world * block rows, the shard's block rows).  csrc/ag_gemm/ag_gemm.cu
    copy_shard_rows enqueues the same copies."""
    copies = []
    while start < end:
        b, i = divmod(start, block)
        blocks = (end - start) // block if i == 0 else 0
        if blocks > 1:
            copies.append(((b * world + rank) * block, start, block, blocks))
            start += blocks * block
        else:
            rows = min(block - i, end - start)
            copies.append(((b * world + rank) * block + i, start, rows, 1))
            start += rows
    return copies


def _copy_shard_rows(a: int, shard: int, rank: int, world: int, start: int, end: int, block: int, row_bytes: int,
                     stream: int) -> None:
    """Enqueue :func:`shard_row_copies` from the shard at address ``shard`` into the A at address ``a``."""
    ext = loader.extension()
    for row, local, rows, blocks in shard_row_copies(rank, world, start, end, block):
        if blocks > 1:
            ext.ag_memcpy2d_async(a + row * row_bytes, shard + local * row_bytes, world * block * row_bytes,
                                  rows * row_bytes, blocks, stream, rows * row_bytes)
        else:
            ext.ag_memcpy_async(a + row * row_bytes, shard + local * row_bytes, rows * row_bytes, stream)


def _push_flag(peer_flags: Tensor, index: int, epoch: int, stream: torch.cuda.Stream) -> None:
    """Enqueue on ``stream``: write ``epoch`` into peer_flags[index] (a stream write: its memory barrier orders it after
    the chunk's bytes, copied before it on ``stream``)."""
    loader.extension().ag_stream_write_value32(peer_flags.data_ptr() + 4 * index, epoch, stream.cuda_stream)


def push_shards(shard: Tensor, peer_buffers: Sequence[Tensor], peer_flags: Sequence[Tensor], rank: int, epoch: int,
                stream: torch.cuda.Stream, chunks_per_rank: Optional[int] = None, k_chunks: int = 1,
                batch_rows: int = 0) -> None:
    """Enqueue on ``stream``: copy this rank's ``shard`` ([S, K], contiguous) into rows [rank*S, (rank+1)*S) of
    every peer's buffer (with ``batch_rows`` > 0, into its blocks of a batch-major buffer: :func:`shard_row_copies`),
    raising the peer's flag of each chunk to ``epoch`` after its bytes.

    peer_buffers[q]: [M, K] view of rank q's buffer, peer_flags[q]: rank q's flags (entries for q == rank are not
    used).  Peers in the order q = rank-1, rank-2, ... (rank q's tile walk reaches rank's rows after rank - q - 1
    other shards).  Row chunk c sets flags[rank * chunks_per_rank + c]; with ``k_chunks`` > 1 the shard moves in
    column blocks instead (2-D copies), block c setting flags[rank * k_chunks + c].
    """
    ext = loader.extension()
    chunks_per_rank = settings.tuning.ag_chunks if chunks_per_rank is None else chunks_per_rank
    shard_rows, k = shard.shape
    if batch_rows and shard_rows % batch_rows:
        raise ValueError(f"a batch-major push needs whole blocks of {batch_rows} rows")
    block = batch_rows or shard_rows
    world = len(peer_buffers)
    element = shard.element_size()
    row_bytes = k * element
    for step in range(1, world):
        peer = (rank - step) % world
        dst = peer_buffers[peer]
        if dst.stride(0) != k:
            raise ValueError(f"peer buffer row stride {dst.stride(0)} != K = {k}")
        if k_chunks > 1:
            for c, (c0, c1) in enumerate(k_chunk_bounds(k, k_chunks)):
                for b in range(shard_rows // block if c1 > c0 else 0):  # each block of rows (one: rank-major)
                    ext.ag_memcpy2d_async(dst.data_ptr() + (b * world + rank) * block * row_bytes + c0 * element,
                                          shard.data_ptr() + b * block * row_bytes + c0 * element, row_bytes,
                                          (c1 - c0) * element, block, stream.cuda_stream)
                _push_flag(peer_flags[peer], rank * k_chunks + c, epoch, stream)
            continue
        for c, (start, end) in enumerate(chunk_bounds(shard_rows, chunks_per_rank)):
            _copy_shard_rows(dst.data_ptr(), shard.data_ptr(), rank, world, start, end, block, row_bytes,
                             stream.cuda_stream)
            _push_flag(peer_flags[peer], rank * chunks_per_rank + c, epoch, stream)


def push_call(shard: Tensor, peer_buffers: Sequence[int], peer_flags: Sequence[int], peer_arrivals: Sequence[int],
              arrivals: Tensor, passed: Tensor, epoch: int, need: int, rank: int, gemms: Sequence[tuple],
              events: Tuple[int, int], main: int, side: int, chunks_per_rank: int, k_chunks: int,
              own_into: int = 0, gathered: int = 0, timeout_s: Optional[float] = None, batch_rows: int = 0,
              gemm_writes_a: bool = True) -> None:
    """Enqueue one eager push call with one host call (csrc/ag_gemm/ag_gemm.h push_call): what :func:`all_gather_matmul`
    otherwise does step by step, i.e. ``side`` follows ``main``, the arrival (:func:`symm.arrive`) on ``main``,
    ``side`` waits for ``passed`` (:func:`symm.wait_passed`), :func:`push_shards` on ``side``, then the shard into this
    rank's rows of the A at address ``own_into`` (0: none) on ``side``; the GEMMs on ``main`` (``gemms``:
    :func:`gemm_args` of each, the first launched as the arrival's programmatic dependent), then the peers' rows of
    this rank's buffer into the same rows of the gathered A at address ``gathered`` (0: none; else ``own_into`` too),
    and ``main`` follows ``side``; with ``k_chunks`` > 1 the arrival comes first and no GEMM is a programmatic
    dependent.  With ``k_chunks`` == 1 the host enqueues the GEMMs before the pushes (a GPU waiting for the host starts
    the first GEMM on this rank's rows sooner).  ``batch_rows`` > 0: every A is batch-major (:func:`push_shards`).  With
    ``gemm_writes_a``, where the first GEMM's kernel variant can, that GEMM writes the rows those two copies would (from
    shared memory, as it loads them) and the copies are left out: a same-device copy runs on SMs, so on either stream
    it waits for the GEMM.

    peer_buffers[q] / peer_flags[q]: addresses of rank q's gathered buffer ([world * S, K]) and flags of this call's
    parity, mapped here; peer_arrivals[q]: this rank's arrival word on peer q; arrivals: this rank's words; ``events``:
    two events of :func:`symm.push_events`; ``main``, ``side``: the streams (cudaStream_t as integers).  Entries for
    q == rank are not used."""
    _, error_device = symm.error_word(shard.device.index)
    timeout_s = symm.timeout_seconds() if timeout_s is None else timeout_s
    loader.extension().ag_push_call(  # positional, in the binding's order
        peer_arrivals, arrivals.data_ptr(), passed.data_ptr(), epoch, need, rank, int(timeout_s * 1e9), error_device,
        shard.data_ptr(), shard.shape[0], shard.shape[1], shard.element_size(), peer_buffers, peer_flags,
        chunks_per_rank, k_chunks, _K_TILE, batch_rows, gemms, own_into, gathered, peer_buffers[rank] if gathered else 0,
        events[0], events[1], main, side, gemm_writes_a)


def assemble_gathered(gathered: Tensor, buffer: Tensor, shard: Tensor, rank: int, batch_rows: int = 0) -> None:
    """gathered[M, K] = the peers' rows of ``buffer`` with ``shard`` as this rank's rows (on the current stream,
    once the GEMM has waited for every chunk); ``batch_rows`` > 0: batch-major (:func:`push_shards`)."""
    rows = shard.shape[0]
    if batch_rows:
        world = gathered.shape[0] // rows
        slices = gathered.view(rows // batch_rows, world, batch_rows, -1)
        slices.copy_(buffer.view(slices.shape))
        slices[:, rank].copy_(shard.view(rows // batch_rows, batch_rows, -1))
        return
    lo, hi = rank * rows, (rank + 1) * rows
    if lo:
        gathered[:lo].copy_(buffer[:lo])
    gathered[lo:hi].copy_(shard)
    if hi < gathered.shape[0]:
        gathered[hi:].copy_(buffer[hi:])
