// The split GEMM+RS transport (torch-free): the fused op as one stock CUTLASS GEMM per row segment, in a ring over
// the ranks, with communication between them.  All use AG+GEMM's mainloop and tile order (cooperative 128x256,
// cluster 2x1, groups of 8 cluster rows), which runs at cuBLAS's speed, and CUTLASS's own TMA-store epilogue:
//
//  * the peer GEMM computes a peer's rows into this rank's outbox, with bias; CountingEpilogue counts each tile in
//    its band (a block of rows x columns that the tile order completes in turn) once its TMA stores have landed,
//    and the launcher's copy stream copies each complete band into the next rank's slot (copy engine, 2-D) and
//    raises that rank's flag of (step, band);
//  * a relay GEMM (more than two ranks) is both: it waits per band for the partial sum rank + 1 sent, adds it as
//    its source C, and counts its tiles for the copy to rank - 1;
//  * the own GEMM computes this rank's rows with rank + 1's partial sum as its source C:
//    out = scale * acc + scale * C + scale * bias.  Its producer warps wait per band for the flag before loading a
//    tile's A and C (BandWaitingMainloop, BandWaitingEpilogue: the all-gather's per-tile wait, every chunk remote).
//
// Against the one-kernel transports the price is a launch per segment and its wave tail; the gain is a GEMM whose
// epilogue is CUTLASS's (no staged stores through our own code, no reduction loop).  See docs/design_gemm_rs.md.
#pragma once

#include <cstdint>

#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "ag_gemm/ag_gemm.h"
#include "fluxinductor/ag_gemm/kernel.cuh"
#include "fluxinductor/common/blocked_rows.cuh"
#include "fluxinductor/common/k_slabs.cuh"
#include "fluxinductor/common/cutlass_launch.cuh"
#include "gemm_rs/split.h"

namespace fluxinductor::gemm_rs_split {

// Where a stored tile is counted: counters[band], band = (m_block / band_tile_rows) * col_chunks +
// n_block / chunk_col_tiles, counters already at this segment's (SplitGemmParams: counters + segment * bands).
struct BandCounting {
  uint32_t* counters = nullptr;
  int band_tile_rows = 1;
  int col_chunks = 1;
  int chunk_col_tiles = 1;
};

// CUTLASS's sm90 TMA-store collective epilogue, plus one count per stored tile.  The warp that issues a tile's TMA
// stores (warp 0 of the math threads) counts it at the start of the CTA's next epilogue, or in store_tail (after the
// last one; the ping-pong kernel calls it after each): by then its bulk stores have long completed, so waiting for
// them costs nothing and the math warps never wait on memory for the count.  Padding tiles of the cluster rounding
// store nothing and are not counted.
//
// Registers: in the ping-pong 128x192 kernel each math warp group's 192 accumulators leave 40 registers for all else,
// so the count keeps as little live as it can: the band, one int, through the store (found before it: with the
// tile's coordinates kept through the store to find it after, the relay GEMM's kernel spilled 162 bytes), the
// pending band until the count (-1 on every way out of count_stored_tile, so where store_tail follows each store
// nothing stays live through the MMAs), and the counters pointer offset by the segment on the host (a parameter,
// read where it is used).
template <class Base>
class CountingEpilogue : public Base {
 public:
  struct Arguments : Base::Arguments {
    BandCounting counting{};
  };
  struct Params : Base::Params {
    BandCounting counting{};
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(problem_shape, args, workspace);
    params.counting = args.counting;
    return params;
  }

  CUTLASS_HOST_DEVICE CountingEpilogue(Params const& params, typename Base::TensorStorage& shared_tensors)
      : Base(params, shared_tensors), counting_(params.counting) {}

