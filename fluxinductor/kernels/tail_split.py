"""The tail split's per-stream scratch, shared by the AG+GEMM kernel and the split GEMM+RS transport's GEMMs.

When a persistent GEMM's last wave of tiles is partial (after at least one full wave), its tiles are split along K into
parts run by the wave's idle clusters; the parts but the last store fp32 sums here and raise a flag, the last part
adds them (csrc/include/fluxinductor/ag_gemm_scheduler.cuh, AllGatherTileScheduler::fixup).  A launch owns the
scratch until it ends, so there is one per stream: launches on one stream run in order, launches on different streams
may run at once.  Flags are never reset: every launch takes a new epoch and a part's flag is ready when it holds
exactly that epoch.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from fluxinductor.kernels import symm

OFF = (0, 0, 0, 1)  # (partials, flags, first epoch, parts): no tail split


class Scratch:
    """One stream's scratch: fp32 partial sums, their flags (zeroed once) and the launch counter."""

    def __init__(self, device: torch.device, sm_count: int):
        floats, flags = symm.extension().ag_tail_split_scratch(sm_count)
        self.partials = torch.empty(floats, dtype=torch.float32, device=device)
        self.flags = torch.zeros(flags, dtype=torch.int32, device=device)
        self.epoch = 0

    def take_epochs(self, count: int) -> int:
        """The first of ``count`` new consecutive epochs (uint32, wrapping; never 0, the flags' initial value)."""
        first = (self.epoch + 1) & 0xFFFFFFFF or 1
        self.epoch = (first + count - 1) & 0xFFFFFFFF
        if self.epoch < first:  # the range wrapped through 0: start again at 1
            first, self.epoch = 1, count
        return first


_scratch: Dict[Tuple[int, int, int], Scratch] = {}


def scratch(device: torch.device, stream: torch.cuda.Stream, sm_count: int) -> Scratch:
    """The scratch of ``stream`` for grids of ``sm_count`` CTAs (0: every SM), allocated on first use."""
    key = (device.index, stream.cuda_stream, sm_count)
    found = _scratch.get(key)
    if found is None:
        found = _scratch[key] = Scratch(device, sm_count)
    return found


def kernel_args(device: torch.device, stream: torch.cuda.Stream, sm_count: int, parts: int,
                launches: int = 1) -> Tuple[int, int, int, int]:
    """(partials address, flags address, first epoch, parts) for ``launches`` GEMMs enqueued next on ``stream``, each
    splitting its tail into at most ``parts`` parts (the n-th takes the first epoch + n); :data:`OFF` when ``parts``
    is below 2."""
    if parts < 2:
        return OFF
    found = scratch(device, stream, sm_count)
    return found.partials.data_ptr(), found.flags.data_ptr(), found.take_epochs(launches), parts
