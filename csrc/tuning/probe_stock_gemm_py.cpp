// The stock CUTLASS GEMM probe's entry points from Python (declared in probe_stock_gemm_py.h).  Host-compiled.
#include "tuning/probe_stock_gemm_py.h"

#include <stdexcept>

#include "tuning/probe_stock_gemm.h"

namespace fluxinductor::python {

int64_t probe_stock_gemm_workspace(int config, int m, int n, int k, int sm_count) {
  return probe::stock_gemm_workspace(config, m, n, k, sm_count);
}

void probe_stock_gemm_run(int config, int64_t a, int m, int k, int64_t lda, int64_t b, int n, int64_t ldb,
                          int64_t out, int64_t ldo, int64_t workspace, int sm_count, int64_t stream) {
  char error[384] = {0};
  if (probe::stock_gemm_run(config, reinterpret_cast<const void*>(a), m, k, lda, reinterpret_cast<const void*>(b), n,
                            ldb, reinterpret_cast<void*>(out), ldo, reinterpret_cast<void*>(workspace), sm_count,
                            reinterpret_cast<void*>(stream), error, int(sizeof(error))) != 0) {
    throw std::runtime_error(error);
  }
}

}  // namespace fluxinductor::python
