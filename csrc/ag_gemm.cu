// AG+GEMM launchers: CUTLASS sm90a instantiations (bf16, fp16) x (B K-contiguous, B N-contiguous),
// the parameter checks, and the two stream operations the host side of the all-gather needs.
#include "ag_gemm.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstring>
#include <mutex>
#include <string>
#include <sstream>

#include "cutlass/cutlass.h"
#include "fluxinductor/ag_gemm_kernel.cuh"

namespace fluxinductor::ag_gemm {
namespace {

Error make_error(std::string const& message) {
  Error error;
  size_t const n = message.size() < sizeof(error.message) - 1 ? message.size() : sizeof(error.message) - 1;
  std::memcpy(error.message, message.data(), n);
  error.message[n] = 0;
  return error;
}

Error cuda_error(const char* what, cudaError_t status) {
  return make_error(std::string(what) + ": " + cudaGetErrorString(status));
}

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)

template <class Config>
Error run_config(AllGatherGemmParams const& p, cudaStream_t stream) {
  using Gemm = typename Config::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  using Element = typename Config::ElementA;

  int const m = int(p.m), n = int(p.n), k = int(p.k);
  // CUTLASS 3 strides are (outer, inner, batch) with the contiguous mode a static 1: set the leading one.
  StrideA stride_a{};
  cute::get<0>(stride_a) = p.lda;                 // A (m, k) at m * lda + k
  StrideB stride_b{};
  if constexpr (cutlass::gemm::detail::is_k_major<StrideB>()) {
    cute::get<0>(stride_b) = p.ldb;               // B (n, k) at n * ldb + k
  } else {
    cute::get<1>(stride_b) = p.ldb;               // B (n, k) at k * ldb + n
  }
  StrideD stride_d{};
  cute::get<0>(stride_d) = p.ldo;                 // out (m, n) at m * ldo + n

  AllGatherSchedule schedule;
  schedule.flags = p.flags;
  schedule.epoch = p.epoch;
  schedule.rank = p.rank;
  schedule.world = p.world;
  schedule.total_rows = m;
  schedule.shard_rows = p.flags ? int(p.shard_rows) : (m > 0 ? m : 1);
  schedule.chunks_per_rank = p.flags ? p.chunks_per_rank : 1;
  schedule.chunk_rows = int((schedule.shard_rows + schedule.chunks_per_rank - 1) / schedule.chunks_per_rank);
  int const cluster_rows_tile = Config::kTileM * Config::kClusterM;
  schedule.first_cluster_row = p.flags ? int((int64_t(p.rank) * p.shard_rows) / cluster_rows_tile) : 0;
  schedule.group_cluster_rows = p.group_cluster_rows > 0 ? p.group_cluster_rows : 8;
  schedule.timeout_ns = p.timeout_ns;
  schedule.error_word = p.error_word;

  cutlass::KernelHardwareInfo hw_info;
  cudaGetDevice(&hw_info.device_id);
  hw_info.sm_count = p.sm_count > 0 ? p.sm_count : device_sm_count();

  typename Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<Element const*>(p.a), stride_a, static_cast<Element const*>(p.b), stride_b},
      {{}, nullptr, stride_d, static_cast<Element*>(p.out), stride_d},
      hw_info};
  arguments.epilogue.thread.alpha = 1.0f;
  arguments.epilogue.thread.beta = 0.0f;
  arguments.epilogue.thread.bias_ptr = static_cast<Element const*>(p.bias);
  arguments.scheduler.schedule = schedule;

  Gemm gemm;
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) {
    return make_error("CUTLASS cannot implement this problem (alignment or size)");
  }
  if (Gemm::get_workspace_size(arguments) != 0) {
    return make_error("unexpected CUTLASS workspace requirement");
  }
  cutlass::Status status = gemm.initialize(arguments, nullptr, stream);
  if (status != cutlass::Status::kSuccess) {
    return make_error(std::string("CUTLASS initialize failed: ") + cutlassGetStatusString(status));
  }
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    return make_error(std::string("CUTLASS launch failed: ") + cutlassGetStatusString(status) + " (" +
                      cudaGetErrorString(cudaGetLastError()) + ")");
  }
  return {};
}

using ConfigBf16KMajor = AllGatherGemmConfig<cutlass::bfloat16_t, cutlass::layout::ColumnMajor>;  // B = W^T view
using ConfigBf16KMajorCoop256x128 =                                                                // variant 1
    AllGatherGemmConfig<cutlass::bfloat16_t, cutlass::layout::ColumnMajor, Cooperative256x128Cluster1x2>;
using ConfigBf16KMajorPingpong =                                                                   // variant 2
    AllGatherGemmConfig<cutlass::bfloat16_t, cutlass::layout::ColumnMajor, Pingpong128x128Cluster1x2>;
using ConfigBf16NMajor = AllGatherGemmConfig<cutlass::bfloat16_t, cutlass::layout::RowMajor>;     // B row-major
using ConfigFp16KMajor = AllGatherGemmConfig<cutlass::half_t, cutlass::layout::ColumnMajor>;
using ConfigFp16NMajor = AllGatherGemmConfig<cutlass::half_t, cutlass::layout::RowMajor>;

