// GEMM + reduce-scatter building blocks (CUTLASS 3.x, sm90a), free of torch headers.
//
//  * RotatedTileSchedulerSm90: the stock persistent scheduler with the batch (L) index rotated, so that a
//    rank walks the row segments of its peers first and its own segment last.  The GEMM is batched over
//    L = world segments of M/world rows (A's batch stride is a segment, B's is 0), so no tile straddles
//    two owners.
//  * GemmRsEpilogue: accumulators (+ bias) are staged in shared memory, a column subtile at a time, then
//    written with 16-byte accesses.  A peer's tile goes straight into that peer's symmetric buffer (slot = this
//    rank) over NVLink, then one flag = epoch is published with release semantics at system scope.  An own
//    tile waits for every peer's flag of that tile (acquire), adds the peers' slots, scales, and writes the
//    output.  With AsyncPush the peer tile leaves shared memory by bulk copies (cp.async.bulk, the TMA unit)
//    and its flag is published at the start of the next epilogue or in store_tail, once the copies landed,
//    so the math warps never wait on NVLink (for the cooperative kernel, whose epilogue stalls both).
//    Copy-engine mode (outbox != null): a peer's tile is written to this rank's local outbox instead, and
//    the tile is counted per (segment, band of tile rows); the launcher's copy stream waits for a band's
//    count, copies the band into the owner's slot and then raises the owner's flag of (this rank, band),
//    so NVLink carries the data without SMs and own tiles wait per band instead of per tile.
//  * gemm_rs_hello_kernel: the per-call handshake that makes buffer reuse race-free and catches ranks
//    that disagree on the problem.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/arch/barrier.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/numeric_types.h"
#include "fluxinductor/common/stop_context.cuh"

namespace fluxinductor {

constexpr int kRsMaxWorld = 8;
constexpr uint32_t kRsAborted = 0xFFFFFFFFu;

// Header layout of a symmetric buffer (byte offsets), mirrored in csrc/gemm_rs/gemm_rs.h and gemm_rs.py.
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

// Bulk (TMA-unit) copies shared -> global, tracked by this thread's bulk async-groups.
CUTLASS_DEVICE void rs_bulk_copy_s2g(void* gmem, void const* smem, uint32_t bytes) {
  uint32_t const src = cute::cast_smem_ptr_to_uint(smem);
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem), "r"(src), "r"(bytes)
               : "memory");
}
CUTLASS_DEVICE void rs_bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// The shared-memory sources of every committed copy have been read (the staging tile may be reused).
CUTLASS_DEVICE void rs_bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Every committed copy has been written; the fence orders those async-proxy writes before this thread's
// later generic-proxy operations (the flag release).
CUTLASS_DEVICE void rs_bulk_wait_written() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
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
  // A call captured in a CUDA graph (its epoch is one constant on every replay): set each hello word back to 0 once
  // seen (a peer writes its next one only after its own segment's epilogue read the tiles this rank sends after this
  // kernel, so the reset cannot erase it), and trap on a timeout or a disagreement, which no host code would raise.
  bool capture;
};

__global__ void gemm_rs_hello_kernel(RsHelloParams p) {
  // The GEMM launched next may start now (a programmatic dependent, stores transport): its mainloop reads nothing of
  // ours, and its epilogue waits for this grid (griddepcontrol.wait) before it reads the status or touches a peer.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
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
    if (ok && p.capture) {
      rs_store_release(local_hello + peer, 0u);
    }
  }
  ok = __syncthreads_and(ok);
  if (threadIdx.x == 0) {
    *reinterpret_cast<uint32_t volatile*>(status) = ok ? p.epoch : kRsAborted;
  }
  if (!ok && p.capture) {
    stop_context(1);
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

// ElementOut: the type of `out` (the own segment's reduced rows); peer slots, the outbox and the bias are Element.
// float with bf16 or fp16 operands: the partials cross in the operands' dtype and their sum is stored in fp32, as a
// half-precision matmul cast to fp32 and then reduced (autocast) computes it.
template <class Element, class ElementOut = Element>
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
  ElementOut* out = nullptr;        // [M/world, N]
  int64_t ldo = 0;
  float out_scale = 1.f;
  int32_t* error = nullptr;
  int64_t timeout_ns = 0;
  bool trap_on_timeout = false;      // a call in a CUDA graph: trap where a tile never came (see RsHelloParams)
  uint32_t* local_status = nullptr;  // null when world == 1
  // Copy-engine mode: peer tiles go to outbox [world][M/world][N] (this rank's memory), and each one adds 1
  // to counters[segment * bands + band] once stored; flags are then per (source rank, band).
  Element* outbox = nullptr;
  uint32_t* counters = nullptr;
  int band_tile_rows = 1;           // tile rows per band
  int bands = 1;                    // bands per segment: ceil(tiles_m / band_tile_rows)
};

