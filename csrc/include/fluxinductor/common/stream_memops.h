// Stream memory operations (cuStreamWaitValue32 / cuStreamWriteValue32) through the runtime's driver entry
// points, so the extension links against cudart only.  Host-only, torch-free.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

namespace fluxinductor {

// cuStreamWaitValue32 / cuStreamWriteValue32 (the signature of their CUDA 11.7+ versions, which the lookup
// below asks for; spelled out because cudaTypedefs.h hides those typedefs behind the API version in effect).
using StreamValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct StreamMemops {
  StreamValue32Fn wait_value32 = nullptr;
  StreamValue32Fn write_value32 = nullptr;
};

// The driver's entry points, looked up once; a null member means the driver does not offer it.
inline StreamMemops const& stream_memops() {
  static StreamMemops ops;
  static std::once_flag once;
  std::call_once(once, [] {
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", reinterpret_cast<void**>(&ops.wait_value32), 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      ops.wait_value32 = nullptr;
    }
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", reinterpret_cast<void**>(&ops.write_value32), 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      ops.write_value32 = nullptr;
    }
  });
  return ops;
}

// `stream` waits until *address >= value (CU_STREAM_WAIT_VALUE_GEQ) or == value (EQ) (device memory of this context).
inline CUresult stream_wait(cudaStream_t stream, uint32_t const* address, uint32_t value, unsigned int condition) {
  auto wait = stream_memops().wait_value32;
  if (wait == nullptr) return CUDA_ERROR_NOT_SUPPORTED;
  return wait(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address), value, condition);
}

inline CUresult stream_wait_geq(cudaStream_t stream, uint32_t const* address, uint32_t value) {
  return stream_wait(stream, address, value, CU_STREAM_WAIT_VALUE_GEQ);
}

inline CUresult stream_wait_eq(cudaStream_t stream, uint32_t const* address, uint32_t value) {
  return stream_wait(stream, address, value, CU_STREAM_WAIT_VALUE_EQ);
}

// `stream` writes `value` to *address once its earlier work is done (default: with a memory barrier).
inline CUresult stream_write(cudaStream_t stream, uint32_t* address, uint32_t value) {
  auto write = stream_memops().write_value32;
  if (write == nullptr) return CUDA_ERROR_NOT_SUPPORTED;
  return write(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address), value,
               CU_STREAM_WRITE_VALUE_DEFAULT);
}

}  // namespace fluxinductor
