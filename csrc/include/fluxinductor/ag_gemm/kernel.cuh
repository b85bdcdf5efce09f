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
template <class Base>
class KChunkWaitingMainloop : public Base {
  static constexpr int kTileM = cute::size<0>(typename Base::TileShape{});

 public:
  struct Arguments : Base::Arguments {
    AllGatherSchedule schedule{};
    void const* a_local = nullptr;  // [shard_rows, K], row stride lda_local; shard_rows a multiple of kTileM
    int64_t lda_local = 0;
  };
  struct Params : Base::Params {
    AllGatherSchedule schedule{};
    typename Base::Params local{};  // the base's params over a_local (only its A descriptor is used)
    int local_first_tile = 0;       // this rank's first M block in the gathered problem
    int local_tiles = 0;            // 0: every tile reads the gathered buffer
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
    return params;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    if (params.local_tiles > 0) {
      Base::prefetch_tma_descriptors(params.local);
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
    if (params.local_tiles > 0 && local_block >= 0 && local_block < params.local_tiles) {
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
    int const first_owner = first_row / s.shard_rows;
    int const last_owner = (min(first_row + kTileM, s.total_rows) - 1) / s.shard_rows;
    bool gave_up = false;
    for (int kc = 0; kc < s.k_chunks && k_tile_count > 0; ++kc) {
      // Base::load issues from one elected lane, which may still be at the previous block's loads: reconverge,
      // so the whole warp waits for this block together.
      __syncwarp();
      for (int owner = first_owner; owner <= last_owner && !gave_up; ++owner) {
        if (owner != s.rank) {
          gave_up = wait_for_flag(s, owner * s.k_chunks + kc);
        }
      }
      // The copy engine wrote A through the generic proxy; the TMA loads that follow use the async proxy.
      asm volatile("fence.proxy.async.global;" ::: "memory");
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
