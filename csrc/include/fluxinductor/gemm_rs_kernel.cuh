// GEMM + reduce-scatter building blocks (CUTLASS 3.x, sm90a), free of torch headers.
//
//  * RotatedTileSchedulerSm90: the stock persistent scheduler with the batch (L) index rotated, so that a
//    rank walks the row segments of its peers first and its own segment last.  The GEMM is batched over
//    L = world segments of M/world rows (A's batch stride is a segment, B's is 0), so no tile straddles
//    two owners.
//  * GemmRsEpilogue: a register-to-global epilogue (no shared memory).  A peer's tile goes straight into
//    that peer's symmetric buffer (slot = this rank), then each warp publishes a flag = epoch with
//    release semantics at system scope.  An own tile waits for the same warp's flag of every peer
//    (acquire), adds the peers' slots, the bias and the scale, and writes the output.
//  * gemm_rs_hello_kernel: the per-call handshake that makes buffer reuse race-free and catches ranks
//    that disagree on the problem.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/numeric_types.h"

namespace fluxinductor {

constexpr int kRsMaxWorld = 8;
constexpr uint32_t kRsAborted = 0xFFFFFFFFu;

// Header layout of a symmetric buffer (byte offsets), mirrored in csrc/gemm_rs.h and gemm_rs.py.
constexpr int64_t kRsHelloOffset = 0;
constexpr int64_t kRsSignatureOffset = 256;
constexpr int64_t kRsStatusOffset = 512;

// ---------------------------------------------------------------------------------------------------
// Flag primitives (system scope: the writer may be a peer GPU across NVLink).
// ---------------------------------------------------------------------------------------------------

CUTLASS_DEVICE uint32_t rs_load_acquire(uint32_t const* ptr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

CUTLASS_DEVICE void rs_store_release(uint32_t* ptr, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

CUTLASS_DEVICE uint32_t rs_load_volatile(uint32_t const* ptr) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

CUTLASS_DEVICE uint64_t rs_globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

CUTLASS_DEVICE void rs_raise(int32_t* error, uint32_t* status, int32_t code) {
  if (error != nullptr) {
    *reinterpret_cast<int32_t volatile*>(error) = code;
  }
  atomicExch(status, kRsAborted);
}

// Spins until *flag == epoch.  Returns false on timeout (after raising) or when the call was aborted.
CUTLASS_DEVICE bool rs_wait_flag(uint32_t const* flag, uint32_t epoch, uint32_t* status, int32_t* error,
                                 int64_t timeout_ns, int32_t code) {
  uint64_t start = 0;
  for (uint32_t spin = 0;; ++spin) {
    if (rs_load_acquire(flag) == epoch) {
      return true;
    }
    if ((spin & 63u) == 63u) {
      if (rs_load_volatile(status) == kRsAborted) {
        return false;
      }
      uint64_t now = rs_globaltimer();
      if (start == 0) {
        start = now;
      } else if (int64_t(now - start) > timeout_ns) {
        rs_raise(error, status, code);
        return false;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Per-call handshake: every rank tells every peer "I am in call `epoch` with problem `signature`" and
// waits until all peers said the same.  A rank only reaches call e after its call e-1 (whose epilogue
// read its slots) finished, so once this returns no peer can still be reading what we are about to write.
// ---------------------------------------------------------------------------------------------------

struct RsHelloParams {
  char* buffers[kRsMaxWorld];  // every rank's buffer base
  int world;
  int rank;
  uint32_t epoch;
  uint64_t signature;
  int32_t* error;
  int64_t timeout_ns;
};

__global__ void gemm_rs_hello_kernel(RsHelloParams p) {
  int const peer = threadIdx.x;
  bool const is_peer = peer < p.world && peer != p.rank;
  char* local = p.buffers[p.rank];
  auto* local_hello = reinterpret_cast<uint32_t*>(local + kRsHelloOffset);
  auto* local_sig = reinterpret_cast<uint64_t volatile*>(local + kRsSignatureOffset);
  auto* status = reinterpret_cast<uint32_t*>(local + kRsStatusOffset);
  if (is_peer) {
    char* remote = p.buffers[peer];
    reinterpret_cast<uint64_t volatile*>(remote + kRsSignatureOffset)[p.rank] = p.signature;
    rs_store_release(reinterpret_cast<uint32_t*>(remote + kRsHelloOffset) + p.rank, p.epoch);
  }
  bool ok = true;
  if (is_peer) {
    uint64_t const start = rs_globaltimer();
    while (rs_load_acquire(local_hello + peer) != p.epoch) {
      if (int64_t(rs_globaltimer() - start) > p.timeout_ns) {
        ok = false;
        if (p.error != nullptr) {
          *reinterpret_cast<int32_t volatile*>(p.error) = 1;  // kGemmRsHelloTimeout
        }
        break;
      }
    }
    if (ok && local_sig[peer] != p.signature) {
      ok = false;
      if (p.error != nullptr) {
        *reinterpret_cast<int32_t volatile*>(p.error) = 2;  // kGemmRsSignatureMismatch
      }
    }
  }
  ok = __syncthreads_and(ok);
  if (threadIdx.x == 0) {
    *reinterpret_cast<uint32_t volatile*>(status) = ok ? p.epoch : kRsAborted;
  }
}

// ---------------------------------------------------------------------------------------------------
// Tile scheduler: PersistentTileSchedulerSm90 with L rotated by `rotate_l`.
// ---------------------------------------------------------------------------------------------------

struct RotatedPersistentScheduler {};  // tag for GemmUniversal's TileSchedulerTag

class RotatedTileSchedulerSm90 : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    int rotate_l = 0;
  };
  struct Params : Base::Params {
    int32_t rotate_l = 0;
    int32_t batches = 1;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& arguments, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params params;
    static_cast<Base::Params&>(params) =
        Base::to_underlying_arguments(problem_shape_mnkl, tile_shape, cluster_shape, hw_info, arguments, workspace,
                                      epilogue_subtile, ktile_start_alignment_count);
    params.batches = int32_t(cute::get<3>(problem_shape_mnkl));
    params.rotate_l = arguments.rotate_l % params.batches;
    return params;
  }

  CUTLASS_HOST_DEVICE RotatedTileSchedulerSm90() {}

  CUTLASS_DEVICE explicit RotatedTileSchedulerSm90(Params const& params)
      : Base(params), rotate_l_(params.rotate_l), batches_(params.batches) {}

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return rotate(Base::get_current_work()); }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info) {
    if (continue_current_work(work_tile_info)) {
      return cute::make_tuple(work_tile_info, true);
    }
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&,
                                      TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

 private:
  CUTLASS_DEVICE WorkTileInfo rotate(WorkTileInfo work) const {
    if (work.is_valid()) {
      int32_t l = work.L_idx + rotate_l_;
      work.L_idx = l >= batches_ ? l - batches_ : l;
    }
    return work;
  }

  int32_t rotate_l_ = 0;
  int32_t batches_ = 1;
};

// ---------------------------------------------------------------------------------------------------
// Epilogue.
// ---------------------------------------------------------------------------------------------------

template <class Element>
struct GemmRsEpilogueArguments {
  char* buffers[kRsMaxWorld] = {};  // every rank's symmetric buffer base (as mapped on this rank)
  int64_t flags_offset = 0;         // bytes into a buffer
  int64_t data_offset = 0;          // bytes into a buffer
  int world = 1;
  int rank = 0;
  int tiles_m = 0;                  // tiles per segment along M
  int tiles_n = 0;
  uint32_t epoch = 0;
  Element const* bias = nullptr;    // [N] or null
  Element* out = nullptr;           // [M/world, N]
  int64_t ldo = 0;
  float out_scale = 1.f;
  int32_t* error = nullptr;
  int64_t timeout_ns = 0;
  uint32_t* local_status = nullptr;  // null when world == 1
};

template <class Element_, int WarpsPerTile_>
class GemmRsEpilogue {
 public:
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementOutput = Element_;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using ElementC = Element_;
  using ElementD = Element_;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  static constexpr int kWarpsPerTile = WarpsPerTile_;
  // Named for GemmUniversalAdapter's typedefs only; the arithmetic is in operator() below.
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<Element_, 1, float, float>;

  struct SharedStorage {};
  using TensorStorage = SharedStorage;
  using Arguments = GemmRsEpilogueArguments<Element_>;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.out != nullptr && args.world >= 1 && args.world <= kRsMaxWorld;
  }

  CUTLASS_HOST_DEVICE GemmRsEpilogue(Params const& params, SharedStorage const& = SharedStorage()) : p_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    int const M = int(get<0>(problem_shape_mnkl));  // rows per segment
    int const N = int(get<1>(problem_shape_mnkl));
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    int const segment = int(l_coord);

    Tensor coord_mn = make_identity_tensor(make_shape(M, N));
    Tensor tile_coord = local_tile(coord_mn, take<0, 2>(blk_shape_MNK), make_coord(m_coord, n_coord));
    if (get<0>(tile_coord(0)) >= M || get<1>(tile_coord(0)) >= N) {
      return;  // padding tile of the cluster rounding: no data, no flag
    }
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor thr_coord = thr_mma.partition_C(tile_coord);  // (m, n) of each accumulator
    static_assert(decltype(size(thr_coord))::value == decltype(size(accumulators))::value);
    static_assert(decltype(size(accumulators))::value % 2 == 0);

    int const warp = thread_idx / 32;
    int const lane = thread_idx % 32;
    bool const own = segment == p_.rank;
    bool const comm = p_.world > 1;
    // Pairs of accumulators are adjacent columns starting at an even column (the GMMA C layout); a pair is
    // moved as one 32-bit word when rows keep that alignment.
    bool const pairs = (N % 2 == 0) && (p_.ldo % 2 == 0);
    int64_t const tile_flag = ((int64_t(m_coord) * p_.tiles_n + int64_t(n_coord)) * kWarpsPerTile) + warp;
    int64_t const slot_elems = int64_t(M) * N;

    ElementD* dst;
    int64_t ld;
    bool active = true;  // false once the call was aborted: compute, but touch no peer memory
    if (comm) {
      active = rs_load_volatile(p_.local_status) == p_.epoch;
    }
    if (own || !comm) {
      dst = p_.out;
      ld = p_.ldo;
    } else {
      dst = reinterpret_cast<ElementD*>(p_.buffers[segment] + p_.data_offset) + int64_t(p_.rank) * slot_elems;
      ld = N;
      if (!active) {
        return;
      }
    }

    // Own tile: wait until every peer's same warp delivered its part of this tile.
    ElementD const* peer_slots = nullptr;
    if (own && comm) {
      char* local = p_.buffers[p_.rank];
      auto const* flags = reinterpret_cast<uint32_t const*>(local + p_.flags_offset);
      int64_t const flags_per_src = int64_t(p_.tiles_m) * p_.tiles_n * kWarpsPerTile;
      bool ok = active;
      if (lane == 0 && ok) {
        for (int q = 0; q < p_.world && ok; ++q) {
          if (q != p_.rank) {
            ok = rs_wait_flag(flags + int64_t(q) * flags_per_src + tile_flag, p_.epoch, p_.local_status, p_.error,
                              p_.timeout_ns, 3 /* kGemmRsTileTimeout */);
          }
        }
      }
      ok = __shfl_sync(0xffffffffu, ok, 0);
      __syncwarp();  // orders every lane's reads of the slots after lane 0's acquire
      if (ok) {
        peer_slots = reinterpret_cast<ElementD const*>(local + p_.data_offset);
      }
    }

    float const scale = (own || !comm) ? p_.out_scale : 1.f;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accumulators); i += 2) {
      int const row = get<0>(thr_coord(i));
      int const col = get<1>(thr_coord(i));
      if (row >= M) {
        continue;
      }
      bool const in0 = col < N;
      bool const in1 = col + 1 < N;
      float v0 = accumulators(i);
      float v1 = accumulators(i + 1);
      if (p_.bias != nullptr) {
        if (in0) v0 += float(p_.bias[col]);
        if (in1) v1 += float(p_.bias[col + 1]);
      }
      if (peer_slots != nullptr) {
        for (int q = 0; q < p_.world; ++q) {
          if (q == p_.rank) continue;
          ElementD const* src = peer_slots + int64_t(q) * slot_elems + int64_t(row) * N + col;
          if (pairs && in1) {
            uint32_t word = __ldcg(reinterpret_cast<unsigned int const*>(src));
            cutlass::Array<ElementD, 2> two = reinterpret_cast<cutlass::Array<ElementD, 2> const&>(word);
            v0 += float(two[0]);
            v1 += float(two[1]);
          } else {
            if (in0) v0 += float(load_cg(src));
            if (in1) v1 += float(load_cg(src + 1));
          }
        }
      }
      v0 *= scale;
      v1 *= scale;
      ElementD* d = dst + int64_t(row) * ld + col;
      if (pairs && in1) {
        cutlass::Array<ElementD, 2> two;
        two[0] = ElementD(v0);
        two[1] = ElementD(v1);
        *reinterpret_cast<uint32_t*>(d) = reinterpret_cast<uint32_t const&>(two);
      } else {
        if (in0) d[0] = ElementD(v0);
        if (in1) d[1] = ElementD(v1);
      }
    }

    if (!own && comm) {
      // Publish: this warp's stores of this tile are complete at system scope before the flag is.
      __syncwarp();
      if (lane == 0) {
        auto* flags = reinterpret_cast<uint32_t*>(p_.buffers[segment] + p_.flags_offset);
        int64_t const flags_per_src = int64_t(p_.tiles_m) * p_.tiles_n * kWarpsPerTile;
        __threadfence_system();
        rs_store_release(flags + int64_t(p_.rank) * flags_per_src + tile_flag, p_.epoch);
      }
    }
  }

 private:
  CUTLASS_DEVICE static ElementD load_cg(ElementD const* ptr) {
    uint16_t bits = __ldcg(reinterpret_cast<unsigned short const*>(ptr));
    return reinterpret_cast<ElementD const&>(bits);
  }

  Params p_;
};

}  // namespace fluxinductor

// GemmUniversal picks its scheduler through this selector; map our tag to the rotated scheduler.
namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount,
          class ProblemShapeType>
struct TileSchedulerSelector<fluxinductor::RotatedPersistentScheduler, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount, ProblemShapeType> {
  using Scheduler = fluxinductor::RotatedTileSchedulerSm90;
};
}  // namespace cutlass::gemm::kernel::detail
