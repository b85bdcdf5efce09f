// AG+GEMM kernels, bfloat16: weight K-contiguous (the transposed nn.Linear view) and N-contiguous.
#include "ag_gemm/instances.h"
#include "fluxinductor/ag_gemm/run.cuh"

namespace fluxinductor::ag_gemm {

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)

using ConfigBf16KContiguous = AllGatherGemmConfig<cutlass::bfloat16_t, cutlass::layout::ColumnMajor>;  // B = W^T view
using ConfigBf16NContiguous = AllGatherGemmConfig<cutlass::bfloat16_t, cutlass::layout::RowMajor>;     // B row-major

Error run_bf16_k_contiguous(AllGatherGemmParams const& p, cudaStream_t s) { return run_config<ConfigBf16KContiguous>(p, s); }
Error run_bf16_n_contiguous(AllGatherGemmParams const& p, cudaStream_t s) { return run_config<ConfigBf16NContiguous>(p, s); }

#endif  // CUTLASS_ARCH_MMA_SM90_SUPPORTED

}  // namespace fluxinductor::ag_gemm
