"""Skips for the GPU kernel tests, each with a visible reason.

``@pytest.mark.gpu`` tests need a CUDA device (tests/conftest.py skips them otherwise); here they also need
an sm_90 device and the built extension, and ``@pytest.mark.gpu(min_gpus=2)`` tests need that many GPUs.
"""

from __future__ import annotations

import os

import pytest

# The N-ranks-on-one-GPU tests run up to 16 streams at once (a kernel stream and, for the GEMM+RS copy-engine
# transport, a copy stream per rank) and the copy streams block in cuStreamWaitValue32.  With CUDA's default of
# 8 hardware queues streams share queues, and a blocked wait can hold back another rank's kernel queued behind
# it until that rank's peers time out (seen at world 8).  Set before any CUDA context exists.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")


def _gpu_skip_reason(min_gpus: int):
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU; none is available on this machine"
    if torch.cuda.device_count() < min_gpus:
        return f"needs {min_gpus} GPUs; this machine has {torch.cuda.device_count()}"
    capability = torch.cuda.get_device_capability(0)
    if capability != (9, 0):
        return f"the fused kernels are built for sm_90a; GPU 0 has capability {capability}"
    from fluxinductor.kernels import extension_available

    reason = extension_available()
    if reason is not None:
        return reason
    return None


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest hook signature
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        reason = _gpu_skip_reason(int(marker.kwargs.get("min_gpus", 1)))
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