// Threads_: the threads that share one output tile in the epilogue (256 for the cooperative kernel, whose two
// math warp groups split a tile; 128 for ping-pong, whose warp groups take alternate tiles and run their
// epilogues one after the other, so one staging tile in shared memory serves both).
//
// SubN_: columns staged at a time (the staging tile is TileM x SubN; less shared memory leaves more mainloop
// stages).  AsyncPush_: peer tiles leave by bulk copies and their flags are published late (see above).
template <int TileN>
constexpr int default_sub_n() {
  return TileN <= 128 ? TileN : (TileN % 128 == 0 ? 128 : TileN / 2);
}

template <class Element_, int TileM_, int TileN_, int Threads_, bool AsyncPush_ = false,
          int SubN_ = default_sub_n<TileN_>(), class ElementOut_ = Element_>
class GemmRsEpilogue {
 public:
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementOutput = ElementOut_;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using ElementC = Element_;
  using ElementD = ElementOut_;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  // Named for GemmUniversalAdapter's typedefs only; the arithmetic is in operator() below.
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<Element_, 1, float, float>;

  static constexpr int kTileM = TileM_;
  static constexpr int kTileN = TileN_;
  static constexpr int kThreads = Threads_;
  static constexpr bool kAsyncPush = AsyncPush_;
  static constexpr int kSubN = SubN_;                 // columns staged at a time
  static constexpr int kSplits = kTileN / kSubN;
  static constexpr int kPitch = kSubN + 8;            // elements: 16-byte rows, rows spread over the banks
  static constexpr int kVec = 16 / sizeof(Element_);  // elements per 16-byte access
  static constexpr int kChunksPerRow = kSubN / kVec;
  static_assert(kTileN % kSubN == 0 && kSubN % kVec == 0);
  static_assert(!kAsyncPush || kThreads >= 32);

