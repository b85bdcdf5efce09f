// GEMM+RS launchers: CUTLASS sm90a instantiations (bf16, fp16) x (B K-major, B N-major), the argument
// checks, and the per-call handshake launch.  Torch-free; see gemm_rs.h for the contract.
#include "gemm_rs/gemm_rs.h"

// Tuning builds (CMake -DFLUXINDUCTOR_KERNEL_TUNING=ON) add every kernel's tuning variants, this file's too.
#if defined(FLUXINDUCTOR_KERNEL_TUNING) && !defined(FLUXINDUCTOR_GEMM_RS_TUNING)
#define FLUXINDUCTOR_GEMM_RS_TUNING
#endif

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "fluxinductor/gemm_rs/kernel.cuh"
#include "fluxinductor/common/blocked_rows.cuh"
#include "fluxinductor/common/cutlass_launch.cuh"
#include "fluxinductor/common/stream_memops.h"
#include "gemm_rs/split.h"

namespace fluxinductor {
namespace {

thread_local std::string g_last_error;

int fail(std::string message) {
  g_last_error = std::move(message);
  return -1;
}

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)

// One kernel configuration: (schedule, tile, cluster).  kThreads: the threads sharing a tile's epilogue.
// kAsyncPush: peer tiles leave by bulk copies, flags published late (GemmRsEpilogue).
template <class Schedule_, int TileM_, int TileN_, int ClusterM_, int ClusterN_, bool AsyncPush_ = false>
struct GemmRsShape {
  using KernelSchedule = Schedule_;
  static constexpr int kTileM = TileM_;
  static constexpr int kTileN = TileN_;
  static constexpr bool kAsyncPush = AsyncPush_;
  static constexpr int kThreads =
      cute::is_same_v<Schedule_, cutlass::gemm::KernelTmaWarpSpecializedCooperative> ? 256 : 128;
  using TileShape = cute::Shape<cute::Int<TileM_>, cute::Int<TileN_>, cute::_64>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM_>, cute::Int<ClusterN_>, cute::_1>;
};

// The shipped configuration (measured on H200, see docs/design_gemm_rs.md): ping-pong, so one math warp
// group's epilogue (the NVLink stores, the peer reads) runs under the other's MMAs.
using DefaultShape = GemmRsShape<cutlass::gemm::KernelTmaWarpSpecializedPingpong, 128, 128, 2, 1>;

template <class Element, class LayoutB, class Shape, class ElementOut_ = Element>
struct GemmRsConfig {
  using ElementOut = ElementOut_;                             // the reduced rows (float: autocast's fp32 reduction)
  using ElementA = Element;                                   // A: this rank's K slice, row-major
  using LayoutA = cutlass::layout::RowMajor;
  using ElementB = Element;                                   // B: K-major (ColumnMajor) or N-major (RowMajor)
  using ElementAccumulator = float;
  using TileShape = typename Shape::TileShape;                // one tile = one flag
  using ClusterShape = typename Shape::ClusterShape;          // B tile multicast along the cluster's M
  using KernelSchedule = typename Shape::KernelSchedule;
  using Epilogue =                                            // staged, peer-aware
      GemmRsEpilogue<Element, Shape::kTileM, Shape::kTileN, Shape::kThreads, Shape::kAsyncPush,
                     default_sub_n<Shape::kTileN>(), ElementOut>;
  using CollectiveEpilogue = GemmRsCollectiveEpilogue<Epilogue>;
  using CollectiveMainloop = BlockedRowsMainloop<typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementA, LayoutA, 8,                                     // 16-byte TMA alignment
      ElementB, LayoutB, 8,
      ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp>;                           // A by segments or, batch-major, by blocks
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>,                          // (M/world, N, K, world segments)
      CollectiveMainloop, CollectiveEpilogue,
      RotatedPersistentScheduler>;                              // peers' segments first, own last
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  static constexpr int kTileM = Shape::kTileM;
  static constexpr int kTileN = Shape::kTileN;
  static_assert(Shape::kThreads == int(cute::size(typename CollectiveMainloop::TiledMma{})));
};

// Tile order by segment size, measured on 2 x H200 (docs/design_gemm_rs.md): from
// 2048 rows per segment up, swizzle 4 along N beat the stock order (M=8192,K=8192,N=28672: 3.12 vs 3.22 ms
// fused); below it, swizzling delayed the own tiles' inputs (M=1024: 0.32 vs 0.20 ms fused).
struct TileOrder {
  int swizzle;
  int raster;  // 0 heuristic, 1 along M, 2 along N
};
constexpr int kLargeSegmentRows = 2048;
constexpr TileOrder kLargeSegmentOrder{4, 2};
constexpr TileOrder kSmallSegmentOrder{1, 0};

int device_sm_count() {
  static int count = [] {
    int device = 0;
    cudaGetDevice(&device);
    return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }();
  return count;
}

// Copy-engine mode: (tile rows per band, bands) for a segment of tiles_m tile rows.
struct Bands {
  int tile_rows;
  int count;
};
Bands band_split(int tiles_m, int wanted) {
  wanted = wanted < 1 ? 1 : (wanted > kGemmRsMaxBands ? kGemmRsMaxBands : wanted);
  int const per = (tiles_m + wanted - 1) / wanted;
  return {per, (tiles_m + per - 1) / per};
}

// Events that join the copy stream to the caller's stream, one pair per (host thread, device): a record is
// followed at once by the wait on it, so reusing them across calls and streams is safe.
struct JoinEvents {
  cudaEvent_t start = nullptr;  // caller's stream -> copy stream: the handshake is done, counters are zero
  cudaEvent_t done = nullptr;   // copy stream -> caller's stream: every band has left
};
cudaError_t join_events(JoinEvents** out) {
  thread_local std::map<int, JoinEvents> events;
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  JoinEvents& ev = events[device];
  if (ev.start == nullptr) {
    if ((status = cudaEventCreateWithFlags(&ev.start, cudaEventDisableTiming)) != cudaSuccess) return status;
    if ((status = cudaEventCreateWithFlags(&ev.done, cudaEventDisableTiming)) != cudaSuccess) return status;
  }
  *out = &ev;
  return cudaSuccess;
}

// One band on the copy stream: wait until `count` tiles of it are stored, copy `height` rows of `width` bytes
// (row pitch `pitch` on both sides) into the peer's slot, then write the epoch into the peer's flag (a stream write,
// whose memory barrier orders it after the band's bytes).
int send_band(GemmRsArgs const& args, uint32_t* counter, uint32_t count, char* dst, char const* src, size_t pitch,
              size_t width, size_t height, char* peer_flag) {
  auto copy_stream = static_cast<cudaStream_t>(args.copy_stream);
  CUresult result = stream_wait_geq(copy_stream, counter, count);
  if (result != CUDA_SUCCESS) {
    return fail("cuStreamWaitValue32 failed with CUresult " + std::to_string(int(result)));
  }
  cudaError_t status = height == 1 ? cudaMemcpyAsync(dst, src, width, cudaMemcpyDeviceToDevice, copy_stream)
                                   : cudaMemcpy2DAsync(dst, pitch, src, pitch, width, height,
                                                       cudaMemcpyDeviceToDevice, copy_stream);
  if (status != cudaSuccess) {
    return fail(std::string("GEMM+RS band copy failed: ") + cudaGetErrorString(status));
  }
  result = stream_write(copy_stream, reinterpret_cast<uint32_t*>(peer_flag), args.epoch);
  if (result != CUDA_SUCCESS) {
    return fail("cuStreamWriteValue32 (a band's flag) failed with CUresult " + std::to_string(int(result)));
  }
  return 0;
}

// Enqueues on the copy stream, for each peer in the kernel's segment order and each band of its segment:
// wait for the band's tile count, copy the band from the outbox into the peer's slot for this rank, then raise
// the peer's flag of (this rank, band) to the epoch (send_band).
// flags_per_src: the flag region's stride per source rank (the default kernel's tiles per segment).
int enqueue_band_copies(GemmRsArgs const& args, int tile_m, int tiles_m, int tiles_n, Bands bands,
                        size_t element_bytes, int64_t flags_per_src) {
  int64_t const segment_rows = args.m / args.world;
  int64_t const row_bytes = int64_t(args.n) * int64_t(element_bytes);
  for (int step = 1; step < args.world; ++step) {
    int const peer = (args.rank + step) % args.world;
    char* peer_base = static_cast<char*>(args.buffers[peer]);
    for (int b = 0; b < bands.count; ++b) {
      int const t0 = b * bands.tile_rows;
      int const t1 = t0 + bands.tile_rows < tiles_m ? t0 + bands.tile_rows : tiles_m;
      int64_t const r0 = int64_t(t0) * tile_m;
      int64_t const r1 = int64_t(t1) * tile_m < segment_rows ? int64_t(t1) * tile_m : segment_rows;
      char const* src = static_cast<char const*>(args.outbox) + (peer * segment_rows + r0) * row_bytes;
      char* dst = peer_base + args.data_offset + (args.rank * segment_rows + r0) * row_bytes;
      size_t const bytes = size_t((r1 - r0) * row_bytes);
      if (int rc = send_band(args, args.counters + peer * bands.count + b, uint32_t((t1 - t0) * tiles_n), dst, src,
                             bytes, bytes, 1, peer_base + args.flags_offset + 4 * (args.rank * flags_per_src + b));
          rc != 0) {
        return rc;
      }
    }
  }
  return 0;
}

// The per-call handshake (gemm_rs_hello_kernel) on the caller's stream.
int launch_hello(GemmRsArgs const& args, cudaStream_t stream) {
  RsHelloParams hello{};
  for (int r = 0; r < args.world; ++r) {
    hello.buffers[r] = static_cast<char*>(args.buffers[r]);
  }
  hello.world = args.world;
  hello.rank = args.rank;
  hello.epoch = args.epoch;
  hello.signature = args.signature;
  hello.error = args.error;
  hello.timeout_ns = args.timeout_ns;
  hello.capture = args.capture;
  gemm_rs_hello_kernel<<<1, 32, 0, stream>>>(hello);
  cudaError_t launch = cudaGetLastError();
  if (launch != cudaSuccess) {
    return fail(std::string("GEMM+RS handshake launch failed: ") + cudaGetErrorString(launch));
  }
  return 0;
}

// Counters start at zero; the copy stream starts after the handshake (every peer finished its previous call, so
// its slots are free).
int start_copy_stream(GemmRsArgs const& args, Bands bands, cudaStream_t stream, JoinEvents** join) {
  auto copy_stream = static_cast<cudaStream_t>(args.copy_stream);
  cudaError_t prep = cudaMemsetAsync(args.counters, 0, sizeof(uint32_t) * args.world * bands.count, stream);
  if (prep == cudaSuccess) prep = join_events(join);
  if (prep == cudaSuccess) prep = cudaEventRecord((*join)->start, stream);
  if (prep == cudaSuccess) prep = cudaStreamWaitEvent(copy_stream, (*join)->start, 0);
  if (prep != cudaSuccess) {
    return fail(std::string("GEMM+RS copy-engine setup failed: ") + cudaGetErrorString(prep));
  }
  return 0;
}

// The caller's stream continues only once every band has left.
int join_copy_stream(GemmRsArgs const& args, JoinEvents* join, cudaStream_t stream) {
  cudaError_t status = cudaEventRecord(join->done, static_cast<cudaStream_t>(args.copy_stream));
  if (status == cudaSuccess) status = cudaStreamWaitEvent(stream, join->done, 0);
  if (status != cudaSuccess) {
    return fail(std::string("GEMM+RS copy-stream join failed: ") + cudaGetErrorString(status));
  }
  return 0;
}

template <class Config>
int run_config(GemmRsArgs const& args, cudaStream_t stream) {
  using Gemm = typename Config::Gemm;
  using Element = typename Config::ElementA;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;

  int const segment_rows = args.m / args.world;
  StrideA stride_a{};
  cute::get<0>(stride_a) = args.lda;                          // A (m, k, l) at l*segment + m*lda + k
  cute::get<2>(stride_a) = int64_t(segment_rows) * args.lda;
  StrideB stride_b{};                                         // batch stride 0: every segment shares B
  if constexpr (cutlass::gemm::detail::is_k_major<StrideB>()) {
    cute::get<0>(stride_b) = args.ldb;                        // B (n, k) at n*ldb + k
  } else {
    cute::get<1>(stride_b) = args.ldb;                        // B (n, k) at k*ldb + n
  }
  cute::get<2>(stride_b) = 0;

  using ElementOut = typename Config::ElementOut;
  GemmRsEpilogueArguments<Element, ElementOut> epi;
  for (int r = 0; r < args.world; ++r) {
    epi.buffers[r] = static_cast<char*>(args.buffers[r]);
  }
  epi.flags_offset = args.flags_offset;
  epi.data_offset = args.data_offset;
  epi.world = args.world;
  epi.rank = args.rank;
  epi.tiles_m = (segment_rows + Config::kTileM - 1) / Config::kTileM;
  epi.tiles_n = (args.n + Config::kTileN - 1) / Config::kTileN;
  bool const copy_engine = args.world > 1 && args.outbox != nullptr;
  Bands const bands = band_split(epi.tiles_m, args.bands);
  if (copy_engine) {
    epi.outbox = static_cast<Element*>(args.outbox);
    epi.counters = args.counters;
    epi.band_tile_rows = bands.tile_rows;
    epi.bands = bands.count;
  }
  epi.epoch = args.epoch;
  epi.bias = static_cast<Element const*>(args.bias);
  epi.out = static_cast<ElementOut*>(args.out);
  epi.ldo = args.ldo;
  epi.out_scale = args.out_scale;
  epi.error = args.error;
  epi.timeout_ns = args.timeout_ns;
  epi.trap_on_timeout = args.capture;
  epi.local_status =
      args.world > 1 ? reinterpret_cast<uint32_t*>(static_cast<char*>(args.buffers[args.rank]) + kRsStatusOffset)
                     : nullptr;

  cutlass::KernelHardwareInfo hw_info;
  cudaGetDevice(&hw_info.device_id);
  hw_info.sm_count = args.sm_count > 0 ? args.sm_count : device_sm_count();

  typename Gemm::GemmKernel::TileSchedulerArguments scheduler;
  scheduler.rotate_l = args.world > 1 ? (args.rank + 1) % args.world : 0;
  // Tile order inside a segment (L2 reuse): args.swizzle (1, 2, 4, 8) and args.raster (0 heuristic, 1 along M,
  // 2 along N) override the measured defaults.
  TileOrder const order = segment_rows >= kLargeSegmentRows ? kLargeSegmentOrder : kSmallSegmentOrder;
  scheduler.max_swizzle_size = args.swizzle > 0 ? args.swizzle : order.swizzle;
  switch (args.raster >= 0 ? args.raster : order.raster) {
    case 1: scheduler.raster_order = decltype(scheduler.raster_order)::AlongM; break;
    case 2: scheduler.raster_order = decltype(scheduler.raster_order)::AlongN; break;
    default: scheduler.raster_order = decltype(scheduler.raster_order)::Heuristic; break;
  }

  typename Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {segment_rows, args.n, args.k, args.world},
      {{static_cast<Element const*>(args.a), stride_a, static_cast<Element const*>(args.b), stride_b},
       args.batch_rows, args.batch_rows * args.world, args.m},  // batch-major: segment l's rows are its blocks
      {epi},
      hw_info,
      scheduler};

