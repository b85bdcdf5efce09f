// The AG+GEMM's entry points from Python (csrc/ag_gemm/ag_gemm_py.cpp), exported by csrc/bindings.cpp under the
// same names.  Pointers and streams travel as integers (tensor.data_ptr(), stream.cuda_stream): no torch headers.
// Each checks its arguments, fills the launcher's params (csrc/ag_gemm/ag_gemm.h) and raises on a launcher's error.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace fluxinductor::python {

// ag_gemm_run: out[M, N] = A[M, K] @ B[K, N] (+ bias) on `stream`, waiting per tile for the flags of the rows it reads.
void ag_gemm_run(int dtype, int64_t a, int64_t m, int64_t k, int64_t lda, int64_t b, int64_t n, int64_t ldb,
                 bool b_k_contiguous, int64_t bias, int64_t out, int64_t ldo, int64_t flags, uint32_t epoch, int rank,
                 int world, int64_t shard_rows, int chunks_per_rank, int k_chunks, int group_cluster_rows,
                 int sm_count, long long timeout_ns, int64_t error_word, int variant, int64_t split_partials,
                 int64_t split_flags, uint32_t split_epoch, int split_max_parts, int split_waves, int64_t a_local,
                 int64_t lda_local, bool pdl, bool trap_on_timeout, int64_t batch_rows, int64_t stream);

// Why ag_gemm_run cannot run these arguments (its arguments before the stream), or an empty string.
std::string ag_gemm_unsupported(int dtype, int64_t a, int64_t m, int64_t k, int64_t lda, int64_t b, int64_t n,
                                int64_t ldb, bool b_k_contiguous, int64_t bias, int64_t out, int64_t ldo,
                                int64_t flags, uint32_t epoch, int rank, int world, int64_t shard_rows,
                                int chunks_per_rank, int k_chunks, int group_cluster_rows, int sm_count,
                                long long timeout_ns, int64_t error_word, int variant, int64_t split_partials,
                                int64_t split_flags, uint32_t split_epoch, int split_max_parts, int split_waves,
                                int64_t a_local, int64_t lda_local, bool pdl, bool trap_on_timeout,
                                int64_t batch_rows);

// The per-call arrival on `stream` (ag_gemm.h arrive_and_wait).
void ag_arrive_and_wait(const std::vector<int64_t>& peer_arrivals, int64_t arrivals, int64_t passed, uint32_t epoch,
                        uint32_t need, int rank, long long timeout_ns, int64_t error_word, int64_t stream, bool reset);

// One eager push call enqueued whole (ag_gemm.h push_call); `gemms`: one tuple of ag_gemm_run's 34 arguments before
// the stream per GEMM; `own_into`, `gathered`, `buffer`: addresses, 0 for none.
void ag_push_call(const std::vector<int64_t>& peer_arrivals, int64_t arrivals, int64_t passed, uint32_t epoch,
                  uint32_t need, int rank, long long timeout_ns, int64_t error_word, int64_t shard, int64_t shard_rows,
                  int64_t k, int element_size, const std::vector<int64_t>& peer_buffers,
                  const std::vector<int64_t>& peer_flags, int chunks_per_rank, int k_chunks, int k_tile,
                  int64_t batch_rows, const std::vector<pybind11::tuple>& gemms, int64_t own_into, int64_t gathered,
                  int64_t buffer,
                  int64_t fork_event, int64_t join_event, int64_t main_stream, int64_t side_stream,
                  bool gemm_writes_a);

// Stream operations (csrc/common/stream_ops.h).
void ag_stream_write_value32(int64_t address, uint32_t value, int64_t stream);
void ag_stream_wait_value32_eq(int64_t address, uint32_t value, int64_t stream);
void ag_memcpy_async(int64_t dst, int64_t src, int64_t bytes, int64_t stream);
void ag_memcpy2d_async(int64_t dst, int64_t src, int64_t pitch, int64_t width, int64_t height, int64_t stream,
                       int64_t src_pitch);
int64_t ag_create_event();
// (host address, device address) of a zeroed host-mapped int32; never freed.
std::tuple<int64_t, int64_t> ag_alloc_host_mapped_word();

// (floats, uint32 flags) of the tail split's scratch for a grid of sm_count CTAs (0: all SMs), up to `waves` waves.
std::tuple<int64_t, int64_t> ag_tail_split_scratch(int sm_count, int waves);

}  // namespace fluxinductor::python
