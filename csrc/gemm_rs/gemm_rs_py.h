// The GEMM+RS's entry points from Python (csrc/gemm_rs/gemm_rs_py.cpp), exported by csrc/bindings.cpp under the
// same names.  Pointers and streams travel as integers (tensor.data_ptr(), stream.cuda_stream): no torch headers.
#pragma once

#include <cstdint>
#include <tuple>
#include <vector>

namespace fluxinductor::python {

// One rank's fused GEMM + reduce-scatter on `stream` (csrc/gemm_rs/gemm_rs.h GemmRsArgs): fills the launcher's
// arguments and raises on its error.  more_slabs: (a, lda, b, ldb, k) per K slab after the first, whose K is k_first.
void gemm_rs_run(int dtype, int m, int n, int k, int world, int rank, int64_t a, int64_t lda, int64_t b, int64_t ldb,
                 bool b_k_major, int64_t bias, int64_t out, int64_t ldo, float out_scale, std::vector<int64_t> buffers,
                 int64_t flags_offset, int64_t data_offset, uint32_t epoch, uint64_t signature, int64_t error,
                 int64_t timeout_ns, int sm_count, int64_t stream, int64_t outbox, int64_t counters, int bands,
                 int64_t copy_stream, bool split, int64_t bias_scaled, bool split_pdl,
                 int64_t tail_split_partials, int64_t tail_split_flags, uint32_t tail_split_epoch, int tail_split_parts,
                 int tail_split_waves, int split_config, bool out_float, bool capture, int tuning_config,
                 int swizzle, int raster, int batch_rows, int k_first, std::vector<int64_t> more_slabs);

// (tile_m, tile_n, flags_per_tile) of the GEMM+RS kernel of tuning configuration `tuning_config`: they fix its
// flag layout.
std::tuple<int, int, int> gemm_rs_tile_shape(int tuning_config);

}  // namespace fluxinductor::python
