// The one pybind11 binding file of fluxinductor._C: it only exports.  Launchers (csrc/*.cu, declared in
// csrc/*.h) take raw pointers, sizes, strides and a stream, and stay free of torch headers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace py = pybind11;

// ---- AG+GEMM (section owned by the AG+GEMM kernel work) -------------------------------------------
#include <stdexcept>
#include <string>
#include <vector>

#include "ag_gemm.h"
#include "probe_stock_gemm.h"

namespace ag_gemm_bindings {

namespace agg = fluxinductor::ag_gemm;

void check_ok(const agg::Error& error) {
  if (error.failed()) {
    throw std::runtime_error(error.message);
  }
}

// Pointers and the stream travel as integers (tensor.data_ptr(), stream.cuda_stream): no torch headers here.
agg::AllGatherGemmParams make_ag_gemm_params(int dtype, int64_t a, int64_t m, int64_t k, int64_t lda, int64_t b,
                                             int64_t n, int64_t ldb, bool b_k_contiguous, int64_t bias, int64_t out,
                                             int64_t ldo, int64_t flags, uint32_t epoch, int rank, int world,
                                             int64_t shard_rows, int chunks_per_rank, int k_chunks,
                                             int group_cluster_rows, int sm_count, long long timeout_ns,
                                             int64_t error_word, int variant, int64_t split_partials,
                                             int64_t split_flags, uint32_t split_epoch, int split_max_parts,
                                             int split_waves, int64_t a_local = 0, int64_t lda_local = 0,
                                             bool pdl = false, bool trap_on_timeout = false) {
  agg::AllGatherGemmParams p;
  if (dtype != int(agg::DType::kBFloat16) && dtype != int(agg::DType::kFloat16)) {
    throw std::invalid_argument("dtype must be 0 (bfloat16) or 1 (float16)");
  }
  p.dtype = agg::DType(dtype);
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
  p.variant = agg::Variant(variant);
  p.split_partials = reinterpret_cast<float*>(split_partials);
  p.split_flags = reinterpret_cast<uint32_t*>(split_flags);
  p.split_epoch = split_epoch; p.split_max_parts = split_max_parts; p.split_waves = split_waves;
  p.a_local = reinterpret_cast<const void*>(a_local);
  p.lda_local = lda_local;
  p.pdl = pdl;
  p.trap_on_timeout = trap_on_timeout;
  return p;
}

// The arrival's parameters (ag_arrive_and_wait, and the arrival inside ag_push_call).
agg::ArrivalParams make_arrival_params(const std::vector<int64_t>& peer_arrivals, int64_t arrivals, int64_t passed,
                                       uint32_t epoch, uint32_t need, int rank, long long timeout_ns,
                                       int64_t error_word, bool reset = false) {
  if (peer_arrivals.empty() || peer_arrivals.size() > size_t(agg::kMaxArrivalWorld)) {
    throw std::invalid_argument("peer_arrivals: one address per rank, at most " +
                                std::to_string(agg::kMaxArrivalWorld));
  }
  agg::ArrivalParams p;
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

#define FLUXINDUCTOR_AG_GEMM_ARGS                                                                           \
  py::arg("dtype"), py::arg("a"), py::arg("m"), py::arg("k"), py::arg("lda"), py::arg("b"), py::arg("n"),    \
      py::arg("ldb"), py::arg("b_k_contiguous"), py::arg("bias"), py::arg("out"), py::arg("ldo"),           \
      py::arg("flags") = 0, py::arg("epoch") = 0, py::arg("rank") = 0, py::arg("world") = 1,                 \
      py::arg("shard_rows") = 0, py::arg("chunks_per_rank") = 1, py::arg("k_chunks") = 1,                    \
      py::arg("group_cluster_rows") = 8,                                                                   \
      py::arg("sm_count") = 0, py::arg("timeout_ns") = 5000000000LL, py::arg("error_word") = 0,         \
      py::arg("variant") = 0, py::arg("split_partials") = 0, py::arg("split_flags") = 0,                    \
      py::arg("split_epoch") = 0, py::arg("split_max_parts") = 1, py::arg("split_waves") = 1,               \
      py::arg("a_local") = 0, py::arg("lda_local") = 0, py::arg("pdl") = false,                              \
      py::arg("trap_on_timeout") = false

void export_ag_gemm(py::module_& m) {
  m.def(
      "ag_gemm_run",
      [](int dtype, int64_t a, int64_t mm, int64_t k, int64_t lda, int64_t b, int64_t n, int64_t ldb,
         bool b_k_contiguous, int64_t bias, int64_t out, int64_t ldo, int64_t flags, uint32_t epoch, int rank,
         int world, int64_t shard_rows, int chunks_per_rank, int k_chunks, int group_cluster_rows,
         int sm_count, long long timeout_ns, int64_t error_word, int variant, int64_t split_partials,
         int64_t split_flags, uint32_t split_epoch, int split_max_parts, int split_waves, int64_t a_local,
         int64_t lda_local, bool pdl, bool trap_on_timeout, int64_t stream) {
        check_ok(agg::all_gather_gemm(
            make_ag_gemm_params(dtype, a, mm, k, lda, b, n, ldb, b_k_contiguous, bias, out, ldo, flags, epoch, rank,
                                world, shard_rows, chunks_per_rank, k_chunks, group_cluster_rows, sm_count, timeout_ns,
                                error_word, variant, split_partials, split_flags, split_epoch, split_max_parts,
                                split_waves, a_local, lda_local, pdl, trap_on_timeout),
            reinterpret_cast<void*>(stream)));
      },
      "out[M, N] = A[M, K] @ B[K, N] (+ bias) on `stream`, waiting per tile for the flags of the rows it reads",
      FLUXINDUCTOR_AG_GEMM_ARGS, py::arg("stream"));
  m.def(
      "ag_gemm_unsupported",
      [](int dtype, int64_t a, int64_t mm, int64_t k, int64_t lda, int64_t b, int64_t n, int64_t ldb,
         bool b_k_contiguous, int64_t bias, int64_t out, int64_t ldo, int64_t flags, uint32_t epoch, int rank,
         int world, int64_t shard_rows, int chunks_per_rank, int k_chunks, int group_cluster_rows,
         int sm_count, long long timeout_ns, int64_t error_word, int variant, int64_t split_partials,
         int64_t split_flags, uint32_t split_epoch, int split_max_parts, int split_waves, int64_t a_local,
         int64_t lda_local, bool pdl, bool trap_on_timeout) {
        return std::string(agg::all_gather_gemm_unsupported(make_ag_gemm_params(
            dtype, a, mm, k, lda, b, n, ldb, b_k_contiguous, bias, out, ldo, flags, epoch, rank, world, shard_rows,
            chunks_per_rank, k_chunks, group_cluster_rows, sm_count, timeout_ns, error_word, variant, split_partials,
            split_flags, split_epoch, split_max_parts, split_waves, a_local, lda_local, pdl, trap_on_timeout)).message);
      },
      "why ag_gemm_run cannot run these arguments, or an empty string", FLUXINDUCTOR_AG_GEMM_ARGS);
  m.def(
      "ag_stream_write_value32",
      [](int64_t address, uint32_t value, int64_t stream) {
        check_ok(agg::stream_write_value32(reinterpret_cast<void*>(address), value, reinterpret_cast<void*>(stream)));
      },
      "cuStreamWriteValue32: write `value` to device `address` when `stream` reaches this point",
      py::arg("address"), py::arg("value"), py::arg("stream"));
  m.def(
      "ag_stream_wait_value32_eq",
      [](int64_t address, uint32_t value, int64_t stream) {
        check_ok(agg::stream_wait_value32_eq(reinterpret_cast<const void*>(address), value,
                                             reinterpret_cast<void*>(stream)));
      },
      "cuStreamWaitValue32 (EQ): `stream` waits until the device word at `address` equals `value`",
      py::arg("address"), py::arg("value"), py::arg("stream"));
  m.def(
      "ag_arrive_and_wait",
      [](const std::vector<int64_t>& peer_arrivals, int64_t arrivals, int64_t passed, uint32_t epoch, uint32_t need,
         int rank, long long timeout_ns, int64_t error_word, int64_t stream, bool reset) {
        check_ok(agg::arrive_and_wait(make_arrival_params(peer_arrivals, arrivals, passed, epoch, need, rank,
                                                          timeout_ns, error_word, reset),
                                      reinterpret_cast<void*>(stream)));
      },
      "the AG+GEMM's per-call arrival on `stream` (ag_gemm.h arrive_and_wait): write `epoch` into every peer's "
      "arrival word for this rank (peer_arrivals[q]; the entry for `rank` is unused), wait until each of this rank's "
      "words (arrivals[q]) is at least `need`, then set *passed = epoch (and with `reset` this rank's words back to 0); "
      "traps after timeout_ns",
      py::arg("peer_arrivals"), py::arg("arrivals"), py::arg("passed"), py::arg("epoch"), py::arg("need"),
      py::arg("rank"), py::arg("timeout_ns"), py::arg("error_word"), py::arg("stream"), py::arg("reset") = false);
  m.def(
      "ag_push_call",
      [](const std::vector<int64_t>& peer_arrivals, int64_t arrivals, int64_t passed, uint32_t epoch, uint32_t need,
         int rank, long long timeout_ns, int64_t error_word, int64_t shard, int64_t shard_rows, int64_t k,
         int element_size, const std::vector<int64_t>& peer_buffers, const std::vector<int64_t>& peer_flags,
         int64_t epoch_word, int chunks_per_rank, int k_chunks, int k_tile, const std::vector<py::tuple>& gemms,
         int64_t fork_event, int64_t join_event, int64_t main_stream, int64_t side_stream) {
        int const world = int(peer_arrivals.size());
        if (world < 1 || world > agg::kMaxArrivalWorld || peer_buffers.size() != peer_arrivals.size() ||
            peer_flags.size() != peer_arrivals.size()) {
          throw std::invalid_argument("ag_push_call: one arrival word, buffer and flag address per rank, at most " +
                                      std::to_string(agg::kMaxArrivalWorld) + " ranks");
        }
        if (gemms.empty() || gemms.size() > size_t(agg::kMaxPushGemms)) {
          throw std::invalid_argument("ag_push_call: 1 to " + std::to_string(agg::kMaxPushGemms) + " GEMMs");
        }
        agg::PushCallParams p;
        p.arrival = make_arrival_params(peer_arrivals, arrivals, passed, epoch, need, rank, timeout_ns, error_word);
        for (int q = 0; q < world; ++q) {
          p.peer_buffers[q] = reinterpret_cast<void*>(peer_buffers[q]);
          p.peer_flags[q] = reinterpret_cast<uint32_t*>(peer_flags[q]);
        }
        p.shard = reinterpret_cast<const void*>(shard);
        p.shard_rows = shard_rows; p.k = k; p.element_size = element_size;
        p.epoch_word = reinterpret_cast<uint32_t*>(epoch_word);
        p.chunks_per_rank = chunks_per_rank; p.k_chunks = k_chunks; p.k_tile = k_tile;
        for (size_t i = 0; i < gemms.size(); ++i) {
          py::tuple const& g = gemms[i];
          if (g.size() != 33) {
            throw std::invalid_argument("ag_push_call: each GEMM is ag_gemm_run's 33 arguments before the stream");
          }
          p.gemms[i] = make_ag_gemm_params(
              g[0].cast<int>(), g[1].cast<int64_t>(), g[2].cast<int64_t>(), g[3].cast<int64_t>(),
              g[4].cast<int64_t>(), g[5].cast<int64_t>(), g[6].cast<int64_t>(), g[7].cast<int64_t>(),
              g[8].cast<bool>(), g[9].cast<int64_t>(), g[10].cast<int64_t>(), g[11].cast<int64_t>(),
              g[12].cast<int64_t>(), g[13].cast<uint32_t>(), g[14].cast<int>(), g[15].cast<int>(),
              g[16].cast<int64_t>(), g[17].cast<int>(), g[18].cast<int>(), g[19].cast<int>(), g[20].cast<int>(),
              g[21].cast<long long>(), g[22].cast<int64_t>(), g[23].cast<int>(), g[24].cast<int64_t>(),
              g[25].cast<int64_t>(), g[26].cast<uint32_t>(), g[27].cast<int>(), g[28].cast<int>(),
              g[29].cast<int64_t>(), g[30].cast<int64_t>(), g[31].cast<bool>(), g[32].cast<bool>());
        }
        p.gemm_count = int(gemms.size());
        p.fork_event = reinterpret_cast<void*>(fork_event);
        p.join_event = reinterpret_cast<void*>(join_event);
        check_ok(agg::push_call(p, reinterpret_cast<void*>(main_stream), reinterpret_cast<void*>(side_stream)));
      },
      "one eager push call of the AG+GEMM (ag_gemm.h push_call) enqueued whole: the side stream's fork, the arrival, "
      "the push with its flags, the GEMMs (`gemms`: ag_gemm_run's arguments before the stream, one tuple per GEMM) "
      "and the join",
      py::arg("peer_arrivals"), py::arg("arrivals"), py::arg("passed"), py::arg("epoch"), py::arg("need"),
      py::arg("rank"), py::arg("timeout_ns"), py::arg("error_word"), py::arg("shard"), py::arg("shard_rows"),
      py::arg("k"), py::arg("element_size"), py::arg("peer_buffers"), py::arg("peer_flags"), py::arg("epoch_word"),
      py::arg("chunks_per_rank"), py::arg("k_chunks"), py::arg("k_tile"), py::arg("gemms"), py::arg("fork_event"),
      py::arg("join_event"), py::arg("main_stream"), py::arg("side_stream"));
  m.def(
      "ag_create_event",
      []() {
        int64_t event = 0;
        check_ok(agg::create_event(&event));
        return event;
      },
      "a cudaEvent_t (timing off) on the current device, as an integer; never destroyed");
  m.def(
      "ag_memcpy_async",
      [](int64_t dst, int64_t src, int64_t bytes, int64_t stream) {
        check_ok(agg::memcpy_async(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes,
                                   reinterpret_cast<void*>(stream)));
      },
      "cudaMemcpyAsync device-to-device (copy engine) on `stream`", py::arg("dst"), py::arg("src"),
      py::arg("bytes"), py::arg("stream"));
  m.def(
      "ag_memcpy2d_async",
      [](int64_t dst, int64_t src, int64_t pitch, int64_t width, int64_t height, int64_t stream) {
        check_ok(agg::memcpy2d_async(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), pitch, width,
                                     height, reinterpret_cast<void*>(stream)));
      },
      "cudaMemcpy2DAsync device-to-device (copy engine) on `stream`: `height` rows of `width` bytes, row pitch "
      "`pitch` on both sides", py::arg("dst"), py::arg("src"), py::arg("pitch"), py::arg("width"), py::arg("height"),
      py::arg("stream"));
  m.def(
      "ag_alloc_host_mapped_word",
      []() {
        int64_t host = 0, device = 0;
        check_ok(agg::alloc_host_mapped_word(&host, &device));  // NOLINT
        return py::make_tuple(host, device);
      },
      "a zeroed host-mapped int32: (host address, device address); never freed");
  m.def("ag_device_sm_count", &agg::device_sm_count, "SM count of the current device");
  m.def("ag_tail_split_scratch", [](int sm_count, int waves) {
        return py::make_tuple(agg::tail_split_scratch_floats(sm_count, waves),
                              agg::tail_split_flag_count(sm_count, waves));
      },
      "(floats, uint32 flags) of the tail split's scratch for a grid of sm_count CTAs (0: all SMs) whose split tail "
      "runs in up to `waves` waves",
      py::arg("sm_count") = 0, py::arg("waves") = 1);
  m.def("ag_tail_split_parts", &agg::tail_split_parts_for,
        "the parts a split tail of `tail` tiles on `clusters` clusters takes (1: no split)", py::arg("tail"),
        py::arg("clusters"), py::arg("max_parts"), py::arg("max_waves"));
  // Measurement only (csrc/probe_stock_gemm.h; tuning builds): stock CUTLASS GEMMs on the AG+GEMM kernel's tiles.
  m.def("probe_stock_gemm_workspace", &fluxinductor::probe::stock_gemm_workspace,
        "workspace bytes of a stock CUTLASS GEMM configuration (-1: not in this build)", py::arg("config"),
        py::arg("m"), py::arg("n"), py::arg("k"), py::arg("sm_count") = 0);
  m.def(
      "probe_stock_gemm_run",
      [](int config, int64_t a, int m, int k, int64_t lda, int64_t b, int n, int64_t ldb, int64_t out, int64_t ldo,
         int64_t workspace, int sm_count, int64_t stream) {
        char error[384] = {0};
        if (fluxinductor::probe::stock_gemm_run(config, reinterpret_cast<const void*>(a), m, k, lda,
                                                reinterpret_cast<const void*>(b), n, ldb, reinterpret_cast<void*>(out),
                                                ldo, reinterpret_cast<void*>(workspace), sm_count,
                                                reinterpret_cast<void*>(stream), error, int(sizeof(error))) != 0) {
          throw std::runtime_error(error);
        }
      },
      "out[m, n] = a[m, k] @ b (bf16, b K-major) with a stock CUTLASS GEMM configuration (tuning builds)",
      py::arg("config"), py::arg("a"), py::arg("m"), py::arg("k"), py::arg("lda"), py::arg("b"), py::arg("n"),
      py::arg("ldb"), py::arg("out"), py::arg("ldo"), py::arg("workspace"), py::arg("sm_count"), py::arg("stream"));
}

#undef FLUXINDUCTOR_AG_GEMM_ARGS

}  // namespace ag_gemm_bindings
// ---- end AG+GEMM -----------------------------------------------------------------------------------

