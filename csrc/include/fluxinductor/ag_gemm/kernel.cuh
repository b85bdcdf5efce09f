// The AG+GEMM kernel type (torch-free): one persistent CUTLASS 3.x sm90a GEMM,
// out[M, N] = A[M, K] @ B[K, N] + bias[N], that waits per tile for the rows of A it reads
// (AllGatherTileScheduler), or per block of its K loop for the columns (KChunkWaitingMainloop).  With no flags
// it is a plain GEMM (communication off).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "fluxinductor/ag_gemm/scheduler.cuh"

namespace fluxinductor::ag_gemm {

// Tile shape, cluster shape and kernel schedule of one variant.
template <class TileShape_, class ClusterShape_, class KernelSchedule_, class EpilogueSchedule_>
struct TileConfig {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using KernelSchedule = KernelSchedule_;
  using EpilogueSchedule = EpilogueSchedule_;
};

using Cooperative128x256Cluster2x1 = TileConfig<
    cute::Shape<cute::_128, cute::_256, cute::_64>,        // CTA tile M x N x K
    cute::Shape<cute::_2, cute::_1, cute::_1>,             // 2 CTAs along M share B (multicast)
    cutlass::gemm::KernelTmaWarpSpecializedCooperative,    // 1 producer + 2 MMA warp groups on one tile
    cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Cooperative256x128Cluster1x2 = TileConfig<
    cute::Shape<cute::_256, cute::_128, cute::_64>,
    cute::Shape<cute::_1, cute::_2, cute::_1>,             // 2 CTAs along N share A (multicast)
    cutlass::gemm::KernelTmaWarpSpecializedCooperative,
    cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Cooperative256x128Cluster2x1 = TileConfig<            // tuning builds only
    cute::Shape<cute::_256, cute::_128, cute::_64>,
    cute::Shape<cute::_2, cute::_1, cute::_1>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative,
    cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Cooperative128x256Cluster1x2 = TileConfig<            // tuning builds only
    cute::Shape<cute::_128, cute::_256, cute::_64>,
    cute::Shape<cute::_1, cute::_2, cute::_1>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative,
    cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Cooperative256x160Cluster1x2 = TileConfig<            // wgmma 64x160 atoms: csrc/ag_gemm/instances_bf16_256x160.cu
    cute::Shape<cute::_256, cute::_160, cute::_64>,        // 1.25x a 128x256 tile: fewer, larger waves
    cute::Shape<cute::_1, cute::_2, cute::_1>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative,
    cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Cooperative256x160Cluster2x1 = TileConfig<            // tuning builds only
    cute::Shape<cute::_256, cute::_160, cute::_64>,
    cute::Shape<cute::_2, cute::_1, cute::_1>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative,
    cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Pingpong64x256Cluster2x1 = TileConfig<              // the split GEMM+RS transport's tuning configuration
    cute::Shape<cute::_64, cute::_256, cute::_64>,
    cute::Shape<cute::_2, cute::_1, cute::_1>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong,
    cutlass::epilogue::TmaWarpSpecialized>;
using Pingpong128x192Cluster2x1 = TileConfig<             // a split GEMM+RS tuning configuration
    cute::Shape<cute::_128, cute::_192, cute::_64>,
    cute::Shape<cute::_2, cute::_1, cute::_1>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong,
    cutlass::epilogue::TmaWarpSpecialized>;
using Pingpong128x160Cluster2x1 = TileConfig<
    cute::Shape<cute::_128, cute::_160, cute::_64>,
    cute::Shape<cute::_2, cute::_1, cute::_1>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong,
    cutlass::epilogue::TmaWarpSpecialized>;
using Pingpong128x144Cluster2x1 = TileConfig<
    cute::Shape<cute::_128, cute::_144, cute::_64>,
    cute::Shape<cute::_2, cute::_1, cute::_1>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong,
    cutlass::epilogue::TmaWarpSpecialized>;
using Pingpong128x128Cluster2x1 = TileConfig<
    cute::Shape<cute::_128, cute::_128, cute::_64>,
    cute::Shape<cute::_2, cute::_1, cute::_1>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong,
    cutlass::epilogue::TmaWarpSpecialized>;
using Pingpong128x128Cluster1x2 = TileConfig<
    cute::Shape<cute::_128, cute::_128, cute::_64>,
    cute::Shape<cute::_1, cute::_2, cute::_1>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong,       // 2 MMA warp groups alternate tiles
    cutlass::epilogue::TmaWarpSpecialized>;

// CUTLASS's sm90 TMA mainloop whose producer, when the schedule splits shards along K
// (AllGatherSchedule::k_chunks > 1), waits for each block of K tiles' flag before issuing that block's loads; with
// row chunks (the scheduler waits per tile) or no flags it is the base, unchanged.  With `a_local` the tiles of this
// rank's rows load A from there (a second pair of TMA descriptors over [shard_rows, K]) instead of from the
// gathered buffer, so this rank's shard never has to be copied into it.
//
// With `a_out` the tiles of N block 0 also write the A tiles they load, from shared memory, into a_out ([M, K], the
// gathered A's layout) with TMA stores: every row block (or, with a_out_local_only, only this rank's) once, so the
// gathered A comes out of the GEMM with no copy on the streams (a same-device copy runs on SMs, behind the GEMM).
// The producer stores a K tile once its load has landed, kStoreLag tiles behind the loads, and before reloading a
// stage waits until the store from it has read shared memory.
template <class Base>
class KChunkWaitingMainloop : public Base {
  static constexpr int kTileM = cute::size<0>(typename Base::TileShape{});
  static constexpr int kTileK = cute::size<2>(typename Base::TileShape{});
  static constexpr int kStages = Base::DispatchPolicy::Stages;
  static constexpr int kStoreLag = kStages > 2 ? kStages - 2 : 1;  // K tiles between a load and its store
  // Not where a cluster multicasts A: a peer CTA's load could overwrite a stage this CTA's store still reads.
  static constexpr bool kStoresA = cute::size<1>(typename Base::DispatchPolicy::ClusterShape{}) == 1;
  using SmemLayoutAStage = decltype(typename Base::SmemLayoutA{}(cute::_, cute::_, cute::Int<0>{}));
  using ElementAOut = typename Base::ElementA;
  using TmaStoreA = decltype(cute::make_tma_copy(
      cute::SM90_TMA_STORE{},
      cute::make_tensor(static_cast<ElementAOut*>(nullptr), cute::repeat_like(typename Base::StrideA{}, int32_t(0)),
                        typename Base::StrideA{}),
      SmemLayoutAStage{}));

