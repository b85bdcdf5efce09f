"""A fused kernel's wait that gives up in a call made for a CUDA graph must end the CUDA context (no host code runs
inside a replay to raise the error word, and the kernel must not finish with rows that never came): the error code
is written first, then csrc/include/fluxinductor/common/stop_context.cuh faults.  Run in a subprocess by
tests/gpu/test_cudagraph_mode.py::test_captured_wait_that_times_out_stops_the_context, since it ends this process's
CUDA context.

    python tests/gpu/run_captured_wait_stops.py ag:<variant>   # AG+GEMM tile waits, rank 0 of 2, flags never set
    python tests/gpu/run_captured_wait_stops.py rs              # GEMM+RS handshake, rank 0 of 2, the peer never enters

Prints "STOPPED code <error word>" when the synchronize after the launch raised.
"""

from __future__ import annotations

import sys

import torch


def launch_ag(variant: int):
    from fluxinductor.kernels import ag_gemm, symm

    world, shard_rows, k, n = 2, 256, 128, 320
    device = torch.device("cuda", 0)
    a = torch.randn(world * shard_rows, k, dtype=torch.bfloat16, device=device)
    weight = torch.randn(n, k, dtype=torch.bfloat16, device=device).t()  # K-contiguous, as nn.Linear gives it
    out = torch.empty(world * shard_rows, n, dtype=torch.bfloat16, device=device)
    flags = torch.zeros(world * 2, dtype=torch.int32, device=device)  # the peer's chunks never arrive
    symm.error_word(0)
    symm.clear_error(0)
    ag_gemm.launch_gemm(a, weight, None, out, flags=flags, epoch=1, rank=0, world=world, shard_rows=shard_rows,
                        chunks_per_rank=2, variant=variant, timeout_s=0.3, tail_split=1, trap_on_timeout=True)
    return lambda: symm.read_error(0)


def launch_rs():
    from fluxinductor.kernels import gemm_rs

    world, m, k, n = 2, 256, 64, 256
    _, _, nbytes = gemm_rs.buffer_layout(m, n, world, torch.bfloat16)
    buffers = [torch.zeros(nbytes, dtype=torch.uint8, device="cuda") for _ in range(world)]
    error = gemm_rs.ErrorWord()
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(n, k, dtype=torch.bfloat16, device="cuda").t()
    out = torch.empty(m // world, n, dtype=torch.bfloat16, device="cuda")
    gemm_rs.launch(a, weight, None, out, m=m, world=world, rank=0, buffers=[b.data_ptr() for b in buffers],
                   epoch=gemm_rs.CAPTURE_EPOCH, sig=gemm_rs.signature(m, n, k, world, torch.bfloat16),
                   error_address=error.device, timeout=300_000_000, capture=True)
    return error.read


def main(which: str) -> None:
    code = launch_rs() if which == "rs" else launch_ag(int(which.split(":")[1]))
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:  # the context is gone; the host-mapped error word is still readable
        print(f"STOPPED code {code()}: {str(e).splitlines()[0]}", flush=True)
        return
    print(f"NOT STOPPED (wrong): error code {code()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
