"""``mode="reduce-overhead"``: CUDA graphs around the fused ops, whose kernels still run; bf16 and fp16 autocast: the
backward's fp32 reduce-scatter runs the GEMM+RS kernel with an fp32 output (tests/gpu/run_cudagraph_mode.py in a
fresh process: it makes a one-rank NCCL group)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_reduce_overhead_and_autocast_on_one_rank(cuda_graphs):
    """cuda_graphs on (the default): the ops inside the captured graph; off: the compile is plain inductor's."""
    env = dict(os.environ, FLUXINDUCTOR_DISPATCH="fused")
    run = subprocess.run([sys.executable, os.path.join(HERE, "run_cudagraph_mode.py")]
                         + ([] if cuda_graphs else ["--no-cuda-graphs"]), env=env, capture_output=True, text=True,
                         timeout=300)
    ok = run.returncode == 0 and "CUDAGRAPH MODE OK" in run.stdout and "AUTOCAST OK" in run.stdout
    assert ok, run.stdout[-4000:] + run.stderr[-4000:]


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.parametrize("transport", ["store", "split"])
def test_captured_two_ranks_torchrun(transport):
    """cuda_graphs=True over real symmetric memory: the ops captured in CUDA graphs, replays and eager calls
    between them against fp32 references, and a reduce-overhead compile (tests/gpu/run_captured_2rank.py), with the
    GEMM+RS's stores or split transport."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # the script sets fused dispatch itself
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           os.path.join(HERE, "run_captured_2rank.py"), "--replays", "200", "--gemm-rs-push", transport]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count("CAPTURED CHECKS PASSED") == 2, run.stdout[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("which,code", [("ag:0", 1), ("ag:6", 1), ("rs", 1)])
def test_captured_wait_that_times_out_stops_the_context(which, code):
    """A wait that gives up in a call made for a CUDA graph writes its code and ends the context
    (tests/gpu/run_captured_wait_stops.py in a subprocess): the AG+GEMM's tile waits with variants 0 and 6 (whose
    registers the stop must not disturb: csrc/include/fluxinductor/common/stop_context.cuh) and the GEMM+RS handshake."""
    run = subprocess.run([sys.executable, os.path.join(HERE, "run_captured_wait_stops.py"), which],
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=120)
    assert f"STOPPED code {code}:" in run.stdout, run.stdout[-4000:] + run.stderr[-4000:]
