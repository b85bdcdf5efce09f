"""``torch.compile(model, backend="flux", mode=...)``: the mode means what it means for inductor; with CUDA graphs on
the fused ops are captured with the rest of the graph (the per-compile option ``cuda_graphs``, on by default), and with
that option off the compile is plain inductor's (tests/gpu/test_cudagraph_mode.py runs both on a GPU)."""

from __future__ import annotations

import dataclasses

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


def test_reduce_overhead_captures_the_ops_without_partitions(compile_fx_patches):
    backend.flux_backend(_graph(), [torch.randn(2, 4)], mode="reduce-overhead")
    assert compile_fx_patches["triton.cudagraphs"] is True
    assert "graph_partition" not in compile_fx_patches  # no partition is needed: the ops are captured
    assert "custom_should_partition_ops" not in compile_fx_patches
    assert type(compile_fx_patches["post_grad_custom_post_pass"]).__name__ == "FluxPassManager"


def test_max_autotune_without_cuda_graphs(compile_fx_patches):
    with torch._inductor.config.patch({"triton.cudagraphs": False}):
        backend.flux_backend(_graph(), [torch.randn(2, 4)], mode="max-autotune-no-cudagraphs")
    assert compile_fx_patches["max_autotune"] is True
    assert "graph_partition" not in compile_fx_patches  # left as the user has it


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="torch.compile mode 'fastest' is not one of"):
        backend.flux_backend(_graph(), [torch.randn(2, 4)], mode="fastest")


@pytest.mark.parametrize("cuda_graphs", [None, False, True])
def test_cuda_graphs_option_captures_or_leaves_the_graph_to_inductor(compile_fx_patches, monkeypatch, cuda_graphs):
    """With CUDA graphs on, the fused ops are captured with the rest (``cuda_graphs`` on, the default), and their
    kernels may run under capture from then on in this process; with it off the compile is plain inductor's (no pass,
    no partition).  The ops carry no cudagraph_unsafe tag (it would fix the choice at registration)."""
    from fluxinductor import settings

    monkeypatch.setattr(settings, "_cuda_graphs_compiled", False)
    # process default off, so that only a compile's option can make kernels_under_capture() true
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, cuda_graphs=False))
    assert not settings.kernels_under_capture()
    for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        assert torch.Tag.cudagraph_unsafe not in getattr(torch.ops.fluxinductor, name).default.tags
    options = {"triton.cudagraphs": True}
    expected = settings.current.cuda_graphs if cuda_graphs is None else cuda_graphs
    if cuda_graphs is not None:
        options["cuda_graphs"] = cuda_graphs
    backend.flux_backend(_graph(), [torch.randn(2, 4)], options=options)
    assert "cuda_graphs" not in compile_fx_patches  # taken out before inductor sees the patches
    assert "custom_should_partition_ops" not in compile_fx_patches and "graph_partition" not in compile_fx_patches
    manager = compile_fx_patches.get("post_grad_custom_post_pass")
    if expected:
        assert manager.cuda_graphs is True
    else:
        assert manager is None  # plain inductor
    assert settings.kernels_under_capture() == bool(expected)


def test_cuda_graphs_is_on_by_default():
    from fluxinductor import settings

    assert settings.Settings().cuda_graphs is True


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