  cutlass::Status status = Gemm::can_implement(arguments);
  if (status != cutlass::Status::kSuccess) {
    return fail(std::string("CUTLASS cannot implement this GEMM+RS problem: ") + cutlassGetStatusString(status));
  }
  if (Gemm::get_workspace_size(arguments) != 0) {
    return fail("GEMM+RS kernel unexpectedly needs a workspace");
  }

  if (args.world > 1) {
    if (int rc = launch_hello(args, stream); rc != 0) {
      return rc;
    }
  }

  JoinEvents* join = nullptr;
  if (copy_engine) {
    if (int rc = start_copy_stream(args, bands, stream, &join); rc != 0) {
      return rc;
    }
  }

  // With the stores transport the GEMM directly follows the handshake on the stream: launched as its programmatic
  // dependent, its mainloop runs while the handshake waits for the peers (the epilogue waits for the handshake).  Not
  // in copy-engine mode, which puts the counters' reset and the copy stream's event between the two.
  cudaError_t const launched =
      launch_gemm_kernel<Gemm>(arguments, hw_info.device_id, stream, args.world > 1 && !copy_engine);
  if (launched != cudaSuccess) {
    return fail(std::string("GEMM+RS launch failed: ") + cudaGetErrorString(launched));
  }
  if (copy_engine) {
    if (int rc = enqueue_band_copies(args, Config::kTileM, epi.tiles_m, epi.tiles_n, bands, sizeof(Element),
                                     int64_t(epi.tiles_m) * epi.tiles_n);
        rc != 0) {
      return rc;
    }
    return join_copy_stream(args, join, stream);
  }
  return 0;
}

