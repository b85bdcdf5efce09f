// GEMM+RS launchers: CUTLASS sm90a instantiations (bf16, fp16) x (B K-major, B N-major), the argument
// checks, and the per-call handshake launch.  Torch-free; see gemm_rs.h for the contract.
#include "gemm_rs.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "fluxinductor/gemm_rs_kernel.cuh"

namespace fluxinductor {
namespace {

thread_local std::string g_last_error;

int fail(std::string message) {
  g_last_error = std::move(message);
  return -1;
}

constexpr int kTileM = 128;
constexpr int kTileN = 256;
constexpr int kWarpsPerTile = 8;  // two consumer warp groups of the cooperative kernel

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)

template <class Element, class LayoutB>
struct GemmRsConfig {
  using ElementA = Element;                                   // A: this rank's K slice, row-major
  using LayoutA = cutlass::layout::RowMajor;
  using ElementB = Element;                                   // B: K-major (ColumnMajor) or N-major (RowMajor)
  using ElementAccumulator = float;
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;  // one tile = one flag set
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;    // B tile multicast over 2 M-tiles
  using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = GemmRsEpilogue<Element, kWarpsPerTile>;      // register-to-global, peer-aware
  using CollectiveEpilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Epilogue>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementA, LayoutA, 8,                                     // 16-byte TMA alignment
      ElementB, LayoutB, 8,
      ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>,                          // (M/world, N, K, world segments)
      CollectiveMainloop, CollectiveEpilogue,
      RotatedPersistentScheduler>;                              // peers' segments first, own last
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  static_assert(cute::size(typename CollectiveMainloop::TiledMma{}) == kWarpsPerTile * 32);
};

int device_sm_count() {
  static int count = [] {
    int device = 0;
    cudaGetDevice(&device);
    return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }();
  return count;
}

template <class Config>
int run_config(GemmRsArgs const& args, cudaStream_t stream) {
  using Gemm = typename Config::Gemm;
  using Element = typename Config::ElementA;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;

  int const segment_rows = args.m / args.world;
  StrideA stride_a{};
  cute::get<0>(stride_a) = args.lda;                          // A (m, k, l) at l*segment + m*lda + k
  cute::get<2>(stride_a) = int64_t(segment_rows) * args.lda;
  StrideB stride_b{};                                         // batch stride 0: every segment shares B
  if constexpr (cutlass::gemm::detail::is_k_major<StrideB>()) {
    cute::get<0>(stride_b) = args.ldb;                        // B (n, k) at n*ldb + k
  } else {
    cute::get<1>(stride_b) = args.ldb;                        // B (n, k) at k*ldb + n
  }
  cute::get<2>(stride_b) = 0;

  GemmRsEpilogueArguments<Element> epi;
  for (int r = 0; r < args.world; ++r) {
    epi.buffers[r] = static_cast<char*>(args.buffers[r]);
  }
  epi.flags_offset = args.flags_offset;
  epi.data_offset = args.data_offset;
  epi.world = args.world;
  epi.rank = args.rank;
  epi.tiles_m = (segment_rows + kTileM - 1) / kTileM;
  epi.tiles_n = (args.n + kTileN - 1) / kTileN;
  epi.epoch = args.epoch;
  epi.bias = static_cast<Element const*>(args.bias);
  epi.out = static_cast<Element*>(args.out);
  epi.ldo = args.ldo;
  epi.out_scale = args.out_scale;
  epi.error = args.error;
  epi.timeout_ns = args.timeout_ns;
  epi.local_status =
      args.world > 1 ? reinterpret_cast<uint32_t*>(static_cast<char*>(args.buffers[args.rank]) + kRsStatusOffset)
                     : nullptr;

  cutlass::KernelHardwareInfo hw_info;
  cudaGetDevice(&hw_info.device_id);
  hw_info.sm_count = args.sm_count > 0 ? args.sm_count : device_sm_count();

  typename Gemm::GemmKernel::TileSchedulerArguments scheduler;
  scheduler.rotate_l = args.world > 1 ? (args.rank + 1) % args.world : 0;

  typename Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {segment_rows, args.n, args.k, args.world},
      {static_cast<Element const*>(args.a), stride_a, static_cast<Element const*>(args.b), stride_b},
      {epi},
      hw_info,
      scheduler};

  Gemm gemm;
  cutlass::Status status = gemm.can_implement(arguments);
  if (status != cutlass::Status::kSuccess) {
    return fail(std::string("CUTLASS cannot implement this GEMM+RS problem: ") + cutlassGetStatusString(status));
  }
  if (Gemm::get_workspace_size(arguments) != 0) {
    return fail("GEMM+RS kernel unexpectedly needs a workspace");
  }

