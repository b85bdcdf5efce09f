// Stock CUTLASS sm90 GEMMs, for measurement only (benchmarks/sweep_kernels.py --stock): the AG+GEMM kernel's tiles run
// by CUTLASS's own tile schedulers, with no fluxinductor code in the kernel.  Against them, a sweep tells what our
// scheduler and mainloop wrapper cost apart from CUTLASS's own distance to cuBLAS.  Built only with
// -DFLUXINDUCTOR_KERNEL_TUNING=ON, like the other tuning variants; elsewhere the launcher reports an error.
#include "tuning/probe_stock_gemm.h"

#include <cstdio>

#if defined(FLUXINDUCTOR_KERNEL_TUNING)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#endif

namespace fluxinductor::probe {

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED) && defined(FLUXINDUCTOR_KERNEL_TUNING)

namespace {

template <class TileShape, class ClusterShape, class Scheduler>
struct StockGemm {
  using Element = cutlass::bfloat16_t;
  // The AG+GEMM kernel's epilogue (out = acc + per-column bias; no bias pointer here) and schedules.
  using Fusion = cutlass::epilogue::fusion::LinCombPerColBias<Element, float, Element, Element, float>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::RowMajor, 8, cutlass::epilogue::TmaWarpSpecializedCooperative, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(const void* a, int m, int k, int64_t lda, const void* b, int n,
                                            int64_t ldb, void* out, int64_t ldo, int sm_count) {
    typename Kernel::StrideA stride_a{};
    cute::get<0>(stride_a) = lda;
    typename Kernel::StrideB stride_b{};
    cute::get<0>(stride_b) = ldb;
    typename Kernel::StrideD stride_d{};
    cute::get<0>(stride_d) = ldo;
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {m, n, k, 1};
    args.mainloop = {static_cast<Element const*>(a), stride_a, static_cast<Element const*>(b), stride_b};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.thread.bias_ptr = nullptr;
    args.epilogue.ptr_D = static_cast<Element*>(out);
    args.epilogue.dD = stride_d;
    cudaGetDevice(&args.hw_info.device_id);
    if (sm_count <= 0) {
      cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, args.hw_info.device_id);
    }
    args.hw_info.sm_count = sm_count;
    return args;
  }

  static int64_t workspace(int m, int n, int k, int sm_count) {
    return int64_t(Gemm::get_workspace_size(arguments(nullptr, m, k, k, nullptr, n, k, nullptr, n, sm_count)));
  }

  static int run(const void* a, int m, int k, int64_t lda, const void* b, int n, int64_t ldb, void* out, int64_t ldo,
                 void* workspace, int sm_count, cudaStream_t stream, char* error, int error_size) {
    auto args = arguments(a, m, k, lda, b, n, ldb, out, ldo, sm_count);
    Gemm gemm;
    cutlass::Status status = gemm.can_implement(args);
    if (status == cutlass::Status::kSuccess) {
      status = gemm.initialize(args, workspace, stream);
    }
    if (status == cutlass::Status::kSuccess) {
      status = gemm.run(stream);
    }
    if (status != cutlass::Status::kSuccess) {
      std::snprintf(error, size_t(error_size), "stock CUTLASS GEMM failed: %s (%s)", cutlassGetStatusString(status),
                    cudaGetErrorString(cudaGetLastError()));
      return -1;
    }
    return 0;
  }
};

using Tile128x256 = cute::Shape<cute::_128, cute::_256, cute::_64>;
using Tile256x128 = cute::Shape<cute::_256, cute::_128, cute::_64>;
using Cluster2x1 = cute::Shape<cute::_2, cute::_1, cute::_1>;
using Cluster1x2 = cute::Shape<cute::_1, cute::_2, cute::_1>;
using Stock0 = StockGemm<Tile128x256, Cluster2x1, cutlass::gemm::PersistentScheduler>;
using Stock1 = StockGemm<Tile128x256, Cluster2x1, cutlass::gemm::StreamKScheduler>;
using Stock2 = StockGemm<Tile256x128, Cluster1x2, cutlass::gemm::PersistentScheduler>;

}  // namespace

int64_t stock_gemm_workspace(int config, int m, int n, int k, int sm_count) {
  switch (config) {
    case 0: return Stock0::workspace(m, n, k, sm_count);
    case 1: return Stock1::workspace(m, n, k, sm_count);
    case 2: return Stock2::workspace(m, n, k, sm_count);
    default: return -1;
  }
}

int stock_gemm_run(int config, const void* a, int m, int k, int64_t lda, const void* b, int n, int64_t ldb, void* out,
                   int64_t ldo, void* workspace, int sm_count, void* stream, char* error, int error_size) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (config) {
    case 0: return Stock0::run(a, m, k, lda, b, n, ldb, out, ldo, workspace, sm_count, s, error, error_size);
    case 1: return Stock1::run(a, m, k, lda, b, n, ldb, out, ldo, workspace, sm_count, s, error, error_size);
    case 2: return Stock2::run(a, m, k, lda, b, n, ldb, out, ldo, workspace, sm_count, s, error, error_size);
    default:
      std::snprintf(error, size_t(error_size), "no stock GEMM configuration %d", config);
      return -1;
  }
}

#else

int64_t stock_gemm_workspace(int, int, int, int, int) { return -1; }

int stock_gemm_run(int, const void*, int, int, int64_t, const void*, int, int64_t, void*, int64_t, void*, int, void*,
                   char* error, int error_size) {
  std::snprintf(error, size_t(error_size),
                "the stock CUTLASS GEMMs exist only in tuning builds (-DFLUXINDUCTOR_KERNEL_TUNING=ON)");
  return -1;
}

#endif

}  // namespace fluxinductor::probe
