// The split GEMM+RS transport's own GEMM (csrc/include/fluxinductor/gemm_rs/split.cuh), bf16 and fp16, its fp32
// result for bf16 operands and an N-major weight, and in tuning builds the tuning configurations.
// Built without grid-dependency control (see split_peer.cu).
#include "fluxinductor/gemm_rs/split.cuh"

namespace fluxinductor::gemm_rs_split {

int run_own_gemm(SplitGemmParams const& params, void* stream, std::string* error_message) {
  if (!params.out_float) {
    return run_split_kind<OwnGemm>(params, stream, error_message);
  }
#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
  // fp32 results come from the backward's grad @ W (an N-major weight) under bf16 autocast: built for that alone.
  using cutlass::bfloat16_t;
  using RowMajor = cutlass::layout::RowMajor;
  if (params.dtype == 0 && !params.b_k_major && params.config == 0) {
    return run_split_gemm<OwnGemmFloat<bfloat16_t, 0, RowMajor>, bfloat16_t>(params, stream, error_message);
  }
  if (params.dtype == 0 && !params.b_k_major && params.config == 2) {
    return run_split_gemm<OwnGemmFloat<bfloat16_t, 2, RowMajor>, bfloat16_t>(params, stream, error_message);
  }
#endif
  *error_message = "the split GEMMs write an fp32 result for bf16 operands and an N-major weight only";
  return -1;
}

}  // namespace fluxinductor::gemm_rs_split
