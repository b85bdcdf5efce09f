// The GEMM+RS's entry points from Python (declared in gemm_rs_py.h): the launcher's arguments filled from plain
// integers, its error raised as an exception.  Host-compiled.
#include "gemm_rs/gemm_rs_py.h"

#include <stdexcept>
#include <vector>

#include "gemm_rs/gemm_rs.h"

namespace fluxinductor::python {

void gemm_rs_run(int dtype, int m, int n, int k, int world, int rank, int64_t a, int64_t lda, int64_t b, int64_t ldb,
                 bool b_k_major, int64_t bias, int64_t out, int64_t ldo, float out_scale, std::vector<int64_t> buffers,
                 int64_t flags_offset, int64_t data_offset, uint32_t epoch, uint64_t signature, int64_t error,
                 int64_t timeout_ns, int sm_count, int64_t stream, int64_t outbox, int64_t counters, int bands,
                 int64_t copy_stream, bool split, int64_t bias_scaled, bool split_pdl,
                 int64_t tail_split_partials, int64_t tail_split_flags, uint32_t tail_split_epoch, int tail_split_parts,
                 int tail_split_waves, int split_config, bool out_float, bool capture, int tuning_config,
                 int swizzle, int raster, int batch_rows, int k_first, std::vector<int64_t> more_slabs) {
  fluxinductor::GemmRsArgs args;
  args.dtype = dtype;
  args.out_float = out_float;
  args.m = m; args.n = n; args.k = k;
  args.world = world; args.rank = rank;
  args.a = reinterpret_cast<const void*>(a); args.lda = lda;
  args.b = reinterpret_cast<const void*>(b); args.ldb = ldb; args.b_k_major = b_k_major;
  args.bias = reinterpret_cast<const void*>(bias);
  args.out = reinterpret_cast<void*>(out); args.ldo = ldo;
  args.out_scale = out_scale;
  if (buffers.size() > size_t(fluxinductor::kGemmRsMaxWorld)) {
    throw std::invalid_argument("at most 8 buffers");
  }
  for (size_t r = 0; r < buffers.size(); ++r) {
    args.buffers[r] = reinterpret_cast<void*>(buffers[r]);
  }
  args.flags_offset = flags_offset; args.data_offset = data_offset;
  args.epoch = epoch; args.signature = signature;
  args.error = reinterpret_cast<int32_t*>(error);
  args.timeout_ns = timeout_ns;
  args.sm_count = sm_count;
  args.outbox = reinterpret_cast<void*>(outbox);  // 0: NVLink stores from the epilogue
  args.counters = reinterpret_cast<uint32_t*>(counters);
  args.bands = bands;
  args.copy_stream = reinterpret_cast<void*>(copy_stream);
  args.split = split;
  args.bias_scaled = reinterpret_cast<const void*>(bias_scaled);
  args.split_pdl = split_pdl;
  args.tail_split_partials = reinterpret_cast<float*>(tail_split_partials);
  args.tail_split_flags = reinterpret_cast<uint32_t*>(tail_split_flags);
  args.tail_split_epoch = tail_split_epoch;
  args.tail_split_parts = tail_split_parts;
  args.tail_split_waves = tail_split_waves;
  args.split_config = split_config;
  args.capture = capture;
  args.tuning_config = tuning_config;
  args.swizzle = swizzle;
  args.raster = raster;
  args.batch_rows = batch_rows;
  if (more_slabs.size() % 5 != 0 || more_slabs.size() > 5 * 2) {
    throw std::invalid_argument("more_slabs: (a, lda, b, ldb, k) for at most two slabs after the first");
  }
  args.slabs = 1 + int(more_slabs.size() / 5);
  args.k_first = args.slabs > 1 ? k_first : 0;
  for (int s = 1; s < args.slabs; ++s) {
    int64_t const* slab = more_slabs.data() + 5 * (s - 1);
    args.a_more[s - 1] = reinterpret_cast<const void*>(slab[0]);
    args.lda_more[s - 1] = slab[1];
    args.b_more[s - 1] = reinterpret_cast<const void*>(slab[2]);
    args.ldb_more[s - 1] = slab[3];
    args.k_more[s - 1] = int(slab[4]);
  }
  if (fluxinductor::gemm_rs_run(args, reinterpret_cast<void*>(stream)) != 0) {
    throw std::runtime_error(fluxinductor::gemm_rs_last_error());
  }
}

std::tuple<int, int, int> gemm_rs_tile_shape(int tuning_config) {
  return {fluxinductor::gemm_rs_tile_m(tuning_config), fluxinductor::gemm_rs_tile_n(tuning_config), fluxinductor::gemm_rs_warps_per_tile()};
}

}  // namespace fluxinductor::python
