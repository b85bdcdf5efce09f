"""Memory stays flat across fused-op calls whose shape changes on every call (tests/gpu/run_memory_flat.py under
torchrun on 2 GPUs): allocated, reserved and workspace bytes bounded after the first pass over the shapes, the plan
and agreement caches bounded, an uncaptured growth frees the old symmetric buffers, every checked result right.

A shorter run than the script's default (``--calls 3000 --auto-calls 1000``); the full one is
``torchrun --nproc-per-node 2 tests/gpu/run_memory_flat.py --out DIR``.  Skips without 2 GPUs (tests/gpu/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.gpu(min_gpus=2)
def test_memory_flat_two_ranks_torchrun(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           os.path.join(HERE, "run_memory_flat.py"), "--calls", "3000", "--auto-calls", "1000", "--out", str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "PASS memory_flat" in result.stdout, result.stdout[-4000:]
    assert os.path.exists(tmp_path / "memory_flat.json")
