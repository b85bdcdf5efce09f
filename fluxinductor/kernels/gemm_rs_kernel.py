"""The GEMM+RS kernel's launch-level pieces shared by every transport: its constants, the extension, the symmetric
buffer's layout (the flags and the slots the stores transport writes into), the problem signature the ranks agree on,
the weight's layout and the host-mapped error word.  (The stores transport is the kernel's own epilogue: it needs
nothing beyond these; the copy and split transports add :mod:`.gemm_rs_copy` and :mod:`.gemm_rs_split`.)
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from fluxinductor import settings
from fluxinductor.kernels import loader

REDUCE_OPS = ("sum", "avg")
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}
_ELEMENT_SIZES = {torch.bfloat16: 2, torch.float16: 2}
MAX_WORLD = 8
HEADER_BYTES = 4096
_MIN_BUFFER_BYTES = 1 << 20
_ERRORS = {
    1: "a peer never entered the call (it crashed, hung, or made a different sequence of calls)",
    2: "ranks called matmul_reduce_scatter with different shapes or dtypes",
    3: "a peer entered the call but never delivered its tiles",
    4: "a split GEMM's tail tile waited too long for its other parts",
}

# The epoch of every call captured in a CUDA graph (replays repeat it): eager calls never take it, so what they leave
# in the hello words and flags never reads as a captured call's (which set those back to 0 after use).
CAPTURE_EPOCH = 0xFFFFFFFE


def _extension():
    """The extension (:mod:`.loader`), with the GEMM+RS kernel built in; RuntimeError with the reason otherwise."""
    ext = loader.extension()
    if not hasattr(ext, "gemm_rs_run"):
        raise RuntimeError("fluxinductor._C was built without the GEMM+RS kernel")
    return ext


_tile_shapes: Dict[int, Tuple[int, int, int]] = {}


def _tile_shape() -> Tuple[int, int, int]:
    # Tuning builds pick the kernel by settings.tuning.gemm_rs_config; the flag layout follows its tile.
    config = settings.tuning.gemm_rs_config
    shape = _tile_shapes.get(config)
    if shape is None:
        shape = _tile_shapes[config] = tuple(_extension().gemm_rs_tile_shape(config))
    return shape


@functools.lru_cache(maxsize=256)
def _layout(m: int, n: int, world: int, element: int, tile: Tuple[int, int, int]) -> Tuple[int, int, int]:
    tile_m, tile_n, flags_per_tile = tile
    segment_rows = m // world
    tiles = -(-segment_rows // tile_m) * -(-n // tile_n)
    flags_offset = HEADER_BYTES
    data_offset = flags_offset + world * tiles * flags_per_tile * 4
    data_offset = -(-data_offset // 256) * 256
    return flags_offset, data_offset, data_offset + world * segment_rows * n * element


def buffer_layout(m: int, n: int, world: int, dtype: torch.dtype) -> Tuple[int, int, int]:
    """(flags_offset, data_offset, total_bytes) of one rank's buffer for a global [m, n] output."""
    return _layout(m, n, world, _ELEMENT_SIZES[dtype], _tile_shape())


@functools.lru_cache(maxsize=256)
def signature(m: int, n: int, k: int, world: int, dtype: torch.dtype, transport: str = "store") -> int:
    """64-bit digest of what every rank must agree on (``transport``: "store", or "copy/<bands>")."""
    packed = struct.pack("<qqqqq", m, n, k, world, _DTYPES[dtype]) + transport.encode()
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


def _weight_layout(weight: Tensor) -> Optional[Tuple[bool, int]]:
    """(b_k_major, ldb) for weight [K, N] read in place, or None when neither dim is contiguous."""
    k, n = weight.shape
    if weight.stride(0) == 1 and (n == 1 or weight.stride(1) >= k):
        return True, max(weight.stride(1), k)  # transposed nn.Linear weight: column (k) contiguous
    if weight.stride(1) == 1 and (k == 1 or weight.stride(0) >= n):
        return False, max(weight.stride(0), n)
    return None


def error_message(code: int) -> str:
    return f"fused matmul_reduce_scatter failed (code {code}): {_ERRORS.get(code, 'unknown error')}"