// ---- GEMM+RS (section owned by the GEMM+RS kernel work) -------------------------------------------
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "gemm_rs.h"

namespace gemm_rs_bindings {

// Pointers and the stream travel as integers (tensor.data_ptr(), stream.cuda_stream): no torch headers here.
void run(int dtype, int m, int n, int k, int world, int rank, int64_t a, int64_t lda, int64_t b, int64_t ldb,
         bool b_k_major, int64_t bias, int64_t out, int64_t ldo, float out_scale, std::vector<int64_t> buffers,
         int64_t flags_offset, int64_t data_offset, uint32_t epoch, uint64_t signature, int64_t error,
         int64_t timeout_ns, int sm_count, int64_t stream, int64_t outbox, int64_t counters, int64_t epoch_word,
         int bands, int64_t copy_stream, bool split, int64_t bias_scaled, bool split_pdl, int64_t tail_split_partials,
         int64_t tail_split_flags, uint32_t tail_split_epoch, int tail_split_parts, int tail_split_waves,
         int split_config, bool out_float, bool capture, int tuning_config, int swizzle, int raster) {
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
  args.epoch_word = reinterpret_cast<uint32_t*>(epoch_word);
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
  if (fluxinductor::gemm_rs_run(args, reinterpret_cast<void*>(stream)) != 0) {
    throw std::runtime_error(fluxinductor::gemm_rs_last_error());
  }
}

void export_gemm_rs(py::module_& m) {
  m.def("gemm_rs_run", &run,
        "One rank's fused GEMM + reduce-scatter on `stream` (see csrc/gemm_rs.h for the buffer layout)",
        py::arg("dtype"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("world"), py::arg("rank"), py::arg("a"),
        py::arg("lda"), py::arg("b"), py::arg("ldb"), py::arg("b_k_major"), py::arg("bias"), py::arg("out"),
        py::arg("ldo"), py::arg("out_scale"), py::arg("buffers"), py::arg("flags_offset"), py::arg("data_offset"),
        py::arg("epoch"), py::arg("signature"), py::arg("error"), py::arg("timeout_ns"), py::arg("sm_count"),
        py::arg("stream"), py::arg("outbox"), py::arg("counters"), py::arg("epoch_word"), py::arg("bands"),
        py::arg("copy_stream"), py::arg("split"), py::arg("bias_scaled"), py::arg("split_pdl"),
        py::arg("tail_split_partials") = 0, py::arg("tail_split_flags") = 0, py::arg("tail_split_epoch") = 0,
        py::arg("tail_split_parts") = 1, py::arg("tail_split_waves") = 1, py::arg("split_config") = 0,
        py::arg("out_float") = false, py::arg("capture") = false, py::arg("tuning_config") = 0,
        py::arg("swizzle") = 0, py::arg("raster") = -1);
  m.attr("GEMM_RS_MAX_BANDS") = fluxinductor::kGemmRsMaxBands;
  m.def("gemm_rs_tile_shape", [](int tuning_config) {
    return py::make_tuple(fluxinductor::gemm_rs_tile_m(tuning_config), fluxinductor::gemm_rs_tile_n(tuning_config),
                          fluxinductor::gemm_rs_warps_per_tile());
  }, "(tile_m, tile_n, flags_per_tile) of the GEMM+RS kernel of this tuning configuration: they fix its flag layout",
        py::arg("tuning_config") = 0);
  m.def("gemm_rs_tuning_build", &fluxinductor::gemm_rs_tuning_build,
        "whether gemm_rs_run's tuning_config can pick a tuning variant (CUDAFLAGS=-DFLUXINDUCTOR_KERNEL_TUNING)");
  m.def("gemm_rs_alloc_host_word", [] {
    int64_t host = 0, device = 0;
    if (fluxinductor::gemm_rs_alloc_host_word(&host, &device) != 0) {
      throw std::runtime_error(fluxinductor::gemm_rs_last_error());
    }
    return py::make_tuple(host, device);
  }, "(host address, device address) of a new zeroed host-mapped int32 error word");
}

}  // namespace gemm_rs_bindings
// ---- end GEMM+RS -----------------------------------------------------------------------------------

PYBIND11_MODULE(_C, m) {
  m.doc() = "fluxinductor fused AG+GEMM and GEMM+RS kernels (CUTLASS sm90a)";
  // AG+GEMM exports
  ag_gemm_bindings::export_ag_gemm(m);
  // GEMM+RS exports
  gemm_rs_bindings::export_gemm_rs(m);
}
