// The one pybind11 binding file of fluxinductor._C: it only declares (the ops' *_py.h) and exports.  Argument
// checks and the launchers' params live in each op's *_py.cpp; the launchers (csrc/<op>/*.cu) take raw pointers,
// sizes, strides and a stream, and stay free of torch headers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ag_gemm/ag_gemm.h"
#include "ag_gemm/ag_gemm_py.h"
#include "allreduce/one_shot.h"
#include "allreduce/one_shot_py.h"
#include "gemm_rs/gemm_rs.h"
#include "gemm_rs/gemm_rs_py.h"
#include "internode/reduce_arrivals.h"
#include "internode/reduce_arrivals_py.h"
#if defined(FLUXINDUCTOR_KERNEL_TUNING)
#include "tuning/probe_stock_gemm_py.h"
#endif

namespace py = pybind11;
namespace api = fluxinductor::python;

namespace {

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
      py::arg("trap_on_timeout") = false, py::arg("batch_rows") = 0

void export_ag_gemm(py::module_& m) {
  m.def("ag_gemm_run", &api::ag_gemm_run,
        "out[M, N] = A[M, K] @ B[K, N] (+ bias) on `stream`, waiting per tile for the flags of the rows it reads",
        FLUXINDUCTOR_AG_GEMM_ARGS, py::arg("stream"));
  m.def("ag_gemm_unsupported", &api::ag_gemm_unsupported,
        "why ag_gemm_run cannot run these arguments, or an empty string", FLUXINDUCTOR_AG_GEMM_ARGS);
  m.def("ag_stream_write_value32", &api::ag_stream_write_value32,
        "cuStreamWriteValue32: write `value` to device `address` when `stream` reaches this point",
        py::arg("address"), py::arg("value"), py::arg("stream"));
  m.def("ag_stream_wait_value32_eq", &api::ag_stream_wait_value32_eq,
        "cuStreamWaitValue32 (EQ): `stream` waits until the device word at `address` equals `value`",
        py::arg("address"), py::arg("value"), py::arg("stream"));
  m.def("ag_arrive_and_wait", &api::ag_arrive_and_wait,
        "the AG+GEMM's per-call arrival on `stream` (ag_gemm.h arrive_and_wait): write `epoch` into every peer's "
        "arrival word for this rank (peer_arrivals[q]; the entry for `rank` is unused), wait until each of this "
        "rank's words (arrivals[q]) is at least `need`, then set *passed = epoch (and with `reset` this rank's words "
        "back to 0); traps after timeout_ns",
        py::arg("peer_arrivals"), py::arg("arrivals"), py::arg("passed"), py::arg("epoch"), py::arg("need"),
        py::arg("rank"), py::arg("timeout_ns"), py::arg("error_word"), py::arg("stream"), py::arg("reset") = false);
  m.def("ag_push_call", &api::ag_push_call,
        "one eager push call of the AG+GEMM (ag_gemm.h push_call) enqueued whole: the side stream's fork, the "
        "arrival, the push with its flags, the shard into this rank's rows of `own_into` (0: none), the GEMMs "
        "(`gemms`: ag_gemm_run's arguments before the stream, one tuple per GEMM), the peers' rows of `buffer` into "
        "`gathered` (0: none) and the join; batch_rows > 0: the buffers are batch-major (ag_gemm.h); with "
        "`gemm_writes_a` the first GEMM writes those rows instead of the copies where its variant can",
        py::arg("peer_arrivals"), py::arg("arrivals"), py::arg("passed"), py::arg("epoch"), py::arg("need"),
        py::arg("rank"), py::arg("timeout_ns"), py::arg("error_word"), py::arg("shard"), py::arg("shard_rows"),
        py::arg("k"), py::arg("element_size"), py::arg("peer_buffers"), py::arg("peer_flags"),
        py::arg("chunks_per_rank"), py::arg("k_chunks"), py::arg("k_tile"), py::arg("batch_rows"), py::arg("gemms"),
        py::arg("own_into"),
        py::arg("gathered"), py::arg("buffer"), py::arg("fork_event"), py::arg("join_event"), py::arg("main_stream"),
        py::arg("side_stream"), py::arg("gemm_writes_a") = true);
  m.def("ag_create_event", &api::ag_create_event,
        "a cudaEvent_t (timing off) on the current device, as an integer; never destroyed");
  m.def("ag_memcpy_async", &api::ag_memcpy_async, "cudaMemcpyAsync device-to-device (copy engine) on `stream`",
        py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("stream"));
  m.def("ag_memcpy2d_async", &api::ag_memcpy2d_async,
        "cudaMemcpy2DAsync device-to-device (copy engine) on `stream`: `height` rows of `width` bytes, row pitch "
        "`pitch` at dst and `src_pitch` at src (0: `pitch`)",
        py::arg("dst"), py::arg("src"), py::arg("pitch"), py::arg("width"), py::arg("height"), py::arg("stream"),
        py::arg("src_pitch") = 0);
  m.def("ag_alloc_host_mapped_word", &api::ag_alloc_host_mapped_word,
        "a zeroed host-mapped int32: (host address, device address); never freed");
  m.def("ag_device_sm_count", &fluxinductor::ag_gemm::device_sm_count, "SM count of the current device");
  m.def("ag_tail_split_scratch", &api::ag_tail_split_scratch,
        "(floats, uint32 flags) of the tail split's scratch for a grid of sm_count CTAs (0: all SMs) whose split "
        "tail runs in up to `waves` waves",
        py::arg("sm_count") = 0, py::arg("waves") = 1);
  m.def("ag_tail_split_parts", &fluxinductor::ag_gemm::tail_split_parts_for,
        "the parts a split tail of `tail` tiles on `clusters` clusters takes (1: no split)", py::arg("tail"),
        py::arg("clusters"), py::arg("max_parts"), py::arg("max_waves"));
}

#undef FLUXINDUCTOR_AG_GEMM_ARGS

void export_gemm_rs(py::module_& m) {
  m.def("gemm_rs_run", &api::gemm_rs_run,
        "One rank's fused GEMM + reduce-scatter on `stream` (see csrc/gemm_rs/gemm_rs.h for the buffer layout)",
        py::arg("dtype"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("world"), py::arg("rank"), py::arg("a"),
        py::arg("lda"), py::arg("b"), py::arg("ldb"), py::arg("b_k_major"), py::arg("bias"), py::arg("out"),
        py::arg("ldo"), py::arg("out_scale"), py::arg("buffers"), py::arg("flags_offset"), py::arg("data_offset"),
        py::arg("epoch"), py::arg("signature"), py::arg("error"), py::arg("timeout_ns"), py::arg("sm_count"),
        py::arg("stream"), py::arg("outbox"), py::arg("counters"), py::arg("bands"),
        py::arg("copy_stream"), py::arg("split"), py::arg("bias_scaled"), py::arg("split_pdl"),
        py::arg("tail_split_partials") = 0, py::arg("tail_split_flags") = 0, py::arg("tail_split_epoch") = 0,
        py::arg("tail_split_parts") = 1, py::arg("tail_split_waves") = 1, py::arg("split_config") = 0,
        py::arg("out_float") = false, py::arg("capture") = false, py::arg("tuning_config") = 0,
        py::arg("swizzle") = 0, py::arg("raster") = -1, py::arg("batch_rows") = 0, py::arg("k_first") = 0,
        py::arg("more_slabs") = std::vector<int64_t>{});
  m.attr("GEMM_RS_MAX_BANDS") = fluxinductor::kGemmRsMaxBands;
  m.def("gemm_rs_tile_shape", &api::gemm_rs_tile_shape,
        "(tile_m, tile_n, flags_per_tile) of the GEMM+RS kernel of this tuning configuration: they fix its flag layout",
        py::arg("tuning_config") = 0);
  m.def("gemm_rs_tuning_build", &fluxinductor::gemm_rs_tuning_build,
        "whether this is a tuning build (-DFLUXINDUCTOR_KERNEL_TUNING=ON): the kernels' tuning variants (csrc/tuning/, "
        "gemm_rs_run's tuning_config) and the probe_stock_gemm_* functions are there");
}

void export_one_shot(py::module_& m) {
  m.def("one_shot_all_reduce", &api::one_shot_all_reduce,
        "One rank's one-shot all-reduce on `stream` (csrc/allreduce/one_shot.h): out = out_scale * sum of every "
        "rank's partial (this rank's pushed into every peer's receive buffer, as mapped here) + bias_scale * bias + "
        "residual; with norm_weight, also normed = rms_norm(out) (csrc/allreduce/one_shot.h)",
        py::arg("dtype"), py::arg("out_float"), py::arg("rows"), py::arg("n"), py::arg("world"), py::arg("rank"),
        py::arg("buffers"), py::arg("slot_bytes"), py::arg("signals"), py::arg("counters"), py::arg("partial"),
        py::arg("bias"), py::arg("residual"),
        py::arg("out"), py::arg("out_scale"), py::arg("bias_scale"), py::arg("error"), py::arg("timeout_ns"),
        py::arg("trap_on_timeout"), py::arg("blocks"), py::arg("stream"), py::arg("norm_weight") = 0,
        py::arg("normed") = 0, py::arg("eps") = 1e-5f, py::arg("weight_after_cast") = true);
  m.def("one_shot_blocks", &api::one_shot_blocks, "the grid a one-shot call launches with", py::arg("rows"),
        py::arg("n"), py::arg("element_size"), py::arg("max_blocks"), py::arg("norm") = false);
  m.attr("ONE_SHOT_MAX_WORLD") = fluxinductor::allreduce::kOneShotMaxWorld;
  m.attr("ONE_SHOT_MAX_BLOCKS") = fluxinductor::allreduce::kOneShotMaxBlocks;
  m.attr("ONE_SHOT_SIGNAL_WORDS") = fluxinductor::allreduce::kOneShotSignalWords;
  m.attr("ONE_SHOT_COUNTER_WORDS") = fluxinductor::allreduce::kOneShotCounterWords;
}

void export_internode(py::module_& m) {
  m.def("reduce_arrivals", &api::reduce_arrivals,
        "The inter-node GEMM+RS's reduction on `stream` (csrc/internode/reduce_arrivals.h): once every sender's flag "
        "reached epoch, out = scale * sum of the slots in rank order",
        py::arg("dtype"), py::arg("rows"), py::arg("n"), py::arg("world"), py::arg("rank"), py::arg("slots"),
        py::arg("slot_stride"), py::arg("flags"), py::arg("epoch"), py::arg("out"), py::arg("scale"),
        py::arg("error"), py::arg("timeout_ns"), py::arg("stream"));
  m.attr("REDUCE_ARRIVALS_TIMEOUT") = int(fluxinductor::internode::kReduceArrivalsTimeout);
}

#if defined(FLUXINDUCTOR_KERNEL_TUNING)
// Measurement only (csrc/tuning/probe_stock_gemm.h): stock CUTLASS GEMMs on the AG+GEMM kernel's tiles.
void export_probes(py::module_& m) {
  m.def("probe_stock_gemm_workspace", &api::probe_stock_gemm_workspace,
        "workspace bytes of a stock CUTLASS GEMM configuration (-1: unknown configuration)", py::arg("config"),
        py::arg("m"), py::arg("n"), py::arg("k"), py::arg("sm_count") = 0);
  m.def("probe_stock_gemm_run", &api::probe_stock_gemm_run,
        "out[m, n] = a[m, k] @ b (bf16, b K-major) with a stock CUTLASS GEMM configuration",
        py::arg("config"), py::arg("a"), py::arg("m"), py::arg("k"), py::arg("lda"), py::arg("b"), py::arg("n"),
        py::arg("ldb"), py::arg("out"), py::arg("ldo"), py::arg("workspace"), py::arg("sm_count"), py::arg("stream"));
}
#endif

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fluxinductor fused AG+GEMM and GEMM+RS kernels (CUTLASS sm90a), the one-shot all-reduce and the "
            "inter-node reduction";
  export_ag_gemm(m);
  export_gemm_rs(m);
  export_one_shot(m);
  export_internode(m);
#if defined(FLUXINDUCTOR_KERNEL_TUNING)
  export_probes(m);
#endif
}
