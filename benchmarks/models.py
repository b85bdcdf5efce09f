"""bench_model.py's models: a sequence-parallel MLP and Llama-style decoder layers, parallelized with
``torch.distributed.tensor.parallel`` over one mesh (sequence parallel, or plain tensor parallel), their
configurations (``full``: the shapes of docs/performance.md; ``small``: the CPU smoke test's), and each model's
no-communication replica (:func:`build_nocomm`: one rank's share of the work as plain modules, no collective)."""

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
    # Llama-3-8B-shaped layers, a long sequence: the smaller model of the model-level issue's table.
    "h4096": {
        "mlp": {"tokens": 16384, "hidden": 4096, "ffn": 14336},
        "llama2": {"layers": 2, "batch": 1, "seq": 16384, "hidden": 4096, "ffn": 14336, "heads": 32,
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

    def __init__(self, hidden: int, heads: int, kv_heads: int, seq: int, shards: int = 1):
        # shards > 1: one rank's column / row shard as a plain module (heads / shards query and KV heads each)
        super().__init__()
        self.head_dim = hidden // heads
        self.wq = nn.Linear(hidden, heads // shards * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads // shards * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads // shards * self.head_dim, bias=False)
        self.wo = nn.Linear(heads // shards * self.head_dim, hidden, bias=False)
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
    def __init__(self, hidden: int, ffn: int, heads: int, kv_heads: int, seq: int, shards: int = 1):
        super().__init__()
        self.attention_norm = RMSNorm(hidden)
        self.attention = Attention(hidden, heads, kv_heads, seq, shards)
        self.ffn_norm = RMSNorm(hidden)
        self.feed_forward = FeedForward(hidden, ffn // shards)

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
    torch.manual_seed(1234)
    with torch.device(device):
        if name == "mlp":
            model = MLP(cfg["hidden"], cfg["ffn"]).to(dtype)
        else:
            model = Decoder(cfg["layers"], hidden=cfg["hidden"], ffn=cfg["ffn"], heads=cfg["heads"],
                            kv_heads=cfg["kv_heads"], seq=cfg["seq"]).to(dtype)
    return _parallelize(model, name, mesh, shard_dim, tp)


def _parallelize(model: nn.Module, name: str, mesh, shard_dim: int, tp: str) -> nn.Module:
    """``model`` (an MLP or a Decoder) parallelized over ``mesh`` with the benchmark's tensor-parallel plan."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if name == "mlp":
        if tp == "plain":
            return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        plan = {
            "up": ColwiseParallel(input_layouts=Shard(shard_dim)),  # all-gather the tokens, x @ up
            "down": RowwiseParallel(output_layouts=Shard(shard_dim)),  # h @ down, reduce-scatter the tokens
        }
        return parallelize_module(model, mesh, plan)
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


def tokens_shape(tp: str, tokens: int) -> dict:
    """llama2's batch and sequence length for ``tokens`` tokens per step (bench_model's ``--tokens``): plain tensor
    parallelism runs a batch of one-token sequences (a decode step's matmul shapes), sequence parallelism one
    sequence (a prefill chunk, its rows split between the ranks)."""
    return {"batch": tokens, "seq": 1} if tp == "plain" else {"batch": 1, "seq": tokens}


def input_shape(name: str, cfg: dict, world: int, shard_dim: int, tp: str = "sequence") -> Tuple[int, ...]:
    """This rank's input shard shape (plain TP: the whole input, the same on every rank)."""
    if tp == "plain":
        world = 1
    if name == "mlp":
        t = cfg["tokens"] // world
        return (t, cfg["hidden"]) if shard_dim == 0 else (cfg.get("batch", 1), t, cfg["hidden"])
    return (cfg["batch"], cfg["seq"] // world, cfg["hidden"])


# ---------------------------------------------------------------------------------------------------
# No-communication replica: one rank's share of the work, no collective
# ---------------------------------------------------------------------------------------------------


def _tiled(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    sizes = [1] * x.dim()
    sizes[dim] = world
    return x.repeat(*sizes)


class _LocalGather(torch.autograd.Function):
    """Where the sequence all-gather was: ``world`` local copies of this rank's rows (a local tile, no peer); its
    backward keeps this rank's rows of the gradient (the reduce-scatter's place: a view, no sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
        ctx.dim, ctx.rows = dim, x.shape[dim]
        return _tiled(x, dim, world)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(ctx.dim, 0, ctx.rows), None, None


class _LocalScatter(torch.autograd.Function):
    """Where the reduce-scatter was: this rank's rows of the partial result (a view, no sum); its backward tiles the
    gradient ``world`` times (the all-gather's place)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
        ctx.dim, ctx.world = dim, world
        return x.narrow(dim, 0, x.shape[dim] // world)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _tiled(grad, ctx.dim, ctx.world), None, None


def _gather_input(module: nn.Module, dim: int, world: int) -> None:
    module.register_forward_pre_hook(lambda mod, args: (_LocalGather.apply(args[0], dim, world),) + tuple(args[1:]))


def _scatter_output(module: nn.Module, dim: int, world: int) -> None:
    module.register_forward_hook(lambda mod, args, out: _LocalScatter.apply(out, dim, world))


class LocalReplica(nn.Module):
    """The root of a no-communication replica.  Its forward is a code object of its own: torch.compile keeps
    per-code-object state (cache entries, the shapes seen for automatic dynamic shapes), which the tensor-parallel
    model's modes must not share with a model of other weight shapes."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


NOCOMM_METHOD = (
    "one rank's share of the work on its own GPU, no collective: column-parallel linears with out_features / world "
    "(Q/K/V: heads / world query and KV heads), row-parallel linears with in_features / world, sequence-parallel "
    "norms on this rank's rows, attention over this rank's heads; parallelized with the tensor-parallel model's plan "
    "over a mesh of this rank alone, so a step pays the same DTensor host work (parameters and activations wrapped "
    "and unwrapped, their guards) while every redistribution is a no-op; compiled with inductor")


def nocomm_approximation(name: str, tp: str) -> str:
    """How the replica departs from the per-rank work of ``build_model(name, ..., tp=tp)`` (empty: exact)."""
    if tp == "plain":
        return ""  # the all-reduces removed (identity): the rest is each rank's work exactly
    return ("sequence parallel: each all-gather of the sequence is replaced by a local tile of this rank's rows "
            "(one pass writing the gathered activation, fused by inductor into its producer) and each reduce-scatter "
            "by a view of this rank's rows of the partial sum (the summation is dropped with the communication); "
            "backward mirrors them (a view; a tile). "
            + ("The norm weights' gradient all-reduce is dropped too. " if name == "llama2" else "")
            + "GEMM, attention, norm and elementwise work per rank: as in the tensor-parallel model")


def solo_mesh(device_type: str):
    """A device mesh of this rank alone (collective: every rank of the default group calls it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    group, _ = dist.new_subgroups(group_size=1)
    return DeviceMesh.from_group(group, device_type)


def build_nocomm(name: str, cfg: dict, world: int, device: torch.device, dtype: torch.dtype, shard_dim: int,
                 tp: str = "sequence", mesh=None) -> nn.Module:
    """The per-rank work of ``build_model(name, cfg, ...)`` over ``world`` ranks with every collective removed
    (:data:`NOCOMM_METHOD`, :func:`nocomm_approximation`); it takes the input of :func:`input_shape` and returns a
    tensor of the tensor-parallel model's local output shape.  ``mesh``: a mesh of this rank alone
    (:func:`solo_mesh`), over which the replica is parallelized with the tensor-parallel plan (the same DTensor
    wrapping, every redistribution a no-op); None: plain modules.  Raises ValueError where a rank's share is not a
    whole number of heads, columns or rows (no exact replica).  Its weights are random (numerics are not compared)."""
    need = {"ffn": cfg["ffn"]}
    if name == "llama2":
        need.update(heads=cfg["heads"], kv_heads=cfg["kv_heads"])
        if tp == "sequence":
            need["seq"] = cfg["seq"]
    elif tp == "sequence":
        need["tokens"] = cfg["tokens"]
    uneven = {k: v for k, v in need.items() if v % world}
    if uneven:
        raise ValueError(f"no exact per-rank replica: {uneven} not divisible by world {world}")
    if mesh is not None and mesh.size() != 1:
        raise ValueError(f"the replica's mesh must hold this rank alone, not {mesh.size()} ranks")
    torch.manual_seed(4321)
    with torch.device(device):
        if name == "mlp":
            inner = MLP(cfg["hidden"], cfg["ffn"] // world).to(dtype)
        else:
            inner = Decoder(cfg["layers"], hidden=cfg["hidden"], ffn=cfg["ffn"], heads=cfg["heads"],
                            kv_heads=cfg["kv_heads"], seq=cfg["seq"], shards=world).to(dtype)
    if mesh is not None:  # the plan's hooks first: the stand-ins below see what the plan made of the activations
        _parallelize(inner, name, mesh, shard_dim, tp)
    if name == "mlp":
        if tp == "sequence":
            _gather_input(inner.up, shard_dim, world)
            _scatter_output(inner.down, shard_dim, world)
        return LocalReplica(inner)
    if tp == "sequence":
        for layer in inner.layers:
            _gather_input(layer.attention, 1, world)
            _scatter_output(layer.attention.wo, 1, world)
            _gather_input(layer.feed_forward, 1, world)
            _scatter_output(layer.feed_forward.w2, 1, world)
    return LocalReplica(inner)
