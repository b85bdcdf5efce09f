// The one-shot all-reduce kernel (protocol: csrc/allreduce/one_shot.h).  Torch-free, CUTLASS-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fluxinductor::allreduce {

template <int MaxWorld>
struct OneShotParams {
  char const* partial;             // this rank's partial
  char* peer_slots[MaxWorld];      // [q]: slot (0, rank) of peer q's receive buffer, as mapped here
  char const* own_slots;           // slot (0, 0) of this rank's receive buffer
  int64_t slot_bytes;              // one slot; slot (parity, q) starts at (parity * world + q) * slot_bytes
  uint32_t* peer_words[MaxWorld];  // [q]: signal word [0][rank] on peer q (block b adds b * max_world)
  uint32_t const* own_words;       // this rank's signal word [0][0]
  uint32_t* counters;              // [0] calls completed, [1] blocks finished in this call
  char const* bias;
  char const* residual;
  char* out;
  char const* norm_weight;  // the RMSNorm kernel's [n] weight (Out)
  char* normed;             // the RMSNorm kernel's [rows, n] result (Out)
  float eps;
  bool weight_after_cast;
  int64_t vectors;  // rows * n / elements per 16-byte vector
  int64_t n_vectors;  // n / elements per vector
  int world, rank, max_world;
  float out_scale, bias_scale;
  int32_t* error;
  int64_t timeout_ns;
  bool trap_on_timeout;
};

namespace detail {

__device__ __forceinline__ uint32_t one_shot_load_acquire(uint32_t const* address) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void one_shot_store_release(uint32_t* address, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ int64_t one_shot_globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return int64_t(t);
}

// A peer's pushed partial: written by another GPU during this kernel, read once; volatile keeps it out of L1.
__device__ __forceinline__ uint4 one_shot_load_vector(char const* address) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(address));
  return v;
}

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }

// kElems elements of T at `address` (kElems * sizeof(T) a multiple of 16 bytes, 16-byte aligned) added to acc.
template <typename T, int kElems>
__device__ __forceinline__ void accumulate(float (&acc)[kElems], char const* address, float scale) {
  constexpr int kChunks = kElems * int(sizeof(T)) / 16;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    uint4 const v = *reinterpret_cast<uint4 const*>(address + 16 * c);
    T const* e = reinterpret_cast<T const*>(&v);
#pragma unroll
    for (int i = 0; i < 16 / int(sizeof(T)); ++i) {
      acc[c * (16 / int(sizeof(T))) + i] += scale * to_float<T>(e[i]);
    }
  }
}

template <typename T, int kElems>
__device__ __forceinline__ void store(char* address, float const (&acc)[kElems]) {
  constexpr int kChunks = kElems * int(sizeof(T)) / 16;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    uint4 v;
    T* e = reinterpret_cast<T*>(&v);
#pragma unroll
    for (int i = 0; i < 16 / int(sizeof(T)); ++i) {
      e[i] = from_float<T>(acc[c * (16 / int(sizeof(T))) + i]);
    }
    *reinterpret_cast<uint4*>(address + 16 * c) = v;
  }
}

// After the block's stores to every peer: thread q (< world, != rank) makes them visible system-wide, writes `epoch`
// into peer q's word and waits for peer q's word here.  Returns whether any wait of the block gave up (then
// kOneShotPeerTimeout is in the error word).
template <int MaxWorld>
__device__ __forceinline__ bool one_shot_signal_wait(OneShotParams<MaxWorld> const& p, uint32_t epoch) {
  __syncthreads();  // every thread's stores precede thread q's fence
  int const q = int(threadIdx.x);
  bool gave_up = false;
  if (q < p.world && q != p.rank) {
    int64_t const slot = int64_t(blockIdx.x) * p.max_world;
    uint32_t* peer_word = nullptr;
#pragma unroll
    for (int i = 0; i < MaxWorld; ++i) {  // constant indices: the parameters stay out of local memory
      peer_word = i == q ? p.peer_words[i] : peer_word;
    }
    __threadfence_system();
    one_shot_store_release(peer_word + slot, epoch);
    uint32_t const* word = p.own_words + slot + q;
    if (int32_t(one_shot_load_acquire(word) - epoch) < 0) {
      int64_t const start = one_shot_globaltimer();
      while (int32_t(one_shot_load_acquire(word) - epoch) < 0) {
        if (one_shot_globaltimer() - start > p.timeout_ns) {
          if (p.error != nullptr) {
            *reinterpret_cast<int32_t volatile*>(p.error) = 1;  // kOneShotPeerTimeout
            __threadfence_system();
          }
          gave_up = true;
          break;
        }
      }
    }
  }
  return __syncthreads_or(gave_up) != 0;
}

}  // namespace detail

