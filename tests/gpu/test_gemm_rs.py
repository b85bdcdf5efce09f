"""Tests of the fused GEMM + reduce-scatter kernel (fluxinductor/kernels/gemm_rs.py, csrc/gemm_rs/gemm_rs.cu).

* ``gemm_only``: the kernel with communication off against an fp32 reference (awkward M, odd N, both weight
  layouts, bias or not, bf16 and fp16), output poisoned with NaN first.
* N ranks on one GPU (world 2, 4, 8): every rank's symmetric buffer is a plain allocation on the one device
  and each rank's kernel runs on its own stream with a persistent grid small enough that all ranks' kernels
  are resident together; the kernels only see raw peer pointers, exactly as across NVLink.  Several calls
  in a row reuse the buffers (epochs).
* A peer that never enters the call: the handshake times out, the error word is set and the host raises.
* 2 GPUs: tests/gpu/run_gemm_rs_2rank.py under torchrun (real symmetric memory, the public interface).

Without CUDA, the extension or an sm_90 GPU the GPU tests skip with the reason; three layout/interface
tests run anywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU; none is available on this machine"
    if torch.cuda.get_device_capability(0) != (9, 0):
        return f"the GEMM+RS kernel is built for sm_90a; GPU 0 is {torch.cuda.get_device_capability(0)}"
    try:
        from fluxinductor.kernels import gemm_rs

        gemm_rs._extension()
    except RuntimeError as e:
        return str(e)
    return None


_SKIP = _skip_reason()
gpu = [pytest.mark.gpu, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]


def _gpu(test):
    for mark in gpu:
        test = mark(test)
    return test


# ---- no GPU needed ---------------------------------------------------------------------------------


def test_unsupported_reason_is_a_reason_on_cpu():
    """CPU tensors (or no extension): a reason string, never an exception, so dispatch decomposes."""
    from fluxinductor.kernels import gemm_rs

    reason = gemm_rs.unsupported_reason(torch.randn(4, 8), torch.randn(8, 4), None, "sum", None)
    assert isinstance(reason, str) and reason


def test_weight_layout_from_strides():
    from fluxinductor.kernels import gemm_rs

    linear_weight = torch.empty(24, 16)  # nn.Linear [N, K]
    assert gemm_rs._weight_layout(linear_weight.t()) == (True, 16)  # [K, N] view: K-major, no copy
    assert gemm_rs._weight_layout(torch.empty(16, 24)) == (False, 24)
    assert gemm_rs._weight_layout(torch.empty(16, 48)[:, ::2]) is None


def test_buffer_layout_arithmetic():
    from fluxinductor.kernels import gemm_rs

    # M=1000 over 2 ranks: 500 rows = 4 tiles of 128; N=300: 3 tiles of 128; 2 sources x 12 flags.
    flags_offset, data_offset, total = gemm_rs._layout(1000, 300, 2, 2, (128, 128, 1))
    assert flags_offset == gemm_rs.HEADER_BYTES
    assert data_offset == -(-(gemm_rs.HEADER_BYTES + 2 * 12 * 4) // 256) * 256
    assert total == data_offset + 2 * 500 * 300 * 2


# ---- GPU -------------------------------------------------------------------------------------------


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def make_weight(k: int, n: int, k_major: bool, dtype, device) -> torch.Tensor:
    """[K, N]: the transposed view of an nn.Linear weight [N, K] (k_major) or a row-major [K, N]."""
    if k_major:
        return (torch.randn(n, k, dtype=torch.float32, device=device) / k**0.5).to(dtype).t()
    return (torch.randn(k, n, dtype=torch.float32, device=device) / k**0.5).to(dtype)


@_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_major", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("m,k,n", [(200, 264, 520), (1000, 72, 136), (1, 16, 8)])
def test_gemm_only(dtype, k_major, with_bias, m, k, n):
    from fluxinductor.kernels import gemm_rs

    torch.manual_seed(m + k + n)
    a = torch.randn(m, k, dtype=dtype, device="cuda")
    w = make_weight(k, n, k_major, dtype, "cuda")
    bias = torch.randn(n, dtype=dtype, device="cuda") if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    gemm_rs.gemm_only(a, w, bias, out=out)
    ref = a.float() @ w.float() + (bias.float() if with_bias else 0)
    assert not out.isnan().any()
    assert relative_error(out, ref) < 1e-2


@_gpu
@pytest.mark.parametrize("dtype,config", [(torch.bfloat16, 0), (torch.bfloat16, 2), (torch.float16, 0)])
@pytest.mark.parametrize("k_major", [True, False])
@pytest.mark.parametrize("m,k,n,with_bias", [(1000, 264, 520, True), (4097, 512, 2048, False), (2, 64, 8, True)])
def test_gemm_only_split(dtype, config, k_major, m, k, n, with_bias):
    """The split transport's two GEMMs with communication off (gemm_only(split=True)): rows [0, M/2), then rows
    [M/2, M) reading a zero source, against the fp32 reference, output poisoned first; the weight K-major (the
    forward's x @ W.t()) or N-major (the backward's grad @ W); configuration 0 (cooperative) and, for bf16, 2
    (ping-pong 128x192)."""
    from fluxinductor.kernels import gemm_rs

    a = torch.randn(m, k, dtype=dtype, device="cuda")
    w = make_weight(k, n, k_major, dtype, "cuda")
    bias = torch.randn(n, dtype=dtype, device="cuda") if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    gemm_rs.gemm_only(a, w, bias, out=out, split=True, split_config_choice=config)
    ref = a.float() @ w.float() + (bias.float() if with_bias else 0)
    assert not out.isnan().any()
    assert relative_error(out, ref) < 1e-2
    with pytest.raises(ValueError):  # neither dim contiguous
        gemm_rs.gemm_only(a, make_weight(k, 2 * n, False, dtype, "cuda")[:, ::2], None, split=True)


@_gpu
@pytest.mark.parametrize("dtype,config", [(torch.bfloat16, 0), (torch.bfloat16, 2), (torch.float16, 0)])
@pytest.mark.parametrize("k_major", [True, False])
@pytest.mark.parametrize("m,ks,n,with_bias", [(1000, (128, 72), 520, True), (4097, (512, 256, 264), 2048, False),
                                              (2, (64, 8), 8, True)])
def test_gemm_only_split_k_slabs(flux_settings, dtype, config, k_major, m, ks, n, with_bias):
    """A sum of matmuls as K slabs of the split transport's GEMMs (gemm_only(split=True, more=...)), each term's
    operands read in place (A's of other row strides, weights of other leading strides, the last K not a multiple
    of the tile's), communication off, against the fp32 reference of the sum, output poisoned first; with the tail
    split of configuration 0 on and off (its parts start inside a slab)."""
    from fluxinductor.kernels import gemm_rs

    flux_settings(gemm_rs_tail_split="4")
    terms = []
    for i, k in enumerate(ks):
        a = torch.randn(m, k + 8 * i, dtype=dtype, device="cuda")[:, :k]  # row stride k + 8i
        w = make_weight(k, n, k_major, dtype, "cuda")
        terms.append((a, w))
    bias = torch.randn(n, dtype=dtype, device="cuda") if with_bias else None
    ref = sum(a.float() @ w.float() for a, w in terms) + (bias.float() if with_bias else 0)
    for tail_split in (None, 1):
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        gemm_rs.gemm_only(terms[0][0], terms[0][1], bias, out=out, split=True, split_config_choice=config,
                          tail_split=tail_split, more=terms[1:])
        gemm_rs.check_gemm_only()
        assert not out.isnan().any()
        assert relative_error(out, ref) < 1e-2
    with pytest.raises(ValueError, match="multiple of 8 and, but the last's, of 64"):
        gemm_rs.gemm_only(terms[0][0][:, :ks[0] - 8], terms[0][1][:ks[0] - 8], None, split=True, more=terms[1:])
    with pytest.raises(ValueError, match="K slabs run on the split transport"):
        gemm_rs.gemm_only(terms[0][0], terms[0][1], None, more=terms[1:])


@_gpu
def test_k_slabs_kernel_refusals():
    """The kernel itself refuses K slabs outside the split transport, and K slabs that do not add up, rather than
    reading past an operand."""
    from fluxinductor.kernels import gemm_rs

    a, a2 = (torch.randn(256, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    w, w2 = (make_weight(64, 128, True, torch.bfloat16, "cuda") for _ in range(2))
    out = torch.empty(128, 128, dtype=torch.bfloat16, device="cuda")
    buffers = [torch.zeros(gemm_rs.buffer_layout(256, 128, 2, torch.bfloat16)[2], dtype=torch.uint8, device="cuda")
               for _ in range(2)]
    args = dict(m=256, world=2, rank=0, buffers=[b.data_ptr() for b in buffers], epoch=1, sig=0,
                error_address=gemm_rs.ErrorWord().device)
    with pytest.raises(RuntimeError, match="K slabs .* are for the split transport"):
        gemm_rs.launch(a, w, None, out, more=[(a2, w2)], **args)
    ext = gemm_rs._extension()
    with pytest.raises(RuntimeError, match="adding up to K"):
        ext.gemm_rs_run(0, 256, 128, 192, 1, 0, a.data_ptr(), 64, w.data_ptr(), 64, True, 0,
                        out.data_ptr(), 128, 1.0, [], 0, 0, 1, 0, gemm_rs.ErrorWord().device, 10**9, 0,
                        torch.cuda.current_stream().cuda_stream, 0, 0, 0, 0, True, 0, True,
                        k_first=64, more_slabs=[a2.data_ptr(), 64, w2.data_ptr(), 64, 64])


@_gpu
def test_gemm_only_odd_n_k_major():
    """Odd N is fine when the weight is K-major (TMA only needs 16-byte K rows); N-major odd N is refused."""
    from fluxinductor.kernels import gemm_rs

    a = torch.randn(130, 64, dtype=torch.bfloat16, device="cuda")
    w = make_weight(64, 1001, True, torch.bfloat16, "cuda")
    out = gemm_rs.gemm_only(a, w, None)
    assert relative_error(out, a.float() @ w.float()) < 1e-2
    w_n_major = make_weight(64, 1001, False, torch.bfloat16, "cuda")
    assert "multiple of 8" in gemm_rs.unsupported_reason(a, w_n_major, None, "sum", None)
    assert "K=60" in gemm_rs.unsupported_reason(a[:, :60], w[:60], None, "sum", None)


def _sm_budget(world, split):
    """CTAs per simulated rank: all ranks resident at once, room for the handshakes.  The split transport's GEMMs
    after the first launch as programmatic dependents, and all ``world`` of a rank may hold SMs at once: a ping-pong
    CTA with one tile has a math warp group with none, which signals the dependent launch as it starts (CUTLASS's
    kernel), so the next GEMM becomes resident, and its own such CTAs let the one after it in.  A GEMM waiting for
    another rank's flags must not keep that rank's GEMMs or copies off the GPU: with two GEMMs per rank budgeted,
    4 ranks of 14 CTAs each, ping-pong, K 2048, timed out in 22 of 300 calls on an H200.  (On separate GPUs the
    dependents only take SMs the grid before them does not hold.)"""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(2, (sms // (world * world if split else world) - 1) // 2 * 2)


def _simulate(world, m, k, n, *, dtype=torch.bfloat16, k_major=True, with_bias=True, reduce_op="sum", calls=3,
              copy_engine=False, split=False, streams=None, tail_split=None, out_dtype=None, batch_rows=0,
              slab_ks=(), own_exact=False, measure=None):
    """Run `world` ranks' kernels side by side on one GPU; returns the max relative error over ranks/calls.
    copy_engine: peer tiles go through each rank's outbox and copy stream (settings.tuning.gemm_rs_push="copy").
    split: the split transport (a ring of GEMMs; implies the copy-engine resources), with ``tail_split`` (None: the
    environment's).  streams: each rank's stream (default: new ones).  out_dtype (float32): the reduction autocast
    makes, each rank's partial rounded to ``dtype`` and summed in fp32, which is then also the reference.
    batch_rows > 0: A is batch-major ([B, S, K] flattened, m = B * S), rank r's result its blocks of batch_rows rows
    ([B, S/world, N]), read in place.  slab_ks: the K of further terms of the reduced sum, K slabs of the split
    GEMMs.  own_exact (with out_dtype): each rank's own partial enters its rows' fp32 sum unrounded (the split
    transport's fp32 result), the peers' rounded.  measure(out, ref): a rank's error (default relative_error)."""
    from fluxinductor.kernels import gemm_rs

    device = torch.device("cuda", 0)
    sm_budget = _sm_budget(world, split)
    _, _, nbytes = gemm_rs.buffer_layout(m, n, world, dtype)
    buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world)]
    pointers = [b.data_ptr() for b in buffers]
    streams = streams or [torch.cuda.Stream(device) for _ in range(world)]
    error = gemm_rs.ErrorWord()
    sig = gemm_rs.signature(m, n, k, world, dtype)
    copy_engine = copy_engine or split
    _load_kernels("split" if split else "copy" if copy_engine else "store", dtype, k_major, out_dtype)
    copies = [gemm_rs.CopyEngineWorkspace(device, world) for _ in range(world)] if copy_engine else [None] * world
    worst = 0.0
    for call in range(1, calls + 1):
        torch.manual_seed(1000 * call + world)
        a = [torch.randn(m, k, dtype=dtype, device=device) for _ in range(world)]
        w = [make_weight(k, n, k_major, dtype, device) for _ in range(world)]
        more = [[(torch.randn(m, ks, dtype=dtype, device=device), make_weight(ks, n, k_major, dtype, device))
                 for ks in slab_ks] for _ in range(world)]
        bias = torch.randn(n, dtype=dtype, device=device) if with_bias else None
        partials = [a[r].float() @ w[r].float() + sum(a_i.float() @ w_i.float() for a_i, w_i in more[r]) +
                    (bias.float() if with_bias else 0) for r in range(world)]
        rounded = [p.to(dtype).float() for p in partials] if out_dtype is not None else partials
        refs = [sum(partials[q] if own_exact and q == r else rounded[q] for q in range(world)) for r in range(world)]
        if reduce_op == "avg":
            refs = [ref / world for ref in refs]
        outs = [torch.full((m // world, n), float("nan"), dtype=out_dtype or dtype, device=device)
                for _ in range(world)]
        torch.cuda.synchronize()
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                gemm_rs.launch(
                    a[r], w[r], bias, outs[r], m=m, world=world, rank=r, buffers=pointers, epoch=call, sig=sig,
                    error_address=error.device, out_scale=(1.0 / world if reduce_op == "avg" else 1.0),
                    timeout=5_000_000_000, sm_count=sm_budget, stream=streams[r], copy=copies[r], split=split,
                    tail_split=tail_split, batch_rows=batch_rows, more=more[r],
                )
        torch.cuda.synchronize()
        assert error.read() == 0, gemm_rs.error_message(error.read())
        rows = m // world
        if batch_rows:  # rank r's rows: its block of every batch
            refs = [ref.view(-1, world, batch_rows, n).transpose(0, 1).reshape(m, n) for ref in refs]
        for r in range(world):
            assert not outs[r].isnan().any(), f"rank {r} call {call}: unwritten output"
            worst = max(worst, (measure or relative_error)(outs[r], refs[r][r * rows:(r + 1) * rows]))
    return worst


_loaded = set()


def _lone_rank_call(transport, dtype=torch.bfloat16, timeout=200_000_000, world=2, k_major=True, out_dtype=None,
                    split_config=None):
    """Rank 0 of a `world`-rank call runs alone (its peers never enter): returns the error code it leaves behind."""
    from fluxinductor.kernels import gemm_rs

    m, k, n = 128 * world, 64, 256
    _, _, nbytes = gemm_rs.buffer_layout(m, n, world, dtype)
    buffers = [torch.zeros(nbytes, dtype=torch.uint8, device="cuda") for _ in range(world)]
    error = gemm_rs.ErrorWord()
    a = torch.randn(m, k, dtype=dtype, device="cuda")
    w = make_weight(k, n, k_major, dtype, "cuda")
    out = torch.empty((m // world, n), dtype=out_dtype or dtype, device="cuda")
    gemm_rs.launch(
        a, w, None, out, m=m, world=world, rank=0, buffers=[b.data_ptr() for b in buffers], epoch=1,
        sig=gemm_rs.signature(m, n, k, world, dtype), error_address=error.device, timeout=timeout,
        copy=gemm_rs.CopyEngineWorkspace(torch.device("cuda", 0), world) if transport != "store" else None,
        split=transport == "split", split_config=split_config,
    )
    torch.cuda.synchronize()  # returns: the kernel gave up instead of hanging
    return error.read()


def _load_kernels(transport, dtype, k_major=True, out_dtype=None, split_config=None):
    """Run rank 0 of a call alone once per transport, dtype and weight layout (3 ranks for the split transport, so
    its relay GEMM runs too), so CUDA's lazy loading has loaded the kernels before simulated ranks wait on each
    other: a first launch while another rank's kernel spins on this GPU stalled until the handshake timed out (seen
    on H200: the first split case of each dtype failed with code 1, and test_n_ranks_one_gpu_layouts with code 3
    when it ran without the tests before it).  The lone rank's handshake times out and its kernels stop waiting
    since the call is aborted.  The split transport's kernels are loaded per configuration (``split_config``, else the
    one settings.tuning.gemm_rs_split_config forces, else the default)."""
    from fluxinductor.kernels import gemm_rs

    config = gemm_rs.resolve_split_config(dtype, split_config) if transport == "split" else None
    key = (transport, dtype, k_major, out_dtype, config)
    if key in _loaded:
        return
    # (an fp32 result runs the split transport at two ranks only)
    code = _lone_rank_call(transport, dtype, timeout=50_000_000,
                           world=3 if transport == "split" and out_dtype is None else 2,
                           k_major=k_major, out_dtype=out_dtype, split_config=config)
    assert code == 1, code
    _loaded.add(key)


@_gpu
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_n_ranks_one_gpu(world, reduce_op):
    # 200 rows per rank: not a multiple of the 128-row tile; N=520 leaves a partial 256-column tile.
    assert _simulate(world, 200 * world, 264, 520, reduce_op=reduce_op) < 1e-2


@_gpu
@pytest.mark.parametrize("world,transport,split_config,out_dtype", [
    (world, transport, config, None) for world in (2, 4)
    for transport, config in (("store", None), ("split", 0), ("split", 2))] + [
    (2, "split", 2, torch.float32)])  # autocast's fp32 result (an N-major weight)
def test_captured_calls_replay_between_eager_calls_one_gpu(world, transport, split_config, out_dtype):
    """Calls captured in CUDA graphs (settings.kernels_under_capture()): each simulated rank captures one call with the
    constant epoch CAPTURE_EPOCH (the handshake resets its words, the flags are zeroed after the call) into a graph
    of its own.  Replays of every rank's graph, with new operands copied into the captured inputs and the outputs
    poisoned, alternate with eager calls on the same buffers and ascending epochs: each gives the fp32 reference, and
    after each replay the hello words and flags are back at 0.  The split transport's graphs hold its copy stream's
    band waits, copies and flag writes; its band counters start each call at 0.  ``out_dtype``: the result's."""
    from fluxinductor.kernels import gemm_rs

    device = torch.device("cuda", 0)
    split = transport == "split"
    m, k, n, dtype = (256 if split else 200) * world, 264, 520 if not split else 512, torch.bfloat16
    sm_budget = _sm_budget(world, split)
    flags_offset, data_offset, nbytes = gemm_rs.buffer_layout(m, n, world, dtype)
    buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world)]
    pointers = [b.data_ptr() for b in buffers]
    streams = [torch.cuda.Stream(device) for _ in range(world)]
    error = gemm_rs.ErrorWord()
    sig = gemm_rs.signature(m, n, k, world, dtype)
    k_major = out_dtype is None
    _load_kernels(transport, dtype, k_major, out_dtype, split_config=split_config)
    a = [torch.empty(m, k, dtype=dtype, device=device) for _ in range(world)]
    w = [make_weight(k, n, k_major, dtype, device) for _ in range(world)]
    bias = torch.randn(n, dtype=dtype, device=device)
    outs = [torch.empty((m // world, n), dtype=out_dtype or dtype, device=device) for _ in range(world)]
    copies = [gemm_rs.CopyEngineWorkspace(device, world) if split else None for _ in range(world)]
    for copy in copies:
        if copy is not None:
            copy.outbox_address(m * n * 2)  # grown before the capture, as an eager call of the shape grows it

    def call(r, epoch, capture):
        gemm_rs.launch(a[r], w[r], bias, outs[r], m=m, world=world, rank=r, buffers=pointers, epoch=epoch, sig=sig,
                       error_address=error.device, timeout=5_000_000_000, sm_count=sm_budget, stream=streams[r],
                       capture=capture, copy=copies[r], split=split, split_config=split_config,
                       tail_split=1 if capture else None)
        if capture:
            buffers[r][flags_offset:data_offset].zero_()

    if split_config == 0:  # a tail split's scratch takes new epochs per launch: the kernel refuses it under capture
        with pytest.raises(RuntimeError, match="runs no tail split"):
            gemm_rs.launch(a[0], w[0], bias, outs[0], m=m, world=world, rank=0, buffers=pointers,
                           epoch=gemm_rs.CAPTURE_EPOCH, sig=sig, error_address=error.device, capture=True,
                           copy=copies[0], split=True, split_config=0, tail_split=4)
    graphs = []
    for r in range(world):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=streams[r]):
            call(r, gemm_rs.CAPTURE_EPOCH, True)
        graphs.append(graph)
    torch.cuda.synchronize()
    rows = m // world
    for step in range(6):
        captured = step % 2 == 0
        for r in range(world):
            a[r].copy_(torch.randn_like(a[r]))
            outs[r].fill_(float("nan"))
        ref = sum(a[r].float() @ w[r].float() + bias.float() for r in range(world))
        torch.cuda.synchronize()
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                if captured:
                    graphs[r].replay()
                else:
                    call(r, step, False)
        torch.cuda.synchronize()
        assert error.read() == 0, gemm_rs.error_message(error.read())
        for r in range(world):
            assert not outs[r].isnan().any(), f"step {step} rank {r}: unwritten output"
            assert relative_error(outs[r], ref[r * rows:(r + 1) * rows]) < 1e-2, f"step {step} rank {r}"
            if captured:
                hello = buffers[r][:4 * world].view(torch.int32)
                assert int(hello.abs().sum()) == 0, f"step {step} rank {r}: hello words left {hello.tolist()}"
                assert int(buffers[r][flags_offset:data_offset].sum()) == 0, f"step {step} rank {r}: flags left set"


@_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("copy_engine", [False, True])
@pytest.mark.parametrize("k_major", [True, False])
@pytest.mark.parametrize("world,reduce_op", [(2, "sum"), (4, "avg")])
def test_fp32_output_n_ranks_one_gpu(dtype, copy_engine, k_major, world, reduce_op):
    """Autocast's fp32 reduction of bf16 (fp16) partials: the result is the fp32 sum of the rounded partials.  The
    tolerance is well under one rounding of the result to the operands' dtype (~1e-3 rms relative for bf16, ~1.4e-4
    for fp16), so an output or a sum in that dtype would fail it."""
    tol = 1e-4 if dtype == torch.bfloat16 else 5e-5
    assert _simulate(world, 200 * world, 264, 520, dtype=dtype, k_major=k_major, reduce_op=reduce_op,
                     copy_engine=copy_engine, out_dtype=torch.float32) < tol


@_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp32_output_comm_off_and_refusals(dtype):
    from fluxinductor.kernels import gemm_rs

    torch.manual_seed(3)
    a = torch.randn(1000, 264, dtype=dtype, device="cuda")
    w = make_weight(264, 520, True, dtype, "cuda")
    bias = torch.randn(520, dtype=dtype, device="cuda")
    out = torch.full((1000, 520), float("nan"), dtype=torch.float32, device="cuda")
    gemm_rs.gemm_only(a, w, bias, out=out)
    ref = (a.float() @ w.float() + bias.float()).to(dtype).float()
    assert not out.isnan().any() and relative_error(out, ref) < (1e-4 if dtype == torch.bfloat16 else 5e-5)
    assert gemm_rs.gemm_only(a, w, None, out_dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match=f"communication off write {dtype}"):
        gemm_rs.gemm_only(a, w, None, split=True, out_dtype=torch.float32)
    # no kernel writes a result in another half-precision dtype
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    assert "the operands' dtype or fp32" in gemm_rs.unsupported_reason(a, w, None, "sum", None, other)
    # the kernel itself refuses the split transport's fp32 output where it has none (a K-major weight, fp16, more than
    # two ranks) instead of writing the operands' dtype into it
    for world, weight in ((2, w), (3, make_weight(264, 520, False, dtype, "cuda"))):
        m = 1000 - 1000 % world
        buffers = [torch.zeros(gemm_rs.buffer_layout(m, 520, world, dtype)[2], dtype=torch.uint8, device="cuda")
                   for _ in range(world)]
        with pytest.raises(RuntimeError, match="writes an fp32 result at two ranks from bf16 operands and an N-major"):
            gemm_rs.launch(a[:m], weight, None, torch.empty((m // world, 520), device="cuda"),
                           m=m, world=world, rank=0, buffers=[b.data_ptr() for b in buffers], epoch=1, sig=0,
                           error_address=gemm_rs.ErrorWord().device,
                           copy=gemm_rs.CopyEngineWorkspace(a.device, world), split=True)
    assert "two ranks" in gemm_rs.split_reason(3, make_weight(264, 520, False, dtype, "cuda"), None, None,
                                               torch.float32)


@_gpu
@pytest.mark.parametrize("config", [0, 2])
@pytest.mark.parametrize("slab_ks", [(), (72,)])
@pytest.mark.parametrize("reduce_op,with_bias,batch_rows", [("sum", True, 0), ("avg", False, 0), ("sum", True, 256)])
def test_split_fp32_output_two_ranks_one_gpu(flux_settings, config, slab_ks, reduce_op, with_bias, batch_rows):
    """Autocast's fp32 reduction through the split transport at two ranks (bf16, the backward's N-major weight): the
    peer's partial crosses in bf16 and the own GEMM adds it to its own fp32 partial, storing fp32.  Checked to well
    under one bf16 rounding of the result against that arithmetic (own partial exact, peer's rounded), with a sum's
    further terms as K slabs too, and over a batch-major operand (4 blocks of 256 rows per rank)."""
    flux_settings(gemm_rs_split_config=str(config))
    m = 2 * 4 * batch_rows if batch_rows else 2 * 1000
    assert _simulate(2, m, 128, 520, k_major=False, with_bias=with_bias, reduce_op=reduce_op, split=True,
                     out_dtype=torch.float32, own_exact=True, slab_ks=slab_ks, batch_rows=batch_rows) < 1e-4


@_gpu
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("bands", [1, 3, 32])
def test_copy_engine_n_ranks_one_gpu(flux_settings, world, bands):
    """Copy-engine transport: peer tiles through the outbox, band counters, copy-stream waits and flag copies.
    1000 rows per rank = 8 tile rows (the last partial): 3 bands split them 3/3/2, 32 bands give one each."""
    flux_settings(gemm_rs_bands=str(bands))
    assert _simulate(world, 1000 * world, 264, 520, reduce_op="avg", copy_engine=True, calls=4) < 1e-2


@_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_engine_layouts_and_odd_n(dtype):
    assert _simulate(2, 2 * 384, 512, 1024, dtype=dtype, k_major=False, with_bias=False, copy_engine=True) < 1e-2
    assert _simulate(4, 4 * 130, 64, 1001, dtype=dtype, copy_engine=True) < 1e-2


@_gpu
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("rows,k,n,bands,reduce_op", [
    (200, 264, 520, 4, "sum"),      # rows not a multiple of the 128-row tile, a partial 256-column tile
    (1000, 264, 520, 3, "avg"),     # 3 column chunks of 1 tile (N=520: 3 tiles); avg scales the bias
    (2500, 512, 2048, 32, "sum"),   # 2 row bands (2048 + 452 rows) x 8 column chunks (one per tile)
    (4200, 64, 1280, 4, "sum"),     # 3 row bands x 4 column chunks of 2/2/1 tiles (5 tiles)
    (1, 64, 8, 4, "avg"),           # one row per rank
])
def test_split_two_ranks_one_gpu(flux_settings, rows, k, n, bands, reduce_op, pdl):
    """Split transport: the peer GEMM's counted TMA stores, the band copies, the own GEMM's per-band waits and its
    source C (the peer's partial), with the programmatic dependent launch (tail split off, which PDL needs) and
    without it (tail split on, the default)."""
    flux_settings(gemm_rs_bands=str(bands))
    flux_settings(gemm_rs_tail_split="1" if pdl == "1" else "4")
    assert _simulate(2, 2 * rows, k, n, reduce_op=reduce_op, split=True, calls=4) < 1e-2


@_gpu
@pytest.mark.parametrize("config", [0, 2])
def test_gemm_only_split_counts_bands(config):
    """gemm_only(split=True, count_bands=True): the same result, and the first GEMM's stored tiles counted (once
    each, the tail split's parts included) in the counters the peer GEMM would give the copy stream."""
    from fluxinductor.kernels import gemm_rs

    m, k, n = 2 * 1000, 264, 1288
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = make_weight(k, n, True, torch.bfloat16, "cuda")
    gemm_rs.gemm_only(a, w, None, split=True, split_config_choice=config, count_bands=True)  # the scratch exists
    gemm_rs.check_gemm_only()
    counters = gemm_rs._count_scratch[a.device.index]
    before = int(counters.sum())
    out = gemm_rs.gemm_only(a, w, None, split=True, split_config_choice=config, count_bands=True)
    gemm_rs.check_gemm_only()
    tile_m, tile_n = (128, 256) if config == 0 else (128, 192)
    assert int(counters.sum()) - before == -(-(m // 2) // tile_m) * -(-n // tile_n)
    assert relative_error(out, a.float() @ w.float()) < 1e-2


@_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_major", [True, False])
def test_split_dtypes_no_bias(dtype, k_major):
    assert _simulate(2, 2 * 384, 512, 1024, dtype=dtype, k_major=k_major, with_bias=False, split=True) < 1e-2


@_gpu
@pytest.mark.parametrize("config,tail_parts", [("0", "1"), ("0", "4"), ("2", "4")])
@pytest.mark.parametrize("world,rows,k,n,bands", [(2, 1000, 776, 1032, 4), (2, 200, 264, 520, 3), (4, 300, 264, 1280, 3)])
def test_split_n_major_weight_n_ranks_one_gpu(flux_settings, world, rows, k, n, bands, config,
                                              tail_parts):
    """The split transport with the weight as a backward's grad @ W gives it (N-major): peer, relay and own GEMMs,
    with bias and avg, the tail split off and on; configurations 0 and 2 (ping-pong 128x192, which has no tail
    split)."""
    flux_settings(gemm_rs_bands=str(bands))
    flux_settings(gemm_rs_tail_split=tail_parts)
    flux_settings(gemm_rs_split_config=config)
    if config != "0":
        from fluxinductor.kernels import gemm_rs

        _lone_rank_call("split", torch.bfloat16, timeout=50_000_000, world=3, k_major=False)  # loads its kernels
        gemm_rs.gemm_only(torch.randn(4, k, dtype=torch.bfloat16, device="cuda"),
                          make_weight(k, n, False, torch.bfloat16, "cuda"), None, split=True)
    assert _simulate(world, world * rows, k, n, k_major=False, reduce_op="avg", split=True, calls=3) < 1e-2


@_gpu
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("world,rows,k,n,bands,reduce_op", [
    (3, 200, 264, 520, 4, "sum"),     # rows not a multiple of the tile, a partial column tile; one relay step
    (4, 1000, 264, 520, 3, "avg"),    # two relay steps; avg scales the own step's bias and source only
    (4, 2500, 512, 2048, 32, "sum"),  # 2 row bands x 8 column chunks per segment
    (8, 300, 64, 1280, 4, "sum"),     # six relay steps
    (4, 1, 64, 8, 4, "avg"),          # one row per rank
])
def test_split_ring_n_ranks_one_gpu(flux_settings, world, rows, k, n, bands, reduce_op, pdl):
    """The split transport's ring with more than two ranks: relay GEMMs that wait per band for rank + 1's partial
    sum, add it as source C and count their own tiles for the copy to rank - 1.  PDL as in the two-rank test."""
    flux_settings(gemm_rs_bands=str(bands))
    flux_settings(gemm_rs_tail_split="1" if pdl == "1" else "4")
    assert _simulate(world, world * rows, k, n, reduce_op=reduce_op, split=True, calls=3) < 1e-2


@_gpu
@pytest.mark.parametrize("config", [0, 2])
@pytest.mark.parametrize("k_major", [True, False])
@pytest.mark.parametrize("world,rows,k,slab_ks,n", [(2, 1000, 128, (72,), 520), (3, 300, 64, (128, 264), 1280),
                                                    (4, 2500, 256, (256,), 2048)])
def test_split_k_slabs_n_ranks_one_gpu(flux_settings, config, k_major, world, rows, k, slab_ks, n):
    """The reduce-scatter of a sum of matmuls run by the split transport with the terms as K slabs of its GEMMs (peer,
    relay and own), each term's operands read in place, against the fp32 reference of the reduced sum."""
    flux_settings(gemm_rs_split_config=str(config))
    assert _simulate(world, world * rows, k, n, k_major=k_major, reduce_op="avg", split=True, calls=2,
                     slab_ks=slab_ks) < 1e-2


@_gpu
@pytest.mark.parametrize("config", [0, 2])
@pytest.mark.parametrize("k_major", [True, False])
@pytest.mark.parametrize("world,batch_rows,blocks,k,slab_ks,n", [(2, 128, 4, 128, (72,), 520),
                                                                 (3, 256, 3, 64, (128, 264), 1280),
                                                                 (4, 512, 2, 256, (256,), 2048)])
def test_split_k_slabs_batch_major_n_ranks_one_gpu(flux_settings, config, k_major, world, batch_rows, blocks, k,
                                                   slab_ks, n):
    """K slabs over batch-major [B, S, K_i] operands (B = blocks, S = world * batch_rows): every term's rows read
    through the blocked row map, each rank's result its block of every batch of the reduced sum."""
    flux_settings(gemm_rs_split_config=str(config))
    m = blocks * world * batch_rows
    assert _simulate(world, m, k, n, k_major=k_major, split=True, calls=2, batch_rows=batch_rows,
                     slab_ks=slab_ks) < 1e-2


@_gpu
@pytest.mark.parametrize("config", [1, 2])
@pytest.mark.parametrize("world,rows,n,bands", [(2, 1000, 520, 3), (2, 2500, 2048, 32), (4, 300, 1280, 4)])
def test_split_config_n_ranks_one_gpu(flux_settings, config, world, rows, n, bands):
    """The split transport's ping-pong configurations (2: 128x192 with 192-column tiles; 1, tuning builds only:
    64x256 in groups of 16 cluster rows; other band arithmetic than the default's), ring and communication-off GEMMs
    against the fp32 reference."""
    from fluxinductor.kernels import gemm_rs

    if config == 1 and not gemm_rs._extension().gemm_rs_tuning_build():
        pytest.skip("split configuration 1 needs a build with CMAKE_ARGS=-DFLUXINDUCTOR_KERNEL_TUNING=ON")
    flux_settings(gemm_rs_split_config=str(config))
    flux_settings(gemm_rs_bands=str(bands))
    a = torch.randn(2 * rows, 264, dtype=torch.bfloat16, device="cuda")
    w = make_weight(264, n, True, torch.bfloat16, "cuda")
    bias = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    out = torch.full((2 * rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm_rs.gemm_only(a, w, bias, out=out, split=True)  # also loads the configuration's kernels before the ring
    torch.cuda.synchronize()
    assert relative_error(out, a.float() @ w.float() + bias.float()) < 1e-2
    _lone_rank_call("split", torch.bfloat16, timeout=50_000_000, world=3)  # loads its relay GEMM
    assert _simulate(world, world * rows, 264, n, reduce_op="avg", split=True, calls=3) < 1e-2


@_gpu
def test_split_ring_dtypes_no_bias():
    assert _simulate(4, 4 * 384, 512, 1024, dtype=torch.float16, with_bias=False, split=True) < 1e-2
    assert _simulate(3, 3 * 130, 64, 1000, with_bias=False, split=True) < 1e-2


def _tail_flags(rows, n, k, sm_count, max_parts, waves=1):
    """How many flags a split GEMM of [rows, n] x K=k raises when it splits its tail: 128x256 tiles in clusters of 2
    CTAs, sm_count / 2 clusters; after at least one full wave, each of the T tail tiles in P parts (the extension's
    ag_tail_split_parts, checked against a simulation in tests/kernels/test_tail_split.py); every part but the last
    raises a flag per CTA and consumer warp group (2 each)."""
    from fluxinductor import _C

    clusters = sm_count // 2
    units = -(-rows // 256) * -(-n // 256)
    tail = units % clusters
    if units < clusters or tail == 0:
        return 0
    parts = _C.ag_tail_split_parts(tail, clusters, min(max_parts, -(-k // 64)), waves)
    return tail * 2 * 2 * (parts - 1)


def _flags_at(scratch, epoch):
    """How many of the scratch's flags (int32 storage of uint32 epochs) hold ``epoch``."""
    return int((scratch.flags == (epoch - (1 << 32) if epoch >= 1 << 31 else epoch)).sum())


@_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n,parts,waves,first,second", [
    (2000, 776, 2552, 4, 1, 32, 32),  # 1000 rows: 40 units on 16 clusters, 8 tail tiles in 2 parts (both GEMMs)
    (1025, 776, 2552, 4, 1, 48, 0),   # 512 rows: 20 units, 4 tail tiles in 4 parts; 513 rows: 30 units, 14 tail: no
    (1537, 776, 2552, 4, 1, 0, 32),   # 768 rows: 30 units, no split; 769 rows: 40 units, 8 tail tiles in 2 parts
    (1025, 776, 2552, 2, 1, 16, 0),   # at most 2 parts
    (1025, 40, 2552, 4, 1, 0, 0),     # one K tile: nothing to split
    (1000, 776, 3320, 4, 2, 80, 80),  # 500 rows: 26 units, 10 tail tiles in 3 parts over two waves
])
def test_gemm_only_split_tail_split(flux_settings, dtype, m, k, n, parts, waves, first, second):
    """The split transport's GEMMs with their partial last waves split along K (communication off), on a grid of 32
    CTAs: exact against the fp32 reference with the output poisoned, three calls reusing the scratch, and the
    scratch's flags show which GEMM split (each GEMM has its own epoch).  ``waves``: settings.tuning.tail_split_waves."""
    from fluxinductor.kernels import gemm_rs, tail_split

    flux_settings(tail_split_waves=str(waves))
    sm_count = 32
    assert _tail_flags(m // 2, n, k, sm_count, parts, waves) == first
    assert _tail_flags(m - m // 2, n, k, sm_count, parts, waves) == second
    torch.manual_seed(m + k + parts)
    a = torch.randn(m, k, dtype=dtype, device="cuda")
    w = make_weight(k, n, True, dtype, "cuda")
    bias = torch.randn(n, dtype=dtype, device="cuda")
    ref = a.float() @ w.float() + bias.float()
    scratch = tail_split.scratch(a.device, torch.cuda.current_stream(), sm_count, waves)
    for call in range(3):
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        gemm_rs.gemm_only(a, w, bias, out=out, split=True, tail_split=parts, sm_count=sm_count)
        gemm_rs.check_gemm_only()
        assert not out.isnan().any(), f"call {call}: unwritten output"
        assert relative_error(out, ref) < 1e-2, f"call {call}"
        # The second GEMM took the scratch's last epoch; where it split, it overwrote the first GEMM's flags.
        assert _flags_at(scratch, scratch.epoch) == second, f"call {call}"
        assert _flags_at(scratch, scratch.epoch - 1) == (first if second == 0 else 0), f"call {call}"


@_gpu
@pytest.mark.parametrize("world,rows,k,n,bands,parts", [
    (2, 1000, 776, 1032, 4, 4),   # 16 clusters per rank, 20 units per GEMM: 4 tail tiles in 4 parts
    (2, 2500, 512, 2048, 32, 3),  # 16 clusters, 80 units: no tail (nothing split), 2 row bands x 8 column chunks
    (4, 300, 264, 1280, 3, 4),    # 7 clusters per rank, 10 units: 3 tail tiles in 2 parts; two relay GEMMs
])
def test_split_tail_split_n_ranks_one_gpu(flux_settings, world, rows, k, n, bands, parts):
    """The split transport with its GEMMs' tails split (settings.tuning.gemm_rs_tail_split): the peer, relay and own
    GEMMs' split tiles beside the band counting, the per-band waits and the source C, every simulated rank with its
    own stream and scratch; the GEMMs run one after another, not as programmatic dependents."""
    from fluxinductor.kernels import tail_split

    flux_settings(gemm_rs_bands=str(bands))
    flux_settings(gemm_rs_tail_split=str(parts))
    flux_settings(tail_split_waves="1")  # the scratch below is the one the launches use
    device = torch.device("cuda", 0)
    streams = [torch.cuda.Stream(device) for _ in range(world)]
    sm_budget = _sm_budget(world, True)
    scratches = [tail_split.scratch(device, stream, sm_budget) for stream in streams]  # pooled streams: maybe used
    before = [scratch.epoch for scratch in scratches]
    assert _simulate(world, world * rows, k, n, reduce_op="avg", split=True, calls=3, streams=streams) < 1e-2
    expected = _tail_flags(rows, n, k, sm_budget, parts)
    for r, scratch in enumerate(scratches):
        assert scratch.epoch == before[r] + 3 * world, f"rank {r}: one epoch per GEMM"
        assert _flags_at(scratch, scratch.epoch) == expected, f"rank {r}"


@_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_major", [True, False])
def test_n_ranks_one_gpu_layouts(dtype, k_major):
    assert _simulate(2, 2 * 384, 512, 1024, dtype=dtype, k_major=k_major, with_bias=False) < 1e-2


@_gpu
def test_odd_n_two_ranks_one_gpu():
    assert _simulate(2, 2 * 130, 64, 1001, with_bias=True) < 1e-2


@_gpu
@pytest.mark.parametrize("config", [1, 4, 5, 6])
@pytest.mark.parametrize("world,n", [(2, 520), (4, 520), (2, 1001)])
def test_tuning_configs_n_ranks_one_gpu(flux_settings, config, world, n):
    """The tuning variants (cooperative 128x256; ping-pong 128x192 and 128x128 cluster 1x1; cooperative with
    bulk-copy pushes and late flags) against the fp32 reference; N=1001 takes the element-wise tail path."""
    from fluxinductor.kernels import gemm_rs

    if not gemm_rs._extension().gemm_rs_tuning_build():
        pytest.skip("tuning variants need a build with CMAKE_ARGS=-DFLUXINDUCTOR_KERNEL_TUNING=ON")
    flux_settings(gemm_rs_config=str(config))
    # Load the variant's kernel before the ranks' kernels wait on each other: with CUDA's lazy module loading a
    # first launch while another rank's kernel spins on this GPU can stall until that kernel's flag wait times
    # out (seen on H200: the first case of every variant failed with code 3, the later ones passed).
    a = torch.randn(128, 264, dtype=torch.bfloat16, device="cuda")
    gemm_rs.gemm_only(a, make_weight(264, n, True, torch.bfloat16, "cuda"), None)
    torch.cuda.synchronize()
    assert _simulate(world, 200 * world, 264, n, calls=4) < 1e-2


@_gpu
@pytest.mark.parametrize("transport,world", [("store", 2), ("copy", 2), ("split", 2), ("split", 4)])
def test_peer_never_signals_raises(transport, world):
    """Only rank 0 of 2 runs: its handshake times out, the error word is set, the host raises.  With the copy
    engine, the aborted kernel still counts every band, so the copy stream drains instead of waiting forever;
    the split transport's own GEMM stops waiting for the peer's bands once the call is aborted."""
    from fluxinductor.kernels import gemm_rs

    code = _lone_rank_call(transport, world=world)
    assert code == 1
    with pytest.raises(RuntimeError, match="never entered"):
        raise RuntimeError(gemm_rs.error_message(code))


@_gpu
def test_two_ranks_torchrun():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs; this machine has {torch.cuda.device_count()}")
    script = os.path.join(HERE, "run_gemm_rs_2rank.py")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@_gpu
@pytest.mark.parametrize("transport", ["store", "copy", "split"])
@pytest.mark.parametrize("world,batch_rows,blocks,k,n", [
    (2, 128, 4, 264, 520),    # blocks of one tile row, a partial K tile
    (4, 256, 3, 512, 1032),   # 3 blocks of two tile rows, a partial N tile
    (2, 512, 2, 1024, 2048),  # several waves
    (8, 128, 2, 256, 264),
])
def test_batch_major_operand_n_ranks_one_gpu(transport, world, batch_rows, blocks, k, n):
    """Every transport reads a batch-major [B, S, K] operand in place (B = blocks, S = world * batch_rows): each rank
    gets its block of every batch, [B, S/world, N], as the reduce-scatter on S of the sum; outputs poisoned first."""
    m = blocks * world * batch_rows
    err = _simulate(world, m, k, n, copy_engine=transport == "copy", split=transport == "split", batch_rows=batch_rows)
    assert err <= 1e-2, err

