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
// rank = -1 makes every chunk remote: the split GEMM+RS transport's relay and own GEMMs wait this way for their
// source's bands (wait_for_tile_chunks, from their producer warps' loads: gemm_rs/split.cuh).
#pragma once

#include <cstdint>
#include <type_traits>

#include "ag_gemm/ag_gemm.h"
#include "fluxinductor/common/stop_context.cuh"
#include "cute/arch/cluster_sm90.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace fluxinductor::ag_gemm {

// Error codes written to AllGatherSchedule::error_word.
constexpr int kErrorNone = 0;
constexpr int kErrorFlagTimeout = 1;
constexpr int kErrorSplitTimeout = 3;  // a tail tile's last part waited too long for the other parts

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
  // Where the rows lie in A (batch_rows > 0: batch-major).  The scheduler walks and waits in call order: rank q's
  // shard_rows rows after rank q - 1's.  With batch_rows = 0 that is also A's order.  With batch_rows > 0 each shard
  // is shard_rows / batch_rows blocks of batch_rows rows (a [B, S/w, ...] slice gathered on S), and block b of rank q
  // lies at rows (b * world + q) * batch_rows of A: the gathered [B, S, ...] itself.  batch_rows is then a multiple of
  // the tile's M, so a tile's rows stay one block's.
  int batch_rows = 0;
  int first_cluster_row = 0;        // the cluster row (M block / cluster M) the walk starts from
  int group_cluster_rows = 8;       // cluster rows per group (see above); >= 1
  long long timeout_ns = 5000000000LL;
  volatile int* error_word = nullptr;  // host-mapped; error_code on timeout
  int error_code = kErrorFlagTimeout;
  // Trap after writing the code (a call inside a CUDA graph, where no host code runs to raise it: the context's error
  // stops the process instead of a result computed from rows that never came).
  bool trap_on_timeout = false;
  // A flag is ready when it equals epoch exactly rather than when int32(flag - epoch) >= 0: a call inside a CUDA
  // graph, whose constant epoch sits just below the wrap, and whose flags are zeroed after each replay.
  bool exact_epoch = false;
  // Optional: stop waiting, without an error, once *abort_word == abort_value (the call was aborted elsewhere).
  uint32_t const* abort_word = nullptr;
  uint32_t abort_value = 0;
  // K chunks (k_chunks > 1, for problems of about one wave, where every tile starts at once): rank q's whole shard
  // arrives in k_chunks column blocks of k_chunk_tiles K tiles, block kc setting flags[q * k_chunks + kc]; the
  // producer waits before each block of a tile's K loop (KChunkWaitingMainloop) instead of the scheduler before
  // the tile, so a peer's tiles start on the first block while the rest streams in.
  int k_chunks = 1;
  int k_chunk_tiles = 1;
  // Tail split (split_partials != nullptr; cooperative kernels, and the split GEMM+RS's ping-pong kernel): when the last wave of tiles is partial (R of C
  // clusters busy, after at least one full wave), each of its R tiles is split along K into P parts run by different
  // clusters, P <= split_max_parts chosen so the parts' ceil(P R / C) <= split_waves waves take the least time,
  // ceil(P R / C) / P of a tile's (with one wave: the most P with P R <= C).  Parts but the last store their fp32
  // accumulators in split_partials and raise their flag in split_flags to split_epoch; the last part (the tile's
  // highest unit, handed out after the others) waits for them, adds, and runs the epilogue.  Scratch: R * (P - 1) *
  // CTAs per cluster * TileM * TileN floats (less than split_waves grids' worth of tiles) and as many flags per
  // consumer warp group, both owned by one stream (concurrent launches need their own).
  // A part's flag is ready when it equals split_epoch exactly (not "at least": a slot left unused for 2^31 launches
  // must not read as ready).  A last part that waits past timeout_ns writes split_error_code to error_word.
  float* split_partials = nullptr;
  uint32_t* split_flags = nullptr;
  uint32_t split_epoch = 0;
  int split_max_parts = 1;
  int split_waves = 1;
  int split_error_code = kErrorSplitTimeout;
  // Units claimed at run time (gemm_rs/pingpong_tail_split.cuh), or nullptr: the static order.  claim[0] counts the
  // claims, claim[1] the clusters done; both 0 before the launch, and the last cluster done sets them back to 0.
  uint32_t* claim = nullptr;
};

