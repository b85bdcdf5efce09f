// The split GEMM+RS transport's ping-pong kernel, with a tail split (torch-free).
//
// CUTLASS's sm90 ping-pong kernel (two math warp groups take turns: one's MMAs while the other runs its epilogue)
// runs every tile's whole K loop.  Its pipeline positions rest on that: each warp advances by the problem's K tiles
// per tile, and the second math warp group starts one tile's K loop behind the first.  So a partial last wave, which
// the cooperative kernel splits along K over the idle clusters (ag_gemm/scheduler.cuh: the tail split), stays whole
// there: at 4096 x 4096 x 8192 per rank the transport's two GEMMs of 128 x 192 tiles are 10.4 waves of work that end
// after 11 (docs/design_gemm_rs.md).
//
// PingpongTailSplit is that kernel with work units of any K length.  The tile-order scheduler hands the partial last
// wave's tiles out as K parts, and every warp walks the CTA's units in turn, advancing its pipeline positions by what
// each unit takes: its K tiles (the mainloop), and for a unit that stores (a whole tile or a split tile's last part)
// one tile of the epilogue's load and store pipelines.  A math warp group holds a whole tile, so a part but the last
// leaves its fp32 accumulators in one scratch slot (fixup_whole_tile) and runs no epilogue: the epilogue's producer
// warp loads no C for it, and the warp group still takes its turn at the order barrier.  The last part of a tile (its
// highest unit, so every part it waits for is an earlier unit on another cluster) adds them and stores.
//
// Base: the GemmUniversal of a ping-pong mainloop with the tile-order scheduler (AllGatherTileScheduler, static
// persistent); everything but the device code is Base's.
#pragma once

#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/arch/grid_dependency_control.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/pipeline/pipeline.hpp"

namespace fluxinductor::gemm_rs_split {

template <class Base>
class PingpongTailSplit : public Base {
 public:
  using Params = typename Base::Params;
  using TileScheduler = typename Base::TileScheduler;
  static_assert(std::is_base_of_v<cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                  typename Base::DispatchPolicy::Schedule>,
                "PingpongTailSplit takes a ping-pong GemmUniversal");
  static_assert(!Base::IsSchedDynamicPersistent && !Base::IsMainloopAuxiliaryLoadNeeded,
                "PingpongTailSplit walks a static tile order with one mainloop producer warp");

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace cute;
    using CollectiveMainloop = typename Base::CollectiveMainloop;
    using CollectiveEpilogue = typename Base::CollectiveEpilogue;
    using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
    using EpiLoadPipeline = typename CollectiveEpilogue::LoadPipeline;
    using EpiStorePipeline = typename CollectiveEpilogue::StorePipeline;
    using ClusterShape = typename Base::ClusterShape;
    using TileShape = typename Base::TileShape;
    constexpr int kGroupThreads = int(cutlass::NumThreadsPerWarpGroup);
    constexpr int kMainloopWarp = 0;  // of the producer warp group
    constexpr int kEpilogueWarp = 2;

    auto& shared = *reinterpret_cast<typename Base::SharedStorage*>(smem_buf);
    int const warp = cutlass::canonical_warp_idx_sync();
    int const warp_in_group = warp % int(cutlass::NumWarpsPerWarpGroup);
    int const group = cutlass::canonical_warp_group_idx();  // 0: producers, 1 and 2: the math warp groups
    int const group_thread = int(threadIdx.x) % kGroupThreads;
    int const lane = cutlass::canonical_lane_idx();
    uint32_t const block_rank_in_cluster = cute::block_rank_in_cluster();
    bool const is_producer = group == 0;
    bool const is_mainloop_warp = is_producer && warp_in_group == kMainloopWarp;

    if (warp == 0 && cute::elect_one_sync()) {
      CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);
      CollectiveEpilogue::prefetch_tma_descriptors(params.epilogue);
    }

    typename MainloopPipeline::Params mainloop_params;
    if (is_mainloop_warp) {
      mainloop_params.role = MainloopPipeline::ThreadCategory::Producer;
    }
    if (!is_producer) {
      mainloop_params.role = MainloopPipeline::ThreadCategory::Consumer;
    }
    mainloop_params.is_leader = group_thread == 0;
    mainloop_params.num_consumers = kGroupThreads;
    mainloop_params.num_producers = Base::NumProducerThreads;
    mainloop_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline mainloop_pipeline(shared.pipelines.mainloop, mainloop_params, ClusterShape{});