  template <class LoadPipeline, class LoadPipelineState, class StorePipeline, class StorePipelineState,
            class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadPipelineState load_state, StorePipeline store_pipeline,
                            StorePipelineState store_state, ProblemShapeMNKL problem_shape_mnkl,
                            TileShapeMNK tile_shape_mnk, TileCoordMNKL tile_coord_mnkl,
                            cute::Tensor<AccEngine, AccLayout> accumulators, TiledMma tiled_mma, int thread_idx,
                            typename Base::TensorStorage& shared_tensors, int subtile_idx = -1) {
    count_stored_tile();
    int const m_block = int(cute::get<0>(tile_coord_mnkl));
    int const n_block = int(cute::get<1>(tile_coord_mnkl));
    bool const real = m_block * int(cute::size<0>(tile_shape_mnk)) < int(cute::get<0>(problem_shape_mnkl)) &&
                      n_block * int(cute::size<1>(tile_shape_mnk)) < int(cute::get<1>(problem_shape_mnkl));
    int const band = real && counting_.counters != nullptr
                         ? (m_block / counting_.band_tile_rows) * counting_.col_chunks +
                               n_block / counting_.chunk_col_tiles
                         : -1;
    auto next = Base::store(load_pipeline, load_state, store_pipeline, store_state, problem_shape_mnkl,
                            tile_shape_mnk, tile_coord_mnkl, accumulators, tiled_mma, thread_idx, shared_tensors,
                            subtile_idx);
    if (thread_idx < 32) {  // the TMA-store warp (sm90_epilogue_tma_warpspecialized.hpp: issue_tma_store)
      pending_band_ = band;
    }
    return next;
  }

  template <class LoadPipeline, class LoadPipelineState, class StorePipeline, class StorePipelineState>
  CUTLASS_DEVICE auto store_tail(LoadPipeline load_pipeline, LoadPipelineState load_state,
                                 StorePipeline store_pipeline, StorePipelineState store_state) {
    auto next = Base::store_tail(load_pipeline, load_state, store_pipeline, store_state);
    count_stored_tile();
    return next;
  }

 private:
  // Bulk async-groups belong to the thread that committed them, so every lane of the warp waits for its own; then
  // the async-proxy writes are ordered before the count (generic proxy, system scope: the copy engine reads next).
  CUTLASS_DEVICE void count_stored_tile() {
    int const band = pending_band_;
    pending_band_ = -1;
    if (band < 0) {
      return;  // the same for all 32 lanes of the TMA-store warp; -1 for every other thread
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
      __threadfence_system();
      atomicAdd(counting_.counters + band, 1u);
    }
  }

  BandCounting counting_;
  int pending_band_ = -1;
};

// The relay and own GEMMs' per-band waits (band_wait: an AllGatherSchedule with rank = -1, every chunk remote; flags
// null for the peer GEMM: no wait), in the producer warps' loads rather than in the tile scheduler (ag_gemm::
// TileOrderSchedulerTag says why).  The mainloop's producer warp waits before a tile's loads of A and B, the
// epilogue's before its loads of C, each as the scheduler's producer warps did when it handed the tile out.
template <class Base>
class BandWaitingMainloop : public Base {
  static constexpr int kTileM = cute::size<0>(typename Base::TileShape{});

 public:
  struct Arguments : Base::Arguments {
    ag_gemm::AllGatherSchedule band_wait{};
  };
  struct Params : Base::Params {
    ag_gemm::AllGatherSchedule band_wait{};
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(problem_shape, args, workspace);
    params.band_wait = args.band_wait;
    return params;
  }

  // Called by the producer warp, as the base's (blk_coord's M block in call order: the split GEMMs map no rows).
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState state, cute::tuple<TensorA, TensorB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, typename Base::TensorStorage& shared_tensors) {
    ag_gemm::AllGatherSchedule const& s = params.band_wait;
    if (s.flags != nullptr) {
      ag_gemm::wait_for_tile_chunks(s, int(cute::get<0>(blk_coord)), kTileM, int(cute::get<1>(blk_coord)),
                                    gave_up_);
    }
    Base::load(params, pipeline, state, load_inputs, blk_coord, k_tile_iter, k_tile_count, thread_idx,
               block_rank_in_cluster, shared_tensors);
  }

 private:
  bool gave_up_ = false;
};

