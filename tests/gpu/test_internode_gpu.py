"""The inter-node path's pieces on GPUs (fluxinductor/kernels/internode.py).

* The reduction kernel (csrc/internode/reduce_arrivals.h) on one GPU: ``world`` senders' partials in slots, their
  flags raised on a side stream after a delay, the output poisoned with NaN first; the sum against fp32 in rank order,
  bf16 and fp16, the 16-byte and the scalar paths, ``avg``; a sender whose flag never comes: the kernel gives up after
  the timeout and writes its error code.
* 2 GPUs (two emulated nodes) and 4 GPUs (two nodes of two: the rails): tests/gpu/run_internode.py under torchrun
  (NVSHMEM puts, torch.compile, 1000 calls, a missing peer).

Without CUDA, the extension or an sm_90 GPU they skip with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = [pytest.mark.gpu]

_CODES = {torch.bfloat16: 0, torch.float16: 1}


def _reduce(slots, flags, epoch, out, world, rank, scale=1.0, timeout_ns=5_000_000_000, stream=None):
    from fluxinductor.kernels import loader
    from fluxinductor.kernels.symm import ErrorWord

    error = ErrorWord()
    rows, n = out.shape
    stream = stream or torch.cuda.current_stream()
    loader.extension().reduce_arrivals(_CODES[out.dtype], rows, n, world, rank, slots.data_ptr(), slots.stride(0),
                                       flags.data_ptr(), epoch, out.data_ptr(), scale, error.device, timeout_ns,
                                       stream.cuda_stream)
    return error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world,rows,n", [(1, 3, 64), (2, 129, 4096), (4, 7, 1001), (8, 64, 8)])
def test_reduce_arrivals_sums_once_every_flag_is_up(dtype, world, rows, n):
    torch.manual_seed(world * rows + n)
    stride = rows * n + (8 if n % 8 else 0)  # a padded slot stride where the scalar path runs anyway
    slots = torch.randn(world, stride, device="cuda").to(dtype)
    flags = torch.zeros(world, dtype=torch.int32, device="cuda")
    out = torch.full((rows, n), float("nan"), dtype=dtype, device="cuda")
    rank, epoch = world - 1, 5
    senders = torch.cuda.Stream()
    torch.cuda._sleep(1_000_000)  # the kernel is queued while no flag is up yet
    with torch.cuda.stream(senders):
        torch.cuda._sleep(20_000_000)
        flags.fill_(epoch)
    scale = 1.0 / world
    error = _reduce(slots, flags, epoch, out, world, rank, scale)
    torch.cuda.synchronize()
    ref = sum(slots[q, :rows * n].float() for q in range(world)).view(rows, n) * scale
    assert error.read() == 0
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_reduce_arrivals_gives_up_on_a_missing_sender():
    from fluxinductor.kernels import loader

    world, rows, n = 2, 16, 256
    slots = torch.randn(world, rows * n, device="cuda").to(torch.bfloat16)
    flags = torch.tensor([7, 6], dtype=torch.int32, device="cuda")  # sender 1 still at the previous call
    out = torch.zeros(rows, n, dtype=torch.bfloat16, device="cuda")
    error = _reduce(slots, flags, 7, out, world, 0, timeout_ns=200_000_000)
    torch.cuda.synchronize()
    assert error.read() == loader.extension().REDUCE_ARRIVALS_TIMEOUT


def _torchrun(ranks: int, gpus_per_node: int):
    script = os.path.join(HERE, "run_internode.py")
    env = dict(os.environ)
    env.setdefault("NVSHMEM_SYMMETRIC_SIZE", "2G")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), script,
                             str(gpus_per_node)], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.count("INTERNODE CHECKS PASSED") == ranks, result.stdout[-4000:]


@pytest.mark.gpu(min_gpus=2)
def test_two_emulated_nodes_torchrun():
    _torchrun(2, 1)


@pytest.mark.gpu(min_gpus=4)
def test_two_emulated_nodes_of_two_gpus_torchrun():
    """The rails: AG+GEMM's forwarding inside a node, GEMM+RS's sums per node."""
    _torchrun(4, 2)
