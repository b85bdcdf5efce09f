// AG+GEMM launcher: the parameter checks, the dispatch to the instantiations (csrc/ag_gemm/instances.h:
// bf16/fp16 x weight K-/N-contiguous, plus bf16 tuning variants in tuning builds) and the one-call push, which
// enqueues the stream operations (csrc/common/stream_ops.h) the host side of the all-gather needs.
#include "ag_gemm/ag_gemm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <utility>
#include <string>
#include <cstdio>

#include "ag_gemm/instances.h"
#include "common/cuda_error.h"
#include "common/stream_ops.h"
#include "cutlass/cutlass.h"
#include "fluxinductor/ag_gemm/scheduler.cuh"

namespace fluxinductor::ag_gemm {
namespace {

bool aligned16(const void* pointer) { return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0; }

}  // namespace

int device_sm_count() {
  static std::mutex mutex;
  static int cached[64] = {0};
  int device = 0;
  cudaGetDevice(&device);
  std::lock_guard<std::mutex> lock(mutex);
  if (device < 64 && cached[device] == 0) {
    cudaDeviceGetAttribute(&cached[device], cudaDevAttrMultiProcessorCount, device);
  }
  return device < 64 ? cached[device] : 0;
}

// Fewer tail slots than the grid has CTAs per wave (ag_gemm/scheduler.cuh: tail tiles x (parts - 1) < tail tiles x
// parts <= waves x clusters), each one CTA tile; two flags (one per consumer warp group) per slot.
int64_t tail_split_slots(int sm_count, int waves) {
  return int64_t(sm_count > 0 ? sm_count : device_sm_count()) * (waves > 1 ? waves : 1);
}

int64_t tail_split_scratch_floats(int sm_count, int waves) {
  return tail_split_slots(sm_count, waves) * kMaxTailTileElements;
}

int64_t tail_split_flag_count(int sm_count, int waves) {
  return tail_split_slots(sm_count, waves) * 2 + kTailClaimWords;
}

int tail_split_parts_for(int tail, int clusters, int max_parts, int max_waves) {
  return tail > 0 && clusters > 0 ? tail_split_parts(uint32_t(tail), uint32_t(clusters), max_parts, max_waves) : 1;
}

Error all_gather_gemm_unsupported(AllGatherGemmParams const& p) {
  // 16-byte TMA rows and base addresses: 8 elements of a 2-byte type.
  constexpr int64_t kAlign = 8;
  Error why;
  char* out = why.message;
  size_t const size = sizeof(why.message);
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) {
    std::snprintf(out, size, "empty problem (M=%lld, N=%lld, K=%lld)", (long long)p.m, (long long)p.n,
                  (long long)p.k);
  } else if (p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX) {
    std::snprintf(out, size, "a dimension exceeds 2^31");
  } else if (p.k % kAlign || p.lda % kAlign || p.lda < p.k) {
    std::snprintf(out, size, "K=%lld / row stride of A %lld is not a multiple of 8 (TMA needs 16-byte rows)",
                  (long long)p.k, (long long)p.lda);
  } else if (p.ldb % kAlign || (p.b_k_contiguous ? p.ldb < p.k : p.ldb < p.n)) {
    std::snprintf(out, size, "the weight's leading stride %lld is not a multiple of 8 or too small",
                  (long long)p.ldb);
  } else if (p.n % kAlign || p.ldo % kAlign || p.ldo < p.n) {
    std::snprintf(out, size, "N=%lld is not a multiple of 8 (TMA needs 16-byte rows)", (long long)p.n);
  } else if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.out) || (p.bias && !aligned16(p.bias))) {
    std::snprintf(out, size, "a base address is not 16-byte aligned");
  } else if (p.flags && (p.world < 1 || p.rank < 0 || p.rank >= p.world || p.shard_rows < 1 ||
                         p.shard_rows * p.world != p.m || p.chunks_per_rank < 1 || p.k_chunks < 1)) {
    std::snprintf(out, size, "inconsistent all-gather layout (rank %d of %d, %lld rows per rank, M=%lld)", p.rank,
                  p.world, (long long)p.shard_rows, (long long)p.m);
  } else if (p.batch_rows < 0 || (p.batch_rows > 0 && (!p.flags || p.batch_rows > INT32_MAX ||
                                                        p.shard_rows % p.batch_rows != 0))) {
    std::snprintf(out, size, "a batch-major A needs flags and rows per rank (%lld) that are whole blocks of %lld rows",
                  (long long)p.shard_rows, (long long)p.batch_rows);
  } else if (p.a_local && (!p.flags || !aligned16(p.a_local) || p.lda_local % kAlign || p.lda_local < p.k)) {
    std::snprintf(out, size, "the local rows' A needs flags, a 16-byte aligned base and a row stride >= K that is a "
                  "multiple of 8 (got %lld)", (long long)p.lda_local);
  } else if (p.a_out && (!p.a_local || !aligned16(p.a_out) || p.ld_a_out % kAlign || p.ld_a_out < p.k)) {
    std::snprintf(out, size, "writing A out needs the local rows' A, a 16-byte aligned base and a row stride >= K "
                  "that is a multiple of 8 (got %lld)", (long long)p.ld_a_out);
  }
  return why;
}

