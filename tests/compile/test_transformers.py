"""Hugging Face transformers' Llama with ``tp_plan="auto"``, compiled with ``backend="flux"``, on 2 gloo ranks.

transformers shards the model with its own plan (plain tensor parallelism: column-wise Q/K/V/gate/up, row-wise o/down
with an all-reduce after each).  The test loads a small saved Llama on both ranks, compiles ``model.forward``
unmodified, and checks that every all-reduce was rewritten (split around the row-wise matmul) and that logits, the
loss and the gradients of a training step match eager.  Skips where transformers or accelerate is missing
(``pip install -e ".[test]"`` installs them).
"""

from __future__ import annotations

import functools
import tempfile
import traceback

import pytest
import torch
from _dist import run_ranks

pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[test]'")
pytest.importorskip("accelerate", reason="accelerate is not installed (transformers' tp_plan needs it)")

LAYERS = 2
TOLERANCE = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _hf_job(rank: int, world: int, path: str) -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    import fluxinductor
    from fluxinductor.log import rewrite_stats_delta

    result: dict[str, object] = {}
    try:
        if rank == 0:
            from transformers import LlamaConfig

            torch.manual_seed(0)
            cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                              max_position_embeddings=64)
            LlamaForCausalLM(cfg).save_pretrained(path)
        dist.barrier()

        def load():
            return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")

        tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
        eager, model = load(), load()
        model.forward = torch.compile(model.forward, backend="flux")
        torch._dynamo.reset()
        s0 = fluxinductor.rewrite_stats()
        with torch.no_grad():
            result["logits"] = _rel(model(tokens).logits, eager(tokens).logits)
        result["forward stats"] = rewrite_stats_delta(fluxinductor.rewrite_stats(), s0)

        s1 = fluxinductor.rewrite_stats()
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        loss_ref = eager(tokens, labels=tokens).loss
        loss_ref.backward()
        result["training stats"] = rewrite_stats_delta(fluxinductor.rewrite_stats(), s1)
        result["loss"] = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())

        def grads(m):
            return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                    for n, p in m.named_parameters() if p.grad is not None}

        g, g_ref = grads(model), grads(eager)
        result["grads compared"] = len(g_ref)
        result["grad"] = max(_rel(g[n], r) for n, r in g_ref.items())
    except Exception:  # noqa: BLE001 - reported to the parent with the rank's traceback
        result["failure"] = traceback.format_exc()
    return result


@functools.cache
def _run():
    with tempfile.TemporaryDirectory(prefix="fluxinductor-hf-") as path:
        return run_ranks(_hf_job, 2, path, timeout=900)


def test_transformers_tp_plan_auto_matches_eager_with_every_all_reduce_rewritten():
    for rank, r in enumerate(_run()):
        assert "failure" not in r, f"rank {rank}:\n{r['failure']}"
        # Two row-wise projections (o_proj, down_proj) per layer, each followed by an all-reduce.
        assert r["forward stats"]["fused"].get("all_reduce_split", 0) == 2 * LAYERS, r["forward stats"]
        assert r["training stats"]["fused"].get("all_reduce_split", 0) >= 2 * LAYERS, r["training stats"]
        assert r["grads compared"] > 0
        for what in ("logits", "loss", "grad"):
            assert r[what] < TOLERANCE, (rank, what, r[what])
