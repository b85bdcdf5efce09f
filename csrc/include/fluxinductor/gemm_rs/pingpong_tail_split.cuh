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
// Units are handed out in the tile order either statically (cluster c takes units c, c + clusters, ...) or, where the
// schedule has claim counters, as the clusters free: a split GEMM+RS pair's second GEMM takes the SMs its first GEMM
// leaves one by one, so a static order gives the late clusters as many units as the early ones and the pair ends one
// tile late.  Then the mainloop producer of the cluster's first CTA claims each unit (an atomic on claim[0]) and
// publishes it in a ring in both CTAs' shared memory; every warp that walks the units (the mainloop and epilogue
// producers, the math warps) reads the ring in order and frees the entry.  The last cluster to find the units gone
// sets the counters back to 0 for the next launch.
//
// Base: the GemmUniversal of a ping-pong mainloop with the tile-order scheduler (AllGatherTileScheduler, static
// persistent); everything but the device code is Base's, and its shared memory is followed by the ring.
#pragma once

#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/arch/grid_dependency_control.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/pipeline/pipeline.hpp"

namespace fluxinductor::gemm_rs_split {

namespace claims {

CUTLASS_DEVICE uint32_t remote_address(void const* local, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(cute::cast_smem_ptr_to_uint(local)), "r"(cta));
  return remote;
}

// Waits for the mbarrier's phase of this parity to complete, acquiring at cluster scope (the ring's entries are
// written by the cluster's first CTA).
CUTLASS_DEVICE void wait(uint64_t const* barrier, uint32_t parity) {
  uint32_t const address = cute::cast_smem_ptr_to_uint(barrier);
  asm volatile(
      "{\n\t.reg .pred done;\n\t"
      "WAIT:\n\t"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra WAIT;\n\t}"
      ::"r"(address), "r"(parity) : "memory");
}

// One arrival on CTA `cta`'s copy of the barrier, releasing at cluster scope.
CUTLASS_DEVICE void arrive(uint64_t const* barrier, uint32_t cta) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote_address(barrier, cta))
               : "memory");
}

// One arrival on CTA `cta`'s copy of the barrier with the default semantics (as CUTLASS's pipelines free a stage): a
// reader's "entry read", whose value it already holds.
CUTLASS_DEVICE void arrive_freed(uint64_t const* barrier, uint32_t cta) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote_address(barrier, cta)) : "memory");
}

CUTLASS_DEVICE void store(uint32_t const* word, uint32_t cta, uint32_t value) {
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(remote_address(word, cta)), "r"(value) : "memory");
}

}  // namespace claims

template <class Base>
class PingpongTailSplit : public Base {
  // The claimed units' ring: deep enough that the producer, which runs ahead of the math warp groups by at most the
  // mainloop's stages (a unit has at least one K tile), never waits for an entry a slower reader still holds.
  static constexpr int kRing = 16;
  struct ClaimStorage {
    uint64_t full[kRing];   // per CTA: one arrival, the first CTA's publication
    uint64_t empty[kRing];  // the first CTA's: one arrival per reading warp of every CTA of the cluster
    uint32_t unit[kRing];
    uint32_t producer_reads;  // the first CTA's: entries its mainloop producer has read
  };
  static constexpr int kClaimOffset = (int(Base::SharedStorageSize) + 15) / 16 * 16;

 public:
  using Params = typename Base::Params;
  using TileScheduler = typename Base::TileScheduler;
  static constexpr int SharedStorageSize = kClaimOffset + int(sizeof(ClaimStorage));
  static_assert(SharedStorageSize <= 227 * 1024, "the claims' ring must fit beside the kernel's shared memory");
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

    auto& ring = *reinterpret_cast<ClaimStorage*>(smem_buf + kClaimOffset);
    ag_gemm::AllGatherSchedule const& schedule = params.scheduler.schedule;
    bool const dynamic = schedule.claim != nullptr;
    bool const loads_c = CollectiveEpilogue(params.epilogue, shared.tensors.epilogue).is_producer_load_needed();
    // Reading warps per CTA: the mainloop producer, the epilogue's (where it loads C), 4 per math warp group.
    uint32_t const readers = (1 + (loads_c ? 1 : 0) + 8) * uint32_t(size(ClusterShape{}));
    if (dynamic && warp == 0 && cute::elect_one_sync()) {
      for (int e = 0; e < kRing; ++e) {
        cutlass::arch::ClusterBarrier::init(&ring.full[e], 1);
        cutlass::arch::ClusterBarrier::init(&ring.empty[e], readers);
      }
      *reinterpret_cast<uint32_t volatile*>(&ring.producer_reads) = 0;
      __threadfence_block();
      cutlass::arch::fence_barrier_init();
    }

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
    uint32_t const first = scheduler.first_unit();
    uint32_t const clusters = scheduler.cluster_count();
    uint32_t const units = scheduler.unit_count();

    if constexpr (size(ClusterShape{}) > 1) {
      cute::cluster_wait();
    }

    // The CTA's i-th unit, read by a whole warp (each role walks i = 0, 1, ... and stops at the first past the
    // units).  Claimed: a warp of its own in the cluster's first CTA (the producer warp group's warp 1) claims each
    // entry and publishes it, at most two entries past the mainloop producer's reads, so a claim's round trip is off
    // every path that loads or computes.
    bool const claimer = dynamic && is_producer && warp_in_group == 1 && block_rank_in_cluster == 0;
    bool const counts_reads = dynamic && is_mainloop_warp && block_rank_in_cluster == 0;
    auto unit_of = [&](uint32_t i) -> uint32_t {
      if (!dynamic) {
        return first + i * clusters;
      }
      int const e = int(i % kRing);
      cutlass::arch::ClusterBarrier::wait(&ring.full[e], (i / kRing) & 1);  // CUTLASS's pipelines' wait
      uint32_t const unit = *reinterpret_cast<uint32_t const volatile*>(&ring.unit[e]);
      __syncwarp();
      if (lane == 0) {
        claims::arrive_freed(&ring.empty[e], 0);
        if (counts_reads) {
          *reinterpret_cast<uint32_t volatile*>(&ring.producer_reads) = i + 1;
        }
      }
      return unit;
    };

