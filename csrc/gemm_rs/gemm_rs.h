// GEMM + reduce-scatter (row-parallel linear): torch-free launcher declarations.
//
// Each rank r holds A_r [M, K] (its K slice) and B_r [K, N]; the result is
//   out_r [M/world, N] = rows [r*M/world, (r+1)*M/world) of sum_q (A_q @ B_q + bias)   (times 1/world for avg);
// with GemmRsArgs::batch_rows the rows of A are batch-major and out_r is rank r's blocks of them (see there).
// One persistent CUTLASS sm90a GEMM per rank computes the row segments owned by its peers first and stores
// them straight into the owner's symmetric buffer (slot r) over NVLink, with one flag per tile;
// its own segment comes last, and its epilogue adds the peers' slots once their flags carry this call's epoch.
// Split transport (GemmRsArgs::split): a ring of stock CUTLASS GEMMs, one per segment.  Each computes a peer's rows
// into the outbox, adding (from the second on) the partial sum rank + 1 sent for them, and the copy engine sends it
// per band to rank - 1; the last computes this rank's rows and adds rank + 1's partial sum of them as C.
// Copy-engine mode (GemmRsArgs::outbox set): peer tiles are stored in a local outbox instead and counted per
// band of tile rows; a copy stream waits for each band's count (cuStreamWaitValue32), copies the band into the
// owner's slot (cudaMemcpyAsync: copy engine, no SMs) and then writes the owner's flag of (this rank, band).
#pragma once

#include <cstdint>

