"""Tests of the one-shot all-reduce kernel (fluxinductor/kernels/one_shot.py, csrc/allreduce/one_shot.cu).

* N ranks on one GPU (world 2, 4, 8): every rank's partial, receive buffer and signal words are plain allocations on
  the one device and each rank's kernel runs on its own stream with a grid small enough that all ranks' kernels are
  resident together; the kernel only sees raw peer pointers, exactly as across NVLink.  Several calls in a row (the
  call counter advances on the device, the calls alternate halves of the receive buffers), the receive buffers
  poisoned with NaN before each call, the output too, every rank's output bit for bit the same.
* Calls with no host synchronization between them: each rank's next partial written on its own stream right after
  its kernel, the ranks' streams free to run a call apart, every call's output checked.
* RMSNorm fused after the reduction (one block per row), both forms, against the fp32 reference of the rounded sum.
* A peer that never enters the call: the wait times out, the error word is set, the kernel returns.
* 2 GPUs: tests/gpu/run_one_shot_2rank.py under torchrun (real symmetric memory, CUDA graphs, 1000 calls, timeout).

Without CUDA, the extension or an sm_90 GPU they skip with the reason.
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
        return f"the extension is built for sm_90a; GPU 0 is {torch.cuda.get_device_capability(0)}"
    try:
        from fluxinductor.kernels import one_shot

        one_shot._extension()
    except RuntimeError as e:
        return str(e)
    return None


_SKIP = _skip_reason()
gpu = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
pytestmark = [pytest.mark.gpu]

BLOCKS = 4  # per simulated rank: 8 ranks x 4 blocks stay resident together


class _Ranks:
    """``world`` simulated ranks on GPU 0: partials, receive buffers, signal words, counters, streams, one error
    word."""

    def __init__(self, world, rows, n, dtype):
        from fluxinductor.kernels import one_shot

        ext = one_shot._extension()
        self.world, self.rows, self.n, self.dtype = world, rows, n, dtype
        self.slot_bytes = (rows * n * dtype.itemsize + 15) // 16 * 16 + 256  # slots a little larger than a partial
        self.partials = [torch.empty(rows, n, dtype=dtype, device="cuda") for _ in range(world)]
        self.buffers = [torch.empty(2 * world * self.slot_bytes, dtype=torch.uint8, device="cuda")
                        for _ in range(world)]
        self.signals = [torch.zeros(ext.ONE_SHOT_SIGNAL_WORDS, dtype=torch.int32, device="cuda") for _ in range(world)]
        self.counters = [torch.zeros(ext.ONE_SHOT_COUNTER_WORDS, dtype=torch.int32, device="cuda")
                         for _ in range(world)]
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        self.error = one_shot.ErrorWord()

    def poison(self):
        for b in self.buffers:
            b.view(torch.int8).fill_(-1)  # 0xff bytes: NaN in bf16, fp16 and fp32

    def launch(self, rank, out, *, bias=None, residual=None, reduce_op="sum", timeout=5_000_000_000, partial=None,
               norm=None):
        from fluxinductor.kernels import one_shot

        partial = self.partials[rank] if partial is None else partial
        norm_weight, normed, eps, weight_after_cast = norm if norm is not None else (None, None, 1e-5, True)
        with torch.cuda.stream(self.streams[rank]):
            one_shot.launch(dtype=self.dtype, out=out, rows=self.rows, n=self.n, world=self.world, rank=rank,
                            partial=partial.data_ptr(), buffers=[b.data_ptr() for b in self.buffers],
                            slot_bytes=self.slot_bytes, signals=[s.data_ptr() for s in self.signals],
                            counters=self.counters[rank].data_ptr(), bias=bias, residual=residual,
                            out_scale=1.0 / self.world if reduce_op == "avg" else 1.0,
                            bias_scale=float(self.world) if reduce_op == "sum" else 1.0,
                            error_address=self.error.device, timeout=timeout, blocks=BLOCKS,
                            stream=self.streams[rank], norm_weight=norm_weight, normed=normed, eps=eps,
                            weight_after_cast=weight_after_cast)


_loaded = set()


def _load(world, dtype, out_dtype):
    """Run rank 0 of a call alone once per kernel instantiation, so CUDA's lazy loading has loaded it before
    simulated ranks spin waiting on each other (a first launch while another rank's kernel spins can stall); its
    start barrier times out and it returns."""
    if (world, dtype, out_dtype) in _loaded:
        return
    ranks = _Ranks(world, 1, 64, dtype)
    out = torch.empty(1, 64, dtype=out_dtype, device="cuda")
    ranks.launch(0, out, timeout=50_000_000)
    torch.cuda.synchronize()
    assert ranks.error.read() == 1, ranks.error.read()
    _loaded.add((world, dtype, out_dtype))


def _simulate(world, rows, n, dtype=torch.bfloat16, out_dtype=None, with_bias=True, with_residual=False,
              reduce_op="sum", calls=3):
    """Every rank's kernel side by side; returns the worst relative error over ranks and calls."""
    out_dtype = out_dtype or dtype
    _load(world, dtype, out_dtype)
    ranks = _Ranks(world, rows, n, dtype)
    worst = 0.0
    for call in range(calls):
        torch.manual_seed(100 * call + world)
        for p in ranks.partials:
            p.copy_(torch.randn(rows, n, device="cuda").to(dtype))
        bias = torch.randn(n, device="cuda").to(dtype) if with_bias else None
        residual = torch.randn(rows, n, device="cuda").to(out_dtype) if with_residual else None
        ref = sum(p.float() for p in ranks.partials)
        if reduce_op == "avg":
            ref = ref / world
        if bias is not None:
            ref = ref + bias.float() * (world if reduce_op == "sum" else 1)
        if residual is not None:
            ref = ref + residual.float()
        outs = [torch.full((rows, n), float("nan"), dtype=out_dtype, device="cuda") for _ in range(world)]
        ranks.poison()
        torch.cuda.synchronize()
        for r in range(world):
            ranks.launch(r, outs[r], bias=bias, residual=residual, reduce_op=reduce_op)
        torch.cuda.synchronize()
        assert ranks.error.read() == 0, ranks.error.read()
        for r in range(world):
            assert not outs[r].isnan().any(), f"rank {r} call {call}: unwritten output"
            assert torch.equal(outs[r].view(torch.uint8), outs[0].view(torch.uint8)), f"rank {r} differs from rank 0"
            worst = max(worst, ((outs[r].float() - ref).norm() / ref.norm()).item())
    for c in ranks.counters:
        assert c.tolist() == [calls, 0], c.tolist()
    return worst


@gpu
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
@pytest.mark.parametrize("rows,n", [(1, 8192), (7, 4096), (129, 8200)])
def test_n_ranks_one_gpu(world, reduce_op, rows, n):
    assert _simulate(world, rows, n, reduce_op=reduce_op) < 1e-2


@gpu
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float16, None), (torch.float32, None),
                                             (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
def test_dtypes_and_residual(dtype, out_dtype):
    tol = 1e-6 if (out_dtype or dtype) == torch.float32 else 1e-2
    assert _simulate(2, 64, 4096, dtype=dtype, out_dtype=out_dtype, with_residual=True) < tol
    assert _simulate(3, 5, 4104 if dtype != torch.float32 else 4100, dtype=dtype, out_dtype=out_dtype,
                     with_bias=False) < tol


@gpu
def test_peer_never_enters_times_out():
    from fluxinductor.kernels import one_shot

    _load(2, torch.bfloat16, torch.bfloat16)  # rank 0 alone: code 1, the kernel returned
    with pytest.raises(RuntimeError, match="never entered"):
        raise RuntimeError(one_shot.error_message(1))


@gpu
@pytest.mark.parametrize("world", [2, 4])
def test_calls_without_host_sync(world):
    """Each rank writes its next partial on its own stream right after its kernel, with no host sync between calls:
    a rank may start call c + 1 while a peer still sums call c, which the alternating halves of the receive buffers
    must keep apart."""
    rows, n, calls = 16, 4096, 24
    _load(world, torch.bfloat16, torch.bfloat16)
    ranks = _Ranks(world, rows, n, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(world)
    inputs = [[torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(world)]
              for _ in range(calls)]
    outs = [[torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(world)]
            for _ in range(calls)]
    torch.cuda.synchronize()
    for r in range(world):  # each rank's whole sequence enqueued before the next rank's
        for c in range(calls):
            with torch.cuda.stream(ranks.streams[r]):
                ranks.partials[r].copy_(inputs[c][r])
            ranks.launch(r, outs[c][r])
    torch.cuda.synchronize()
    assert ranks.error.read() == 0, ranks.error.read()
    for c in range(calls):
        ref = sum(p.float() for p in inputs[c])
        for r in range(world):
            assert torch.equal(outs[c][r].view(torch.int16), outs[c][0].view(torch.int16)), (c, r)
            err = ((outs[c][r].float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (c, r, err)


@gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weight_after_cast", [True, False])
def test_rms_norm_n_ranks_one_gpu(world, dtype, weight_after_cast):
    from fluxinductor import ops

    for rows, n, with_bias in ((1, 8192, False), (6, 4096, True), (70, 1032 if dtype == torch.float32 else 1040, True)):
        _load_norm(world, dtype)
        ranks = _Ranks(world, rows, n, dtype)
        for call in range(2):
            gen = torch.Generator(device="cuda").manual_seed(10 * call + rows)
            for p in ranks.partials:
                p.copy_(torch.randn(rows, n, device="cuda", generator=gen).to(dtype))
            bias = torch.randn(n, device="cuda", generator=gen).to(dtype) if with_bias else None
            residual = torch.randn(rows, n, device="cuda", generator=gen).to(dtype)
            norm_weight = (0.5 + torch.rand(n, device="cuda", generator=gen)).to(dtype)
            ref = sum(p.float() for p in ranks.partials) + residual.float()
            if bias is not None:
                ref = ref + world * bias.float()
            h_ref = ref.to(dtype)
            normed_ref = ops.rms_norm_reference(h_ref.float(), norm_weight.float(), 1e-5, True)
            outs = [torch.full((rows, n), float("nan"), dtype=dtype, device="cuda") for _ in range(world)]
            normeds = [torch.full((rows, n), float("nan"), dtype=dtype, device="cuda") for _ in range(world)]
            ranks.poison()
            torch.cuda.synchronize()
            for r in range(world):
                ranks.launch(r, outs[r], bias=bias, residual=residual, norm=(norm_weight, normeds[r], 1e-5,
                                                                             weight_after_cast))
            torch.cuda.synchronize()
            assert ranks.error.read() == 0, ranks.error.read()
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            for r in range(world):
                for got, want in ((outs[r], h_ref.float()), (normeds[r], normed_ref)):
                    assert not got.isnan().any(), f"rank {r}: unwritten output"
                    err = ((got.float() - want).norm() / want.norm()).item()
                    assert err < tol, (rows, n, r, err)
                assert torch.equal(normeds[r].view(torch.uint8), normeds[0].view(torch.uint8)), r
        for c in ranks.counters:
            assert c.tolist() == [2, 0], c.tolist()


def _load_norm(world, dtype):
    """As :func:`_load`, for the RMSNorm kernel's instantiation."""
    if ("norm", world, dtype) in _loaded:
        return
    ranks = _Ranks(world, 1, 64, dtype)
    out, normed = (torch.empty(1, 64, dtype=dtype, device="cuda") for _ in range(2))
    ranks.launch(0, out, timeout=50_000_000, norm=(torch.ones(64, dtype=dtype, device="cuda"), normed, 1e-5, True))
    torch.cuda.synchronize()
    assert ranks.error.read() == 1, ranks.error.read()
    _loaded.add(("norm", world, dtype))


@gpu
def test_refused_launches_raise():
    from fluxinductor.kernels import one_shot

    ranks = _Ranks(2, 4, 4096, torch.bfloat16)
    out = torch.empty(4, 4096, dtype=torch.bfloat16, device="cuda")
    common = dict(dtype=torch.bfloat16, out=out, world=2, rank=0, buffers=[b.data_ptr() for b in ranks.buffers],
                  signals=[s.data_ptr() for s in ranks.signals], counters=ranks.counters[0].data_ptr(), blocks=1)
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        one_shot.launch(rows=4, n=4100, partial=ranks.partials[0].data_ptr(), slot_bytes=ranks.slot_bytes, **common)
    with pytest.raises(RuntimeError, match="16-byte"):
        one_shot.launch(rows=4, n=4096, partial=ranks.partials[0].data_ptr() + 2, slot_bytes=ranks.slot_bytes,
                        **common)
    with pytest.raises(RuntimeError, match="slots of"):
        one_shot.launch(rows=4, n=4096, partial=ranks.partials[0].data_ptr(), slot_bytes=4 * 4096, **common)


@gpu
def test_two_ranks_torchrun():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs; this machine has {torch.cuda.device_count()}")
    script = os.path.join(HERE, "run_one_shot_2rank.py")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.count("ONE-SHOT CHECKS PASSED") == 2, result.stdout[-4000:]
