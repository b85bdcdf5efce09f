// The one-shot all-reduce's launcher (declared in one_shot.h): argument checks, the kernel's params, and its
// instantiations over (partial dtype, output dtype, world).
#include "allreduce/one_shot.h"

#include <cuda_runtime.h>

#include <cstdio>

#include "fluxinductor/allreduce/one_shot.cuh"

namespace fluxinductor::allreduce {
namespace {

using Params = OneShotParams<kOneShotMaxWorld>;

int element_size(int dtype) { return dtype == 2 ? 4 : 2; }

template <typename In, typename Out, int World>
cudaError_t launch(Params const& params, int blocks, cudaStream_t stream) {
  one_shot_all_reduce_kernel<In, Out, World, kOneShotMaxWorld, kOneShotThreads>
      <<<blocks, kOneShotThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

template <typename T, int World>
cudaError_t launch_norm(Params const& params, int blocks, cudaStream_t stream) {
  one_shot_all_reduce_rms_norm_kernel<T, World, kOneShotMaxWorld, kOneShotThreads>
      <<<blocks, kOneShotThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_norm_world(Params const& params, int blocks, cudaStream_t stream) {
  switch (params.world) {
    case 1: return launch_norm<T, 1>(params, blocks, stream);
    case 2: return launch_norm<T, 2>(params, blocks, stream);
    case 3: return launch_norm<T, 3>(params, blocks, stream);
    case 4: return launch_norm<T, 4>(params, blocks, stream);
    case 5: return launch_norm<T, 5>(params, blocks, stream);
    case 6: return launch_norm<T, 6>(params, blocks, stream);
    case 7: return launch_norm<T, 7>(params, blocks, stream);
    case 8: return launch_norm<T, 8>(params, blocks, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename In, typename Out>
cudaError_t launch_world(Params const& params, int blocks, cudaStream_t stream) {
  switch (params.world) {
    case 1: return launch<In, Out, 1>(params, blocks, stream);
    case 2: return launch<In, Out, 2>(params, blocks, stream);
    case 3: return launch<In, Out, 3>(params, blocks, stream);
    case 4: return launch<In, Out, 4>(params, blocks, stream);
    case 5: return launch<In, Out, 5>(params, blocks, stream);
    case 6: return launch<In, Out, 6>(params, blocks, stream);
    case 7: return launch<In, Out, 7>(params, blocks, stream);
    case 8: return launch<In, Out, 8>(params, blocks, stream);
    default: return cudaErrorInvalidValue;
  }
}

bool aligned(void const* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

int one_shot_blocks(int64_t rows, int64_t n, int element_size, int max_blocks, bool norm) {
  int64_t const vectors = rows * n * element_size / 16;
  int64_t const wanted = norm ? rows : (vectors + kOneShotThreads - 1) / kOneShotThreads;
  int64_t const cap = max_blocks < 1 ? 1 : (max_blocks > kOneShotMaxBlocks ? kOneShotMaxBlocks : max_blocks);
  return int(wanted < 1 ? 1 : (wanted > cap ? cap : wanted));
}

Error one_shot_all_reduce(OneShotArgs const& a, void* stream) {
  Error why;
  auto fail = [&](char const* format, auto... values) {
    std::snprintf(why.message, sizeof(why.message), format, values...);
    return why;
  };
  if (a.dtype < 0 || a.dtype > 2) {
    return fail("one_shot_all_reduce: dtype code %d (0 bf16, 1 fp16, 2 fp32)", a.dtype);
  }
  if (a.out_float && a.dtype == 2) {
    return fail("one_shot_all_reduce: out_float with fp32 partials");
  }
  if (a.world < 1 || a.world > kOneShotMaxWorld || a.rank < 0 || a.rank >= a.world) {
    return fail("one_shot_all_reduce: rank %d of %d (world at most %d)", a.rank, a.world, kOneShotMaxWorld);
  }
  int const element = element_size(a.dtype);
  if (a.rows < 0 || a.n <= 0 || (a.n * element) % 16 != 0) {
    return fail("one_shot_all_reduce: [%lld, %lld] elements of %d bytes: a row must be a multiple of 16 bytes",
                static_cast<long long>(a.rows), static_cast<long long>(a.n), element);
  }
  if (a.blocks < 0 || a.blocks > kOneShotMaxBlocks) {
    return fail("one_shot_all_reduce: %d blocks (at most %d)", a.blocks, kOneShotMaxBlocks);
  }
  if (a.rows == 0) {
    return why;
  }
  int64_t const bytes = a.rows * a.n * element;
  if (a.counters == nullptr || a.out == nullptr || a.partial == nullptr || !aligned(a.out) || !aligned(a.bias) ||
      !aligned(a.residual) || !aligned(a.partial)) {
    return fail("one_shot_all_reduce: counters %p, partial %p, out %p, bias %p, residual %p (partial, out, bias and "
                "residual 16-byte aligned)", static_cast<void*>(a.counters), a.partial, a.out, a.bias, a.residual);
  }
  if (a.slot_bytes < bytes || a.slot_bytes % 16 != 0) {
    return fail("one_shot_all_reduce: slots of %lld bytes for a partial of %lld (a multiple of 16 at least as large)",
                static_cast<long long>(a.slot_bytes), static_cast<long long>(bytes));
  }
  bool const norm = a.norm_weight != nullptr;
  if (norm && (a.out_float || a.normed == nullptr || !aligned(a.normed) || !aligned(a.norm_weight))) {
    return fail("one_shot_all_reduce: RMSNorm needs normed %p and norm_weight %p 16-byte aligned and out in the "
                "partials' dtype", a.normed, a.norm_weight);
  }
  Params p{};
  for (int q = 0; q < a.world; ++q) {
    if (a.buffers[q] == nullptr || !aligned(a.buffers[q]) || a.signals[q] == nullptr) {
      return fail("one_shot_all_reduce: rank %d's receive buffer %p (16-byte aligned) or signal words %p missing", q,
                  a.buffers[q], static_cast<void*>(a.signals[q]));
    }
    p.peer_slots[q] = static_cast<char*>(a.buffers[q]) + a.rank * a.slot_bytes;
    p.peer_words[q] = a.signals[q] + a.rank;
  }
  p.partial = static_cast<char const*>(a.partial);
  p.own_slots = static_cast<char const*>(a.buffers[a.rank]);
  p.slot_bytes = a.slot_bytes;
  p.own_words = a.signals[a.rank];
  p.counters = a.counters;
  p.bias = static_cast<char const*>(a.bias);
  p.residual = static_cast<char const*>(a.residual);
  p.out = static_cast<char*>(a.out);
  p.norm_weight = static_cast<char const*>(a.norm_weight);
  p.normed = static_cast<char*>(a.normed);
  p.eps = a.eps;
  p.weight_after_cast = a.weight_after_cast;
  p.vectors = a.rows * a.n * element / 16;
  p.n_vectors = a.n * element / 16;
  p.world = a.world;
  p.rank = a.rank;
  p.max_world = kOneShotMaxWorld;
  p.out_scale = a.out_scale;
  p.bias_scale = a.bias_scale;
  p.error = a.error;
  p.timeout_ns = a.timeout_ns;
  p.trap_on_timeout = a.trap_on_timeout;
  int const blocks = a.blocks > 0 ? a.blocks : one_shot_blocks(a.rows, a.n, element, kOneShotMaxBlocks, norm);
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t status;
  if (norm) {
    status = a.dtype == 0   ? launch_norm_world<__nv_bfloat16>(p, blocks, s)
             : a.dtype == 1 ? launch_norm_world<__half>(p, blocks, s)
                            : launch_norm_world<float>(p, blocks, s);
  } else if (a.dtype == 0) {
    status = a.out_float ? launch_world<__nv_bfloat16, float>(p, blocks, s)
                         : launch_world<__nv_bfloat16, __nv_bfloat16>(p, blocks, s);
  } else if (a.dtype == 1) {
    status = a.out_float ? launch_world<__half, float>(p, blocks, s) : launch_world<__half, __half>(p, blocks, s);
  } else {
    status = launch_world<float, float>(p, blocks, s);
  }
  if (status != cudaSuccess) {
    return fail("one_shot_all_reduce launch: %s", cudaGetErrorString(status));
  }
  return why;
}

}  // namespace fluxinductor::allreduce
