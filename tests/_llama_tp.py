"""A torchtitan-style Llama on DTensor tensor parallelism with sequence parallelism, for tests and benchmarks.

The module and plan follow torchtitan's Llama3 (``torchtitan/models/llama3``): RMSNorm through ``F.rms_norm``,
GQA attention with rotary embeddings and ``F.scaled_dot_product_attention``, a SwiGLU feed-forward, and its TP plan:
the token embedding row-wise with a ``Shard(1)`` output (the sequence-parallel residual stream), ``SequenceParallel``
norms, ``PrepareModuleInput`` gathering the sequence before the column-wise Q/K/V and w1/w3, row-wise wo and w2 with
``Shard(1)`` outputs, the final norm sequence-parallel and the output projection column-wise with a vocabulary-sharded
output for loss parallelism.  Each block is compiled on its own, as torchtitan's ``apply_compile`` does, so block 0
reads the embedding's output (an ``AsyncCollectiveTensor``: the reduce-scatter is waited on lazily) and block 1 reads
block 0's compiled output (a plain tensor).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    vocab: int = 96
    seq: int = 16
    eps: float = 1e-5


def rotary_freqs(head_dim: int, seq: int, theta: float = 10000.0) -> torch.Tensor:
    """[seq, head_dim / 2] complex rotations, as torchtitan's ``precompute_freqs_cis``."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, D] rotated pairwise by freqs [S, D / 2]."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs.view(1, xc.shape[1], 1, xc.shape[-1])).flatten(3)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        # x: [B, S, dim] (replicated after PrepareModuleInput); q/k/v local heads: -1 is heads / world.
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rotary(q, freqs), apply_rotary(k, freqs)
        repeats = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(repeats, dim=2)
        v = v.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.register_buffer("freqs", rotary_freqs(cfg.dim // cfg.n_heads, cfg.seq), persistent=False)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        # True: block 0 reads a copy of the embedding's output, a plain tensor instead of torchtitan's
        # AsyncCollectiveTensor.  In torch 2.13 a compiled region that reads that AsyncCollectiveTensor fails in its
        # backward for every AOTAutograd backend (DTensor's redistribute backward is handed a plain gradient).
        self.plain_block_input = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, S] int64 -> logits [B, S, vocab] (a vocabulary-sharded DTensor once parallelized)."""
        h = self.tok_embeddings(tokens)
        if self.plain_block_input:
            h = h.clone()
        for layer in self.layers.values():
            h = layer(h, self.freqs)
        return self.output(self.norm(h))


def build(cfg: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu",
          fan_in_init: bool = False) -> Llama:
    """The same weights on every rank (seeded), small enough that fp32 sums stay exact to ~1e-6.  ``fan_in_init``:
    matrices drawn with std 1/sqrt(fan in), as a trained model's are scaled, so that activations keep their size
    through the layers of a full-size model (with std 0.2 a 4096-wide model's bf16 gradients are noise)."""
    torch.manual_seed(seed)
    model = Llama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            std = (p.shape[-1] ** -0.5 if fan_in_init else 0.2) if p.dim() > 1 else 1.0
            p.normal_(0.0, std)
            if p.dim() == 1:
                p.add_(1.0)
    model.to(device=device)
    for p in model.parameters():  # Module.to(dtype) would cast the complex rotary buffer to real
        p.data = p.data.to(dtype)
    return model


def parallelize(model: Llama, mesh) -> Llama:
    """torchtitan's Llama3 TP plan (sequence parallel, loss parallel), applied in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model


def compile_blocks(model: Llama, backend, options: dict | None = None, checkpoint: str = "none") -> Llama:
    """torchtitan's ``apply_ac`` then ``apply_compile``: each block wrapped (activation checkpointing ``full`` or
    ``selective`` per-op) and compiled on its own with ``fullgraph=True``."""
    for name, block in list(model.layers.items()):
        if checkpoint != "none":
            block = checkpointed(block, checkpoint)
        model.layers[name] = torch.compile(block, backend=backend, fullgraph=True, options=options)
    return model


class _Checkpointed(nn.Module):
    def __init__(self, block: nn.Module, mode: str):
        super().__init__()
        self.block, self.mode = block, mode

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        if self.mode == "full":
            return checkpoint(self.block, x, freqs, use_reentrant=False)
        from torch.utils.checkpoint import (
            CheckpointPolicy,
            create_selective_checkpoint_contexts,
        )

        # torchtitan's selective op policy: keep matmuls and collectives' results, recompute the rest.
        save = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
                torch.ops.aten._scaled_dot_product_efficient_attention.default,
                torch.ops._c10d_functional.reduce_scatter_tensor.default}

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

        return checkpoint(self.block, x, freqs, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(policy))


def checkpointed(block: nn.Module, mode: str) -> nn.Module:
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing {mode!r} is not one of 'none', 'full', 'selective'")
    return _Checkpointed(block, mode)


def train_step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Forward, loss and backward (inside loss_parallel for DTensor logits, which its backward needs)."""
    from torch.distributed.tensor import DTensor

    logits = model(tokens)
    if isinstance(logits, DTensor):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
            loss.backward()
    else:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        loss.backward()
    return loss.detach()


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full tensor (DTensor shards gathered), by the unwrapped module's names."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if isinstance(g, DTensor):
            g = g.full_tensor()
        out[name.replace("_orig_mod.", "").replace("block.", "")] = g.detach().float().clone()
    return out


def tokens_for(cfg: LlamaConfig, batch: int, seed: int = 1, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
    return [tokens[:, :-1].to(device), tokens[:, 1:].to(device)]


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
