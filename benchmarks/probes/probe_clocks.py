#!/usr/bin/env python3
"""SM clock and board power while each contender runs back to back (one GPU, communication off).

    python3 benchmarks/probes/probe_clocks.py --out $OUT/probe_clocks.json

Why: the same kernels rank differently on different machines (ping-pong split GEMMs were ahead of the cooperative ones
on a one-GPU H200 and behind them on a 2xH200 machine), and an H200 at its power
cap lowers its clock.  If a kernel that draws less power keeps a higher clock under sustained load, its lead there is
the power cap's, not the kernel's.

Per per-rank problem [M, K] @ [K, N]: cuBLAS and, with ``--op rs-split``, the split GEMM+RS transport's GEMMs
(``gemm_only(split=True)``) in each configuration of ``--split-configs`` (1 and 2 need a tuning build), or with
``--op ag`` AG+GEMM's kernel with communication off in each variant of ``--variants`` (3-5: tuning builds).  Each contender runs for
``--seconds`` back to back (no gaps), ``--rounds`` times in turn, while ``nvidia-smi`` samples the SM clock and the
power draw every 50 ms; a phase's first 0.5 s is dropped (the clock settles).  Per contender: ms per call, median SM
clock (MHz), median power (W), from the phases' pooled samples.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import git_sha, parse_problems, write_json  # noqa: E402

PROBLEMS = [(8192, 4096, 28672), (4096, 4096, 57344), (3072, 4096, 28672)]
SETTLE_S = 0.5


def run_phase(fn, seconds: float):
    """Calls ``fn`` back to back for about ``seconds``; (start, end, calls, ms per call)."""
    fn()
    torch.cuda.synchronize()
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    start_event.record()
    calls = 0
    while time.time() - t0 < seconds:
        for _ in range(4):
            fn()
        calls += 4
        torch.cuda.synchronize()  # keeps the host from running ahead of the phase
    end_event.record()
    end_event.synchronize()
    return t0, time.time(), calls, start_event.elapsed_time(end_event) / calls


def read_samples(path: str):
    samples = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            try:  # nvidia-smi's local time, as time.time() on the same machine
                t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((t, float(parts[1]), float(parts[2])))
            except (ValueError, IndexError):
                continue
    return samples


def main(argv=None) -> int:
    from fluxinductor.kernels import ag_gemm, gemm_rs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", default=None, help="M,K,N;M,K,N (per-rank problems); default: " + str(PROBLEMS))
    p.add_argument("--op", choices=["rs-split", "ag"], default="rs-split")
    p.add_argument("--split-configs", default="0", help="comma-separated split GEMM configurations (gemm_rs_split_config)")
    p.add_argument("--variants", default="0", help="--op ag: comma-separated AG+GEMM variants")
    p.add_argument("--seconds", type=float, default=2.5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    problems = parse_problems(args.problems, PROBLEMS)
    configs = [int(c) for c in (args.split_configs if args.op == "rs-split" else args.variants).split(",")]
    dev = torch.device("cuda")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    sha, dirty = git_sha()
    data = {"schema": 1, "op": args.op, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "git_sha": sha,
            "dirty": dirty, "seconds": args.seconds, "rounds": args.rounds, "settle_s": SETTLE_S, "results": []}
    log = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
    # Line-buffered, so the samples are in the file while the probe runs.
    sampler = subprocess.Popen(
        ["stdbuf", "-oL", "nvidia-smi", "-i", str(index), "--query-gpu=timestamp,clocks.sm,power.draw",
         "--format=csv,noheader,nounits", "-lms", "50"], stdout=log, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        for m, k, n in problems:
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = (torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5).t()
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)

            def split_fn(config):
                return lambda: gemm_rs.gemm_only(a, w, None, out=out, split=True, split_config_choice=config)
            def ag_fn(variant):
                return lambda: ag_gemm.launch_gemm(a, w, None, out, variant=variant)
            fns = {"cublas": lambda: torch.mm(a, w)}
            if args.op == "rs-split":
                fns.update({f"split_config{c}": split_fn(c) for c in configs})
            else:
                fns.update({f"ag_variant{v}": ag_fn(v) for v in configs})
            phases = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    phases[name].append(run_phase(fn, args.seconds))
            time.sleep(0.3)  # the last samples reach the log
            log.flush()
            samples = read_samples(log.name)
            row = {"problem": [m, k, n], "contenders": {}}
            for name, runs in phases.items():
                picked = [(clk, watts) for t, clk, watts in samples
                          if any(t0 + SETTLE_S <= t <= t1 for t0, t1, _, _ in runs)]
                row["contenders"][name] = {
                    "ms": statistics.median(r[3] for r in runs),
                    "sm_clock_mhz": statistics.median(c for c, _ in picked) if picked else None,
                    "power_w": statistics.median(w_ for _, w_ in picked) if picked else None,
                    "samples": len(picked)}
            data["results"].append(row)
            print(f"{m}x{k}x{n}: " + "; ".join(
                f"{name} {c['ms']:.3f} ms, {c['sm_clock_mhz']} MHz, {c['power_w']} W ({c['samples']} samples)"
                for name, c in row["contenders"].items()), flush=True)
            write_json(args.out, data)
    finally:
        sampler.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
