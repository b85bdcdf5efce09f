"""The GEMM+RS split transport's choices: whether a call qualifies (:func:`split_reason`), whether a sum of matmuls
can run as its GEMMs' K slabs (:func:`slabs_reason`), its GEMMs' configuration and their tail split.  The transport itself (a ring of stock CUTLASS GEMMs, the partial sums moved by the copy engine
with :mod:`.gemm_rs_copy`'s resources) runs in csrc/gemm_rs/gemm_rs.cu run_split.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from fluxinductor import settings
from fluxinductor.kernels.gemm_rs_kernel import _weight_layout


def tail_split_parts() -> int:
    """The most parts the split transport's GEMMs split a partial last wave's tiles into along K
    (``settings.tuning.gemm_rs_tail_split``, default 4; 1 = off).  With 2 or more the GEMMs share one scratch per stream
    (:mod:`fluxinductor.kernels.tail_split`).  The cooperative configuration's GEMMs then run one after another instead
    of as programmatic dependents; the ping-pong configuration's take at most 3 parts, each GEMM half the scratch, and
    keep their programmatic launches at two ranks (csrc/gemm_rs/gemm_rs.cu set_tail_split).  With communication off the
    tail split took the cooperative GEMMs from 1.050-1.086x to 1.029-1.050x cuBLAS on the five TP=2 shapes that split
    (one H200, docs/design_gemm_rs.md)."""
    return settings.tuning.gemm_rs_tail_split


# The split GEMMs' configurations (csrc/gemm_rs/split.h): 0 cooperative 128x256 (every dtype), 2 ping-pong 128x192
# (bf16); 1 (ping-pong 64x256) only in tuning builds.
SPLIT_CONFIGS = (0, 2)


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


def split_reason(world: int, weight: Tensor, bias: Optional[Tensor], out: Optional[Tensor] = None,
                 out_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """None when the split transport can run this call, else why not (then ``copy`` runs).  ``out_dtype`` (or
    ``out``'s dtype): the result's, when it is not the operands' (:func:`float_result_reason`)."""
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
    out_dtype = out.dtype if out is not None else out_dtype
    if out_dtype is not None and out_dtype != weight.dtype:
        return float_result_reason(world, weight, out_dtype)
    return None


def float_result_reason(world: int, weight: Tensor, out_dtype: torch.dtype) -> Optional[str]:
    """None when the split transport can write an ``out_dtype`` result of ``weight.dtype`` operands: fp32 from bf16
    with an N-major weight (the backward's grad @ W under autocast) at two ranks, where the own GEMM adds the peer's
    partial, which crossed in bf16, to its own fp32 one (csrc/gemm_rs/split_own.cu).  More ranks would round the
    relayed partial sums to bf16 at each hop."""
    if out_dtype != torch.float32 or weight.dtype != torch.bfloat16 or world != 2:
        return (f"the split transport writes {weight.dtype}, not {out_dtype} (an fp32 result of bf16 operands at two "
                "ranks only)")
    layout = _weight_layout(weight)
    if layout is None or layout[0]:
        return "the split transport writes an fp32 result with an N-major weight only"
    return None


# A reduce-scatter of a sum of matmuls, sum_i a_i @ w_i, runs as one split GEMM over the terms' concatenated K, each
# term's operands read in place (csrc/include/fluxinductor/common/k_slabs.cuh): at most this many terms, every term's
# K but the last a multiple of the GEMMs' tile K.
MAX_SLABS = 3
SLAB_K_MULTIPLE = 64


def slabs_reason(a2d: Tensor, weight: Tensor, more: Sequence[Tuple[Tensor, Tensor]]) -> Optional[str]:
    """None when the split transport can run ``a2d @ weight + sum(a_i @ w_i for a_i, w_i in more)`` as K slabs of its
    GEMMs (every a [M, K_i] of one M, every w [K_i, N] of one N and one layout, dtype and device), else why not.
    Alignment of the ``a_i`` is not asked: the kernel module copies a misaligned one."""
    if not more:
        return None
    terms = [(a2d, weight)] + list(more)
    if len(terms) > MAX_SLABS:
        return f"{len(terms)} terms: the split GEMMs take at most {MAX_SLABS} K slabs"
    layout = _weight_layout(weight)
    m, n = a2d.shape[0], weight.shape[1]
    for i, (a, w) in enumerate(terms):
        if a.dim() != 2 or w.dim() != 2 or a.shape[0] != m or a.shape[1] != w.shape[0] or w.shape[1] != n:
            return (f"term {i}: {tuple(a.shape)} @ {tuple(w.shape)} is not [M={m}, K_{i}] @ [K_{i}, N={n}] like the "
                    "first term")
        if a.dtype != a2d.dtype or w.dtype != a2d.dtype or a.device != a2d.device or w.device != a2d.device:
            return f"term {i}: its dtypes or devices differ from the first term's"
        w_layout = _weight_layout(w)
        if w_layout is None or layout is None or w_layout[0] != layout[0]:
            return f"term {i}: its weight is not laid out as the first term's (the slabs share one layout)"
        if w_layout[1] % 8 or w.data_ptr() % 16:
            return f"term {i}: its weight is not 16-byte aligned with a leading stride of a multiple of 8"
        k = a.shape[1]
        if k % 8 or (i < len(terms) - 1 and k % SLAB_K_MULTIPLE):
            return (f"term {i}: K={k}; every term's K must be a multiple of 8 and, but the last's, of "
                    f"{SLAB_K_MULTIPLE} (the split GEMMs' tile K)")
    return None