template <class Base>
class BandWaitingEpilogue : public Base {
 public:
  struct Arguments : Base::Arguments {
    ag_gemm::AllGatherSchedule band_wait{};
  };
  struct Params : Base::Params {
    ag_gemm::AllGatherSchedule band_wait{};
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(problem_shape, args, workspace);
    params.band_wait = args.band_wait;
    return params;
  }

  CUTLASS_HOST_DEVICE BandWaitingEpilogue(Params const& params, typename Base::TensorStorage& shared_tensors)
      : Base(params, shared_tensors), band_wait_(&params.band_wait) {}

  // Called by the epilogue's producer warp, as the base's.
  template <class LoadPipeline, class LoadPipelineState, class ProblemShapeMNKL, class TileShapeMNK,
            class TileCoordMNKL, class TiledMma>
  CUTLASS_DEVICE auto load(LoadPipeline load_pipeline, LoadPipelineState load_pipe_producer_state,
                           ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_mnk,
                           TileCoordMNKL tile_coord_mnkl, TiledMma tiled_mma, int thread_idx,
                           typename Base::TensorStorage& shared_tensors, int subtile_idx = -1) {
    ag_gemm::AllGatherSchedule const& s = *band_wait_;
    if (s.flags != nullptr) {
      ag_gemm::wait_for_tile_chunks(s, int(cute::get<0>(tile_coord_mnkl)), int(cute::size<0>(tile_shape_mnk)),
                                    int(cute::get<1>(tile_coord_mnkl)), gave_up_);
    }
    return Base::load(load_pipeline, load_pipe_producer_state, problem_shape_mnkl, tile_shape_mnk, tile_coord_mnkl,
                      tiled_mma, thread_idx, shared_tensors, subtile_idx);
  }

 private:
  ag_gemm::AllGatherSchedule const* band_wait_;
  bool gave_up_ = false;
};

// The kernel types of each kSplitTilings entry.
template <int Config>
struct SplitTiles;
template <>
struct SplitTiles<0> : ag_gemm::Cooperative128x256Cluster2x1 {};
template <>
struct SplitTiles<1> : ag_gemm::Pingpong64x256Cluster2x1 {};
template <>
struct SplitTiles<2> : ag_gemm::Pingpong128x192Cluster2x1 {};
template <>
struct SplitTiles<3> : ag_gemm::Pingpong128x160Cluster2x1 {};
template <>
struct SplitTiles<4> : ag_gemm::Pingpong128x144Cluster2x1 {};
template <>
struct SplitTiles<5> : ag_gemm::Pingpong128x128Cluster2x1 {};

template <int Config>
constexpr bool tiling_matches() {
  using Tiles = SplitTiles<Config>;
  constexpr SplitTiling t = kSplitTilings[Config];
  return cute::size<0>(typename Tiles::TileShape{}) == t.tile_m &&
         cute::size<1>(typename Tiles::TileShape{}) == t.tile_n &&
         cute::size<0>(typename Tiles::ClusterShape{}) == t.cluster_m;
}
static_assert(tiling_matches<0>() && tiling_matches<1>() && tiling_matches<2>() && tiling_matches<3>() &&
              tiling_matches<4>() && tiling_matches<5>() && kSplitConfigs == 6,
              "gemm_rs/split.h's tilings (the launcher's band arithmetic) must be the kernels' tiles");
static_assert(kMaxMoreSlabs == kMaxKSlabs - 1, "gemm_rs/split.h's slabs must be the mainloop's");

