"""The GEMM+RS split transport's choices: whether a call qualifies (:func:`split_reason`), its GEMMs' configuration
and their tail split.  The transport itself (a ring of stock CUTLASS GEMMs, the partial sums moved by the copy engine
with :mod:`.gemm_rs_copy`'s resources) runs in csrc/gemm_rs/gemm_rs.cu run_split.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from fluxinductor import settings
from fluxinductor.kernels.gemm_rs_kernel import _weight_layout


def tail_split_parts() -> int:
    """The most parts the split transport's GEMMs split a partial last wave's tiles into along K
    (``settings.tuning.gemm_rs_tail_split``, default 4; 1 = off).  With 2 or more the GEMMs share one scratch per stream
    (:mod:`fluxinductor.kernels.tail_split`) and run one after another instead of as programmatic dependents.  The
    two GEMMs with communication off went from 1.050-1.086x to 1.029-1.050x cuBLAS on the five TP=2 shapes that split
    (one H200, docs/design_gemm_rs.md)."""
    return settings.tuning.gemm_rs_tail_split


# The split GEMMs' configurations (csrc/gemm_rs/split.h): 0 cooperative 128x256 (every dtype), 2 ping-pong 128x192
# (bf16); 1 (ping-pong 64x256) only in tuning builds.
SPLIT_CONFIGS = (0, 2)
_TAIL_SPLIT_CONFIGS = (0,)  # the cooperative configuration (ag_gemm::supports_tail_split)


def resolve_split_config(dtype: torch.dtype, chosen: Optional[int] = None) -> int:
    """The split GEMMs' configuration for a call: ``settings.tuning.gemm_rs_split_config`` when set (A/B runs, tuning
    builds), else ``chosen`` (the cost model's per-shape pick), else 0; 0 for any dtype but bf16, which has only that
    one.  Every rank must use the same (the call's handshake includes it)."""
    forced = settings.tuning.gemm_rs_split_config
    config = forced if forced is not None else (0 if chosen is None else int(chosen))
    return config if dtype == torch.bfloat16 else 0


def split_configs(dtype: torch.dtype) -> Tuple[int, ...]:
    """The configurations a calibration times for a call: each one the dtype has, or none (the call's own choice
    stands) where ``settings.tuning.gemm_rs_split_config`` forces one or the dtype has only one."""
    if settings.tuning.gemm_rs_split_config is not None or dtype != torch.bfloat16:
        return ()
    return SPLIT_CONFIGS


def split_reason(world: int, weight: Tensor, bias: Optional[Tensor], out: Optional[Tensor] = None) -> Optional[str]:
    """None when the split transport can run this call, else why not (then ``copy`` runs)."""
    if world < 2:
        return f"the split transport needs 2 or more ranks, not {world}"
    if _weight_layout(weight) is None:
        return "the weight has neither dim contiguous"
    n = weight.shape[1]
    if n % 8:
        return f"N={n} is not a multiple of 8 (the split transport's TMA stores need 16-byte rows)"
    if bias is not None and bias.data_ptr() % 16:
        return "bias is not 16-byte aligned"
    if out is not None and (out.stride(1) != 1 or out.stride(0) % 8 or out.data_ptr() % 16):
        return "out is not a 16-byte aligned row-major tensor with a row stride of a multiple of 8"
    if out is not None and out.dtype != weight.dtype:
        return f"the split transport writes {weight.dtype}, not {out.dtype}"
    return None
