"""Python side of the fused Hopper kernels (``fluxinductor._C``).

``symm``: the extension loader and the symmetric-memory workspaces; ``ag_gemm``: all-gather + GEMM; ``gemm_rs``:
GEMM + reduce-scatter; ``peers``: whether a group's GPUs can run them together (one host, NVLink).
Importing this package never needs CUDA or the extension: both are looked up on first use.
"""

from fluxinductor.kernels.symm import extension_available

__all__ = ["extension_available"]
