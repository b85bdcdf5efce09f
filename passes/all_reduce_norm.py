"""Rewrite ``matmul_all_reduce -> residual add -> RMSNorm`` into ``fluxinductor.matmul_all_reduce_rms_norm``.

In plain tensor parallelism a layer's row-parallel output projection is all-reduced, added to the residual stream and
normalized by the next layer's RMSNorm.  Where ``all_reduce_split.py`` keeps such an all-reduce whole as one
``fluxinductor.matmul_all_reduce`` (the op's one-shot all-reduce kernel could run: decode sizes under CUDA graphs), this
pass folds the add and the norm into the op: the one-shot kernel adds the residual and normalizes each row while it
reduces it, which saves the kernel inductor would otherwise launch for the add and the norm, per layer output.

Before (bf16 or fp16; fp32 where the graph has the casts; the forms Hugging Face's Llama and ``F.rms_norm`` leave
after decomposition)::

    y   = fluxinductor.matmul_all_reduce(a, W_o, b, reduce_op, group)     # [M, N]; out_dtype absent or None
    y3  = reshape(y, [B, S, N])                                           # views, optional
    h   = add(y3, r)                                                      # r: the residual, [B, S, N] (either operand)
    hf  = convert_element_type(h, float32)                                # read by pow and the mul below only
    x   = mul(hf, rsqrt(add(mean(pow(hf, 2), [-1], True), eps)))
    out = mul(convert_element_type(x, h.dtype), g)          # weight_after_cast=True (Llama), or
    out = convert_element_type(mul(x, g), h.dtype)          # weight_after_cast=False (F.rms_norm); g: [N], h.dtype

After::

    f      = fluxinductor.matmul_all_reduce_rms_norm(a, W_o, b, reduce_op, group, reshape(r, [M, N]), g, eps,
                                                     weight_after_cast)
    h      = reshape(getitem(f, 0), [B, S, N])                            # every reader of h (the next residual add)
    out    = reshape(getitem(f, 1), [B, S, N])                            # every reader of the norm

The reshapes are there only where the shapes differ (the op's results have the shape of ``y``).  A strided residual
reaches the op as a contiguous copy (``clone``): the op's results are contiguous.

The op computes what the graph did (``fluxinductor.ops.rms_norm_reference``): the same fp32 statistics, the same
roundings to h's dtype.  Required: every node between ``y`` and ``out`` reads and is read as shown (one reader each;
``h`` may have others, ``hf`` exactly the two), a plain add of operands of the same shape and dtype, the mean over the
last dim with ``keepdim``, a constant ``eps``, ``h``, ``g`` and ``out`` all in the matmul operand's dtype (bf16, fp16 or
fp32), and no possible mutation between ``y`` and ``out`` (the op reads the matmul's operands at the add and the norm
weight there too; a weight computed after the add by pure ops moves up with the op).  A ``matmul_all_reduce`` whose
reader chain starts like the pattern (views, an add, a cast of the add to fp32) but does not match is recorded with
:func:`fluxinductor.log.record_skip`; any other is left alone silently (nothing was there to fuse).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch.fx import Graph, Node

from fluxinductor.log import record_fused, record_skip
from fluxinductor.passes import _match as m
from fluxinductor.passes._match import Skip

PATTERN = "all_reduce_rms_norm"

_ADD = m.aten.add.Tensor
_ADD_EPS = (m.aten.add.Tensor, m.aten.add.Scalar)
_POW = m.aten.pow.Tensor_Scalar
_MEAN = m.aten.mean.dim
_RSQRT = m.aten.rsqrt.default
_MUL = m.aten.mul.Tensor
_RESHAPE = m.aten.reshape.default
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# How many views the walk from the matmul_all_reduce to the add looks through before it gives up.
_MAX_VIEWS = 4


def _ops():
    """(matmul_all_reduce, matmul_all_reduce_rms_norm) overloads."""
    from fluxinductor import ops  # noqa: F401  (registers torch.ops.fluxinductor)

    registered = torch.ops.fluxinductor
    return registered.matmul_all_reduce.default, registered.matmul_all_reduce_rms_norm.default


@dataclass
class _Match:
    reduced: Node  # the matmul_all_reduce
    views: List[Node]  # reduced -> ... -> the add's operand
    add: Node  # h = reduced (viewed) + residual
    residual: Node
    upcast: Node  # convert_element_type(h, float32)
    norm: List[Node]  # pow, mean, eps add, rsqrt, mul
    tail: List[Node]  # [cast, weight mul] (weight_after_cast) or [weight mul, cast]; tail[-1] is the norm's output
    weight: Node  # the norm weight, [N]
    eps: float
    weight_after_cast: bool

    @property
    def out(self) -> Node:
        return self.tail[-1]

    def nodes(self) -> List[Node]:
        """Every node the rewrite replaces."""
        return [self.reduced, *self.views, self.add, self.upcast, *self.norm, *self.tail]


def _arg(node: Node, index: int, name: str, default=None):
    """Argument ``index`` (keyword ``name``) of ``node``."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _other_operand(binary: Node, operand: Node) -> Optional[object]:
    """The other operand of ``binary`` (a two-operand op reading ``operand`` once), else None."""
    if len(binary.args) != 2:
        return None
    x, y = binary.args
    if x is operand and y is not operand:
        return y
    if y is operand and x is not operand:
        return x
    return None


