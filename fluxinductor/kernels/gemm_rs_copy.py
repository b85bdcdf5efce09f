"""The GEMM+RS copy-engine transport's resources: the epilogue stores a peer's tile in a local outbox and counts it per
band of tile rows; a copy stream waits for each band's count, copies the band into the owner's slot with the copy engine
(no SMs) and raises the owner's flag of that band (csrc/gemm_rs/gemm_rs.cu).  The split transport moves its partial sums with
the same resources.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fluxinductor import settings
from fluxinductor.kernels import symm as _symm
from fluxinductor.kernels.gemm_rs_kernel import _MIN_BUFFER_BYTES, _extension


def bands() -> int:
    """Bands per row segment of the copy transport (``settings.tuning.gemm_rs_bands``)."""
    return settings.tuning.gemm_rs_bands


class CopyEngineWorkspace:
    """One rank's copy-engine resources: the outbox (grown to the next power of two bytes), the band counters and
    the copy stream."""

    def __init__(self, device: torch.device, world: int):
        self.device = device
        count = world * _extension().GEMM_RS_MAX_BANDS
        self.counters = _symm.persistent(lambda: torch.zeros(count, dtype=torch.int32, device=device), device)
        self.stream = torch.cuda.Stream(device)
        self.outbox: Optional[Tensor] = None

    def outbox_address(self, nbytes: int) -> int:
        if self.outbox is None or self.outbox.numel() < nbytes:
            capacity = max(_MIN_BUFFER_BYTES, 1 << (int(nbytes) - 1).bit_length())
            self.outbox = _symm.persistent(lambda: torch.empty(capacity, dtype=torch.uint8, device=self.device),
                                           self.device)
            # The copy stream reads it after the caller's stream moved on: keep it from reuse until then.
            self.outbox.record_stream(self.stream)
        return self.outbox.data_ptr()
