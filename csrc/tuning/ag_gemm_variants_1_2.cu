// AG+GEMM tuning variants 1 and 2 (bf16, K-contiguous weight): cooperative 256x128 cluster 1x2, ping-pong 128x128
// cluster 1x2 (Variant in csrc/ag_gemm/ag_gemm.h).  Built only with -DFLUXINDUCTOR_KERNEL_TUNING=ON: the shipped
// dispatcher picks variant 0 or 6, these only when the ag_variant tuning knob names them.
#include "ag_gemm/instances.h"
#include "fluxinductor/ag_gemm/run.cuh"

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
