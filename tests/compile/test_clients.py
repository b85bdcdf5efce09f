"""Clients as their users run them: torchtitan-style per-block compilation, and graphs served from inductor's caches.

1. Two sequence-parallel Llama blocks (``tests/_llama_tp.py``: torchtitan's Llama3 module and TP plan) compiled one by
   one with ``fullgraph=True``, on 2 gloo ranks, batch 1 and 2.  Block 0 first reads the embedding's output, an
   ``AsyncCollectiveTensor``, block 1 reads block 0's output, a plain tensor: dynamo recompiles the block for the
   second type.  With ``backend="flux"`` that recompile must stay static (a block output whose strides differ from
   the previous call's input turns it dynamic, and DTensor's sharding propagation then fails on the symbolic sizes),
   the compiled graphs must number as many as inductor's, the block outputs must have inductor's strides, and
   outputs, loss and gradients must match eager.  Training reads a plain block-0 input: in torch 2.13 a training
   step whose compiled region reads the embedding's ``AsyncCollectiveTensor`` fails in its backward for every
   AOTAutograd backend (``aot_eager`` and ``inductor`` alike: DTensor's redistribute backward gets a plain gradient).
2. ``keep_output_layouts``: the pass manager's check that a rewritten graph keeps its outputs' strides.
3. A compile served from inductor's caches reports the fused ops its graph calls (``rewrite_stats()["from_cache"]``).
"""

from __future__ import annotations

import functools
import tempfile
import traceback

import pytest
import torch
from _dist import run_ranks

CONFIG = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "vocab": 64, "seq": 8}
TOLERANCE = 1e-5


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _blocks_job(rank: int, world: int, backend: str, batch: int) -> dict[str, object]:
    import _llama_tp as llama
    from torch._dynamo import lookup_backend
    from torch._dynamo.utils import counters
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh

    import fluxinductor
    from fluxinductor.log import rewrite_stats_delta

    torch._dynamo.reset()
    counters.clear()
    cfg = llama.LlamaConfig(**CONFIG)
    mesh = init_device_mesh("cpu", (world,))
    eager = llama.parallelize(llama.build(cfg), mesh)
    model = llama.parallelize(llama.build(cfg), mesh)
    compiled_with_symbols = []
    inner = lookup_backend(backend)

    def recording_backend(gm, example_inputs):
        # A compile whose inputs have symbolic sizes or strides is the dynamic recompile of issue 35.
        symbolic = any(isinstance(s, torch.SymInt) for t in example_inputs if isinstance(t, torch.Tensor)
                       for s in (*t.shape, *t.stride()))
        compiled_with_symbols.append(symbolic)
        return inner(gm, example_inputs)

    llama.compile_blocks(model, recording_backend)
    result: dict[str, object] = {"errors": {}}
    s0 = fluxinductor.rewrite_stats()
    tokens, labels = llama.tokens_for(cfg, batch)
    try:
        # Forward as torchtitan runs it: block 0 reads the embedding's AsyncCollectiveTensor, block 1 a plain tensor.
        h, h_ref = model.tok_embeddings(tokens), eager.tok_embeddings(tokens)
        result["block0 input"] = type(h).__name__
        layouts = []
        for name, block in model.layers.items():
            h, h_ref = block(h, model.freqs), eager.layers[name](h_ref, eager.freqs)
            layouts.append((tuple(h.shape), h.stride(), h.is_contiguous(), type(h).__name__))
            result["errors"][f"block {name} output"] = _max_rel(h, h_ref)
        result["block outputs"] = layouts
        # One training step (block 0 input made plain: see the module docstring), against eager.
        model.plain_block_input = eager.plain_block_input = True
        loss = llama.train_step(model, tokens, labels)
        loss_ref = llama.train_step(eager, tokens, labels)
        result["errors"]["loss"] = abs(float(loss) - float(loss_ref)) / abs(float(loss_ref))
        grads, grads_ref = llama.full_grads(model), llama.full_grads(eager)
        for name, g in grads_ref.items():
            result["errors"][f"grad {name}"] = _max_rel(grads[name], g)
    except Exception:  # noqa: BLE001 - reported to the parent with the rank's traceback
        result["failure"] = traceback.format_exc()
    result["async input seen"] = result.get("block0 input") == AsyncCollectiveTensor.__name__
    result["compiled with symbols"] = compiled_with_symbols
    result["unique graphs"] = counters["stats"]["unique_graphs"]
    result["frames"] = counters["frames"]["ok"]
    result["stats"] = rewrite_stats_delta(fluxinductor.rewrite_stats(), s0)
    return result