#endif  // CUTLASS_ARCH_MMA_SM90_SUPPORTED

}  // namespace

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
#if defined(FLUXINDUCTOR_GEMM_RS_TUNING)
// Tuning builds (CUDAFLAGS=-DFLUXINDUCTOR_GEMM_RS_TUNING) add bf16 K-major variants, picked per call by
// GemmRsArgs::tuning_config (every rank must pick the same); CI and releases build the default alone.
using TuningShape1 = GemmRsShape<cutlass::gemm::KernelTmaWarpSpecializedCooperative, 128, 256, 2, 1>;
using TuningShape2 = GemmRsShape<cutlass::gemm::KernelTmaWarpSpecializedPingpong, 128, 128, 1, 2>;
using TuningShape3 = GemmRsShape<cutlass::gemm::KernelTmaWarpSpecializedCooperative, 256, 128, 2, 1>;
using TuningShape4 = GemmRsShape<cutlass::gemm::KernelTmaWarpSpecializedPingpong, 128, 192, 2, 1>;
using TuningShape5 = GemmRsShape<cutlass::gemm::KernelTmaWarpSpecializedPingpong, 128, 128, 1, 1>;
using TuningShape6 = GemmRsShape<cutlass::gemm::KernelTmaWarpSpecializedCooperative, 128, 256, 2, 1, true>;
// The one list of tuning configurations: calls f(Shape{}) for `config`; false when there is no such config.
template <class F>
bool visit_tuning_shape(int config, F&& f) {
  switch (config) {
    case 1: f(TuningShape1{}); return true;
    case 2: f(TuningShape2{}); return true;
    case 3: f(TuningShape3{}); return true;
    case 4: f(TuningShape4{}); return true;
    case 5: f(TuningShape5{}); return true;
    case 6: f(TuningShape6{}); return true;
  }
  return false;
}
#endif
#endif

