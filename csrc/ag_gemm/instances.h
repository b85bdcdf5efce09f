// The AG+GEMM instantiations, one function per kernel, spread over translation units so they build in
// parallel: csrc/ag_gemm/instances_{bf16,fp16,bf16_256x160}.cu in every build, csrc/tuning/ag_gemm_variant*.cu in
// tuning builds (-DFLUXINDUCTOR_KERNEL_TUNING=ON).  Called by csrc/ag_gemm/ag_gemm.cu.
#pragma once

#include <cuda_runtime.h>

#include "ag_gemm/ag_gemm.h"

namespace fluxinductor::ag_gemm {

// Every build: what the dispatcher picks (fluxinductor/kernels/ag_gemm.py kernel_variant).
Error run_bf16_k_contiguous(AllGatherGemmParams const& params, cudaStream_t stream);      // variant 0
Error run_bf16_n_contiguous(AllGatherGemmParams const& params, cudaStream_t stream);
Error run_fp16_k_contiguous(AllGatherGemmParams const& params, cudaStream_t stream);
Error run_fp16_n_contiguous(AllGatherGemmParams const& params, cudaStream_t stream);
Error run_bf16_k_contiguous_coop256x160_c1x2(AllGatherGemmParams const& params, cudaStream_t stream);  // 6
// Tuning builds only (csrc/tuning/); ag_gemm.cu reports the others' variants as absent elsewhere.
Error run_bf16_k_contiguous_coop256x128(AllGatherGemmParams const& params, cudaStream_t stream);       // 1
Error run_bf16_k_contiguous_pingpong(AllGatherGemmParams const& params, cudaStream_t stream);          // 2
Error run_bf16_k_contiguous_coop256x128_c2x1(AllGatherGemmParams const& params, cudaStream_t stream);  // 3
Error run_bf16_k_contiguous_coop128x256_c1x2(AllGatherGemmParams const& params, cudaStream_t stream);  // 4
Error run_bf16_k_contiguous_pingpong128x192_c2x1(AllGatherGemmParams const& params, cudaStream_t stream);  // 5
Error run_bf16_k_contiguous_coop256x160_c2x1(AllGatherGemmParams const& params, cudaStream_t stream);  // 7

}  // namespace fluxinductor::ag_gemm
