// One-shot all-reduce for small outputs (decode): torch-free launcher declarations.
//
// Every rank r has its partial P_r [rows, n] (row-major, contiguous) in its own memory before the call (its matmul
// wrote it there).  Each rank's kernel pushes P_r into a slot of every peer's symmetric receive buffer over NVLink,
// signals, waits for every peer's push into its own buffer, and writes
//   out [rows, n] = out_scale * sum_q P_q + bias_scale * bias + residual          (bias [n], residual [rows, n])
// summed in fp32 in rank order 0, 1, ..., world - 1, so every rank writes the same bits.  The only NVLink traffic is
// stores, which the sender does not wait for; every load is local.
//
// The receive buffer of each rank holds 2 x world slots of slot_bytes: slot (parity, q) receives rank q's partial in
// calls whose epoch has that parity.  Ordering, per call (the same grid on every rank: it depends only on rows, n and
// the launch's block count, which every rank computes alike):
//   1. epoch = counters[0] + 1: the calls this rank's kernel completed on the group, kept on the device (never a host
//      argument, so a CUDA graph replay takes the next epoch by itself, and eager calls and replays interleave);
//   2. block b stores its share of P_r into slot (epoch & 1, r) of every peer, then writes epoch into signal word
//      [b][r] of every peer (release, after a system fence), and waits until its own words [b][q] reached epoch;
//   3. block b sums its share from its own partial and the peers' slots;
//   4. the last block to finish sets counters[0] = epoch.
// No barrier at the end: a peer's store into slot parity p of call e + 2 comes after that peer passed step 2 of call
// e + 1, so after this rank's kernel of call e + 1 started, so after its kernel of call e (the last reader of parity
// p) finished (one stream: kernels in call order).  A peer is at most one call ahead (it cannot pass step 2 of call
// e + 1 before this rank entered it), so words compare by signed 32-bit difference (no reset, wrap-around safe), and
// a word of a block the current grid does not have only ever holds an older epoch.  A wait past timeout_ns writes its
// code into the host-mapped error word and the block gives up (the host raises; counters[0] then stays behind, so the
// group needs a fresh workspace); with trap_on_timeout (calls captured in a CUDA graph, where no host code would see
// the word) it then traps.
#pragma once

#include <cstdint>

#include "common/error.h"

namespace fluxinductor::allreduce {

constexpr int kOneShotMaxWorld = 8;
constexpr int kOneShotMaxBlocks = 128;
constexpr int kOneShotThreads = 512;
// Signal words of one rank (uint32, zeroed before first use): [kOneShotMaxBlocks][kOneShotMaxWorld]; [b][q] is
// written by peer q's block b.
constexpr int kOneShotSignalWords = kOneShotMaxBlocks * kOneShotMaxWorld;
// Counters of one rank (uint32, zeroed before first use): [0] calls completed, [1] blocks finished in the current
// call.
constexpr int kOneShotCounterWords = 2;

// Error codes written into OneShotArgs::error.
enum OneShotError : int32_t {
  kOneShotOk = 0,
  kOneShotPeerTimeout = 1,  // a peer never entered the call (or never finished its stores)
};

// Element types: 0 bf16, 1 fp16, 2 fp32.
struct OneShotArgs {
  int dtype = 0;             // the partials' and the bias's
  bool out_float = false;    // out (and residual) fp32 instead of dtype (bf16/fp16 partials only)
  int64_t rows = 0, n = 0;   // n * element size a multiple of 16 bytes
  int world = 1, rank = 0;
  void const* partial = nullptr;              // this rank's partial [rows, n], 16-byte aligned
  void* buffers[kOneShotMaxWorld] = {};       // every rank's receive buffer (2 x world slots), as mapped here
  int64_t slot_bytes = 0;                     // one slot: at least rows * n * element size, a multiple of 16
  uint32_t* signals[kOneShotMaxWorld] = {};   // every rank's kOneShotSignalWords words, as mapped here
  uint32_t* counters = nullptr;               // this rank's kOneShotCounterWords counters (device)
  void const* bias = nullptr;                 // [n] in dtype, or null
  void const* residual = nullptr;             // [rows, n] in out's dtype, or null
  void* out = nullptr;                        // [rows, n], contiguous
  // RMSNorm after the reduction (one_shot_all_reduce_rms_norm_kernel), where norm_weight is set: out_float false,
  // normed [rows, n] and norm_weight [n] in dtype; normed = rms_norm(out) (see the kernel for the two forms).
  void const* norm_weight = nullptr;
  void* normed = nullptr;
  float eps = 1e-5f;
  bool weight_after_cast = true;
  float out_scale = 1.f;                      // 1/world for avg
  float bias_scale = 1.f;                     // this rank's bias only: world * bias equals the sum of the ranks'
                                              // biases only where every rank holds the same bias (the Python op
                                              // puts each rank's bias into its partial instead)
  int32_t* error = nullptr;                   // host-mapped error word, or null
  int64_t timeout_ns = 10000000000LL;
  bool trap_on_timeout = false;
  int blocks = 0;                             // the grid (1..kOneShotMaxBlocks; 0: one_shot_blocks's choice)
};

// The grid a call of `rows` x `n` elements (with RMSNorm: one block per row, at most max_blocks) of `element_size` bytes launches with at most max_blocks blocks.
int one_shot_blocks(int64_t rows, int64_t n, int element_size, int max_blocks, bool norm = false);

// Checks the arguments and launches on `stream` (a cudaStream_t); nothing is launched when rows == 0.
Error one_shot_all_reduce(OneShotArgs const& args, void* stream);

}  // namespace fluxinductor::allreduce
