// AG+GEMM variant 6 (bf16, K-contiguous weight): cooperative 256x160 tiles, cluster 1x2.
// A 4096 x 14336 per-rank output (4096x8192x28672 at TP=2) is 1792 tiles of 128x256, 13.6 waves on 132 SMs whose
// last wave runs 58% full (too full for the tail split); in 1440 tiles of 256x160 it is 10.9 waves, 1.25 times the
// work each (cuBLAS picks 320x128 there).  fluxinductor/kernels/ag_gemm.py picks variant 6 per shape where that
// model says it ends sooner.  Variant 7 (the same tiles, cluster 2x1) is a tuning variant
// (csrc/tuning/ag_gemm_variant_7.cu).
//
// CuTe offers wgmma atoms whose N is not a multiple of 64 (64x160x16) only with this macro; without it the builder
// tiles 160 columns with five 64x32x16 atoms, and the kernel ran at 1.4-1.7x cuBLAS (measured).  The macro changes
// which atom a tile shape selects, so it is set in this translation unit alone, whose tiles are all 160 wide.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include "ag_gemm/instances.h"
#include "fluxinductor/ag_gemm/run.cuh"

namespace fluxinductor::ag_gemm {

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)

Error run_bf16_k_contiguous_coop256x160_c1x2(AllGatherGemmParams const& p, cudaStream_t s) {
  return run_config<
      AllGatherGemmConfig<cutlass::bfloat16_t, cutlass::layout::ColumnMajor, Cooperative256x160Cluster1x2>>(p, s);
}

#endif

}  // namespace fluxinductor::ag_gemm
