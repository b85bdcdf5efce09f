// The split GEMM+RS transport's peer GEMM (csrc/include/fluxinductor/gemm_rs_split.cuh), bf16 and fp16.
// Built with grid-dependency control: each CTA signals at its last tile, so the own GEMM, launched as a
// programmatic dependent, takes SMs as this GEMM's CTAs leave instead of after its last wave.  The own GEMM's
// translation unit is built without it, so that kernel does not wait for this one (it reads none of its output).
#define CUTLASS_ENABLE_GDC_FOR_SM90 1
#include "fluxinductor/gemm_rs_split.cuh"

namespace fluxinductor::gemm_rs_split {

int run_peer_gemm(SplitGemmParams const& params, void* stream, std::string* error_message) {
#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
  if (params.dtype == 0) {
    return run_split_gemm<PeerGemm<cutlass::bfloat16_t>, cutlass::bfloat16_t>(params, stream, error_message);
  }
  if (params.dtype == 1) {
    return run_split_gemm<PeerGemm<cutlass::half_t>, cutlass::half_t>(params, stream, error_message);
  }
  *error_message = "dtype must be 0 (bf16) or 1 (fp16)";
#else
  *error_message = "fluxinductor was built without sm90a support (CUTLASS_ARCH_MMA_SM90_SUPPORTED)";
#endif
  return -1;
}

}  // namespace fluxinductor::gemm_rs_split
