"""CPU tests of bench_model's no-communication replica on a mesh of one rank, and of probes/trace_idle.py's accounting
of a profiled step."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, os.path.join(REPO, "benchmarks", "probes"))

import models  # noqa: E402
import trace_idle  # noqa: E402


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["llama2", "mlp"])
@pytest.mark.parametrize("tp", ["sequence", "plain"])
def test_replica_on_a_solo_mesh_is_the_plain_replica(one_rank_group, name, tp):
    """Parallelized with the model's plan over a mesh of this rank alone, the replica of a 2-rank model's share holds
    DTensor linear weights but computes what the plain-module replica computes (same seed, same weights), forward and
    backward."""
    from torch.distributed.tensor import DTensor

    cfg = dict(models.CONFIGS["small"][name])
    world, shard_dim = 2, 1
    x = torch.randn(models.input_shape(name, cfg, world, shard_dim, tp))
    plain = models.build_nocomm(name, cfg, world, torch.device("cpu"), torch.float32, shard_dim, tp)
    solo = models.build_nocomm(name, cfg, world, torch.device("cpu"), torch.float32, shard_dim, tp,
                               models.solo_mesh("cpu"))
    linears = [m.weight for m in solo.modules() if isinstance(m, torch.nn.Linear)]  # every one in the plan
    assert linears and all(isinstance(w, DTensor) and w.device_mesh.size() == 1 for w in linears)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [plain(xs[0]), solo(xs[1])]
    assert not isinstance(outs[1], DTensor) and outs[1].shape == outs[0].shape
    torch.testing.assert_close(outs[1], outs[0])
    for out in outs:
        out.square().sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad)


def test_replica_refuses_a_mesh_of_several_ranks(one_rank_group):
    class _Mesh:
        def size(self):
            return 2

    cfg = dict(models.CONFIGS["small"]["mlp"])
    with pytest.raises(ValueError, match="this rank alone"):
        models.build_nocomm("mlp", cfg, 2, torch.device("cpu"), torch.float32, 1, "sequence", _Mesh())


def _kernel(name, ts, dur, correlation, stream=7):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "correlation": correlation}}


def _launch(ts, dur, correlation):
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur,
            "args": {"correlation": correlation}}


def _sync(ts, dur):
    return {"cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": ts, "dur": dur, "args": {}}


def test_trace_idle_accounts_a_step(tmp_path):
    """A step is what was launched between two synchronizations (before the first: a step caught at its end, left
    out).  Idle time before a kernel whose launch ended after the stream went idle is the host's, up to the launch's
    end; the rest of that gap, and a gap where the kernel was already queued, is other idle (here: waiting on another
    stream).  Peer-wait kernels are summed by name."""
    events = [
        _launch(0, 5, 1), _kernel("triton_tail_of_a_lead_step", 10, 50, 1),  # before the first sync: dropped
        _sync(60, 40),  # ends at 100
        _launch(110, 10, 2), _kernel("triton_norm", 120, 30, 2),  # 120-150
        _launch(125, 5, 3), _kernel("fluxinductor::arrive_and_wait_kernel", 150, 20, 3),  # queued: no gap
        _launch(190, 10, 4), _kernel("cutlass_gemm", 230, 100, 4),  # idle 170-230: host to 200, other 200-230
        _launch(200, 5, 5), _kernel("nvjet_gemm", 340, 60, 5),  # queued at 205, idle 330-340: other
        _kernel("copy_on_side_stream", 150, 100, 6, stream=9),
        _sync(400, 10),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    steps = trace_idle.steps_of(str(path))
    assert steps == [{"span_us": 280, "busy_us": 210.0, "host_idle_us": 30.0, "other_idle_us": 40.0,
                      "peer_wait_kernels_us": 20, "kernels": 4,
                      "busy_by_kind_us": {"triton": 30, "peer_wait": 20, "cutlass": 100, "cublas": 60}}]
