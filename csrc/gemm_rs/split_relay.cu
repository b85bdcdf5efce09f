// The split GEMM+RS transport's relay GEMM (csrc/include/fluxinductor/gemm_rs/split.cuh), bf16 and fp16, and
// in tuning builds the tuning configurations: the ring's middle steps with more than two ranks.  Built with
// grid-dependency control like the peer GEMM, so the GEMM after it, launched as a programmatic dependent, takes SMs
// as this one's CTAs leave.  Launched as a dependent itself, it waits for the GEMM before it to finish (it reads
// none of that GEMM's output, so this costs the overlap of one wave tail, not correctness).
#define CUTLASS_ENABLE_GDC_FOR_SM90 1
#include "fluxinductor/gemm_rs/split.cuh"

namespace fluxinductor::gemm_rs_split {

int run_relay_gemm(SplitGemmParams const& params, void* stream, std::string* error_message) {
  return run_split_kind<RelayGemm>(params, stream, error_message);
}

}  // namespace fluxinductor::gemm_rs_split