// In: the partials' (and bias's) type; Out: out's and residual's; World: the group size (1..MaxWorld).
template <typename In, typename Out, int World, int MaxWorld, int Threads>
__global__ void __launch_bounds__(Threads) one_shot_all_reduce_kernel(OneShotParams<MaxWorld> const p) {
  constexpr int kElems = 16 / int(sizeof(In));
  // counters[0] changes only when every block of this call has read it (step 4 of the protocol).
  uint32_t const epoch = *reinterpret_cast<uint32_t const volatile*>(p.counters) + 1u;
  int64_t const parity_slots = int64_t(epoch & 1u) * World * p.slot_bytes;
  int64_t const step = int64_t(gridDim.x) * Threads;
  int64_t const first = int64_t(blockIdx.x) * Threads + threadIdx.x;

  char* peers[World];
#pragma unroll
  for (int q = 0; q < World; ++q) {
    peers[q] = p.peer_slots[q] + parity_slots;
  }
  for (int64_t v = first; v < p.vectors; v += step) {
    uint4 const mine = *reinterpret_cast<uint4 const*>(p.partial + v * 16);
#pragma unroll
    for (int q = 0; q < World; ++q) {
      if (q != p.rank) {
        *reinterpret_cast<uint4*>(peers[q] + v * 16) = mine;
      }
    }
  }
  if (detail::one_shot_signal_wait(p, epoch)) {
    if (p.trap_on_timeout) {
      __trap();
    }
    return;
  }

  char const* inputs[World];
#pragma unroll
  for (int q = 0; q < World; ++q) {
    inputs[q] = p.own_slots + parity_slots + q * p.slot_bytes;
  }
  for (int64_t v = first; v < p.vectors; v += step) {
    uint4 loaded[World];
#pragma unroll
    for (int q = 0; q < World; ++q) {  // every load in flight before the first add
      loaded[q] = q == p.rank ? *reinterpret_cast<uint4 const*>(p.partial + v * 16)
                              : detail::one_shot_load_vector(inputs[q] + v * 16);
    }
    float acc[kElems];
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
      acc[i] = detail::to_float<In>(reinterpret_cast<In const*>(&loaded[0])[i]);
    }
#pragma unroll
    for (int q = 1; q < World; ++q) {  // rank order: every rank sums alike
      In const* e = reinterpret_cast<In const*>(&loaded[q]);
#pragma unroll
      for (int i = 0; i < kElems; ++i) {
        acc[i] += detail::to_float<In>(e[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
      acc[i] *= p.out_scale;
    }
    if (p.bias != nullptr) {
      detail::accumulate<In, kElems>(acc, p.bias + (v % p.n_vectors) * 16, p.bias_scale);
    }
    if (p.residual != nullptr) {
      detail::accumulate<Out, kElems>(acc, p.residual + v * kElems * int64_t(sizeof(Out)), 1.f);
    }
    detail::store<Out, kElems>(p.out + v * kElems * int64_t(sizeof(Out)), acc);
  }

  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t const finished = atomicAdd(p.counters + 1, 1u);
    if (finished == gridDim.x - 1) {  // the last block: every block has read counters[0]
      p.counters[1] = 0;
      p.counters[0] = epoch;
    }
  }
}

// The one-shot all-reduce followed by RMSNorm, one row per block at a time (so a block holds a whole row's sum of
// squares), with the same protocol as one_shot_all_reduce_kernel; the push and the sum both take the rows of this
// block, so the block's signal covers exactly what it reads.  Per row: h = out_scale * sum_q P_q + bias_scale * bias
// + residual, written to out (rounded to T); then, from the rounded h in fp32, r = rsqrt(mean(h^2) + eps) and
//   normed = T(T(h * r) * weight)        (weight_after_cast: Hugging Face's Llama)
//   normed = T(h * r * weight)           (otherwise: F.rms_norm)
// with every product computed in fp32 and rounded where the graph rounds it.
template <typename T, int World, int MaxWorld, int Threads>
__global__ void __launch_bounds__(Threads) one_shot_all_reduce_rms_norm_kernel(OneShotParams<MaxWorld> const p) {
  constexpr int kElems = 16 / int(sizeof(T));
  constexpr int kWarps = Threads / 32;
  __shared__ float warp_sums[kWarps];
  uint32_t const epoch = *reinterpret_cast<uint32_t const volatile*>(p.counters) + 1u;
  int64_t const parity_slots = int64_t(epoch & 1u) * World * p.slot_bytes;
  int64_t const rows = p.vectors / p.n_vectors;

  char* peers[World];
#pragma unroll
  for (int q = 0; q < World; ++q) {
    peers[q] = p.peer_slots[q] + parity_slots;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    for (int64_t v = row * p.n_vectors + threadIdx.x; v < (row + 1) * p.n_vectors; v += Threads) {
      uint4 const mine = *reinterpret_cast<uint4 const*>(p.partial + v * 16);
#pragma unroll
      for (int q = 0; q < World; ++q) {
        if (q != p.rank) {
          *reinterpret_cast<uint4*>(peers[q] + v * 16) = mine;
        }
      }
    }
  }
  if (detail::one_shot_signal_wait(p, epoch)) {
    if (p.trap_on_timeout) {
      __trap();
    }
    return;
  }

  char const* inputs[World];
#pragma unroll
  for (int q = 0; q < World; ++q) {
    inputs[q] = p.own_slots + parity_slots + q * p.slot_bytes;
  }
  float const inv_n = 1.f / float(p.n_vectors * kElems);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    float squares = 0.f;
    for (int64_t v = row * p.n_vectors + threadIdx.x; v < (row + 1) * p.n_vectors; v += Threads) {
      uint4 loaded[World];
#pragma unroll
      for (int q = 0; q < World; ++q) {
        loaded[q] = q == p.rank ? *reinterpret_cast<uint4 const*>(p.partial + v * 16)
                                : detail::one_shot_load_vector(inputs[q] + v * 16);
      }
      float acc[kElems];
#pragma unroll
      for (int i = 0; i < kElems; ++i) {
        acc[i] = detail::to_float<T>(reinterpret_cast<T const*>(&loaded[0])[i]);
      }
#pragma unroll
      for (int q = 1; q < World; ++q) {
        T const* e = reinterpret_cast<T const*>(&loaded[q]);
#pragma unroll
        for (int i = 0; i < kElems; ++i) {
          acc[i] += detail::to_float<T>(e[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < kElems; ++i) {
        acc[i] *= p.out_scale;
      }
      if (p.bias != nullptr) {
        detail::accumulate<T, kElems>(acc, p.bias + (v % p.n_vectors) * 16, p.bias_scale);
      }
      if (p.residual != nullptr) {
        detail::accumulate<T, kElems>(acc, p.residual + v * 16, 1.f);
      }
#pragma unroll
      for (int i = 0; i < kElems; ++i) {  // h as the graph holds it: rounded to T
        acc[i] = detail::to_float<T>(detail::from_float<T>(acc[i]));
        squares += acc[i] * acc[i];
      }
      detail::store<T, kElems>(p.out + v * 16, acc);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    }
    if (threadIdx.x % 32 == 0) {
      warp_sums[threadIdx.x / 32] = squares;
    }
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      total += warp_sums[w];
    }
    float const r = rsqrtf(total * inv_n + p.eps);
    for (int64_t v = row * p.n_vectors + threadIdx.x; v < (row + 1) * p.n_vectors; v += Threads) {
      float h[kElems] = {};
      detail::accumulate<T, kElems>(h, p.out + v * 16, 1.f);  // this thread's own store above
      float w[kElems] = {};
      detail::accumulate<T, kElems>(w, p.norm_weight + (v % p.n_vectors) * 16, 1.f);
#pragma unroll
      for (int i = 0; i < kElems; ++i) {
        h[i] = p.weight_after_cast ? detail::to_float<T>(detail::from_float<T>(h[i] * r)) * w[i] : h[i] * r * w[i];
      }
      detail::store<T, kElems>(p.normed + v * 16, h);
    }
    __syncthreads();  // warp_sums is read above before the next row writes it
  }

  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t const finished = atomicAdd(p.counters + 1, 1u);
    if (finished == gridDim.x - 1) {
      p.counters[1] = 0;
      p.counters[0] = epoch;
    }
  }
}

}  // namespace fluxinductor::allreduce
