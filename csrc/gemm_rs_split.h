// The split GEMM+RS transport's two GEMMs (csrc/include/fluxinductor/gemm_rs_split.cuh), torch-free.  gemm_rs.cu
// drives them: the peer GEMM, the copy stream's band copies, then the own GEMM.
#pragma once

#include <cstdint>
#include <string>

namespace fluxinductor::gemm_rs_split {

// D [rows, n] (row stride ldd) = beta * C + alpha * (A [rows, k] @ B) + bias, B K-major ([n, k] rows of ldb).
struct SplitGemmParams {
  int dtype = 0;                    // 0 = bf16, 1 = fp16
  int rows = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  const void* bias = nullptr;       // [n] or null
  const void* c = nullptr;          // own GEMM: [rows, n] with row stride n (the peer's partial); peer GEMM: null
  void* d = nullptr;
  int64_t ldd = 0;
  float alpha = 1.f, beta = 0.f;
  int sm_count = 0;
  // Peer GEMM: each stored tile adds 1 to counters[segment * bands + m_block / band_tile_rows].
  uint32_t* counters = nullptr;
  int segment = 0;
  int bands = 1;
  int band_tile_rows = 1;
  // Own GEMM: before a tile, wait until flags[band] - epoch >= 0 (as int32) for every band of band_rows rows it
  // covers; give up without an error once *abort_word == abort_value, or with error_code in *error after timeout_ns.
  uint32_t const* flags = nullptr;
  uint32_t epoch = 0;
  int band_rows = 1;
  uint32_t const* abort_word = nullptr;
  uint32_t abort_value = 0;
  int32_t* error = nullptr;
  int32_t error_code = 0;
  int64_t timeout_ns = 0;
  bool pdl = false;                 // own GEMM: launch as a programmatic dependent of the peer GEMM
};

constexpr int kTileM = 128;  // both GEMMs' tile (checked against the kernels' type in the .cu files)
constexpr int kTileN = 256;

// 0, or -1 with the reason in *error_message.
int run_peer_gemm(SplitGemmParams const& params, void* stream, std::string* error_message);
int run_own_gemm(SplitGemmParams const& params, void* stream, std::string* error_message);

}  // namespace fluxinductor::gemm_rs_split
