#!/usr/bin/env python3
"""What a copy-engine copy running beside a GEMM costs the GEMM, and why (one GPU).

    python3 benchmarks/probes/probe_contention.py --out $OUT/probe_contention.json

Why: on the 2xH200 machine a full-speed copy-engine pull beside a cuBLAS GEMM cost the GEMM more than the pull alone
takes, the same cost holds the fused AG+GEMM's overlap efficiency at 0.5-0.8, and
pacing the pull (same bytes, spread out) changed nothing (docs/design_ag_gemm.md).  A local device-to-device copy on the
copy engine moves the same bytes through this GPU's HBM and L2 as a pull of the peer's shard does (written here, read
there; each GPU serves its peer's pull), so one GPU can ask which resource the copy takes from the GEMM:

- ``gemm``: the GEMM alone; ``copy``: the copy alone (``--bytes``, distinct source and destination).
- ``gemm+copy``: the copy starts on a side stream as the GEMM starts.
- ``gemm+copy_hot``: the same bytes in ``--pieces`` copies between two buffers of bytes/pieces: as much copy-engine
  traffic, but a footprint that stays in L2 (so little HBM traffic and no eviction of the GEMM's lines).
- ``gemm+copy_l2win=<A|B>``: ``gemm+copy`` with an L2 persisting access-policy window over the GEMM's A or B on the
  GEMM's stream (``cudaLimitPersistingL2CacheSize`` set to the device's maximum for the run, reset after).

Found on one H200: the windows slow the GEMM alone by 1-4% and shield nothing,
and a same-device ``cudaMemcpyAsync`` runs as an SM kernel there (1.9 TB/s alone; beside a persistent GEMM that holds
every SM it waits for the GEMM's end), so the copy modes measure SM sharing, not copy-engine contention; the
pull's contention needs two GPUs, or a copy engine forced on one (``cudaMemcpyBatchAsync``, not built here).
Timing: per iteration the contenders run in turn (round-robin) after a
synchronize, behind a ~1 ms sleep kernel that gates both streams until the host has enqueued everything; CUDA
events from the gate's end to the GEMM's end (and the copy's); median of ``--iters``.
``--kernels`` adds fluxinductor's AG+GEMM kernel with communication off (``ag``) beside cuBLAS.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import git_sha, parse_problems, write_json  # noqa: E402

# Per-rank AG+GEMM problems of the TP=2 shapes (global M, K, N -> [M, K] @ [K, N/2]); the pulled shard is M/2 x K.
PROBLEMS = [(4096, 12288, 24576), (8192, 8192, 14336), (2048, 8192, 14336)]
GATE_CYCLES = 2_000_000  # ~1 ms at the H200's clocks

_LIMIT_PERSISTING_L2 = 0x06            # cudaLimitPersistingL2CacheSize
_ATTR_ACCESS_POLICY_WINDOW = 1         # cudaLaunchAttributeAccessPolicyWindow (= cudaStreamAttributeAccessPolicyWindow)
_DEV_ATTR_L2 = 89                      # cudaDevAttrL2CacheSize
_DEV_ATTR_MAX_PERSISTING_L2 = 108      # cudaDevAttrMaxPersistingL2CacheSize
_DEV_ATTR_MAX_WINDOW = 109             # cudaDevAttrMaxAccessPolicyWindowSize
_PROP_NORMAL, _PROP_STREAMING, _PROP_PERSISTING = 0, 1, 2


class _Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class _AttrValue(ctypes.Union):  # cudaLaunchAttributeValue: 64 bytes
    _fields_ = [("window", _Window), ("pad", ctypes.c_char * 64)]


def _cudart():
    """The CUDA runtime torch loaded (its path from this process's maps)."""
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
    if not paths:
        raise RuntimeError("libcudart is not mapped in this process")
    return ctypes.CDLL(sorted(paths)[0])


class L2Window:
    """Sets and clears an L2 persisting access-policy window on one stream."""

    def __init__(self, device_index: int):
        self.rt = _cudart()
        self.dev = device_index
        self.l2 = self._attr(_DEV_ATTR_L2)
        self.max_persisting = self._attr(_DEV_ATTR_MAX_PERSISTING_L2)
        self.max_window = self._attr(_DEV_ATTR_MAX_WINDOW)

    def _attr(self, attr: int) -> int:
        v = ctypes.c_int(0)
        self._check(self.rt.cudaDeviceGetAttribute(ctypes.byref(v), attr, self.dev), "cudaDeviceGetAttribute")
        return v.value

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with cudaError {rc}")

    def set(self, stream: torch.cuda.Stream, tensor: torch.Tensor) -> dict:
        self._check(self.rt.cudaDeviceSetLimit(_LIMIT_PERSISTING_L2, ctypes.c_size_t(self.max_persisting)),
                    "cudaDeviceSetLimit")
        nbytes = min(tensor.numel() * tensor.element_size(), self.max_window)
        value = _AttrValue()
        value.window.base_ptr = tensor.data_ptr()
        value.window.num_bytes = nbytes
        value.window.hitRatio = min(1.0, self.max_persisting / nbytes)
        value.window.hitProp = _PROP_PERSISTING
        value.window.missProp = _PROP_STREAMING
        self._check(self.rt.cudaStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream), _ATTR_ACCESS_POLICY_WINDOW,
                                                   ctypes.byref(value)), "cudaStreamSetAttribute")
        return {"window_bytes": nbytes, "hit_ratio": value.window.hitRatio}

    def clear(self, stream: torch.cuda.Stream) -> None:
        value = _AttrValue()
        value.window.num_bytes = 0
        self._check(self.rt.cudaStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream), _ATTR_ACCESS_POLICY_WINDOW,
                                                   ctypes.byref(value)), "cudaStreamSetAttribute")
        torch.cuda.synchronize()
        self._check(self.rt.cudaCtxResetPersistingL2Cache(), "cudaCtxResetPersistingL2Cache")
        self._check(self.rt.cudaDeviceSetLimit(_LIMIT_PERSISTING_L2, ctypes.c_size_t(0)), "cudaDeviceSetLimit")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", default=None, help="M,K,N;M,K,N (per-rank GEMMs); default: " + str(PROBLEMS))
    p.add_argument("--bytes", default=None, help="copy bytes per problem, comma-separated; default M*K (the AG shard)")
    p.add_argument("--pieces", type=int, default=16, help="gemm+copy_hot: the copy in this many pieces")
    p.add_argument("--kernels", default="cublas", help="comma-separated: cublas, ag (fluxinductor, comm off)")
    p.add_argument("--windows", default="A,B", help="comma-separated operands to try an L2 window on ('' for none)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    problems = parse_problems(args.problems, PROBLEMS)
    copy_bytes = ([int(b) for b in args.bytes.split(",")] if args.bytes else [m * k for m, k, _ in problems])
    if len(copy_bytes) != len(problems):
        p.error("--bytes needs one value per problem")
    kernels = [k for k in args.kernels.split(",") if k]
    windows = [w for w in args.windows.split(",") if w]

    dev = torch.device("cuda", torch.cuda.current_device())
    l2 = L2Window(dev.index)
    sha, dirty = git_sha()
    data = {"schema": 1, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "git_sha": sha,
            "dirty": dirty, "iters": args.iters, "pieces": args.pieces, "l2_bytes": l2.l2,
            "max_persisting_l2_bytes": l2.max_persisting, "max_window_bytes": l2.max_window, "results": []}
    print(f"L2 {l2.l2 >> 20} MiB, persisting max {l2.max_persisting >> 20} MiB, window max {l2.max_window >> 20} MiB")
    gemm_stream, side = torch.cuda.Stream(), torch.cuda.Stream()

    for (m, k, n), nbytes in zip(problems, copy_bytes):
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5).t()
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        src = torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        piece = nbytes // 2 // args.pieces
        hot_src, hot_dst = src[:piece], dst[:piece]

        gemms = {}
        if "cublas" in kernels:
            gemms["cublas"] = lambda: torch.mm(a, w, out=out)
        if "ag" in kernels:
            from fluxinductor.kernels import ag_gemm
            gemms["ag"] = lambda: ag_gemm.launch_gemm(a, w, None, out, variant=0)

        def big_copy():
            dst.copy_(src)

        def hot_copy():
            for _ in range(args.pieces):
                hot_dst.copy_(hot_src)

        def timed(gemm, copy):
            start, gemm_end, copy_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            torch.cuda.synchronize()
            # The gate holds both streams until the host has enqueued everything (16 copies take ~0.1 ms of host
            # time to enqueue; without the gate the GEMM would start that much later than the clock).
            torch.cuda._sleep(GATE_CYCLES)
            start.record()
            gemm_stream.wait_event(start)
            if copy is not None:
                side.wait_event(start)
                with torch.cuda.stream(side):
                    copy()
                copy_end.record(side)
            if gemm is not None:
                with torch.cuda.stream(gemm_stream):
                    gemm()
            gemm_end.record(gemm_stream)
            torch.cuda.synchronize()
            g = start.elapsed_time(gemm_end) if gemm is not None else None
            c = start.elapsed_time(copy_end) if copy is not None else None
            return g, c

        contenders = {"copy": (None, big_copy), "copy_hot": (None, hot_copy)}
        for name, g in gemms.items():
            contenders[f"{name}"] = (g, None)
            contenders[f"{name}+copy"] = (g, big_copy)
            contenders[f"{name}+copy_hot"] = (g, hot_copy)
        def round_robin(pairs):
            """{name: [(gemm ms, copy ms) per timed iteration]}, the contenders in turn each iteration."""
            samples = {name: [] for name in pairs}
            for it in range(args.warmup + args.iters):
                for name, (g, c) in pairs.items():
                    r = timed(g, c)
                    if it >= args.warmup:
                        samples[name].append(r)
            return samples

        samples = round_robin(contenders)
        row = {"problem": [m, k, n], "copy_bytes": nbytes, "contenders": {}}
        for name, rs in samples.items():
            row["contenders"][name] = {
                "gemm_ms": statistics.median(r[0] for r in rs) if rs[0][0] is not None else None,
                "copy_ms": statistics.median(r[1] for r in rs) if rs[0][1] is not None else None}

        # The windows change the L2's configuration for the whole device: measured in their own phase, each with the
        # GEMM alone and beside the copy (round-robin), then cleared.
        for operand in windows:
            target = {"A": a, "B": w}[operand]
            for name, g in gemms.items():
                info = l2.set(gemm_stream, target)
                try:
                    wins = round_robin({f"{name}+l2win={operand}": (g, None),
                                        f"{name}+copy+l2win={operand}": (g, big_copy)})
                finally:
                    l2.clear(gemm_stream)
                for key, rs in wins.items():
                    row["contenders"][key] = {"gemm_ms": statistics.median(r[0] for r in rs),
                                              "copy_ms": (statistics.median(r[1] for r in rs)
                                                          if rs[0][1] is not None else None), **info}
        data["results"].append(row)
        print(f"{m}x{k}x{n}, copy {nbytes / 2**20:.0f} MiB: " + "; ".join(
            f"{name} {c['gemm_ms'] if c['gemm_ms'] is not None else c['copy_ms']:.3f}"
            + (f" (copy {c['copy_ms']:.3f})" if c['gemm_ms'] is not None and c['copy_ms'] is not None else "")
            for name, c in row["contenders"].items()), flush=True)
        write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
