// Stream operations (csrc/common/stream_ops.h): the driver's stream memory operations through their entry points
// (csrc/include/fluxinductor/common/stream_memops.h), copy-engine copies, events and host-mapped words.
#include "common/stream_ops.h"

#include <cuda_runtime.h>

#include <string>

#include "common/cuda_error.h"
#include "fluxinductor/common/stream_memops.h"

namespace fluxinductor {
namespace {

// A stream memory operation's result: `name` is missing from the driver when its entry point was not found.
Error memop_error(CUresult result, bool available, char const* name) {
  if (result == CUDA_ERROR_NOT_SUPPORTED && !available) {
    return make_error(std::string(name) + " is not available from this driver");
  }
  if (result != CUDA_SUCCESS) {
    return make_error(std::string(name) + " failed with CUresult " + std::to_string(int(result)));
  }
  return {};
}

}  // namespace

Error stream_write_value32(void* address, uint32_t value, void* stream) {
  return memop_error(stream_write(static_cast<cudaStream_t>(stream), static_cast<uint32_t*>(address), value),
                     stream_memops().write_value32 != nullptr, "cuStreamWriteValue32");
}

Error stream_wait_value32_eq(void const* address, uint32_t value, void* stream) {
  return memop_error(stream_wait_eq(static_cast<cudaStream_t>(stream), static_cast<uint32_t const*>(address), value),
                     stream_memops().wait_value32 != nullptr, "cuStreamWaitValue32");
}

Error memcpy_async(void* dst, const void* src, int64_t bytes, void* stream) {
  cudaError_t status =
      cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
  return status == cudaSuccess ? Error() : cuda_error("cudaMemcpyAsync", status);
}

Error memcpy2d_async(void* dst, const void* src, int64_t pitch, int64_t width, int64_t height, void* stream,
                     int64_t src_pitch) {
  cudaError_t status = cudaMemcpy2DAsync(dst, size_t(pitch), src, size_t(src_pitch > 0 ? src_pitch : pitch),
                                         size_t(width), size_t(height), cudaMemcpyDeviceToDevice,
                                         static_cast<cudaStream_t>(stream));
  return status == cudaSuccess ? Error() : cuda_error("cudaMemcpy2DAsync", status);
}

Error memcpy3d_async(void* dst, const void* src, int64_t pitch, int64_t dst_rows, int64_t src_rows, int64_t width,
                     int64_t height, int64_t depth, void* stream) {
  cudaMemcpy3DParms copy = {};
  copy.dstPtr = make_cudaPitchedPtr(dst, size_t(pitch), size_t(width), size_t(dst_rows));
  copy.srcPtr = make_cudaPitchedPtr(const_cast<void*>(src), size_t(pitch), size_t(width), size_t(src_rows));
  copy.extent = make_cudaExtent(size_t(width), size_t(height), size_t(depth));
  copy.kind = cudaMemcpyDeviceToDevice;
  cudaError_t status = cudaMemcpy3DAsync(&copy, static_cast<cudaStream_t>(stream));
  return status == cudaSuccess ? Error() : cuda_error("cudaMemcpy3DAsync", status);
}

Error create_event(int64_t* event) {
  cudaEvent_t created = nullptr;
  cudaError_t status = cudaEventCreateWithFlags(&created, cudaEventDisableTiming);
  if (status != cudaSuccess) {
    return cuda_error("cudaEventCreateWithFlags", status);
  }
  *event = reinterpret_cast<int64_t>(created);
  return {};
}

Error alloc_host_mapped_word(int64_t* host_address, int64_t* device_address) {
  void* host = nullptr;
  cudaError_t status = cudaHostAlloc(&host, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable);
  if (status != cudaSuccess) {
    return cuda_error("cudaHostAlloc", status);
  }
  *static_cast<volatile int*>(host) = 0;
  void* device = nullptr;
  status = cudaHostGetDevicePointer(&device, host, 0);
  if (status != cudaSuccess) {
    return cuda_error("cudaHostGetDevicePointer", status);
  }
  *host_address = reinterpret_cast<int64_t>(host);
  *device_address = reinterpret_cast<int64_t>(device);
  return {};
}

}  // namespace fluxinductor
