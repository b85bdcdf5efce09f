// A persistent tile scheduler for all-gather + GEMM on sm90 (torch-free).
//
// The GEMM reads A: [M, K] from this rank's gathered buffer while the copy engine is still filling it.
// A = rank 0's shard, rank 1's shard, ... (shard_rows rows each); each shard arrives in chunks_per_rank
// chunks, and the arrival of chunk c of rank q sets flags[q * chunks_per_rank + c] to the call's epoch.
//
// Tile order: the scheduler walks the M blocks starting at this rank's own shard (ready when the kernel
// starts), then the next rank's, and so on: the order in which the pulls land.  Inside a group of
// `group_cluster_rows` cluster rows the M index runs fastest (tiles of one wave share B columns and A
// rows, as a swizzle would), groups run one after another.  Before handing out a tile, the producer
// warp group waits until every chunk its rows touch has arrived (ld.acquire + fence.proxy.async so the
// TMA loads that follow see the copied bytes).  The wait gives up after timeout_ns of %globaltimer:
// it writes an error code to a host-visible word and stops waiting (the host raises).
//
// rank = -1 makes every chunk remote: the split GEMM+RS transport's own GEMM waits this way for the peer's bands.
#pragma once

#include <cstdint>

#include "cute/arch/cluster_sm90.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace fluxinductor::ag_gemm {

// Error codes written to AllGatherSchedule::error_word.
constexpr int kErrorNone = 0;
constexpr int kErrorFlagTimeout = 1;

// What the scheduler needs to order tiles and wait for the rows they read.  Plain data, filled on the host.
struct AllGatherSchedule {
  uint32_t const* flags = nullptr;  // [world * chunks_per_rank]; nullptr: no waiting (communication off)
  uint32_t epoch = 0;               // a chunk is ready when int32(flag - epoch) >= 0
  int rank = 0;                     // this rank: its rows are in place before the kernel starts
  int world = 1;
  int total_rows = 0;               // M = world * shard_rows
  int shard_rows = 1;               // rows per rank
  int chunk_rows = 1;               // rows per chunk (the last chunk of a shard may be shorter)
  int chunks_per_rank = 1;
  // Chunks may also split columns: flags[(owner * chunks_per_rank + chunk) * col_chunks + n_block / chunk_col_tiles]
  // (n_block in CTA tiles).  col_chunks = 1: whole rows, as the all-gather's chunks.
  int col_chunks = 1;
  int chunk_col_tiles = 1;
  int first_cluster_row = 0;        // the cluster row (M block / cluster M) the walk starts from
  int group_cluster_rows = 8;       // cluster rows per group (see above); >= 1
  long long timeout_ns = 5000000000LL;
  volatile int* error_word = nullptr;  // host-mapped; error_code on timeout
  int error_code = kErrorFlagTimeout;
  // Optional: stop waiting, without an error, once *abort_word == abort_value (the call was aborted elsewhere).
  uint32_t const* abort_word = nullptr;
  uint32_t abort_value = 0;
  // K chunks (k_chunks > 1, for problems of about one wave, where every tile starts at once): rank q's whole shard
  // arrives in k_chunks column blocks of k_chunk_tiles K tiles, block kc setting flags[q * k_chunks + kc]; the
  // producer waits before each block of a tile's K loop (KChunkWaitingMainloop) instead of the scheduler before
  // the tile, so a peer's tiles start on the first block while the rest streams in.
  int k_chunks = 1;
  int k_chunk_tiles = 1;
};

namespace detail {

CUTLASS_DEVICE uint32_t load_acquire_sys(uint32_t const* address) {
  uint32_t value;
  // System scope: the flag may be written by a peer GPU's copy engine across NVLink.
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

CUTLASS_DEVICE long long global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return (long long)t;
}

}  // namespace detail