@functools.cache
def _blocks(backend: str, batch: int):
    return run_ranks(_blocks_job, 2, backend, batch, timeout=900)


@pytest.mark.parametrize("batch", [1, 2])
def test_blocks_compiled_separately_match_inductor(batch):
    for rank, (flux, ref) in enumerate(zip(_blocks("flux", batch), _blocks("inductor", batch))):
        where = f"batch={batch} rank={rank}"
        assert "failure" not in ref, f"{where}: inductor itself failed:\n{ref['failure']}"
        assert "failure" not in flux, f"{where}: flux failed:\n{flux['failure']}"
        assert flux["async input seen"], f"{where}: block 0 did not read an AsyncCollectiveTensor: {flux}"
        assert not any(flux["compiled with symbols"]), f"{where}: flux compiled a dynamic graph: {flux}"
        assert flux["unique graphs"] == ref["unique graphs"] and flux["frames"] == ref["frames"], (
            f"{where}: flux compiled {flux['unique graphs']} graphs in {flux['frames']} frames, inductor "
            f"{ref['unique graphs']} in {ref['frames']}")
        assert flux["block outputs"] == ref["block outputs"], (
            f"{where}: block outputs (shape, stride, contiguous, type) differ from inductor's: "
            f"{flux['block outputs']} vs {ref['block outputs']}")
        bad = {k: v for k, v in flux["errors"].items() if not v <= TOLERANCE}
        assert not bad, f"{where}: flux differs from eager: {bad}"
        fused = flux["stats"]["fused"]
        assert fused.get("all_gather_matmul", 0) > 0 and fused.get("matmul_reduce_scatter", 0) > 0, (
            f"{where}: flux fused nothing: {flux['stats']}")


