"""The AG+GEMM push's host side without a GPU: when a call pushes, what push_shards enqueues (peer order, byte
offsets, flag indices; recorded by a fake extension instead of copy-engine calls), the gathered A assembled from
the buffer and the shard, and the order of what a call enqueues on its two streams around the call's barrier (the
arrival, or torch's barrier)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from fluxinductor import settings
from fluxinductor.kernels import ag_gemm, loader, symm


def _weight(k: int, n: int, k_contiguous: bool = True) -> torch.Tensor:
    return torch.randn(n, k, dtype=torch.bfloat16).t() if k_contiguous else torch.randn(k, n, dtype=torch.bfloat16)


def test_push_needs_whole_tiles_of_every_launch(flux_settings):
    w = _weight(256, 64)
    assert ag_gemm.use_push(torch.randn(256, 256, dtype=torch.bfloat16), [w])
    assert not ag_gemm.use_push(torch.randn(129, 256, dtype=torch.bfloat16), [w])  # a tile would straddle ranks
    assert not ag_gemm.use_push(torch.randn(256, 512, dtype=torch.bfloat16)[:, :256], [w])  # not contiguous
    flux_settings(ag_variant=1)  # cooperative 256x128: 256-row tiles for bf16, K-contiguous weights
    assert not ag_gemm.use_push(torch.randn(128, 256, dtype=torch.bfloat16), [w])
    assert ag_gemm.use_push(torch.randn(128, 256, dtype=torch.bfloat16), [_weight(256, 64, k_contiguous=False)])
    assert ag_gemm.use_push(torch.randn(128, 256, dtype=torch.float16), [w.half()])  # variants are bf16 only


class _Recorder:
    """Stands in for the extension: records the stream operations push_shards enqueues."""

    def __init__(self):
        self.ops = []

    def ag_stream_write_value32(self, address, value, stream):
        self.ops.append(("write", address, value))

    def ag_memcpy_async(self, dst, src, nbytes, stream):
        self.ops.append(("copy", dst, src, nbytes))

    def ag_memcpy2d_async(self, dst, src, pitch, width, height, stream):
        self.ops.append(("copy2d", dst, src, pitch, width, height))


class _Stream:
    cuda_stream = 0


@pytest.mark.parametrize("k_chunks", [1, 3])
def test_push_order_offsets_and_flags(monkeypatch, k_chunks):
    """Rank 1 of 3: its shard goes to rank 0 first (whose walk reaches rank 1's rows next), then rank 2, each chunk
    (row chunks, or column blocks) into rows [S, 2S) of that peer's buffer, each followed by a stream write of the
    epoch into that peer's flag of (rank 1, chunk)."""
    recorder = _Recorder()
    monkeypatch.setattr(loader, "extension", lambda: recorder)
    world, rank, rows, k, chunks = 3, 1, 6, 128, 2
    shard = torch.randn(rows, k, dtype=torch.bfloat16)
    buffers = [torch.empty(world * rows, k, dtype=torch.bfloat16) for _ in range(world)]
    flags = [torch.zeros(world * 16, dtype=torch.int32) for _ in range(world)]
    ag_gemm.push_shards(shard, buffers, flags, rank, 7, _Stream(), chunks, k_chunks)

    row_bytes = k * 2
    expected = []
    for peer in (0, 2):
        base = buffers[peer].data_ptr() + rank * rows * row_bytes
        if k_chunks > 1:
            for c, (c0, c1) in enumerate(ag_gemm.k_chunk_bounds(k, k_chunks)):
                if c1 > c0:
                    expected.append(("copy2d", base + 2 * c0, shard.data_ptr() + 2 * c0, row_bytes, 2 * (c1 - c0),
                                     rows))
                expected.append(("write", flags[peer].data_ptr() + 4 * (rank * k_chunks + c), 7))
        else:
            for c, (start, end) in enumerate(ag_gemm.chunk_bounds(rows, chunks)):
                expected.append(("copy", base + start * row_bytes, shard.data_ptr() + start * row_bytes,
                                 (end - start) * row_bytes))
                expected.append(("write", flags[peer].data_ptr() + 4 * (rank * chunks + c), 7))
    assert recorder.ops == expected


def test_batch_major_push_copies(monkeypatch):
    """Rank 1 of 2, a [3, 4, K] shard (blocks of 4 rows) in 2 chunks of 6 rows: each chunk lands in the blocks it
    covers of the peer's batch-major buffer (block b of rank 1 at rows (2b + 1) * 4), as a 2-D copy of whole blocks
    and 1-D copies of parts of one; the bytes end up where the gathered [3, 8, K] has them."""
    recorder = _Recorder()
    monkeypatch.setattr(loader, "extension", lambda: recorder)
    world, rank, block, blocks, k = 2, 1, 4, 3, 8
    rows = block * blocks
    shard = torch.randn(rows, k, dtype=torch.bfloat16)
    peer = torch.full((world * rows, k), float("nan"), dtype=torch.bfloat16)
    flags = [torch.zeros(world * 16, dtype=torch.int32) for _ in range(world)]
    ag_gemm.push_shards(shard, [peer, None], flags, rank, 7, _Stream(), chunks_per_rank=2, batch_rows=block)
    rb = k * 2
    base, src = peer.data_ptr(), shard.data_ptr()
    assert recorder.ops == [
        ("copy", base + 4 * rb, src, 4 * rb), ("copy", base + 12 * rb, src + 4 * rb, 2 * rb),
        ("write", flags[0].data_ptr() + 4 * 2, 7),
        ("copy", base + 14 * rb, src + 6 * rb, 2 * rb), ("copy", base + 20 * rb, src + 8 * rb, 4 * rb),
        ("write", flags[0].data_ptr() + 4 * 3, 7)]
    assert ag_gemm.shard_row_copies(rank, world, 0, rows, block) == [(4, 0, 4, 3)]  # one 2-D copy of every block
    # carried out on the CPU, the copies put the shard where the gathered tensor has this rank's rows
    for row, local, n, height in ag_gemm.shard_row_copies(rank, world, 0, rows, block) + \
            ag_gemm.shard_row_copies(rank, world, 2, 7, block):
        for h in range(height):
            peer[row + h * world * block:row + h * world * block + n] = shard[local + h * block:local + h * block + n]
    assert torch.equal(peer.view(blocks, world, block, k)[:, rank], shard.view(blocks, block, k))
    assert peer.view(blocks, world, block, k)[:, 0].isnan().all()
    with pytest.raises(ValueError, match="whole blocks"):
        ag_gemm.push_shards(shard, [peer, None], flags, rank, 7, _Stream(), chunks_per_rank=2, batch_rows=5)


def test_batch_major_push_in_column_blocks(monkeypatch):
    """Column blocks (one-wave problems) of a batch-major push: each block's columns of every row block, into the
    peer's rows of that block, then the block's flag."""
    recorder = _Recorder()
    monkeypatch.setattr(loader, "extension", lambda: recorder)
    world, rank, block, blocks, k = 2, 1, 4, 2, 128
    shard = torch.randn(block * blocks, k, dtype=torch.bfloat16)
    peer = torch.empty(world * block * blocks, k, dtype=torch.bfloat16)
    flags = [torch.zeros(world * 16, dtype=torch.int32) for _ in range(world)]
    ag_gemm.push_shards(shard, [peer, None], flags, rank, 7, _Stream(), k_chunks=2, batch_rows=block)
    rb, base, src = k * 2, peer.data_ptr(), shard.data_ptr()
    expected = []
    for c, (c0, c1) in enumerate(ag_gemm.k_chunk_bounds(k, 2)):
        for b in range(blocks):
            expected.append(("copy2d", base + (b * world + rank) * block * rb + 2 * c0, src + b * block * rb + 2 * c0,
                             rb, 2 * (c1 - c0), block))
        expected.append(("write", flags[0].data_ptr() + 4 * (rank * 2 + c), 7))
    assert recorder.ops == expected


def test_batch_major_gathered_a():
    rows, k, world, block = 6, 4, 3, 3
    buffer = torch.randn(world * rows, k)
    shard = torch.randn(rows, k)
    gathered = torch.full((world * rows, k), float("nan"))
    ag_gemm.assemble_gathered(gathered, buffer, shard, 1, block)
    expected = buffer.clone().view(2, world, block, k)
    expected[:, 1] = shard.view(2, block, k)
    assert torch.equal(gathered, expected.view(-1, k))


def test_push_refuses_a_padded_peer_buffer(monkeypatch):
    monkeypatch.setattr(loader, "extension", lambda: _Recorder())
    shard = torch.randn(4, 64, dtype=torch.bfloat16)
    padded = torch.empty(8, 72, dtype=torch.bfloat16)[:, :64]
    with pytest.raises(ValueError, match="row stride"):
        ag_gemm.push_shards(shard, [padded, padded], [torch.zeros(32, dtype=torch.int32)] * 2, 0, 1, _Stream())


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_gathered_a_takes_own_rows_from_the_shard(rank):
    rows, k, world = 3, 8, 3
    buffer = torch.randn(world * rows, k)
    buffer[rank * rows:(rank + 1) * rows] = float("nan")  # never written on a pushing rank
    shard = torch.randn(rows, k)
    gathered = torch.full((world * rows, k), float("nan"))
    ag_gemm.assemble_gathered(gathered, buffer, shard, rank)
    expected = buffer.clone()
    expected[rank * rows:(rank + 1) * rows] = shard
    assert torch.equal(gathered, expected)


class _OrderedStream:
    def __init__(self, name, log):
        self.name, self.log, self.cuda_stream = name, log, 0

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))