    typename EpiLoadPipeline::Params epi_load_params;
    if (is_producer && warp_in_group == kEpilogueWarp) {
      epi_load_params.role = EpiLoadPipeline::ThreadCategory::Producer;
    }
    if (!is_producer) {
      epi_load_params.role = EpiLoadPipeline::ThreadCategory::Consumer;
    }
    epi_load_params.dst_blockid = block_rank_in_cluster;
    epi_load_params.producer_arv_count = cutlass::NumThreadsPerWarp;
    epi_load_params.consumer_arv_count = kGroupThreads;
    if constexpr (CollectiveEpilogue::RequiresTransactionBytes) {
      epi_load_params.transaction_bytes = params.epilogue.tma_transaction_bytes;
    }
    EpiLoadPipeline epi_load_pipeline(shared.pipelines.epi_load, epi_load_params);

    typename EpiStorePipeline::Params epi_store_params;
    epi_store_params.always_wait = true;
    EpiStorePipeline epi_store_pipeline(epi_store_params);

    // The mainloop's producer warp lets the epilogue's start loading C after the first tile's loads are issued.
    typename Base::LoadWarpOrderBarrier::Params load_order_params;
    load_order_params.group_id = warp_in_group == kMainloopWarp ? 0 : 1;
    load_order_params.group_size = cutlass::NumThreadsPerWarp;
    typename Base::LoadWarpOrderBarrier load_order(shared.pipelines.load_order, load_order_params);

    // The math warp groups take turns: 0's MMAs, 1's MMAs, 0's epilogue, 1's epilogue, ...
    typename Base::MathWarpGroupOrderBarrier::Params math_order_params;
    math_order_params.group_id = group - 1;
    math_order_params.group_size = kGroupThreads;
    typename Base::MathWarpGroupOrderBarrier math_order(shared.pipelines.math_wg_order, math_order_params);

    typename CollectiveMainloop::PipelineState mainloop_read;
    typename CollectiveEpilogue::LoadPipelineState epi_load_read;
    auto mainloop_write = cutlass::make_producer_start_state<MainloopPipeline>();
    auto epi_load_write = cutlass::make_producer_start_state<EpiLoadPipeline>();
    auto epi_store_write = cutlass::make_producer_start_state<EpiStorePipeline>();

    // The pipelines' barriers must be initialized in every CTA of the cluster before any CTA uses them.
    if constexpr (size(ClusterShape{}) > 1) {
      cute::cluster_arrive_relaxed();
    } else {
      __syncthreads();
    }

    auto const problem_mnkl = append<4>(params.problem_shape, Int<1>{});
    typename Base::TiledMma tiled_mma;
    auto const tile_shape = TileShape{};
    CollectiveMainloop collective_mainloop;
    CollectiveEpilogue collective_epilogue(params.epilogue, shared.tensors.epilogue);
    auto load_inputs = collective_mainloop.load_init(problem_mnkl, params.mainloop);
    Tensor gA_mkl = get<0>(load_inputs);
    Tensor gB_nkl = get<1>(load_inputs);
    int const epi_load_tiles = CollectiveEpilogue::get_load_pipe_increment(tile_shape);
    int const epi_store_tiles = CollectiveEpilogue::get_store_pipe_increment(tile_shape);
    auto block_coord = [&](auto const& work) {
      return make_coord(idx2crd(work.M_idx, shape<2>(gA_mkl)), idx2crd(work.N_idx, shape<2>(gB_nkl)), _,
                        idx2crd(work.L_idx, shape<4>(gB_nkl)));
    };
    auto k_tiles = [&](auto const& work) {
      return int(TileScheduler::get_work_k_tile_count(work, problem_mnkl, tile_shape));
    };

    TileScheduler scheduler{params.scheduler};
    auto work = scheduler.initial_work_tile_info(ClusterShape{});

    if constexpr (size(ClusterShape{}) > 1) {
      cute::cluster_wait();
    }

