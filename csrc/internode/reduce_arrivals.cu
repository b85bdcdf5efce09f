// The inter-node GEMM+RS's reduction kernel (protocol: csrc/internode/reduce_arrivals.h).
#include "internode/reduce_arrivals.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>

#include "fluxinductor/allreduce/one_shot.cuh"  // the flag load, the timer and the conversions the one-shot uses

namespace fluxinductor::internode {
namespace {

using allreduce::detail::from_float;
using allreduce::detail::one_shot_globaltimer;
using allreduce::detail::one_shot_load_acquire;
using allreduce::detail::to_float;

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

// Thread 0 of each block waits for every sender's flag; the block's other threads read the slots only after the
// barrier that follows its acquire loads.  Vec elements a thread (16 bytes where rows * n allows, else 1).
template <typename T, int Vec>
__global__ void __launch_bounds__(kThreads) reduce_arrivals_kernel(ReduceArrivalsArgs a) {
  __shared__ int gave_up;
  if (threadIdx.x == 0) {
    gave_up = 0;
    int64_t const start = one_shot_globaltimer();
    for (int q = 0; q < a.world && !gave_up; ++q) {
      if (q == a.rank) continue;
      while (int32_t(one_shot_load_acquire(a.flags + q) - a.epoch) < 0) {
        if (one_shot_globaltimer() - start > a.timeout_ns) {
          if (a.error != nullptr) atomicCAS(a.error, 0, int32_t(kReduceArrivalsTimeout));
          gave_up = 1;
          break;
        }
        __nanosleep(128);
      }
    }
  }
  __syncthreads();
  if (gave_up) return;
  T const* slots = static_cast<T const*>(a.slots);
  T* out = static_cast<T*>(a.out);
  int64_t const vectors = a.rows * a.n / Vec;
  for (int64_t v = int64_t(blockIdx.x) * kThreads + threadIdx.x; v < vectors; v += int64_t(gridDim.x) * kThreads) {
    float acc[Vec];
#pragma unroll
    for (int i = 0; i < Vec; ++i) acc[i] = 0.f;
    for (int q = 0; q < a.world; ++q) {
      T const* src = slots + q * a.slot_stride + v * Vec;
      if constexpr (Vec == 8) {
        uint4 const loaded = __ldcg(reinterpret_cast<uint4 const*>(src));  // L2 only: another agent wrote it
        T const* e = reinterpret_cast<T const*>(&loaded);
#pragma unroll
        for (int i = 0; i < Vec; ++i) acc[i] += to_float<T>(e[i]);
      } else {
        acc[0] += to_float<T>(src[0]);
      }
    }
    if constexpr (Vec == 8) {
      uint4 stored;
      T* e = reinterpret_cast<T*>(&stored);
#pragma unroll
      for (int i = 0; i < Vec; ++i) e[i] = from_float<T>(acc[i] * a.scale);
      *reinterpret_cast<uint4*>(out + v * Vec) = stored;
    } else {
      out[v] = from_float<T>(acc[0] * a.scale);
    }
  }
}

template <typename T>
cudaError_t launch(ReduceArrivalsArgs const& a, bool vectorized, cudaStream_t stream) {
  int64_t const items = vectorized ? a.rows * a.n / 8 : a.rows * a.n;
  int const blocks = int(items / kThreads + 1 < kMaxBlocks ? items / kThreads + 1 : kMaxBlocks);
  if (vectorized) {
    reduce_arrivals_kernel<T, 8><<<blocks, kThreads, 0, stream>>>(a);
  } else {
    reduce_arrivals_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

bool aligned16(void const* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

Error reduce_arrivals(ReduceArrivalsArgs const& a, void* stream) {
  char message[384];
  auto fail = [&](char const* what) {
    std::snprintf(message, sizeof(message), "reduce_arrivals: %s (rows %lld, n %lld, world %d, rank %d)", what,
                  static_cast<long long>(a.rows), static_cast<long long>(a.n), a.world, a.rank);
    return make_error(message);
  };
  if (a.dtype != 0 && a.dtype != 1) return fail("dtype must be bf16 (0) or fp16 (1)");
  if (a.world < 1 || a.rank < 0 || a.rank >= a.world) return fail("rank outside the world");
  if (a.rows < 0 || a.n <= 0 || a.slot_stride < a.rows * a.n) return fail("a slot smaller than [rows, n]");
  if (a.rows == 0) return Error{};
  if (a.slots == nullptr || a.flags == nullptr || a.out == nullptr) return fail("null slots, flags or out");
  // 16-byte vectors where every slot, the output and the slot stride allow it.
  bool const vectorized = (a.rows * a.n) % 8 == 0 && a.slot_stride % 8 == 0 && aligned16(a.slots) && aligned16(a.out);
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t const status = a.dtype == 0 ? launch<__nv_bfloat16>(a, vectorized, s) : launch<__half>(a, vectorized, s);
  if (status != cudaSuccess) {
    std::snprintf(message, sizeof(message), "reduce_arrivals launch: %s", cudaGetErrorString(status));
    return make_error(message);
  }
  return Error{};
}

}  // namespace fluxinductor::internode
