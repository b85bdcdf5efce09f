// Ends this process's CUDA context from device code: a wait that gave up inside a CUDA graph, where no host code
// runs to raise the error word, must not let the kernel finish with rows that never came.
//
// A volatile store to address 0 (no allocation maps it) faults, and the context is lost as it is after __trap().
// __trap() itself is not used in the GEMM kernels: ptxas treats it as the end of the thread and re-plans registers
// around it, and in the AG+GEMM's 256x160 kernel (variant 6) that cost a 448-byte stack frame and 1.3 KB of spill
// stores, which ran the kernel 4.7x slower on 2xH200 (docs/design_ag_gemm.md).
#pragma once

#include <cstdint>

namespace fluxinductor {

__device__ __forceinline__ void stop_context(int code) {
  __threadfence_system();  // the error word written before this reaches the host first
  *reinterpret_cast<int volatile*>(uintptr_t{0}) = code;
}

}  // namespace fluxinductor
