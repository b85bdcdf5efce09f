"""Rewrite ``all_gather -> matmul`` into ``fluxinductor.all_gather_matmul``.

Fuses the pattern ``A = all_gather(shard, gather_dim); C_i = A @ W_i (+ b_i)`` into
``all_gather_matmul(shard, [W_i], [b_i], gather_dim, group, return_gathered)``.

Before (gather_dim = 1, as funcol/DTensor write it for activations [B, S, H] sharded on S, B > 1)::

    ag    = _c10d_functional.all_gather_into_tensor(shard, world, group)   # shard: [B, S/w, H]
    w     = _c10d_functional.wait_tensor(ag)                               # [w*B, S/w, H]
    parts = split(w, B)            ; p_i = getitem(parts, i)               # world chunks on dim 0
    A     = cat([p_0, ..., p_w-1], 1)                                      # [B, S, H]
    A2    = reshape(A, [B*S, H])
    q     = addmm(b_q, A2, W_q)    ; k = mm(A2, W_k)                        # [B*S, N_i]
    use(A2)                                                                # e.g. saved for backward

After, where the shard's blocks are not whole tiles (the op runs on the shard rows-first, [S/w * B, H], and gathers
on dim 0; the permutes are left to inductor, which folds them into the kernels that produce the shard and read the
results)::

    s2    = reshape(clone(permute(shard, [1, 0, 2]), contiguous), [-1, H])  # [S/w * B, H]
    f     = fluxinductor.all_gather_matmul(s2, [W_q, W_k], [b_q, None], 0, group, True)
    outs  = getitem(f, 0)                                                  # [S * B, N_i]
    q     = reshape(permute(reshape(getitem(outs, 0), [S, B, N_q]), [1, 0, 2]), [B*S, N_q]) ; k = ...
    A     = clone(permute(reshape(getitem(f, 1), [S, B, H]), [1, 0, 2]), contiguous)   # [B, S, H]
    A2    = reshape(A, [B*S, H]) ; use(A2)

With B = 1 (or gather_dim 0) no permute is needed and the op gets the shard as it is, with the graph's gather_dim.
Neither is it where each shard's block of rows (S/w, times any dims between S and H) is whole 128-row tiles of the
kernel (``_match.batch_major``): the kernel then gathers each [B, S/w, H] shard straight into the batch-major
[B, S, H] and computes on it in place, so the op gets the shard as it is there too and its results are the graph's.

``return_gathered`` is True only when something other than the fused matmuls still reads the gathered
tensor; otherwise the second result is an empty tensor and is not used.  The gather forms recognized:

* gather_dim 0: ``wait_tensor(all_gather)`` is the gathered tensor itself.  This also covers funcol's
  view form for B = 1 (``reshape(wait, [1, S, H])``): a reshape keeps row-major order, so it is a
  reshape chain on the dim-0 gather and is passed with gather_dim 0.
* gather_dim d > 0: ``cat([world ordered chunks of wait on dim 0], d)`` (chunks as split/getitem,
  split_with_sizes/getitem or slice).
* either of them read only through ``prims.convert_element_type(·, dtype)`` (autocast), possibly
  after reshapes: the op gets ``convert_element_type(shard, dtype)``, which gathers to the same tensor.

A matmul is fused when its first operand is the gathered tensor or a reshape chain of it ending in
``[M, K]`` with ``K`` the gathered tensor's last dim (so ``M`` rows in gathered order), and it is an
``mm`` or an ``addmm`` with alpha = beta = 1 and a ``[N]`` bias.  The new nodes go before the first
reader of the gathered tensor; weight/bias computations that sat later are moved up with it.
Sizes other than K and N may be symbolic (dynamic shapes); they are compared without adding guards, and the
reshapes the rewrite writes take -1 (or the graph's own size nodes) where a size is symbolic.
Everything else is left alone and recorded with :func:`fluxinductor.log.record_skip`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set

import torch
from torch.fx import Graph, Node

from fluxinductor.log import record_fused, record_skip
from fluxinductor.passes import _match as m
from fluxinductor.passes._match import Skip

PATTERN = "all_gather_matmul"
# Why a weight-gradient mm(gathered^T, grad) stays as it is (it still reads the fused op's gathered tensor).
WEIGHT_GRADIENT_SKIP = ("weight-gradient mm: the gathered tensor is its contraction dim (this matmul only; the "
                        "all-gather may fuse with another)")


@dataclass
class _AllGatherMatch:
    """One all-gather, normalized: ``gathered = all_gather(shard, gather_dim)``."""

    all_gather: Node
    shard: Node
    gather_dim: int
    group_size: int
    group_name: str
    gathered: Node  # wait_tensor (gather_dim 0) or the cat (gather_dim > 0), or its dtype cast
    gather_nodes: List[Node]  # all_gather, wait, chunk nodes, cat: erased once dead
    shape: tuple  # gathered shape
    cast_dtype: Optional[torch.dtype] = None  # the gathered tensor is only read through this cast

    @property
    def rows_by_k(self) -> tuple:
        # The gathered tensor flattened to the 2-D operand an mm reads: [M, K].
        return (m.numel(self.shape[:-1]), self.shape[-1])


@dataclass
class _Matmul:
    """``node = a @ weight (+ bias)`` where ``a`` is the gathered tensor flattened to [M, K]."""

    node: Node
    a: Node
    weight: Node
    bias: Optional[Node]
    n: int
    hoist: List[Node] = field(default_factory=list)  # weight/bias ancestors to move above the op


def _match_all_gather(ag: Node, group_allowed: Callable[[str], bool]) -> _AllGatherMatch:
    if len(ag.args) < 3:
        raise Skip("unexpected all_gather signature", str(ag.args))
    shard, group_size, group_name = ag.args[0], ag.args[1], ag.args[2]
    if not group_allowed(group_name):
        raise Skip("group not allowed", f"group {group_name!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise Skip("symbolic group size", str(group_size))
    wait = m.only_user(ag)
    if not m.is_call(wait, m.WAIT):
        raise Skip("all_gather not followed by a single wait_tensor", ag.name)
    shard_shape = m.shape_of(shard, "shard")
    m.check_float(shard, "shard")
    if len(shard_shape) < 2:
        raise Skip("1-D shard", str(shard_shape))

    gathered, gather_dim, extra = wait, 0, []
    users = list(wait.users)
    parts: Optional[List[Node]] = None
    if len(users) == 1 and m.is_call(users[0], m.SPLIT_OPS):
        parts = list(users[0].users)
    elif users and all(m.is_call(u, m.SLICE) for u in users):
        parts = users
    elif any(m.is_call(u, m.SPLIT_OPS) or m.is_call(u, m.SLICE) for u in users):
        raise Skip("all_gather result split and also read whole", wait.name)
    if parts is not None:
        # The split/cat form of gather_dim > 0: every chunk feeds one cat and nothing else.
        cats = {u for p in parts for u in p.users}
        cat = next(iter(cats)) if len(cats) == 1 else None
        if not m.is_call(cat, m.CAT) or any(len(p.users) != 1 for p in parts):
            raise Skip("all_gather chunks not consumed by exactly one cat", wait.name)
        chunks = m.ordered_chunks(cat.args[0], group_size)
        if chunks is None or chunks[0] is not wait or chunks[1] != 0 or set(parts) - set(chunks[2]):
            raise Skip("all_gather chunks not in rank order", cat.name)
        gathered, gather_dim, extra = cat, m.cat_dim(cat), chunks[2] + [cat]

    shape = m.shape_of(gathered, "gathered")
    expected = list(shard_shape)
    expected[gather_dim] *= group_size
    if not m.same_shape(expected, shape):
        raise Skip("gathered shape does not match shard", f"{shard_shape} x{group_size} on {gather_dim} -> {shape}")
    if gather_dim == len(shape) - 1:
        raise Skip("gather_dim is the contraction dim", f"gather_dim {gather_dim} of {shape}")
    if not isinstance(shape[-1], int):
        raise Skip("symbolic shape", f"contraction dim of gathered {gathered.name}: {shape}")
    gather_nodes = [ag, wait] + extra
    cast_dtype = None
    # Autocast casts after the gather (possibly after funcol's reshape).  A cast is elementwise, so it
    # commutes with the gather and the reshapes: gathering the cast shard gives the same tensor (and
    # moves fewer bytes when it narrows).
    chain = [gathered]
    while len(chain[-1].users) == 1 and m.is_call(m.only_user(chain[-1]), m.VIEW_OPS):
        chain.append(m.only_user(chain[-1]))
    cast = m.only_user(chain[-1])
    if m.is_call(cast, m.CONVERT) and cast.args[0] is chain[-1] and isinstance(cast.args[1], torch.dtype) \
            and cast.args[1].is_floating_point:
        gather_nodes += chain
        gathered, cast_dtype = cast, cast.args[1]
    return _AllGatherMatch(ag, shard, gather_dim, group_size, group_name, gathered, gather_nodes, shape, cast_dtype)


def _view_closure(match: _AllGatherMatch) -> List[Node]:
    """The gathered node and every reshape chain hanging off it (breadth first)."""
    closure, i = [match.gathered], 0
    while i < len(closure):
        for u in closure[i].users:
            if m.is_call(u, m.VIEW_OPS) and u.args[0] is closure[i] and u not in closure:
                closure.append(u)
        i += 1
    return closure


def _consumers(match: _AllGatherMatch, closure: List[Node]) -> List[_Matmul]:
    """Matmuls that read the gathered tensor as their [M, K] first operand; records a skip for every
    other matmul that reads it."""
    in_closure = set(closure)
    forbidden = in_closure | set(match.gather_nodes)
    pos = m.positions(match.gathered.graph)
    dtype = m.val(match.gathered).dtype
    found: List[_Matmul] = []
    seen: Set[Node] = set()
    for c in closure:
        for u in c.users:
            if u in in_closure or u in seen:
                continue
            seen.add(u)
            operands = m.matmul_operands(u)
            if operands is None:
                # mm(permute(gathered), grad): the weight gradient, gathered rows on the contraction dim.
                if m.is_call(u, m.TRANSPOSES):
                    for mm in u.users:
                        ops = m.matmul_operands(mm)
                        if ops is not None and ops[0] is u:
                            record_skip(PATTERN, WEIGHT_GRADIENT_SKIP,
                                        f"{mm.name} = mm({u.name}, ...)")
                elif m.is_call(u, (m.MM, m.ADDMM, m.aten.bmm.default, m.aten.baddbmm.default)):
                    record_skip(PATTERN, "unsupported matmul form", u.name)
                continue
            a, weight, bias = operands
            try:
                if a is not c:
                    raise Skip("gathered tensor is the second matmul operand", u.name)
                if bias is c:
                    raise Skip("gathered tensor is the addmm bias", u.name)
                a_shape = m.shape_of(a, "matmul operand")
                if not m.same_shape(a_shape, match.rows_by_k):
                    raise Skip("matmul operand is not the gathered tensor flattened to [M, K]",
                               f"{u.name}: {a_shape} vs gathered {match.shape}")
                n = m.check_weight_and_bias(weight, bias, match.shape[-1], dtype, u.name)
                anchor_pos = min(pos[x] for x in match.gathered.users)
                hoist: List[Node] = []
                for dep in (weight, bias):
                    if dep is None:
                        continue
                    # Everything dep is computed from since the all_gather: none may read the gathered
                    # tensor; what sits after the op's place moves up with it.
                    up = m.ancestors_after(dep, pos[match.all_gather], pos)
                    if any(x in forbidden or match.gathered in x.all_input_nodes for x in up):
                        raise Skip("weight depends on the gathered tensor", u.name)
                    up = [x for x in up if pos[x] >= anchor_pos]
                    if any(x.op != "call_function" or not m.is_pure(x) for x in up):
                        raise Skip("weight computed by an impure op after the all_gather", u.name)
                    hoist += up
                found.append(_Matmul(u, a, weight, bias, n, hoist))
            except Skip as s:
                record_skip(PATTERN, s.reason, s.detail)
    return found


def _still_read(match: _AllGatherMatch, closure: List[Node], fused: Set[Node]) -> bool:
    """Whether the gathered tensor is read by anything but the fused matmuls (through reshapes)."""
    in_closure = set(closure)
    live: Dict[Node, bool] = {}
    for c in reversed(closure):  # reshapes come after what they reshape
        live[c] = any(u not in fused and (u not in in_closure or live.get(u, True)) for u in c.users)
    return live[match.gathered]


def _rewrite(graph: Graph, match: _AllGatherMatch, closure: List[Node], matmuls: List[_Matmul], fake_mode) -> None:
    from fluxinductor import ops  # noqa: F401  (registers torch.ops.fluxinductor)

    op = torch.ops.fluxinductor.all_gather_matmul.default
    return_gathered = _still_read(match, closure, {mm.node for mm in matmuls})
    weights = [mm.weight for mm in matmuls]
    biases = [mm.bias for mm in matmuls]

    # gather_dim > 0 with a leading dim > 1 ([B, S/w, H] with B > 1): the op gets the shard as it is where its kernel
    # keeps the batch-major layout (m.batch_major); otherwise it gathers the rows-first shard on dim 0 and the permutes
    # around it are left to inductor (see m.rows_first).
    plan = m.rows_first(match.shape, match.gather_dim)
    batch_major = plan is not None and m.batch_major(match.shape, match.gather_dim)
    if batch_major:
        plan = None
    k = match.shape[-1]
    # Evaluate the op's fake impl first: a failure leaves the graph untouched.
    try:
        with fake_mode:
            shard_val = m.val(match.shard)
            if match.cast_dtype is not None:
                shard_val = m.CONVERT(shard_val, match.cast_dtype)
            if plan is not None:
                lead = [-1] + [shard_val.shape[d] for d in plan[2]]  # [world * S, rest...] of the results
                shard_val = shard_val.permute(plan[0]).reshape(-1, k)
            result = op(shard_val, [m.val(w) for w in weights],
                        [None if b is None else m.val(b) for b in biases],
                        0 if plan is not None else match.gather_dim, match.group_name, return_gathered)
            if plan is not None:
                # The results as the graph reads them: [..., world * S, ..., N_i] (views of the rows-first results).
                result_2d = result
                result = ([o.reshape(lead + [mm.n]).permute(plan[1]) for o, mm in zip(result_2d[0], matmuls)],
                          result_2d[1].reshape(lead + [k]).permute(plan[1]) if return_gathered else result_2d[1])
    except Exception as e:  # noqa: BLE001 - any failure here means "do not rewrite"
        raise Skip("fused op rejected the shapes", f"{type(e).__name__}: {e}")
    for mm, out in zip(matmuls, result[0]):
        if not m.same_shape(out.shape, match.shape[:-1] + (mm.n,)):
            raise Skip("fused op output shape mismatch", f"{tuple(out.shape)} for {mm.node.name}")
    old_shape = tuple(m.val(match.gathered).shape)
    # Reshapes of the op's results take plain ints (a symbolic size becomes -1): at most one may be symbolic.
    gathered_arg = m.reshape_arg(old_shape)
    if gathered_arg is None and match.cast_dtype is not None:
        # Two symbolic sizes: reuse the sizes of the graph's own reshape before the cast.
        gathered_arg = m.view_size_args(match.gathered.args[0], match.gather_nodes)
    if return_gathered and gathered_arg is None and not m.same_shape(result[1].shape, old_shape):
        raise Skip("symbolic shape", f"gathered {match.gathered.name} {old_shape} has more than one symbolic size")

    pos = m.positions(graph)
    anchor = min(match.gathered.users, key=pos.__getitem__)
    # The op reads the shard at the anchor instead of at the all_gather, the matmuls read the op's result
    # instead of the gathered tensor, and weight computations move up to the anchor: no mutation may sit
    # anywhere in that span.
    last = max([mm.node for mm in matmuls] + [x for mm in matmuls for x in mm.hoist], key=pos.__getitem__)
    mutator = m.mutation_between(match.all_gather, last)
    if mutator is not None:
        raise Skip("possible mutation between the all_gather and its matmuls", mutator.name)
    m.hoist_before(anchor, [x for mm in matmuls for x in mm.hoist], pos)
    with graph.inserting_before(anchor):
        shard = match.shard
        if match.cast_dtype is not None:
            shard = graph.call_function(m.CONVERT, (match.shard, match.cast_dtype))
            m.set_val(shard, fake_mode, lambda: m.CONVERT(m.val(match.shard), match.cast_dtype))
        if batch_major and not m.val(shard).is_contiguous():
            # The kernel reads the shard in place as [B * S/w, H]: its producer (a norm reading the rows-first
            # reduce-scatter's result, say) writes it batch-major instead of in its input's order.
            shard = m.call_contiguous(graph, fake_mode, shard)
        if plan is not None:
            lead = [-1] + [m.size_arg(graph, match.shard, d) for d in plan[2]]
            shard = m.call_view(graph, fake_mode, m.aten.permute.default, shard, plan[0])
            shard = m.call_contiguous(graph, fake_mode, shard)
            shard = m.call_view(graph, fake_mode, m.aten.reshape.default, shard, [-1, k])
        args = (shard, weights, biases, 0 if plan is not None else match.gather_dim, match.group_name,
                return_gathered)
        fused = graph.call_function(op, args)
        fused.meta["val"] = result if plan is None else result_2d
        m.copy_debug_meta(fused, matmuls[0].node)
        outs = graph.call_function(operator.getitem, (fused, 0))
        outs.meta["val"] = fused.meta["val"][0]
        for i, mm in enumerate(matmuls):
            out = graph.call_function(operator.getitem, (outs, i))
            out.meta["val"] = outs.meta["val"][i]
            if plan is not None:
                out = m.call_view(graph, fake_mode, m.aten.reshape.default, out, lead + [mm.n])
                out = m.call_view(graph, fake_mode, m.aten.permute.default, out, plan[1])
            if not m.same_shape(result[0][i].shape, m.val(mm.node).shape):
                # [..., N] -> the [M, N] the mm produced (row-major, same elements).
                reshaped = graph.call_function(m.aten.reshape.default, (out, [-1, mm.n]))
                m.set_val(reshaped, fake_mode, lambda o=result[0][i], n=mm.n: o.reshape(-1, n))
                out = reshaped
            mm.node.replace_all_uses_with(out)
        if return_gathered:
            gathered = graph.call_function(operator.getitem, (fused, 1))
            gathered.meta["val"] = fused.meta["val"][1]
            if plan is not None:
                gathered = m.call_view(graph, fake_mode, m.aten.reshape.default, gathered, lead + [k])
                gathered = m.call_view(graph, fake_mode, m.aten.permute.default, gathered, plan[1])
                gathered = m.call_contiguous(graph, fake_mode, gathered)
            if not m.same_shape(result[1].shape, old_shape):
                # A cast found after a reshape of the gathered tensor: reshape the op's result the same way.
                reshaped = graph.call_function(m.aten.reshape.default, (gathered, gathered_arg))
                m.set_val(reshaped, fake_mode, lambda: result[1].reshape(old_shape))
                gathered = reshaped
            match.gathered.replace_all_uses_with(gathered)
    m.erase_dead(graph, [mm.node for mm in matmuls] + closure + match.gather_nodes)
    record_fused(PATTERN, f"{len(matmuls)} matmul(s), gather_dim={match.gather_dim}"
                          f"{', rows-first' if plan else ', batch-major' if batch_major else ''}, "
                          f"return_gathered={return_gathered}, group={match.group_name}")


def fuse_all_gather_matmul(graph: Graph, group_allowed: Callable[[str], bool],
                           not_worth_fusing: Optional[Callable[..., Optional[str]]] = None) -> None:
    """Rewrite every ``all_gather -> matmul(s)`` in ``graph`` (in place) into one
    ``fluxinductor.all_gather_matmul`` per all-gather; record a skip for each one left alone.
    ``not_worth_fusing(op, device, world, m, k, n, dtype)`` (global GEMM shape; m None where it is symbolic) may veto
    a match."""
    all_gathers = [n for n in graph.nodes if m.is_call(n, m.ALL_GATHER)]
    if not all_gathers:
        return
    fake_mode = m.fake_mode_of(graph)
    for ag in m.each_collective(all_gathers):
        try:
            if fake_mode is None:
                raise Skip("no fake mode in graph metadata", ag.name)
            match = _match_all_gather(ag, group_allowed)
            closure = _view_closure(match)
            matmuls = _consumers(match, closure)
            if not matmuls:
                readers = sorted({str(u.target) for c in closure for u in c.users if u not in closure})
                raise Skip("no matmul reads the gathered tensor", ", ".join(readers))
            rows, k = match.rows_by_k
            if not_worth_fusing is not None:
                shard = m.val(match.shard)
                n = match.group_size * sum(mm.n for mm in matmuls)
                # A symbolic M (the graph serves every M) is asked as None: "at any M".
                why = not_worth_fusing(PATTERN, shard.device, match.group_size, rows if isinstance(rows, int) else None,
                                       k, n, shard.dtype)
                if why is not None:
                    raise Skip("not worth fusing here", why)
            _rewrite(graph, match, closure, matmuls, fake_mode)
        except Skip as s:
            record_skip(PATTERN, s.reason, s.detail or ag.name)
