"""The AG+GEMM kernel variant each launch runs, without a GPU: the wave model (``modelled_time``) and the automatic
choice between 128x256 tiles (variant 0) and 256x160 tiles (variant 6) on the benchmark's and the models' TP=2 shapes,
at the H200's 132 SMs."""

from __future__ import annotations

import pytest
import torch

from fluxinductor.kernels import ag_gemm, extension_available

pytestmark = pytest.mark.skipif(extension_available() is not None,
                                reason="the wave model asks the extension for the tail split's parts "
                                       f"({extension_available()})")

SMS = 132


def _weight(k: int, n: int, k_contiguous: bool = True, dtype=torch.bfloat16) -> torch.Tensor:
    # only the shape, strides and dtype are read: a meta tensor stands in for a large weight
    if k_contiguous:
        return torch.empty((n, k), dtype=dtype, device="meta").t()
    return torch.empty((k, n), dtype=dtype, device="meta")


def test_wave_model_counts_partial_waves_and_split_tails():
    # 4096 x 14336, 128x256 tiles in clusters of 2: 896 cluster tiles on 66 clusters, 13 full waves and a tail of 38,
    # which splits only over two waves (3 parts, 2/3 of a tile); 256x160: 720 cluster tiles, 10 waves and 60.
    assert ag_gemm.modelled_time(4096, 14336, 8192, 0, SMS) == 14 * 128 * 256
    assert ag_gemm.modelled_time(4096, 14336, 8192, 0, SMS, tail_parts=4) == 14 * 128 * 256  # 38 of 66: no split
    assert ag_gemm.modelled_time(4096, 14336, 8192, 0, SMS, tail_parts=4, tail_waves=2) == pytest.approx(
        (13 + 2 / 3) * 128 * 256)
    assert ag_gemm.modelled_time(4096, 14336, 8192, 6, SMS) == 11 * 256 * 160
    # 8192 x 14336: a tail of 10 cluster tiles in 4 parts (a quarter of a tile); variant 6 never splits.
    assert ag_gemm.modelled_time(8192, 14336, 8192, 0, SMS, tail_parts=4) == pytest.approx(27.25 * 128 * 256)
    assert ag_gemm.modelled_time(8192, 14336, 8192, 0, SMS) == 28 * 128 * 256
    # a one-tile problem: one partial wave, never split (no full wave before it)
    assert ag_gemm.modelled_time(128, 256, 64, 0, SMS, tail_parts=4) == 128 * 256


# (per-rank M, K, N at TP=2) -> the variant the automatic choice takes.  Measured on one H200 with communication off
# (docs/design_ag_gemm.md): 6 ahead at 4096 x 14336 (0.999 against 1.027x cuBLAS), 0 ahead at 2048, 3072
# (1.014 / 1.025 against 1.063 / 1.086) and 16384 rows, and at 4096 x 24576.
@pytest.mark.parametrize("m, k, n, expected", [
    (4096, 8192, 14336, 6),     # 4096x8192x28672: 14 -> 10.9 waves of 1.25x the work
    (8192, 8192, 14336, 0),     # 27.25 -> 27.5 tile-waves (measured 6 ahead by 1.7%: the model is conservative here)
    (16384, 8192, 14336, 0),
    (2048, 8192, 14336, 0),
    (3072, 8192, 14336, 0),
    (4096, 12288, 24576, 0),
    (4096, 8192, 28672, 0),
    (4096, 8192, 4096, 0),
    (4096, 8192, 5120, 0),
    (4096, 49152, 6144, 0),
    (1024, 8192, 4096, 0),      # one wave: the K-chunked waits, variant 0
])
def test_automatic_choice(flux_settings, m, k, n, expected):
    flux_settings(ag_variant=None, ag_tail_split=4, tail_split_waves=1)
    assert ag_gemm.kernel_variant(torch.bfloat16, _weight(k, n), m, sm_count=SMS) == expected
    assert ag_gemm.kernel_variant(torch.bfloat16, _weight(k, n), m, m // 2, sm_count=SMS) == expected


def test_choice_keeps_whole_tiles_and_the_other_kernels(flux_settings):
    flux_settings(ag_variant=None, ag_tail_split=4)
    w = _weight(8192, 14336)
    assert ag_gemm.kernel_variant(torch.bfloat16, w, 4096, 2048, sm_count=SMS) == 6
    # a shard of 128-row tiles that is not whole 256-row ones keeps 128-row tiles (and so the push)
    assert ag_gemm.kernel_variant(torch.bfloat16, w, 4352, 2176, sm_count=SMS) == 0
    assert ag_gemm.use_push(torch.empty(2176, 16, dtype=torch.bfloat16), [_weight(16, 14336)])
    # fp16 and an N-contiguous weight have one kernel each
    assert ag_gemm.kernel_variant(torch.float16, _weight(8192, 14336, dtype=torch.float16), 4096,
                                  sm_count=SMS) == 0
    assert ag_gemm.kernel_variant(torch.bfloat16, _weight(8192, 14336, k_contiguous=False), 4096,
                                  sm_count=SMS) == 0


def test_forced_variant(flux_settings):
    flux_settings(ag_variant=1)
    assert ag_gemm.kernel_variant(torch.bfloat16, _weight(8192, 14336), 4096, sm_count=SMS) == 1
    assert ag_gemm.kernel_variant(torch.bfloat16, _weight(8192, 4096), 4096, sm_count=SMS) == 1
    assert ag_gemm.kernel_variant(torch.float16, _weight(8192, 4096, dtype=torch.float16), 4096, sm_count=SMS) == 0


@pytest.mark.parametrize("value", [9, -1, "x"])
def test_unknown_forced_variant_raises(flux_settings, value):
    """An ag_variant the kernel does not have is an error when it is set, not a silent variant 0."""
    with pytest.raises(ValueError, match=r"ag_variant=.*: expected one of 0, 1, 2, 3, 4, 5, 6, 7"):
        flux_settings(ag_variant=value)
    assert ag_gemm.kernel_variant(torch.bfloat16, _weight(8192, 4096), 4096, sm_count=SMS) == 0