namespace fluxinductor {

constexpr int kGemmRsMaxWorld = 8;

// Error codes a kernel writes into GemmRsArgs::error (host-mapped memory; 0 = no error).
enum GemmRsError : int32_t {
  kGemmRsOk = 0,
  kGemmRsHelloTimeout = 1,       // a peer never entered this call (it crashed, hung or skipped a call)
  kGemmRsSignatureMismatch = 2,  // ranks called with different shapes/dtypes
  kGemmRsTileTimeout = 3,        // a peer entered the call but never delivered a tile
  kGemmRsSplitTimeout = 4,       // split transport, tail split: a tile's last part waited too long for the others
};

// Copy-engine mode: at most this many bands per segment (the counters hold world * this many words).
constexpr int kGemmRsMaxBands = 32;

// Layout of one rank's symmetric buffer (byte offsets; the same on every rank):
//   [0, 256)                      hello words, uint32 per source rank (the epoch the source is in)
//   [256, 512)                    signatures, uint64 per source rank
//   [512, 516)                    status of this rank's current call (== epoch when all peers agreed)
//   [flags_offset, ...)           uint32 flags [src][tile_m][tile_n] = epoch once delivered
//                                 (copy-engine mode: flags [src][band], in the same region)
//   [data_offset, ...)            slots [src][M/world][N] elements: the peers' partial products
struct GemmRsArgs {
  int dtype = 0;            // 0 = bf16, 1 = fp16 (A, B, bias and, unless out_float, out share it)
  // out is fp32: partials in the operands' dtype, their fp32 sum (store and copy transports; the split transport at
  // two ranks, bf16 and an N-major weight, where this rank's own partial is added unrounded)
  bool out_float = false;
  int m = 0, n = 0, k = 0;  // global M (all ranks' rows), N, this rank's K
  int world = 1, rank = 0;
  const void* a = nullptr;  // A [m, k] row-major, row stride lda (elements)
  int64_t lda = 0;
  const void* b = nullptr;  // B [k, n]: element (kk, nn) at b[nn*ldb + kk] when b_k_major, else b[kk*ldb + nn]
  int64_t ldb = 0;
  bool b_k_major = true;
  // Split transport only: K in slabs, the reduce-scatter of sum_s A_s @ B_s (1 = none).  Slab 0 is a [m, k_first]
  // and b [k_first, n] above; slab s > 0 is a_more [m, k_more] (row stride lda_more) and b_more [k_more, n]
  // (leading stride ldb_more, b's layout); k is the sum.  Every slab's K but the last a multiple of 64 (the split
  // GEMMs' tile K), each a multiple of 8.  With batch_rows, every slab's A is batch-major alike.
  int slabs = 1;
  int k_first = 0;
  const void* a_more[2] = {};
  int64_t lda_more[2] = {};
  const void* b_more[2] = {};
  int64_t ldb_more[2] = {};
  int k_more[2] = {};
  const void* bias = nullptr;  // [n] or null
  void* out = nullptr;         // [m/world, n], row stride ldo
  int64_t ldo = 0;
  float out_scale = 1.f;       // 1/world for avg
  void* buffers[kGemmRsMaxWorld] = {};  // every rank's symmetric buffer base, as mapped on this rank
  int64_t flags_offset = 0;    // bytes
  int64_t data_offset = 0;     // bytes
  uint32_t epoch = 0;          // this call's number, the same on every rank, >= 1
  uint64_t signature = 0;      // what every rank must agree on (shape, dtype, world)
  int32_t* error = nullptr;    // host-mapped error word
  int64_t timeout_ns = 10'000'000'000LL;
  int sm_count = 0;            // CTAs of the persistent grid (0 = all SMs)
  // A call captured in a CUDA graph (the stores or the split transport, no tail split): `epoch` is the same constant
  // on every replay, so the handshake sets its hello words back to 0 once seen, the caller zeroes this rank's flags
  // after the call, flags must equal the epoch exactly, and a failed wait traps (no host code runs between replays to
  // raise the error word).  The split transport's band counters are zeroed at the start of every call anyway.
  bool capture = false;
  // Copy-engine mode (world > 1 and outbox != null):
  void* outbox = nullptr;         // [world][m/world][n] elements on this rank's device (own segment unused)
  uint32_t* counters = nullptr;   // [world * kGemmRsMaxBands] on this rank's device
  int bands = 4;                  // bands per segment wanted (1..kGemmRsMaxBands; fewer when M is small)
  void* copy_stream = nullptr;    // cudaStream_t the copies run on (not `stream`)
  // Split transport (copy-engine resources above, K-major weight): one GEMM per segment with CUTLASS's own epilogue,
  // in a ring (csrc/include/fluxinductor/gemm_rs/split.cuh, run_split in gemm_rs.cu).
  // With world 1 (gemm_only), the two GEMMs run with communication off, outbox holding [m/2 or more rows, n] zeros.
  bool split = false;
  const void* bias_scaled = nullptr;  // bias * out_scale (the own rows' GEMM adds it unscaled); null without bias
  bool split_pdl = true;              // launch each GEMM after the first as a programmatic dependent
  int split_config = 0;               // the split GEMMs' configuration (gemm_rs/split.h kSplitTilings; same on every rank)
  // Tuning (fluxinductor.settings.tuning; same on every rank):
  int tuning_config = 0;  // tuning builds: the kernel configuration (0 the default; 1..6 gemm_rs.cu TuningShape*)
  int swizzle = 0;        // tile-order swizzle inside a segment (1, 2, 4, 8); 0: the measured default
  int raster = -1;        // 0 heuristic, 1 along M, 2 along N; -1: the measured default
  // > 0: A is batch-major, the [B, S, k] operand of a reduce-scatter on S (m = B * S): owner q's rows are B blocks of
  // batch_rows = S / world rows, block b at rows (b * world + q) * batch_rows, read in (b, row) order, so out is
  // this rank's [B, S / world, n].  A multiple of the tile's M that divides m / world.  0: owner q's rows are
  // [q * m / world, (q + 1) * m / world).
  int batch_rows = 0;
  // Split transport, optional: each GEMM's partial last wave split along K into up to tail_split_parts parts (> 1),
  // in up to tail_split_waves waves, with the AG+GEMM tail split's scratch (ag_gemm.h sizes it for sm_count and the
  // waves), which must belong to `stream`.  The call uses the epochs tail_split_epoch, +1, ... one per GEMM (world of
  // them; 2 with world 1), and launches its GEMMs one after another (split_pdl is ignored), since they share the
  // scratch.
  float* tail_split_partials = nullptr;
  uint32_t* tail_split_flags = nullptr;
  uint32_t tail_split_epoch = 0;
  int tail_split_parts = 1;
  int tail_split_waves = 1;
};

// The tile shape of configuration `tuning_config` and flags per tile (1) fix the flag layout (the launcher and Python
// agree through these).
int gemm_rs_tile_m(int tuning_config);
int gemm_rs_tile_n(int tuning_config);
int gemm_rs_warps_per_tile();
// True in tuning builds (-DFLUXINDUCTOR_KERNEL_TUNING=ON): GemmRsArgs::tuning_config picks a variant.
bool gemm_rs_tuning_build();

// Enqueues the call on `stream` (a cudaStream_t). Returns 0, or a negative code with a message in gemm_rs_last_error().
int gemm_rs_run(const GemmRsArgs& args, void* stream);
const char* gemm_rs_last_error();

}  // namespace fluxinductor