def _one_user(node: Node, what: str) -> Node:
    user = m.only_user(node)
    if user is None:
        raise Skip("norm intermediate has other users", f"{what} {node.name} has {len(node.users)} users")
    return user


def _is_upcast(node: Node, x: Node) -> bool:
    return m.is_call(node, m.CONVERT) and node.args[0] is x and _arg(node, 1, "dtype") == torch.float32


def _starts_like_the_pattern(reduced: Node) -> bool:
    """Whether a reader chain of ``reduced`` (through views) reaches an add whose result is cast to fp32: a residual
    add and a norm as far as its first nodes show, so a failed match is worth a line in the log."""
    frontier = [reduced]
    for _ in range(_MAX_VIEWS + 1):
        nxt = []
        for x in frontier:
            for user in x.users:
                if m.is_call(user, _ADD) and any(_is_upcast(c, user) for c in user.users):
                    return True
                if m.is_call(user, m.VIEW_OPS) and user.args[0] is x:
                    nxt.append(user)
        frontier = nxt
    return False


def _match_add(reduced: Node) -> Tuple[List[Node], Node, Node]:
    """The views from ``reduced`` to the residual add, the add and the residual.  Raises :class:`Skip`."""
    out_dtype = _arg(reduced, 5, "out_dtype")
    if out_dtype is not None:
        raise Skip("matmul_all_reduce with out_dtype", f"{reduced.name}: out_dtype={out_dtype}")
    views, x = [], reduced
    while True:
        user = m.only_user(x)
        if user is None:
            raise Skip("matmul_all_reduce output has other users", f"{x.name} has {len(x.users)} users")
        if not (m.is_call(user, m.VIEW_OPS) and user.args[0] is x) or len(views) == _MAX_VIEWS:
            break
        views.append(user)
        x = user
    add = user
    if not m.is_call(add, _ADD):
        raise Skip("no residual add", f"{x.name} is read by {add.format_node()}")
    if set(add.kwargs) - {"alpha"} or add.kwargs.get("alpha", 1) != 1:
        raise Skip("residual add with alpha", add.format_node())
    residual = _other_operand(add, x)
    if not isinstance(residual, Node):
        raise Skip("residual is not a tensor", add.format_node())
    x_val, r_val, h_val = m.val(x), m.val(residual), m.val(add)
    if x_val is None or r_val is None or h_val is None:
        raise Skip("no tensor metadata", add.name)
    if not m.same_shape(r_val.shape, x_val.shape) or r_val.dtype != x_val.dtype:
        raise Skip("residual does not match the reduced tensor",
                   f"residual {r_val.dtype}{list(r_val.shape)}, reduced {x_val.dtype}{list(x_val.shape)}")
    return views, add, residual


