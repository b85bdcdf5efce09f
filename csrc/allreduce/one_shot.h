// One-shot all-reduce for small outputs (decode): torch-free launcher declarations.
//
// Every rank r has written its partial P_r [rows, n] (row-major, contiguous) into its own symmetric buffer before the
// call (its matmul wrote it there).  Each rank's kernel then reads every rank's partial over NVLink and writes
//   out [rows, n] = out_scale * sum_q P_q + bias_scale * bias + residual          (bias [n], residual [rows, n])
// summed in fp32 in rank order 0, 1, ..., world - 1, so every rank writes the same bits.
//
// Ordering, per block b of the grid (the same grid on every rank: it depends only on rows, n and the launch's block
// count, which every rank computes alike):
//   1. epoch = counters[b] + 1, a per-block call counter kept on the device (never a host argument, so a CUDA graph
//      replay takes the next epoch by itself, and eager calls and replays interleave);
//   2. start barrier: write epoch into signal word start[b][rank] of every peer, wait until this rank's start[b][q]
//      reached epoch for every peer q.  A peer's word is written by its kernel, which starts after its matmul on
//      the same stream finished, so the peer's partial is complete;
//   3. the block's share of the output, 16-byte loads from every rank's partial;
//   4. end barrier: the same words end[b][*]: once it passed, no peer reads this rank's partial any more, so the
//      next call's matmul (issued after this kernel) may overwrite it with no second buffer;
//   5. counters[b] = epoch.
// Block b runs in exactly the calls where the grid has a block b, on every rank alike, so the per-block counters of
// all ranks stay equal.  Words compare by signed 32-bit difference (no reset, wrap-around safe: peers are at most one
// call apart).  A wait past timeout_ns writes its code into the host-mapped error word and the block gives up (the
// host raises); with trap_on_timeout (calls captured in a CUDA graph, where no host code would see the word) it then
// traps.
#pragma once

#include <cstdint>

#include "common/error.h"

namespace fluxinductor::allreduce {

constexpr int kOneShotMaxWorld = 8;
constexpr int kOneShotMaxBlocks = 128;
constexpr int kOneShotThreads = 512;
// Signal words of one rank (uint32, zeroed before first use): start[kOneShotMaxBlocks][kOneShotMaxWorld], then
// end[kOneShotMaxBlocks][kOneShotMaxWorld]; [b][q] is written by peer q's block b.
constexpr int kOneShotSignalWords = 2 * kOneShotMaxBlocks * kOneShotMaxWorld;

// Error codes written into OneShotArgs::error.
enum OneShotError : int32_t {
  kOneShotOk = 0,
  kOneShotStartTimeout = 1,  // a peer never entered the call
  kOneShotEndTimeout = 2,    // a peer entered but never finished reading this rank's partial
};

// Element types: 0 bf16, 1 fp16, 2 fp32.
struct OneShotArgs {
  int dtype = 0;             // the partials' and the bias's
  bool out_float = false;    // out (and residual) fp32 instead of dtype (bf16/fp16 partials only)
  int64_t rows = 0, n = 0;   // n * element size a multiple of 16 bytes
  int world = 1, rank = 0;
  void const* inputs[kOneShotMaxWorld] = {};  // every rank's partial [rows, n], as mapped here, 16-byte aligned
  uint32_t* signals[kOneShotMaxWorld] = {};   // every rank's kOneShotSignalWords words, as mapped here
  uint32_t* counters = nullptr;               // this rank's kOneShotMaxBlocks per-block call counters (device)
  void const* bias = nullptr;                 // [n] in dtype, or null
  void const* residual = nullptr;             // [rows, n] in out's dtype, or null
  void* out = nullptr;                        // [rows, n], contiguous
  float out_scale = 1.f;                      // 1/world for avg
  float bias_scale = 1.f;                     // this rank's bias only: world * bias equals the sum of the ranks'
                                              // biases only where every rank holds the same bias (the Python op
                                              // puts each rank's bias into its partial instead)
  int32_t* error = nullptr;                   // host-mapped error word, or null
  int64_t timeout_ns = 10000000000LL;
  bool trap_on_timeout = false;
  int blocks = 0;                             // the grid (1..kOneShotMaxBlocks; 0: one_shot_blocks's choice)
};

// The grid a call of `rows` x `n` elements of `element_size` bytes launches with at most max_blocks blocks.
int one_shot_blocks(int64_t rows, int64_t n, int element_size, int max_blocks);

// Checks the arguments and launches on `stream` (a cudaStream_t); nothing is launched when rows == 0.
Error one_shot_all_reduce(OneShotArgs const& args, void* stream);

}  // namespace fluxinductor::allreduce