bool variant_stores_a(Variant variant) {
  switch (variant) {  // the cluster shapes of kernel.cuh's TileConfigs: A is multicast along N
    case Variant::kCooperative128x256Cluster2x1:
    case Variant::kCooperative256x128Cluster2x1:
    case Variant::kPingpong128x192Cluster2x1:
    case Variant::kCooperative256x160Cluster2x1:
      return true;
    default:
      return false;
  }
}

Error all_gather_gemm(AllGatherGemmParams const& p, void* stream_handle) {
  Error why = all_gather_gemm_unsupported(p);
  if (why.failed()) {
    return why;
  }
#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  switch (p.dtype) {
    case DType::kBFloat16:
      if (!p.b_k_contiguous) {
        return run_bf16_n_contiguous(p, stream);
      }
      switch (p.variant) {
        case Variant::kCooperative128x256Cluster2x1:
          return run_bf16_k_contiguous(p, stream);
        case Variant::kCooperative256x160Cluster1x2:
          return run_bf16_k_contiguous_coop256x160_c1x2(p, stream);
#if defined(FLUXINDUCTOR_KERNEL_TUNING)
        case Variant::kCooperative256x128Cluster1x2:
          return run_bf16_k_contiguous_coop256x128(p, stream);
        case Variant::kPingpong128x128Cluster1x2:
          return run_bf16_k_contiguous_pingpong(p, stream);
        case Variant::kCooperative256x128Cluster2x1:
          return run_bf16_k_contiguous_coop256x128_c2x1(p, stream);
        case Variant::kCooperative128x256Cluster1x2:
          return run_bf16_k_contiguous_coop128x256_c1x2(p, stream);
        case Variant::kPingpong128x192Cluster2x1:
          return run_bf16_k_contiguous_pingpong128x192_c2x1(p, stream);
        case Variant::kCooperative256x160Cluster2x1:
          return run_bf16_k_contiguous_coop256x160_c2x1(p, stream);
#else
        case Variant::kCooperative256x128Cluster1x2:
        case Variant::kPingpong128x128Cluster1x2:
        case Variant::kCooperative256x128Cluster2x1:
        case Variant::kCooperative128x256Cluster1x2:
        case Variant::kPingpong128x192Cluster2x1:
        case Variant::kCooperative256x160Cluster2x1:
          return make_error("AG+GEMM variant " + std::to_string(int(p.variant)) +
                            " exists only in tuning builds (-DFLUXINDUCTOR_KERNEL_TUNING=ON, csrc/tuning/)");
#endif
      }
      return make_error("unknown AG+GEMM kernel variant " + std::to_string(int(p.variant)) +
                        " (csrc/ag_gemm/ag_gemm.h)");
    case DType::kFloat16:
      return p.b_k_contiguous ? run_fp16_k_contiguous(p, stream) : run_fp16_n_contiguous(p, stream);
  }
  return make_error("unsupported dtype");
#else
  (void)stream_handle;
  return make_error("the extension was built without sm90a support");
#endif
}