def _match_norm(add: Node) -> Tuple[Node, List[Node], float]:
    """(upcast, [pow, mean, eps add, rsqrt, mul], eps) of the RMSNorm statistics of ``add``.  Raises :class:`Skip`."""
    upcasts = [u for u in add.users if _is_upcast(u, add)]
    if len(upcasts) != 1:
        raise Skip("no fp32 upcast of the residual sum", f"{add.name}: {len(upcasts)} casts to float32")
    upcast = upcasts[0]
    if len(upcast.users) != 2:
        raise Skip("norm intermediate has other users", f"fp32 upcast {upcast.name} has {len(upcast.users)} users")
    pows = [u for u in upcast.users if m.is_call(u, _POW) and u.args[0] is upcast]
    if len(pows) != 1 or isinstance(pows[0].args[1], bool) or pows[0].args[1] != 2:
        raise Skip("not an RMSNorm", f"{upcast.name} is not squared: {[u.format_node() for u in upcast.users]}")
    square = pows[0]
    mean = _one_user(square, "square")
    if not m.is_call(mean, _MEAN) or mean.args[0] is not square:
        raise Skip("not an RMSNorm", f"the square is read by {mean.format_node()}")
    dims, keepdim = _arg(mean, 1, "dim"), _arg(mean, 2, "keepdim", False)
    ndim = m.val(add).dim()
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or dims[0] not in (-1, ndim - 1):
        raise Skip("mean over a dim other than the last", f"{mean.name}: dim={dims}, {ndim}-D")
    if not keepdim:
        raise Skip("mean without keepdim", mean.name)
    if mean.kwargs.get("dtype") is not None:
        raise Skip("not an RMSNorm", f"{mean.name} has dtype={mean.kwargs['dtype']}")
    add_eps = _one_user(mean, "mean")
    if not m.is_call(add_eps, _ADD_EPS) or len(add_eps.args) != 2 or add_eps.args[0] is not mean \
            or add_eps.kwargs.get("alpha", 1) != 1:
        raise Skip("not an RMSNorm", f"the mean is read by {add_eps.format_node()}")
    eps = add_eps.args[1]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise Skip("eps is not a constant", add_eps.format_node())
    rsqrt = _one_user(add_eps, "eps add")
    if not m.is_call(rsqrt, _RSQRT) or rsqrt.args[0] is not add_eps:
        raise Skip("not an RMSNorm", f"mean + eps is read by {rsqrt.format_node()}")
    normalized = _one_user(rsqrt, "rsqrt")
    if not m.is_call(normalized, _MUL) or _other_operand(normalized, rsqrt) is not upcast:
        raise Skip("not an RMSNorm", f"the rsqrt is read by {normalized.format_node()}")
    return upcast, [square, mean, add_eps, rsqrt, normalized], float(eps)


def _match_tail(normalized: Node, dtype: torch.dtype) -> Tuple[List[Node], Node, bool]:
    """The cast back to ``dtype`` and the weight's mul after ``normalized``, in graph order, the weight, and whether
    the weight multiplies after the cast.  Raises :class:`Skip`."""
    first = _one_user(normalized, "normalized")
    if m.is_call(first, m.CONVERT) and first.args[0] is normalized:  # Llama: cast, then the weight
        if _arg(first, 1, "dtype") != dtype:
            raise Skip("norm output dtype differs from the residual sum", f"{first.name} casts to {first.args[1]}")
        scaled = _one_user(first, "cast")
        if not m.is_call(scaled, _MUL):
            raise Skip("not an RMSNorm", f"the normalized value is read by {scaled.format_node()} (no weight)")
        weight = _other_operand(scaled, first)
        tail, after_cast = [first, scaled], True
    elif m.is_call(first, _MUL):  # F.rms_norm: the weight, then the cast
        weight = _other_operand(first, normalized)
        cast = _one_user(first, "weighted")
        if not (m.is_call(cast, m.CONVERT) and cast.args[0] is first):
            raise Skip("not an RMSNorm", f"the weighted norm is read by {cast.format_node()}")
        tail, after_cast = [first, cast], False
    else:
        raise Skip("not an RMSNorm", f"the normalized value is read by {first.format_node()}")
    if not isinstance(weight, Node):
        raise Skip("norm weight is not a [N] vector in the residual's dtype", f"{tail[-1].format_node()}")
    out = m.val(tail[-1])
    if out is None or out.dtype != dtype:
        raise Skip("norm output dtype differs from the residual sum",
                   f"{tail[-1].name}: {getattr(out, 'dtype', None)}, residual sum {dtype}")
    return tail, weight, after_cast


