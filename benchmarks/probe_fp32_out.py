"""GEMM+RS's kernel with communication off, bf16 operands, writing bf16 or fp32 (autocast's fp32 reduction), against
cuBLAS alone and cuBLAS followed by the cast to fp32 (the unfused graph's compute before its fp32 reduce-scatter).
One GPU; prints a row per shape and the JSON last.

    python3 benchmarks/probe_fp32_out.py > out.log
"""
import json, torch
from fluxinductor.kernels import gemm_rs
def t(fn, iters=30):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = []
    for _ in range(5):
        s.record()
        for _ in range(iters): fn()
        e.record(); torch.cuda.synchronize()
        best.append(s.elapsed_time(e) / iters)
    return min(best)
rows = []
for m, k, n in [(4096, 14336, 8192), (8192, 14336, 8192), (4096, 4096, 8192), (1024, 4096, 8192)]:
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda").t()
    o16 = torch.empty(m, n, dtype=torch.bfloat16, device="cuda"); o32 = torch.empty(m, n, dtype=torch.float32, device="cuda")
    r = {"m": m, "k": k, "n": n,
         "cublas_ms": t(lambda: torch.mm(a, w)),
         "cublas_then_cast_ms": t(lambda: torch.mm(a, w).float()),
         "kernel_bf16_out_ms": t(lambda: gemm_rs.gemm_only(a, w, None, out=o16)),
         "kernel_fp32_out_ms": t(lambda: gemm_rs.gemm_only(a, w, None, out=o32))}
    print(r, flush=True); rows.append(r)
print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))