class _Workspace:
    """Stands in for symm.SymmetricWorkspace: CPU buffers, and a log of the calls' arrival and the side stream's wait."""

    def __init__(self, log, rank, world, rows, k):
        self.log, self.rank, self.world, self.epoch = log, rank, world, 4
        self.side_stream = _OrderedStream("side", log)
        self.buffers = [torch.full((world * rows, k), float("nan"), dtype=torch.bfloat16) for _ in range(world)]
        self.flags = torch.zeros(2, world * 16, dtype=torch.int32)
        self.captured = False  # no call of this workspace was captured in a CUDA graph

    def reserve(self, nbytes):
        pass

    def next_epoch(self):
        self.epoch += 1
        return self.epoch

    def previous_epoch(self):
        return self.epoch - 1

    def view(self, parity, rank, rows, cols, dtype):
        return self.buffers[rank]

    def peer_flags(self, parity, rank):
        return self.flags[parity]

    def arrive(self, epoch, need, stream):
        own = self.buffers[self.rank][self.rank * 4:(self.rank + 1) * 4]
        self.log.append(("arrive", epoch, need, stream.name, "own rows in buffer" if not own.isnan().any() else ""))

    def wait_passed(self, epoch, stream):
        self.log.append(("wait_passed", epoch, stream.name))

    # the one-call push's addresses (ag_gemm.push_call)
    def peer_addresses(self, parity, rows, cols, dtype):
        return [b.data_ptr() for b in self.buffers], [self.flags[parity].data_ptr() + q for q in range(self.world)]

    def peer_arrival_words(self):
        return [1000 + q for q in range(self.world)]

    arrivals = torch.zeros(2, dtype=torch.int32)
    passed = torch.zeros(1, dtype=torch.int32)

    def push_events(self):
        return 11, 12


