// AG+GEMM tuning variants, bfloat16 with a K-contiguous weight (see Variant in ag_gemm.h).
#include "ag_gemm_instances.h"
#include "fluxinductor/ag_gemm_run.cuh"

namespace fluxinductor::ag_gemm {

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)

using ConfigBf16Coop256x128 =                                                // variant 1
    AllGatherGemmConfig<cutlass::bfloat16_t, cutlass::layout::ColumnMajor, Cooperative256x128Cluster1x2>;
using ConfigBf16Pingpong =                                                   // variant 2
    AllGatherGemmConfig<cutlass::bfloat16_t, cutlass::layout::ColumnMajor, Pingpong128x128Cluster1x2>;

Error run_bf16_k_contiguous_coop256x128(AllGatherGemmParams const& p, cudaStream_t s) {
  return run_config<ConfigBf16Coop256x128>(p, s);
}
Error run_bf16_k_contiguous_pingpong(AllGatherGemmParams const& p, cudaStream_t s) {
  return run_config<ConfigBf16Pingpong>(p, s);
}

#endif  // CUTLASS_ARCH_MMA_SM90_SUPPORTED

}  // namespace fluxinductor::ag_gemm
