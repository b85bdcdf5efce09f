"""``torch.compile(model, backend="flux", mode=...)``: the mode means what it means for inductor, and with CUDA graphs
on the fused ops stay out of the captured partitions unless the per-compile option ``cuda_graphs`` is on
(tests/gpu/test_cudagraph_mode.py runs both on a GPU)."""

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


@pytest.mark.parametrize("cuda_graphs", [None, False, True])
def test_fused_ops_are_partitioned_out_unless_captured(compile_fx_patches, monkeypatch, cuda_graphs):
    """With CUDA graphs on, the fused ops are listed in inductor's custom_should_partition_ops (inductor runs them
    between captured partitions), unless the compile's ``cuda_graphs`` option is on: then they are captured with the
    rest, and their kernels may run under capture from then on in this process.  The ops carry no
    cudagraph_unsafe tag (it would fix the choice at registration), and the option is part of the pass manager's
    cache key."""
    from fluxinductor import ops, settings

    monkeypatch.setattr(settings, "_cuda_graphs_compiled", False)
    assert not settings.kernels_under_capture()
    for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        assert torch.Tag.cudagraph_unsafe not in getattr(torch.ops.fluxinductor, name).default.tags
    options = {"triton.cudagraphs": True, "custom_should_partition_ops": ["mylib::other"]}
    if cuda_graphs is not None:
        options["cuda_graphs"] = cuda_graphs
    backend.flux_backend(_graph(), [torch.randn(2, 4)], options=options)
    assert "cuda_graphs" not in compile_fx_patches  # taken out before inductor sees the patches
    listed = compile_fx_patches["custom_should_partition_ops"]
    assert listed == (["mylib::other"] if cuda_graphs else ["mylib::other", *ops.FUSED_OPS])
    assert settings.kernels_under_capture() == bool(cuda_graphs)
    assert compile_fx_patches["post_grad_custom_post_pass"].cuda_graphs == bool(cuda_graphs)


def test_cuda_graphs_option_is_in_the_cache_key():
    from fluxinductor.passes import FluxPassManager

    assert FluxPassManager(cuda_graphs=True).uuid() != FluxPassManager(cuda_graphs=False).uuid()


def test_bad_compile_option_is_a_clear_error(compile_fx_patches):
    with pytest.raises(ValueError, match=r"options\['split_all_reduce'\]='sometimes': expected one of exact"):
        backend.flux_backend(_graph(), [torch.randn(2, 4)], options={"split_all_reduce": "sometimes"})


def test_torch_compile_with_a_mode_runs():
    """torch passes ``mode`` to a named backend as a keyword; the backend used to reject it (TypeError)."""
    torch._dynamo.reset()
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(3, 8)
    out = torch.compile(lin, backend="flux", mode="reduce-overhead")(x)  # CPU: inductor skips CUDA graphs
    torch.testing.assert_close(out, lin(x))
