"""GEMM+RS's kernel with communication off, bf16 or fp16 operands, writing the operands' dtype or fp32 (autocast's
fp32 reduction), against cuBLAS alone and cuBLAS followed by the cast to fp32 (the unfused graph's compute before
its fp32 reduce-scatter).  One GPU; prints a row per shape and the JSON last.

    python3 benchmarks/probes/probe_fp32_out.py [--dtype bf16|fp16] > out.log
"""
import argparse
import json

import torch

from fluxinductor.kernels import gemm_rs

SHAPES = [(4096, 14336, 8192), (8192, 14336, 8192), (4096, 4096, 8192), (1024, 4096, 8192)]


def best_ms(fn, iters=30, rounds=5):
    """The best of ``rounds`` averages over ``iters`` back-to-back calls (after 5 warm-ups)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[parser.parse_args().dtype]
    rows = []
    for m, k, n in SHAPES:
        a = torch.randn(m, k, dtype=dtype, device="cuda")
        w = torch.randn(n, k, dtype=dtype, device="cuda").t()  # nn.Linear's weight, transposed
        out_half = torch.empty(m, n, dtype=dtype, device="cuda")
        out_fp32 = torch.empty(m, n, dtype=torch.float32, device="cuda")
        row = {"m": m, "k": k, "n": n,
               "cublas_ms": best_ms(lambda: torch.mm(a, w)),
               "cublas_then_cast_ms": best_ms(lambda: torch.mm(a, w).float()),
               "kernel_half_out_ms": best_ms(lambda: gemm_rs.gemm_only(a, w, None, out=out_half)),
               "kernel_fp32_out_ms": best_ms(lambda: gemm_rs.gemm_only(a, w, None, out=out_fp32))}
        row["fp32_kernel_over_cublas_then_cast"] = row["kernel_fp32_out_ms"] / row["cublas_then_cast_ms"]
        print(row, flush=True)
        rows.append(row)
    print(json.dumps({"device": torch.cuda.get_device_name(), "dtype": str(dtype), "torch": torch.__version__,
                      "rows": rows}))


if __name__ == "__main__":
    main()
