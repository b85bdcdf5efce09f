"""Host cost of one call of the fused ops, per dispatch path (torchrun, any world size, CUDA).

A compiled model enqueues its kernels from the host; when a step's host work outruns the GPU, the GPU
idles and the op's device time no longer tells what the model pays.  For each shape and path this prints
(and writes as JSON):

  host_us    host time to enqueue one call while the GPU is kept busy by a sleep kernel (so no call can
             wait on the GPU; a call that synchronizes shows the sleep in this number);
  device_ms  device time of one call, events around it, host enqueue hidden by a sleep first;
  b2b_ms     wall time per call of ``--calls`` back-to-back calls, synchronized at the end: what a stream
             of such calls costs when host and device overlap.

Paths: ``fused``, ``auto`` and ``decomposed`` (``FLUXINDUCTOR_DISPATCH``), ``auto_asynctp`` (``auto`` with the
tuning field ``asynctp`` on), all through ``torch.ops.fluxinductor.*``; ``asynctp_op`` calls PyTorch's
``torch.ops.symm_mem.fused_*`` directly; ``nccl_seq`` is the functional collective then ``torch.mm``.
Operands have the sequence-parallel layout of a DTensor model, [1, S, H] sharded on dim 1.

``--tuning key=value[,...]`` sets kernel-tuning fields for the whole run (``fluxinductor.settings.set_tuning``).
``--profile PATH`` also runs cProfile over ``--calls`` calls of that path on rank 0 and prints the top
functions, so a slow path shows where its host time goes.

Usage: torchrun --nproc-per-node 4 benchmarks/probes/host_overhead.py --shapes rs:4096x8192x8192,ag:4096x8192x10240
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import add_tuning_argument, apply_tuning, git_sha, init_gpu_ranks, overridden, write_json  # noqa: E402

PATHS = ("nccl_seq", "decomposed", "fused", "auto", "auto_asynctp", "asynctp_op")
# The dispatch mode and kernel-tuning fields of each path through torch.ops.fluxinductor.
_PATH_SETTINGS = {
    "decomposed": ("decomposed", {}),
    "fused": ("fused", {}),
    "auto": ("auto", {"asynctp": False}),
    "auto_asynctp": ("auto", {"asynctp": True}),
}


@contextlib.contextmanager
def path_settings(path: str):
    """The dispatch mode and tuning of ``path`` for the ``with`` block (nothing for the paths that bypass it)."""
    mode, values = _PATH_SETTINGS.get(path, (None, {}))
    with overridden(**values, **({} if mode is None else {"dispatch": mode})):
        yield


def parse_shape(text: str):
    op, _, mkn = text.partition(":")
    if op not in ("ag", "rs") or not mkn:
        raise ValueError(f"shape {text!r}: expected ag:MxKxN or rs:MxKxN")
    m, k, n = (int(v) for v in mkn.split("x"))
    return op, m, k, n


def make_call(path: str, op: str, m: int, k: int, n: int, world: int, group_name: str, device):
    """A no-argument callable running one call of ``op`` (global shape m, k, n) on ``path``."""
    import torch.distributed._functional_collectives as funcol

    gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
    dtype = torch.bfloat16
    if op == "ag":
        shard = torch.randn(1, m // world, k, device=device, dtype=dtype, generator=gen)
        weight = (torch.randn(n // world, k, device=device, dtype=dtype, generator=gen) / k**0.5).t()
        if path == "nccl_seq":
            return lambda: torch.matmul(funcol.all_gather_tensor(shard, 1, group_name), weight)
        if path == "asynctp_op":
            return lambda: torch.ops.symm_mem.fused_all_gather_matmul(shard, [weight], 1, group_name)
        fn = torch.ops.fluxinductor.all_gather_matmul
        return lambda: fn(shard, [weight], [None], 1, group_name, False)
    a = torch.randn(1, m, k // world, device=device, dtype=dtype, generator=gen)
    weight = (torch.randn(n, k // world, device=device, dtype=dtype, generator=gen) / k**0.5).t()
    if path == "nccl_seq":
        return lambda: funcol.reduce_scatter_tensor(torch.matmul(a, weight), "sum", 1, group_name)
    if path == "asynctp_op":
        return lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, weight, "sum", 1, group_name)
    fn = torch.ops.fluxinductor.matmul_reduce_scatter
    return lambda: fn(a, weight, None, "sum", 1, group_name)


def _wait(out):
    # funcol results are AsyncCollectiveTensors: wait so the collective is part of the call.
    t = out[0] if isinstance(out, (list, tuple)) else out
    if isinstance(t, (list, tuple)):
        t = t[0]
    return t.wait() if hasattr(t, "wait") else t


def measure(call, calls: int, sleep_cycles: int) -> dict:
    for _ in range(3):
        _wait(call())
    torch.cuda.synchronize()
    # host_us: enqueue `calls` calls behind a long sleep kernel.
    dist.barrier()
    torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    for _ in range(calls):
        _wait(call())
    host_us = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    # device_ms: one call at a time, host enqueue hidden.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device = []
    for _ in range(calls):
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles // 20)
        start.record()
        _wait(call())
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end))
    # b2b_ms: back-to-back calls, wall time.
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        _wait(call())
    torch.cuda.synchronize()
    b2b_ms = (time.perf_counter() - t0) * 1e3 / calls
    return {"host_us": host_us, "device_ms": statistics.median(device), "b2b_ms": b2b_ms}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="rs:4096x8192x8192,rs:4096x28672x8192,ag:4096x8192x10240,ag:4096x8192x57344")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--sleep-cycles", type=int, default=200_000_000, help="GPU sleep behind the host_us loop")
    p.add_argument("--profile", default=None, choices=PATHS, help="cProfile this path on rank 0")
    p.add_argument("--profile-top", type=int, default=25, help="entries printed per sort order of --profile")
    p.add_argument("--out", default=None, help="write JSON here (rank 0)")
    add_tuning_argument(p)
    args = p.parse_args(argv)

    rank, world, device, group_name = init_gpu_ranks()
    tuning_values = apply_tuning(args.tuning)

    rows = []
    for text in args.shapes.split(","):
        op, m, k, n = parse_shape(text)
        for path in args.paths.split(","):
            with path_settings(path):
                row = {"op": op, "m": m, "k": k, "n": n, "path": path}
                try:
                    call = make_call(path, op, m, k, n, world, group_name, device)
                    row.update(measure(call, args.calls, args.sleep_cycles))
                    if path == args.profile:
                        torch.cuda.synchronize()
                        prof = cProfile.Profile()
                        prof.enable()
                        for _ in range(args.calls):
                            _wait(call())
                        prof.disable()
                        torch.cuda.synchronize()
                        if rank == 0:
                            pstats.f8 = lambda x: f"{x * 1e6 / args.calls:8.1f}"  # us per call, not s in all
                            for order in ("tottime", "cumulative"):
                                s = io.StringIO()
                                pstats.Stats(prof, stream=s).sort_stats(order).print_stats(args.profile_top)
                                print(f"--- cProfile {text} {path} ({args.calls} calls), by {order} ---\n"
                                      + "(tottime and cumtime in us per call)\n" + s.getvalue()[-9000:], flush=True)
                except Exception as e:  # noqa: BLE001 - one failing path does not end the run
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                gathered = [None] * world
                dist.all_gather_object(gathered, row)
                if rank == 0:
                    worst = dict(row)
                    for key in ("host_us", "device_ms", "b2b_ms"):
                        vals = [g.get(key) for g in gathered if g.get(key) is not None]
                        worst[key] = max(vals) if vals else None
                    rows.append(worst)
                    f = lambda v, fmt: "-" if v is None else fmt.format(v)  # noqa: E731
                    print(f"{text:22s} {path:13s} host {f(worst.get('host_us'), '{:8.1f}')} us  device "
                          f"{f(worst.get('device_ms'), '{:7.3f}')} ms  b2b {f(worst.get('b2b_ms'), '{:7.3f}')} ms"
                          f"  {worst.get('error', '')}", flush=True)
    if rank == 0 and args.out:
        sha, dirty = git_sha()
        write_json(args.out, {"schema": "fluxinductor.host_overhead/1", "device": torch.cuda.get_device_name(),
                              "world": world, "torch": torch.__version__, "git_sha": sha, "git_dirty": dirty,
                              "tuning": tuning_values, "calls": args.calls, "note": "max over ranks", "rows": rows})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
