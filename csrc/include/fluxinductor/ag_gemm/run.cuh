// The body shared by every AG+GEMM instantiation (csrc/ag_gemm/instances_*.cu, csrc/tuning/ag_gemm_variant*.cu):
// fill CUTLASS arguments from the plain params struct and launch.  Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "ag_gemm/ag_gemm.h"
#include "cutlass/cutlass.h"
#include "fluxinductor/ag_gemm/kernel.cuh"
#include "fluxinductor/common/cutlass_launch.cuh"

namespace fluxinductor::ag_gemm {

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
  schedule.batch_rows = p.flags ? int(p.batch_rows) : 0;
  schedule.first_cluster_row = p.flags ? int((int64_t(p.rank) * p.shard_rows) / cluster_rows_tile) : 0;
  schedule.group_cluster_rows = p.group_cluster_rows > 0 ? p.group_cluster_rows : 8;
  schedule.timeout_ns = p.timeout_ns;
  schedule.error_word = p.error_word;
  schedule.trap_on_timeout = p.trap_on_timeout;
  if (p.flags && p.k_chunks > 1) {  // whole shards in column blocks of K tiles
    int constexpr kTileK = cute::size<2>(typename Config::TileShape{});
    int const k_tiles = (k + kTileK - 1) / kTileK;
    schedule.k_chunks = p.k_chunks;
    schedule.k_chunk_tiles = (k_tiles + p.k_chunks - 1) / p.k_chunks;
  }

  if (p.a_local != nullptr && p.shard_rows % Config::kTileM != 0) {
    return make_error("the local rows' A needs rows per rank (" + std::to_string(p.shard_rows) +
                      ") that are a multiple of the tile's M (" + std::to_string(Config::kTileM) + ")");
  }

  if (p.a_out != nullptr && cute::size<1>(typename Config::ClusterShape{}) != 1) {
    return make_error("this kernel variant multicasts A, so it cannot write the A it loads (a_out)");
  }

  if (schedule.batch_rows > 0 && !maps_batch_major<typename Config::TileShape>()) {
    return make_error("this kernel variant's tiles take no batch-major A (variant 6: use 0)");
  }
  if (schedule.batch_rows > 0 && schedule.batch_rows % Config::kTileM != 0) {
    return make_error("a batch-major A needs rows per block (" + std::to_string(p.batch_rows) +
                      ") that are a multiple of the tile's M (" + std::to_string(Config::kTileM) + ")");
  }

  if constexpr (supports_tail_split<Config>()) {
    set_tail_split(schedule, p.split_partials, p.split_flags, p.split_epoch, p.split_max_parts, p.split_waves);
  }

  cutlass::KernelHardwareInfo hw_info;
  cudaGetDevice(&hw_info.device_id);
  hw_info.sm_count = p.sm_count > 0 ? p.sm_count : device_sm_count();

  typename Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {{static_cast<Element const*>(p.a), stride_a, static_cast<Element const*>(p.b), stride_b}, schedule,
       p.a_local, p.lda_local, p.a_out, p.ld_a_out, p.a_out_local_only},
      {{}, nullptr, stride_d, static_cast<Element*>(p.out), stride_d},
      hw_info};
  arguments.epilogue.thread.alpha = 1.0f;
  arguments.epilogue.thread.beta = 0.0f;
  arguments.epilogue.thread.bias_ptr = static_cast<Element const*>(p.bias);
  arguments.scheduler.schedule = schedule;

  if (Gemm::can_implement(arguments) != cutlass::Status::kSuccess) {
    return make_error("CUTLASS cannot implement this problem (alignment or size)");
  }
  if (Gemm::get_workspace_size(arguments) != 0) {
    return make_error("unexpected CUTLASS workspace requirement");
  }
  cudaError_t const launched = launch_gemm_kernel<Gemm>(arguments, hw_info.device_id, stream, p.pdl);
  if (launched != cudaSuccess) {
    return make_error(std::string("CUTLASS launch failed: ") + cudaGetErrorString(launched));
  }
  return {};
}

#endif  // CUTLASS_ARCH_MMA_SM90_SUPPORTED

}  // namespace fluxinductor::ag_gemm
