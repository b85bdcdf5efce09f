// The split GEMM+RS transport's own GEMM (csrc/include/fluxinductor/gemm_rs/split.cuh), bf16 and fp16, and
// in tuning builds the tuning configurations.
// Built without grid-dependency control (see split_peer.cu).
#include "fluxinductor/gemm_rs/split.cuh"

namespace fluxinductor::gemm_rs_split {

int run_own_gemm(SplitGemmParams const& params, void* stream, std::string* error_message) {
  return run_split_kind<OwnGemm>(params, stream, error_message);
}

}  // namespace fluxinductor::gemm_rs_split
