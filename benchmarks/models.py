"""bench_model.py's models: a sequence-parallel MLP and Llama-style decoder layers, parallelized with
``torch.distributed.tensor.parallel`` over one mesh (sequence parallel, or plain tensor parallel), and their
configurations (``full``: the shapes of docs/performance.md; ``small``: the CPU smoke test's)."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

MODELS = ("mlp", "llama2")

CONFIGS = {
    # The reference shapes (docs/performance.md).
    "full": {
        "mlp": {"tokens": 4096, "hidden": 8192, "ffn": 28672},
        "llama2": {"layers": 2, "batch": 1, "seq": 4096, "hidden": 8192, "ffn": 28672, "heads": 64,
                   "kv_heads": 8},
    },
    # CPU smoke: divisible by 2, 4 and 8 ranks.
    "small": {
        "mlp": {"tokens": 64, "hidden": 64, "ffn": 128},
        "llama2": {"layers": 2, "batch": 1, "seq": 32, "hidden": 64, "ffn": 128, "heads": 8, "kv_heads": 4},
    },
}




class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x):
        # x: [T / world, H] sequence shard (Shard(0)) or [1, T / world, H] (Shard(1)); out: same shape
        return self.down(F.gelu(self.up(x)))


class RMSNorm(nn.Module):
    """Written out from elementwise ops and a mean, so DTensor handles it on every torch version."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rope_tables(seq: int, head_dim: int, base: float = 500000.0) -> Tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)  # [S, hd / 2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, hd]
    return angles.cos().float(), angles.sin().float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, S, hd]; cos, sin: [S, hd]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """GQA attention; the column-wise Q/K/V projections split the heads over the ranks."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, seq: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)
        cos, sin = _rope_tables(seq, self.head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        # x: [B, S, H] (gathered); q: [B, heads / world, S, hd]; k, v: [B, kv_heads / world, S, hd]
        b, s = x.shape[0], x.shape[1]
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:s].to(q.dtype), self.sin[:s].to(q.dtype)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:  # each KV head serves `repeat` query heads
            k = k[:, :, None].expand(b, k.shape[1], repeat, s, self.head_dim).reshape(b, -1, s, self.head_dim)
            v = v[:, :, None].expand(b, v.shape[1], repeat, s, self.head_dim).reshape(b, -1, s, self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # [B, S / world, H] after the reduce-scatter


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, ffn: int, heads: int, kv_heads: int, seq: int):
        super().__init__()
        self.attention_norm = RMSNorm(hidden)
        self.attention = Attention(hidden, heads, kv_heads, seq)
        self.ffn_norm = RMSNorm(hidden)
        self.feed_forward = FeedForward(hidden, ffn)

    def forward(self, x):
        # x: [B, S / world, H], this rank's slice of the sequence
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """The root holds no parallel style: hooks on the root would become a graph of their own."""

    def __init__(self, layers: int, **kw):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(**kw) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build_model(name: str, cfg: dict, mesh, device: torch.device, dtype: torch.dtype, shard_dim: int,
                tp: str = "sequence") -> nn.Module:
    """The model on ``device`` in ``dtype``, parallelized over ``mesh`` (same weights on every rank).  ``tp``:
    "sequence" (sequence parallel: the tokens sharded between layers) or "plain" (replicated activations, each
    row-parallel output all-reduced)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(1234)
    with torch.device(device):
        if name == "mlp":
            model = MLP(cfg["hidden"], cfg["ffn"]).to(dtype)
            if tp == "plain":
                return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            plan = {
                "up": ColwiseParallel(input_layouts=Shard(shard_dim)),  # all-gather the tokens, x @ up
                "down": RowwiseParallel(output_layouts=Shard(shard_dim)),  # h @ down, reduce-scatter the tokens
            }
            return parallelize_module(model, mesh, plan)
        model = Decoder(cfg["layers"], hidden=cfg["hidden"], ffn=cfg["ffn"], heads=cfg["heads"],
                        kv_heads=cfg["kv_heads"], seq=cfg["seq"]).to(dtype)
    if tp == "plain":
        for layer in model.layers:
            parallelize_module(layer, mesh, {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),  # all-reduced
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),  # all-reduced
            })
        return model
    gather_sequence = lambda: PrepareModuleInput(  # noqa: E731
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for layer in model.layers:
        parallelize_module(layer, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": gather_sequence(),  # one all-gather feeds wq, wk and wv
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": gather_sequence(),  # one all-gather feeds w1 and w3
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return model


def input_shape(name: str, cfg: dict, world: int, shard_dim: int, tp: str = "sequence") -> Tuple[int, ...]:
    """This rank's input shard shape (plain TP: the whole input, the same on every rank)."""
    if tp == "plain":
        world = 1
    if name == "mlp":
        t = cfg["tokens"] // world
        return (t, cfg["hidden"]) if shard_dim == 0 else (cfg.get("batch", 1), t, cfg["hidden"])
    return (cfg["batch"], cfg["seq"] // world, cfg["hidden"])