 public:
  struct Arguments : Base::Arguments {
    AllGatherSchedule schedule{};
    void const* a_local = nullptr;  // [shard_rows, K], row stride lda_local; shard_rows a multiple of kTileM
    int64_t lda_local = 0;
    void* a_out = nullptr;          // [M, K], row stride ld_a_out: where N block 0's tiles store the A they load
    int64_t ld_a_out = 0;
    bool a_out_local_only = false;  // only this rank's rows (the peers' are in A already)
  };
  struct Params : Base::Params {
    AllGatherSchedule schedule{};
    typename Base::Params local{};  // the base's params over a_local (only its A descriptor is used)
    int local_first_tile = 0;       // this rank's first M block in the gathered problem
    int local_tiles = 0;            // 0: every tile reads the gathered buffer
    TmaStoreA store_a{};            // over a_out
    int store_rows = 0;             // 0: no stores; 1: this rank's row blocks; 2: every row block
    int store_m = 0, store_k = 0;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(problem_shape, args, workspace);
    params.schedule = args.schedule;
    if (args.a_local != nullptr && args.schedule.flags != nullptr) {
      typename Base::Arguments local = args;
      local.ptr_A = static_cast<typename Base::ElementA const*>(args.a_local);
      cute::get<0>(local.dA) = args.lda_local;
      auto const local_shape = cute::make_tuple(args.schedule.shard_rows, cute::get<1>(problem_shape),
                                                cute::get<2>(problem_shape), cute::get<3>(problem_shape));
      params.local = Base::to_underlying_arguments(local_shape, local, workspace);
      params.local_first_tile = args.schedule.rank * args.schedule.shard_rows / kTileM;
      params.local_tiles = args.schedule.shard_rows / kTileM;
    }
    if (kStoresA && args.a_out != nullptr && args.schedule.flags != nullptr) {
      auto const m = cute::get<0>(problem_shape), k = cute::get<2>(problem_shape);
      typename Base::StrideA stride{};
      cute::get<0>(stride) = args.ld_a_out;
      auto const out = cute::make_tensor(static_cast<ElementAOut*>(args.a_out),
                                         cute::make_layout(cute::make_shape(m, k, 1), stride));
      params.store_a = cute::make_tma_copy(cute::SM90_TMA_STORE{}, out, SmemLayoutAStage{});
      params.store_rows = args.a_out_local_only ? 1 : 2;
      params.store_m = m;
      params.store_k = k;
    }
    return params;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    if (params.local_tiles > 0) {
      Base::prefetch_tma_descriptors(params.local);
    }
    if constexpr (kStoresA) {
      if (params.store_rows > 0) {
        cute::prefetch_tma_descriptor(params.store_a.get_tma_descriptor());
      }
    }
  }