    if (is_producer) {
      cutlass::arch::warpgroup_reg_dealloc<Base::LoadRegisterRequirement>();
      if (is_mainloop_warp) {
        cutlass::arch::wait_on_dependent_grids();
        for (uint32_t i = 0;; ++i) {
          auto work = scheduler.work_at(unit_of(i));
          if (!work.is_valid()) {
            break;
          }
          int const count = k_tiles(work);
          auto k_tile_iter =
              make_coord_iterator(idx2crd(int(TileScheduler::get_work_k_tile_start(work)), shape<3>(gA_mkl)),
                                  shape<3>(gA_mkl));
          collective_mainloop.load(params.mainloop, mainloop_pipeline, mainloop_write, load_inputs,
                                   block_coord(work), k_tile_iter, count, lane, block_rank_in_cluster,
                                   shared.tensors.mainloop);
          mainloop_write.advance(count);
          if (i == 0) {
            load_order.arrive();
          }
        }
#if defined(CUTLASS_ENABLE_GDC_FOR_SM90)
        cutlass::arch::launch_dependent_grids();  // every unit is handed out
#endif
        collective_mainloop.load_tail(mainloop_pipeline, mainloop_write);
      } else if (claimer) {
        if (lane == 0) {
          uint32_t p = 0;
          for (;; ++p) {
            while (*reinterpret_cast<uint32_t const volatile*>(&ring.producer_reads) + 1 < p) {
              __nanosleep(128);  // off the math warps' issue slots
            }
            if (p >= uint32_t(kRing)) {
              claims::wait(&ring.empty[p % kRing], (p / kRing - 1) & 1);
            }
            uint32_t const unit = atomicAdd(schedule.claim, 1u);
            for (uint32_t cta = 0; cta < uint32_t(size(ClusterShape{})); ++cta) {
              claims::store(&ring.unit[p % kRing], cta, unit);
              claims::arrive(&ring.full[p % kRing], cta);
            }
            if (unit >= units) {
              break;
            }
          }
          // The last cluster to find the units gone: no claim comes after it, so the counters start at 0 next time.
          __threadfence();
          if (atomicAdd(schedule.claim + 1, 1u) == clusters - 1) {
            atomicExch(schedule.claim, 0u);
            atomicExch(schedule.claim + 1, 0u);
          }
          // The other CTA's warps arrive on this CTA's barriers: it stays until the last of them, on this entry.
          claims::wait(&ring.empty[p % kRing], (p / kRing) & 1);
        }
        __syncwarp();
      } else if (warp_in_group == kEpilogueWarp && loads_c) {
        cutlass::arch::wait_on_dependent_grids();
        for (uint32_t i = 0;; ++i) {
          auto work = scheduler.work_at(unit_of(i));
          if (!work.is_valid()) {
            break;
          }
          if (i == 0) {
            load_order.wait();
          }
          if (TileScheduler::compute_epilogue(work, params.scheduler)) {
            epi_load_write = collective_epilogue.load(epi_load_pipeline, epi_load_write, problem_mnkl, tile_shape,
                                                      block_coord(work), tiled_mma, lane, shared.tensors.epilogue);
          }
        }
        collective_epilogue.load_tail(epi_load_pipeline, epi_load_write);
      }
      return;
    }

    cutlass::arch::warpgroup_reg_alloc<Base::MmaRegisterRequirement>();
    int const consumer = group - 1;
    // Steps the read positions past a unit the other math warp group runs.
    auto pass_over = [&](auto const& other) {
      mainloop_read.advance(k_tiles(other));
      if (TileScheduler::compute_epilogue(other, params.scheduler)) {
        epi_load_read.advance(epi_load_tiles);
        epi_store_write.advance(epi_store_tiles);
      }
    };
    // The math warp groups take the CTA's units in turn: 0 the even ones, 1 the odd ones.
    for (uint32_t i = 0;; ++i) {
      auto work = scheduler.work_at(unit_of(i));
      if (!work.is_valid()) {
        break;
      }
      if (int(i & 1) != consumer) {
        pass_over(work);
        continue;
      }
      int const count = k_tiles(work);
      Tensor accumulators = partition_fragment_C(tiled_mma, take<0, 2>(tile_shape));
      math_order.wait();
      collective_mainloop.mma(mainloop_pipeline, mainloop_read, accumulators, count, group_thread,
                              shared.tensors.mainloop, params.mainloop);
      math_order.arrive();
      collective_mainloop.mma_tail(mainloop_pipeline, mainloop_read, count);
      mainloop_read.advance(count);
#if defined(CUTLASS_ENABLE_GDC_FOR_SM90)
      if (!dynamic && first + (i + 2) * clusters >= units) {  // this warp group's last unit
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
    }
#if defined(CUTLASS_ENABLE_GDC_FOR_SM90)
    cutlass::arch::launch_dependent_grids();
#endif
#else
    if (threadIdx.x == 0 && blockIdx.x == 0) {
      printf("PingpongTailSplit needs sm90a\n");
    }
#endif
  }
};

}  // namespace fluxinductor::gemm_rs_split