namespace {

Error follow(cudaStream_t waiter, cudaStream_t leader, cudaEvent_t event) {
  cudaError_t status = cudaEventRecord(event, leader);
  if (status != cudaSuccess) {
    return cuda_error("cudaEventRecord", status);
  }
  status = cudaStreamWaitEvent(waiter, event, 0);
  return status == cudaSuccess ? Error() : cuda_error("cudaStreamWaitEvent", status);
}

Error push_call_unsupported(PushCallParams const& p) {
  int const world = p.arrival.world;
  if (world < 2 || world > kMaxArrivalWorld || p.arrival.rank < 0 || p.arrival.rank >= world) {
    return make_error("push_call: rank " + std::to_string(p.arrival.rank) + " of " + std::to_string(world));
  }
  if (p.gemm_count < 1 || p.gemm_count > kMaxPushGemms) {
    return make_error("push_call: " + std::to_string(p.gemm_count) + " GEMMs (1 to " +
                      std::to_string(kMaxPushGemms) + ")");
  }
  if (!p.shard || p.shard_rows < 1 || p.k < 1 || p.element_size < 1 || !p.arrival.passed ||
      p.chunks_per_rank < 1 || p.k_chunks < 1 || p.k_tile < 1 || !p.fork_event || !p.join_event) {
    return make_error("push_call: a missing pointer, event or count");
  }
  if (p.gathered && !p.buffer) {
    return make_error("push_call: the gathered A needs this rank's buffer");
  }
  if (p.batch_rows < 0 || (p.batch_rows > 0 && p.shard_rows % p.batch_rows != 0)) {
    return make_error("push_call: a batch-major push needs whole blocks of batch_rows rows");
  }
  for (int q = 0; q < world; ++q) {
    if (q != p.arrival.rank && (!p.peer_buffers[q] || !p.peer_flags[q])) {
      return make_error("push_call: no buffer or flags for peer " + std::to_string(q));
    }
  }
  return {};
}

// Rows [l0, l1) of rank q's shard (contiguous at `shard`) into where they lie in a gathered A at `a` of `world`
// ranks, whose blocks of `block` rows are batch-major (block b of rank q at rows (b * world + q) * block; block =
// shard_rows: rank-major): a 1-D copy for a part of one block, a 2-D one for whole blocks.
Error copy_shard_rows(char* a, char const* shard, int q, int world, int64_t l0, int64_t l1, int64_t block,
                      int64_t row_bytes, cudaStream_t stream) {
  Error why;
  while (l0 < l1 && !why.failed()) {
    int64_t const b = l0 / block, i = l0 - b * block;
    char* dst = a + ((b * world + q) * block + i) * row_bytes;
    int64_t const blocks = i == 0 ? (l1 - l0) / block : 0;
    if (blocks > 1) {
      why = memcpy2d_async(dst, shard + l0 * row_bytes, world * block * row_bytes, block * row_bytes, blocks, stream,
                           block * row_bytes);
      l0 += blocks * block;
    } else {
      int64_t const rows = std::min(block - i, l1 - l0);
      why = memcpy_async(dst, shard + l0 * row_bytes, rows * row_bytes, stream);
      l0 += rows;
    }
  }
  return why;
}

}  // namespace