namespace {
struct TileMN {
  int m;
  int n;
};

// The tile of the kernel gemm_rs_run picks for `tuning_config` (the flag layout follows it).
TileMN current_tile(int tuning_config) {
#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
  TileMN tile{DefaultShape::kTileM, DefaultShape::kTileN};
#if defined(FLUXINDUCTOR_GEMM_RS_TUNING)
  visit_tuning_shape(tuning_config, [&](auto shape) {
    tile = {decltype(shape)::kTileM, decltype(shape)::kTileN};
  });
#endif
  (void)tuning_config;
  return tile;
#else
  (void)tuning_config;
  return {128, 128};
#endif
}
}  // namespace

namespace {
#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
// The split transport's bands: blocks of `rows` rows (whole tile-order groups) x `chunk_col_tiles` column tiles,
// numbered row band * col_chunks + column chunk, at most kGemmRsMaxBands.  Both GEMMs walk a group's columns in
// order (rows fastest), so the bands complete, are sent and are needed in that order: the copy of band b runs
// beside the peer GEMM's later bands, and the own GEMM starts on bands that arrived long before.
struct SplitBands {
  int rows = 0;            // a multiple of the tiling's group_rows()
  int row_bands = 1;
  int col_chunks = 1;
  int chunk_col_tiles = 1;
  int tiles_n = 1;
  int count() const { return row_bands * col_chunks; }
};
SplitBands split_bands(int segment_rows, int n, int wanted_col_chunks, gemm_rs_split::SplitTiling tiling) {
  SplitBands b;
  int const groups = (segment_rows + tiling.group_rows() - 1) / tiling.group_rows();
  int const groups_per_band = (groups + kGemmRsMaxBands - 1) / kGemmRsMaxBands;
  b.rows = groups_per_band * tiling.group_rows();
  b.row_bands = (groups + groups_per_band - 1) / groups_per_band;
  b.tiles_n = (n + tiling.tile_n - 1) / tiling.tile_n;
  int chunks = wanted_col_chunks < 1 ? 1 : wanted_col_chunks;
  chunks = chunks < kGemmRsMaxBands / b.row_bands ? chunks : kGemmRsMaxBands / b.row_bands;
  chunks = chunks < b.tiles_n ? chunks : b.tiles_n;
  b.chunk_col_tiles = (b.tiles_n + chunks - 1) / chunks;
  b.col_chunks = (b.tiles_n + b.chunk_col_tiles - 1) / b.chunk_col_tiles;
  return b;
}

// The split GEMMs' configuration, args.split_config (every rank must pass the same: the band arithmetic follows its
// tiling); -1 with the reason in g_last_error when it is out of range.  Whether this build has the configuration for
// the dtype and weight layout is the GEMM launcher's to report.
int split_config(GemmRsArgs const& args) {
  int const config = args.split_config;
  if (config < 0 || config >= gemm_rs_split::kSplitConfigs) {
    return fail("the split configuration must be in [0, " + std::to_string(gemm_rs_split::kSplitConfigs) + "), got " +
                std::to_string(config));
  }
  return config;
}

// What every split GEMM takes from the call: dtype, configuration, N, K, B, the grid size and the error word (A, rows,
// C, D and the rest per GEMM).
gemm_rs_split::SplitGemmParams split_gemm_params(GemmRsArgs const& args, int config) {
  gemm_rs_split::SplitGemmParams gemm;
  gemm.dtype = args.dtype;
  gemm.config = config;
  gemm.n = args.n;
  gemm.k = args.k;
  gemm.lda = args.lda;
  gemm.b = args.b;
  gemm.ldb = args.ldb;
  gemm.b_k_major = args.b_k_major;
  gemm.slabs = args.slabs;
  gemm.k_first = args.k_first;
  for (int s = 1; s < args.slabs; ++s) {
    gemm.a_more[s - 1] = args.a_more[s - 1];
    gemm.lda_more[s - 1] = args.lda_more[s - 1];
    gemm.b_more[s - 1] = args.b_more[s - 1];
    gemm.ldb_more[s - 1] = args.ldb_more[s - 1];
    gemm.k_more[s - 1] = args.k_more[s - 1];
  }
  gemm.sm_count = args.sm_count;
  gemm.error = args.error;
  gemm.timeout_ns = args.timeout_ns;
  return gemm;
}

// The tail split's arguments of the call's `index`-th GEMM (each has its own epoch).  The GEMMs then share the
// scratch, so each launches after the one before, not as its programmatic dependent.
void set_tail_split(gemm_rs_split::SplitGemmParams* gemm, GemmRsArgs const& args, int index) {
  if (args.tail_split_parts < 2 || args.tail_split_partials == nullptr || args.tail_split_flags == nullptr) {
    return;
  }
  gemm->pdl = false;
  gemm->split_partials = args.tail_split_partials;
  gemm->split_flags = args.tail_split_flags;
  gemm->split_epoch = args.tail_split_epoch + uint32_t(index);
  gemm->split_max_parts = args.tail_split_parts;
  gemm->split_waves = args.tail_split_waves;
  gemm->split_error_code = kGemmRsSplitTimeout;
}

// The split transport's copy stream, one ring step: per band in order, wait for its tile count, copy the block
// (2-D, copy engine) from outbox segment `step` into slot `step` of rank `to`, then raise that rank's flag of
// (step, band) to the epoch (send_band).
int enqueue_split_copies(GemmRsArgs const& args, SplitBands const& bands, gemm_rs_split::SplitTiling tiling,
                         int segment_rows, int step, int to, size_t element_bytes, int64_t flags_per_src) {
  size_t const pitch = size_t(args.n) * element_bytes;
  char const* outbox = static_cast<char const*>(args.outbox) + size_t(step) * segment_rows * pitch;
  char* to_base = static_cast<char*>(args.buffers[to]);
  char* slot = to_base + args.data_offset + size_t(step) * segment_rows * pitch;
  for (int rb = 0; rb < bands.row_bands; ++rb) {
    int const r0 = rb * bands.rows;
    int const r1 = r0 + bands.rows < segment_rows ? r0 + bands.rows : segment_rows;
    int const row_tiles = (r1 - r0 + tiling.tile_m - 1) / tiling.tile_m;
    for (int cc = 0; cc < bands.col_chunks; ++cc) {
      int const t0 = cc * bands.chunk_col_tiles;
      int const t1 = t0 + bands.chunk_col_tiles < bands.tiles_n ? t0 + bands.chunk_col_tiles : bands.tiles_n;
      int const band = rb * bands.col_chunks + cc;
      size_t const c0 = size_t(t0) * tiling.tile_n;
      size_t const c1 = size_t(t1) * tiling.tile_n < size_t(args.n) ? size_t(t1) * tiling.tile_n : size_t(args.n);
      size_t const offset = size_t(r0) * pitch + c0 * element_bytes;
      if (int rc = send_band(args, args.counters + step * bands.count() + band, uint32_t(row_tiles * (t1 - t0)),
                             slot + offset, outbox + offset, pitch, (c1 - c0) * element_bytes, size_t(r1 - r0),
                             to_base + args.flags_offset + 4 * (step * flags_per_src + band));
          rc != 0) {
        return rc;
      }
    }
  }
  return 0;
}

// The split transport (csrc/include/fluxinductor/gemm_rs_split.cuh), a ring over the ranks.  After the handshake,
// step s = 0 .. world-1 computes segment (rank + 1 + s) % world as one stock GEMM:
//   step 0, the peer GEMM: A @ B + bias into outbox segment 0;
//   step 0 < s < world-1, a relay GEMM: A @ B + bias + slot s-1 (what rank + 1 summed for this segment at its step
//     s-1) into outbox segment s, waiting per band for slot s-1's flags;
//   the last step, the own GEMM: scale * (A @ B + bias + slot world-2) into out, waiting the same way.
// Each outbox segment goes to rank - 1's slot s band by band on the copy stream, beside the later steps.  Rank - 1
// needs it one step later, so every band has a whole segment's GEMM time to arrive; with two ranks this is the
// peer GEMM, one copy, the own GEMM.  Every rank sends (world-1) segments, as a direct reduce-scatter would.
int run_split(GemmRsArgs const& args, cudaStream_t stream) {
  namespace split = gemm_rs_split;
  if (args.world < 2 || args.outbox == nullptr) {
    return fail("the split transport takes two or more ranks and the copy-engine resources");
  }
  int const segment_rows = args.m / args.world;
  int const to = (args.rank + args.world - 1) % args.world;  // the rank this one's partial sums go to
  size_t const element_bytes = 2;
  int const config = split_config(args);
  if (config < 0) {
    return config;
  }
  split::SplitTiling const tiling = split::kSplitTilings[config];
  SplitBands const bands = split_bands(segment_rows, args.n, args.bands, tiling);
  // Flags live where the default kernel's layout (gemm_rs.py's buffer_layout) put them: [world][its tiles], here
  // [step][band].
  TileMN const layout_tile = current_tile(args.tuning_config);
  int64_t const flags_per_src = int64_t((segment_rows + layout_tile.m - 1) / layout_tile.m) *
                                ((args.n + layout_tile.n - 1) / layout_tile.n);
  if (bands.count() > flags_per_src) {
    return fail("the split transport needs a flag per band within the buffer layout's flags per rank");
  }
  if (int rc = launch_hello(args, stream); rc != 0) {
    return rc;
  }
  JoinEvents* join = nullptr;
  if (int rc = start_copy_stream(args, Bands{1, bands.count()}, stream, &join); rc != 0) {
    return rc;
  }
  split::SplitGemmParams gemm = split_gemm_params(args, config);
  gemm.rows = segment_rows;
  gemm.band_rows = bands.rows;
  gemm.col_chunks = bands.col_chunks;
  gemm.chunk_col_tiles = bands.chunk_col_tiles;
  char* local = static_cast<char*>(args.buffers[args.rank]);
  size_t const segment_bytes = size_t(segment_rows) * args.n * element_bytes;
  std::string message;
  for (int step = 0; step < args.world; ++step) {
    int const segment = (args.rank + 1 + step) % args.world;
    bool const last = step == args.world - 1;
    split::SplitGemmParams g = gemm;
    // The segment's rows from its first: its blocks (batch-major, the same row map for every slab) or its range.
    int64_t const first_row = int64_t(segment) * (args.batch_rows > 0 ? args.batch_rows : segment_rows);
    g.a = static_cast<char const*>(args.a) + first_row * args.lda * element_bytes;
    for (int s = 1; s < args.slabs; ++s) {
      g.a_more[s - 1] =
          static_cast<char const*>(args.a_more[s - 1]) + first_row * args.lda_more[s - 1] * element_bytes;
    }
    if (args.batch_rows > 0) {
      g.block_rows = args.batch_rows;
      g.pitch_rows = args.batch_rows * args.world;
      g.rows_extent = args.m - segment * args.batch_rows;
    }
    if (step > 0) {  // add rank + 1's partial sum of this segment, band by band as its flags arrive
      g.c = local + args.data_offset + (step - 1) * segment_bytes;
      g.beta = last ? args.out_scale : 1.f;
      g.flags = reinterpret_cast<uint32_t const*>(local + args.flags_offset) + (step - 1) * flags_per_src;
      g.epoch = args.epoch;
      g.abort_word = reinterpret_cast<uint32_t const*>(local + kRsStatusOffset);
      g.abort_value = kRsAborted;
      g.error_code = kGemmRsTileTimeout;
      g.capture = args.capture;
      g.pdl = args.split_pdl;
    }
    set_tail_split(&g, args, step);
    if (last) {
      g.bias = args.bias_scaled;
      g.d = args.out;
      g.ldd = args.ldo;
      g.alpha = args.out_scale;
      g.out_float = args.out_float;  // the peer's partial crossed in the operands' dtype
    } else {
      g.bias = args.bias;
      g.d = static_cast<char*>(args.outbox) + step * segment_bytes;
      g.ldd = args.n;
      g.counters = args.counters;
      g.segment = step;
      g.bands = bands.count();
    }
    int const rc = step == 0 ? split::run_peer_gemm(g, stream, &message)
                   : last    ? split::run_own_gemm(g, stream, &message)
                             : split::run_relay_gemm(g, stream, &message);
    if (rc != 0) {
      return fail(message);
    }
    if (!last) {
      if (int sent = enqueue_split_copies(args, bands, tiling, segment_rows, step, to, element_bytes, flags_per_src);
          sent != 0) {
        return sent;
      }
    }
  }
  return join_copy_stream(args, join, stream);
}


// World 1 (gemm_only's split mode, benchmarks): the split transport's two GEMMs with communication off.  Rows
// [0, m/2) with bias, then rows [m/2, m) with bias and the zeros at args.outbox ([m/2 or more rows, n]) as source C,
// so out = A @ B + bias at the split transport's GEMM cost (two launches, the second reading C).  With counters, the
// first GEMM counts its stored tiles per band there as the peer GEMM does (nothing waits for them).
int run_split_nocomm(GemmRsArgs const& args, cudaStream_t stream) {
  if (args.m < 2 || args.outbox == nullptr) {
    return fail("the split transport's GEMMs need M >= 2 and a zero source buffer");
  }
  int const first_rows = args.m / 2;
  size_t const element_bytes = 2;
  std::string message;
  int const config = split_config(args);
  if (config < 0) {
    return config;
  }
  gemm_rs_split::SplitGemmParams gemm = split_gemm_params(args, config);
  gemm.bias = args.bias;
  gemm.ldd = args.ldo;
  gemm_rs_split::SplitGemmParams first = gemm;
  first.rows = first_rows;
  first.a = args.a;
  first.d = args.out;
  if (args.counters != nullptr) {
    SplitBands const bands = split_bands(first_rows, args.n, args.bands, gemm_rs_split::kSplitTilings[config]);
    first.band_rows = bands.rows;
    first.col_chunks = bands.col_chunks;
    first.chunk_col_tiles = bands.chunk_col_tiles;
    first.counters = args.counters;
    first.bands = bands.count();
  }
  set_tail_split(&first, args, 0);
  if (gemm_rs_split::run_peer_gemm(first, stream, &message) != 0) {
    return fail(message);
  }
  gemm_rs_split::SplitGemmParams second = gemm;
  second.rows = args.m - first_rows;
  second.a = static_cast<char const*>(args.a) + int64_t(first_rows) * args.lda * element_bytes;
  for (int s = 1; s < args.slabs; ++s) {
    second.a_more[s - 1] = static_cast<char const*>(args.a_more[s - 1]) +
                           int64_t(first_rows) * args.lda_more[s - 1] * element_bytes;
  }
  second.d = static_cast<char*>(args.out) + int64_t(first_rows) * args.ldo * element_bytes;
  second.c = args.outbox;
  second.beta = 1.f;
  second.pdl = args.split_pdl;
  set_tail_split(&second, args, 1);
  if (gemm_rs_split::run_own_gemm(second, stream, &message) != 0) {
    return fail(message);
  }
  return 0;
}
#endif  // CUTLASS_ARCH_MMA_SM90_SUPPORTED
}  // namespace