  if (args.world > 1) {
    RsHelloParams hello{};
    for (int r = 0; r < args.world; ++r) {
      hello.buffers[r] = static_cast<char*>(args.buffers[r]);
    }
    hello.world = args.world;
    hello.rank = args.rank;
    hello.epoch = args.epoch;
    hello.signature = args.signature;
    hello.error = args.error;
    hello.timeout_ns = args.timeout_ns;
    gemm_rs_hello_kernel<<<1, 32, 0, stream>>>(hello);
    cudaError_t launch = cudaGetLastError();
    if (launch != cudaSuccess) {
      return fail(std::string("GEMM+RS handshake launch failed: ") + cudaGetErrorString(launch));
    }
  }

  status = gemm.initialize(arguments, nullptr, stream);
  if (status != cutlass::Status::kSuccess) {
    return fail(std::string("CUTLASS initialize failed: ") + cutlassGetStatusString(status));
  }
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    cudaError_t launch = cudaGetLastError();
    return fail(std::string("GEMM+RS launch failed: ") + cutlassGetStatusString(status) + " / " +
                cudaGetErrorString(launch));
  }
  return 0;
}

#endif  // CUTLASS_ARCH_MMA_SM90_SUPPORTED

}  // namespace

int gemm_rs_tile_m() { return kTileM; }
int gemm_rs_tile_n() { return kTileN; }
int gemm_rs_warps_per_tile() { return kWarpsPerTile; }
const char* gemm_rs_last_error() { return g_last_error.c_str(); }

int gemm_rs_alloc_host_word(int64_t* host_address, int64_t* device_address) {
  void* host = nullptr;
  cudaError_t status = cudaHostAlloc(&host, sizeof(int32_t), cudaHostAllocMapped | cudaHostAllocPortable);
  if (status != cudaSuccess) {
    return fail(std::string("cudaHostAlloc failed: ") + cudaGetErrorString(status));
  }
  *static_cast<int32_t volatile*>(host) = 0;
  void* device = nullptr;
  status = cudaHostGetDevicePointer(&device, host, 0);
  if (status != cudaSuccess) {
    return fail(std::string("cudaHostGetDevicePointer failed: ") + cudaGetErrorString(status));
  }
  *host_address = reinterpret_cast<int64_t>(host);
  *device_address = reinterpret_cast<int64_t>(device);
  return 0;
}

int gemm_rs_run(GemmRsArgs const& args, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (args.world < 1 || args.world > kGemmRsMaxWorld || args.rank < 0 || args.rank >= args.world) {
    return fail("world must be in [1, 8] and 0 <= rank < world");
  }
  if (args.m <= 0 || args.n <= 0 || args.k <= 0 || args.m % args.world != 0) {
    return fail("M, N, K must be positive and M a multiple of world");
  }
  if (args.k % 8 != 0 || args.lda % 8 != 0 || args.ldb % 8 != 0) {
    return fail("K and the operand row strides must be multiples of 8 elements (16-byte TMA alignment)");
  }
  if ((reinterpret_cast<uintptr_t>(args.a) | reinterpret_cast<uintptr_t>(args.b)) % 16 != 0) {
    return fail("A and B must be 16-byte aligned");
  }
  if (args.world > 1) {
    for (int r = 0; r < args.world; ++r) {
      if (args.buffers[r] == nullptr) {
        return fail("every rank's buffer pointer is needed");
      }
    }
    if (args.epoch == 0) {
      return fail("epoch must be >= 1");
    }
  }
#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
  if (args.dtype == 0) {
    return args.b_k_major ? run_config<GemmRsConfig<cutlass::bfloat16_t, cutlass::layout::ColumnMajor>>(args, stream)
                          : run_config<GemmRsConfig<cutlass::bfloat16_t, cutlass::layout::RowMajor>>(args, stream);
  }
  if (args.dtype == 1) {
    return args.b_k_major ? run_config<GemmRsConfig<cutlass::half_t, cutlass::layout::ColumnMajor>>(args, stream)
                          : run_config<GemmRsConfig<cutlass::half_t, cutlass::layout::RowMajor>>(args, stream);
  }
  return fail("dtype must be 0 (bf16) or 1 (fp16)");
#else
  return fail("fluxinductor was built without sm90a support (CUTLASS_ARCH_MMA_SM90_SUPPORTED)");
#endif
}

}  // namespace fluxinductor
