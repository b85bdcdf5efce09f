// The inter-node reduction's entry point from Python (csrc/internode/reduce_arrivals_py.cpp), exported by
// csrc/bindings.cpp under the same name.  Pointers and streams travel as integers.
#pragma once

#include <cstdint>

namespace fluxinductor::python {

// csrc/internode/reduce_arrivals.h on `stream`; raises on a refused launch.
void reduce_arrivals(int dtype, int64_t rows, int64_t n, int world, int rank, int64_t slots, int64_t slot_stride,
                     int64_t flags, int64_t epoch, int64_t out, float scale, int64_t error, int64_t timeout_ns,
                     int64_t stream);

}  // namespace fluxinductor::python