// Waits until flags[flag] - epoch >= 0 (as int32).  Called by a whole warp (or its active lanes): the first lane
// polls, the warp agrees on the outcome.  Returns true when it gave up: the call was aborted, or the timeout passed
// (then error_code is written to the error word).
CUTLASS_DEVICE bool wait_for_flag(AllGatherSchedule const& schedule, int flag) {
  unsigned const lanes = __activemask();
  int gave_up = 0;
  if ((threadIdx.x & 31) == (__ffs(lanes) - 1)) {
    uint32_t const* address = schedule.flags + flag;
    if (int(detail::load_acquire_sys(address) - schedule.epoch) < 0) {
      long long const start = detail::global_timer_ns();
      unsigned sleep_ns = 32;
      while (int(detail::load_acquire_sys(address) - schedule.epoch) < 0) {
        if (schedule.abort_word != nullptr &&
            *reinterpret_cast<uint32_t const volatile*>(schedule.abort_word) == schedule.abort_value) {
          gave_up = 1;
          break;
        }
        if (detail::global_timer_ns() - start > schedule.timeout_ns) {
          gave_up = 1;
          if (schedule.error_word != nullptr) {
            *schedule.error_word = schedule.error_code;
            __threadfence_system();
          }
          break;
        }
        __nanosleep(sleep_ns);
        sleep_ns = min(sleep_ns * 2, 1024u);
      }
    }
  }
  gave_up = __shfl_sync(lanes, gave_up, __ffs(lanes) - 1);
  __syncwarp(lanes);
  return gave_up != 0;
}

// Tag selecting AllGatherTileScheduler in CUTLASS's TileSchedulerSelector.
struct AllGatherSchedulerTag {};

