"""``torch.compile(model, backend="flux", mode=...)``: the mode means what it means for inductor, and with CUDA graphs
on the fused ops stay out of the captured partitions unless FLUXINDUCTOR_CUDA_GRAPHS=1 (tests/gpu/test_cudagraph_mode.py
runs both on a GPU)."""

from __future__ import annotations

import pytest
import torch

import fluxinductor  # noqa: F401 - registers the ops and the backend
from fluxinductor import backend


@pytest.fixture
def compile_fx_patches(monkeypatch):
    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen.update(config_patches or {})
        return gm

    import torch._inductor.compile_fx as compile_fx_module

    monkeypatch.setattr(compile_fx_module, "compile_fx", fake_compile_fx)
    return seen


def _graph():
    return torch.fx.symbolic_trace(torch.nn.Linear(4, 4))


def test_reduce_overhead_turns_on_cuda_graphs_partitioned_around_the_ops(compile_fx_patches):
    backend.flux_backend(_graph(), [torch.randn(2, 4)], mode="reduce-overhead")
    assert compile_fx_patches["triton.cudagraphs"] is True
    assert compile_fx_patches["graph_partition"] is True
    assert type(compile_fx_patches["post_grad_custom_post_pass"]).__name__ == "FluxPassManager"


def test_max_autotune_without_cuda_graphs(compile_fx_patches):
    with torch._inductor.config.patch({"triton.cudagraphs": False}):
        backend.flux_backend(_graph(), [torch.randn(2, 4)], mode="max-autotune-no-cudagraphs")
    assert compile_fx_patches["max_autotune"] is True
    assert "graph_partition" not in compile_fx_patches  # left as the user has it


def test_options_can_turn_partitioning_off(compile_fx_patches):
    backend.flux_backend(_graph(), [torch.randn(2, 4)], options={"triton.cudagraphs": True, "graph_partition": False})
    assert compile_fx_patches["graph_partition"] is False


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="torch.compile mode 'fastest' is not one of"):
        backend.flux_backend(_graph(), [torch.randn(2, 4)], mode="fastest")


@pytest.mark.parametrize("cuda_graphs", ["0", "1"])
def test_fused_ops_are_tagged_cudagraph_unsafe_unless_captured(cuda_graphs):
    """By default the ops are tagged cudagraph_unsafe (inductor runs them between captured partitions); with
    FLUXINDUCTOR_CUDA_GRAPHS=1, read when the ops are registered, they are not, and are captured with the rest.  The
    setting is part of the pass manager's cache key.  In a fresh interpreter: the tag is fixed at registration."""
    import os
    import subprocess
    import sys

    code = ("import torch, fluxinductor; from fluxinductor import config; "
            "ops = [getattr(torch.ops.fluxinductor, n).default for n in "
            "('all_gather_matmul', 'matmul_reduce_scatter', 'matmul_all_reduce')]; "
            "print([torch.Tag.cudagraph_unsafe in op.tags for op in ops], config.cache_key())")
    env = dict(os.environ, FLUXINDUCTOR_CUDA_GRAPHS=cuda_graphs)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    tagged = cuda_graphs == "0"
    assert out.stdout.strip() == f"{[tagged] * 3} disabled=False;tp_groups=*;cuda_graphs={not tagged}", out.stdout


def test_torch_compile_with_a_mode_runs():
    """torch passes ``mode`` to a named backend as a keyword; the backend used to reject it (TypeError)."""
    torch._dynamo.reset()
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(3, 8)
    out = torch.compile(lin, backend="flux", mode="reduce-overhead")(x)  # CPU: inductor skips CUDA graphs
    torch.testing.assert_close(out, lin(x))