@pytest.mark.parametrize("barrier", ["arrival", "arrival, one wave"])
def test_pull_call_order(monkeypatch, barrier):
    """What a pulling all_gather_matmul enqueues, in order.  On the arrival (multi-wave): the side stream joins main
    (the shard is ready), main copies this rank's rows into its buffer and runs the call's arrival (needing the peers
    at this call), the side stream waits for the arrival's word before it moves any bytes, and the fused GEMM is
    launched as the arrival's programmatic dependent.  One wave (column blocks): the side stream follows the arrival
    through an event, and the GEMM is no dependent.  Only the widest weight's GEMM is fused; the others run after it
    on the complete buffer."""
    log = []
    world, rank, rows, k = 2, 1, 4, 64
    ws = _Workspace(log, rank, world, rows, k)
    main = _OrderedStream("main", log)

    class _Ext:
        def ag_device_sm_count(self):
            return 132

    monkeypatch.setattr(symm, "workspace", lambda group, device: ws)
    monkeypatch.setattr(loader, "extension", lambda: _Ext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(ag_gemm, "check_errors", lambda device=None: None)
    monkeypatch.setattr(ag_gemm, "_check_layout_agrees", lambda ws, shard, push, batch_rows=0: None)
    monkeypatch.setattr(ag_gemm, "use_push", lambda shard, weights: False)
    if barrier == "arrival, one wave":
        monkeypatch.setattr(ag_gemm, "use_k_chunks", lambda *a: 4)
    monkeypatch.setattr(ag_gemm, "pull_shards", lambda *a, **kw: log.append(("pull", a[6].name)))
    monkeypatch.setattr(ag_gemm, "launch_gemm",
                        lambda *a, **kw: log.append(("gemm", a[1].shape[1], kw["stream"].name, kw["pdl"])))
    shard = torch.randn(rows, k, dtype=torch.bfloat16)
    weights = [_weight(k, 16), _weight(k, 24)]
    outputs, _ = ag_gemm.all_gather_matmul(shard, weights, [None, None], "g", False, checked=True)

    arrival = ("arrive", 5, 5, "main", "own rows in buffer")
    gemm = ("gemm", 24, "main", barrier == "arrival")
    if barrier == "arrival":
        expected = [("wait_stream", "side", "main"), arrival, ("wait_passed", 5, "side"), ("pull", "side"), gemm]
    else:
        expected = [arrival, ("wait_stream", "side", "main"), ("pull", "side"), gemm]
    assert log == expected + [("wait_stream", "main", "side")]
    assert [tuple(o.shape) for o in outputs] == [(world * rows, 16), (world * rows, 24)]
    own = slice(rank * rows, (rank + 1) * rows)
    torch.testing.assert_close(outputs[0][own], shard @ weights[0])  # the narrow GEMM reads the buffer


def test_epochs_wrap_past_zero_and_remember_the_previous_call():
    """Call epochs are 32-bit, never 0 (the flags' and arrival words' initial value), and the previous call's epoch
    (what a push's arrival needs) is the one actually used before, across the wrap; the first call needs 0."""
    ws = object.__new__(symm.SymmetricWorkspace)  # the epoch bookkeeping needs no process group
    ws.epoch, ws._previous_epoch = 0, 0
    assert (ws.next_epoch(), ws.previous_epoch()) == (1, 0)
    ws.epoch = 0xFFFFFFFE
    seen = [(ws.next_epoch(), ws.previous_epoch()) for _ in range(3)]
    assert seen == [(0xFFFFFFFF, 0xFFFFFFFE), (1, 0xFFFFFFFF), (2, 1)]


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("one_wave", [False, True])
@pytest.mark.parametrize("return_gathered", [False, True])
def test_one_call_arguments(monkeypatch, one_wave, return_gathered, captured):
    """The eager push on the arrival is enqueued by one host call (ag_gemm.push_call, csrc/ag_gemm/ag_gemm.h): it gets
    the shard, every rank's buffer and flag addresses of this call's parity, this rank's arrival words, the epoch and
    the previous call's (what a push needs; this call's once a call of the workspace was captured, as a peer's replay
    may have read either buffer since), the chunking (row chunks, or column blocks on one-wave problems) and the
    widest weight's GEMM, reading this rank's rows from the shard, not launched as a dependent by its arguments
    (push_call decides that).  The same call copies this rank's rows into the gathered A (or, for the other weights'
    GEMMs, into the buffer) and the peers' rows out of the buffer into the gathered A."""
    log = []
    world, rank, rows, k = 2, 1, 4, 64
    ws = _Workspace(log, rank, world, rows, k)
    ws.captured = captured
    main = _OrderedStream("main", log)

    ws.side_stream.cuda_stream = 1

    class _Ext:
        def ag_device_sm_count(self):
            return 132

    calls = []
    shard_bytes = rows * k * 2

    def push_call(*args, own_into, gathered, batch_rows):  # what the call's copies do, on CPU tensors
        calls.append((args, own_into, gathered, batch_rows))
        shard, buffers = args[0], args[1]
        if own_into:
            ctypes.memmove(own_into + rank * shard_bytes, shard.data_ptr(), shard_bytes)
        if gathered:  # rank 1 of 2: the peer's rows come first
            ctypes.memmove(gathered, buffers[rank], rank * shard_bytes)

    monkeypatch.setattr(symm, "workspace", lambda group, device: ws)
    monkeypatch.setattr(loader, "extension", lambda: _Ext())
    monkeypatch.setattr(symm, "error_word", lambda index: (0, 77))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(ag_gemm, "_raw_stream", lambda index: 0)
    monkeypatch.setattr(ag_gemm, "check_errors", lambda device=None: None)
    monkeypatch.setattr(ag_gemm, "_check_layout_agrees", lambda ws, shard, push, batch_rows=0: None)
    monkeypatch.setattr(ag_gemm, "use_push", lambda shard, weights: True)
    monkeypatch.setattr(ag_gemm, "use_k_chunks", lambda *a: 4 if one_wave else 1)
    monkeypatch.setattr(ag_gemm, "tail_split_args", lambda *a: (0, 0, 0, 1, 1))
    monkeypatch.setattr(ag_gemm, "_choose_launch", lambda a, w, shard_rows, sm, variant, group, batch: (True, k, 0, 8))
    monkeypatch.setattr(ag_gemm, "push_call", push_call)
    shard = torch.randn(rows, k, dtype=torch.bfloat16)
    weights = [_weight(k, 16), _weight(k, 24)]
    outputs, gathered = ag_gemm.all_gather_matmul(shard, weights, [None, None], "g", return_gathered, checked=True)

    assert len(calls) == 1 and log == []  # nothing enqueued beside the one call
    ((c_shard, buffers, flags, arrival_words, arrivals, passed, epoch, need, c_rank, gemms, events, c_main, c_side,
      chunks, k_chunks), own_into, c_gathered, batch_rows) = calls[0]
    assert c_shard is shard and c_rank == rank and (epoch, need) == (5, 5 if captured else 4)
    assert (buffers, flags) == ws.peer_addresses(1, world * rows, k, shard.dtype)  # epoch 5: parity 1
    assert arrival_words == ws.peer_arrival_words() and arrivals is ws.arrivals and passed is ws.passed
    assert events == (11, 12) and (c_main, c_side) == (0, 1)  # the streams' handles
    a_full = gathered if return_gathered else ws.buffers[rank]  # this rank's rows go into the buffer for the narrow GEMM
    assert own_into == a_full.data_ptr() and batch_rows == 0
    assert c_gathered == (gathered.data_ptr() if return_gathered else 0)
    assert (chunks, k_chunks) == (min(settings.tuning.ag_chunks, symm.MAX_CHUNKS_PER_RANK), 4 if one_wave else 1)
    assert len(gemms) == 1
    for gemm, weight, out in zip(gemms, weights[1:], outputs[1:]):
        assert len(gemm) == 34  # ag_gemm_run's arguments before the stream
        assert gemm[1] == ws.buffers[rank].data_ptr() and gemm[5] == weight.data_ptr() and gemm[10] == out.data_ptr()
        assert gemm[12] == ws.flags[1].data_ptr() and gemm[13:17] == (5, rank, world, rows)
        assert gemm[18] == k_chunks and gemm[22] == 77  # K blocks, the error word
        assert gemm[29:] == (shard.data_ptr(), k, False, False, 0)  # own rows from the shard; no PDL, no trap; rank-major
    assert [tuple(o.shape) for o in outputs] == [(world * rows, 16), (world * rows, 24)]
    assert tuple(gathered.shape) == ((world * rows, k) if return_gathered else (0,))
    own = slice(rank * rows, (rank + 1) * rows)
    torch.testing.assert_close(outputs[0][own], shard @ weights[0])  # the narrow GEMM reads this rank's rows
    if return_gathered:
        expected = ws.buffers[rank].clone()
        expected[own] = shard
        assert torch.equal(gathered.isnan(), expected.isnan()) and torch.equal(gathered[own], shard)


def _push_call_args(world=2, **changes):
    gemm = (0,) * 34
    args = dict(peer_arrivals=[8] * world, arrivals=8, passed=8, epoch=3, need=2, rank=0, timeout_ns=10**9,
                error_word=0, shard=16, shard_rows=128, k=64, element_size=2, peer_buffers=[16] * world,
                peer_flags=[16] * world, chunks_per_rank=2, k_chunks=1, k_tile=64, batch_rows=0, gemms=[gemm], own_into=0,
                gathered=0, buffer=0, fork_event=8, join_event=8, main_stream=0, side_stream=0)
    args.update(changes)
    return list(args.values())


@pytest.mark.skipif(symm.extension_available() is not None, reason=f"needs the extension ({symm.extension_available()})")
@pytest.mark.parametrize("changes, error, match", [
    (dict(peer_buffers=[16]), ValueError, "one arrival word, buffer and flag address per rank"),
    (dict(gemms=[]), ValueError, "1 to 8 GEMMs"),
    (dict(gemms=[(0,) * 33]), ValueError, "34 arguments"),
    (dict(peer_arrivals=[8], peer_buffers=[16], peer_flags=[16]), RuntimeError, "rank 0 of 1"),
    (dict(rank=2), RuntimeError, "rank 2 of 2"),
    (dict(shard=0), RuntimeError, "missing pointer"),
    (dict(k_chunks=0), RuntimeError, "missing pointer, event or count"),
    (dict(peer_flags=[16, 0]), RuntimeError, "no buffer or flags for peer 1"),
    (dict(gathered=16), RuntimeError, "gathered A needs this rank's buffer"),
    (dict(batch_rows=96), RuntimeError, "whole blocks of batch_rows"),
])
def test_push_call_refuses_bad_arguments(changes, error, match):
    """The one-call push checks its arguments before it enqueues anything (no GPU needed to reach the checks)."""
    with pytest.raises(error, match=match):
        symm.extension().ag_push_call(*_push_call_args(**changes))


def test_batch_major_takes_no_256x160_tiles(flux_settings):
    """The 256x160 variants take no batch-major A (their kernels leave too few registers for the mapping): a forced
    one makes the call run rank-major; the others keep the layout."""
    assert ag_gemm.maps_batch_major(0) and ag_gemm.maps_batch_major(1)
    assert not ag_gemm.maps_batch_major(6) and not ag_gemm.maps_batch_major(7)
    shard, w = torch.randn(2 * 256, 64, dtype=torch.bfloat16), _weight(64, 128)
    assert ag_gemm.batch_major_reason(shard, [w], 256) is None
    flux_settings(ag_variant=6)
    assert "takes no batch-major A" in ag_gemm.batch_major_reason(shard, [w], 256)
