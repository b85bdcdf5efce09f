// The stock CUTLASS GEMM probe's entry points from Python (csrc/tuning/probe_stock_gemm_py.cpp; tuning builds only),
// exported by csrc/bindings.cpp under the same names.
#pragma once

#include <cstdint>

namespace fluxinductor::python {

// Workspace bytes of a stock CUTLASS GEMM configuration (-1: unknown configuration).
int64_t probe_stock_gemm_workspace(int config, int m, int n, int k, int sm_count);

// out[m, n] = a[m, k] @ b (bf16, b K-major) with a stock CUTLASS GEMM configuration; raises on an error.
void probe_stock_gemm_run(int config, int64_t a, int m, int k, int64_t lda, int64_t b, int n, int64_t ldb,
                          int64_t out, int64_t ldo, int64_t workspace, int sm_count, int64_t stream);

}  // namespace fluxinductor::python