def _checkpointed_job(rank: int, world: int, backend: str, checkpoint: str) -> dict[str, object]:
    import _llama_tp as llama
    from torch.distributed.device_mesh import init_device_mesh

    import fluxinductor
    from fluxinductor.log import rewrite_stats_delta

    torch._dynamo.reset()
    cfg = llama.LlamaConfig(**CONFIG)
    mesh = init_device_mesh("cpu", (world,))
    eager = llama.parallelize(llama.build(cfg), mesh)
    model = llama.compile_blocks(llama.parallelize(llama.build(cfg), mesh), backend, checkpoint=checkpoint)
    model.plain_block_input = eager.plain_block_input = True
    tokens, labels = llama.tokens_for(cfg, 1)
    result: dict[str, object] = {"errors": {}}
    s0 = fluxinductor.rewrite_stats()
    try:
        loss, loss_ref = llama.train_step(model, tokens, labels), llama.train_step(eager, tokens, labels)
        result["errors"]["loss"] = abs(float(loss) - float(loss_ref)) / abs(float(loss_ref))
        grads, grads_ref = llama.full_grads(model), llama.full_grads(eager)
        for name, g in grads_ref.items():
            result["errors"][f"grad {name}"] = _max_rel(grads[name], g)
    except Exception as e:  # noqa: BLE001 - reported to the parent with the rank's traceback
        result["failure"] = traceback.format_exc()
        result["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    result["stats"] = rewrite_stats_delta(fluxinductor.rewrite_stats(), s0)
    return result


@pytest.mark.parametrize("checkpoint", ["full", "selective"])
def test_activation_checkpointed_blocks_train_like_eager_wherever_inductor_does(checkpoint):
    """torchtitan's ``--activation_checkpoint.mode full`` / ``selective`` (its per-op policy) around each compiled
    block: where inductor trains it, flux trains it too, matching eager, with the recomputed forward in the backward
    fused as well.  Where inductor itself fails (torch 2.13 on CPU ranks: a ``DeviceMesh`` among the tensors saved
    for the backward under ``full``; dynamo refusing the selective policy's ``context_fn``), the test skips naming
    the error: the limitation is torch's, and flux can do no better than the graph it rewrites."""
    ref = run_ranks(_checkpointed_job, 2, "inductor", checkpoint, timeout=900)
    if any("failure" in r for r in ref):
        pytest.skip(f"inductor itself fails under {checkpoint} checkpointing with torch {torch.__version__}: "
                    f"{next(r['error'] for r in ref if 'failure' in r)}")
    for rank, r in enumerate(run_ranks(_checkpointed_job, 2, "flux", checkpoint, timeout=900)):
        assert "failure" not in r, f"rank {rank}:\n{r['failure']}"
        bad = {k: v for k, v in r["errors"].items() if not v <= TOLERANCE}
        assert not bad, f"rank {rank}, {checkpoint}: flux differs from eager: {bad}"
        fused = r["stats"]["fused"]
        assert fused.get("matmul_reduce_scatter", 0) > 0 and fused.get("all_gather_matmul", 0) > 0, r["stats"]


def _fake_graph_with_permuted_output():
    """A graph whose output an (imitated) rewrite replaced by a row-major copy read back through a permute."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        return (torch.mm(x, w).view(2, 4, 8) + 1,)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 8))
    graph = gm.graph
    output = graph.find_nodes(op="output")[0]
    original = output.args[0][0]
    with graph.inserting_before(output):
        rows = graph.call_function(torch.ops.aten.permute.default, (original, [1, 0, 2]))
        rows.meta["val"] = original.meta["val"].permute(1, 0, 2)
        copy = graph.call_function(torch.ops.aten.clone.default, (rows,), {"memory_format": torch.contiguous_format})
        copy.meta["val"] = rows.meta["val"].clone(memory_format=torch.contiguous_format)
        back = graph.call_function(torch.ops.aten.permute.default, (copy, [1, 0, 2]))
        back.meta["val"] = copy.meta["val"].permute(1, 0, 2)
    return graph, original, back


def test_keep_output_layouts_restores_strides():
    from passes.manager import keep_output_layouts, output_layouts

    graph, _original, replacement = _fake_graph_with_permuted_output()
    promised = output_layouts(graph)
    output = graph.find_nodes(op="output")[0]
    output.args = ((replacement,),)
    assert output_layouts(graph)[0][1] == (8, 16, 1)
    assert keep_output_layouts(graph, promised) == 1
    assert output_layouts(graph) == promised == [((2, 4, 8), (32, 8, 1), torch.float32)]
    kept = output.args[0][0]
    assert kept.target is torch.ops.prims.inductor_force_stride_order.default and kept.args[0] is replacement
    graph.lint()
    # Nothing changed: nothing inserted.
    assert keep_output_layouts(graph, promised) == 0


def test_keep_output_layouts_refuses_a_changed_shape():
    from passes.manager import keep_output_layouts, output_layouts

    graph, original, _ = _fake_graph_with_permuted_output()
    promised = output_layouts(graph)
    output = graph.find_nodes(op="output")[0]
    mm = original.args[0].args[0]  # add(view(mm), 1)
    assert tuple(mm.meta["val"].shape) == (8, 8)
    output.args = ((mm,),)
    with pytest.raises(AssertionError, match="changed graph output 0"):
        keep_output_layouts(graph, promised)


# A model without DTensor: DTensor graphs take the DeviceMesh as an opaque input whose pickle differs per process,
# so their cache keys never match across processes.
CACHE_MODEL = "funcol_swiglu"


def _cache_job(rank: int, world: int) -> dict[str, object]:
    from test_compile_numerics import run_case
    from torch._dynamo.utils import counters

    import fluxinductor
    from fluxinductor.log import rewrite_stats_delta

    torch._dynamo.reset()
    counters.clear()
    s0 = fluxinductor.rewrite_stats()
    result = run_case(rank, world, CACHE_MODEL, "fp32")
    result["stats"] = rewrite_stats_delta(fluxinductor.rewrite_stats(), s0)
    result["cache hits"] = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    return result


def test_graph_served_from_cache_reports_its_fused_ops():
    with tempfile.TemporaryDirectory(prefix="fluxinductor-clients-cache-") as cache_dir:
        cold = run_ranks(_cache_job, 2, cache_dir=cache_dir, timeout=600)
        warm = run_ranks(_cache_job, 2, cache_dir=cache_dir, timeout=600)
    for rank, (c, w) in enumerate(zip(cold, warm)):
        where = f"rank={rank}"
        assert c["cache hits"] == 0 and c["stats"]["from_cache"] == {}, f"{where}: cold compile: {c}"
        fused = c["stats"]["fused"]
        assert fused.get("all_gather_matmul", 0) >= 2 and fused.get("matmul_reduce_scatter", 0) >= 2, c["stats"]
        # Warm: forward and backward served from the cache; no pass ran, yet the stats say what the graphs call.
        assert w["cache hits"] >= 2, f"{where}: warm compile missed the caches: {w}"
        assert w["stats"]["fused"] == {}, f"{where}: a pass ran on a served graph: {w['stats']}"
        assert w["stats"]["from_cache"] == {op: n for op, n in fused.items()}, (
            f"{where}: the served graphs' fused ops {w['stats']['from_cache']} are not the cold compile's {fused}")
