// The inter-node GEMM+RS's reduction (fluxinductor/kernels/internode.py): torch-free launcher declarations.
//
// Every sender q != rank puts its partial of this rank's rows [rows, n] into slot q of this rank's receive buffer
// (an NVSHMEM put), then, once a quiet confirmed that put complete, puts the call's epoch into flags[q].  This rank's
// own partial is already in slot `rank`.  The kernel waits until every sender's flag reached epoch (a signed 32-bit
// difference: flags are never reset) and writes
//   out [rows, n] = scale * sum_q slot_q          (summed in fp32 in rank order 0, 1, ..., world - 1)
// so every rank reduces its rows in the same order whatever order the partials landed in.  A wait past timeout_ns
// writes kReduceArrivalsTimeout into the host-mapped error word and the kernel gives up (the host raises).
#pragma once

#include <cstdint>

#include "common/error.h"

namespace fluxinductor::internode {

enum ReduceArrivalsError : int32_t {
  kReduceArrivalsOk = 0,
  kReduceArrivalsTimeout = 1,  // a sender's partial never arrived
};

struct ReduceArrivalsArgs {
  int dtype = 0;              // 0 bf16, 1 fp16 (slots and out)
  int64_t rows = 0, n = 0;    // one slot: [rows, n], contiguous
  int world = 1, rank = 0;
  void const* slots = nullptr;     // slot q at slots + q * slot_stride elements
  int64_t slot_stride = 0;         // elements, at least rows * n
  uint32_t const* flags = nullptr;  // [world]: flags[q] written by sender q
  uint32_t epoch = 0;
  void* out = nullptr;        // [rows, n], contiguous
  float scale = 1.f;          // 1/world for avg
  int32_t* error = nullptr;   // host-mapped error word, or null
  int64_t timeout_ns = 10000000000LL;
};

// Checks the arguments and launches on `stream` (a cudaStream_t); nothing is launched when rows == 0.
Error reduce_arrivals(ReduceArrivalsArgs const& args, void* stream);

}  // namespace fluxinductor::internode