// The stock collective epilogue out = beta * C + (alpha * acc + bias), with (WithSource) or without a source C; the
// result in ElementD (the operands' dtype, or fp32 for the own GEMM of an fp32 reduction).
template <class Element, class Tiles, bool WithSource, class ElementD = Element>
using StockEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Tiles::TileShape, typename Tiles::ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    cute::conditional_t<WithSource, Element, void>, cutlass::layout::RowMajor, 8,
    ElementD, cutlass::layout::RowMajor, 16 / sizeof(ElementD),
    typename Tiles::EpilogueSchedule,
    cutlass::epilogue::fusion::LinCombPerColBias<ElementD, float, Element, Element, float>>::CollectiveOp;

// A: row-major [rows, K]; B: K-major (LayoutB ColumnMajor: the transposed nn.Linear weight) or N-major (RowMajor);
// the AG+GEMM tile order, its waits in the loads (BandWaitingMainloop, BandWaitingEpilogue).
template <class Element, int Config, class CollectiveEpilogue, class LayoutB>
struct SplitGemm {
  using LayoutTagB = LayoutB;
  using Tiles = SplitTiles<Config>;
  static constexpr SplitTiling kTiling = kSplitTilings[Config];
  using Epilogue = BandWaitingEpilogue<CollectiveEpilogue>;
  using Mainloop = BandWaitingMainloop<BlockedRowsMainloop<KSlabsMainloop<typename cutlass::gemm::collective::
      CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::RowMajor, 8,
      Element, LayoutB, 8,
      float, typename Tiles::TileShape, typename Tiles::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Tiles::KernelSchedule>::CollectiveOp>>>;  // A by rows or, batch-major, by blocks; K in slabs
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      ag_gemm::TileOrderSchedulerTag<
                                                          ag_gemm::supports_tail_split<Tiles>()>>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Element, int Config, class LayoutB>
using PeerGemm =
    SplitGemm<Element, Config, CountingEpilogue<StockEpilogue<Element, SplitTiles<Config>, false>>, LayoutB>;
template <class Element, int Config, class LayoutB>
using RelayGemm =
    SplitGemm<Element, Config, CountingEpilogue<StockEpilogue<Element, SplitTiles<Config>, true>>, LayoutB>;
template <class Element, int Config, class LayoutB>
using OwnGemm = SplitGemm<Element, Config, StockEpilogue<Element, SplitTiles<Config>, true>, LayoutB>;
// The own GEMM of an fp32 reduction of bf16/fp16 operands (autocast's reduce_scatter(mm(a, w).float()) at two ranks):
// the fp32 sum of this rank's fp32 partial and the peer's partial, which crossed in the operands' dtype.
template <class Element, int Config, class LayoutB>
using OwnGemmFloat = SplitGemm<Element, Config, StockEpilogue<Element, SplitTiles<Config>, true, float>, LayoutB>;

template <class Epilogue>
struct IsCounting : cute::false_type {};
template <class Base>
struct IsCounting<BandWaitingEpilogue<CountingEpilogue<Base>>> : cute::true_type {};

// Fills CUTLASS's arguments from the plain params and launches one of the GEMMs.
template <class Config, class Element>
int run_split_gemm(SplitGemmParams const& p, void* stream_ptr, std::string* error_message) {
  using Gemm = typename Config::Gemm;
  using Kernel = typename Config::Kernel;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  typename Kernel::StrideA stride_a{};
  cute::get<0>(stride_a) = p.lda;
  typename Kernel::StrideB stride_b{};
  if constexpr (cute::is_same_v<typename Config::LayoutTagB, cutlass::layout::ColumnMajor>) {
    cute::get<0>(stride_b) = p.ldb;  // K-major: B (n, k) at n * ldb + k
  } else {
    cute::get<1>(stride_b) = p.ldb;  // N-major: B (n, k) at k * ldb + n
  }
  typename Kernel::StrideC stride_c{};
  cute::get<0>(stride_c) = p.n;
  typename Kernel::StrideD stride_d{};
  cute::get<0>(stride_d) = p.ldd;

  ag_gemm::AllGatherSchedule schedule;
  schedule.total_rows = p.rows;
  schedule.shard_rows = p.rows;
  schedule.group_cluster_rows = Config::kTiling.group_cluster_rows;
  if (p.flags != nullptr) {  // relay and own GEMM: every band waits for rank + 1's partial sum
    schedule.flags = p.flags;
    schedule.epoch = p.epoch;
    schedule.rank = -1;
    schedule.chunk_rows = p.band_rows;
    schedule.chunks_per_rank = (p.rows + p.band_rows - 1) / p.band_rows;
    schedule.col_chunks = p.col_chunks;
    schedule.chunk_col_tiles = p.chunk_col_tiles;
    schedule.timeout_ns = p.timeout_ns;
    schedule.error_word = p.error;
    schedule.error_code = p.error_code;
    schedule.abort_word = p.abort_word;
    schedule.abort_value = p.abort_value;
    schedule.exact_epoch = p.capture;
    schedule.trap_on_timeout = p.capture;
  }
  if constexpr (ag_gemm::supports_tail_split<typename Config::Tiles>()) {
    ag_gemm::set_tail_split(schedule, p.split_partials, p.split_flags, p.split_epoch, p.split_max_parts,
                            p.split_waves);
    if (schedule.split_partials != nullptr) {
      if (p.pdl) {
        *error_message = "the split GEMM+RS tail split needs its scratch to itself: launch without pdl";
        return -1;
      }
      schedule.split_error_code = p.split_error_code;
      schedule.timeout_ns = p.timeout_ns;
      schedule.error_word = p.error;
    }
  }

  typename Gemm::Arguments arguments{};
  arguments.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  arguments.problem_shape = {p.rows, p.n, p.k, 1};
  arguments.mainloop.ptr_A = static_cast<Element const*>(p.a);
  arguments.mainloop.dA = stride_a;
  arguments.mainloop.ptr_B = static_cast<Element const*>(p.b);
  arguments.mainloop.dB = stride_b;
  arguments.mainloop.block_rows = p.block_rows;
  arguments.mainloop.pitch_rows = p.pitch_rows;
  arguments.mainloop.rows_extent = p.rows_extent;
  if (p.slabs > 1) {  // the further slabs' A and B, strided as the first's
    arguments.mainloop.slabs = p.slabs;
    arguments.mainloop.k_first = p.k_first;
    for (int s = 1; s < p.slabs; ++s) {
      auto& slab = arguments.mainloop.more[s - 1];
      slab.a = p.a_more[s - 1];
      slab.dA = stride_a;
      cute::get<0>(slab.dA) = p.lda_more[s - 1];
      slab.b = p.b_more[s - 1];
      slab.dB = stride_b;
      if constexpr (cute::is_same_v<typename Config::LayoutTagB, cutlass::layout::ColumnMajor>) {
        cute::get<0>(slab.dB) = p.ldb_more[s - 1];
      } else {
        cute::get<1>(slab.dB) = p.ldb_more[s - 1];
      }
      slab.k = p.k_more[s - 1];
    }
  }
  arguments.epilogue.thread.alpha = p.alpha;
  arguments.epilogue.thread.beta = p.beta;
  arguments.epilogue.thread.bias_ptr = static_cast<Element const*>(p.bias);
  arguments.epilogue.ptr_C = static_cast<Element const*>(p.c);
  arguments.epilogue.dC = stride_c;
  arguments.epilogue.ptr_D = static_cast<typename Config::Epilogue::ElementD*>(p.d);
  arguments.epilogue.dD = stride_d;
  if constexpr (IsCounting<typename Config::Epilogue>::value) {
    arguments.epilogue.counting = {p.counters != nullptr ? p.counters + p.segment * p.bands : nullptr,
                                   p.band_rows / Config::kTiling.tile_m, p.col_chunks, p.chunk_col_tiles};
  }
  if (p.out_float != cute::is_same_v<typename Config::Epilogue::ElementD, float>) {
    *error_message = "split GEMM+RS: the result's dtype is not this GEMM's";
    return -1;
  }
  cudaGetDevice(&arguments.hw_info.device_id);
  arguments.hw_info.sm_count = p.sm_count > 0 ? p.sm_count : ag_gemm::device_sm_count();
  arguments.scheduler.schedule = schedule;  // tile order; its tail split's waits honour the abort word and timeout
  arguments.mainloop.band_wait = schedule;
  arguments.epilogue.band_wait = schedule;

  cutlass::Status status = Gemm::can_implement(arguments);
  if (status != cutlass::Status::kSuccess) {
    *error_message = std::string("CUTLASS cannot implement this split GEMM+RS problem: ") +
                     cutlassGetStatusString(status);
    return -1;
  }
  if (Gemm::get_workspace_size(arguments) != 0) {
    *error_message = "split GEMM+RS kernel unexpectedly needs a workspace";
    return -1;
  }
  cudaError_t const launched = launch_gemm_kernel<Gemm>(arguments, arguments.hw_info.device_id, stream, p.pdl);
  if (launched != cudaSuccess) {
    *error_message = std::string("split GEMM+RS launch failed: ") + cudaGetErrorString(launched);
    return -1;
  }
  return 0;
}

// One GEMM kind for the params' weight layout (K-major: ColumnMajor B, N-major: RowMajor B).
template <template <class, int, class> class Kind, class Element, int Config>
int run_split_layout(SplitGemmParams const& p, void* stream, std::string* error_message) {
  return p.b_k_major
             ? run_split_gemm<Kind<Element, Config, cutlass::layout::ColumnMajor>, Element>(p, stream, error_message)
             : run_split_gemm<Kind<Element, Config, cutlass::layout::RowMajor>, Element>(p, stream, error_message);
}

// One GEMM kind (PeerGemm, RelayGemm or OwnGemm) for the params' configuration, dtype and weight layout.
template <template <class, int, class> class Kind>
int run_split_kind(SplitGemmParams const& p, void* stream, std::string* error_message) {
#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
  using cutlass::bfloat16_t;
  using cutlass::half_t;
  if (p.config == 0 && p.dtype == 0) {
    return run_split_layout<Kind, bfloat16_t, 0>(p, stream, error_message);
  }
  if (p.config == 0 && p.dtype == 1) {
    return run_split_layout<Kind, half_t, 0>(p, stream, error_message);
  }
  if (p.config == 2 && p.dtype == 0) {
    return run_split_layout<Kind, bfloat16_t, 2>(p, stream, error_message);
  }
  if (p.config == 3 && p.dtype == 0 && p.b_k_major) {
    return run_split_gemm<Kind<bfloat16_t, 3, cutlass::layout::ColumnMajor>, bfloat16_t>(p, stream, error_message);
  }
  if (p.config == 4 && p.dtype == 0 && p.b_k_major) {
    return run_split_gemm<Kind<bfloat16_t, 4, cutlass::layout::ColumnMajor>, bfloat16_t>(p, stream, error_message);
  }
  if (p.config == 5 && p.dtype == 0 && p.b_k_major) {
    return run_split_gemm<Kind<bfloat16_t, 5, cutlass::layout::ColumnMajor>, bfloat16_t>(p, stream, error_message);
  }
#if defined(FLUXINDUCTOR_KERNEL_TUNING)
  using KMajor = cutlass::layout::ColumnMajor;  // configuration 1 is built for K-major weights only
  if (p.config == 1 && p.dtype == 0 && p.b_k_major) {
    return run_split_gemm<Kind<bfloat16_t, 1, KMajor>, bfloat16_t>(p, stream, error_message);
  }
#endif
  *error_message = "no split GEMM for configuration " + std::to_string(p.config) + ", dtype " +
                   std::to_string(p.dtype) + " and a " + (p.b_k_major ? "K" : "N") + "-major weight in this build";
#else
  *error_message = "fluxinductor was built without sm90a support (CUTLASS_ARCH_MMA_SM90_SUPPORTED)";
#endif
  return -1;
}

}  // namespace fluxinductor::gemm_rs_split
