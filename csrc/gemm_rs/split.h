// The split GEMM+RS transport's GEMMs (csrc/include/fluxinductor/gemm_rs/split.cuh), torch-free.  gemm_rs.cu's
// run_split drives them around the ring: the peer GEMM, world-2 relay GEMMs, the own GEMM, and the copy stream's
// band copies after each but the last.
#pragma once

#include <cstdint>
#include <string>

namespace fluxinductor::gemm_rs_split {

// K slabs beyond the first a split GEMM takes (csrc/include/fluxinductor/common/k_slabs.cuh kMaxKSlabs - 1).
constexpr int kMaxMoreSlabs = 2;

// A split GEMM configuration's tiling, which the launcher's band arithmetic follows (checked against the kernels'
// types in gemm_rs/split.cuh).  Both GEMMs walk tiles in groups of group_rows() rows, rows fastest inside a group.
struct SplitTiling {
  int tile_m;
  int tile_n;
  int cluster_m;
  int group_cluster_rows;  // tile-order group height, in cluster rows
  constexpr int group_rows() const { return group_cluster_rows * cluster_m * tile_m; }
};
// 0: cooperative 128x256, cluster 2x1, groups of 8 cluster rows (AG+GEMM's configuration; every dtype).  2: ping-pong
// 128x192, cluster 2x1, groups of 8, whose two math warp groups take turns, one's epilogue under the other's MMAs
// (bf16 only; the cost model's table picks 0 or 2 per shape, GemmRsArgs::split_config).  Tuning builds
// (-DFLUXINDUCTOR_KERNEL_TUNING) add 1: ping-pong 64x256, cluster 2x1, groups of 16 cluster rows (K-major weights).
constexpr SplitTiling kSplitTilings[] = {{128, 256, 2, 8}, {64, 256, 2, 16}, {128, 192, 2, 8}, {128, 160, 2, 8},
                                         {128, 144, 2, 8}, {128, 128, 2, 8}};
constexpr int kSplitConfigs = int(sizeof(kSplitTilings) / sizeof(kSplitTilings[0]));

// D [rows, n] (row stride ldd) = beta * C + alpha * (A [rows, k] @ B) + bias; B K-major (the transposed nn.Linear
// weight of a forward x @ W.t()) or N-major (the weight itself, as a backward's grad @ W gives it).
struct SplitGemmParams {
  int dtype = 0;                    // 0 = bf16, 1 = fp16
  bool out_float = false;           // D is fp32 (the own GEMM of an fp32 reduction: bf16 operands, N-major B)
  int config = 0;                   // index into kSplitTilings
  int rows = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  // > 0: row r of this GEMM's A is row (r / block_rows) * pitch_rows + r % block_rows from `a`, of rows_extent rows
  // (a segment of a batch-major A: fluxinductor/common/blocked_rows.cuh; every slab's A alike, from its a_more);
  // 0: rows [0, rows) from `a`.
  int block_rows = 0, pitch_rows = 0, rows_extent = 0;
  const void* b = nullptr;          // B [k, n]: element (kk, nn) at b[nn*ldb + kk] when b_k_major, else b[kk*ldb + nn]
  int64_t ldb = 0;
  bool b_k_major = true;
  // K in slabs (1 = none): D = sum_s A_s @ B_s, slab 0 the A and B above with K k_first (a multiple of the tile's K,
  // as every slab's but the last), slab s > 0 [rows, k_more] at a_more (row stride lda_more) times [k_more, n] at
  // b_more (leading stride ldb_more, B's layout); k is the sum.
  int slabs = 1;
  int k_first = 0;
  const void* a_more[kMaxMoreSlabs] = {};
  int64_t lda_more[kMaxMoreSlabs] = {};
  const void* b_more[kMaxMoreSlabs] = {};
  int64_t ldb_more[kMaxMoreSlabs] = {};
  int k_more[kMaxMoreSlabs] = {};
  const void* bias = nullptr;       // [n] or null
  const void* c = nullptr;          // relay and own GEMM: [rows, n], row stride n (rank + 1's partial sum); peer: null
  void* d = nullptr;
  int64_t ldd = 0;
  float alpha = 1.f, beta = 0.f;
  int sm_count = 0;
  // Bands: blocks of band_rows rows (a multiple of the tile's rows) x chunk_col_tiles column tiles, numbered
  // row band * col_chunks + column chunk.  With band_rows a multiple of the tiling's group_rows() the bands complete
  // in their numbering's order.
  int band_rows = 0;                // 0 without counting (band_rows is read only where counters is set)
  int col_chunks = 1;
  int chunk_col_tiles = 1;
  // Peer and relay GEMM: each stored tile adds 1 to counters[segment * bands + its band].
  uint32_t* counters = nullptr;
  int segment = 0;
  int bands = 1;
  // Relay and own GEMM: before a tile, wait until flags[its band] - epoch >= 0 (as int32); give up without an error
  // once *abort_word == abort_value, or with error_code in *error after timeout_ns.
  uint32_t const* flags = nullptr;
  uint32_t epoch = 0;
  uint32_t const* abort_word = nullptr;
  uint32_t abort_value = 0;
  int32_t* error = nullptr;
  int32_t error_code = 0;
  int64_t timeout_ns = 0;
  // A call captured in a CUDA graph: the waits compare the epoch exactly and a timed-out wait traps (no host code
  // runs between replays to raise the error word).
  bool capture = false;
  bool pdl = false;                 // launch as a programmatic dependent of the GEMM before it
  // Tail split (cooperative configurations; ag_gemm/scheduler.cuh AllGatherSchedule): a partial last wave's tiles
  // split along K into up to split_max_parts parts over up to split_waves waves.  The scratch (ag_gemm.h
  // tail_split_scratch_floats / flag_count for sm_count and split_waves) belongs to this launch until it ends, so the
  // next GEMM on it must not start earlier (no pdl).  A last part that times out writes split_error_code to *error.
  float* split_partials = nullptr;
  uint32_t* split_flags = nullptr;
  uint32_t split_epoch = 0;
  int split_max_parts = 1;
  int split_waves = 1;
  int32_t split_error_code = 0;
};

// 0, or -1 with the reason in *error_message.
int run_peer_gemm(SplitGemmParams const& params, void* stream, std::string* error_message);
int run_relay_gemm(SplitGemmParams const& params, void* stream, std::string* error_message);
int run_own_gemm(SplitGemmParams const& params, void* stream, std::string* error_message);  // also out_float

}  // namespace fluxinductor::gemm_rs_split
