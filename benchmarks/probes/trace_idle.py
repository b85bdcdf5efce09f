"""Where a profiled step's GPU time goes: busy, waiting for the host, or waiting for a peer.

Reads Chrome traces that ``bench_model.py --profile N --profile-trace PREFIX`` wrote (CUDA activity: kernels, copies
and the runtime calls that launched them).  Steps are split at the host's synchronizations (``cudaDeviceSynchronize``:
``--profile-exposed`` synchronizes before every step; what was launched before the first one is left out).  Per step, on the compute stream (the stream with the most
kernel time): the span from its first kernel's start to its last one's end; busy time; idle time the host caused (a
gap before a kernel whose launch call ended after the kernel before it had finished: the GPU had nothing queued);
other idle time; the time of the kernels that wait for peers (the AG+GEMM's arrival, the GEMM+RS handshake, NCCL's
kernels); and the busy time by kind of kernel (:data:`KINDS`).

    python benchmarks/probes/trace_idle.py TRACE.json [TRACE.json ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Dict, List

WAIT_KERNELS = ("arrive_and_wait", "gemm_rs_hello", "nccl")
# Kinds of compute-stream work, by name (first match): the peer waits, inductor's triton kernels (whose names can
# mention attention), the fused ops' CUTLASS GEMMs, cuBLAS, attention, copies.
KINDS = (("peer_wait", WAIT_KERNELS), ("triton", ("triton",)), ("cutlass", ("cutlass", "GemmUniversal")),
         ("cublas", ("nvjet", "gemm", "Gemm")), ("attention", ("sdpa", "flash", "attention")),
         ("copy", ("Memcpy", "Memset")))


def kind_of(name: str) -> str:
    for kind, marks in KINDS:
        if any(m in name for m in marks):
            return kind
    return "other"


def _events(path: str) -> List[dict]:
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def steps_of(path: str) -> List[Dict[str, float]]:
    events = _events(path)
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    syncs = sorted(e["ts"] + e["dur"] for e in events
                   if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaDeviceSynchronize")
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy_by_stream: Dict[int, float] = {}
    for k in kernels:
        if k.get("cat") == "kernel":
            busy_by_stream[k["args"]["stream"]] = busy_by_stream.get(k["args"]["stream"], 0.0) + k["dur"]
    compute = max(busy_by_stream, key=busy_by_stream.get)

    def launched(k: dict) -> float:
        r = runtime.get(k["args"].get("correlation"))
        return r["ts"] + r["dur"] if r is not None else k["ts"]

    def step_index(k: dict) -> int:
        t = launched(k)
        return sum(1 for s in syncs if s <= t)

    by_step: Dict[int, List[dict]] = {}
    for k in sorted(kernels, key=lambda e: e["ts"]):
        by_step.setdefault(step_index(k), []).append(k)
    out = []
    # With a synchronization before every step, kernels launched before the first one belong to a step the profile
    # caught only the end of.
    first = 1 if len(syncs) >= 2 else 0
    for index in sorted(i for i in by_step if i >= first):
        ks = by_step[index]
        main = [k for k in ks if k["args"]["stream"] == compute]
        if not main or not any(k.get("cat") == "kernel" for k in main):
            continue
        start, end = main[0]["ts"], max(k["ts"] + k["dur"] for k in main)
        busy = host_idle = other_idle = 0.0
        previous_end = None
        for k in main:
            if previous_end is not None and k["ts"] > previous_end:
                gap = k["ts"] - previous_end
                if launched(k) > previous_end:  # nothing was queued when the stream went idle
                    host_idle += min(gap, launched(k) - previous_end)
                    other_idle += max(0.0, gap - (launched(k) - previous_end))
                else:
                    other_idle += gap
            busy += k["dur"]
            previous_end = max(previous_end or 0.0, k["ts"] + k["dur"])
        waits = sum(k["dur"] for k in main if any(w in k["name"] for w in WAIT_KERNELS))
        by_kind: Dict[str, float] = {}
        for k in main:
            by_kind[kind_of(k["name"])] = by_kind.get(kind_of(k["name"]), 0.0) + k["dur"]
        out.append({"span_us": end - start, "busy_us": busy, "host_idle_us": host_idle, "other_idle_us": other_idle,
                    "peer_wait_kernels_us": waits, "kernels": len(main), "busy_by_kind_us": by_kind})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result = {}
    for path in args.traces:
        steps = steps_of(path)
        result[path] = steps
        if not steps:
            print(f"{path}: no steps")
            continue
        keys = [k for k in steps[0] if k not in ("kernels", "busy_by_kind_us")]
        medians = {k: statistics.median(s[k] for s in steps) for k in keys}
        kinds = sorted({kind for s in steps for kind in s["busy_by_kind_us"]})
        by_kind = {kind: statistics.median(s["busy_by_kind_us"].get(kind, 0.0) for s in steps) for kind in kinds}
        print(f"{path}: {len(steps)} steps; median " + ", ".join(f"{k} {v:.0f}" for k, v in medians.items())
              + "; busy by kind " + ", ".join(f"{k} {v:.0f}" for k, v in by_kind.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
