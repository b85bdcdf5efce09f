// The split GEMM+RS transport's own GEMM with a reduce-add store (csrc/include/fluxinductor/gemm_rs_split.cuh),
// bf16 and fp16.  Built without grid-dependency control, as the own GEMM (gemm_rs_split_own.cu).
#include "fluxinductor/gemm_rs_split.cuh"

namespace fluxinductor::gemm_rs_split {

int run_own_reduce_gemm(SplitGemmParams const& params, void* stream, std::string* error_message) {
  return run_split_kind<OwnReduceGemm>(params, stream, error_message);
}

}  // namespace fluxinductor::gemm_rs_split
