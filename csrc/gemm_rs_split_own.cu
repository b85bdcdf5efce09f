// The split GEMM+RS transport's own GEMM (csrc/include/fluxinductor/gemm_rs_split.cuh), bf16 and fp16, and
// in tuning builds the tuning configurations.
// Built without grid-dependency control (see gemm_rs_split_peer.cu).
#include <cstdlib>

#include "fluxinductor/gemm_rs_split.cuh"

namespace fluxinductor::gemm_rs_split {

int run_own_gemm(SplitGemmParams const& params, void* stream, std::string* error_message) {
#if defined(FLUXINDUCTOR_KERNEL_TUNING) && defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
  // Tuning builds: FLUXINDUCTOR_GEMM_RS_OWN_EPILOGUE = 1..3 takes an explicit epilogue policy (bf16, configuration 0).
  char const* value = std::getenv("FLUXINDUCTOR_GEMM_RS_OWN_EPILOGUE");
  int const epilogue = value != nullptr ? std::atoi(value) : 0;
  if (epilogue != 0 && params.config == 0 && params.dtype == 0) {
    using cutlass::bfloat16_t;
    switch (epilogue) {
      case 1:  // C and D apart, 2 stages each: C refills without waiting for D's stores
        return run_split_gemm<TunedOwn<2, 2, false, false>::Gemm<bfloat16_t, 0>, bfloat16_t>(params, stream,
                                                                                            error_message);
      case 2:  // and D's TMA stores delayed behind the next subtile's math
        return run_split_gemm<TunedOwn<2, 2, false, true>::Gemm<bfloat16_t, 0>, bfloat16_t>(params, stream,
                                                                                           error_message);
      case 3:  // the builder's stages without the reuse, stores delayed (more shared memory: fewer mainloop stages)
        return run_split_gemm<TunedOwn<4, 2, false, true>::Gemm<bfloat16_t, 0>, bfloat16_t>(params, stream,
                                                                                           error_message);
      default:
        *error_message = "FLUXINDUCTOR_GEMM_RS_OWN_EPILOGUE must be 0..3";
        return -1;
    }
  }
#endif
  return run_split_kind<OwnGemm>(params, stream, error_message);
}

}  // namespace fluxinductor::gemm_rs_split
