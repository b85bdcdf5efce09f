// AG+GEMM kernels, float16: weight K-contiguous and N-contiguous.
#include "ag_gemm/instances.h"
#include "fluxinductor/ag_gemm/run.cuh"

namespace fluxinductor::ag_gemm {

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)

using ConfigFp16KContiguous = AllGatherGemmConfig<cutlass::half_t, cutlass::layout::ColumnMajor>;
using ConfigFp16NContiguous = AllGatherGemmConfig<cutlass::half_t, cutlass::layout::RowMajor>;

Error run_fp16_k_contiguous(AllGatherGemmParams const& p, cudaStream_t s) { return run_config<ConfigFp16KContiguous>(p, s); }
Error run_fp16_n_contiguous(AllGatherGemmParams const& p, cudaStream_t s) { return run_config<ConfigFp16NContiguous>(p, s); }

#endif  // CUTLASS_ARCH_MMA_SM90_SUPPORTED

}  // namespace fluxinductor::ag_gemm
