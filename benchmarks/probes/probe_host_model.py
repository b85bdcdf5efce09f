"""Host time of compiled model steps, and where it goes: bench_model's sequence-parallel Llama layers (full config,
bf16, no grad) compiled per backend, each step enqueued behind a long GPU sleep so that the host is timed alone, then
a cProfile of more such steps (rank 0 prints the top entries by own and by cumulative time).

    torchrun --nproc-per-node 2 benchmarks/probes/probe_host_model.py --backends inductor,flux [--steps 10] [--top 28]

With FLUXINDUCTOR_DISPATCH=fused it shows how much of a flux step's host time the fused ops' Python (dispatch,
checks, launches) takes against inductor's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the models
import models  # noqa: E402

_SLEEP_CYCLES = 50_000_000  # ~25 ms: longer than any step's enqueue


def host_steps(fn, x, steps: int, prof=None):
    """Host ms of each of ``steps`` calls, each enqueued behind a GPU sleep (profiled when ``prof`` is given)."""
    times = []
    for _ in range(steps):
        torch.cuda._sleep(_SLEEP_CYCLES)
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1e3)
        if prof is not None:
            prof.disable()
        torch.cuda.synchronize()
        dist.barrier()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="inductor,flux")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=28)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (world,))
    cfg = dict(models.CONFIGS["full"]["llama2"])
    model = models.build_model("llama2", cfg, mesh, device, torch.bfloat16, 1)
    x = torch.randn(models.input_shape("llama2", cfg, world, 1), dtype=torch.bfloat16, device=device)
    for backend in args.backends.split(","):
        torch._dynamo.reset()
        if backend == "flux":
            import fluxinductor  # noqa: F401  (registers the backend)
        fn = torch.compile(model, backend=backend)
        with torch.no_grad():
            host_steps(fn, x, 3)  # compile and warm up
            times = host_steps(fn, x, args.steps)
            prof = cProfile.Profile()
            host_steps(fn, x, args.steps, prof)
        if rank == 0:
            print(f"=== {backend}: host ms per step, median {statistics.median(times):.3f}, min {min(times):.3f}",
                  flush=True)
            pstats.f8 = lambda v: f"{v * 1e6 / args.steps:8.1f}"  # us per step, not s in all
            print("(tottime and cumtime in us per step)", flush=True)
            for key in ("tottime", "cumulative"):
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
                print("\n".join(line[:200] for line in out.getvalue().splitlines()[6:]), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
