// The split GEMM+RS transport's relay GEMM (csrc/include/fluxinductor/gemm_rs_split.cuh), bf16 and fp16: the
// ring's middle steps with more than two ranks.  Built with grid-dependency control like the peer GEMM, so the GEMM
// after it, launched as a programmatic dependent, takes SMs as this one's CTAs leave.  Launched as a dependent
// itself, it waits for the GEMM before it to finish (it reads none of that GEMM's output, so this costs the overlap
// of one wave tail, not correctness).
#define CUTLASS_ENABLE_GDC_FOR_SM90 1
#include "fluxinductor/gemm_rs_split.cuh"

namespace fluxinductor::gemm_rs_split {

int run_relay_gemm(SplitGemmParams const& params, void* stream, std::string* error_message) {
#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
  if (params.dtype == 0) {
    return run_split_gemm<RelayGemm<cutlass::bfloat16_t>, cutlass::bfloat16_t>(params, stream, error_message);
  }
  if (params.dtype == 1) {
    return run_split_gemm<RelayGemm<cutlass::half_t>, cutlass::half_t>(params, stream, error_message);
  }
  *error_message = "dtype must be 0 (bf16) or 1 (fp16)";
#else
  *error_message = "fluxinductor was built without sm90a support (CUTLASS_ARCH_MMA_SM90_SUPPORTED)";
#endif
  return -1;
}

}  // namespace fluxinductor::gemm_rs_split