// Whether a kernel of these tiles (TileShape, KernelSchedule) can split its tail here: the cooperative schedule, whose
// two consumer warp groups share one tile, with a tile that fits a scratch slot.  (CUTLASS's ping-pong kernel runs
// every tile's whole K loop; the split GEMM+RS transport's own ping-pong kernel splits: gemm_rs/pingpong_tail_split.cuh.)
template <class Tiles>
constexpr bool supports_tail_split() {
  using TileShape = typename Tiles::TileShape;
  return std::is_same_v<typename Tiles::KernelSchedule, cutlass::gemm::KernelTmaWarpSpecializedCooperative> &&
         cute::size<0>(TileShape{}) * cute::size<1>(TileShape{}) <= kMaxTailTileElements;
}

// Turns the tail split on in `schedule` (scratch as AllGatherSchedule describes it; parts < 2 or no scratch: off).
inline void set_tail_split(AllGatherSchedule& schedule, float* partials, uint32_t* flags, uint32_t epoch, int parts,
                           int waves) {
  if (partials == nullptr || flags == nullptr || parts < 2) {
    return;
  }
  schedule.split_partials = partials;
  schedule.split_flags = flags + kTailClaimWords;  // the first words are claim counters, no part's (ag_gemm.h)
  schedule.split_epoch = epoch;
  schedule.split_max_parts = parts;
  schedule.split_waves = waves > 1 ? waves : 1;
}

// The parts P (1: no split) a tail of `tail` tiles on `clusters` clusters splits into: among P <= max_parts whose
// parts fit max_waves waves, the one that ends soonest, ceil(P tail / clusters) / P of a tile's time (the fewest parts
// on a tie).  Part p of tail tile t runs on cluster (p tail + t) % clusters, so no P whose parts of one tile would meet
// on a cluster (d tail a multiple of clusters for some d < P).  With one wave: the most P with P tail <= clusters.
CUTLASS_HOST_DEVICE int tail_split_parts(uint32_t tail, uint32_t clusters, int max_parts, int max_waves) {
  int best = 1;
  uint32_t best_waves = 1;
  for (int p = 2; p <= max_parts; ++p) {
    uint32_t const waves = (uint32_t(p) * tail + clusters - 1) / clusters;
    if (waves > uint32_t(max_waves) || (uint32_t(p - 1) * tail) % clusters == 0) {
      break;  // more parts only take more waves, or keep this collision
    }
    if (waves * uint32_t(best) < best_waves * uint32_t(p)) {
      best = p;
      best_waves = waves;
    }
  }
  return best;
}

namespace detail {

CUTLASS_DEVICE uint32_t load_acquire_sys(uint32_t const* address) {
  uint32_t value;
  // System scope: the flag may be written by a peer GPU's copy engine across NVLink.
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

CUTLASS_DEVICE void store_release_gpu(uint32_t* address, uint32_t value) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

CUTLASS_DEVICE long long global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return (long long)t;
}

}  // namespace detail

// One thread polls until int32(*address - epoch) >= 0 (exact: until *address == epoch).  Returns true when it gave
// up: the call was aborted, or the timeout passed (then error_code is written to the error word).
CUTLASS_DEVICE bool poll_for_epoch(AllGatherSchedule const& schedule, uint32_t const* address, uint32_t epoch,
                                   int error_code, bool exact = false) {
  auto ready = [&] {
    uint32_t const value = detail::load_acquire_sys(address);
    return exact ? value == epoch : int(value - epoch) >= 0;
  };
  if (ready()) {
    return false;
  }
  long long const start = detail::global_timer_ns();
  unsigned sleep_ns = 32;
  while (!ready()) {
    if (schedule.abort_word != nullptr &&
        *reinterpret_cast<uint32_t const volatile*>(schedule.abort_word) == schedule.abort_value) {
      return true;
    }
    if (detail::global_timer_ns() - start > schedule.timeout_ns) {
      if (schedule.error_word != nullptr) {
        *schedule.error_word = error_code;
        __threadfence_system();
      }
      if (schedule.trap_on_timeout) {
        stop_context(error_code);
      }
      return true;
    }
    __nanosleep(sleep_ns);
    sleep_ns = min(sleep_ns * 2, 1024u);
  }
  return false;
}