def _match(reduced: Node) -> _Match:
    """Raises :class:`Skip` where ``reduced``'s readers are not the pattern of the module docstring."""
    a = m.val(reduced.args[0])
    if a is None:
        raise Skip("no tensor metadata", f"matmul operand of {reduced.name}")
    views, add, residual = _match_add(reduced)
    h = m.val(add)
    if h.dtype not in _DTYPES:
        raise Skip("unsupported dtype", f"{add.name} is {h.dtype}")
    if h.dtype != a.dtype:
        raise Skip("residual sum dtype differs from the matmul operand", f"{h.dtype} vs {a.dtype}")
    upcast, norm, eps = _match_norm(add)
    tail, weight, after_cast = _match_tail(norm[-1], h.dtype)
    match = _Match(reduced, views, add, residual, upcast, norm, tail, weight, eps, after_cast)
    g = m.val(weight)
    if g is None or g.dim() != 1 or not m.known_equal(g.shape[0], h.shape[-1]) or g.dtype != h.dtype \
            or weight in match.nodes():
        raise Skip("norm weight is not a [N] vector in the residual's dtype",
                   f"{weight.name}: {getattr(g, 'dtype', None)}{list(getattr(g, 'shape', []))}, N={h.shape[-1]}, "
                   f"{h.dtype}")
    return match


def _known_contiguous(v: torch.Tensor) -> bool:
    """``v`` is row-major contiguous for every value of its symbols (no guard added)."""
    expected = 1
    for size, stride in reversed(list(zip(v.shape, v.stride()))):
        if not m.known_equal(size, 1) and not m.known_equal(stride, expected):
            return False
        expected = expected * size
    return True


def _weight_to_move(graph: Graph, match: _Match) -> List[Node]:
    """The nodes computing the norm weight that sit after the add (they move before it, with the op).  Raises
    :class:`Skip` where they cannot move."""
    pos = m.positions(graph)
    if pos[match.weight] < pos[match.add]:
        return []
    moved = m.ancestors_after(match.weight, pos[match.add], pos)
    replaced = set(match.nodes())
    if any(n in replaced for n in moved):
        raise Skip("norm weight depends on the residual sum", match.weight.name)
    impure = [n.name for n in moved if not m.is_pure(n)]
    if impure:
        raise Skip("norm weight computed by an impure op after the residual add", ", ".join(impure))
    return moved


