// AG+GEMM tuning variants 3, 4 and 5 (bf16, K-contiguous weight): cooperative 256x128 cluster 2x1, cooperative
// 128x256 cluster 1x2, ping-pong 128x192 cluster 2x1.  Built only with -DFLUXINDUCTOR_KERNEL_TUNING=ON, so CI and
// releases do not pay for them; benchmarks/sweep_kernels.py measures them against cuBLAS.
#include "ag_gemm/instances.h"
#include "fluxinductor/ag_gemm/run.cuh"

namespace fluxinductor::ag_gemm {

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)

Error run_bf16_k_contiguous_coop256x128_c2x1(AllGatherGemmParams const& p, cudaStream_t s) {
  return run_config<
      AllGatherGemmConfig<cutlass::bfloat16_t, cutlass::layout::ColumnMajor, Cooperative256x128Cluster2x1>>(p, s);
}
Error run_bf16_k_contiguous_coop128x256_c1x2(AllGatherGemmParams const& p, cudaStream_t s) {
  return run_config<
      AllGatherGemmConfig<cutlass::bfloat16_t, cutlass::layout::ColumnMajor, Cooperative128x256Cluster1x2>>(p, s);
}
Error run_bf16_k_contiguous_pingpong128x192_c2x1(AllGatherGemmParams const& p, cudaStream_t s) {
  return run_config<
      AllGatherGemmConfig<cutlass::bfloat16_t, cutlass::layout::ColumnMajor, Pingpong128x192Cluster2x1>>(p, s);
}

#endif  // CUTLASS_ARCH_MMA_SM90_SUPPORTED

}  // namespace fluxinductor::ag_gemm
