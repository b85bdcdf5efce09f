// Launchers of the AG+GEMM kernel (csrc/ag_gemm/ag_gemm.cu).  Torch-free: raw pointers, sizes, a stream.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/error.h"

namespace fluxinductor::ag_gemm {

enum class DType : int { kBFloat16 = 0, kFloat16 = 1 };

// Why a call did not happen (csrc/common/error.h).
using fluxinductor::Error;
using fluxinductor::make_error;

// Kernel variants (tile / cluster / schedule) for bf16 with a K-contiguous weight; other cases use kDefault.
enum class Variant : int {
  // In every build (what the dispatcher picks): 0, and 6 where 256x160 tiles end sooner (a 4096 x 14336 output
  // fills 10.9 waves of 132 SMs with them, 13.6 with 128x256).
  kCooperative128x256Cluster2x1 = 0,  // the default
  kCooperative256x160Cluster1x2 = 6,
  // Tuning builds only (-DFLUXINDUCTOR_KERNEL_TUNING=ON, csrc/tuning/); elsewhere they report an error.
  kCooperative256x128Cluster1x2 = 1,
  kPingpong128x128Cluster1x2 = 2,
  kCooperative256x128Cluster2x1 = 3,
  kCooperative128x256Cluster1x2 = 4,
  kPingpong128x192Cluster2x1 = 5,
  kCooperative256x160Cluster2x1 = 7,
};

// out[M, N] = A[M, K] @ B[K, N] (+ bias[N]), A read from the gathered buffer while it is being filled.
struct AllGatherGemmParams {
  DType dtype = DType::kBFloat16;
  const void* a = nullptr;        // [M, K] row-major, row stride lda elements
  int64_t m = 0, k = 0, lda = 0;
  const void* b = nullptr;        // [K, N]: b_k_contiguous ? element (k, n) at b[n * ldb + k] : b[k * ldb + n]
  int64_t n = 0, ldb = 0;
  bool b_k_contiguous = true;     // true for the transposed view of an nn.Linear weight
  const void* bias = nullptr;     // [N] or nullptr
  void* out = nullptr;            // [M, N] row-major, row stride ldo elements
  int64_t ldo = 0;
  // Communication: flags == nullptr switches the waits off (a plain GEMM).
  const uint32_t* flags = nullptr;  // [world * chunks_per_rank], device memory
  uint32_t epoch = 0;
  int rank = 0, world = 1;
  int64_t shard_rows = 0;         // rows of A per rank (M = world * shard_rows when flags are given)
  int chunks_per_rank = 1;
  // > 1: each rank's whole shard arrives in k_chunks column blocks instead (flags [world * k_chunks]), and the
  // producer waits before each block of a tile's K loop (for problems of about one wave; ag_gemm/scheduler.cuh).
  int k_chunks = 1;
  // > 0 (with flags): A is batch-major, each shard shard_rows / batch_rows blocks of batch_rows rows,
  // block b of rank q at rows (b * world + q) * batch_rows of A and of out (ag_gemm/scheduler.cuh); a multiple of
  // the tile's M.  a_local is then the shard in its own order ([shard_rows, K]: block after block).
  int64_t batch_rows = 0;
  int group_cluster_rows = 8;     // tile-order group height, in cluster rows (see ag_gemm/scheduler.cuh)
  int sm_count = 0;               // persistent grid size; 0 = all SMs of the device
  Variant variant = Variant::kCooperative128x256Cluster2x1;
  long long timeout_ns = 5000000000LL;
  int* error_word = nullptr;      // host-mapped word, set to a nonzero code when a wait times out
  bool trap_on_timeout = false;   // and then trap (calls inside CUDA graphs: no host code runs to raise the code)
  // Tail split (cooperative variants; ag_gemm/scheduler.cuh): a partial last wave of tiles split along K into up to
  // split_max_parts parts, run in up to split_waves waves.  split_partials: device scratch of at least
  // tail_split_scratch_floats(sm_count, split_waves) floats, split_flags: as many uint32 flags as
  // tail_split_flag_count(sm_count, split_waves) (zeroed once), split_epoch: nonzero and new for this scratch (the
  // flags of an earlier launch must not hold it).  nullptr / max parts 1: off.  One scratch per stream.
  float* split_partials = nullptr;
  uint32_t* split_flags = nullptr;
  uint32_t split_epoch = 0;
  int split_max_parts = 1;
  int split_waves = 1;
  // Optional (with flags): this rank's own rows, [shard_rows, K] row-major with row stride lda_local, read from here
  // instead of rows [rank * shard_rows, (rank + 1) * shard_rows) of A, which then need not hold them (the peers'
  // shards are pushed into A; this rank's never is copied there).  shard_rows must be a multiple of the tile's M.
  const void* a_local = nullptr;
  int64_t lda_local = 0;
  // Launch as a programmatic dependent of the kernel before it on the stream (arrive_and_wait below): the GEMM may
  // start while that kernel still runs.  It reads nothing that kernel writes, so it never waits for it.
  bool pdl = false;
  // Optional (with flags and a_local; variants whose A is not multicast, variant_stores_a): the tiles of N block 0
  // also write the A tiles they load into a_out ([M, K] in A's layout, row stride ld_a_out): every row, or with
  // a_out_local_only this rank's rows only.  Done when the kernel is.
  void* a_out = nullptr;
  int64_t ld_a_out = 0;
  bool a_out_local_only = false;
};

// Whether a variant's kernel can write the A it loads (a_out): not where a cluster multicasts A, as a peer CTA's load
// may then overwrite a stage that this CTA's store still reads.  push_call decides by it; the launch itself refuses
// a_out on such a kernel (ag_gemm/run.cuh).
bool variant_stores_a(Variant variant);

// The tail split's scratch for a grid of sm_count CTAs (0: all SMs) whose split tail runs in up to `waves` waves:
// floats, and flags.  Each slot holds one CTA tile of fp32 accumulators, at most kMaxTailTileElements (the split is
// off for larger tiles).  The flags begin with kTailClaimWords words that no part's flag takes (set_tail_split starts
// the parts' after them), wherever the scratch was sized for more waves: the split GEMM+RS ping-pong GEMMs' claim
// counters (two per GEMM, for the two GEMMs that may run at once; gemm_rs.cu set_tail_split).
constexpr int kMaxTailTileElements = 128 * 256;
constexpr int kTailClaimWords = 4;
int64_t tail_split_scratch_floats(int sm_count, int waves = 1);
int64_t tail_split_flag_count(int sm_count, int waves = 1);
// The parts a split tail of `tail` tiles on `clusters` clusters takes (ag_gemm/scheduler.cuh tail_split_parts; 1: no
// split), for tests on the host.
int tail_split_parts_for(int tail, int clusters, int max_parts, int max_waves);

// The per-call arrival (csrc/ag_gemm/arrival.cu), the AG+GEMM's barrier.  Rank r reaching call e writes e into its
// arrival word on every peer (r's earlier work on this stream, its GEMMs of calls < e included, is done by then), waits until
// every peer's arrival word here is at least `need`, then sets *passed = epoch, which the copy stream waits for before
// it writes into peers' buffers.  With `reset` (calls captured in CUDA graphs, whose epoch is one constant) it then
// sets each of this rank's words back to 0: a peer writes its next arrival only after its GEMM of this call, which
// waited for this rank's chunks, pushed after this kernel, so the reset cannot erase it.  A push needs need = e - 1 (peer q reached call e - 1, so its GEMM of call e - 2, the
// last reader of the buffer this call writes into, is done), a pull need = e (every slot written).  The kernel lets a
// programmatic dependent (the GEMM, `pdl`) start at once.  A wait past timeout_ns writes kErrorArrivalTimeout to
// *error_word and traps, as torch's symmetric-memory barrier does: the copy stream must not write into a peer that may
// still read, nor wait forever.
constexpr int kMaxArrivalWorld = 32;
constexpr int kErrorArrivalTimeout = 4;
struct ArrivalParams {
  uint32_t* peer_arrivals[kMaxArrivalWorld] = {};  // [q]: peer q's arrival word for this rank, mapped (q != rank)
  uint32_t const* arrivals = nullptr;              // this rank's words, [world]: [q] written by peer q
  uint32_t* passed = nullptr;                      // this device
  uint32_t epoch = 0, need = 0;
  int rank = 0, world = 1;
  long long timeout_ns = 5000000000LL;
  int* error_word = nullptr;                       // host-mapped, or nullptr
  bool reset = false;                              // set this rank's words back to 0 once they were seen
};
Error arrive_and_wait(ArrivalParams const& params, void* stream);

// Checks and launches on `stream` (a cudaStream_t).
Error all_gather_gemm(AllGatherGemmParams const& params, void* stream);

// One eager call of the push (fluxinductor/kernels/ag_gemm.py all_gather_matmul) enqueued by one host call: the
// per-call stream operations cost host time that a Python loop over them multiplies (docs/design_ag_gemm.md).
// In order:
//   k_chunks == 1: `side` follows `main` (fork_event); the arrival on `main`; `side` waits until `passed` holds the
//     epoch; the first GEMM is the arrival's programmatic dependent;
//   k_chunks > 1 (one-wave problems, whose push start is the critical path): the arrival on `main`, then `side`
//     follows `main` (fork_event), no programmatic launch;
// then on `side`: for peer q = rank - 1, rank - 2, ... the shard into this rank's rows of peer_buffers[q] (rows
// [rank * shard_rows, (rank + 1) * shard_rows), row stride k; batch-major with batch_rows > 0, as in
// AllGatherGemmParams), chunk by chunk (row chunks: ceil(shard_rows / chunks_per_rank) rows of the shard each, flag
// rank * chunks_per_rank + c; column blocks with k_chunks > 1: ceil(ceil(k / k_tile) / k_chunks) K tiles each, flag
// rank * k_chunks + c), each chunk's bytes then the epoch written into peer_flags[q][flag] (a stream write, whose
// memory barrier orders it after the bytes); then, if `own_into`, the shard into this rank's rows of it.  On `main`
// the GEMMs (gemms[i].pdl is set here), then, if `gathered`, the peers' rows of `buffer` (this rank's, [world *
// shard_rows, k]) into the same rows of `gathered` (every GEMM has waited for them); last `main` follows `side`
// (join_event).  The events are the caller's (cudaEventDisableTiming), reused by every call on these streams.  With
// k_chunks == 1 the host enqueues the GEMMs before the side stream's copies, so that a GPU waiting for the host starts
// the first GEMM on this rank's rows sooner; one-wave calls enqueue the copies first (their start is the critical
// path).
// Where the first GEMM's variant can (variant_stores_a) and it reads this rank's rows from the shard, it writes
// those rows into `own_into` itself, and with `gathered` (then own_into == gathered) the peers' rows too, in place
// of both copies: a same-device copy runs on SMs, so the streams' copies wait for the GEMM.
constexpr int kMaxPushGemms = 8;
struct PushCallParams {
  ArrivalParams arrival;                           // epoch, need, rank, world: the call's
  const void* shard = nullptr;                     // [shard_rows, k] row-major, contiguous
  int64_t shard_rows = 0, k = 0, element_size = 2;
  void* peer_buffers[kMaxArrivalWorld] = {};       // [q]: rank q's gathered buffer, [world * shard_rows, k], mapped
  uint32_t* peer_flags[kMaxArrivalWorld] = {};     // [q]: rank q's flags of this call's parity, mapped
  int chunks_per_rank = 1, k_chunks = 1, k_tile = 64;
  int64_t batch_rows = 0;                          // > 0: batch-major buffers (column blocks: 3-D copies)
  AllGatherGemmParams gemms[kMaxPushGemms];
  int gemm_count = 0;
  void* own_into = nullptr;                        // [world * shard_rows, k] on this device, or null
  void* gathered = nullptr;                        // [world * shard_rows, k] on this device, or null
  const void* buffer = nullptr;                    // this rank's buffer, [world * shard_rows, k] (with `gathered`)
  bool gemm_writes_a = true;                       // false: the streams copy, whatever the variant
  void* fork_event = nullptr;
  void* join_event = nullptr;
};
Error push_call(PushCallParams const& params, void* main_stream, void* side_stream);

// Why the kernel cannot run this problem (alignment, sizes), if it cannot.
Error all_gather_gemm_unsupported(AllGatherGemmParams const& params);

// The number of SMs of the current device.
int device_sm_count();

}  // namespace fluxinductor::ag_gemm
