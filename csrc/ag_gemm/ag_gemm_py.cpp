// The AG+GEMM's entry points from Python (declared in ag_gemm_py.h): argument checks, the launchers' params filled
// from plain integers, a launcher's error raised as an exception.  Host-compiled, so no std::string or exception
// crosses into the nvcc-compiled launchers (they return an Error).
#include "ag_gemm/ag_gemm_py.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "ag_gemm/ag_gemm.h"
#include "common/stream_ops.h"

namespace fluxinductor::python {
namespace {

namespace py = pybind11;

void check_ok(const Error& error) {
  if (error.failed()) {
    throw std::runtime_error(error.message);
  }
}

ag_gemm::AllGatherGemmParams make_ag_gemm_params(int dtype, int64_t a, int64_t m, int64_t k, int64_t lda, int64_t b,
                                                 int64_t n, int64_t ldb, bool b_k_contiguous, int64_t bias, int64_t out,
                                                 int64_t ldo, int64_t flags, uint32_t epoch, int rank, int world,
                                                 int64_t shard_rows, int chunks_per_rank, int k_chunks,
                                                 int group_cluster_rows, int sm_count, long long timeout_ns,
                                                 int64_t error_word, int variant, int64_t split_partials,
                                                 int64_t split_flags, uint32_t split_epoch, int split_max_parts,
                                                 int split_waves, int64_t a_local = 0, int64_t lda_local = 0,
                                                 bool pdl = false, bool trap_on_timeout = false,
                                                 int64_t batch_rows = 0) {
  ag_gemm::AllGatherGemmParams p;
  if (dtype != int(ag_gemm::DType::kBFloat16) && dtype != int(ag_gemm::DType::kFloat16)) {
    throw std::invalid_argument("dtype must be 0 (bfloat16) or 1 (float16)");
  }
  p.dtype = ag_gemm::DType(dtype);
  p.a = reinterpret_cast<const void*>(a);
  p.m = m; p.k = k; p.lda = lda;
  p.b = reinterpret_cast<const void*>(b);
  p.n = n; p.ldb = ldb; p.b_k_contiguous = b_k_contiguous;
  p.bias = reinterpret_cast<const void*>(bias);
  p.out = reinterpret_cast<void*>(out);
  p.ldo = ldo;
  p.flags = reinterpret_cast<const uint32_t*>(flags);
  p.epoch = epoch; p.rank = rank; p.world = world; p.shard_rows = shard_rows;
  p.chunks_per_rank = chunks_per_rank; p.k_chunks = k_chunks;
  p.group_cluster_rows = group_cluster_rows; p.sm_count = sm_count;
  p.timeout_ns = timeout_ns;
  p.error_word = reinterpret_cast<int*>(error_word);
  p.variant = ag_gemm::Variant(variant);
  p.split_partials = reinterpret_cast<float*>(split_partials);
  p.split_flags = reinterpret_cast<uint32_t*>(split_flags);
  p.split_epoch = split_epoch; p.split_max_parts = split_max_parts; p.split_waves = split_waves;
  p.a_local = reinterpret_cast<const void*>(a_local);
  p.lda_local = lda_local;
  p.pdl = pdl;
  p.trap_on_timeout = trap_on_timeout;
  p.batch_rows = batch_rows;
  return p;
}

// The arrival's parameters (ag_arrive_and_wait, and the arrival inside ag_push_call).
ag_gemm::ArrivalParams make_arrival_params(const std::vector<int64_t>& peer_arrivals, int64_t arrivals, int64_t passed,
                                           uint32_t epoch, uint32_t need, int rank, long long timeout_ns,
                                           int64_t error_word, bool reset = false) {
  if (peer_arrivals.empty() || peer_arrivals.size() > size_t(ag_gemm::kMaxArrivalWorld)) {
    throw std::invalid_argument("peer_arrivals: one address per rank, at most " +
                                std::to_string(ag_gemm::kMaxArrivalWorld));
  }
  ag_gemm::ArrivalParams p;
  p.world = int(peer_arrivals.size());
  for (size_t q = 0; q < peer_arrivals.size(); ++q) {
    p.peer_arrivals[q] = reinterpret_cast<uint32_t*>(peer_arrivals[q]);
  }
  p.arrivals = reinterpret_cast<const uint32_t*>(arrivals);
  p.passed = reinterpret_cast<uint32_t*>(passed);
  p.epoch = epoch; p.need = need; p.rank = rank; p.timeout_ns = timeout_ns;
  p.error_word = reinterpret_cast<int*>(error_word);
  p.reset = reset;
  return p;
}

}  // namespace

void ag_gemm_run(int dtype, int64_t a, int64_t m, int64_t k, int64_t lda, int64_t b, int64_t n, int64_t ldb,
                 bool b_k_contiguous, int64_t bias, int64_t out, int64_t ldo, int64_t flags, uint32_t epoch, int rank,
                 int world, int64_t shard_rows, int chunks_per_rank, int k_chunks, int group_cluster_rows,
                 int sm_count, long long timeout_ns, int64_t error_word, int variant, int64_t split_partials,
                 int64_t split_flags, uint32_t split_epoch, int split_max_parts, int split_waves, int64_t a_local,
                 int64_t lda_local, bool pdl, bool trap_on_timeout, int64_t batch_rows, int64_t stream) {
  check_ok(ag_gemm::all_gather_gemm(
      make_ag_gemm_params(dtype, a, m, k, lda, b, n, ldb, b_k_contiguous, bias, out, ldo, flags, epoch, rank, world,
                          shard_rows, chunks_per_rank, k_chunks, group_cluster_rows, sm_count, timeout_ns, error_word,
                          variant, split_partials, split_flags, split_epoch, split_max_parts, split_waves, a_local,
                          lda_local, pdl, trap_on_timeout, batch_rows),
      reinterpret_cast<void*>(stream)));
}

std::string ag_gemm_unsupported(int dtype, int64_t a, int64_t m, int64_t k, int64_t lda, int64_t b, int64_t n,
                                int64_t ldb, bool b_k_contiguous, int64_t bias, int64_t out, int64_t ldo,
                                int64_t flags, uint32_t epoch, int rank, int world, int64_t shard_rows,
                                int chunks_per_rank, int k_chunks, int group_cluster_rows, int sm_count,
                                long long timeout_ns, int64_t error_word, int variant, int64_t split_partials,
                                int64_t split_flags, uint32_t split_epoch, int split_max_parts, int split_waves,
                                int64_t a_local, int64_t lda_local, bool pdl, bool trap_on_timeout,
                                int64_t batch_rows) {
  return std::string(ag_gemm::all_gather_gemm_unsupported(make_ag_gemm_params(
      dtype, a, m, k, lda, b, n, ldb, b_k_contiguous, bias, out, ldo, flags, epoch, rank, world, shard_rows,
      chunks_per_rank, k_chunks, group_cluster_rows, sm_count, timeout_ns, error_word, variant, split_partials,
      split_flags, split_epoch, split_max_parts, split_waves, a_local, lda_local, pdl, trap_on_timeout,
      batch_rows)).message);
}

void ag_arrive_and_wait(const std::vector<int64_t>& peer_arrivals, int64_t arrivals, int64_t passed, uint32_t epoch,
                        uint32_t need, int rank, long long timeout_ns, int64_t error_word, int64_t stream, bool reset) {
  check_ok(ag_gemm::arrive_and_wait(
      make_arrival_params(peer_arrivals, arrivals, passed, epoch, need, rank, timeout_ns, error_word, reset),
      reinterpret_cast<void*>(stream)));
}

void ag_push_call(const std::vector<int64_t>& peer_arrivals, int64_t arrivals, int64_t passed, uint32_t epoch,
                  uint32_t need, int rank, long long timeout_ns, int64_t error_word, int64_t shard, int64_t shard_rows,
                  int64_t k, int element_size, const std::vector<int64_t>& peer_buffers,
                  const std::vector<int64_t>& peer_flags, int chunks_per_rank, int k_chunks, int k_tile,
                  int64_t batch_rows, const std::vector<py::tuple>& gemms, int64_t own_into, int64_t gathered,
                  int64_t buffer,
                  int64_t fork_event, int64_t join_event, int64_t main_stream, int64_t side_stream,
                  bool gemm_writes_a) {
  int const world = int(peer_arrivals.size());
  if (world < 1 || world > ag_gemm::kMaxArrivalWorld || peer_buffers.size() != peer_arrivals.size() ||
      peer_flags.size() != peer_arrivals.size()) {
    throw std::invalid_argument("ag_push_call: one arrival word, buffer and flag address per rank, at most " +
                                std::to_string(ag_gemm::kMaxArrivalWorld) + " ranks");
  }
  if (gemms.empty() || gemms.size() > size_t(ag_gemm::kMaxPushGemms)) {
    throw std::invalid_argument("ag_push_call: 1 to " + std::to_string(ag_gemm::kMaxPushGemms) + " GEMMs");
  }
  ag_gemm::PushCallParams p;
  p.arrival = make_arrival_params(peer_arrivals, arrivals, passed, epoch, need, rank, timeout_ns, error_word);
  for (int q = 0; q < world; ++q) {
    p.peer_buffers[q] = reinterpret_cast<void*>(peer_buffers[q]);
    p.peer_flags[q] = reinterpret_cast<uint32_t*>(peer_flags[q]);
  }
  p.shard = reinterpret_cast<const void*>(shard);
  p.shard_rows = shard_rows; p.k = k; p.element_size = element_size;
  p.chunks_per_rank = chunks_per_rank; p.k_chunks = k_chunks; p.k_tile = k_tile; p.batch_rows = batch_rows;
  for (size_t i = 0; i < gemms.size(); ++i) {
    py::tuple const& g = gemms[i];
    if (g.size() != 34) {
      throw std::invalid_argument("ag_push_call: each GEMM is ag_gemm_run's 34 arguments before the stream");
    }
    p.gemms[i] = make_ag_gemm_params(
        g[0].cast<int>(), g[1].cast<int64_t>(), g[2].cast<int64_t>(), g[3].cast<int64_t>(),
        g[4].cast<int64_t>(), g[5].cast<int64_t>(), g[6].cast<int64_t>(), g[7].cast<int64_t>(),
        g[8].cast<bool>(), g[9].cast<int64_t>(), g[10].cast<int64_t>(), g[11].cast<int64_t>(),
        g[12].cast<int64_t>(), g[13].cast<uint32_t>(), g[14].cast<int>(), g[15].cast<int>(),
        g[16].cast<int64_t>(), g[17].cast<int>(), g[18].cast<int>(), g[19].cast<int>(), g[20].cast<int>(),
        g[21].cast<long long>(), g[22].cast<int64_t>(), g[23].cast<int>(), g[24].cast<int64_t>(),
        g[25].cast<int64_t>(), g[26].cast<uint32_t>(), g[27].cast<int>(), g[28].cast<int>(),
        g[29].cast<int64_t>(), g[30].cast<int64_t>(), g[31].cast<bool>(), g[32].cast<bool>(),
        g[33].cast<int64_t>());
  }
  p.gemm_count = int(gemms.size());
  p.own_into = reinterpret_cast<void*>(own_into);
  p.gathered = reinterpret_cast<void*>(gathered);
  p.buffer = reinterpret_cast<const void*>(buffer);
  p.gemm_writes_a = gemm_writes_a;
  p.fork_event = reinterpret_cast<void*>(fork_event);
  p.join_event = reinterpret_cast<void*>(join_event);
  check_ok(ag_gemm::push_call(p, reinterpret_cast<void*>(main_stream), reinterpret_cast<void*>(side_stream)));
}

void ag_stream_write_value32(int64_t address, uint32_t value, int64_t stream) {
  check_ok(stream_write_value32(reinterpret_cast<void*>(address), value, reinterpret_cast<void*>(stream)));
}

void ag_stream_wait_value32_eq(int64_t address, uint32_t value, int64_t stream) {
  check_ok(stream_wait_value32_eq(reinterpret_cast<const void*>(address), value, reinterpret_cast<void*>(stream)));
}

void ag_memcpy_async(int64_t dst, int64_t src, int64_t bytes, int64_t stream) {
  check_ok(memcpy_async(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes,
                        reinterpret_cast<void*>(stream)));
}

void ag_memcpy2d_async(int64_t dst, int64_t src, int64_t pitch, int64_t width, int64_t height, int64_t stream,
                       int64_t src_pitch) {
  check_ok(memcpy2d_async(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), pitch, width, height,
                          reinterpret_cast<void*>(stream), src_pitch));
}

int64_t ag_create_event() {
  int64_t event = 0;
  check_ok(create_event(&event));
  return event;
}

std::tuple<int64_t, int64_t> ag_alloc_host_mapped_word() {
  int64_t host = 0, device = 0;
  check_ok(alloc_host_mapped_word(&host, &device));
  return {host, device};
}

std::tuple<int64_t, int64_t> ag_tail_split_scratch(int sm_count, int waves) {
  return {ag_gemm::tail_split_scratch_floats(sm_count, waves), ag_gemm::tail_split_flag_count(sm_count, waves)};
}

}  // namespace fluxinductor::python
