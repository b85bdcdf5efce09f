// The split GEMM+RS transport's GEMMs (csrc/include/fluxinductor/gemm_rs_split.cuh), torch-free.  gemm_rs.cu's
// run_split drives them around the ring: the peer GEMM, world-2 relay GEMMs, the own GEMM, and the copy stream's
// band copies after each but the last.
#pragma once

#include <cstdint>
#include <string>

namespace fluxinductor::gemm_rs_split {

constexpr int kTileM = 128;  // both GEMMs' tile (checked against the kernels' type in the .cu files)
constexpr int kTileN = 256;
constexpr int kGroupClusterRows = 8;                 // tile-order group height, in cluster rows (2 tiles each)
constexpr int kGroupRows = kGroupClusterRows * 2 * kTileM;

// D [rows, n] (row stride ldd) = beta * C + alpha * (A [rows, k] @ B) + bias, B K-major ([n, k] rows of ldb).
struct SplitGemmParams {
  int dtype = 0;                    // 0 = bf16, 1 = fp16
  int rows = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  const void* bias = nullptr;       // [n] or null
  const void* c = nullptr;          // relay and own GEMM: [rows, n], row stride n (rank + 1's partial sum); peer: null
  void* d = nullptr;
  int64_t ldd = 0;
  float alpha = 1.f, beta = 0.f;
  int sm_count = 0;
  // Bands: blocks of band_rows rows (a multiple of kTileM) x chunk_col_tiles column tiles, numbered
  // row band * col_chunks + column chunk.  Both GEMMs walk tiles in groups of kGroupRows rows, columns slower
  // than rows inside a group, so with band_rows a multiple of kGroupRows the bands complete in their numbering's
  // order.
  int band_rows = kTileM;
  int col_chunks = 1;
  int chunk_col_tiles = 1;
  // Peer and relay GEMM: each stored tile adds 1 to counters[segment * bands + its band].
  uint32_t* counters = nullptr;
  int segment = 0;
  int bands = 1;
  // Relay and own GEMM: before a tile, wait until flags[its band] - epoch >= 0 (as int32); give up without an error once
  // *abort_word == abort_value, or with error_code in *error after timeout_ns.
  uint32_t const* flags = nullptr;
  uint32_t epoch = 0;
  uint32_t const* abort_word = nullptr;
  uint32_t abort_value = 0;
  int32_t* error = nullptr;
  int32_t error_code = 0;
  int64_t timeout_ns = 0;
  bool pdl = false;                 // launch as a programmatic dependent of the GEMM before it
};

// 0, or -1 with the reason in *error_message.
int run_peer_gemm(SplitGemmParams const& params, void* stream, std::string* error_message);
int run_relay_gemm(SplitGemmParams const& params, void* stream, std::string* error_message);
int run_own_gemm(SplitGemmParams const& params, void* stream, std::string* error_message);

}  // namespace fluxinductor::gemm_rs_split
