// The inter-node reduction's entry point from Python (declared in reduce_arrivals_py.h).  Host-compiled.
#include "internode/reduce_arrivals_py.h"

#include <stdexcept>

#include "internode/reduce_arrivals.h"

namespace fluxinductor::python {

void reduce_arrivals(int dtype, int64_t rows, int64_t n, int world, int rank, int64_t slots, int64_t slot_stride,
                     int64_t flags, int64_t epoch, int64_t out, float scale, int64_t error, int64_t timeout_ns,
                     int64_t stream) {
  fluxinductor::internode::ReduceArrivalsArgs args;
  args.dtype = dtype;
  args.rows = rows;
  args.n = n;
  args.world = world;
  args.rank = rank;
  args.slots = reinterpret_cast<void const*>(slots);
  args.slot_stride = slot_stride;
  args.flags = reinterpret_cast<uint32_t const*>(flags);
  args.epoch = static_cast<uint32_t>(epoch);
  args.out = reinterpret_cast<void*>(out);
  args.scale = scale;
  args.error = reinterpret_cast<int32_t*>(error);
  args.timeout_ns = timeout_ns;
  fluxinductor::Error const why = fluxinductor::internode::reduce_arrivals(args, reinterpret_cast<void*>(stream));
  if (why.failed()) {
    throw std::runtime_error(why.message);
  }
}

}  // namespace fluxinductor::python
