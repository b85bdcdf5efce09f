// AG+GEMM tuning variant 7 (bf16, K-contiguous weight): cooperative 256x160 tiles, cluster 2x1, the 2x1-cluster
// counterpart of variant 6 (csrc/ag_gemm/instances_bf16_256x160.cu, whose comment says why 256x160 tiles).  Built
// only with -DFLUXINDUCTOR_KERNEL_TUNING=ON; the shipped dispatcher never picks it.
//
// The 160-wide tiles need CuTe's extended wgmma shapes (64x160x16), enabled for this translation unit alone, whose
// tiles are all 160 wide (see csrc/ag_gemm/instances_bf16_256x160.cu).
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include "ag_gemm/instances.h"
#include "fluxinductor/ag_gemm/run.cuh"

namespace fluxinductor::ag_gemm {

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)

Error run_bf16_k_contiguous_coop256x160_c2x1(AllGatherGemmParams const& p, cudaStream_t s) {
  return run_config<
      AllGatherGemmConfig<cutlass::bfloat16_t, cutlass::layout::ColumnMajor, Cooperative256x160Cluster2x1>>(p, s);
}

#endif

}  // namespace fluxinductor::ag_gemm
