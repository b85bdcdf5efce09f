// One launch of a CUTLASS 3 (sm90) GEMM kernel from its Arguments, with the host work of a launch kept to the
// launch: CUTLASS's GemmUniversalAdapter sets two function attributes on every launch (initialize: the dynamic shared
// memory size; ClusterLauncher: non-portable cluster sizes), driver calls a launch does not need.  Here
// the shared memory size is set once per kernel and device, and the launch goes straight to cudaLaunchKernelExC with
// the cluster shape (a portable one: at most 8 CTAs, which needs no attribute) and, when asked, programmatic
// dependent launch.  Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"

namespace fluxinductor {

// The kernel's dynamic shared memory limit, raised once per device (bit d of `done`); cudaSuccess when set.
template <class GemmKernel>
cudaError_t configure_gemm_kernel_once(int device) {
  static std::atomic<uint64_t> done{0};
  uint64_t const bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) {
    return cudaSuccess;
  }
  int const smem_size = int(GemmKernel::SharedStorageSize);
  if (smem_size >= (48 << 10)) {
    cudaError_t status = cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, smem_size);
    if (status != cudaSuccess) {
      return status;
    }
  }
  done.fetch_or(bit, std::memory_order_acq_rel);
  return cudaSuccess;
}

// Launches the GEMM of `arguments` (no workspace: the caller has checked get_workspace_size() == 0) on `stream`;
// `pdl`: as a programmatic dependent of the kernel before it on the stream.  A launch error is returned, not left
// for cudaGetLastError.
template <class Gemm>
cudaError_t launch_gemm_kernel(typename Gemm::Arguments const& arguments, int device, cudaStream_t stream, bool pdl) {
  using GemmKernel = typename Gemm::GemmKernel;
  using ClusterShape = typename GemmKernel::DispatchPolicy::ClusterShape;
  static_assert(cute::size(ClusterShape{}) <= 8, "a non-portable cluster size needs its function attribute");
  cudaError_t status = configure_gemm_kernel_once<GemmKernel>(device);
  if (status != cudaSuccess) {
    return status;
  }
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(arguments, nullptr);
  dim3 const grid = GemmKernel::get_grid_shape(params);
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = unsigned(cute::size<0>(ClusterShape{}));
  attributes[0].val.clusterDim.y = unsigned(cute::size<1>(ClusterShape{}));
  attributes[0].val.clusterDim.z = unsigned(cute::size<2>(ClusterShape{}));
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = GemmKernel::get_block_shape();
  config.dynamicSmemBytes = size_t(GemmKernel::SharedStorageSize);
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = pdl ? 2 : 1;
  void* kernel_params[] = {&params};
  return cudaLaunchKernelExC(&config, (void const*)cutlass::device_kernel<GemmKernel>,
                             kernel_params);
}

}  // namespace fluxinductor
