// The one-shot all-reduce's entry points from Python (csrc/allreduce/one_shot_py.cpp), exported by csrc/bindings.cpp
// under the same names.  Pointers and streams travel as integers (tensor.data_ptr(), stream.cuda_stream).
#pragma once

#include <cstdint>
#include <vector>

namespace fluxinductor::python {

// One rank's one-shot all-reduce on `stream` (csrc/allreduce/one_shot.h OneShotArgs); raises on a refused launch.
void one_shot_all_reduce(int dtype, bool out_float, int64_t rows, int64_t n, int world, int rank,
                         std::vector<int64_t> buffers, int64_t slot_bytes, std::vector<int64_t> signals,
                         int64_t counters, int64_t partial, int64_t bias, int64_t residual, int64_t out, float out_scale, float bias_scale, int64_t error,
                         int64_t timeout_ns, bool trap_on_timeout, int blocks, int64_t stream,
                         int64_t norm_weight, int64_t normed, float eps, bool weight_after_cast);

// The grid a call launches with (csrc/allreduce/one_shot.h one_shot_blocks).
int one_shot_blocks(int64_t rows, int64_t n, int element_size, int max_blocks, bool norm);

}  // namespace fluxinductor::python
