"""The fused custom ops the passes put into graphs.

``torch.ops.fluxinductor.all_gather_matmul``, ``torch.ops.fluxinductor.matmul_reduce_scatter`` and
``torch.ops.fluxinductor.matmul_all_reduce`` mean exactly what the unfused graph meant.  At run time
:mod:`fluxinductor.dispatch` may run a fused kernel; when it declines (CPU tensors, no extension, unsupported dtype
or shape, a shape where the cost model says fusion loses) the op runs the reference decomposition below over the
process group, so a rewritten graph runs anywhere: gloo on CPU, NCCL on GPUs.

A collective of the decomposition that fails on this rank (a peer exited, or did not join it within the process
group's timeout) raises :class:`fluxinductor.agreement.PeerFailureError`, naming the op, the group and the peers.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from fluxinductor import agreement, dispatch, settings
from fluxinductor.kernels import symm
from fluxinductor.log import record_fallback

REDUCE_OPS = ("sum", "avg")


# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor (a FutureWarning on every call) in favour of
# these names for the same collectives; older torch has only the old names, which it does not deprecate.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group(group_name: str) -> dist.ProcessGroup:
    return _resolve_process_group(group_name)


def _known_ne(a, b) -> bool:
    """``a != b`` for sizes; under dynamic shapes (the fake implementations' SymInts) true only where it holds
    for every value of the symbols, so a check never adds a guard.  The real implementations see ints."""
    if isinstance(a, int) and isinstance(b, int):
        return a != b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a != b)


def _check_dim(dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{what}={dim} is out of range for a {ndim}-D tensor")
    return dim % ndim


# ---------------------------------------------------------------------------------------------------
# Reference decompositions (also the oracles of the kernel tests).
# ---------------------------------------------------------------------------------------------------


def all_gather(shard: Tensor, gather_dim: int, group: dist.ProcessGroup, op: str = "all_gather") -> Tensor:
    """Concatenate every rank's ``shard`` along ``gather_dim`` (rank order).  ``op``: the fused op a
    :class:`~fluxinductor.agreement.PeerFailureError` names."""
    world = group.size()
    gather_dim = _check_dim(gather_dim, shard.dim(), "gather_dim")
    shard = shard.contiguous()
    # shard: [S, ...] -> gathered_rows: [world * S, ...]
    gathered_rows = shard.new_empty((world * shard.shape[0],) + tuple(shard.shape[1:]))
    try:
        _all_gather_single(gathered_rows, shard, group=group)
    except RuntimeError as e:
        raise agreement.peer_failure(op, group, group.group_name, "its all-gather", e) from e
    if gather_dim == 0:
        return gathered_rows
    return torch.cat(gathered_rows.chunk(world, dim=0), dim=gather_dim)


def reduce_scatter(partial: Tensor, reduce_op: str, scatter_dim: int, group: dist.ProcessGroup,
                   op: str = "reduce_scatter") -> Tensor:
    """Sum (or average) ``partial`` over the group and keep this rank's slice of ``scatter_dim``.  ``op``: the fused
    op a :class:`~fluxinductor.agreement.PeerFailureError` names."""
    world = group.size()
    scatter_dim = _check_dim(scatter_dim, partial.dim(), "scatter_dim")
    if partial.shape[scatter_dim] % world:
        raise ValueError(f"dim {scatter_dim} of size {partial.shape[scatter_dim]} does not split over {world} ranks")
    if scatter_dim != 0:
        partial = torch.cat(partial.chunk(world, dim=scatter_dim), dim=0)
    partial = partial.contiguous()
    out = partial.new_empty((partial.shape[0] // world,) + tuple(partial.shape[1:]))
    try:
        _reduce_scatter_single(out, partial, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as e:
        raise agreement.peer_failure(op, group, group.group_name, "its reduce-scatter", e) from e
    # With scatter_dim > 0 the chunks were stacked on dim 0 above, so this rank's dim-0 slice already
    # has the output's shape: [..., size(scatter_dim) / world, ...].
    return out / world if reduce_op == "avg" else out


def _linear(a: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    # a: [..., K], weight: [K, N] -> [..., N]
    if a.dim() == 2:
        return torch.mm(a, weight) if bias is None else torch.addmm(bias, a, weight)
    out = torch.matmul(a, weight)
    return out if bias is None else out + bias


def _partial(a: Tensor, weight: Tensor, bias: Optional[Tensor], out_dtype: Optional[torch.dtype],
             more_a: Sequence[Tensor] = (), more_weights: Sequence[Tensor] = ()) -> Tensor:
    """This rank's term of a reduced matmul: ``(a @ weight + sum(a_i @ w_i) + bias)``, cast to ``out_dtype`` where
    given.  Further terms accumulate into the first product (addmm, as inductor runs such a sum), not through adds."""
    partial = _linear(a, weight, bias)
    if more_a:
        partial = partial.contiguous()
        rows = partial.view(-1, partial.shape[-1])
        for a_i, w_i in zip(more_a, more_weights):
            rows.addmm_(a_i.reshape(-1, a_i.shape[-1]), w_i)
    return partial if out_dtype is None else partial.to(out_dtype)


def all_gather_matmul_reference(
    shard: Tensor,
    weights: Sequence[Tensor],
    biases: Sequence[Optional[Tensor]],
    gather_dim: int,
    group_name: str,
) -> Tuple[List[Tensor], Tensor]:
    """all_gather(shard, gather_dim) then ``gathered @ weights[i] + biases[i]`` for each i."""
    gathered = all_gather(shard, gather_dim, _group(group_name), "all_gather_matmul")
    return [_linear(gathered, w, b) for w, b in zip(weights, biases)], gathered


def all_reduce(partial: Tensor, reduce_op: str, group: dist.ProcessGroup, op: str = "all_reduce") -> Tensor:
    """Sum (or average) ``partial`` over the group.  ``op``: the fused op a
    :class:`~fluxinductor.agreement.PeerFailureError` names."""
    out = partial.contiguous().clone()
    try:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as e:
        raise agreement.peer_failure(op, group, group.group_name, "its all-reduce", e) from e
    return out / group.size() if reduce_op == "avg" else out


def matmul_all_reduce_reference(
    a: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, group_name: str,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """all_reduce((a @ weight + bias).to(out_dtype), reduce_op); the bias is added on every rank."""
    return all_reduce(_partial(a, weight, bias, out_dtype), reduce_op, _group(group_name), "matmul_all_reduce")


def rms_norm_reference(h: Tensor, norm_weight: Tensor, eps: float, weight_after_cast: bool) -> Tensor:
    """RMSNorm of ``h`` over its last dim in fp32, as the two forms models write it: ``weight_after_cast``,
    ``(h * rsqrt(mean(h^2) + eps)).to(h.dtype) * norm_weight`` (Hugging Face's Llama); otherwise
    ``(h * rsqrt(mean(h^2) + eps) * norm_weight).to(h.dtype)`` (``F.rms_norm``)."""
    hf = h.float()
    x = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(h.dtype) * norm_weight if weight_after_cast else (x * norm_weight).to(h.dtype)


def matmul_reduce_scatter_reference(
    a: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, scatter_dim: int, group_name: str,
    out_dtype: Optional[torch.dtype] = None, more_a: Sequence[Tensor] = (), more_weights: Sequence[Tensor] = (),
) -> Tensor:
    """reduce_scatter((a @ weight + sum(a_i @ w_i) + bias).to(out_dtype), reduce_op, scatter_dim); the bias is added
    on every rank."""
    return reduce_scatter(_partial(a, weight, bias, out_dtype, more_a, more_weights), reduce_op, scatter_dim,
                          _group(group_name), "matmul_reduce_scatter")


# ---------------------------------------------------------------------------------------------------
# Input checks shared by the real and fake implementations.
# ---------------------------------------------------------------------------------------------------


def _check_all_gather_matmul(shard: Tensor, weights, biases, gather_dim: int) -> None:
    if len(weights) == 0:
        raise ValueError("all_gather_matmul needs at least one weight")
    if len(biases) != len(weights):
        raise ValueError(f"{len(weights)} weights but {len(biases)} biases (use None for no bias)")
    if shard.dim() < 2:
        raise ValueError(f"shard must be at least 2-D, got {shard.dim()}-D")
    gather_dim = _check_dim(gather_dim, shard.dim(), "gather_dim")
    if gather_dim == shard.dim() - 1:
        raise ValueError("gather_dim must not be the contraction (last) dim")
    for w, b in zip(weights, biases):
        if w.dim() != 2 or _known_ne(w.shape[0], shard.shape[-1]):
            raise ValueError(f"weight of shape {tuple(w.shape)} does not match shard {tuple(shard.shape)}")
        _check_dtype_and_bias(shard, w, b, "shard")


def _check_dtype_and_bias(a: Tensor, weight: Tensor, bias: Optional[Tensor], what: str) -> None:
    """weight [K, N] and bias [N] (or None) in ``a``'s dtype: checked before the collective, which would otherwise
    run before the matmul refuses them."""
    if weight.dtype != a.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from the {what}'s {a.dtype}")
    if bias is None:
        return
    if bias.dim() != 1 or _known_ne(bias.shape[0], weight.shape[1]):
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not match weight {tuple(weight.shape)} "
                         f"(a [N] vector)")
    if bias.dtype != a.dtype:
        raise ValueError(f"bias dtype {bias.dtype} differs from the {what}'s {a.dtype}")


def _check_matmul_all_reduce(a: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str) -> None:
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"reduce_op must be one of {REDUCE_OPS}, got {reduce_op!r}")
    if a.dim() < 2 or weight.dim() != 2 or _known_ne(a.shape[-1], weight.shape[0]):
        raise ValueError(f"cannot multiply {tuple(a.shape)} by {tuple(weight.shape)}")
    _check_dtype_and_bias(a, weight, bias, "input")


def _check_matmul_reduce_scatter(a: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, scatter_dim: int,
                                 world: int, more_a: Sequence[Tensor] = (), more_weights: Sequence[Tensor] = ()) -> None:
    _check_matmul_all_reduce(a, weight, bias, reduce_op)
    if len(more_a) != len(more_weights):
        raise ValueError(f"{len(more_a)} further operands but {len(more_weights)} further weights")
    for a_i, w_i in zip(more_a, more_weights):
        if a_i.dim() != a.dim() or any(_known_ne(x, y) for x, y in zip(a_i.shape[:-1], a.shape[:-1])):
            raise ValueError(f"a further operand of shape {tuple(a_i.shape)} does not match {tuple(a.shape)} but in "
                             "its last dim")
        if w_i.dim() != 2 or _known_ne(a_i.shape[-1], w_i.shape[0]) or _known_ne(w_i.shape[1], weight.shape[1]):
            raise ValueError(f"cannot add {tuple(a_i.shape)} @ {tuple(w_i.shape)} to {tuple(a.shape)} @ "
                             f"{tuple(weight.shape)}")
        if a_i.dtype != a.dtype:
            raise ValueError(f"a further operand's dtype {a_i.dtype} differs from the input's {a.dtype}")
        _check_dtype_and_bias(a, w_i, None, "input")
    scatter_dim = _check_dim(scatter_dim, a.dim(), "scatter_dim")
    size = weight.shape[1] if scatter_dim == a.dim() - 1 else a.shape[scatter_dim]
    if _known_ne(size % world, 0):
        raise ValueError(f"dim {scatter_dim} of size {size} does not split over {world} ranks")


def _dim_or_raw(dim: int, t: Tensor) -> int:
    """``dim`` normalized where it is in range (ranks may name a dim from either end), as given otherwise."""
    return dim % t.dim() if -t.dim() <= dim < t.dim() else dim


def _matmul_fields(group: dist.ProcessGroup, a: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str,
                   out_dtype: Optional[torch.dtype]) -> dict:
    """What every rank of a reduced matmul's group must agree on (:mod:`fluxinductor.agreement`): shapes, dtypes and
    arguments, and what the dispatcher decides a path on (operand layouts, path settings), so that no two ranks take
    paths with different collectives."""
    return {"world": group.size(), "input shape": a.shape, "dtype": a.dtype, "device": a.device.type,
            "weight shape": weight.shape, "weight dtype": weight.dtype,
            "bias shape": None if bias is None else bias.shape, "bias dtype": None if bias is None else bias.dtype,
            "reduce_op": reduce_op, "out_dtype": out_dtype,
            "layouts (strides, 16-byte aligned) of input, weight, bias": (_layout(a), _layout(weight), _layout(bias)),
            **_path_settings()}


def _layout(t: Optional[Tensor]) -> Optional[tuple]:
    """What a dispatch plan reads of an operand beyond its shape and dtype: its strides and whether its data is 16-byte
    aligned (the kernels' eligibility, a weight's K- or N-major form)."""
    return None if t is None else (tuple(t.stride()), t.data_ptr() % 16 == 0)


def _path_settings() -> dict:
    """The settings that choose a call's path (a fused kernel, async-TP or the decomposition, each with its own
    collectives): ranks that differ in them would wait in collectives their peers never join."""
    return {"FLUXINDUCTOR_DISPATCH": settings.current.dispatch, "tuning asynctp": settings.tuning.asynctp}


# ---------------------------------------------------------------------------------------------------
# The ops.
# ---------------------------------------------------------------------------------------------------


# The fused ops.  They carry no cudagraph_unsafe tag: CUDA graphs capture them like any other op (the per-compile option
# cuda_graphs, on by default; with it off the backend leaves graphs compiled under CUDA graphs to plain inductor).
FUSED_OPS = ("fluxinductor::all_gather_matmul", "fluxinductor::matmul_reduce_scatter",
             "fluxinductor::matmul_all_reduce", "fluxinductor::matmul_all_reduce_rms_norm")

# The ops are defined with torch.library.Library rather than torch.library.custom_op: custom_op's Python wrappers (its
# autograd layer, the redispatch below it, the backend wrapper, dynamo's disable) cost 20-40 us of host time per call
# on the 2xH200 machine, which a host-bound model pays on every layer (docs/design_ag_gemm.md).  The
# kernel is registered for every backend (CompositeExplicitAutograd) and has no autograd formula: the passes put the
# ops into graphs AOTAutograd has already differentiated, which run without grad.  A call that would need one is
# refused (_refuse_grad), where the autograd fallback would otherwise only warn at backward time.
_LIB = torch.library.Library("fluxinductor", "FRAGMENT")


def _op(schema: str, tags: Tuple[torch.Tag, ...] = ()):
    """Define ``fluxinductor::<the function's name><schema>`` (with ``tags``) with the decorated function as its kernel,
    behind the refusal of inputs that need a gradient."""

    def define(fn):
        name = fn.__name__

        def kernel(*args, **kwargs):
            _refuse_grad(name, *args, *kwargs.values())
            return fn(*args, **kwargs)

        _LIB.define(name + schema, tags=tags)
        _LIB.impl(name, kernel, "CompositeExplicitAutograd")
        return fn

    return define


def _any_requires_grad(*args) -> bool:
    """Whether a tensor among ``args`` (tensors, None, or lists of them) requires grad."""
    for arg in args:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(t, Tensor) and t.requires_grad:
                return True
    return False


def _refuse_grad(name: str, *args) -> None:
    if torch.is_grad_enabled() and _any_requires_grad(*args):
        raise RuntimeError(f"fluxinductor::{name} has no autograd formula: call it under torch.no_grad() (the "
                           "compile passes put it into graphs that AOTAutograd has already differentiated)")


# needs_fixed_stride_order: inductor hands the op its operands in the stride order of the graph's values.  A batch-major
# shard ([B, S/w, H] gathered on S, B > 1) is read in place, so the pass gives it a contiguous one; without the tag
# inductor may lay the producing kernel's output out in another order (a norm reading the rows-first reduce-scatter's
# result kept that order), and the call then permutes itself (fluxinductor.dispatch).
@_op("(Tensor shard, Tensor[] weights, Tensor?[] biases, int gather_dim, str group_name, bool return_gathered) "
     "-> (Tensor[], Tensor)", tags=(torch.Tag.needs_fixed_stride_order,))
def all_gather_matmul(
    shard: Tensor,
    weights: List[Tensor],
    biases: List[Optional[Tensor]],
    gather_dim: int,
    group_name: str,
    return_gathered: bool,
) -> Tuple[List[Tensor], Tensor]:
    """``A = all_gather(shard, gather_dim)``; returns ``([A @ W_i + b_i for each i], A)``.

    shard: [..., S, ..., K] (this rank's slice of ``gather_dim``), weights[i]: [K, N_i],
    biases[i]: [N_i] or None.  outputs[i]: [..., world * S, ..., N_i].  The second result is the
    gathered ``A`` when ``return_gathered``, else an empty tensor.
    """
    key = dispatch.replay_key("all_gather_matmul", group_name, (gather_dim, return_gathered, len(weights)),
                              (shard, *weights, *biases))
    replay = dispatch.replay(key)
    if replay is not None:  # a signature this group agreed on and the dispatcher ran fused
        return replay(shard, weights, biases)
    group = _group(group_name)
    agreement.check("all_gather_matmul", group, group_name, {
        "world": group.size(), "shard shape": shard.shape, "dtype": shard.dtype, "device": shard.device.type,
        "weight shapes": tuple(w.shape for w in weights), "weight dtypes": tuple(w.dtype for w in weights),
        "bias shapes": tuple(None if b is None else b.shape for b in biases),
        "bias dtypes": tuple(None if b is None else b.dtype for b in biases),
        "gather_dim": _dim_or_raw(gather_dim, shard), "return_gathered": return_gathered,
        "layouts (strides, 16-byte aligned) of shard, weights, biases": (
            _layout(shard), tuple(_layout(w) for w in weights), tuple(_layout(b) for b in biases)),
        **_path_settings(),
    }, lambda: _check_all_gather_matmul(shard, weights, biases, gather_dim))
    fused = dispatch.all_gather_matmul(shard, weights, biases, gather_dim, group_name, return_gathered, key)
    if fused is not None:
        return fused
    outputs, gathered = all_gather_matmul_reference(shard, weights, biases, gather_dim, group_name)
    return outputs, (gathered if return_gathered else shard.new_empty(0))


@torch.library.register_fake("fluxinductor::all_gather_matmul")
def _(shard, weights, biases, gather_dim, group_name, return_gathered):
    _check_all_gather_matmul(shard, weights, biases, gather_dim)
    world = _group(group_name).size()
    gather_dim = gather_dim % shard.dim()
    gathered_shape = list(shard.shape)
    gathered_shape[gather_dim] *= world
    outputs = [shard.new_empty(gathered_shape[:-1] + [w.shape[1]]) for w in weights]
    gathered = shard.new_empty(gathered_shape) if return_gathered else shard.new_empty(0)
    return outputs, gathered


# needs_fixed_stride_order: as all_gather_matmul's, for a batch-major operand read in place.
@_op("(Tensor a, Tensor weight, Tensor? bias, str reduce_op, int scatter_dim, str group_name, "
     "ScalarType? out_dtype=None, Tensor[]? more_a=None, Tensor[]? more_weights=None) -> Tensor",
     tags=(torch.Tag.needs_fixed_stride_order,))
def matmul_reduce_scatter(
    a: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, scatter_dim: int, group_name: str,
    out_dtype: Optional[torch.dtype] = None, more_a: Optional[Sequence[Tensor]] = None,
    more_weights: Optional[Sequence[Tensor]] = None,
) -> Tensor:
    """``reduce_scatter((a @ weight + sum(a_i @ w_i) + bias).to(out_dtype), reduce_op, scatter_dim)`` over the group.

    a: [..., K] (this rank's partial operand), weight: [K, N], bias: [N] or None, added on every rank
    before the reduction, as the unfused graph did.  ``more_a`` and ``more_weights``: further terms of the sum
    (a_i [..., K_i] of a's other dims, w_i [K_i, N]), the input gradient of separate gate/up or Q/K/V linears, which
    the fused path runs as K slabs of one GEMM, each operand read in place.  ``out_dtype`` (None: a's): the dtype the
    partials are reduced in, as autocast's ``reduce_scatter(mm(a, w).float())`` (the matmul rounds to a's dtype
    first).  Returns [...] with ``scatter_dim`` divided by world.
    """
    more_a, more_weights = more_a or (), more_weights or ()
    key = dispatch.replay_key("matmul_reduce_scatter", group_name, (reduce_op, scatter_dim, out_dtype),
                              (a, weight, bias, *more_a, *more_weights))
    replay = dispatch.replay(key)
    if replay is not None:  # a signature this group agreed on and the dispatcher ran fused
        return replay(a, weight, bias, more_a, more_weights) if more_a else replay(a, weight, bias)
    group = _group(group_name)
    fields = {**_matmul_fields(group, a, weight, bias, reduce_op, out_dtype), "scatter_dim": _dim_or_raw(scatter_dim, a)}
    if more_a:
        fields["further terms (shapes, dtypes, layouts)"] = tuple(
            (a_i.shape, w_i.shape, a_i.dtype, w_i.dtype, _layout(a_i), _layout(w_i))
            for a_i, w_i in zip(more_a, more_weights))
    agreement.check("matmul_reduce_scatter", group, group_name, fields,
                    lambda: _check_matmul_reduce_scatter(a, weight, bias, reduce_op, scatter_dim, group.size(),
                                                         more_a, more_weights))
    fused = dispatch.matmul_reduce_scatter(a, weight, bias, reduce_op, scatter_dim, group_name, out_dtype, key,
                                           more_a, more_weights)
    if fused is not None:
        return fused
    return matmul_reduce_scatter_reference(a, weight, bias, reduce_op, scatter_dim, group_name, out_dtype, more_a,
                                           more_weights)


@torch.library.register_fake("fluxinductor::matmul_reduce_scatter")
def _(a, weight, bias, reduce_op, scatter_dim, group_name, out_dtype=None, more_a=None, more_weights=None):
    more_a, more_weights = more_a or (), more_weights or ()
    world = _group(group_name).size()
    _check_matmul_reduce_scatter(a, weight, bias, reduce_op, scatter_dim, world, more_a, more_weights)
    shape = list(a.shape[:-1]) + [weight.shape[1]]
    scatter_dim = scatter_dim % len(shape)
    shape[scatter_dim] //= world
    return a.new_empty(shape, dtype=out_dtype or a.dtype)


@_op("(Tensor a, Tensor weight, Tensor? bias, str reduce_op, str group_name, ScalarType? out_dtype=None) -> Tensor")
def matmul_all_reduce(
    a: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, group_name: str,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """``all_reduce((a @ weight + bias).to(out_dtype), reduce_op)`` over the group: a row-parallel matmul in plain
    tensor parallelism whose all-reduce the graph leaves whole (symbolic rows, rows that do not split over the group,
    or a split the cost model vetoes: ``passes/all_reduce_split.py``).

    a: [..., K], weight: [K, N], bias: [N] or None (added on every rank, as the graph did); returns [..., N].  It runs
    one of three paths (:func:`_all_reduce_plan`, decided on a call signature's first call and remembered):
    ``oneshot``, the matmul into this rank's partial buffer and the one-shot all-reduce kernel
    (:mod:`fluxinductor.kernels.one_shot`: small outputs on NVLink peers); ``split``, where the rows split over the
    group and :func:`fluxinductor.dispatch.matmul_reduce_scatter` takes the call (a fused kernel or async-TP), that
    fused reduce-scatter and an all-gather of the result; otherwise ``sequential``, the matmul and the all-reduce, the
    graph's own decomposition.
    """
    group = _group(group_name)
    agreement.check("matmul_all_reduce", group, group_name,
                    _matmul_fields(group, a, weight, bias, reduce_op, out_dtype),
                    lambda: _check_matmul_all_reduce(a, weight, bias, reduce_op))
    rows = a.numel() // a.shape[-1] if a.shape[-1] else 0
    a2d = a.reshape(rows, a.shape[-1])
    path, why = _all_reduce_plan(a, a2d, weight, bias, reduce_op, group_name, out_dtype, group.size(), rows)
    if path == "oneshot":
        from fluxinductor.kernels import one_shot

        return one_shot.matmul_all_reduce(a2d, weight, bias, reduce_op, group_name, out_dtype,
                                          checked=True).reshape(*a.shape[:-1], weight.shape[1])
    return _all_reduce_unfused(a, a2d, weight, bias, reduce_op, group_name, out_dtype, group, path, why,
                               "matmul_all_reduce")


def _all_reduce_unfused(a: Tensor, a2d: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str,
                        group_name: str, out_dtype: Optional[torch.dtype], group: dist.ProcessGroup, path: str,
                        why: Optional[str], op: str) -> Tensor:
    """A reduced matmul's split or sequential path (``path``, ``why`` from :func:`_all_reduce_plan`)."""
    if path == "split":
        part = _split_all_reduce(a2d, weight, bias, reduce_op, group_name, out_dtype, group)
        if part is not None:
            return part.reshape(*a.shape[:-1], weight.shape[1])
    elif why is not None:
        record_fallback(op, why)
    return matmul_all_reduce_reference(a, weight, bias, reduce_op, group_name, out_dtype)


def _check_rms_norm(a: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor) -> None:
    shape = list(a.shape[:-1]) + [weight.shape[1]]
    if residual.dim() != len(shape) or any(_known_ne(x, y) for x, y in zip(residual.shape, shape)):
        raise ValueError(f"residual of shape {tuple(residual.shape)} does not match the output {tuple(shape)}")
    if residual.dtype != a.dtype or norm_weight.dtype != a.dtype:
        raise ValueError(f"residual ({residual.dtype}) and norm weight ({norm_weight.dtype}) must be in the input's "
                         f"dtype {a.dtype}")
    if norm_weight.dim() != 1 or _known_ne(norm_weight.shape[0], weight.shape[1]):
        raise ValueError(f"norm weight of shape {tuple(norm_weight.shape)} is not [N={weight.shape[1]}]")


@_op("(Tensor a, Tensor weight, Tensor? bias, str reduce_op, str group_name, Tensor residual, Tensor norm_weight, "
     "float eps, bool weight_after_cast) -> (Tensor, Tensor)")
def matmul_all_reduce_rms_norm(
    a: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, group_name: str, residual: Tensor,
    norm_weight: Tensor, eps: float, weight_after_cast: bool,
) -> Tuple[Tensor, Tensor]:
    """``h = residual + all_reduce(a @ weight + bias, reduce_op)`` and ``rms_norm(h)`` (:func:`rms_norm_reference`):
    a row-parallel matmul whose all-reduce feeds a residual add and the RMSNorm after it, as a transformer layer's
    output projection does in plain tensor parallelism (``passes/all_reduce_norm.py``).

    a: [..., K], weight: [K, N], bias: [N] or None, residual: [..., N] and norm_weight: [N], both in a's dtype.
    Returns (h, normed), both [..., N] in a's dtype.  On the one-shot path the kernel adds the residual and normalizes
    each row as it reduces it (:func:`fluxinductor.kernels.one_shot.matmul_all_reduce`); on the others,
    :func:`matmul_all_reduce`'s paths, then the add and the norm.
    """
    group = _group(group_name)
    agreement.check("matmul_all_reduce_rms_norm", group, group_name,
                    {**_matmul_fields(group, a, weight, bias, reduce_op, None), "residual shape": residual.shape,
                     "norm weight shape": norm_weight.shape, "eps": eps, "weight_after_cast": weight_after_cast},
                    lambda: (_check_matmul_all_reduce(a, weight, bias, reduce_op),
                             _check_rms_norm(a, weight, residual, norm_weight)))
    rows = a.numel() // a.shape[-1] if a.shape[-1] else 0
    a2d = a.reshape(rows, a.shape[-1])
    path, why = _all_reduce_plan(a, a2d, weight, bias, reduce_op, group_name, None, group.size(), rows)
    if path == "oneshot":
        from fluxinductor.kernels import one_shot

        n = weight.shape[1]
        h, normed = one_shot.matmul_all_reduce(
            a2d, weight, bias, reduce_op, group_name, checked=True, residual=residual.reshape(rows, n),
            norm=(norm_weight, eps, weight_after_cast))
        return h.reshape(residual.shape), normed.reshape(residual.shape)
    # In place into the reduced result (a new tensor): h keeps its contiguous layout, as the fake promises, whatever
    # the residual's strides.
    h = _all_reduce_unfused(a, a2d, weight, bias, reduce_op, group_name, None, group, path, why,
                            "matmul_all_reduce_rms_norm").add_(residual)
    return h, rms_norm_reference(h, norm_weight, eps, weight_after_cast).contiguous()


@torch.library.register_fake("fluxinductor::matmul_all_reduce_rms_norm")
def _(a, weight, bias, reduce_op, group_name, residual, norm_weight, eps, weight_after_cast):
    _check_matmul_all_reduce(a, weight, bias, reduce_op)
    _check_rms_norm(a, weight, residual, norm_weight)
    shape = list(a.shape[:-1]) + [weight.shape[1]]
    return a.new_empty(shape), a.new_empty(shape)


def _split_all_reduce(a2d: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, group_name: str,
                      out_dtype: Optional[torch.dtype], group: dist.ProcessGroup) -> Optional[Tensor]:
    """The split path: [rows, N] through :func:`fluxinductor.dispatch.matmul_reduce_scatter` and an all-gather, or
    None where the dispatcher declined the reduce-scatter (it recorded why)."""
    part = dispatch.matmul_reduce_scatter(a2d, weight, bias, reduce_op, 0, group_name, out_dtype)
    # part: this rank's [rows / world, N] of the reduced result -> every rank's, [rows, N]
    return None if part is None else all_gather(part, 0, group, "matmul_all_reduce")


# ---------------------------------------------------------------------------------------------------
# matmul_all_reduce's path: one-shot, split or sequential.
# ---------------------------------------------------------------------------------------------------

# Decisions remembered per call signature (as dispatch._plans): the measured choice runs collectives on its first call,
# so it must never run again for the same signature, and a call under CUDA graph capture can only reuse it.
_all_reduce_plans: Dict[tuple, Tuple[str, Optional[str]]] = {}
_MAX_PLANS = 4096


def clear_plans() -> None:
    """Forget matmul_all_reduce's remembered paths (tests that replace the dispatcher's pieces between calls)."""
    _all_reduce_plans.clear()


def _all_reduce_plan(a: Tensor, a2d: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str,
                     group_name: str, out_dtype: Optional[torch.dtype], world: int,
                     rows: int) -> Tuple[str, Optional[str]]:
    """(path, reason): "oneshot", "split" or "sequential", with the reason a path other than the one-shot kernel
    runs (None for split, whose fallbacks the dispatcher records).

    * the one-shot kernel is offered only on CUDA tensors of NVLink peers (``dispatch._peers_reason``) under the
      ``auto`` or ``fused`` dispatch where :func:`fluxinductor.kernels.one_shot.unsupported_reason` finds nothing;
      without it the choice is the split where the rows split and (``auto``) the cost model does not veto it, else
      sequential;
    * ``fused``: the one-shot kernel for small outputs (:func:`fluxinductor.kernels.one_shot.small_enough`) or where
      the split cannot run, the split above;
    * ``auto``: measured on the signature's first call by :func:`fluxinductor.calibration.choose_measured` among
      sequential, oneshot and (where not vetoed) split, on every rank at the same call.  Where that module does not
      offer the function, the ``fused`` size rule with the split veto.  Under CUDA graph capture only a remembered
      plan counts (a capture measures nothing); without one, sequential.  A remembered sequential plan runs the
      one-shot kernel under capture where it can (:func:`_captured_one_shot`).
    """
    dispatch_mode = dispatch.mode()
    capturing = symm.capturing()
    key = (dispatch_mode, group_name, world, reduce_op, out_dtype, dispatch._operand_key(a),
           dispatch._operand_key(weight), dispatch._operand_key(bias),
           dispatch._auto_key(a.device, world) if dispatch_mode == "auto" and a.is_cuda else None)
    plan = _all_reduce_plans.get(key)
    if plan is not None:
        if plan[0] == "oneshot" and capturing:
            why = _one_shot_reason(a2d, weight, bias, reduce_op, group_name, out_dtype, dispatch_mode)
            if why is not None:
                return "sequential", why
        if plan[0] == "sequential" and capturing and _captured_one_shot(a2d, weight, bias, reduce_op, group_name,
                                                                        out_dtype, dispatch_mode, world, rows):
            return "oneshot", None
        return plan
    plan = _decide_all_reduce(a, a2d, weight, bias, reduce_op, group_name, out_dtype, world, rows, dispatch_mode)
    if capturing:
        return plan
    if len(_all_reduce_plans) >= _MAX_PLANS:
        _all_reduce_plans.clear()
    _all_reduce_plans[key] = plan
    return plan


def _captured_one_shot(a2d: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, group_name: str,
                       out_dtype: Optional[torch.dtype], dispatch_mode: str, world: int, rows: int) -> bool:
    """Whether a call captured in a CUDA graph whose remembered plan is sequential runs the one-shot kernel instead.

    The plan compares eager calls, but inside a captured graph the sequential path (the matmul, then c10d's
    all-reduce) cost about 1.1 ms more device time per call in the decode steps of bench_model (2xH200, plain TP,
    ``reduce-overhead``: 32 tokens with dynamic shapes, where it measured as fast as the one-shot path eagerly, and 64
    tokens under the ``fused`` dispatch), where captured one-shot calls cost what they cost eagerly.  So a captured
    call takes the one-shot kernel where it can run and the output is small enough for it
    (:func:`fluxinductor.kernels.one_shot.small_enough`).  Every input is the same on every rank (the agreed plan, the
    shapes, the group's workspace, grown collectively), so every rank captures the same path."""
    if dispatch_mode not in ("auto", "fused"):
        return False
    from fluxinductor.kernels import one_shot

    if not one_shot.small_enough(rows, weight.shape[1], a2d.dtype, world):
        return False
    return _one_shot_reason(a2d, weight, bias, reduce_op, group_name, out_dtype, dispatch_mode) is None


def _one_shot_reason(a2d: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str, group_name: str,
                     out_dtype: Optional[torch.dtype], dispatch_mode: str) -> Optional[str]:
    """Why this call cannot run the one-shot kernel, or None.  The group's NVLink check (a collective on the group's
    first call) comes first and depends only on what every rank shares (the mode, CUDA operands)."""
    if dispatch_mode not in ("auto", "fused"):
        return f"FLUXINDUCTOR_DISPATCH={dispatch_mode}"
    if not a2d.is_cuda:
        return f"{a2d.device.type} tensors have no one-shot all-reduce"
    why = dispatch._peers_reason(group_name, a2d.device)
    try:
        from fluxinductor.kernels import one_shot
    except Exception as e:  # noqa: BLE001 - a broken kernel module means "no one-shot path"
        return f"one-shot all-reduce unavailable ({type(e).__name__}: {e})"
    return why or one_shot.unsupported_reason(a2d, weight, bias, reduce_op, group_name, out_dtype)


def _decide_all_reduce(a: Tensor, a2d: Tensor, weight: Tensor, bias: Optional[Tensor], reduce_op: str,
                       group_name: str, out_dtype: Optional[torch.dtype], world: int, rows: int,
                       dispatch_mode: str) -> Tuple[str, Optional[str]]:
    """The plan of :func:`_all_reduce_plan` for a signature it has not seen."""
    split_why = (f"{rows} rows do not split over {world} ranks" if rows % world else
                 dispatch.split_all_reduce_veto(a, weight, world))
    one_shot_why = _one_shot_reason(a2d, weight, bias, reduce_op, group_name, out_dtype, dispatch_mode)
    if one_shot_why is not None:
        return ("split", None) if split_why is None else ("sequential", split_why)
    from fluxinductor.kernels import one_shot

    n = weight.shape[1]
    small = one_shot.small_enough(rows, n, a.dtype, world)
    if dispatch_mode == "fused":
        return ("oneshot", None) if small or split_why is not None else ("split", None)
    if symm.capturing():
        return "sequential", "CUDA graph capture before an eager call measured the paths of this call"
    choose = _choose_measured()
    if choose is None:
        if small:
            return "oneshot", None
        return ("split", None) if split_why is None else ("sequential", split_why)
    group = _group(group_name)
    candidates = {
        "sequential": lambda: matmul_all_reduce_reference(a2d, weight, bias, reduce_op, group_name, out_dtype),
        "oneshot": lambda: one_shot.matmul_all_reduce(a2d, weight, bias, reduce_op, group_name, out_dtype,
                                                      checked=True),
    }
    if split_why is None:
        def split() -> Tensor:  # where the dispatcher declines the reduce-scatter, what the op would then run
            part = _split_all_reduce(a2d, weight, bias, reduce_op, group_name, out_dtype, group)
            return part if part is not None else matmul_all_reduce_reference(a2d, weight, bias, reduce_op,
                                                                             group_name, out_dtype)

        candidates["split"] = split
    path, reason = choose(op="matmul_all_reduce", device=a.device, group_name=group_name, world=world, m=rows,
                          k=a.shape[-1] * world, n=n, dtype=a.dtype, candidates=candidates)
    if path not in candidates:
        return "sequential", f"calibration chose {path!r}, not one of {sorted(candidates)}"
    return path, None if path != "sequential" else f"measured: {reason}"


def _choose_measured():
    """``fluxinductor.calibration.choose_measured``, or None where that module or function is not there."""
    try:
        from fluxinductor import calibration
    except ImportError:
        return None
    return getattr(calibration, "choose_measured", None)


@torch.library.register_fake("fluxinductor::matmul_all_reduce")
def _(a, weight, bias, reduce_op, group_name, out_dtype=None):
    _check_matmul_all_reduce(a, weight, bias, reduce_op)
    return a.new_empty(list(a.shape[:-1]) + [weight.shape[1]], dtype=out_dtype or a.dtype)
