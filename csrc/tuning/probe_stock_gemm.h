// Stock CUTLASS sm90 GEMMs for measurement only (csrc/tuning/probe_stock_gemm.cu; tuning builds).  Torch-free.
#pragma once

#include <cstdint>

namespace fluxinductor::probe {

// Configurations: 0 cooperative 128x256 cluster 2x1, CUTLASS's persistent tile scheduler (the AG+GEMM kernel's tiles
// without its scheduler and mainloop wrapper); 1 the same with CUTLASS's stream-K scheduler; 2 cooperative 256x128
// cluster 1x2, persistent (cuBLAS's tiling on most of the benchmark's shapes).
constexpr int kStockConfigs = 3;

// Workspace bytes a launch of `config` needs for out[m, n] = a[m, k] @ b (bf16, K-major b), or -1 where this build
// has no stock GEMMs (not a tuning build) or the configuration is unknown.
int64_t stock_gemm_workspace(int config, int m, int n, int k, int sm_count);

// Launches it; 0, or -1 with the reason in `error` (`error_size` bytes).  a: [m, k] row-major (row stride lda),
// b: element (k, n) at b[n * ldb + k], out: [m, n] row-major (row stride ldo).
int stock_gemm_run(int config, const void* a, int m, int k, int64_t lda, const void* b, int n, int64_t ldb, void* out,
                   int64_t ldo, void* workspace, int sm_count, void* stream, char* error, int error_size);

}  // namespace fluxinductor::probe
