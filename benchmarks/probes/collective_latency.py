"""Latency of the small collectives a tensor-parallel decode step runs (torchrun, CUDA, any world size).

For each size (bytes of the bf16 tensor every rank holds before the collective) and collective: NCCL's
``all_reduce``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, PyTorch's one-shot all-reduce on
symmetric memory (``torch.ops.symm_mem.one_shot_all_reduce``, where it runs) and fluxinductor's (the kernel of the
``matmul_all_reduce`` op, checked against NCCL's result first).  Two timings per point, medians of
``--rounds`` rounds, the collectives alternated within each round:

  exposed_us  a barrier, then CUDA events around one call: what a step that waits on the collective pays;
  graph_us    one call replayed in a CUDA graph, ``--calls`` replays between events, per call: the device time
              with no host work in it (what ``reduce-overhead`` pays).

The all-gather figure is what ``cost_model.SPLIT_ALL_REDUCE_LATENCY_MS`` weighs a split all-reduce against.

Usage: torchrun --nproc-per-node 2 benchmarks/probes/collective_latency.py --out results.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import Timer, git_sha, write_json  # noqa: E402

SIZES = (8 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 32 << 20)


def collectives(numel: int, world: int, device: torch.device, group_name: str):
    x = torch.randn(numel, dtype=torch.bfloat16, device=device)
    gathered = torch.empty(numel * world, dtype=torch.bfloat16, device=device)
    scattered = torch.empty(numel // world, dtype=torch.bfloat16, device=device)
    ops = {
        "nccl_all_reduce": lambda: dist.all_reduce(x),
        "nccl_all_gather": lambda: dist.all_gather_into_tensor(gathered, x),
        "nccl_reduce_scatter": lambda: dist.reduce_scatter_tensor(scattered, x),
    }
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(numel, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buf, group_name)
        buf.copy_(x)
        torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)
        ops["symm_mem_one_shot_all_reduce"] = lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)
    except Exception as e:  # noqa: BLE001 - reported, not fatal: PyTorch's op may not run here
        if dist.get_rank() == 0:
            print(f"symm_mem one-shot all-reduce unavailable: {type(e).__name__}: {e}", flush=True)
    try:
        ops["flux_one_shot_all_reduce"] = flux_one_shot(x, group_name)
    except Exception as e:  # noqa: BLE001 - reported, not fatal: the extension may not be built here
        if dist.get_rank() == 0:
            print(f"fluxinductor's one-shot all-reduce unavailable: {type(e).__name__}: {e}", flush=True)
    return ops


def flux_one_shot(x: torch.Tensor, group_name: str):
    """fluxinductor's one-shot all-reduce of ``x`` (as rows of up to 8192 elements), its input already in the group's
    partial buffer, where the fused op's matmul writes it."""
    from fluxinductor.kernels import one_shot

    n = min(8192, x.numel())
    rows = x.numel() // n
    ws = one_shot.workspace(group_name, x.device)
    ws.reserve(rows * n * x.element_size())
    partial = ws.partial(rows, n, x.dtype)
    partial.copy_(x[:rows * n].view(rows, n))
    out = torch.empty_like(partial)
    blocks = one_shot.blocks_for(rows, n, x.dtype)

    def call():
        # trap_on_timeout: the call is also replayed in a CUDA graph, where no host code reads the error word.
        one_shot.launch(dtype=x.dtype, out=out, rows=rows, n=n, world=ws.world, rank=ws.rank,
                        partial=partial.data_ptr(), buffers=ws.buffer_ptrs, slot_bytes=ws.capacity,
                        signals=ws.signal_ptrs, counters=ws.counters.data_ptr(), error_address=ws.error.device,
                        trap_on_timeout=True, blocks=blocks)

    out.fill_(float("nan"))
    call()
    want = x[:rows * n].view(rows, n).clone()
    dist.all_reduce(want)
    error = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
    if not error <= 1e-2:  # NaN (a row never written) fails too
        raise AssertionError(f"one-shot all-reduce of {rows}x{n}: relative error {error} against NCCL's")
    return call


def graphed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_us(graph, calls: int) -> float:
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def time_contenders(fns: dict, timer, rounds: int, calls: int, rank: int, label: str) -> dict:
    """Each contender's ``exposed_us`` (``timer`` around one eager call) and ``graph_us`` (:func:`graph_us` of its
    captured graph; absent where it cannot be captured), median and [min, max] over ``rounds`` alternated rounds."""
    graphs = {}
    for name, fn in fns.items():
        try:
            graphs[name] = graphed(fn)
        except Exception as e:  # noqa: BLE001 - a contender that cannot be captured is timed eagerly only
            if rank == 0:
                print(f"{name} at {label} not captured: {type(e).__name__}: {e}", flush=True)
    times = {name: {"exposed_us": [], "graph_us": []} for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name]["exposed_us"].append(timer(fn) * 1e3)
            if name in graphs:
                times[name]["graph_us"].append(graph_us(graphs[name], calls))
    summary = {}
    for name, t in times.items():
        summary[name] = {}
        for what, values in t.items():
            if values:
                summary[name][what] = statistics.median(values)
                summary[name][what + "_range"] = [min(values), max(values)]
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group_name = dist.group.WORLD.group_name
    timer = Timer(device)
    results = []
    for size in SIZES:
        ops = collectives(size // 2, world, device, group_name)
        for name, timed in time_contenders(ops, timer, args.rounds, args.calls, rank, f"{size} B").items():
            row = {"bytes": size, "collective": name, **timed}
            results.append(row)
            if rank == 0:
                print(f"{size:>10} B {name:<30} exposed {row['exposed_us']:8.1f} us   graph "
                      f"{row.get('graph_us', float('nan')):8.1f} us", flush=True)
    if rank == 0 and args.out:
        sha, dirty = git_sha()
        write_json(args.out, {"benchmark": "collective_latency", "device": torch.cuda.get_device_name(device),
                              "world": world, "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                              "git_sha": sha, "git_dirty": dirty, "rounds": args.rounds, "results": results})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
