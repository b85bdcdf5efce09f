// The AG+GEMM instantiations, one function per kernel, spread over translation units so they build in
// parallel (csrc/ag_gemm_bf16.cu, ag_gemm_fp16.cu, ag_gemm_bf16_variants.cu,
// ag_gemm_bf16_tuning.cu, ag_gemm_bf16_wide.cu).  Called by csrc/ag_gemm.cu.
#pragma once

#include <cuda_runtime.h>

#include "ag_gemm.h"

namespace fluxinductor::ag_gemm {

Error run_bf16_k_contiguous(AllGatherGemmParams const& params, cudaStream_t stream);      // variant 0
Error run_bf16_n_contiguous(AllGatherGemmParams const& params, cudaStream_t stream);
Error run_fp16_k_contiguous(AllGatherGemmParams const& params, cudaStream_t stream);
Error run_fp16_n_contiguous(AllGatherGemmParams const& params, cudaStream_t stream);
Error run_bf16_k_contiguous_coop256x128(AllGatherGemmParams const& params, cudaStream_t stream);  // variant 1
Error run_bf16_k_contiguous_pingpong(AllGatherGemmParams const& params, cudaStream_t stream);     // variant 2
// Tuning builds only (csrc/ag_gemm_bf16_tuning.cu); otherwise they return an error.
Error run_bf16_k_contiguous_coop256x128_c2x1(AllGatherGemmParams const& params, cudaStream_t stream);  // 3
Error run_bf16_k_contiguous_coop128x256_c1x2(AllGatherGemmParams const& params, cudaStream_t stream);  // 4
Error run_bf16_k_contiguous_pingpong128x192_c2x1(AllGatherGemmParams const& params, cudaStream_t stream);  // 5
// csrc/ag_gemm_bf16_wide.cu: 6 in every build, 7 in tuning builds only.
Error run_bf16_k_contiguous_coop256x160_c1x2(AllGatherGemmParams const& params, cudaStream_t stream);  // 6
Error run_bf16_k_contiguous_coop256x160_c2x1(AllGatherGemmParams const& params, cudaStream_t stream);  // 7

}  // namespace fluxinductor::ag_gemm