Error push_call(PushCallParams const& p, void* main_handle, void* side_handle) {
  Error why = push_call_unsupported(p);
  if (why.failed()) {
    return why;
  }
  auto main = static_cast<cudaStream_t>(main_handle);
  auto side = static_cast<cudaStream_t>(side_handle);
  auto fork = static_cast<cudaEvent_t>(p.fork_event);
  int const rank = p.arrival.rank, world = p.arrival.world;
  uint32_t const epoch = p.arrival.epoch;
  bool const pdl = p.k_chunks == 1;
  if (pdl) {
    if ((why = follow(side, main, fork)).failed() || (why = arrive_and_wait(p.arrival, main)).failed() ||
        (why = stream_wait_value32_eq(p.arrival.passed, epoch, side)).failed()) {
      return why;
    }
  } else if ((why = arrive_and_wait(p.arrival, main)).failed() || (why = follow(side, main, fork)).failed()) {
    return why;
  }

  // The first GEMM writes the rows the copies below would (PushCallParams): this rank's into own_into, and with
  // `gathered` (== own_into) the peers' too.
  AllGatherGemmParams const& first = p.gemms[0];
  bool const gemm_writes_a = p.gemm_writes_a && p.own_into && (!p.gathered || p.gathered == p.own_into) &&
                             first.a_local && variant_stores_a(first.variant);
  auto launch_gemms = [&]() -> Error {
    for (int i = 0; i < p.gemm_count; ++i) {
      AllGatherGemmParams gemm = p.gemms[i];
      gemm.pdl = pdl && i == 0;
      if (i == 0 && gemm_writes_a) {
        gemm.a_out = p.own_into;
        gemm.ld_a_out = p.k;
        gemm.a_out_local_only = p.gathered == nullptr;
      }
      if (Error error = all_gather_gemm(gemm, main); error.failed()) {
        return error;
      }
    }
    return {};
  };
  // With k_chunks == 1 the host enqueues the GEMMs before the pushes: where the GPU waits for this host (a step's
  // first op), the first GEMM starts on its own rows while the host enqueues the copies, and its peers' rows wait for
  // their flags either way.  One-wave calls (k_chunks > 1) push first: every tile waits for the pushes' first column
  // block, so their start is the critical path.
  if (pdl && (why = launch_gemms()).failed()) {
    return why;
  }
  int64_t const row_bytes = p.k * p.element_size;
  int64_t const block = p.batch_rows > 0 ? p.batch_rows : p.shard_rows;
  auto const* shard = static_cast<char const*>(p.shard);
  for (int step = 1; step < world; ++step) {
    int const peer = (rank - step + world) % world;
    char* base = static_cast<char*>(p.peer_buffers[peer]) + rank * block * row_bytes;  // this rank's first block
    if (p.k_chunks > 1) {  // column blocks of whole K tiles (ag_gemm.py k_chunk_bounds), of every row block at once
      int64_t const k_tiles = (p.k + p.k_tile - 1) / p.k_tile;
      int64_t const cols = (k_tiles + p.k_chunks - 1) / p.k_chunks * p.k_tile;
      int64_t const blocks = p.shard_rows / block;
      for (int c = 0; c < p.k_chunks; ++c) {
        int64_t const c0 = std::min(c * cols, p.k), c1 = std::min((c + 1) * cols, p.k);
        int64_t const width = (c1 - c0) * p.element_size;
        if (c1 > c0 && (why = blocks > 1 ? memcpy3d_async(base + c0 * p.element_size, shard + c0 * p.element_size,
                                                          row_bytes, world * block, block, width, block, blocks, side)
                                         : memcpy2d_async(base + c0 * p.element_size, shard + c0 * p.element_size,
                                                          row_bytes, width, p.shard_rows, side)).failed()) {
          return why;
        }
        if ((why = stream_write_value32(p.peer_flags[peer] + rank * p.k_chunks + c, epoch, side)).failed()) {
          return why;
        }
      }
      continue;
    }
    int64_t const rows = (p.shard_rows + p.chunks_per_rank - 1) / p.chunks_per_rank;  // ag_gemm.py chunk_bounds
    for (int c = 0; c < p.chunks_per_rank; ++c) {
      int64_t const start = std::min(c * rows, p.shard_rows), end = std::min((c + 1) * rows, p.shard_rows);
      if ((why = copy_shard_rows(static_cast<char*>(p.peer_buffers[peer]), shard, rank, world, start, end, block,
                                 row_bytes, side)).failed()) {
        return why;
      }
      if ((why = stream_write_value32(p.peer_flags[peer] + rank * p.chunks_per_rank + c, epoch, side)).failed()) {
        return why;
      }
    }
  }

  if (!gemm_writes_a && p.own_into &&
      (why = copy_shard_rows(static_cast<char*>(p.own_into), shard, rank, world, 0, p.shard_rows, block, row_bytes,
                             side)).failed()) {
    return why;
  }
  if (!pdl && (why = launch_gemms()).failed()) {
    return why;
  }

  if (p.gathered && !gemm_writes_a) {  // the blocks of ranks [0, rank) and (rank, world), in each block slice
    auto* gathered = static_cast<char*>(p.gathered);
    auto const* buffer = static_cast<char const*>(p.buffer);
    int64_t const slice_bytes = world * block * row_bytes, blocks = p.shard_rows / block;
    for (auto [q0, q1] : {std::pair<int64_t, int64_t>{0, rank}, std::pair<int64_t, int64_t>{rank + 1, world}}) {
      int64_t const offset = q0 * block * row_bytes, width = (q1 - q0) * block * row_bytes;
      if (width > 0 && (why = blocks > 1 ? memcpy2d_async(gathered + offset, buffer + offset, slice_bytes, width,
                                                          blocks, main)
                                         : memcpy_async(gathered + offset, buffer + offset, width, main)).failed()) {
        return why;
      }
    }
  }
  return follow(main, side, static_cast<cudaEvent_t>(p.join_event));
}

}  // namespace fluxinductor::ag_gemm
