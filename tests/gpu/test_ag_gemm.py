"""Tests of the fused all-gather + GEMM kernel (fluxinductor/kernels/ag_gemm.py, csrc/ag_gemm/ag_gemm.cu).

* ``gemm_only``: the kernel with communication off against an fp32 reference, awkward sizes, both
  weight layouts, bias or not, bf16 and fp16, outputs poisoned with NaN before the run.
* N ranks on one GPU (world 2, 4, 8): every rank's buffers live on the one device; each rank copies its
  shard in, pulls the others' on its own side stream (copy engine + flags) and runs the kernel on its own
  stream with a persistent grid small enough that all ranks' kernels run side by side; or (the push) copies its
  shard into the others' buffers and raises their flags, its kernel reading its own rows from the shard.
* A rank whose peer never delivers: the kernel's wait times out and the host raises, no hang.
* 2 GPUs: tests/gpu/run_ag_gemm_2rank.py under torchrun (real symmetric memory, the public interface).

Without CUDA, the extension or an sm_90 GPU these skip with the reason (tests/gpu/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

from types import SimpleNamespace

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def make_weight(k: int, n: int, k_contiguous: bool, dtype, device) -> torch.Tensor:
    """[K, N]: the transposed view of an nn.Linear weight [N, K] (k_contiguous) or a row-major [K, N]."""
    if k_contiguous:
        return torch.randn(n, k, dtype=dtype, device=device).t()
    return torch.randn(k, n, dtype=dtype, device=device)


def test_unsupported_reason_without_a_kernel():
    """CPU tensors (or no extension): a reason, never an exception (dispatch then decomposes)."""
    from fluxinductor.kernels import ag_gemm

    shard = torch.randn(4, 8)
    reason = ag_gemm.unsupported_reason(shard, [torch.randn(8, 8)], [None], "0")
    assert isinstance(reason, str) and reason


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_contiguous", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("m,k,n", [(258, 264, 520), (1000, 72, 136), (1, 16, 8)])
def test_gemm_only(dtype, k_contiguous, with_bias, m, k, n):
    from fluxinductor.kernels import ag_gemm

    torch.manual_seed(m + k + n)
    a = torch.randn(m, k, dtype=dtype, device="cuda")
    w = make_weight(k, n, k_contiguous, dtype, "cuda")
    bias = torch.randn(n, dtype=dtype, device="cuda") if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    ag_gemm.launch_gemm(a, w, bias, out)
    ref = a.float() @ w.float() + (bias.float() if with_bias else 0)
    assert not out.isnan().any()
    assert relative_error(out, ref) <= 1e-2
    assert relative_error(ag_gemm.gemm_only(a, w, bias), ref) <= 1e-2


@pytest.mark.gpu
def test_odd_sizes_are_reported_not_run():
    from fluxinductor.kernels import ag_gemm

    a = torch.randn(64, 129, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(129, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="multiple of 8"):
        ag_gemm.gemm_only(a, w, None)
    a = torch.randn(64, 128, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(128, 63, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="multiple of 8"):
        ag_gemm.gemm_only(a, w, None)


def _rank_tensors(world, shard_rows, k, ns, with_bias, dtype, flags_per_rank):
    """What every simulated rank holds: its shard, the weights and biases (shared), its NaN-poisoned gathered buffer,
    outputs and gathered result, its zeroed flags, a main and a side stream; and a persistent grid size small enough
    that all ranks' kernels are resident at once with SMs left for the copies (same-device copies are SM kernels)."""
    device = torch.device("cuda", 0)
    m = world * shard_rows
    nan = float("nan")
    return SimpleNamespace(
        device=device, m=m,
        shards=[torch.randn(shard_rows, k, dtype=dtype, device=device) for _ in range(world)],
        weights=[make_weight(k, n, i % 2 == 0, dtype, device) for i, n in enumerate(ns)],
        biases=[torch.randn(n, dtype=dtype, device=device) if with_bias else None for n in ns],
        buffers=[torch.full((m, k), nan, dtype=dtype, device=device) for _ in range(world)],
        flags=[torch.zeros(world * flags_per_rank, dtype=torch.int32, device=device) for _ in range(world)],
        outputs=[[torch.full((m, n), nan, dtype=dtype, device=device) for n in ns] for _ in range(world)],
        gathered=[torch.full((m, k), nan, dtype=dtype, device=device) for _ in range(world)],
        main=[torch.cuda.Stream(device) for _ in range(world)],
        side=[torch.cuda.Stream(device) for _ in range(world)],
        sm_count=max(2, (96 // world) // 2 * 2))


def _load_kernels(t):
    """Run each weight's GEMM once, alone, before any simulated rank waits: CUDA loads a kernel lazily at its first
    launch, and that load can wait for an idle device, which this one is not while a simulated rank's GEMM waits for a
    peer whose work the blocked host has not enqueued yet (the first test of a run then timed out)."""
    from fluxinductor.kernels import ag_gemm

    shard_rows = t.shards[0].shape[0]
    for w, b in zip(t.weights, t.biases):
        # the variant the simulated ranks' launches will run (the automatic choice sees the whole M and the shard)
        variant = ag_gemm.kernel_variant(w.dtype, w, t.m, shard_rows, t.sm_count)
        ag_gemm.launch_gemm(t.shards[0], w, b, torch.empty(shard_rows, w.shape[1], dtype=w.dtype, device=t.device),
                            sm_count=t.sm_count, variant=variant)
    torch.cuda.synchronize()


def run_ranks_on_one_gpu(world, shard_rows, k, ns, with_bias, chunks=2, dtype=torch.bfloat16,
                         skip_pull_from=None, timeout_s=None, k_chunks=1, push=False, epochs=(9, 8), one_call=False,
                         batch_rows=0):
    """Simulate ``world`` ranks on cuda:0; returns (outputs[rank][i], references[i], gathered[rank], A).
    k_chunks > 1: shards move in column blocks and the kernel waits per block of its K loop.  push: each rank pushes
    its shard into the others' buffers and its GEMM reads its own rows from the shard, so its own rows of its buffer
    stay NaN (a read of them would show).  one_call (with push): each rank's call is enqueued by ag_gemm.push_call, as
    all_gather_matmul does, instead of step by step; True or "gathered": the first GEMM writes the gathered A as it
    loads it, "copies": the streams copy it, "buffer": no gathered A is asked for and the first GEMM writes this rank's
    rows into its buffer (as for GEMMs of other weights), which then holds the whole A.  batch_rows > 0 (with push): each shard is [B, batch_rows, K]
    flattened, and the gathered A and the outputs are batch-major ([B, world * batch_rows, ...] flattened)."""
    if push:
        return _push_ranks_on_one_gpu(world, shard_rows, k, ns, with_bias, chunks, dtype, skip_pull_from, timeout_s,
                                      k_chunks, *epochs, one_call=one_call, batch_rows=batch_rows)
    from fluxinductor.kernels import ag_gemm

    t = _rank_tensors(world, shard_rows, k, ns, with_bias, dtype, max(chunks, k_chunks))
    _load_kernels(t)
    shards, weights, biases, buffers, flags = t.shards, t.weights, t.biases, t.buffers, t.flags
    outputs, gathered, main, side, sm_count = t.outputs, t.gathered, t.main, t.side, t.sm_count
    epoch = 7
    torch.cuda.synchronize()
    copied = []
    for r in range(world):  # each rank writes its own slot ...
        main[r].wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(main[r]):
            buffers[r][r * shard_rows:(r + 1) * shard_rows].copy_(shards[r])
            event = torch.cuda.Event()
            event.record(main[r])
            copied.append(event)
    for r in range(world):  # ... and, once all slots are written (the barrier), pulls and computes
        for event in copied:
            side[r].wait_event(event)
        if skip_pull_from is not None and r != skip_pull_from:
            # A peer that never delivers: pull the others only, so its flags are never set.
            for step in range(1, world):
                q = (r + step) % world
                if q == skip_pull_from:
                    continue
                if k_chunks > 1:
                    for c in range(k_chunks):
                        ag_gemm.pull_k_block(buffers[r], buffers[q], q, shard_rows, k_chunks, c, flags[r], epoch,
                                             side[r])
                    continue
                for c in range(chunks):
                    ag_gemm.pull_row_chunk(buffers[r], buffers[q], q, shard_rows, chunks, c, flags[r], epoch, side[r])
        else:
            ag_gemm.pull_shards(buffers[r], buffers, r, shard_rows, flags[r], epoch, side[r], chunks,
                                gathered_out=gathered[r], k_chunks=k_chunks)
        for i, (w, b) in enumerate(zip(weights, biases)):
            ag_gemm.launch_gemm(buffers[r], w, b, outputs[r][i], flags=flags[r], epoch=epoch, rank=r, world=world,
                                shard_rows=shard_rows, chunks_per_rank=chunks, k_chunks=k_chunks, sm_count=sm_count,
                                timeout_s=timeout_s, stream=main[r])
        main[r].wait_stream(side[r])
    for r in range(world):
        torch.cuda.current_stream().wait_stream(main[r])
    torch.cuda.synchronize()
    full = torch.cat(shards).float()
    refs = [full @ w.float() + (b.float() if b is not None else 0) for w, b in zip(weights, biases)]
    return outputs, refs, gathered, torch.cat(shards)


def _check_ranks(outputs, refs, gathered=None, full=None):
    """Every simulated rank's outputs are written and match the fp32 references; its gathered A (when given) is
    exactly the concatenated shards."""
    for r, rank_outputs in enumerate(outputs):
        if gathered is not None:
            assert torch.equal(gathered[r], full), f"rank {r}: gathered A differs"
        for out, ref in zip(rank_outputs, refs):
            assert not out.isnan().any(), f"rank {r}: unwritten output"
            assert relative_error(out, ref) <= 1e-2, f"rank {r}"


def _as_int32(value):
    """A uint32 epoch as the int32 a flag tensor stores."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _gathered(shards, batch_rows):
    """The gathered A of these shards: rank-major, or (batch_rows > 0) batch-major."""
    if not batch_rows:
        return torch.cat(shards)
    k = shards[0].shape[1]
    return torch.stack([s.view(-1, batch_rows, k) for s in shards], 1).reshape(-1, k)


def _own_rows(a, rank, world, shard_rows, batch_rows):
    """This rank's rows of a gathered A (a view)."""
    if not batch_rows:
        return a[rank * shard_rows:(rank + 1) * shard_rows]
    return a.view(-1, world, batch_rows, a.shape[1])[:, rank]


def _push_ranks_on_one_gpu(world, shard_rows, k, ns, with_bias, chunks, dtype, skip_from, timeout_s, k_chunks,
                           epoch=9, previous=8, one_call=False, batch_rows=0):
    from fluxinductor.kernels import ag_gemm, symm

    t = _rank_tensors(world, shard_rows, k, ns, with_bias, dtype, max(chunks, k_chunks))
    _load_kernels(t)
    device, shards, weights, biases, buffers, flags = t.device, t.shards, t.weights, t.biases, t.buffers, t.flags
    outputs, gathered, main, side, sm_count = t.outputs, t.gathered, t.main, t.side, t.sm_count
    for f in flags:  # what this buffer parity's flags hold from two calls ago: must not read as this call's
        f.fill_(_as_int32(previous - 1 if previous > 1 else 0xFFFFFFFF))
    # The call's arrival, as all_gather_matmul runs it: arrivals[r][q] is rank r's word for peer q; every rank has
    # reached the previous call, which is all a push needs.
    arrivals = torch.full((world, world), _as_int32(previous), dtype=torch.int32, device=device)
    passed = torch.zeros(world, dtype=torch.int32, device=device)
    # Load the kernels the ranks launch after a GEMM may already wait (CUDA's lazy loading can hold a launch until the
    # device is idle, which a waiting simulated rank on the same GPU never is).
    ag_gemm.assemble_gathered(gathered[0].clone(), buffers[0], shards[0], 0, batch_rows)
    torch.cuda.synchronize()
    events = [symm.push_events(device) for _ in range(world)] if one_call else None
    mode = "gathered" if one_call is True else one_call
    for r in range(world):
        side[r].wait_stream(torch.cuda.current_stream())
        main[r].wait_stream(torch.cuda.current_stream())
        if one_call and r != skip_from:  # the whole call from one host call (ag_gemm.push_call), as all_gather_matmul
            gemms = [ag_gemm.gemm_args(buffers[r], w, b, outputs[r][i], stream=main[r], flags=flags[r], epoch=epoch,
                                       rank=r, world=world, shard_rows=shard_rows, chunks_per_rank=chunks,
                                       k_chunks=k_chunks, sm_count=sm_count, timeout_s=timeout_s, a_local=shards[r],
                                       capturing=False, batch_rows=batch_rows)
                     for i, (w, b) in enumerate(zip(weights, biases))]
            # The gathered A from the same call: written by the first GEMM as it loads it, or this rank's rows copied
            # from the shard (side stream) and the peers' rows from the buffer once the GEMMs waited for them (main).
            into = buffers[r] if mode == "buffer" else gathered[r]
            ag_gemm.push_call(shards[r], [x.data_ptr() for x in buffers], [f.data_ptr() for f in flags],
                              [arrivals[q, r].data_ptr() for q in range(world)], arrivals[r], passed[r], epoch,
                              previous, r, gemms, events[r], main[r].cuda_stream, side[r].cuda_stream, chunks,
                              k_chunks, own_into=into.data_ptr(), gathered=0 if mode == "buffer" else into.data_ptr(),
                              timeout_s=timeout_s, batch_rows=batch_rows, gemm_writes_a=mode != "copies")
            continue
        symm.arrive([arrivals[q, r].data_ptr() for q in range(world)], arrivals[r], passed[r], epoch, previous, r,
                    main[r])
        symm.wait_passed(passed[r], epoch, side[r])
        if r != skip_from:  # a rank that never delivers pushes nothing, so its chunks' flags are never set
            ag_gemm.push_shards(shards[r], buffers, flags, r, epoch, side[r], chunks, k_chunks, batch_rows)
        with torch.cuda.stream(main[r]):
            for i, (w, b) in enumerate(zip(weights, biases)):
                ag_gemm.launch_gemm(buffers[r], w, b, outputs[r][i], flags=flags[r], epoch=epoch, rank=r, world=world,
                                    shard_rows=shard_rows, chunks_per_rank=chunks, k_chunks=k_chunks,
                                    sm_count=sm_count, timeout_s=timeout_s, stream=main[r], a_local=shards[r],
                                    pdl=i == 0, batch_rows=batch_rows)
            ag_gemm.assemble_gathered(gathered[r], buffers[r], shards[r], r, batch_rows)
        main[r].wait_stream(side[r])
    for r in range(world):
        torch.cuda.current_stream().wait_stream(main[r])
    torch.cuda.synchronize()
    for r in range(world):
        if mode == "buffer":  # the first GEMM wrote this rank's rows: the buffer is the gathered A
            gathered[r].copy_(buffers[r])
        else:
            own = _own_rows(buffers[r], r, world, shard_rows, batch_rows)
            assert own.isnan().all(), f"rank {r}: its own rows were written into its buffer"
        written = [int(arrivals[q, r]) for q in range(world) if q != r]
        assert written == [_as_int32(epoch)] * (world - 1), f"rank {r}'s arrival on its peers: {written}"
    assert passed.tolist() == [_as_int32(epoch)] * world
    full = _gathered(shards, batch_rows)
    refs = [full.float() @ w.float() + (b.float() if b is not None else 0) for w, b in zip(weights, biases)]
    return outputs, refs, gathered, full


@pytest.mark.gpu
@pytest.mark.parametrize("world,shard_rows,k,k_chunks,chunks,ns", [
    (2, 128, 264, 1, 3, [520, 136]),     # one tile row per rank, a partial K tile, 3 row chunks, two weights
    (4, 256, 1024, 1, 2, [2048]),       # two tile rows per rank, several waves
    (8, 128, 512, 1, 1, [264]),
    (2, 1024, 1024, 1, 2, [2048]),      # the shard's tiles span cluster rows and groups
    (4, 256, 1024, 4, 1, [520]),        # column blocks (the one-wave path), 16 K tiles in blocks of 4
    (2, 512, 264, 16, 1, [136, 520]),   # more blocks than K tiles: the empty ones still raise their flags
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("one_call", [False, "gathered", "copies", "buffer"],
                         ids=["steps", "one_call", "one_call_copies", "one_call_buffer"])
def test_push_n_ranks_on_one_gpu(world, shard_rows, k, k_chunks, chunks, ns, dtype, one_call):
    """The push: each rank copies its shard into the peers' buffers and raises their flags; its GEMM reads its own
    rows from the shard (the buffer's own rows stay NaN) and the peers' rows from the buffer; the gathered A is
    assembled from both.  Enqueued step by step from Python, and by one host call (ag_gemm.push_call, what
    all_gather_matmul runs): the first GEMM writing the gathered A as it loads it, the streams copying it, or the GEMM
    writing this rank's rows into its buffer (no gathered A asked for)."""
    torch.manual_seed(world + shard_rows + k_chunks)
    outputs, refs, gathered, full = run_ranks_on_one_gpu(world, shard_rows, k, ns, with_bias=True, chunks=chunks,
                                                         dtype=dtype, k_chunks=k_chunks, push=True, one_call=one_call)
    _check_ranks(outputs, refs, gathered, full)


@pytest.mark.gpu
@pytest.mark.parametrize("world,batch_rows,blocks,k,k_chunks,chunks,ns", [
    (2, 128, 4, 264, 1, 2, [520, 136]),    # 4 blocks of one tile row, 2 chunks of 2 whole blocks, two weights
    (2, 256, 3, 512, 1, 2, [1024]),        # 3 blocks, chunks split a block (1-D parts and a 2-D copy)
    (4, 128, 2, 1024, 1, 3, [2048]),       # 3 chunks over 2 blocks
    (2, 512, 4, 1024, 1, 2, [2048]),       # blocks of 2 cluster rows; several waves
    (8, 128, 2, 512, 1, 1, [264]),
    (2, 128, 3, 1024, 4, 1, [520]),        # column blocks (one wave): every row block's columns in one 3-D copy
    (4, 256, 2, 512, 16, 1, [136, 264]),   # more column blocks than K tiles
])
@pytest.mark.parametrize("one_call", [False, "gathered", "copies", "buffer"],
                         ids=["steps", "one_call", "one_call_copies", "one_call_buffer"])
def test_batch_major_push_n_ranks_on_one_gpu(world, batch_rows, blocks, k, k_chunks, chunks, ns, one_call):
    """The push of [B, S/w, K] shards (B = blocks) into batch-major buffers, block b of rank q at rows (b * world + q)
    * batch_rows: each GEMM computes the gathered [B, S, K] in place, its outputs [B, S, N] with no permute, and the
    gathered A is assembled batch-major; the buffers' own rows stay NaN."""
    torch.manual_seed(world + batch_rows + blocks + k_chunks)
    outputs, refs, gathered, full = run_ranks_on_one_gpu(world, blocks * batch_rows, k, ns, with_bias=True,
                                                         chunks=chunks, push=True, one_call=one_call,
                                                         batch_rows=batch_rows, k_chunks=k_chunks)
    _check_ranks(outputs, refs, gathered, full)


@pytest.mark.gpu
def test_batch_major_needs_whole_tiles():
    """The kernel refuses batch-major blocks that are not whole tiles, or that do not divide the shard; the call-level
    check says why a shard cannot keep the layout."""
    from fluxinductor.kernels import ag_gemm

    shard = torch.randn(4 * 192, 64, dtype=torch.bfloat16, device="cuda")
    buffer = torch.randn(2 * 4 * 192, 64, dtype=torch.bfloat16, device="cuda")
    flags = torch.zeros(8, dtype=torch.int32, device="cuda")
    w = make_weight(64, 256, True, torch.bfloat16, "cuda")
    out = torch.empty(2 * 4 * 192, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="multiple of the tile"):
        ag_gemm.launch_gemm(buffer, w, None, out, flags=flags, epoch=1, rank=0, world=2, shard_rows=4 * 192,
                            chunks_per_rank=1, a_local=shard, batch_rows=96)
    with pytest.raises(RuntimeError, match="batch-major"):
        ag_gemm.launch_gemm(buffer, w, None, out, flags=flags, epoch=1, rank=0, world=2, shard_rows=4 * 192,
                            chunks_per_rank=1, a_local=shard, batch_rows=5 * 128)
    assert "whole tiles" in ag_gemm.batch_major_reason(shard, [w], 192)
    assert ag_gemm.batch_major_reason(shard, [w], 4 * 192) is None


@pytest.mark.gpu
@pytest.mark.parametrize("epochs", [(0xFFFFFFFF, 0xFFFFFFFE), (1, 0xFFFFFFFF), (2, 1)])
def test_push_across_the_epoch_wrap(epochs):
    """Epochs are 32-bit and wrap from 0xFFFFFFFF to 1: the flags left two calls ago (previous - 1) must not read as
    this call's, and the arrival of the previous call must satisfy the push, on both sides of the wrap."""
    torch.manual_seed(epochs[0] & 0xFF)
    outputs, refs, gathered, full = run_ranks_on_one_gpu(2, 256, 264, [520], with_bias=True, chunks=2, push=True,
                                                         epochs=epochs, one_call=True)
    _check_ranks(outputs, refs, gathered, full)


@pytest.mark.gpu
def test_push_peer_never_delivers_times_out():
    """A peer that never pushes: the waiting ranks' kernels give up after the timeout and report it."""
    from fluxinductor.kernels import ag_gemm, symm

    symm.clear_error(0)
    run_ranks_on_one_gpu(2, 256, 264, [520], with_bias=False, skip_pull_from=1, timeout_s=0.5, push=True,
                         one_call=True)
    with pytest.raises(ag_gemm.AllGatherGemmError):
        ag_gemm.check_errors(torch.device("cuda", 0), synchronize=True)
    symm.clear_error(0)


@pytest.mark.gpu
def test_arrival_waits_for_a_late_peer():
    """The arrival releases the side stream only once the peer's word reaches ``need``: the peer arrives late (after a
    sleep on another stream), and the copy the side stream enqueued after its wait runs after that."""
    from fluxinductor.kernels import symm

    device = torch.device("cuda", 0)
    world, rank, epoch = 2, 0, 12
    arrivals = torch.zeros((world, world), dtype=torch.int32, device=device)
    passed = torch.zeros(1, dtype=torch.int32, device=device)
    source, target = torch.arange(64, dtype=torch.int32, device=device), torch.zeros(64, dtype=torch.int32,
                                                                                    device=device)
    main, side, peer = (torch.cuda.Stream(device) for _ in range(3))
    torch.cuda._sleep(1)  # load the kernels before the arrival spins: CUDA's lazy loading of a kernel can wait for an
    arrivals[rank, 1].fill_(0)  # idle device, which this one is not while the arrival waits
    target.copy_(source)
    target.zero_()
    torch.cuda.synchronize()
    symm.arrive([arrivals[q, rank].data_ptr() for q in range(world)], arrivals[rank], passed[0], epoch, epoch, rank,
                main, timeout_s=5.0)
    symm.wait_passed(passed[0], epoch, side)
    with torch.cuda.stream(side):
        target.copy_(source)
        copied = torch.cuda.Event(enable_timing=True)
        copied.record(side)
    with torch.cuda.stream(peer):
        torch.cuda._sleep(50_000_000)  # ~25 ms
        arrivals[rank, 1].fill_(epoch)  # the peer reaches the call
        arrived = torch.cuda.Event(enable_timing=True)
        arrived.record(peer)
    torch.cuda.synchronize()
    assert passed.item() == epoch
    assert int(arrivals[1, rank]) == epoch, "the arrival was not written into the peer's word"
    assert torch.equal(target, source)
    assert arrived.elapsed_time(copied) > 0, "the side stream ran before the peer arrived"


@pytest.mark.gpu
def test_arrival_timeout_traps():
    """A peer that never reaches the call: the arrival gives up after its timeout and traps (the copy stream must
    neither write into that peer nor wait forever), leaving its error code in the host-mapped word."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.join(HERE, "run_ag_arrival_timeout.py")]
    try:
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the arrival did not give up on a peer that never arrives")
    assert "ARRIVAL TRAPPED code 4" in result.stdout, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.gpu
def test_local_rows_need_whole_tiles():
    """The kernel refuses an own-rows A whose shard is not a multiple of the tile's M (a tile would straddle)."""
    from fluxinductor.kernels import ag_gemm

    shard = torch.randn(129, 64, dtype=torch.bfloat16, device="cuda")
    buffer = torch.randn(258, 64, dtype=torch.bfloat16, device="cuda")
    flags = torch.zeros(4, dtype=torch.int32, device="cuda")
    w = make_weight(64, 256, True, torch.bfloat16, "cuda")
    out = torch.empty(258, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="multiple of the tile"):
        ag_gemm.launch_gemm(buffer, w, None, out, flags=flags, epoch=1, rank=0, world=2, shard_rows=129,
                            chunks_per_rank=1, a_local=shard)
    assert not ag_gemm.use_push(shard, [w])


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("with_bias", [True, False])
def test_n_ranks_on_one_gpu(world, with_bias):
    torch.manual_seed(world)
    outputs, refs, gathered, full = run_ranks_on_one_gpu(world, shard_rows=129, k=264, ns=[520, 136],
                                                         with_bias=with_bias, chunks=3)
    _check_ranks(outputs, refs, gathered, full)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_n_ranks_large_on_one_gpu(world):
    """Shards of whole tiles, several waves per rank: the tile order and waits under real concurrency."""
    torch.manual_seed(11)
    outputs, refs, _, _ = run_ranks_on_one_gpu(world, shard_rows=1024, k=1024, ns=[2048], with_bias=True)
    for r in range(world):
        assert relative_error(outputs[r][0], refs[0]) <= 1e-2, f"rank {r}"


@pytest.mark.gpu
@pytest.mark.parametrize("world,shard_rows,k,k_chunks", [
    (2, 129, 264, 3),    # 5 K tiles in blocks of 2/2/1; a shard boundary inside a tile
    (4, 256, 1024, 4),   # whole tiles, 16 K tiles in blocks of 4
    (2, 512, 264, 16),   # more blocks than K tiles: the empty ones still raise their flags
    (8, 64, 512, 2),
])
def test_k_chunks_on_one_gpu(world, shard_rows, k, k_chunks):
    """Shards moved in column blocks (2-D copies), the producer waiting per block of each tile's K loop."""
    torch.manual_seed(world + k_chunks)
    outputs, refs, gathered, full = run_ranks_on_one_gpu(world, shard_rows=shard_rows, k=k, ns=[520, 136],
                                                         with_bias=True, k_chunks=k_chunks)
    _check_ranks(outputs, refs, gathered, full)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_contiguous", [True, False])
@pytest.mark.parametrize("m,k,n,sm_count,tail_split,waves,flags", [
    (1000, 776, 1032, 32, 4, 1, 48),  # 16 clusters, 20 tiles: 1 full wave + 4 tail tiles in 4 parts (3/3/3/4 K tiles)
    (1000, 776, 1032, 32, 2, 1, 16),  # the same tail in 2 parts
    (258, 72, 2056, 16, 4, 1, 8),     # 8 clusters, 18 tiles: 2 waves + 2 tail tiles; 2 K tiles cap the parts at 2
    (1000, 40, 1032, 32, 4, 1, 0),    # 1 K tile: nothing to split
    (500, 776, 3320, 32, 4, 1, 0),    # 16 clusters, 26 tiles: 10 tail tiles, more than fit one wave in 2 parts
    (500, 776, 3320, 32, 4, 2, 80),   # the same in 3 parts over two waves (2/3 of a tile's time)
])
def test_tail_split(flux_settings, dtype, k_contiguous, m, k, n, sm_count, tail_split, waves, flags):
    """A partial last wave split along K (parts on different clusters, the last part adding the others' fp32
    sums): as exact as the unsplit kernel, with bias, M and N not multiples of the tile.  ``flags``: the parts' flags
    the launch raises in its scratch, tail tiles x 2 CTAs x 2 consumer warp groups x (parts - 1): the split ran.
    ``waves``: settings.tuning.tail_split_waves."""
    from fluxinductor.kernels import ag_gemm, tail_split as tails

    flux_settings(tail_split_waves=str(waves))

    torch.manual_seed(m + n + tail_split)
    a = torch.randn(m, k, dtype=dtype, device="cuda")
    w = make_weight(k, n, k_contiguous, dtype, "cuda")
    bias = torch.randn(n, dtype=dtype, device="cuda")
    ref = a.float() @ w.float() + bias.float()
    for call in range(3):  # the scratch and its flags are reused: each launch's epoch is new
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        ag_gemm.launch_gemm(a, w, bias, out, sm_count=sm_count, tail_split=tail_split)
        ag_gemm.check_errors(synchronize=True)
        assert not out.isnan().any(), f"call {call}: unwritten output"
        assert relative_error(out, ref) <= 1e-2, f"call {call}"
        scratch = tails.scratch(a.device, torch.cuda.current_stream(), sm_count, waves)
        assert int((scratch.flags == scratch.epoch).sum()) == flags, f"call {call}: parts' flags"


@pytest.mark.gpu
@pytest.mark.parametrize("world,shard_rows,n", [(2, 500, 2056), (4, 250, 1544)])
def test_tail_split_n_ranks_on_one_gpu(world, shard_rows, n):
    """Tail tiles split along K while every simulated rank's kernel runs at once on its own stream (each with its
    own scratch) and waits per tile for the peers' rows (world 2: 24 clusters, 36 tiles, 12 tail tiles in 2 parts;
    world 4: 12 clusters, 28 tiles, 4 tail tiles in 3 parts)."""
    torch.manual_seed(world + n)
    outputs, refs, _, _ = run_ranks_on_one_gpu(world, shard_rows=shard_rows, k=776, ns=[n], with_bias=True)
    for r in range(world):
        assert not outputs[r][0].isnan().any(), f"rank {r}: unwritten output"
        assert relative_error(outputs[r][0], refs[0]) <= 1e-2, f"rank {r}"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [1, 2, 5, 6, 7])
def test_other_kernel_variants(variant):
    """The other variants of the bf16 kernel (K-contiguous weight) are exact too, with and without waits."""
    from fluxinductor.kernels import ag_gemm, gemm_rs

    if variant in (1, 2, 3, 4, 5, 7) and not gemm_rs._extension().gemm_rs_tuning_build():
        pytest.skip(f"AG+GEMM variant {variant} needs a build with CMAKE_ARGS=-DFLUXINDUCTOR_KERNEL_TUNING=ON")

    torch.manual_seed(variant)
    a = torch.randn(1000, 264, dtype=torch.bfloat16, device="cuda")
    w = make_weight(264, 520, True, torch.bfloat16, "cuda")
    bias = torch.randn(520, dtype=torch.bfloat16, device="cuda")
    out = torch.full((1000, 520), float("nan"), dtype=torch.bfloat16, device="cuda")
    ag_gemm.launch_gemm(a, w, bias, out, variant=variant)
    assert relative_error(out, a.float() @ w.float() + bias.float()) <= 1e-2
    from fluxinductor import settings

    with settings.override(ag_variant=variant):
        outputs, refs, _, _ = run_ranks_on_one_gpu(4, shard_rows=129, k=264, ns=[520], with_bias=True)
    for r in range(4):
        assert relative_error(outputs[r][0], refs[0]) <= 1e-2, f"rank {r}"


@pytest.mark.gpu
@pytest.mark.parametrize("world,shard_rows,chunks", [(2, 256, 2), (4, 512, 3), (2, 1024, 2)])
def test_wide_variant_push_n_ranks_on_one_gpu(flux_settings, world, shard_rows, chunks):
    """Variant 6 (256x160 tiles, which the automatic choice takes for 4096 x 14336 outputs) under the push: this rank's
    rows from the shard through the second TMA descriptor (256-row tiles), the peers' rows waited for per row chunk
    (chunks of 128 or 171 rows: a tile waits for two or three), N = 520 and 136 not multiples of 160."""

    flux_settings(ag_variant=6)
    torch.manual_seed(world + shard_rows)
    outputs, refs, gathered, full = run_ranks_on_one_gpu(world, shard_rows, 776, [520, 136], with_bias=True,
                                                         chunks=chunks, push=True)
    _check_ranks(outputs, refs, gathered, full)


@pytest.mark.gpu
def test_unknown_variant_is_an_error():
    """A variant number the extension has no kernel for raises; it never silently runs another variant."""
    from fluxinductor.kernels import ag_gemm

    a = torch.randn(256, 64, dtype=torch.bfloat16, device="cuda")
    w = make_weight(64, 256, True, torch.bfloat16, "cuda")
    out = torch.full((256, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="unknown AG\\+GEMM kernel variant 99"):
        ag_gemm.launch_gemm(a, w, None, out, variant=99)
    assert out.isnan().all()


@pytest.mark.gpu
def test_automatic_variant_on_a_wide_shape():
    """The automatic choice (no ``settings.tuning.ag_variant``) on the per-rank problem of 4096x8192x28672 at TP=2 takes
    variant 6 on a 132-SM device, and the launch is exact."""
    from fluxinductor.kernels import ag_gemm, symm

    from fluxinductor import settings

    if settings.tuning.ag_variant is not None:
        pytest.skip("settings.tuning.ag_variant is set")
    sm_count = symm.extension().ag_device_sm_count()
    torch.manual_seed(6)
    a = torch.randn(4096, 8192, dtype=torch.bfloat16, device="cuda")
    w = make_weight(8192, 14336, True, torch.bfloat16, "cuda")
    bias = torch.randn(14336, dtype=torch.bfloat16, device="cuda")
    expected = 6 if sm_count == 132 else ag_gemm.kernel_variant(torch.bfloat16, w, 4096, sm_count=sm_count)
    assert ag_gemm.kernel_variant(torch.bfloat16, w, 4096) == expected
    out = torch.full((4096, 14336), float("nan"), dtype=torch.bfloat16, device="cuda")
    ag_gemm.launch_gemm(a, w, bias, out)
    assert relative_error(out, a.float() @ w.float() + bias.float()) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["k", "rows"])
def test_waits_mid_call(mode):
    """The peer's pieces released one at a time while the kernel runs: with K chunks every producer stops between
    blocks of its K loop, with row chunks in the scheduler's wait before a tile.  In a subprocess with a timeout,
    since a hang there would not reach the kernel's own flag timeout."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.join(HERE, "run_ag_k_chunk_waits.py"), "--calls", "20", "--mode", mode]
    try:
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the kernel hung with the peer's {mode} chunks arriving mid-call")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    label = "K-CHUNK" if mode == "k" else "ROW-CHUNK"
    assert f"{label} WAITS OK" in result.stdout, result.stdout[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("world,shard_rows,k,k_chunks,chunks,ns", [
    (2, 256, 264, 1, 2, [520, 136]),   # row chunks, two weights, a partial K tile
    (4, 256, 1024, 4, 1, [520]),       # column blocks
])
def test_captured_calls_replay_on_one_gpu(world, shard_rows, k, k_chunks, chunks, ns):
    """Calls captured in CUDA graphs (settings.kernels_under_capture()): each simulated rank captures one push call
    (``captured_push_call``: no per-call epoch) into a graph of its own.  Replaying every rank's graph together, with
    new shards copied into the captured inputs and the outputs poisoned each time, gives the fp32 reference on every
    replay, the gathered A exactly, and leaves the flags and arrival words at 0, which is what the next replay needs
    (a flag left set would let it read the previous replay's rows)."""
    from fluxinductor.kernels import ag_gemm, symm

    torch.manual_seed(world + k_chunks)
    t = _rank_tensors(world, shard_rows, k, ns, with_bias=True, dtype=torch.bfloat16,
                      flags_per_rank=max(chunks, k_chunks))
    _load_kernels(t)
    device = t.device
    symm.error_word(0)  # allocated before any capture (a capture cannot allocate pinned memory)
    symm.clear_error(0)
    arrivals = torch.zeros((world, world), dtype=torch.int32, device=device)  # [r, q]: rank r's word, written by q
    passed = torch.zeros(world, dtype=torch.int32, device=device)
    graphs = []
    for r in range(world):
        def arrive(stream, r=r):
            symm.arrive([arrivals[q, r].data_ptr() for q in range(world)], arrivals[r], passed[r], symm.CAPTURE_EPOCH,
                        symm.CAPTURE_EPOCH, r, stream, timeout_s=5.0, reset=True)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=t.main[r]):
            ag_gemm.captured_push_call(t.shards[r], t.weights, t.biases, t.outputs[r], t.gathered[r], t.buffers,
                                       t.flags, arrive=arrive, rank=r, chunks=chunks,
                                       k_chunks=k_chunks, main=t.main[r], side=t.side[r], sm_count=t.sm_count,
                                       timeout_s=5.0)
        graphs.append(graph)
    torch.cuda.synchronize()
    for replay in range(4):
        for r in range(world):
            t.shards[r].copy_(torch.randn_like(t.shards[r]))
            t.gathered[r].fill_(float("nan"))
            for out in t.outputs[r]:
                out.fill_(float("nan"))
        torch.cuda.synchronize()
        for r in range(world):
            with torch.cuda.stream(t.main[r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        assert symm.read_error(0) == 0, f"replay {replay}: error code {symm.read_error(0)}"
        full = torch.cat(t.shards)
        refs = [full.float() @ w.float() + b.float() for w, b in zip(t.weights, t.biases)]
        _check_ranks(t.outputs, refs, t.gathered, full)
        assert all(int(f.abs().sum()) == 0 for f in t.flags), f"replay {replay}: flags left set"
        assert int(arrivals.abs().sum()) == 0, f"replay {replay}: arrival words left set: {arrivals.tolist()}"
        for r in range(world):
            assert t.buffers[r][r * shard_rows:(r + 1) * shard_rows].isnan().all(), "own rows went into the buffer"


@pytest.mark.gpu
def test_peer_that_never_delivers_raises():
    from fluxinductor.kernels import ag_gemm

    ag_gemm.check_errors(synchronize=True)  # start clean
    for k_chunks in (1, 2):
        run_ranks_on_one_gpu(2, shard_rows=256, k=128, ns=[256], with_bias=False, skip_pull_from=1, timeout_s=0.5,
                             k_chunks=k_chunks)
        with pytest.raises(ag_gemm.AllGatherGemmError, match="timed out"):
            ag_gemm.check_errors(synchronize=True)
        ag_gemm.check_errors(synchronize=True)  # raised once, then clear


@pytest.mark.gpu(min_gpus=2)
def test_two_ranks_torchrun():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           os.path.join(HERE, "run_ag_gemm_2rank.py"), "--calls", "200"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.count("ALL CHECKS PASSED") == 2, result.stdout[-4000:]
