// Stream operations the ops' host sides enqueue beside their kernels (flags, copy-engine copies, events, host-mapped
// error words).  Torch-free: raw addresses, a stream as void* (a cudaStream_t).
#pragma once

#include <cstdint>

#include "common/error.h"

namespace fluxinductor {

// cuStreamWriteValue32(stream, address, value) through the driver entry point (no libcuda link).
Error stream_write_value32(void* address, uint32_t value, void* stream);
// cuStreamWaitValue32(stream, address, value, EQ): `stream` waits until *address == value (device memory).
Error stream_wait_value32_eq(void const* address, uint32_t value, void* stream);

// cudaMemcpyAsync device-to-device (the copy engine, also for a peer's mapped memory).
Error memcpy_async(void* dst, const void* src, int64_t bytes, void* stream);
// cudaMemcpy2DAsync device-to-device: `height` rows of `width` bytes, row pitch `pitch` bytes at dst and `src_pitch`
// at src (0: `pitch` on both sides).
Error memcpy2d_async(void* dst, const void* src, int64_t pitch, int64_t width, int64_t height, void* stream,
                     int64_t src_pitch = 0);

// cudaMemcpy3DAsync device-to-device: `depth` slices of `height` rows of `width` bytes; rows `pitch` bytes apart on both
// sides, slices dst_rows rows apart at dst and src_rows rows apart at src.
Error memcpy3d_async(void* dst, const void* src, int64_t pitch, int64_t dst_rows, int64_t src_rows, int64_t width,
                     int64_t height, int64_t depth, void* stream);

// A cudaEvent_t with timing off on the current device, or an error.  Never destroyed.
Error create_event(int64_t* event);

// A zeroed host-mapped int32 (cudaHostAllocMapped | Portable), for errors the host can read without a sync.
// Sets its host and device addresses.  The caller keeps it for the life of the process.
Error alloc_host_mapped_word(int64_t* host_address, int64_t* device_address);

}  // namespace fluxinductor
