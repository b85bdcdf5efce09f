"""The AG+GEMM kernel's variants (csrc/ag_gemm/ag_gemm.h Variant) and the automatic choice between them: each variant's tiling,
the tile-order group height, and a wave model of a persistent GEMM's time.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from fluxinductor import settings
from fluxinductor.kernels import loader
from fluxinductor.kernels.tail_split import waves as tail_split_waves

# Tunables (measured on 2 x H200, see docs/design_ag_gemm.md) are fields of fluxinductor.settings.tuning: ag_chunks
# (row chunks per shard), ag_group_rows (tile-order group height), ag_variant, ag_k_chunks, ag_tail_split.
# ag_variant, the kernel variant for bf16 with a K-contiguous weight (csrc/ag_gemm/ag_gemm.h Variant): 0 cooperative 128x256
# cluster 2x1, 1 cooperative 256x128 cluster 1x2, 2 ping-pong 128x128 cluster 1x2, 6 cooperative 256x160 cluster 1x2;
# tuning builds add 3 cooperative 256x128 cluster 2x1, 4 cooperative 128x256 cluster 1x2, 5 ping-pong 128x192
# cluster 2x1 and 7 cooperative 256x160 cluster 2x1.  Unset (None): per shape, 0 or 6 (kernel_variant).
# The automatic choice takes variant 6 where the wave model below says it ends at least this much sooner than 0.
WIDE_MIN_GAIN = 0.01
_K_TILE = 64  # every variant's K tile
# Tail split: when the last wave of tiles is partial (after at least one full wave), its tiles are split along K into
# up to this many parts on the wave's idle clusters, the parts' fp32 sums added by the last part
# (csrc/include/fluxinductor/ag_gemm/scheduler.cuh; cooperative variants): settings.tuning.ag_tail_split, 1 = off.
# Each variant's tiling (csrc/include/fluxinductor/ag_gemm/kernel.cuh): tile M, tile N, cluster M, cluster N.
_TILES = {0: (128, 256, 2, 1), 1: (256, 128, 1, 2), 2: (128, 128, 1, 2), 3: (256, 128, 2, 1), 4: (128, 256, 1, 2),
          5: (128, 192, 2, 1), 6: (256, 160, 1, 2), 7: (256, 160, 2, 1)}
# The variants whose partial last wave the kernel splits (ag_gemm_scheduler.cuh supports_tail_split: cooperative,
# tiles of at most 128 x 256).
_TAIL_SPLITTING = (0, 1, 3, 4)


def maps_batch_major(variant: int) -> bool:
    """Whether the variant's kernel takes a batch-major A (ag_gemm/scheduler.cuh maps_batch_major: tiles of at most
    128 x 256; 256 x 160 tiles leave too few registers for the mapping)."""
    return _TILES[variant][0] * _TILES[variant][1] <= 128 * 256


def _tile_m(variant: int) -> int:
    return _TILES[variant][0]


def _cluster_row_height(variant: int) -> int:
    """Rows of A one cluster row covers: tile M x cluster M."""
    return _TILES[variant][0] * _TILES[variant][2]


def _weight_layout(weight: Tensor) -> Optional[Tuple[bool, int]]:
    """(k_contiguous, leading stride) of weight [K, N], or None when neither dim is contiguous."""
    k, n = weight.shape
    s0, s1 = weight.stride()
    if s0 == 1 and s1 >= k:  # the transposed view of an nn.Linear weight [N, K]
        return True, s1
    if s1 == 1 and s0 >= n:  # a row-major [K, N]
        return False, s0
    return None


def group_cluster_rows(shard_rows: int, variant: int, limit: Optional[int] = None) -> int:
    """Tile-order group height (cluster rows) that never spans two shards when shards are whole cluster rows.

    Inside a group the walk visits every row before moving to the next column, so a group that reached into
    a peer's shard would make the first wave wait for the pull.
    """
    limit = settings.tuning.ag_group_rows if limit is None else limit
    per_shard = shard_rows // _cluster_row_height(variant)
    if per_shard < 1:
        return 1
    if shard_rows % _cluster_row_height(variant):
        return max(1, min(limit, per_shard))
    return max(g for g in range(1, min(limit, per_shard) + 1) if per_shard % g == 0)


def modelled_time(m: int, n: int, k: int, variant: int, sm_count: int, tail_parts: int = 1,
                  tail_waves: int = 1) -> float:
    """A persistent GEMM's time in units of one output element's K loop: waves of tiles x the tile's area.  A wave is
    one tile per cluster of the grid; a partial last wave counts whole, or, where the variant splits its tail (into
    at most ``tail_parts`` parts over ``tail_waves`` waves, after a full wave), as the split's parts
    (ag_gemm_scheduler.cuh tail_split_parts)."""
    tile_m, tile_n, cluster_m, cluster_n = _TILES[variant]
    cluster = cluster_m * cluster_n
    tiles = -(-m // tile_m) * -(-n // tile_n)
    clusters = max(1, sm_count // cluster)
    full, tail = divmod(-(-tiles // cluster), clusters)
    waves = float(full)
    if tail and full and variant in _TAIL_SPLITTING and tail_parts > 1:
        k_tiles = -(-k // _K_TILE)
        parts = loader.extension().ag_tail_split_parts(tail, clusters, min(tail_parts, k_tiles), tail_waves)
        waves += -(-(parts * tail) // clusters) / parts
    elif tail:
        waves += 1
    return waves * tile_m * tile_n


def _has_variants(dtype: torch.dtype, weight: Tensor) -> bool:
    """Whether launches with this weight have variants (csrc/ag_gemm/ag_gemm.cu: bf16 with a K-contiguous weight)."""
    layout = _weight_layout(weight)
    return dtype == torch.bfloat16 and layout is not None and layout[0]


def _forced_variant(dtype: torch.dtype, weight: Tensor) -> int:
    """``settings.tuning.ag_variant`` where launches with this weight have variants, else 0."""
    variant = settings.tuning.ag_variant
    return variant if variant is not None and _has_variants(dtype, weight) else 0


def kernel_variant(dtype: torch.dtype, weight: Tensor, m: int, shard_rows: Optional[int] = None,
                   sm_count: Optional[int] = None) -> int:
    """The variant a launch of ``[m, K] @ weight`` runs.  ``settings.tuning.ag_variant`` when set; else 0,
    or 6 (256x160 tiles) where :func:`modelled_time` says it ends WIDE_MIN_GAIN sooner: a 4096 x 14336 output is
    14 waves of 128x256 tiles on 132 SMs (the last 58% full, too full to split) and 10.9 of the 1.25x larger
    256x160 ones; measured on one H200 with communication off, 1.027 -> 0.999x cuBLAS (docs/design_ag_gemm.md), and on 2xH200 with communication on, E 0.787 -> 0.999 .  Only for bf16 with a
    K-contiguous weight (the other kernels have one variant), and, in a call (``shard_rows`` given), for shards of
    whole 256-row tiles, so that the push and the tile order's groups keep whole tiles.  Never for a problem of one
    wave of 128x256 tiles (those take the K-chunked waits, measured with 0 only): there the model's one wave of
    256x160 tiles is the longer one."""
    if settings.tuning.ag_variant is not None or not _has_variants(dtype, weight):
        return _forced_variant(dtype, weight)
    if shard_rows is not None and shard_rows % _tile_m(6):
        return 0
    k, n = weight.shape
    sm_count = loader.extension().ag_device_sm_count() if sm_count is None else sm_count
    return _automatic_variant(m, n, k, sm_count, settings.tuning.ag_tail_split, tail_split_waves())


@functools.lru_cache(maxsize=4096)
def _automatic_variant(m: int, n: int, k: int, sm_count: int, tail_parts: int, tail_waves: int) -> int:
    wide = modelled_time(m, n, k, 6, sm_count)
    return 6 if wide * (1 + WIDE_MIN_GAIN) <= modelled_time(m, n, k, 0, sm_count, tail_parts, tail_waves) else 0
