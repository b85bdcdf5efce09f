// The AG+GEMM's per-call arrival (declared in ag_gemm.h): a one-warp kernel that replaces a full barrier in front of
// the GEMM.  Torch-free, CUTLASS-free.
//
// Why a push needs only the previous call's arrival: rank r pushes call e's shard into buffer parity(e) of peer q, whose
// last reader was q's GEMM of call e - 2.  q writes its arrival e - 1 from this kernel, which starts after q's earlier
// work on its stream, that GEMM included.  In a healthy run r's GEMM of call e - 1 already waited for q's chunks of
// call e - 1, which q pushed after its arrival e - 1, so the wait below normally finds the word set and costs no
// round trip; it only waits when the previous call failed.  The GEMM itself is launched as this kernel's programmatic
// dependent and never waits for it (its own rows are local, its peers' rows have their own flags).
#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "ag_gemm/ag_gemm.h"
#include "fluxinductor/ag_gemm/scheduler.cuh"

namespace fluxinductor::ag_gemm {
namespace {

// One warp; lane q handles peer q.
__global__ void arrive_and_wait_kernel(ArrivalParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  int const q = int(threadIdx.x);
  bool arrived = true;
  if (q < p.world && q != p.rank) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p.peer_arrivals[q]), "r"(p.epoch) : "memory");
    // The flags' poll (signed difference, backoff, timeout writing the code to the error word).
    AllGatherSchedule wait;
    wait.timeout_ns = p.timeout_ns;
    wait.error_word = p.error_word;
    arrived = !poll_for_epoch(wait, p.arrivals + q, p.need, kErrorArrivalTimeout);
    if (arrived && p.reset) {
      asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(const_cast<uint32_t*>(p.arrivals + q)), "r"(0u) : "memory");
    }
  }
  unsigned const missing = __ballot_sync(0xffffffffu, !arrived);
  if (missing != 0) {
    if (q == __ffs(missing) - 1) {
      printf("fluxinductor all_gather_matmul: rank %d waited %lld ms for rank %d to reach call %u (it is at %u); "
             "stopping this process's CUDA context (FLUXINDUCTOR_TIMEOUT_S)\n",
             p.rank, p.timeout_ns / 1000000, q, p.need, detail::load_acquire_sys(p.arrivals + q));
      __trap();
    }
    return;
  }
  if (q == 0) {
    detail::store_release_gpu(p.passed, p.epoch);
  }
}

}  // namespace

Error arrive_and_wait(ArrivalParams const& p, void* stream) {
  Error why;
  if (p.world < 1 || p.world > kMaxArrivalWorld || p.rank < 0 || p.rank >= p.world || p.arrivals == nullptr ||
      p.passed == nullptr) {
    std::snprintf(why.message, sizeof(why.message), "arrive_and_wait: rank %d of %d (at most %d), arrival words %p, "
                  "passed word %p", p.rank, p.world, kMaxArrivalWorld, static_cast<void const*>(p.arrivals),
                  static_cast<void*>(p.passed));
    return why;
  }
  for (int q = 0; q < p.world; ++q) {
    if (q != p.rank && p.peer_arrivals[q] == nullptr) {
      std::snprintf(why.message, sizeof(why.message), "arrive_and_wait: no arrival word for peer %d", q);
      return why;
    }
  }
  arrive_and_wait_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(p);
  cudaError_t const status = cudaGetLastError();
  if (status != cudaSuccess) {
    std::snprintf(why.message, sizeof(why.message), "arrive_and_wait launch: %s", cudaGetErrorString(status));
  }
  return why;
}

}  // namespace fluxinductor::ag_gemm