  // The accumulators go through this tile so that every global access (local, or a peer's over NVLink) is a
  // 16-byte access of a warp-contiguous row segment.
  struct SharedStorage {
    alignas(128) Element_ tile[kTileM * kPitch];  // one column subtile
  };
  using TensorStorage = SharedStorage;
  using Arguments = GemmRsEpilogueArguments<Element_, ElementOut_>;
  using OutVec = cutlass::AlignedArray<ElementOut_, kVec, 16>;  // kVec outputs: one or two 16-byte stores
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
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char* smem_buf) {
    using namespace cute;
    static_assert(decltype(size<0>(BlockShapeMNK{}))::value == kTileM);
    static_assert(decltype(size<1>(BlockShapeMNK{}))::value == kTileN);
    // The handshake before this kernel may still run when it was launched as its programmatic dependent: nothing below
    // may read the status or touch a peer before it has finished (returns at once after the first tile, or when the
    // kernel was launched normally).
    if (p_.world > 1) {
      asm volatile("griddepcontrol.wait;" ::: "memory");
    }
    // 0. a peer tile pushed by the previous epilogue: publish its flag once its bulk copies landed.
    flush_pending();

    int const M = int(get<0>(problem_shape_mnkl));  // rows per segment
    int const N = int(get<1>(problem_shape_mnkl));
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    int const segment = int(l_coord);
    int const row0 = int(m_coord) * kTileM;
    int const col0 = int(n_coord) * kTileN;
    if (row0 >= M || col0 >= N) {
      return;  // padding tile of the cluster rounding: no data, no flag
    }
    int const rows = min(kTileM, M - row0);
    int const cols = min(kTileN, N - col0);
    Element_* stage = reinterpret_cast<SharedStorage*>(smem_buf)->tile;
    // Ping-pong: one barrier per math warp group (their epilogues are ordered anyway); cooperative: one.
    uint32_t const barrier_id = kThreads == 256 ? 0u : uint32_t(cutlass::canonical_warp_group_idx() & 1);
    auto tile_sync = [&] { cutlass::arch::NamedBarrier::sync(kThreads, barrier_id); };

    bool const own = segment == p_.rank;
    bool const comm = p_.world > 1;
    bool const copy_engine = comm && p_.outbox != nullptr;  // peer tiles go to the local outbox
    // false once the call was aborted: compute, but touch no peer memory.  Every thread still takes every
    // tile_sync below (another CTA may abort while this one is half-way through a tile).
    bool const active = !comm || rs_load_volatile(p_.local_status) == p_.epoch;

    Element_ const* peer_slots = nullptr;
    int64_t const slot_elems = int64_t(M) * N;
    int const band = int(m_coord) / p_.band_tile_rows;
    // Copy-engine mode: one flag per (source, band), raised by the source's copy stream.
    int64_t const tile_flag = copy_engine ? int64_t(band) : int64_t(m_coord) * p_.tiles_n + int64_t(n_coord);
    int64_t const flags_per_src = int64_t(p_.tiles_m) * p_.tiles_n;

    bool const to_out = own || !comm;  // this tile's rows are this rank's result: `out` (ElementOut_)
    Element_* dst = nullptr;           // else: a peer's slot or the outbox (Element_)
    ElementOut_* out = nullptr;
    int64_t ld;
    if (to_out) {
      out = p_.out;
      ld = p_.ldo;
    } else if (copy_engine) {
      dst = p_.outbox + int64_t(segment) * slot_elems;
      ld = N;
    } else {
      dst = reinterpret_cast<Element_*>(p_.buffers[segment] + p_.data_offset) + int64_t(p_.rank) * slot_elems;
      ld = N;
    }
    float const scale = to_out ? p_.out_scale : 1.f;
    bool const vec = (N % kVec == 0) && (ld % kVec == 0);
    bool const push = comm && !own && active && !copy_engine;  // this tile goes to a peer by SM stores
    bool const bulk = kAsyncPush && push && vec;  // ... by bulk copies (16-byte multiples and alignment)

    Tensor coord_mn = make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{}));
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor thr_coord = thr_mma.partition_C(coord_mn);  // (m, n) within the tile of each accumulator
    static_assert(decltype(size(thr_coord))::value == decltype(size(accumulators))::value);
    static_assert(decltype(size(accumulators))::value % 2 == 0);

    CUTLASS_PRAGMA_UNROLL
    for (int split = 0; split < kSplits; ++split) {
      int const sub0 = split * kSubN;  // first tile column of this subtile
      if (sub0 >= cols) {
        break;  // the same for every thread
      }
      // 1. accumulators (+ bias) of this subtile -> shared tile, rounded to the output type; an own tile's
      // thread 0 then waits for the peers' parts (2).
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accumulators); i += 2) {
        // Accumulators 2j and 2j+1 are adjacent columns of one row (GMMA C layout), starting at an even column.
        int const r = get<0>(thr_coord(i));
        int const c = get<1>(thr_coord(i));
        if constexpr (kSplits > 1) {
          if (c < sub0 || c >= sub0 + kSubN) {
            continue;
          }
        }
        float v0 = accumulators(i);
        float v1 = accumulators(i + 1);
        if (p_.bias != nullptr) {
          if (c < cols) v0 += float(p_.bias[col0 + c]);
          if (c + 1 < cols) v1 += float(p_.bias[col0 + c + 1]);
        }
        cutlass::Array<Element_, 2> two;
        two[0] = Element_(v0);
        two[1] = Element_(v1);
        *reinterpret_cast<cutlass::Array<Element_, 2>*>(stage + r * kPitch + (c - sub0)) = two;
      }
      if (bulk) {
        cutlass::arch::fence_view_async_shared();  // the bulk copies read through the async proxy
      }
      bool const first = split == 0;
      if (first && own && comm && thread_idx == 0 && active) {
        // own tile: wait (while the other threads stage) until every peer delivered its part of it.
        auto const* flags = reinterpret_cast<uint32_t const*>(p_.buffers[p_.rank] + p_.flags_offset);
        for (int q = 0; q < p_.world; ++q) {
          if (q != p_.rank &&
              !rs_wait_flag(flags + int64_t(q) * flags_per_src + tile_flag, p_.epoch, p_.local_status, p_.error,
                            p_.timeout_ns, 3 /* kGemmRsTileTimeout */)) {
            if (p_.trap_on_timeout) {
              stop_context(3 /* kGemmRsTileTimeout */);
            }
            break;
          }
        }
      }
      tile_sync();  // the shared subtile is complete, and thread 0's acquire orders the slot reads below
      if (first && own && comm && rs_load_volatile(p_.local_status) == p_.epoch) {
        peer_slots = reinterpret_cast<Element_ const*>(p_.buffers[p_.rank] + p_.data_offset);
      }

      // 3. shared subtile -> destination (own: + peers' slots, * scale -> out; peer: its slot for this rank).
      if (bulk) {
        if (thread_idx < 32) {  // one warp issues a bulk copy per row; the TMA unit moves the bytes
          uint32_t const bytes = uint32_t(min(kSubN, cols - sub0)) * uint32_t(sizeof(Element_));
          for (int r = thread_idx; r < rows; r += 32) {
            rs_bulk_copy_s2g(dst + int64_t(row0 + r) * ld + col0 + sub0, stage + r * kPitch, bytes);
          }
          rs_bulk_commit();
          rs_bulk_wait_read();  // the subtile may be overwritten once every row was read
        }
      } else if (vec && peer_slots != nullptr) {
        reduce_own_subtile(stage, peer_slots, slot_elems, N, out, ld, row0, col0, sub0, rows, cols, scale,
                           thread_idx);
      } else if (own || !comm || active || copy_engine) {
        CUTLASS_PRAGMA_NO_UNROLL
        for (int chunk = thread_idx; chunk < kTileM * kChunksPerRow; chunk += kThreads) {
          int const r = chunk / kChunksPerRow;
          int const c = sub0 + (chunk % kChunksPerRow) * kVec;  // tile column
          if (r >= rows || c >= cols) {
            continue;
          }
          Element_ const* src = stage + r * kPitch + (c - sub0);
          int64_t const grow = int64_t(row0 + r);
          int const gcol = col0 + c;
          if (vec && !to_out) {
            *reinterpret_cast<uint4*>(dst + grow * ld + gcol) = *reinterpret_cast<uint4 const*>(src);
          } else if (vec) {  // an own tile with the peers' parts took reduce_own_subtile above
            cutlass::Array<Element_, kVec> v = *reinterpret_cast<cutlass::Array<Element_, kVec> const*>(src);
            OutVec o;
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < kVec; ++j) o[j] = ElementOut_(float(v[j]) * scale);
            store_out(out + grow * ld + gcol, o);
          } else {
            for (int j = 0; j < kVec && c + j < cols; ++j) {
              float acc = float(src[j]);
              if (peer_slots != nullptr) {
                for (int q = 0; q < p_.world; ++q) {
                  if (q != p_.rank) acc += float(load_cg(peer_slots + int64_t(q) * slot_elems + grow * N + gcol + j));
                }
              }
              if (to_out) {
                out[grow * ld + gcol + j] = ElementOut_(acc * scale);
              } else {
                dst[grow * ld + gcol + j] = Element_(acc);  // scale is 1 for a peer's part
              }
            }
          }
        }
      }
      tile_sync();  // the shared subtile is read before it is written again (next subtile or next tile)
    }

    // 4. copy-engine mode: count the tile in its band, after its stores (even when aborted: the copy
    // stream must never wait forever).  The copy engine reads the outbox once the count is complete.
    if (copy_engine && !own && thread_idx == 0) {
      __threadfence_system();
      atomicAdd(p_.counters + int64_t(segment) * p_.bands + band, 1u);
    }
    // 4. publish a peer tile: all its stores are performed at system scope before its flag is.
    if (push) {
      uint32_t* flag = reinterpret_cast<uint32_t*>(p_.buffers[segment] + p_.flags_offset) +
                       int64_t(p_.rank) * flags_per_src + tile_flag;
      if (bulk) {
        if (thread_idx < 32) {
          pending_flag_ = flag;  // flush_pending() publishes it once the copies landed
        }
      } else if (thread_idx == 0) {
        __threadfence_system();  // after the tile_sync above: every thread's stores to the peer are issued
        rs_store_release(flag, p_.epoch);
      }
    }
  }

  // An own tile's subtile with the peers' parts: out = (staged + sum of the peers' slots) * scale, 16-byte
  // chunks.  Each thread takes kReduceBatch chunks at a time and issues every peer's loads for them before
  // adding, so the slot reads overlap: a chunk-at-a-time loop waits one HBM round trip per (chunk, peer),
  // which at TP=4 made the own segment several times slower than its GEMM work (3 peers x 16 chunks per thread
  // per 128x128 tile, each load waited for in turn).
  static constexpr int kReduceBatch = 4;

  // kVec outputs at a 16-byte aligned address (out rows are multiples of kVec elements where this is used).
  CUTLASS_DEVICE static void store_out(ElementOut_* p, OutVec const& o) {
    static_assert(sizeof(OutVec) % 16 == 0);
    CUTLASS_PRAGMA_UNROLL
    for (int w = 0; w < int(sizeof(OutVec) / 16); ++w) {
      reinterpret_cast<uint4*>(p)[w] = reinterpret_cast<uint4 const*>(&o)[w];
    }
  }

  CUTLASS_DEVICE void reduce_own_subtile(Element_ const* stage, Element_ const* peer_slots, int64_t slot_elems,
                                         int N, ElementOut_* dst, int64_t ld, int row0, int col0, int sub0, int rows,
                                         int cols, float scale, int thread_idx) const {
    constexpr int kChunks = kTileM * kChunksPerRow;
    using Vec = cutlass::Array<Element_, kVec>;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int base = thread_idx; base < kChunks; base += kThreads * kReduceBatch) {
      float acc[kReduceBatch][kVec];
      int64_t offset[kReduceBatch];  // row * N + column of the chunk in a slot, -1 outside the tile
      int64_t out_offset[kReduceBatch];
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kReduceBatch; ++b) {
        int const chunk = base + b * kThreads;
        int const r = chunk / kChunksPerRow;
        int const c = sub0 + (chunk % kChunksPerRow) * kVec;  // tile column
        bool const inside = chunk < kChunks && r < rows && c < cols;
        offset[b] = inside ? int64_t(row0 + r) * N + col0 + c : -1;
        out_offset[b] = int64_t(row0 + r) * ld + col0 + c;
        Vec v;
        if (inside) {
          v = *reinterpret_cast<Vec const*>(stage + r * kPitch + (c - sub0));
        }
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kVec; ++j) acc[b][j] = inside ? float(v[j]) : 0.f;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int q = 0; q < kRsMaxWorld; ++q) {
        if (q >= p_.world) break;
        if (q == p_.rank) continue;
        Element_ const* slot = peer_slots + int64_t(q) * slot_elems;
        uint4 bits[kReduceBatch];
        CUTLASS_PRAGMA_UNROLL
        for (int b = 0; b < kReduceBatch; ++b) {
          bits[b] = offset[b] >= 0 ? __ldcg(reinterpret_cast<uint4 const*>(slot + offset[b])) : make_uint4(0, 0, 0, 0);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int b = 0; b < kReduceBatch; ++b) {
          Vec const& w = reinterpret_cast<Vec const&>(bits[b]);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kVec; ++j) acc[b][j] += float(w[j]);
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kReduceBatch; ++b) {
        if (offset[b] >= 0) {
          OutVec o;
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kVec; ++j) o[j] = ElementOut_(acc[b][j] * scale);
          store_out(dst + out_offset[b], o);
        }
      }
    }
  }

  // Publishes the flag of the tile this warp last pushed by bulk copies, once they have landed.  Called at the
  // start of each epilogue and from store_tail (after the CTA's last tile).  All 32 lanes of the issuing warp
  // hold the same pending flag, so they take the branch together.
  CUTLASS_DEVICE void flush_pending() {
    if constexpr (kAsyncPush) {
      if (pending_flag_ != nullptr) {
        rs_bulk_wait_written();
        __syncwarp();
        if ((threadIdx.x & 31) == 0) {
          __threadfence_system();
          rs_store_release(pending_flag_, p_.epoch);
        }
        pending_flag_ = nullptr;
      }
    }
  }

 private:
  CUTLASS_DEVICE static Element_ load_cg(Element_ const* ptr) {
    uint16_t bits = __ldcg(reinterpret_cast<unsigned short const*>(ptr));
    return reinterpret_cast<Element_ const&>(bits);
  }

  Params p_;
  uint32_t* pending_flag_ = nullptr;  // AsyncPush: the flag of the last tile this warp pushed, not yet published
};

// The collective epilogue GemmUniversal drives: CUTLASS's adapter for a per-tile epilogue, plus a store_tail that
// publishes the last pushed tile's flag (AsyncPush).  The cooperative kernel calls store_tail once, after the
// CTA's last tile; the ping-pong kernel after every tile (so there the push waits for its copies each tile).
template <class Epilogue>
class GemmRsCollectiveEpilogue : public cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Epilogue> {
  using Base = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Epilogue>;

 public:
  using Base::Base;

  template <class LoadPipeline, class LoadPipelineState, class StorePipeline, class StorePipelineState>
  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                                 StorePipelineState store_state) {
    this->flush_pending();
    return cute::make_tuple(load_state, store_state);
  }
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