// Waits until flags[flag] - epoch >= 0 (as int32).  Called by a whole warp (or its active lanes): the first lane
// polls, the warp agrees on the outcome.  Returns true when it gave up (see poll_for_epoch).
CUTLASS_DEVICE bool wait_for_flag(AllGatherSchedule const& schedule, int flag) {
  unsigned const lanes = __activemask();
  int gave_up = 0;
  if ((threadIdx.x & 31) == (__ffs(lanes) - 1)) {
    gave_up = poll_for_epoch(schedule, schedule.flags + flag, schedule.epoch, schedule.error_code,
                             schedule.exact_epoch) ? 1 : 0;
  }
  gave_up = __shfl_sync(lanes, gave_up, __ffs(lanes) - 1);
  __syncwarp(lanes);
  return gave_up != 0;
}

// The flag of the chunk that holds call-order row `row` (before col_chunks' split).
CUTLASS_DEVICE int chunk_flag_index(AllGatherSchedule const& s, int row) {
  int const owner = row / s.shard_rows;
  int const chunk = (row - owner * s.shard_rows) / s.chunk_rows;
  return owner * s.chunks_per_rank + chunk;
}

// The wait before a tile's loads: until every chunk of another rank that the tile's rows (M block m_block of tile_m
// rows, in call order) and its column block n_block touch has arrived, then a proxy fence for the TMA loads that
// follow.  Called by a whole warp.  gave_up: set once a wait gave up (see poll_for_epoch); no wait after that.
CUTLASS_DEVICE void wait_for_tile_chunks(AllGatherSchedule const& s, int m_block, int tile_m, int n_block,
                                         bool& gave_up) {
  // The mainloop's load issues from one elected lane; the other lanes return at once and reach this wait while
  // that lane may still be issuing the previous tile.  Reconverge first, so the whole warp waits together (a
  // warp entering the wait split hung the K-chunked producer: docs/design_ag_gemm.md).
  __syncwarp();
  int const first_row = m_block * tile_m;
  if (gave_up || first_row >= s.total_rows) {
    return;
  }
  int const last_row = min(first_row + tile_m, s.total_rows) - 1;
  int const last_flag = chunk_flag_index(s, last_row);
  int const col_chunk = s.col_chunks > 1 ? n_block / s.chunk_col_tiles : 0;
  for (int flag = chunk_flag_index(s, first_row); flag <= last_flag && !gave_up; ++flag) {
    if (flag / s.chunks_per_rank != s.rank) {
      gave_up = gave_up || wait_for_flag(s, flag * s.col_chunks + col_chunk);
    }
  }
  // The copy engine wrote A through the generic proxy; the TMA loads that follow use the async proxy.
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Whether kernels of these tiles take a batch-major A (AllGatherSchedule::batch_rows): those whose accumulators fit a
// 128 x 256 tile.  With variant 6's 256 x 160 tiles the mapping in the tile walk made ptxas spill (10 bytes).
template <class TileShape>
constexpr bool maps_batch_major() {
  return cute::size<0>(TileShape{}) * cute::size<1>(TileShape{}) <= kMaxTailTileElements;
}

// Row `row` of the call order as a row of A, and back (see AllGatherSchedule::batch_rows).  Rows past the problem
// (a cluster's padding) map to themselves.  32-bit arithmetic only (see work_for_unit).
CUTLASS_HOST_DEVICE int batch_major_row(AllGatherSchedule const& s, int row) {
  if (s.batch_rows <= 0 || row >= s.total_rows) {
    return row;
  }
  int const owner = row / s.shard_rows;
  int const local = row - owner * s.shard_rows;
  int const block = local / s.batch_rows;
  return (block * s.world + owner) * s.batch_rows + (local - block * s.batch_rows);
}

CUTLASS_HOST_DEVICE int call_order_row(AllGatherSchedule const& s, int row) {
  if (s.batch_rows <= 0 || row >= s.total_rows) {
    return row;
  }
  int const slot = row / s.batch_rows;  // block * world + owner
  int const block = slot / s.world;
  int const owner = slot - block * s.world;
  return owner * s.shard_rows + block * s.batch_rows + (row - slot * s.batch_rows);
}

// Tag selecting AllGatherTileScheduler in CUTLASS's TileSchedulerSelector.
struct AllGatherSchedulerTag {};

// Tag selecting AllGatherTileScheduler without its waits (Waits = false): the same tile order, for kernels whose
// producer warps wait in their own loads (the split GEMM+RS's, gemm_rs/split.cuh), with the tail split or without
// (TailSplit: whether the kernel splits its tail: gemm_rs/split.cuh splits_tail).  Every warp group runs the scheduler,
// so its wait is code in the consumer warp groups' tile loop too, where it never runs, and the tail split's state
// stays in registers through their MMAs and epilogue.  In the ping-pong 128x192 kernel, whose math warp
// groups hold 192 accumulator registers each out of 232, the wait alone made ptxas spill 82 bytes (still 24 with the
// wait cut down to one flag load).
template <bool TailSplit>
struct TileOrderSchedulerTag {};

// Waits: the producer warp group waits for each tile's chunks before it is handed out (AllGatherSchedule::flags).
// TailSplit: the tail split runs when the schedule asks for it (false: never, whatever the schedule says).
template <class TileShape, bool Waits = true, bool TailSplit = true>
class AllGatherTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  static constexpr int kTileM = cute::size<0>(TileShape{});

 public:
  using RasterOrderOptions = typename Base::RasterOrderOptions;

  // The base's work tile plus the K range of a tail-split part (parts == 1: the whole K loop).
  struct WorkTileInfo {
    int32_t M_idx = 0;
    int32_t N_idx = 0;
    int32_t L_idx = 0;
    bool is_valid_tile = false;
    int32_t k_start = 0;      // first K tile
    int32_t k_count = 0;      // K tiles (parts > 1 only)
    int32_t part = 0;         // this part; the last one reduces and stores
    int32_t parts = 1;
    int32_t tail_index = 0;   // which tile of the tail wave (its scratch slots)

    CUTLASS_HOST_DEVICE bool is_valid() const { return is_valid_tile; }
    CUTLASS_HOST_DEVICE static WorkTileInfo invalid_work_tile() { return WorkTileInfo{-1, -1, -1, false}; }
    CUTLASS_HOST_DEVICE bool is_final_split(uint32_t) const { return part == parts - 1; }
    CUTLASS_HOST_DEVICE int32_t reduction_subtile_idx() const { return -1; }
  };

  struct Arguments : Base::Arguments {
    AllGatherSchedule schedule{};
  };
  struct Params : Base::Params {
    AllGatherSchedule schedule{};
    int k_tiles = 1;  // K tiles of the problem
  };

  template <class ProblemShape, class TileShape_>
  CUTLASS_HOST_DEVICE static int get_work_k_tile_count(WorkTileInfo const& work, ProblemShape problem_shape,
                                                        TileShape_ tile_shape) {
    return work.parts > 1 ? work.k_count
                          : int(cute::size(cute::ceil_div(cute::get<2>(problem_shape), cute::get<2>(tile_shape))));
  }
  CUTLASS_HOST_DEVICE static uint32_t get_work_k_tile_start(WorkTileInfo const& work) { return work.k_start; }
  CUTLASS_HOST_DEVICE static bool valid_warpgroup_in_work_tile(WorkTileInfo const&) { return true; }
  CUTLASS_HOST_DEVICE static bool requires_separate_reduction(Params const&) { return false; }
  CUTLASS_HOST_DEVICE static bool compute_epilogue(WorkTileInfo const& work, Params const&) {
    return work.part == work.parts - 1;
  }
  CUTLASS_HOST_DEVICE static bool compute_epilogue(WorkTileInfo const& work) { return work.part == work.parts - 1; }

  // Called by every consumer warp group after its MMAs, before the epilogue (the cooperative kernel: the warp groups
  // share the tile).  Parts of a split tile but the last store this warp group's accumulators (thread-interleaved, so
  // the stores coalesce) and release its flag; the last part waits for every other part's flag and adds their
  // accumulators.
  template <class FrgTensorC>
  CUTLASS_DEVICE static void fixup(Params const& params, WorkTileInfo const& work, FrgTensorC& accumulators,
                                   uint32_t num_warp_groups, uint32_t warp_group) {
    fixup_slots(params, work, accumulators, num_warp_groups, warp_group, warp_group);
  }

  // The same for a warp group that holds a whole tile (the ping-pong kernel, gemm_rs/pingpong_tail_split.cuh): one
  // slot per tail tile, CTA and part; `consumer` (0 or 1) picks the named barrier of its math warp group.
  template <class FrgTensorC>
  CUTLASS_DEVICE static void fixup_whole_tile(Params const& params, WorkTileInfo const& work,
                                              FrgTensorC& accumulators, uint32_t consumer) {
    fixup_slots(params, work, accumulators, 1, 0, consumer);
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE static void fixup_slots(Params const& params, WorkTileInfo const& work, FrgTensorC& accumulators,
                                         uint32_t slot_groups, uint32_t slot_group, uint32_t barrier_group) {
    if (work.parts <= 1) {
      return;
    }
    constexpr int kThreads = 128;  // one consumer warp group
    AllGatherSchedule const& s = params.schedule;
    constexpr int values = int(decltype(cute::size(accumulators))::value);  // registers: index them statically
    int const thread = int(threadIdx.x % kThreads);
    auto const barrier = barrier_group == 0 ? cutlass::arch::ReservedNamedBarriers::StreamkBarrier0
                                            : cutlass::arch::ReservedNamedBarriers::StreamkBarrier1;
    int const cta = int(cute::block_rank_in_cluster());
    dim3 const cluster = cute::cluster_shape();
    int const ctas = int(cluster.x * cluster.y * cluster.z);
    // Slots of (tail tile, CTA of the cluster, warp group holding a share of it), one per part but the last.
    int64_t const slot = ((int64_t(work.tail_index) * ctas + cta) * slot_groups + slot_group) * (work.parts - 1);
    float* partials = s.split_partials + slot * values * kThreads;
    uint32_t* flags = s.split_flags + slot;
    if (work.part < work.parts - 1) {
      float* mine = partials + int64_t(work.part) * values * kThreads;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < values; ++i) {
        mine[i * kThreads + thread] = accumulators(i);
      }
      __threadfence();
      cutlass::arch::NamedBarrier::arrive_and_wait(kThreads, barrier);
      if (thread == 0) {
        detail::store_release_gpu(flags + work.part, s.split_epoch);
      }
      return;
    }
    if (thread == 0) {
      for (int p = 0; p < work.parts - 1; ++p) {
        if (poll_for_epoch(s, flags + p, s.split_epoch, s.split_error_code, /*exact=*/true)) {
          break;  // timed out: the error word says so, and the sums are wrong
        }
      }
    }
    cutlass::arch::NamedBarrier::arrive_and_wait(kThreads, barrier);
    for (int p = 0; p < work.parts - 1; ++p) {
      float const* theirs = partials + int64_t(p) * values * kThreads;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < values; ++i) {
        accumulators(i) += theirs[i * kThreads + thread];
      }
    }
  }

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
    params.k_tiles = int(cute::size(cute::ceil_div(cute::get<2>(problem_shape_mnkl), cute::get<2>(TileShape{}))));
    return params;
  }

  CUTLASS_HOST_DEVICE static bool can_implement(Arguments const& args) {
    AllGatherSchedule const& s = args.schedule;
    return s.split_max_parts >= 1 && s.group_cluster_rows >= 1 && s.world >= 1 && s.shard_rows >= 1 &&
           s.chunk_rows >= 1 && s.chunks_per_rank >= 1 && s.col_chunks >= 1 && s.chunk_col_tiles >= 1 &&
           s.k_chunks >= 1 && s.k_chunk_tiles >= 1 &&
           (s.batch_rows == 0 ||
            (maps_batch_major<TileShape>() && s.batch_rows % kTileM == 0 && s.shard_rows % s.batch_rows == 0));
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
    unit_ = cluster.x + clusters.x * (cluster.y + clusters.y * cluster.z);
    num_clusters_ = clusters.x * clusters.y * clusters.z;
    dim3 in_cluster = cute::block_id_in_cluster();
    cta_m_in_cluster_ = int(in_cluster.x);
    cta_n_in_cluster_ = int(in_cluster.y);
    // Only the producer warp group (warp group 0 in the cooperative and ping-pong kernels) loads A.  With K chunks
    // the mainloop's producer waits instead, per block of the K loop.
    waits_ = Waits && schedule_.flags != nullptr && threadIdx.x < 128 && schedule_.k_chunks <= 1;
    // Tail split: only after a full wave, with K tiles to share, and not with K chunks (their waits assume a tile's
    // K loop starts at 0).
    uint32_t const units = uint32_t(scheduler_params.problem_tiles_m_) * scheduler_params.problem_tiles_n_;
    uint32_t const clusters32 = uint32_t(num_clusters_);
    uint32_t const tail = units % clusters32;
    full_units_ = units - tail;
    if (TailSplit && schedule_.split_partials != nullptr && schedule_.k_chunks <= 1 && units >= clusters32 &&
        tail > 0) {
      int const parts =
          tail_split_parts(tail, clusters32, min(schedule_.split_max_parts, params.k_tiles), schedule_.split_waves);
      if (parts >= 2) {
        tail_units_ = tail;
        parts_ = parts;
        k_tiles_ = params.k_tiles;
      }
    }
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work() { return work_for_unit(unit_); }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) {
    unit_ += num_clusters_ * advance_count;
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
    return uint64_t(unit_) + num_clusters_ * advance_count >= total_units();
  }

  // For kernels that hand units out themselves (gemm_rs/pingpong_tail_split.cuh's claims): this cluster's first unit
  // in the static order, the clusters, the units (a split tail's parts included) and any unit's work.
  CUTLASS_DEVICE uint32_t first_unit() const { return unit_; }
  CUTLASS_DEVICE uint32_t cluster_count() const { return num_clusters_; }
  CUTLASS_DEVICE uint32_t unit_count() const { return uint32_t(total_units()); }
  CUTLASS_DEVICE WorkTileInfo work_at(uint32_t unit) { return work_for_unit(unit); }

 private:
  // Units handed out: the full waves' tiles, then the tail's tiles times their parts.
  CUTLASS_DEVICE uint64_t total_units() const {
    return tail_units_ > 0 ? uint64_t(full_units_) + uint64_t(tail_units_) * parts_
                           : uint64_t(scheduler_params.problem_tiles_m_) * scheduler_params.problem_tiles_n_;
  }

  // unit -> (cluster row, cluster column): groups of group_cluster_rows cluster rows, rotated so the walk
  // starts at first_cluster_row; inside a group the row runs fastest.
  // 32-bit arithmetic only: a 64-bit division is a function call, which would serialize the MMA warps' wgmma.
  CUTLASS_DEVICE WorkTileInfo work_for_unit(uint64_t unit64) {
    uint32_t const cluster_rows = scheduler_params.problem_tiles_m_;
    uint32_t const cluster_cols = scheduler_params.problem_tiles_n_;
    if (unit64 >= total_units()) {
      return WorkTileInfo::invalid_work_tile();
    }
    uint32_t unit = uint32_t(unit64);
    // A tail unit: the last wave holds tail_units_ tiles x parts_, part p of tile t on unit full + p * tail + t, so
    // the parts of one tile run on different clusters and the last part (which waits for the others) on the highest.
    int32_t part = 0, parts = 1, tail_index = 0, k_start = 0, k_count = 0;
    if (tail_units_ > 0 && unit >= full_units_) {
      uint32_t const v = unit - full_units_;
      part = int32_t(v / tail_units_);
      tail_index = int32_t(v - uint32_t(part) * tail_units_);
      parts = parts_;
      k_start = int32_t((part * k_tiles_) / parts_);
      k_count = int32_t(((part + 1) * k_tiles_) / parts_) - k_start;
      unit = full_units_ + uint32_t(tail_index);
    }
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
                      int(col * scheduler_params.cluster_shape_n_) + cta_n_in_cluster_, 0, true,
                      k_start, k_count, part, parts, tail_index};
    if constexpr (Waits) {
      if (waits_) {
        wait_for_tile_chunks(schedule_, work.M_idx, kTileM, work.N_idx, gave_up_);
      }
    }
    if constexpr (maps_batch_major<TileShape>()) {
      if (schedule_.batch_rows > 0) {  // the mainloop and the epilogue address A and the output by rows of A
        work.M_idx = batch_major_row(schedule_, work.M_idx * kTileM) / kTileM;
      }
    }
    return work;
  }

  AllGatherSchedule schedule_{};
  // 32-bit (the tile counts are: see the constructor's units): one register less each through the consumer warp
  // groups' MMAs and epilogue.
  uint32_t unit_ = 0;
  uint32_t num_clusters_ = 1;
  int cta_m_in_cluster_ = 0;
  int cta_n_in_cluster_ = 0;
  bool waits_ = false;
  bool gave_up_ = false;
  uint32_t full_units_ = 0;  // units before the tail wave
  uint32_t tail_units_ = 0;  // tiles of the tail wave when it is split (0: no split)
  int parts_ = 1;
  int k_tiles_ = 1;
};

}  // namespace fluxinductor::ag_gemm

namespace cutlass::gemm::kernel::detail {

// GemmUniversal picks its scheduler through this selector: our tags select the all-gather scheduler, with or without
// its waits.
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<fluxinductor::ag_gemm::AllGatherSchedulerTag, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = fluxinductor::ag_gemm::AllGatherTileScheduler<TileShape>;
};
template <bool TailSplit, class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<fluxinductor::ag_gemm::TileOrderSchedulerTag<TailSplit>, ArchTag, TileShape,
                             ClusterShape, SchedulerPipelineStageCount> {
  using Scheduler = fluxinductor::ag_gemm::AllGatherTileScheduler<TileShape, /*Waits=*/false, TailSplit>;
};

}  // namespace cutlass::gemm::kernel::detail
