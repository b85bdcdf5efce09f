// A CUDA runtime status as an Error (csrc/common/error.h), for the launchers' .cu files.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/error.h"

namespace fluxinductor {

inline Error cuda_error(const char* what, cudaError_t status) {
  return make_error(std::string(what) + ": " + cudaGetErrorString(status));
}

}  // namespace fluxinductor
