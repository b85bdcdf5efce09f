// The one pybind11 binding file of fluxinductor._C: it only exports.  Launchers (csrc/*.cu, declared in
// csrc/*.h) take raw pointers, sizes, strides and a stream, and stay free of torch headers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace py = pybind11;

// ---- AG+GEMM (section owned by the AG+GEMM kernel work) -------------------------------------------
// ---- end AG+GEMM -----------------------------------------------------------------------------------

// ---- GEMM+RS (section owned by the GEMM+RS kernel work) -------------------------------------------
// ---- end GEMM+RS -----------------------------------------------------------------------------------

PYBIND11_MODULE(_C, m) {
  m.doc() = "fluxinductor fused AG+GEMM and GEMM+RS kernels (CUTLASS sm90a)";
  // AG+GEMM exports
  // GEMM+RS exports
}
