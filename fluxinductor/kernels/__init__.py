"""Python side of the fused Hopper kernels (``fluxinductor._C``).

- ``loader``: the extension's one loader; ``symm``: the AG+GEMM symmetric-memory workspace (and what every kernel
  keeps across calls); ``tail_split``: the tail split's per-stream scratch;
- ``ag_gemm``: all-gather + GEMM (the interface), with ``ag_gemm_variants`` (the kernel variants and their choice)
  and ``ag_gemm_transfer`` (the shards' copy-engine transfers);
- ``gemm_rs``: GEMM + reduce-scatter (the interface), with ``gemm_rs_kernel`` (the kernel's buffer layout and
  launch pieces, all the stores transport needs), one module per other transport (``gemm_rs_copy``, ``gemm_rs_split``)
  and ``gemm_rs_group`` (the per-group workspace);
- ``peers``: whether a group's GPUs can run them together (one host, NVLink).

Importing this package never needs CUDA or the extension: both are looked up on first use.
"""

from fluxinductor.kernels.loader import extension_available

__all__ = ["extension_available"]
