"""A peer that never reaches the call: the AG+GEMM's arrival (csrc/ag_gemm/arrival.cu) must give up after its timeout and
stop the CUDA context (trap) instead of releasing the copy stream or spinning forever.  Run in a subprocess by
tests/gpu/test_ag_gemm.py::test_arrival_timeout_traps, since the trap ends this process's CUDA context.

Prints "ARRIVAL TRAPPED code <error word>" when the synchronize after the arrival raised.
"""

from __future__ import annotations

import time

import torch

from fluxinductor.kernels import symm


def main() -> None:
    device = torch.device("cuda", 0)
    world, rank, epoch = 2, 0, 5
    arrivals = torch.zeros((world, world), dtype=torch.int32, device=device)
    arrivals[rank, 1] = epoch - 2  # peer 1 is two calls behind: a push (need = epoch - 1) must not pass
    passed = torch.zeros(1, dtype=torch.int32, device=device)
    symm.clear_error(0)
    symm.error_word(0)
    stream = torch.cuda.Stream(device)
    torch.cuda.synchronize()
    start = time.monotonic()
    symm.arrive([arrivals[q, rank].data_ptr() for q in range(world)], arrivals[rank], passed[0], epoch, epoch - 1,
                rank, stream, timeout_s=0.3)
    try:
        stream.synchronize()
    except RuntimeError as e:  # the trap: the context is gone, only host memory is still readable
        print(f"ARRIVAL TRAPPED code {symm.read_error(0)} after {time.monotonic() - start:.2f} s: {e}", flush=True)
        return
    print(f"ARRIVAL PASSED (wrong): passed word {passed.item()}", flush=True)


if __name__ == "__main__":
    main()
