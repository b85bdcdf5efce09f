"""Pure host-side arithmetic of the fused kernels' Python layer: runs without a GPU or the extension."""

from __future__ import annotations


def test_pace_thresholds():
    """Pulls are spread over the shard walked before each peer's, and every chunk is asked for a wave early."""
    from fluxinductor.kernels import ag_gemm

    # M=4096 (16 cluster rows of 256), N=24576 (96 cluster columns): 1536 units, 768 per shard position.
    t = ag_gemm.pace_thresholds(4096, 24576, 2, 4, 0, 132)
    assert t == [[0, 192 - 66, 384 - 66, 576 - 66]]
    t = ag_gemm.pace_thresholds(8192, 24576, 4, 2, 0, 132)  # 3072 units, 768 per position
    assert t == [[0, 384 - 66], [768 - 66, 1152 - 66], [1536 - 66, 1920 - 66]]
    for world in (2, 4, 8):  # every pull is asked for before the GEMM first reads that peer's shard
        per = 32 * 96 / world
        for step, row in enumerate(ag_gemm.pace_thresholds(8192, 24576, world, 3, 0, 132), start=1):
            assert row == sorted(row) and all(0 <= x < step * per for x in row)
    # Shards that are not whole cluster rows (1000 rows, cluster rows of 256): no pacing.
    assert ag_gemm.pace_thresholds(2000, 24576, 2, 4, 0, 132) == [[0, 0, 0, 0]]
