"""Run time choice between a fused kernel and the decomposition, for each call of a fused op.

Each function returns the op's result when it ran a fused path, or ``None`` (after recording why with
:func:`fluxinductor.log.record_fallback`) to make the op run its reference decomposition.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from torch import Tensor

from fluxinductor.log import record_fallback


def all_gather_matmul(
    shard: Tensor,
    weights: List[Tensor],
    biases: List[Optional[Tensor]],
    gather_dim: int,
    group_name: str,
    return_gathered: bool,
) -> Optional[Tuple[List[Tensor], Tensor]]:
    if not shard.is_cuda:
        record_fallback("all_gather_matmul", f"{shard.device.type} tensors have no fused kernel")
        return None
    record_fallback("all_gather_matmul", "fused CUDA kernels are not built")
    return None


def matmul_reduce_scatter(
    a: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, scatter_dim: int, group_name: str
) -> Optional[Tensor]:
    if not a.is_cuda:
        record_fallback("matmul_reduce_scatter", f"{a.device.type} tensors have no fused kernel")
        return None
    record_fallback("matmul_reduce_scatter", "fused CUDA kernels are not built")
    return None
