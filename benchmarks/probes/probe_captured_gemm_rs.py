#!/usr/bin/env python3
"""GEMM+RS calls replayed from CUDA graphs against the same calls made eagerly, simulated ranks on one GPU.

    python3 benchmarks/probes/probe_captured_gemm_rs.py --out $OUT/captured_gemm_rs.json

As ``tests/gpu/test_gemm_rs.py`` simulates ranks: every rank's buffer is a plain allocation on the one device, each
rank's calls run on a stream of their own with a persistent grid of a share of the SMs (the split transport: two
GEMMs' worth), and the kernels see only raw peer pointers.  Per transport (stores; split in configuration 2, and in
configuration 0, whose eager calls split their tails and whose captured ones cannot), one call per rank captured into
a graph of its own, then rounds that alternate: every rank's eager call, every rank's graph replayed; device time
from an event before the ranks' streams fork to one after they join.  The ranks share the GPU's SMs, HBM and copy
engines, so the times say what capturing costs or saves (a graph's copy-stream branch, its stream memory operations,
its programmatic launches), not what two GPUs joined by NVLink would take.  Each replay's output is checked against
an fp32 reference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import git_sha, write_json  # noqa: E402

TRANSPORTS = [("store", None), ("split", 2), ("split", 0)]


def run(world: int, m: int, k: int, n: int, transport: str, config, rounds: int, iters: int) -> dict:
    from fluxinductor.kernels import gemm_rs

    device = torch.device("cuda", 0)
    dtype = torch.bfloat16
    split = transport == "split"
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    sm_budget = max(2, (sms // (2 * world if split else world) - 1) // 2 * 2)
    flags_offset, data_offset, nbytes = gemm_rs.buffer_layout(m, n, world, dtype)
    buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world)]
    pointers = [b.data_ptr() for b in buffers]
    streams = [torch.cuda.Stream(device) for _ in range(world)]
    error = gemm_rs.ErrorWord()
    sig = gemm_rs.signature(m, n, k, world, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    a = [torch.randn(m, k, dtype=dtype, device=device, generator=gen) for _ in range(world)]
    w = [(torch.randn(n, k, dtype=dtype, device=device, generator=gen) / k**0.5).t() for _ in range(world)]
    outs = [torch.empty((m // world, n), dtype=dtype, device=device) for _ in range(world)]
    copies = [gemm_rs.CopyEngineWorkspace(device, world) if split else None for _ in range(world)]
    for copy in copies:
        if copy is not None:
            copy.outbox_address(m * n * 2)
    epoch = [0]

    def call(r, capture):
        gemm_rs.launch(a[r], w[r], None, outs[r], m=m, world=world, rank=r, buffers=pointers,
                       epoch=gemm_rs.CAPTURE_EPOCH if capture else epoch[0], sig=sig, error_address=error.device,
                       sm_count=sm_budget, stream=streams[r], capture=capture, copy=copies[r], split=split,
                       split_config=config, tail_split=1 if capture else None)
        if capture:
            buffers[r][flags_offset:data_offset].zero_()

    graphs = []
    for r in range(world):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=streams[r]):
            call(r, True)
        graphs.append(graph)
    torch.cuda.synchronize()

    main = torch.cuda.current_stream(device)

    def step(captured: bool) -> None:
        epoch[0] += 1
        for r in range(world):
            streams[r].wait_stream(main)
            with torch.cuda.stream(streams[r]):
                if captured:
                    graphs[r].replay()
                else:
                    call(r, False)
        for r in range(world):
            main.wait_stream(streams[r])

    def timed(captured: bool) -> float:
        torch.cuda._sleep(2_000_000)  # the host enqueues every rank's call before the GPU reaches them
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        step(captured)
        end.record(main)
        end.synchronize()
        return start.elapsed_time(end)

    for captured in (False, True, False, True):
        step(captured)
    torch.cuda.synchronize()
    times = {"eager": [], "captured": []}
    for _ in range(rounds):
        for name in times:
            times[name].append(statistics.median(timed(name == "captured") for _ in range(iters)))
    assert error.read() == 0, gemm_rs.error_message(error.read())
    ref = sum(a[r].float() @ w[r].float() for r in range(world))
    rows = m // world
    for r in range(world):
        outs[r].fill_(float("nan"))
    step(True)
    torch.cuda.synchronize()
    worst = max(float((outs[r].float() - ref[r * rows:(r + 1) * rows]).norm() / ref[r * rows:(r + 1) * rows].norm())
                for r in range(world))
    if not worst < 1e-2:
        raise RuntimeError(f"{transport}{config}: a replay's relative error {worst}")
    return {"transport": transport, "split_config": config, "world": world, "problem": [m, k, n],
            "sm_budget": sm_budget, "rel_err": worst, "round_ms": times,
            "ms": {name: statistics.median(t) for name, t in times.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", default="4096,4096,8192;4096,14336,8192",
                   help="M,K,N;... per-rank problems (M rows, K per rank)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sha, dirty = git_sha()
    data = {"schema": 1, "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "git_sha": sha,
            "dirty": dirty, "world": args.world, "rounds": args.rounds, "iters": args.iters, "results": []}
    for problem in args.problems.split(";"):
        m, k, n = (int(x) for x in problem.split(","))
        for transport, config in TRANSPORTS:
            row = run(args.world, m, k, n, transport, config, args.rounds, args.iters)
            data["results"].append(row)
            print(f"{m}x{k}x{n} {transport}{'' if config is None else config}: eager {row['ms']['eager']:.3f} ms, "
                  f"captured {row['ms']['captured']:.3f} ms ({row['ms']['captured'] / row['ms']['eager']:.3f}x), "
                  f"replay error {row['rel_err']:.1e}", flush=True)
            write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