template <class TileShape>
class AllGatherTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  static constexpr int kTileM = cute::size<0>(TileShape{});

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  using RasterOrderOptions = typename Base::RasterOrderOptions;

  struct Arguments : Base::Arguments {
    AllGatherSchedule schedule{};
  };
  struct Params : Base::Params {
    AllGatherSchedule schedule{};
  };

  // Our own walk needs the base's tile counts without swizzle; the raster order only matters for how
  // the base lays out the grid.
  CUTLASS_HOST_DEVICE static typename Base::Arguments base_arguments() {
    typename Base::Arguments args{};
    args.max_swizzle_size = 1;
    args.raster_order = RasterOrderOptions::AlongN;
    return args;
  }

  template <class ProblemShapeMNKL, class TileShape_, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape_ tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& arguments, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(
        problem_shape_mnkl, tile_shape, cluster_shape, hw_info, base_arguments(), workspace, epilogue_subtile,
        ktile_start_alignment_count);
    params.schedule = arguments.schedule;
    return params;
  }

  CUTLASS_HOST_DEVICE static bool can_implement(Arguments const& args) {
    return args.schedule.group_cluster_rows >= 1 && args.schedule.world >= 1 && args.schedule.shard_rows >= 1 &&
           args.schedule.chunk_rows >= 1 && args.schedule.chunks_per_rank >= 1 && args.schedule.col_chunks >= 1 &&
           args.schedule.chunk_col_tiles >= 1 && args.schedule.k_chunks >= 1 && args.schedule.k_chunk_tiles >= 1;
  }

  template <class ProblemShapeMNK, class BlockShape, class ClusterShape>
  CUTLASS_HOST_DEVICE static dim3 get_grid_shape(Params const& params, ProblemShapeMNK problem_shape_mnk,
                                                 BlockShape cta_shape, ClusterShape cluster_shape,
                                                 cutlass::KernelHardwareInfo hw_info, Arguments = Arguments{},
                                                 bool truncate_by_problem_size = true) {
    return Base::get_grid_shape(params, problem_shape_mnk, cta_shape, cluster_shape, hw_info, base_arguments(),
                                truncate_by_problem_size);
  }

  CUTLASS_HOST_DEVICE AllGatherTileScheduler() {}

  CUTLASS_DEVICE explicit AllGatherTileScheduler(Params const& params) : Base(params), schedule_(params.schedule) {
    dim3 cluster = cute::cluster_id_in_grid();
    dim3 clusters = cute::cluster_grid_dims();
    unit_ = uint64_t(cluster.x) + uint64_t(clusters.x) * (uint64_t(cluster.y) + uint64_t(clusters.y) * cluster.z);
    num_clusters_ = uint64_t(clusters.x) * clusters.y * clusters.z;
    dim3 in_cluster = cute::block_id_in_cluster();
    cta_m_in_cluster_ = int(in_cluster.x);
    cta_n_in_cluster_ = int(in_cluster.y);
    // Only the producer warp group (warp group 0 in the cooperative and ping-pong kernels) loads A.  With K chunks
    // the mainloop's producer waits instead, per block of the K loop.
    waits_ = schedule_.flags != nullptr && threadIdx.x < 128 && schedule_.k_chunks <= 1;
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work() { return work_for_unit(unit_); }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) {
    unit_ += num_clusters_ * uint64_t(advance_count);
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&,
                                      TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t advance_count = 1) const {
    return unit_ + num_clusters_ * uint64_t(advance_count) >= total_units();
  }

 private:
  CUTLASS_DEVICE uint64_t total_units() const {
    return uint64_t(scheduler_params.problem_tiles_m_) * scheduler_params.problem_tiles_n_;
  }

  // unit -> (cluster row, cluster column): groups of group_cluster_rows cluster rows, rotated so the walk
  // starts at first_cluster_row; inside a group the row runs fastest.
  // 32-bit arithmetic only: a 64-bit division is a function call, which would serialize the MMA warps' wgmma.
  CUTLASS_DEVICE WorkTileInfo work_for_unit(uint64_t unit64) {
    uint32_t const cluster_rows = scheduler_params.problem_tiles_m_;
    uint32_t const cluster_cols = scheduler_params.problem_tiles_n_;
    if (unit64 >= uint64_t(cluster_rows) * cluster_cols) {
      return WorkTileInfo::invalid_work_tile();
    }
    uint32_t const unit = uint32_t(unit64);
    uint32_t const group_rows = min(uint32_t(schedule_.group_cluster_rows), cluster_rows);
    uint32_t const units_per_group = group_rows * cluster_cols;
    uint32_t const group = unit / units_per_group;
    uint32_t const in_group = unit - group * units_per_group;
    uint32_t const rows_here = min(group_rows, cluster_rows - group * group_rows);
    uint32_t const col = in_group / rows_here;
    uint32_t row = group * group_rows + (in_group - col * rows_here) + uint32_t(schedule_.first_cluster_row);
    if (row >= cluster_rows) {
      row -= cluster_rows;
    }
    WorkTileInfo work{int(row * scheduler_params.cluster_shape_m_) + cta_m_in_cluster_,
                      int(col * scheduler_params.cluster_shape_n_) + cta_n_in_cluster_, 0, true};
    if (waits_) {
      wait_for_tile(work.M_idx, work.N_idx);
    }
    return work;
  }

  CUTLASS_DEVICE int flag_index(int row) const {
    int const owner = row / schedule_.shard_rows;
    int const chunk = (row - owner * schedule_.shard_rows) / schedule_.chunk_rows;
    return owner * schedule_.chunks_per_rank + chunk;
  }

  CUTLASS_DEVICE void wait_for_tile(int m_block, int n_block) {
    // The mainloop's load issues from one elected lane; the other lanes return at once and reach this wait while
    // that lane may still be issuing the previous tile.  Reconverge first, so the whole warp waits together (a
    // warp entering the wait split hung the K-chunked producer: csrc/NOTES_ag_gemm.md, session 7).
    __syncwarp();
    int const first_row = m_block * kTileM;
    if (gave_up_ || first_row >= schedule_.total_rows) {
      return;
    }
    int const last_row = min(first_row + kTileM, schedule_.total_rows) - 1;
    int const last_flag = flag_index(last_row);
    int const col_chunk = schedule_.col_chunks > 1 ? n_block / schedule_.chunk_col_tiles : 0;
    for (int flag = flag_index(first_row); flag <= last_flag && !gave_up_; ++flag) {
      if (flag / schedule_.chunks_per_rank != schedule_.rank) {
        wait_for_flag(flag * schedule_.col_chunks + col_chunk);
      }
    }
    // The copy engine wrote A through the generic proxy; the TMA loads that follow use the async proxy.
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }

  CUTLASS_DEVICE void wait_for_flag(int flag) { gave_up_ = gave_up_ || ag_gemm::wait_for_flag(schedule_, flag); }

  AllGatherSchedule schedule_{};
  uint64_t unit_ = 0;
  uint64_t num_clusters_ = 1;
  int cta_m_in_cluster_ = 0;
  int cta_n_in_cluster_ = 0;
  bool waits_ = false;
  bool gave_up_ = false;
};

}  // namespace fluxinductor::ag_gemm

namespace cutlass::gemm::kernel::detail {

// GemmUniversal picks its scheduler through this selector: our tag selects the all-gather scheduler.
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<fluxinductor::ag_gemm::AllGatherSchedulerTag, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = fluxinductor::ag_gemm::AllGatherTileScheduler<TileShape>;
};

}  // namespace cutlass::gemm::kernel::detail
