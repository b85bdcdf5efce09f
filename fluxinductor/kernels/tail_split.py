"""The tail split's per-stream scratch, shared by the AG+GEMM kernel and the split GEMM+RS transport's GEMMs.

When a persistent GEMM's last wave of tiles is partial (after at least one full wave), its tiles are split along K into
parts run by the wave's idle clusters; the parts but the last store fp32 sums here and raise a flag, the last part
adds them (csrc/include/fluxinductor/ag_gemm/scheduler.cuh, AllGatherTileScheduler::fixup).  A launch owns the
scratch until it ends, so there is one per stream: launches on one stream run in order, launches on different streams
may run at once.  Flags are never reset: every launch takes a new epoch and a part's flag is ready when it holds
exactly that epoch.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from fluxinductor import settings
from fluxinductor.kernels import loader, symm

OFF = (0, 0, 0, 1, 1)  # (partials, flags, first epoch, parts, waves): no tail split


def waves() -> int:
    """How many waves a split tail may take (``settings.tuning.tail_split_waves``, default 1). With 1, a tail of T
    tiles on C clusters splits only where P T <= C (P >= 2 parts); with 2, also into parts that take two waves where
    that ends sooner (a tail of more than half a wave: T = 38 of 66 clusters splits in 3 parts, 2/3 of a tile's
    time), for twice the scratch. Off by default: on one H200 it gained nothing beyond the timing spread
    (docs/design_gemm_rs.md)."""
    return settings.tuning.tail_split_waves


class Scratch:
    """One stream's scratch for tails of up to ``waves`` waves: fp32 partial sums, their flags (zeroed once) and the
    launch counter."""

    def __init__(self, device: torch.device, sm_count: int, waves: int = 1):
        self.waves = waves
        floats, flags = loader.extension().ag_tail_split_scratch(sm_count, waves)
        self.partials = symm.persistent(lambda: torch.empty(floats, dtype=torch.float32, device=device), device)
        self.flags = symm.persistent(lambda: torch.zeros(flags, dtype=torch.int32, device=device), device)
        self.epoch = 0

    def take_epochs(self, count: int) -> int:
        """The first of ``count`` new consecutive epochs (uint32, wrapping; never 0, the flags' initial value)."""
        first = (self.epoch + 1) & 0xFFFFFFFF or 1
        self.epoch = (first + count - 1) & 0xFFFFFFFF
        if self.epoch < first:  # the range wrapped through 0: start again at 1
            first, self.epoch = 1, count
        return first


_scratch: Dict[Tuple[int, int, int], Scratch] = {}


def scratch(device: torch.device, stream: torch.cuda.Stream, sm_count: int, tail_waves: int = 1) -> Scratch:
    """The scratch of ``stream`` for grids of ``sm_count`` CTAs (0: every SM) and tails of up to ``tail_waves`` waves,
    allocated on first use (one per stream: a larger one replaces a smaller one, after the stream's work so far)."""
    key = (device.index, stream.cuda_stream, sm_count)
    found = _scratch.get(key)
    if found is None or found.waves < tail_waves:
        replacement = Scratch(device, sm_count, tail_waves)
        if found is not None:  # launches already enqueued on the stream may still use the old one
            found.partials.record_stream(stream)
            found.flags.record_stream(stream)
            replacement.epoch = found.epoch
        found = _scratch[key] = replacement
    return found


def kernel_args(device: torch.device, stream: torch.cuda.Stream, sm_count: int, parts: int, launches: int = 1,
                tail_waves: Optional[int] = None) -> Tuple[int, int, int, int, int]:
    """(partials address, flags address, first epoch, parts, waves) for ``launches`` GEMMs enqueued next on
    ``stream``, each splitting its tail into at most ``parts`` parts over at most ``tail_waves`` waves (default
    :func:`waves`); the n-th takes the first epoch + n.  :data:`OFF` when ``parts`` is below 2."""
    if parts < 2:
        return OFF
    tail_waves = waves() if tail_waves is None else tail_waves
    found = scratch(device, stream, sm_count, tail_waves)
    return found.partials.data_ptr(), found.flags.data_ptr(), found.take_epochs(launches), parts, tail_waves