int gemm_rs_tile_m(int tuning_config) { return current_tile(tuning_config).m; }
int gemm_rs_tile_n(int tuning_config) { return current_tile(tuning_config).n; }
int gemm_rs_warps_per_tile() { return 1; }  // one flag per tile
bool gemm_rs_tuning_build() {
#if defined(FLUXINDUCTOR_GEMM_RS_TUNING) && defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
  return true;
#else
  return false;
#endif
}
const char* gemm_rs_last_error() { return g_last_error.c_str(); }

int gemm_rs_run(GemmRsArgs const& args, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (args.world < 1 || args.world > kGemmRsMaxWorld || args.rank < 0 || args.rank >= args.world) {
    return fail("world must be in [1, 8] and 0 <= rank < world");
  }
  if (args.m <= 0 || args.n <= 0 || args.k <= 0 || args.m % args.world != 0) {
    return fail("M, N, K must be positive and M a multiple of world");
  }
  if (args.batch_rows < 0 || (args.batch_rows > 0 && ((args.m / args.world) % args.batch_rows != 0 || args.world < 2))) {
    return fail("a batch-major A needs two or more ranks and blocks (batch_rows) that divide each rank's M / world rows");
  }
  if (args.k % 8 != 0 || args.lda % 8 != 0 || args.ldb % 8 != 0) {
    return fail("K and the operand row strides must be multiples of 8 elements (16-byte TMA alignment)");
  }
  if ((reinterpret_cast<uintptr_t>(args.a) | reinterpret_cast<uintptr_t>(args.b)) % 16 != 0) {
    return fail("A and B must be 16-byte aligned");
  }
  if (args.slabs != 1) {
    if (args.slabs < 1 || args.slabs > 3 || !args.split) {
      return fail("K slabs (1 to 3) are for the split transport");
    }
    int k = args.k_first;
    bool ok = args.k_first > 0 && args.k_first % 64 == 0;
    for (int s = 1; s < args.slabs; ++s) {
      int const ks = args.k_more[s - 1];
      ok = ok && ks > 0 && ks % 8 == 0 && (s == args.slabs - 1 || ks % 64 == 0) &&
           args.lda_more[s - 1] % 8 == 0 && args.ldb_more[s - 1] % 8 == 0 &&
           (reinterpret_cast<uintptr_t>(args.a_more[s - 1]) | reinterpret_cast<uintptr_t>(args.b_more[s - 1])) %
                   16 == 0;
      k += ks;
    }
    if (!ok || k != args.k) {
      return fail("K slabs: every slab's K but the last a multiple of 64, each a multiple of 8, adding up to K, "
                  "their operands 16-byte aligned with row strides of multiples of 8");
    }
  }
  if (args.world > 1) {
    for (int r = 0; r < args.world; ++r) {
      if (args.buffers[r] == nullptr) {
        return fail("every rank's buffer pointer is needed");
      }
    }
    if (args.epoch == 0) {
      return fail("epoch must be >= 1");
    }
    if (args.outbox != nullptr &&
        (args.counters == nullptr || args.copy_stream == nullptr ||
         args.copy_stream == stream_ptr)) {
      return fail("copy-engine mode needs counters and a copy stream other than the kernel's");
    }
    if (args.capture && args.outbox != nullptr && !args.split) {
      return fail("a captured call runs the stores or the split transport, not the copy transport");
    }
    if (args.capture && args.tail_split_parts > 1) {
      return fail("a captured call runs no tail split (its scratch takes new epochs per launch)");
    }
  }
#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
  if (args.out_float && args.split && (args.world != 2 || args.dtype != 0 || args.b_k_major)) {
    return fail("the split transport writes an fp32 result at two ranks from bf16 operands and an N-major weight only "
                "(its relay GEMMs and the other kernels store the operands' dtype)");
  }
  if (args.split) {
    return args.world == 1 ? run_split_nocomm(args, stream) : run_split(args, stream);
  }
  using cutlass::bfloat16_t;
  using cutlass::half_t;
  using ColumnMajor = cutlass::layout::ColumnMajor;  // B K-major: the transposed nn.Linear weight
  using RowMajor = cutlass::layout::RowMajor;        // B N-major
#if defined(FLUXINDUCTOR_GEMM_RS_TUNING)
  if (int config = args.tuning_config; config != 0 && !args.out_float) {
    if (args.dtype != 0 || !args.b_k_major) {
      return fail("tuning configurations exist for bf16 with a K-major weight only");
    }
    int rc = 0;
    if (!visit_tuning_shape(config, [&](auto shape) {
          rc = run_config<GemmRsConfig<bfloat16_t, ColumnMajor, decltype(shape)>>(args, stream);
        })) {
      return fail("the GEMM+RS tuning configuration (gemm_rs_config) must be 0..6");
    }
    return rc;
  }
#endif
  if (args.out_float && args.dtype == 0) {
    return args.b_k_major ? run_config<GemmRsConfig<bfloat16_t, ColumnMajor, DefaultShape, float>>(args, stream)
                          : run_config<GemmRsConfig<bfloat16_t, RowMajor, DefaultShape, float>>(args, stream);
  }
  if (args.out_float && args.dtype == 1) {
    return args.b_k_major ? run_config<GemmRsConfig<half_t, ColumnMajor, DefaultShape, float>>(args, stream)
                          : run_config<GemmRsConfig<half_t, RowMajor, DefaultShape, float>>(args, stream);
  }
  if (args.dtype == 0) {
    return args.b_k_major ? run_config<GemmRsConfig<bfloat16_t, ColumnMajor, DefaultShape>>(args, stream)
                          : run_config<GemmRsConfig<bfloat16_t, RowMajor, DefaultShape>>(args, stream);
  }
  if (args.dtype == 1) {
    return args.b_k_major ? run_config<GemmRsConfig<half_t, ColumnMajor, DefaultShape>>(args, stream)
                          : run_config<GemmRsConfig<half_t, RowMajor, DefaultShape>>(args, stream);
  }
  return fail("dtype must be 0 (bf16) or 1 (fp16)");
#else
  return fail("fluxinductor was built without sm90a support (CUTLASS_ARCH_MMA_SM90_SUPPORTED)");
#endif
}

}  // namespace fluxinductor
