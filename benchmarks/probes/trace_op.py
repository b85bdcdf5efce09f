"""GPU timeline of a few calls of a fused op (torchrun, any world size, CUDA): every kernel and copy they ran,
with stream, start and duration relative to the first traced GPU activity, from torch.profiler (CUPTI).

Shows where a path's time goes: whether the copy engine keeps pace with the GEMM, how long a wait held a
stream, what runs after the GEMM ends.  Paths and shapes as in ``host_overhead.py``; ``--tuning key=value[,...]`` sets
kernel-tuning fields for the traced calls (e.g. ``gemm_rs_push=copy``).

Usage: torchrun --nproc-per-node 4 benchmarks/probes/trace_op.py --shape rs:8192x8192x28672 --path fused \\
           --tuning gemm_rs_push=copy
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import add_tuning_argument, apply_tuning, git_sha, init_gpu_ranks, write_json  # noqa: E402
from host_overhead import PATHS, _wait, make_call, parse_shape, path_settings  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, help="ag:MxKxN or rs:MxKxN (global shape)")
    p.add_argument("--path", default="fused", choices=PATHS)
    add_tuning_argument(p)
    p.add_argument("--calls", type=int, default=2, help="calls traced (each after a barrier, whose NCCL kernel "
                   "separates them in the listing)")
    p.add_argument("--hide-host", action="store_true", help="a GPU sleep before each traced call (as bench_ops.py's "
                   "default), so the host has enqueued the whole call before the GPU reaches it: device-time gaps only")
    p.add_argument("--back-to-back", action="store_true", help="the traced calls one after another with no barrier "
                   "or synchronization between them (host-bound calls show the GPU's gaps)")
    p.add_argument("--out", default=None, help="JSON with every rank's events (rank 0 writes)")
    args = p.parse_args(argv)

    rank, world, device, group_name = init_gpu_ranks()
    extra = apply_tuning(args.tuning)
    op, m, k, n = parse_shape(args.shape)
    with path_settings(args.path):
        call = make_call(args.path, op, m, k, n, world, group_name, device)
        for _ in range(3):
            _wait(call())
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if args.back_to_back:
                dist.barrier()
                torch.cuda.synchronize()
            for i in range(args.calls):
                if not args.back_to_back:
                    dist.barrier()
                    torch.cuda.synchronize()
                with torch.profiler.record_function(f"call{i}"):
                    if args.hide_host:
                        torch.cuda._sleep(2_000_000)
                    _wait(call())
                if not args.back_to_back:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
    events = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        events.append({"name": e.name[:80], "start_us": e.time_range.start, "dur_us": e.time_range.elapsed_us(),
                       "stream": getattr(e, "device_resource_id", None)})
    events.sort(key=lambda e: e["start_us"])
    t0 = events[0]["start_us"] if events else 0
    for e in events:
        e["start_us"] -= t0
    everyone = [None] * world
    dist.all_gather_object(everyone, events)
    if rank == 0:
        for r, evs in enumerate(everyone):
            end = max((e["start_us"] + e["dur_us"] for e in evs), default=0)
            print(f"--- rank {r}: {args.shape} {args.path} {extra or ''}: {len(evs)} GPU events, {end / 1e3:.3f} ms "
                  "from first to last ---", flush=True)
            for e in evs:
                print(f"  stream {e['stream']!s:>4} {e['start_us'] / 1e3:8.3f} +{e['dur_us'] / 1e3:7.3f} ms  {e['name']}",
                      flush=True)
        if args.out:
            sha, dirty = git_sha()
            write_json(args.out, {"schema": "fluxinductor.trace_op/1", "device": torch.cuda.get_device_name(),
                                  "world": world, "shape": args.shape, "path": args.path, "tuning": extra,
                                  "git_sha": sha, "git_dirty": dirty, "events_by_rank": everyone})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