    if (is_producer) {
      cutlass::arch::warpgroup_reg_dealloc<Base::LoadRegisterRequirement>();
      if (is_mainloop_warp) {
        cutlass::arch::wait_on_dependent_grids();
        bool first = true;
        while (work.is_valid()) {
          int const count = k_tiles(work);
          auto k_tile_iter =
              make_coord_iterator(idx2crd(int(TileScheduler::get_work_k_tile_start(work)), shape<3>(gA_mkl)),
                                  shape<3>(gA_mkl));
          collective_mainloop.load(params.mainloop, mainloop_pipeline, mainloop_write, load_inputs,
                                   block_coord(work), k_tile_iter, count, lane, block_rank_in_cluster,
                                   shared.tensors.mainloop);
          mainloop_write.advance(count);
          if (first) {
            load_order.arrive();
            first = false;
          }
          scheduler.advance_to_next_work();
          work = scheduler.get_current_work();
        }
        collective_mainloop.load_tail(mainloop_pipeline, mainloop_write);
      } else if (warp_in_group == kEpilogueWarp && collective_epilogue.is_producer_load_needed()) {
        cutlass::arch::wait_on_dependent_grids();
        bool first = true;
        while (work.is_valid()) {
          if (first) {
            load_order.wait();
            first = false;
          }
          if (TileScheduler::compute_epilogue(work, params.scheduler)) {
            epi_load_write = collective_epilogue.load(epi_load_pipeline, epi_load_write, problem_mnkl, tile_shape,
                                                      block_coord(work), tiled_mma, lane, shared.tensors.epilogue);
          }
          scheduler.advance_to_next_work();
          work = scheduler.get_current_work();
        }
        collective_epilogue.load_tail(epi_load_pipeline, epi_load_write);
      }
      return;
    }

    cutlass::arch::warpgroup_reg_alloc<Base::MmaRegisterRequirement>();
    int const consumer = group - 1;
#if defined(CUTLASS_ENABLE_GDC_FOR_SM90)
    if (!work.is_valid()) {
      cutlass::arch::launch_dependent_grids();
      return;
    }
#endif
    // Steps the read positions past a unit the other math warp group runs.
    auto pass_over = [&](auto const& other) {
      if (!other.is_valid()) {
        return;
      }
      mainloop_read.advance(k_tiles(other));
      if (TileScheduler::compute_epilogue(other, params.scheduler)) {
        epi_load_read.advance(epi_load_tiles);
        epi_store_write.advance(epi_store_tiles);
      }
    };
    if (consumer == 1) {  // the CTA's second unit: after the first one's
      pass_over(work);
      scheduler.advance_to_next_work();
      work = scheduler.get_current_work();
    }
    while (work.is_valid()) {
      int const count = k_tiles(work);
      Tensor accumulators = partition_fragment_C(tiled_mma, take<0, 2>(tile_shape));
      math_order.wait();
      collective_mainloop.mma(mainloop_pipeline, mainloop_read, accumulators, count, group_thread,
                              shared.tensors.mainloop, params.mainloop);
      math_order.arrive();
      collective_mainloop.mma_tail(mainloop_pipeline, mainloop_read, count);
      mainloop_read.advance(count);
#if defined(CUTLASS_ENABLE_GDC_FOR_SM90)
      if (scheduler.is_last_tile(work, Base::NumMmaWarpGroups)) {
        cutlass::arch::launch_dependent_grids();
      }
#endif
      TileScheduler::fixup_whole_tile(params.scheduler, work, accumulators, uint32_t(consumer));
      bool const stores = TileScheduler::compute_epilogue(work, params.scheduler);
      math_order.wait();
      if (stores) {
        auto [load_next, store_next] =
            collective_epilogue.store(epi_load_pipeline, epi_load_read, epi_store_pipeline, epi_store_write,
                                      problem_mnkl, tile_shape, block_coord(work), accumulators, tiled_mma,
                                      group_thread, shared.tensors.epilogue);
        // The stores must have left shared memory before the other warp group's epilogue reuses it.
        auto [load_after, store_after] =
            collective_epilogue.store_tail(epi_load_pipeline, load_next, epi_store_pipeline, store_next);
        epi_load_read = load_after;
        epi_store_write = store_after;
      }
      math_order.arrive();
      scheduler.advance_to_next_work();
      pass_over(scheduler.get_current_work());
      scheduler.advance_to_next_work();
      work = scheduler.get_current_work();
    }
#else
    if (threadIdx.x == 0 && blockIdx.x == 0) {
      printf("PingpongTailSplit needs sm90a\n");
    }
#endif
  }
};

}  // namespace fluxinductor::gemm_rs_split