  // Called by the producer warp (CUTLASS's load elects one lane for the TMA issue; the waits poll from one lane).
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState state, cute::tuple<TensorA, TensorB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, typename Base::TensorStorage& shared_tensors) {
    AllGatherSchedule const& s = params.schedule;
    // The tile's M block in call order (blk_coord is in rows of A, batch-major with batch_rows > 0).
    int block = int(cute::get<0>(blk_coord));
    if constexpr (maps_batch_major<typename Base::TileShape>()) {
      if (s.batch_rows > 0) {
        block = call_order_row(s, block * kTileM) / kTileM;
      }
    }
    int const local_block = block - params.local_first_tile;
    bool const local = params.local_tiles > 0 && local_block >= 0 && local_block < params.local_tiles;
    if constexpr (kStoresA) {
      if (params.store_rows > 0 && int(cute::get<1>(blk_coord)) == 0 && (params.store_rows == 2 || local)) {
        load_storing(params, pipeline, state, load_inputs, blk_coord, local ? local_block : -1, block, k_tile_iter,
                     k_tile_count, thread_idx, block_rank_in_cluster, shared_tensors);
        return;
      }
    }
    if (local) {
      // This rank's rows, from its own input: never waited for.
      auto const local_coord = cute::make_coord(local_block, cute::get<1>(blk_coord), cute::get<2>(blk_coord),
                                                cute::get<3>(blk_coord));
      Base::load(params.local, pipeline, state, load_inputs, local_coord, k_tile_iter, k_tile_count, thread_idx,
                 block_rank_in_cluster, shared_tensors);
      return;
    }
    int const first_row = block * kTileM;
    if (s.flags == nullptr || s.k_chunks <= 1 || first_row >= s.total_rows) {
      Base::load(params, pipeline, state, load_inputs, blk_coord, k_tile_iter, k_tile_count, thread_idx,
                 block_rank_in_cluster, shared_tensors);
      return;
    }
    bool gave_up = false;
    for (int kc = 0; kc < s.k_chunks && k_tile_count > 0; ++kc) {
      wait_for_k_block(s, first_row, kc, gave_up);
      int const tiles = kc == s.k_chunks - 1 ? k_tile_count : min(s.k_chunk_tiles, k_tile_count);
      Base::load(params, pipeline, state, load_inputs, blk_coord, k_tile_iter, tiles, thread_idx,
                 block_rank_in_cluster, shared_tensors);
      state.advance(tiles);
      for (int i = 0; i < tiles; ++i) {
        ++k_tile_iter;
      }
      k_tile_count -= tiles;
    }
  }

  // The producer's end: every store of A done (its shared memory read and its global writes made), then the base's.
  CUTLASS_DEVICE void load_tail(typename Base::MainloopPipeline pipeline, typename Base::PipelineState state) {
    if (cutlass::canonical_lane_idx() == 0) {
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
    __syncwarp();
    Base::load_tail(pipeline, state);
  }

 private:
  // Waits until each peer owning rows of the tile at first_row has raised the flag of K block kc (after a timeout,
  // gave_up, and no more waits), then orders the TMA loads that follow after the copy engine's writes.
  CUTLASS_DEVICE static void wait_for_k_block(AllGatherSchedule const& s, int first_row, int kc, bool& gave_up) {
    // Base::load issues from one elected lane, which may still be at the previous block's loads: reconverge, so the
    // whole warp waits for this block together.
    __syncwarp();
    int const first_owner = first_row / s.shard_rows;
    int const last_owner = (min(first_row + kTileM, s.total_rows) - 1) / s.shard_rows;
    for (int owner = first_owner; owner <= last_owner && !gave_up; ++owner) {
      if (owner != s.rank) {
        gave_up = wait_for_flag(s, owner * s.k_chunks + kc);
      }
    }
    // The copy engine wrote A through the generic proxy; the TMA loads that follow use the async proxy.
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }

  // load() for a tile that stores its A: the K tiles one at a time (a block's flags waited for first with column
  // blocks), each stored into a_out kStoreLag tiles later, once its load has landed.  Lane 0 issues and waits for
  // the stores (bulk async groups are per thread); Base::load issues the loads from its elected lane.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_storing(Params const& params, typename Base::MainloopPipeline pipeline,
                                   typename Base::PipelineState state,
                                   cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                                   int local_block, int block, KTileIterator k_tile_iter, int k_tile_count,
                                   int thread_idx, uint32_t block_rank_in_cluster,
                                   typename Base::TensorStorage& shared_tensors) {
    using namespace cute;
    AllGatherSchedule const& s = params.schedule;
    bool const lane0 = cutlass::canonical_lane_idx() == 0;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
    Tensor mOut = params.store_a.get_tma_tensor(make_shape(params.store_m, params.store_k, 1));
    Tensor gOut = local_tile(mOut(_, _, 0), make_shape(Int<kTileM>{}, Int<kTileK>{}),
                             make_coord(int(get<0>(blk_coord)), _));                 // (BLK_M, BLK_K, k)
    auto cta_store = params.store_a.get_slice(Int<0>{});
    Tensor tSsA = cta_store.partition_S(sA);                                         // (TMA, TMA_M, TMA_K, PIPE)
    Tensor tSgOut = cta_store.partition_D(gOut);                                     // (TMA, TMA_M, TMA_K, k)

    auto const local_coord = make_coord(local_block, get<1>(blk_coord), get<2>(blk_coord), get<3>(blk_coord));
    int const first_row = block * kTileM;
    bool const chunked = local_block < 0 && s.flags != nullptr && s.k_chunks > 1 && first_row < s.total_rows;

    typename Base::PipelineState stored = state;  // the oldest K tile loaded and not yet stored
    int stored_k = int(*k_tile_iter);
    int pending = 0;
    auto store_one = [&]() {
      if (lane0) {
        // Its load has landed: the stage's full barrier, at the consumers' phase (a producer state's is inverted, as
        // the stages start empty).  Waited on directly: the pipeline's consumer_wait traps in a producer thread.
        cutlass::arch::ClusterTransactionBarrier::wait(pipeline.producer_get_barrier(stored), stored.phase() ^ 1u);
        copy(params.store_a, tSsA(_, _, _, stored.index()), tSgOut(_, _, _, stored_k));
        tma_store_arrive();
      }
      ++stored;
      ++stored_k;
      --pending;
    };
    bool gave_up = false;
    for (int t = 0; k_tile_count > 0; ++t, --k_tile_count) {
      int const k_tile = int(*k_tile_iter);
      if (chunked && (t == 0 || k_tile % s.k_chunk_tiles == 0)) {  // the first K tile of a block: its flags
        wait_for_k_block(s, first_row, k_tile / s.k_chunk_tiles, gave_up);
      }
      if (lane0) {  // the store from the stage this load reuses has read it
        tma_store_wait<kStages - 1 - kStoreLag>();
      }
      __syncwarp();
      if (local_block >= 0) {
        Base::load(params.local, pipeline, state, load_inputs, local_coord, k_tile_iter, 1, thread_idx,
                   block_rank_in_cluster, shared_tensors);
      } else {
        Base::load(params, pipeline, state, load_inputs, blk_coord, k_tile_iter, 1, thread_idx,
                   block_rank_in_cluster, shared_tensors);
      }
      ++state;
      ++k_tile_iter;
      if (++pending > kStoreLag) {
        store_one();
      }
    }
    while (pending > 0) {
      store_one();
    }
    __syncwarp();
  }
};

