// The one-shot all-reduce's entry points from Python (declared in one_shot_py.h): the launcher's arguments filled
// from plain integers, its error raised as an exception.  Host-compiled.
#include "allreduce/one_shot_py.h"

#include <stdexcept>
#include <string>

#include "allreduce/one_shot.h"

namespace fluxinductor::python {

void one_shot_all_reduce(int dtype, bool out_float, int64_t rows, int64_t n, int world, int rank,
                         std::vector<int64_t> buffers, int64_t slot_bytes, std::vector<int64_t> signals,
                         int64_t counters, int64_t partial, int64_t bias, int64_t residual, int64_t out, float out_scale, float bias_scale, int64_t error,
                         int64_t timeout_ns, bool trap_on_timeout, int blocks, int64_t stream,
                         int64_t norm_weight, int64_t normed, float eps, bool weight_after_cast) {
  namespace ar = fluxinductor::allreduce;
  if (world < 1 || world > ar::kOneShotMaxWorld || buffers.size() != size_t(world) || signals.size() != size_t(world)) {
    throw std::invalid_argument("one_shot_all_reduce: world " + std::to_string(world) + " (at most " +
                                std::to_string(ar::kOneShotMaxWorld) + ") with " + std::to_string(buffers.size()) +
                                " receive buffers and " + std::to_string(signals.size()) + " signal arrays");
  }
  ar::OneShotArgs args;
  args.dtype = dtype;
  args.out_float = out_float;
  args.rows = rows;
  args.n = n;
  args.world = world;
  args.rank = rank;
  for (int q = 0; q < world; ++q) {
    args.buffers[q] = reinterpret_cast<void*>(buffers[q]);
    args.signals[q] = reinterpret_cast<uint32_t*>(signals[q]);
  }
  args.slot_bytes = slot_bytes;
  args.counters = reinterpret_cast<uint32_t*>(counters);
  args.partial = reinterpret_cast<void const*>(partial);
  args.bias = reinterpret_cast<void const*>(bias);
  args.residual = reinterpret_cast<void const*>(residual);
  args.out = reinterpret_cast<void*>(out);
  args.out_scale = out_scale;
  args.bias_scale = bias_scale;
  args.error = reinterpret_cast<int32_t*>(error);
  args.timeout_ns = timeout_ns;
  args.trap_on_timeout = trap_on_timeout;
  args.blocks = blocks;
  args.norm_weight = reinterpret_cast<void const*>(norm_weight);
  args.normed = reinterpret_cast<void*>(normed);
  args.eps = eps;
  args.weight_after_cast = weight_after_cast;
  fluxinductor::Error const why = ar::one_shot_all_reduce(args, reinterpret_cast<void*>(stream));
  if (why.failed()) {
    throw std::runtime_error(why.message);
  }
}

int one_shot_blocks(int64_t rows, int64_t n, int element_size, int max_blocks, bool norm) {
  return fluxinductor::allreduce::one_shot_blocks(rows, n, element_size, max_blocks, norm);
}

}  // namespace fluxinductor::python
