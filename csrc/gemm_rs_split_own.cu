// The split GEMM+RS transport's own GEMM (csrc/include/fluxinductor/gemm_rs_split.cuh), bf16 and fp16.
// Built without grid-dependency control (see gemm_rs_split_peer.cu).
#include "fluxinductor/gemm_rs_split.cuh"

namespace fluxinductor::gemm_rs_split {

int run_own_gemm(SplitGemmParams const& params, void* stream, std::string* error_message) {
#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
  if (params.dtype == 0) {
    return run_split_gemm<OwnGemm<cutlass::bfloat16_t>, cutlass::bfloat16_t>(params, stream, error_message);
  }
  if (params.dtype == 1) {
    return run_split_gemm<OwnGemm<cutlass::half_t>, cutlass::half_t>(params, stream, error_message);
  }
  *error_message = "dtype must be 0 (bf16) or 1 (fp16)";
#else
  *error_message = "fluxinductor was built without sm90a support (CUTLASS_ARCH_MMA_SM90_SUPPORTED)";
#endif
  return -1;
}

}  // namespace fluxinductor::gemm_rs_split