// One kernel configuration per (element type, layout of B, tile config).  B: [K, N] as torch holds it; a transposed
// nn.Linear weight ([N, K] row-major) is cutlass::layout::ColumnMajor here, a plain [K, N] row-major
// weight is cutlass::layout::RowMajor.
template <class Element, class LayoutB, class Tiles = Cooperative128x256Cluster2x1>
struct AllGatherGemmConfig {
  using ElementA = Element;                                   // gathered activations
  using LayoutA = cutlass::layout::RowMajor;                  // A: [M, K], K contiguous
  static constexpr int kAlignmentA = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA rows
  using ElementB = Element;                                   // weight
  static constexpr int kAlignmentB = kAlignmentA;
  using ElementD = Element;                                   // output
  using LayoutD = cutlass::layout::RowMajor;                  // out: [M, N]
  static constexpr int kAlignmentD = kAlignmentA;
  using ElementAccumulator = float;                           // fp32 accumulation
  using ElementCompute = float;                               // epilogue math in fp32
  using ElementBias = Element;                                // bias: [N]

  using TileShape = typename Tiles::TileShape;
  using ClusterShape = typename Tiles::ClusterShape;
  using KernelSchedule = typename Tiles::KernelSchedule;
  using EpilogueSchedule = typename Tiles::EpilogueSchedule;
  // out = acc + bias (per column); a null bias pointer reads as zeros, so one kernel serves both cases.
  using FusionOperation = cutlass::epilogue::fusion::LinCombPerColBias<ElementD, ElementCompute, ElementBias,
                                                                        ElementD, ElementCompute>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,   // Hopper tensor cores
      TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementCompute,
      void, LayoutD, kAlignmentD,                            // no source C
      ElementD, LayoutD, kAlignmentD,
      EpilogueSchedule, FusionOperation>::CollectiveOp;

  using CollectiveMainloop = KChunkWaitingMainloop<typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementA, LayoutA, kAlignmentA,
      ElementB, LayoutB, kAlignmentB,
      ElementAccumulator,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<     // as many stages as the epilogue leaves room for
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp>;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>,                       // M, N, K, L (L = 1)
      CollectiveMainloop, CollectiveEpilogue,
      AllGatherSchedulerTag>;                                // per-tile waits, local shard first
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kClusterM = cute::size<0>(ClusterShape{});
};

}  // namespace fluxinductor::ag_gemm
