// AG+GEMM tuning variants 3, 4 and 5 (bf16, K-contiguous weight).  Built only with
// CUDAFLAGS=-DFLUXINDUCTOR_KERNEL_TUNING, so CI and releases do not pay for them; elsewhere they report an error.
// benchmarks/sweep_kernels.py measures them against cuBLAS (results in csrc/NOTES_ag_gemm.md).
#include "ag_gemm_instances.h"
#include "fluxinductor/ag_gemm_run.cuh"

namespace fluxinductor::ag_gemm {

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED) && defined(FLUXINDUCTOR_KERNEL_TUNING)

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

#else

Error run_bf16_k_contiguous_coop256x128_c2x1(AllGatherGemmParams const&, cudaStream_t) {
  return make_error("AG+GEMM variant 3 exists only in tuning builds (CUDAFLAGS=-DFLUXINDUCTOR_KERNEL_TUNING)");
}
Error run_bf16_k_contiguous_coop128x256_c1x2(AllGatherGemmParams const&, cudaStream_t) {
  return make_error("AG+GEMM variant 4 exists only in tuning builds (CUDAFLAGS=-DFLUXINDUCTOR_KERNEL_TUNING)");
}
Error run_bf16_k_contiguous_pingpong128x192_c2x1(AllGatherGemmParams const&, cudaStream_t) {
  return make_error("AG+GEMM variant 5 exists only in tuning builds (CUDAFLAGS=-DFLUXINDUCTOR_KERNEL_TUNING)");
}

#endif

}  // namespace fluxinductor::ag_gemm