#endif  // CUTLASS_ARCH_MMA_SM90_SUPPORTED

bool aligned16(const void* pointer) { return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0; }

}  // namespace

int device_sm_count() {
  static std::mutex mutex;
  static int cached[64] = {0};
  int device = 0;
  cudaGetDevice(&device);
  std::lock_guard<std::mutex> lock(mutex);
  if (device < 64 && cached[device] == 0) {
    cudaDeviceGetAttribute(&cached[device], cudaDevAttrMultiProcessorCount, device);
  }
  return device < 64 ? cached[device] : 0;
}

Error all_gather_gemm_unsupported(AllGatherGemmParams const& p) {
  // 16-byte TMA rows and base addresses: 8 elements of a 2-byte type.
  constexpr int64_t kAlign = 8;
  std::ostringstream why;
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) {
    why << "empty problem (M=" << p.m << ", N=" << p.n << ", K=" << p.k << ")";
  } else if (p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX) {
    why << "a dimension exceeds 2^31";
  } else if (p.k % kAlign || p.lda % kAlign || p.lda < p.k) {
    why << "K=" << p.k << " / row stride of A " << p.lda << " is not a multiple of 8 (TMA needs 16-byte rows)";
  } else if (p.ldb % kAlign || (p.b_k_contiguous ? p.ldb < p.k : p.ldb < p.n)) {
    why << "the weight's leading stride " << p.ldb << " is not a multiple of 8 or too small";
  } else if (p.n % kAlign || p.ldo % kAlign || p.ldo < p.n) {
    why << "N=" << p.n << " is not a multiple of 8 (TMA needs 16-byte rows)";
  } else if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.out) || (p.bias && !aligned16(p.bias))) {
    why << "a base address is not 16-byte aligned";
  } else if (p.flags && (p.world < 1 || p.rank < 0 || p.rank >= p.world || p.shard_rows < 1 ||
                         p.shard_rows * p.world != p.m || p.chunks_per_rank < 1)) {
    why << "inconsistent all-gather layout (rank " << p.rank << " of " << p.world << ", " << p.shard_rows
        << " rows per rank, M=" << p.m << ")";
  }
  return make_error(why.str());
}

Error all_gather_gemm(AllGatherGemmParams const& p, void* stream_handle) {
  Error why = all_gather_gemm_unsupported(p);
  if (why.failed()) {
    return why;
  }
#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  switch (p.dtype) {
    case DType::kBFloat16:
      if (!p.b_k_contiguous) {
        return run_config<ConfigBf16NMajor>(p, stream);
      }
      switch (p.variant) {
        case Variant::kCooperative256x128Cluster1x2:
          return run_config<ConfigBf16KMajorCoop256x128>(p, stream);
        case Variant::kPingpong128x128Cluster1x2:
          return run_config<ConfigBf16KMajorPingpong>(p, stream);
        default:
          return run_config<ConfigBf16KMajor>(p, stream);
      }
    case DType::kFloat16:
      return p.b_k_contiguous ? run_config<ConfigFp16KMajor>(p, stream) : run_config<ConfigFp16NMajor>(p, stream);
  }
  return make_error("unsupported dtype");
#else
  (void)stream_handle;
  return make_error("the extension was built without sm90a support");
#endif
}

Error stream_write_value32(void* address, uint32_t value, void* stream) {
  static PFN_cuStreamWriteValue32_v11070 write_value32 = nullptr;
  static std::once_flag once;
  static cudaError_t lookup_status = cudaSuccess;
  std::call_once(once, [] {
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    lookup_status = cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", reinterpret_cast<void**>(&write_value32),
                                                     12000, cudaEnableDefault, &found);
    if (found != cudaDriverEntryPointSuccess) {
      write_value32 = nullptr;
    }
  });
  if (write_value32 == nullptr) {
    return cuda_error("cuStreamWriteValue32 not available", lookup_status);
  }
  CUresult result = write_value32(static_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address), value,
                                  CU_STREAM_WRITE_VALUE_DEFAULT);
  if (result != CUDA_SUCCESS) {
    return make_error("cuStreamWriteValue32 failed with CUresult " + std::to_string(int(result)));
  }
  return {};
}

Error memcpy_async(void* dst, const void* src, int64_t bytes, void* stream) {
  cudaError_t status =
      cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
  return status == cudaSuccess ? Error() : cuda_error("cudaMemcpyAsync", status);
}

Error alloc_host_mapped_word(int64_t* host_address, int64_t* device_address) {
  void* host = nullptr;
  cudaError_t status = cudaHostAlloc(&host, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable);
  if (status != cudaSuccess) {
    return cuda_error("cudaHostAlloc", status);
  }
  *static_cast<volatile int*>(host) = 0;
  void* device = nullptr;
  status = cudaHostGetDevicePointer(&device, host, 0);
  if (status != cudaSuccess) {
    return cuda_error("cudaHostGetDevicePointer", status);
  }
  *host_address = reinterpret_cast<int64_t>(host);
  *device_address = reinterpret_cast<int64_t>(device);
  return {};
}

}  // namespace fluxinductor::ag_gemm