def _rewrite(graph: Graph, match: _Match, fake_mode) -> str:
    """Replace ``match`` with the fused op; returns a description.  Raises :class:`Skip` with the graph untouched."""
    _, fused_op = _ops()
    reduced, add = match.reduced, match.add
    a, weight, bias = reduced.args[:3]
    reduce_op, group_name = _arg(reduced, 3, "reduce_op"), _arg(reduced, 4, "group_name")
    n_shape, h_shape = m.shape_of(reduced, "matmul_all_reduce"), m.shape_of(add, "residual sum")
    reshape_residual = not m.same_shape(m.val(match.residual).shape, n_shape)
    # The op's kernel reads a contiguous residual (it copies a strided one on every call); in the graph inductor can
    # fold that copy into the residual's producer.
    copy_residual = not _known_contiguous(m.val(match.residual))
    reshape_results = not m.same_shape(n_shape, h_shape)
    residual_arg = m.reshape_arg(n_shape) if reshape_residual else None
    if reshape_residual and residual_arg is None:
        raise Skip("symbolic shape", f"residual reshape to {n_shape} with more than one symbolic size")
    results_arg = None
    if reshape_results:
        results_arg = m.reshape_arg(h_shape)
        if results_arg is None and match.views:
            results_arg = m.view_size_args(match.views[-1], match.nodes())
        if results_arg is None:
            raise Skip("symbolic shape", f"result reshape to {h_shape} with more than one symbolic size")
    # The op reads a, weight and bias at the add instead of at the matmul_all_reduce, and the norm weight there too.
    mutator = m.mutation_between(reduced, match.out)
    if mutator is not None:
        raise Skip("possible mutation between the matmul_all_reduce and the norm", mutator.name)
    moved = _weight_to_move(graph, match)
    try:
        with fake_mode:
            residual = m.val(match.residual)
            if copy_residual:
                residual = residual.clone(memory_format=torch.contiguous_format)
            if reshape_residual:
                residual = residual.reshape(n_shape)
            result = fused_op(m.val(a), m.val(weight), m.val(bias), reduce_op, group_name, residual,
                              m.val(match.weight), match.eps, match.weight_after_cast)
    except Exception as e:  # noqa: BLE001 - any failure here means "do not rewrite"
        raise Skip("fused op rejected the shapes", f"{type(e).__name__}: {e}")
    if not all(m.same_shape(r.shape, n_shape) and r.dtype == m.val(add).dtype for r in result):
        raise Skip("fused op output shape mismatch", f"{[tuple(r.shape) for r in result]} vs {tuple(n_shape)}")

    if moved:
        m.hoist_before(add, moved, m.positions(graph))
    with graph.inserting_before(add):
        residual_node = match.residual
        if copy_residual:
            residual_node = m.call_contiguous(graph, fake_mode, residual_node)
        if reshape_residual:
            residual_node = m.call_view(graph, fake_mode, _RESHAPE, residual_node, residual_arg)
        fused = graph.call_function(fused_op, (a, weight, bias, reduce_op, group_name, residual_node, match.weight,
                                               match.eps, match.weight_after_cast))
        fused.meta["val"] = result
        m.copy_debug_meta(fused, reduced)
        outputs = []
        for index, replaced in ((0, add), (1, match.out)):
            out = graph.call_function(operator.getitem, (fused, index))
            out.meta["val"] = result[index]
            if reshape_results:
                out = m.call_view(graph, fake_mode, _RESHAPE, out, list(results_arg))
            m.copy_debug_meta(out, replaced)
            outputs.append(out)
    add.replace_all_uses_with(outputs[0])
    match.out.replace_all_uses_with(outputs[1])
    m.erase_dead(graph, match.nodes())
    pos = m.positions(graph)
    leftover = [n.name for n in match.nodes() if n in pos]
    if leftover:  # every replaced node must be unread now; anything else is a bug in the matcher
        raise RuntimeError(f"fluxinductor {PATTERN} left nodes with readers: {leftover}")
    return (f"{reduced.name}: {'weight after the cast (Llama)' if match.weight_after_cast else 'weight before the cast'}"
            f", eps={match.eps}, {m.val(a).dtype}, rows {list(n_shape[:-1])}, N={n_shape[-1]}, "
            f"reduce_op={reduce_op}, bias={bias is not None}, group={group_name}"
            f"{f', {len(moved)} weight node(s) moved up' if moved else ''}")


def fuse_all_reduce_rms_norm(graph: Graph) -> int:
    """Rewrite every ``matmul_all_reduce -> residual add -> RMSNorm`` of ``graph`` (see the module docstring) in
    place; returns how many."""
    matmul_all_reduce, _ = _ops()
    reduces = [n for n in graph.nodes if m.is_call(n, matmul_all_reduce)]
    if not reduces:
        return 0
    fake_mode = m.fake_mode_of(graph)
    rewrites = 0
    for reduced in m.each_collective(reduces):
        if not _starts_like_the_pattern(reduced):
            continue
        try:
            if fake_mode is None:
                raise Skip("no fake mode in graph metadata", reduced.name)
            detail = _rewrite(graph, _match(reduced), fake_mode)
        except Skip as s:
            record_skip(PATTERN, s.reason, s.detail or reduced.name)
            continue
        record_fused(PATTERN, detail)
        rewrites += 1
    return rewrites
