"""``mode="reduce-overhead"``: CUDA graphs around the fused ops, whose kernels still run (tests/gpu/run_cudagraph_mode.py
in a fresh process: it makes a one-rank NCCL group)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.gpu
def test_reduce_overhead_captures_around_the_fused_ops():
    env = dict(os.environ, FLUXINDUCTOR_DISPATCH="fused")
    run = subprocess.run([sys.executable, os.path.join(HERE, "run_cudagraph_mode.py")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "CUDAGRAPH MODE OK" in run.stdout, run.stdout[-4000:] + run.stderr[-4000:]
