// The split GEMM+RS transport's peer GEMM (csrc/include/fluxinductor/gemm_rs/split.cuh), bf16 and fp16, and
// in tuning builds the tuning configurations.
// Built with grid-dependency control: each CTA signals at its last tile, so the own GEMM, launched as a
// programmatic dependent, takes SMs as this GEMM's CTAs leave instead of after its last wave.  The own GEMM's
// translation unit is built without it, so that kernel does not wait for this one (it reads none of its output).
#define CUTLASS_ENABLE_GDC_FOR_SM90 1
#include "fluxinductor/gemm_rs/split.cuh"

namespace fluxinductor::gemm_rs_split {

int run_peer_gemm(SplitGemmParams const& params, void* stream, std::string* error_message) {
  return run_split_kind<PeerGemm>(params, stream, error_message);
}

}  // namespace fluxinductor::gemm_rs_split
