"""The tail split's host side without a GPU: epochs taken per launch, the GEMM+RS knob, the arguments when off."""

from __future__ import annotations

import pytest

from fluxinductor.kernels import tail_split


def _scratch_at(epoch: int) -> tail_split.Scratch:
    scratch = object.__new__(tail_split.Scratch)  # no device buffers: only the epoch arithmetic is under test
    scratch.epoch = epoch
    return scratch


def test_epochs_are_consecutive_and_new():
    scratch = _scratch_at(0)
    assert scratch.take_epochs(1) == 1
    assert scratch.take_epochs(2) == 2  # 2 and 3
    assert scratch.take_epochs(4) == 4  # 4..7
    assert scratch.epoch == 7


def test_epochs_wrap_without_zero_and_without_splitting_a_range():
    """Flags start at 0, so 0 is never an epoch; a range that would run through 0 starts again at 1 (the kernel adds
    the launch index to the first epoch as a uint32)."""
    scratch = _scratch_at(0xFFFFFFFE)
    assert scratch.take_epochs(1) == 0xFFFFFFFF
    assert scratch.take_epochs(1) == 1
    scratch = _scratch_at(0xFFFFFFFD)
    assert scratch.take_epochs(4) == 1  # 0xFFFFFFFE..1 would cross 0
    assert scratch.epoch == 4
    scratch = _scratch_at(0xFFFFFFFF)
    assert scratch.take_epochs(2) == 1


def test_off_below_two_parts():
    assert tail_split.kernel_args(None, None, 0, 1) == tail_split.OFF
    assert tail_split.OFF[3] == 1


@pytest.mark.parametrize("field,read,default,other,bad,message", [
    ("gemm_rs_tail_split", "gemm_rs_parts", 4, 1, "0", r"gemm_rs_tail_split='0': expected an integer >= 1"),
    ("tail_split_waves", "waves", 1, 2, "0", r"tail_split_waves='0': expected an integer \[1, 4\]"),
])
def test_knobs(field, read, default, other, bad, message, flux_settings):
    """The GEMM+RS tail split's parts and the waves any tail split may take: default, another value, a refused one
    (refused when set, naming the field, and the value in force stays)."""
    from fluxinductor.kernels import gemm_rs

    knob = {"gemm_rs_parts": gemm_rs.tail_split_parts, "waves": tail_split.waves}[read]
    assert knob() == default
    flux_settings(**{field: other})
    assert knob() == other
    with pytest.raises(ValueError, match=message):
        flux_settings(**{field: bad})
    assert knob() == other


def _simulated_parts(tail: int, clusters: int, max_parts: int, max_waves: int) -> int:
    """The scheduler's choice found by dealing the tail's units out as the kernel does: part p of tail tile t is unit
    p * tail + t after the full waves, and unit u goes to cluster u % clusters.  A choice is valid when no cluster gets
    two parts of one tile and the busiest cluster runs at most max_waves units; its time is that cluster's units x
    1/P of a tile.  The fastest valid P wins, the fewest parts on a tie; 1 (no split) takes a whole tile."""
    best, best_time = 1, 1.0
    for parts in range(2, max_parts + 1):
        per_cluster = [[] for _ in range(clusters)]
        for p in range(parts):
            for t in range(tail):
                per_cluster[(p * tail + t) % clusters].append(t)
        if any(len(set(tiles)) < len(tiles) for tiles in per_cluster):
            break  # two parts of one tile on one cluster; more parts keep that pair
        busiest = max(len(tiles) for tiles in per_cluster)
        if busiest > max_waves:
            break
        if busiest / parts < best_time - 1e-12:
            best, best_time = parts, busiest / parts
    return best


def test_tail_parts_rule_matches_a_simulation():
    """The kernel's closed form (ag_gemm/scheduler.cuh tail_split_parts, called through the extension) against the
    simulated deal of units to clusters, over every tail of 66 and 16 clusters."""
    from fluxinductor.kernels import extension_available

    reason = extension_available()
    if reason is not None:
        pytest.skip(reason)
    from fluxinductor import _C

    for clusters in (66, 16, 7):
        for tail in range(1, clusters):
            for max_parts in (1, 2, 3, 4):
                for max_waves in (1, 2):
                    expected = _simulated_parts(tail, clusters, max_parts, max_waves)
                    got = _C.ag_tail_split_parts(tail, clusters, max_parts, max_waves)
                    assert got == expected, (tail, clusters, max_parts, max_waves)
    # The cases the tests on the GPU and docs/design_gemm_rs.md rely on.
    assert _C.ag_tail_split_parts(38, 66, 4, 1) == 1 and _C.ag_tail_split_parts(38, 66, 4, 2) == 3
    assert _C.ag_tail_split_parts(18, 66, 4, 1) == 3 and _C.ag_tail_split_parts(10, 16, 4, 2) == 3
