"""Rewrite ``matmul -> reduce_scatter`` into ``fluxinductor.matmul_reduce_scatter``.

Fuses the pattern ``C = reduce_scatter(A @ W (+ b), reduce_op, scatter_dim)`` into
``matmul_reduce_scatter(A, W, b, reduce_op, scatter_dim, group)``.

Before (scatter_dim = 1, as funcol/DTensor write it for activations [B, S, N] scattered on S)::

    y     = addmm(b, a2, W)                        # a2: [B*S, K] (often reshape(a, [B*S, K])), y: [B*S, N]
    y3    = reshape(y, [B, S, N])
    parts = split(y3, S/w, 1) ; p_i = getitem(parts, i)
    z     = cat([p_0, ..., p_w-1])                 # [w*B, S/w, N]: the chunks stacked on dim 0
    rs    = _c10d_functional.reduce_scatter_tensor(z, "sum", world, group)
    out   = _c10d_functional.wait_tensor(rs)       # [B, S/w, N]; any number of users

After (the op runs on the operand rows-first, [S * B, K], and scatters dim 0; inductor folds the permutes into the
kernels that produce ``a`` and read ``out``)::

    a3    = reshape(a2, [B, S, K])                 # or a itself when a2 = reshape(a, [B, S, K])
    a_r   = reshape(clone(permute(a3, [1, 0, 2]), contiguous), [-1, K])
    out   = clone(permute(reshape(fluxinductor.matmul_reduce_scatter(a_r, W, b, "sum", 0, group), [S/w, B, N]),
                          [1, 0, 2]), contiguous)  # [B, S/w, N]

With B = 1 no permute is needed: the op gets ``a3`` and scatter_dim 1.

A sum of matmuls (the input gradient of separate Q/K/V or gate/up linears; inductor has already folded
``mm + mm`` into ``addmm(mm, a, w)``)::

    y   = add(reshape(addmm(mm(a_q, W_q), a_k, W_k), [B, S, N]), reshape(mm(a_v, W_v), [B, S, N]))
    out = wait_tensor(reduce_scatter_tensor(<y, split/cat as above>, "sum", world, group))

becomes one op that gets the terms as they are, the split transport's K slabs (:func:`_slabs` says when; each
operand rows-first as above, or batch-major as it is)::

    out = fluxinductor.matmul_reduce_scatter(reshape(a_q, [B, S, K_q]), W_q, None, "sum", 1, group,
                                             more_a=[reshape(a_k, [B, S, K_k]), reshape(a_v, [B, S, K_v])],
                                             more_weights=[W_k, W_v])

or, where the slabs do not fit, one matmul over the concatenated K (``cat([a_q, a_k, a_v], 1)`` with
``cat([W_q, W_k, W_v], 0)``), or one op per term, results added, where the cost model finds that cheaper.

Under bf16 (or fp16) autocast the backward reduces a bf16 (fp16) matmul in fp32 (the input it differentiates was
fp32)::

    out = wait_tensor(reduce_scatter_tensor(convert_element_type(mm(a, W), float32), "sum", world, group))

becomes ``fluxinductor.matmul_reduce_scatter(a, W, None, "sum", 0, group, out_dtype=float32)``: the partials stay
in the matmul's dtype, as the graph rounds them, and are summed into an fp32 result.  A sum whose terms are each cast
(``convert(mm(a_q, W_q)) + convert(mm(a_k, W_k)) + ...``, the gradient of an fp32 input that autocast cast once per
projection) is fused as one matmul over the concatenated K like any sum, so each rank's partial is rounded once where
the graph rounded each term (closer to the exact sum).  Other casts are left alone.

With scatter_dim 0 the reduce_scatter reads the matmul output directly (2-D), or through a reshape
chain to [..., N] (e.g. [S, B, N] for sequence-first activations); the op then gets ``a`` reshaped to
[..., K] and scatter_dim 0.  The bias is added on every rank before the reduction, exactly as
``addmm -> reduce_scatter`` does.  The matmul output (and the reshape/split/cat between) must have no
other reader, else the matmul would have to run twice; such matches, ``reduce_op`` other than
sum/avg, non-floating dtypes, sizes that do not split over the group, a symbolic N or K and disallowed
groups are left alone and recorded with :func:`fluxinductor.log.record_skip`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch.fx import Graph, Node

from fluxinductor.log import record_fused, record_skip
from fluxinductor.passes import _match as m
from fluxinductor.passes._match import Skip

PATTERN = "matmul_reduce_scatter"


@dataclass
class _Term:
    """One ``a @ weight`` of the reduced sum; a: [M, K_i], weight: [K_i, N]."""

    a: Node
    weight: Node


@dataclass
class _ReduceScatterMatch:
    """One reduce-scatter (or all-reduce) of a matmul (or of a sum of matmuls), normalized:
    ``out = reduce_scatter(reshape(sum_i a_i @ w_i + bias, partial_shape), reduce_op, scatter_dim)``."""

    wait: Node
    terms: List[_Term]
    bias: Optional[Node]  # [N]
    reduce_op: str
    scatter_dim: Optional[int]  # None: an all_reduce (nothing scattered)
    group_name: str
    partial_shape: tuple  # the N-D tensor being reduced, [..., N]; scatter_dim indexes it
    between: List[Node]  # matmuls, adds, reshapes, chunk nodes, cat, reduce_scatter, wait: erased once dead
    first: Node  # the earliest node of the sum: the operands are read there in the original graph
    lead_args: Optional[list]  # size args of [...] (partial_shape[:-1]) from a reshape in the chain, or None
    out_dtype: Optional[torch.dtype] = None  # the reduction's dtype where the chain upcasts the matmul (autocast)


def _collect_terms(node: Node, rows: m.Size, n: int, terms: List[_Term], biases: List[Node], chain: List[Node],
                   casts: List[Node]) -> None:
    """Split ``node`` (a tensor of ``rows * n`` elements, last dim ``n``) into matmul terms and [N] biases.

    Accepts reshapes (row-major, so any chain keeping the last dim ``n`` maps element (m, j) of every
    term to the same place), ``add`` of two same-shape tensors, ``mm`` and ``addmm`` (its addend either a
    [N] bias or another such tensor).  Every node must be read only by the one before it.
    """
    shape = m.shape_of(node, "reduce_scatter operand")
    if not (m.known_equal(shape[-1], n) and m.known_equal(m.numel(shape[:-1]), rows)):
        raise Skip("reshape between matmul and reduce_scatter mixes the N dim", f"{node.name}: {shape}")
    chain.append(node)
    children: List[Node] = []
    if m.is_call(node, m.VIEW_OPS):
        children = [node.args[0]]
    elif m.is_call(node, m.aten.add.Tensor) and len(node.args) == 2 and not node.kwargs:
        x, y = node.args
        if not (isinstance(x, Node) and isinstance(y, Node)):
            raise Skip("reduce_scatter input is not a matmul", f"{node.name} adds a scalar")
        if not (m.same_shape(m.shape_of(x, "addend"), shape) and m.same_shape(m.shape_of(y, "addend"), shape)):
            raise Skip("reduce_scatter input is not a matmul", f"{node.name} broadcasts")
        children = [x, y]
    elif m.is_call(node, m.CONVERT):
        # Autocast: a bf16 or fp16 matmul reduced in fp32.  The op takes that as out_dtype (the kernel sends the
        # half-precision partials and sums them in fp32, as the graph does); other casts would change what the graph
        # computes.  A sum may cast each term (autocast casts an fp32 input once per matmul, so the input's gradient
        # is the fp32 sum of the upcast terms); all casts must then start from the same dtype.
        source = node.args[0]
        source_dtype = m.val(source).dtype if isinstance(source, Node) and m.val(source) is not None else None
        if (source_dtype not in (torch.bfloat16, torch.float16) or node.args[1] != torch.float32
                or any(m.val(c.args[0]).dtype != source_dtype for c in casts)):
            raise Skip("dtype cast between matmul and reduce_scatter", f"{node.name}: {source_dtype} to {node.args[1]}")
        casts.append(node)
        children = [source]
    else:
        operands = m.matmul_operands(node)
        if operands is None:
            raise Skip("reduce_scatter input is not a matmul", f"{node.name} = {node.target}")
        a, weight, addend = operands
        a_shape = m.shape_of(a, "matmul operand")
        if len(a_shape) != 2 or not m.known_equal(a_shape[0], rows):
            raise Skip("unexpected matmul operand shape", f"{node.name}: {a_shape}")
        terms.append(_Term(a, weight))
        if addend is not None:
            if isinstance(addend, Node) and m.same_shape(m.shape_of(addend, "addmm addend"), (n,)):
                biases.append(addend)
            elif isinstance(addend, Node) and m.same_shape(m.shape_of(addend, "addmm addend"), (rows, n)):
                # inductor folds ``mm + mm`` into ``addmm(mm, a, w)``: the addend is another term.
                children = [addend]
            else:
                raise Skip("bias is not a [N] vector", f"{node.name}: addend {m.val(addend).shape}")
    for child in children:
        if len(child.users) != 1:
            raise Skip("matmul output has other users", f"{child.name} is read by {[u.name for u in child.users]}")
        _collect_terms(child, rows, n, terms, biases, chain, casts)


def _check_collective(node: Node, reduce_op, group_name, group_allowed: Callable[[str], bool], what: str) -> Node:
    """Checks a reducing collective's group and op; returns its single ``wait_tensor``."""
    if not group_allowed(group_name):
        raise Skip("group not allowed", f"group {group_name!r}")
    if reduce_op not in ("sum", "avg"):
        raise Skip("unsupported reduce_op", str(reduce_op))
    wait = m.only_user(node)
    if not m.is_call(wait, m.WAIT):
        raise Skip(f"{what} not followed by a single wait_tensor", node.name)
    return wait


def _match_reduce_scatter(rs: Node, group_allowed: Callable[[str], bool], fuse_sums: bool) -> _ReduceScatterMatch:
    if len(rs.args) < 4:
        raise Skip("unexpected reduce_scatter signature", str(rs.args))
    inp, reduce_op, group_size, group_name = rs.args[:4]
    if not isinstance(group_size, int) or group_size < 1:
        raise Skip("symbolic group size", str(group_size))
    wait = _check_collective(rs, reduce_op, group_name, group_allowed, "reduce_scatter")
    dtype = m.check_float(inp, "reduce_scatter input")
    inp_shape = m.shape_of(inp, "reduce_scatter input")

    between: List[Node] = [rs, wait]
    partial, scatter_dim = inp, 0
    if m.is_call(inp, m.CAT) and m.cat_dim(inp) == 0:
        chunks = m.ordered_chunks(inp.args[0], group_size)
        if chunks is not None:
            # The stacked-chunks form of scatter_dim > 0.
            partial, scatter_dim, chunk_nodes = chunks
            if any(len(p.users) != 1 for p in chunk_nodes if not m.is_call(p, m.SPLIT_OPS)):
                raise Skip("matmul output has other users", f"chunks of {partial.name} are read elsewhere")
            if m.is_call(chunk_nodes[0], m.SPLIT_OPS) and len(chunk_nodes[0].users) != group_size:
                raise Skip("matmul output has other users", f"chunks of {partial.name} are read elsewhere")
            between += chunk_nodes + [inp]
    partial_shape = m.shape_of(partial, "reduce_scatter operand")
    if partial is inp:
        readers = {rs}
    elif m.is_call(between[2], m.SPLIT_OPS):
        readers = {between[2]}
    else:
        readers = set(between[2:-1])  # the slices
    if set(partial.users) != readers:
        raise Skip("matmul output has other users", partial.name)
    if len(partial_shape) < 2:
        raise Skip("1-D reduce_scatter operand", str(partial_shape))
    # A symbolic size that may not split is left to run time, where the op raises as the reduce_scatter would.
    if m.known_not_divisible(partial_shape[scatter_dim], group_size):
        raise Skip("scatter dim does not split over the group",
                   f"size {partial_shape[scatter_dim]} on dim {scatter_dim}, {group_size} ranks")
    if m.known_not_divisible(inp_shape[0], group_size):
        raise Skip("scatter dim does not split over the group", f"input {inp_shape}, {group_size} ranks")

    return _match_terms(wait, partial, partial_shape, dtype, reduce_op, scatter_dim, group_name, between, fuse_sums)


def _match_terms(wait: Node, partial: Node, partial_shape: tuple, dtype: torch.dtype, reduce_op: str,
                 scatter_dim: Optional[int], group_name: str, between: List[Node],
                 fuse_sums: bool) -> _ReduceScatterMatch:
    """The match of a collective (``between``: from it to its wait) reducing ``partial`` (read by it alone), once
    ``partial`` is shown to be a matmul or a sum of them."""
    n = partial_shape[-1]
    if not isinstance(n, int):
        raise Skip("symbolic shape", f"N of reduced operand {partial.name}: {partial_shape}")
    rows = m.numel(partial_shape[:-1])
    terms: List[_Term] = []
    biases: List[Node] = []
    chain: List[Node] = []
    casts: List[Node] = []
    _collect_terms(partial, rows, n, terms, biases, chain, casts)
    out_dtype = None
    if casts:  # the matmuls run in the cast's source dtype, the reduction in ``dtype``
        out_dtype, dtype = dtype, m.val(casts[0].args[0]).dtype
    if len(terms) > 1 and not fuse_sums:
        raise Skip("sum of matmuls (fuse_matmul_sums=False)", f"{len(terms)} terms")
    if len(biases) > 1:
        raise Skip("more than one bias in the reduced sum", str([b.name for b in biases]))
    bias = biases[0] if biases else None
    for term in terms:
        if not isinstance(m.val(term.a).shape[1], int):
            raise Skip("symbolic shape", f"K of matmul operand {term.a.name}: {tuple(m.val(term.a).shape)}")
        m.check_float(term.a, "matmul operand")
        if m.val(term.a).dtype != dtype:
            raise Skip("mixed dtypes", f"{term.a.name}: {m.val(term.a).dtype}, reduced {dtype}")
        m.check_weight_and_bias(term.weight, None, m.val(term.a).shape[1], dtype, term.a.name)
    if bias is not None:
        m.check_weight_and_bias(terms[0].weight, bias, m.val(terms[0].a).shape[1], dtype, bias.name)
    pos = m.positions(wait.graph)
    first = min(chain, key=pos.__getitem__)
    # Under dynamic shapes with two symbolic sizes the operand's reshape to [..., K] reuses the sizes of the
    # graph's own reshape to [..., N].
    lead_args = None
    for c in chain:
        if m.is_call(c, m.VIEW_OPS) and m.same_shape(m.val(c).shape, partial_shape):
            size_args = m.view_size_args(c, between + chain)
            if size_args is not None and len(size_args) == len(partial_shape):
                lead_args = size_args[:-1]
                break
    return _ReduceScatterMatch(wait, terms, bias, reduce_op, scatter_dim, group_name, partial_shape,
                               between + chain, first, lead_args, out_dtype)


def match_all_reduce(ar: Node, group_allowed: Callable[[str], bool], fuse_sums: bool = True) -> _ReduceScatterMatch:
    """``wait(all_reduce(x))`` with ``x`` what this pass fuses into a reduce-scatter (a matmul or a sum of them, read
    by the collective alone), as a match with ``scatter_dim`` None.  Raises :class:`Skip` otherwise."""
    if len(ar.args) != 3 or ar.kwargs:
        raise Skip("unexpected all_reduce signature", str(ar.args))
    inp, reduce_op, group_name = ar.args
    wait = _check_collective(ar, reduce_op, group_name, group_allowed, "all_reduce")
    dtype = m.check_float(inp, "all_reduce input")
    shape = m.shape_of(inp, "all_reduce input")
    if len(shape) < 2:
        raise Skip("1-D all_reduce operand", str(shape))
    if set(inp.users) != {ar}:
        raise Skip("matmul output has other users", inp.name)
    return _match_terms(wait, inp, shape, dtype, reduce_op, None, group_name, [ar, wait], fuse_sums)


def rewrite_matmul_all_reduce(match: _ReduceScatterMatch, inserted_by: str) -> str:
    """Replace a :func:`match_all_reduce` match with one ``fluxinductor.matmul_all_reduce`` (which runs a fused
    reduce-scatter and an all-gather where the rows split over the group at run time), marked as inserted by the pass
    ``inserted_by`` (a later rewrite of it counts under that pass's collective); returns a description.
    Raises :class:`Skip` (the graph untouched) where the op refuses the shapes or a mutation intervenes."""
    graph = match.wait.graph
    op = _rewrite(graph, match, m.fake_mode_of(graph))
    while op.target is not torch.ops.fluxinductor.matmul_all_reduce.default:
        op = op.args[0]  # the views of the op's result back to the all-reduce's shape
    op.meta[m.INSERTED_BY] = inserted_by
    return (f"{len(match.terms)} matmul(s), reduce_op={match.reduce_op}, bias={match.bias is not None}, "
            f"rows {match.partial_shape[:-1]}")


def _n_d(graph: Graph, fake_mode, node: Node, shape: tuple, arg: Optional[list]) -> Node:
    """``node`` reshaped to ``shape`` (a new reshape node with size argument ``arg``, unless it already has
    that shape)."""
    if m.same_shape(m.val(node).shape, shape):
        return node
    reshaped = graph.call_function(m.aten.reshape.default, (node, arg))
    m.set_val(reshaped, fake_mode, lambda: m.val(node).reshape(shape))
    return reshaped


@dataclass
class _Group:
    """One fused op of a rewrite: the terms it sums (over their concatenated K), its bias, and what its fake
    evaluation found."""

    terms: List[_Term]
    bias: Optional[Node]
    a_source: Node  # the operand node (or, for several terms, the first term's) the op reads
    a_nd_shape: tuple
    a_nd_arg: Optional[list]
    needs_reshape: bool
    plan: Optional[tuple]
    result_2d: torch.Tensor
    result: torch.Tensor  # fake, as the graph reads it
    batch_major: bool = False  # B > 1, no plan: the op reads the batch-major operand in place
    slabs: bool = False  # the terms as the op's K slabs (a, weight and more_a, more_weights), not concatenated


def _collective_args(match: _ReduceScatterMatch, plan: Optional[tuple]) -> tuple:
    """(reduce_op, scatter_dim, group_name) of matmul_reduce_scatter; (reduce_op, group_name) of matmul_all_reduce."""
    if match.scatter_dim is None:
        return match.reduce_op, match.group_name
    return match.reduce_op, 0 if plan is not None else match.scatter_dim, match.group_name


def _op(match: _ReduceScatterMatch):
    from fluxinductor import ops  # noqa: F401  (registers torch.ops.fluxinductor)

    registered = torch.ops.fluxinductor
    return (registered.matmul_all_reduce if match.scatter_dim is None else registered.matmul_reduce_scatter).default


def _plan(match: _ReduceScatterMatch, terms: List[_Term], bias: Optional[Node], fake_mode,
          slabs: bool = False) -> _Group:
    """Evaluate the fused op of ``terms`` on fakes (nothing in the graph changes); raises :class:`Skip` where the op
    refuses the shapes.  ``slabs``: the terms go to the op as they are (its K slabs), not concatenated."""
    op = _op(match)
    lead = tuple(match.partial_shape[:-1])
    ks = [m.val(t.a).shape[1] for t in terms]
    if slabs:
        return _plan_slabs(match, terms, bias, fake_mode, op, lead, ks)
    a_nd_shape = lead + (sum(ks),)
    a_source = terms[0].a
    if len(terms) == 1 and m.is_call(a_source, m.VIEW_OPS) and m.val(a_source.args[0]) is not None \
            and m.same_shape(m.val(a_source.args[0]).shape, a_nd_shape):
        # a is usually reshape(x, [M, K]) of an N-D x of the shape needed: use x itself.
        a_source = a_source.args[0]
    a_shape = m.val(a_source).shape if len(terms) == 1 else (m.val(a_source).shape[0], sum(ks))
    needs_reshape = not m.same_shape(a_shape, a_nd_shape)
    a_nd_arg = m.reshape_arg(a_nd_shape)
    if a_nd_arg is None and match.lead_args is not None:
        a_nd_arg = match.lead_args + [sum(ks)]
    if needs_reshape and a_nd_arg is None:
        raise Skip("symbolic shape", f"operand {a_nd_shape} would need a reshape with more than one symbolic size")
    # scatter_dim > 0 with a leading dim > 1 ([B, S, N] scattered on S with B > 1): the op gets the operand as it is
    # where its kernel reads each owner's blocks in place (m.batch_major of the result's shape); otherwise it
    # reduce-scatters the rows-first operand on dim 0 and the permutes around it are left to inductor (m.rows_first).
    out_shape = m.val(match.wait).shape
    plan = None if match.scatter_dim is None else m.rows_first(out_shape, match.scatter_dim)
    batch_major = plan is not None and m.batch_major(out_shape, match.scatter_dim)
    if batch_major:
        plan = None
    out_dtype_arg = () if match.out_dtype is None else (match.out_dtype,)  # the schema's default otherwise
    try:
        with fake_mode:
            if len(terms) == 1:
                a_val, w_val = m.val(a_source), m.val(terms[0].weight)
            else:
                # sum_i a_i @ w_i == cat(a_i, dim 1) @ cat(w_i, dim 0)
                a_val = torch.cat([m.val(t.a) for t in terms], 1)
                w_val = torch.cat([m.val(t.weight) for t in terms], 0)
            if needs_reshape:
                a_val = a_val.reshape(a_nd_shape)
            if plan is not None:
                lead = [-1] + [a_val.shape[d] for d in plan[2]]  # [S / world, rest...] of the result
                a_val = a_val.permute(plan[0]).reshape(-1, sum(ks))
            result_2d = op(a_val, w_val, None if bias is None else m.val(bias), *_collective_args(match, plan),
                           *out_dtype_arg)
            # The result as the graph reads it (a view of the rows-first result).
            result = result_2d if plan is None else result_2d.reshape(lead + [match.partial_shape[-1]]).permute(plan[1])
    except Exception as e:  # noqa: BLE001 - any failure here means "do not rewrite"
        raise Skip("fused op rejected the shapes", f"{type(e).__name__}: {e}")
    if not m.same_shape(result.shape, out_shape):
        raise Skip("fused op output shape mismatch", f"{tuple(result.shape)} vs {tuple(out_shape)}")
    return _Group(terms, bias, a_source, a_nd_shape, a_nd_arg, needs_reshape, plan, result_2d, result, batch_major)


def _slab_shapes(match: _ReduceScatterMatch, lead: tuple, ks: list) -> List[tuple]:
    """(N-D shape, its reshape argument) of each term's operand as the op gets it: the result's leading dims, the
    term's K."""
    shapes = []
    for k in ks:
        shape = lead + (k,)
        arg = m.reshape_arg(shape)
        if arg is None and match.lead_args is not None:
            arg = match.lead_args + [k]
        if arg is None:
            raise Skip("symbolic shape", f"operand {shape} would need a reshape with more than one symbolic size")
        shapes.append((shape, arg))
    return shapes


def _plan_slabs(match: _ReduceScatterMatch, terms: List[_Term], bias: Optional[Node], fake_mode, op, lead: tuple,
                ks: list) -> _Group:
    """:func:`_plan` for the terms as K slabs: each operand reshaped to the result's leading dims and, where the op
    runs rows-first, permuted as the single operand would be."""
    out_shape = m.val(match.wait).shape
    plan = m.rows_first(out_shape, match.scatter_dim)
    batch_major = plan is not None and m.batch_major(out_shape, match.scatter_dim)
    if batch_major:  # every operand read in place, as the single one would be
        plan = None
    shapes = _slab_shapes(match, lead, ks)
    try:
        with fake_mode:
            vals = [m.val(t.a).reshape(shape) for t, (shape, _) in zip(terms, shapes)]
            if plan is not None:
                rows = [-1] + [vals[0].shape[d] for d in plan[2]]
                vals = [v.permute(plan[0]).reshape(-1, k) for v, k in zip(vals, ks)]
            result_2d = op(vals[0], m.val(terms[0].weight), None if bias is None else m.val(bias),
                           *_collective_args(match, plan), **_out_dtype_kw(match), more_a=vals[1:],
                           more_weights=[m.val(t.weight) for t in terms[1:]])
            result = result_2d if plan is None else result_2d.reshape(rows + [match.partial_shape[-1]]).permute(plan[1])
    except Exception as e:  # noqa: BLE001 - any failure here means "do not rewrite"
        raise Skip("fused op rejected the shapes", f"{type(e).__name__}: {e}")
    if not m.same_shape(result.shape, out_shape):
        raise Skip("fused op output shape mismatch", f"{tuple(result.shape)} vs {tuple(out_shape)}")
    return _Group(terms, bias, terms[0].a, shapes[0][0], shapes[0][1], True, plan, result_2d, result, batch_major,
                  slabs=True)


def _insert_slabs(graph: Graph, match: _ReduceScatterMatch, g: _Group, fake_mode) -> Node:
    """:func:`_insert` for the terms as K slabs."""
    n = match.partial_shape[-1]
    lead = tuple(match.partial_shape[:-1])
    ks = [m.val(t.a).shape[1] for t in g.terms]
    args = []
    rows = None
    for t, (shape, arg), k in zip(g.terms, _slab_shapes(match, lead, ks), ks):
        a_arg = _n_d(graph, fake_mode, t.a, shape, arg)
        if g.batch_major and not m.val(a_arg).is_contiguous():
            a_arg = m.call_contiguous(graph, fake_mode, a_arg)  # read in place: its producer writes it batch-major
        if g.plan is not None:
            if rows is None:  # [S / world, rest...] of the result, as the first operand's sizes give them
                rows = _result_rows(graph, a_arg, g.plan)
            a_arg = _rows_first(graph, fake_mode, a_arg, g.plan, k)
        args.append(a_arg)
    fused = graph.call_function(_op(match), (args[0], g.terms[0].weight, g.bias) + _collective_args(match, g.plan),
                                {**_out_dtype_kw(match), "more_a": args[1:],
                                 "more_weights": [t.weight for t in g.terms[1:]]})
    fused.meta["val"] = g.result_2d
    m.copy_debug_meta(fused, match.first)
    return fused if g.plan is None else _restored(graph, fake_mode, fused, g.plan, rows + [n])


def _out_dtype_kw(match: _ReduceScatterMatch) -> dict:
    """The op's ``out_dtype`` keyword for the match: an fp32 reduction of half-precision partials, else none."""
    return {} if match.out_dtype is None else {"out_dtype": match.out_dtype}


def _result_rows(graph: Graph, a_arg: Node, plan: tuple) -> list:
    """[-1, rest...]: the leading sizes of the rows-first result, read from the N-D operand ``a_arg``."""
    return [-1] + [m.size_arg(graph, a_arg, d) for d in plan[2]]


def _rows_first(graph: Graph, fake_mode, a_arg: Node, plan: tuple, k: m.Size) -> Node:
    """The N-D operand ``a_arg`` permuted rows-first (``plan``, :func:`fluxinductor.passes._match.rows_first`) and
    flattened to [-1, k]."""
    a_arg = m.call_view(graph, fake_mode, m.aten.permute.default, a_arg, plan[0])
    a_arg = m.call_contiguous(graph, fake_mode, a_arg)
    return m.call_view(graph, fake_mode, m.aten.reshape.default, a_arg, [-1, k])


def _restored(graph: Graph, fake_mode, out: Node, plan: tuple, shape: list) -> Node:
    """The rows-first result ``out`` reshaped to ``shape`` and permuted back to the graph's layout, contiguous."""
    out = m.call_view(graph, fake_mode, m.aten.reshape.default, out, shape)
    out = m.call_view(graph, fake_mode, m.aten.permute.default, out, plan[1])
    return m.call_contiguous(graph, fake_mode, out)


def _insert(graph: Graph, match: _ReduceScatterMatch, g: _Group, fake_mode) -> Node:
    """Insert ``g``'s fused op (and the reshapes around it) before the collective; returns the node of its result
    in the shape the graph reads."""
    if g.slabs:
        return _insert_slabs(graph, match, g, fake_mode)
    n = match.partial_shape[-1]
    ks = [m.val(t.a).shape[1] for t in g.terms]
    if len(g.terms) == 1:
        a_arg, w_arg = _n_d(graph, fake_mode, g.a_source, g.a_nd_shape, g.a_nd_arg), g.terms[0].weight
    else:
        a_cat = graph.call_function(m.aten.cat.default, ([t.a for t in g.terms], 1))
        m.set_val(a_cat, fake_mode, lambda: torch.cat([m.val(t.a) for t in g.terms], 1))
        a_arg = _n_d(graph, fake_mode, a_cat, g.a_nd_shape, g.a_nd_arg)
        w_arg = graph.call_function(m.aten.cat.default, ([t.weight for t in g.terms], 0))
        m.set_val(w_arg, fake_mode, lambda: torch.cat([m.val(t.weight) for t in g.terms], 0))
    if g.batch_major and not m.val(a_arg).is_contiguous():
        a_arg = m.call_contiguous(graph, fake_mode, a_arg)  # read in place: its producer writes it batch-major
    if g.plan is not None:
        lead = _result_rows(graph, a_arg, g.plan)
        a_arg = _rows_first(graph, fake_mode, a_arg, g.plan, sum(ks))
    out_dtype_arg = () if match.out_dtype is None else (match.out_dtype,)
    fused = graph.call_function(_op(match), (a_arg, w_arg, g.bias) + _collective_args(match, g.plan) + out_dtype_arg)
    fused.meta["val"] = g.result_2d
    m.copy_debug_meta(fused, match.first)
    return fused if g.plan is None else _restored(graph, fake_mode, fused, g.plan, lead + [n])


def _rewrite(graph: Graph, match: _ReduceScatterMatch, fake_mode, per_term: bool = False, slabs: bool = False) -> Node:
    """Replace ``match`` with one fused op over the concatenated K of its terms (``slabs``: the op gets the terms as
    they are, its K slabs), or (``per_term``, a reduce-scatter of a sum) one fused op per term whose results are added:
    ``rs(a1 @ w1 + a2 @ w2) == rs(a1 @ w1) + rs(a2 @ w2)``.  Returns the node that now stands for the reduced
    result."""
    all_reduce = match.scatter_dim is None
    rs = match.between[0]
    # The op reads a, weight and bias at the reduce_scatter instead of at the matmul(s).
    mutator = m.mutation_between(match.first, rs)
    if mutator is not None:
        raise Skip("possible mutation between the matmul and the reduce_scatter", mutator.name)
    split = per_term and not all_reduce and len(match.terms) > 1
    groups = [[t] for t in match.terms] if split else [match.terms]
    # Every op is evaluated on fakes before the graph changes; the bias goes to the first op only.
    planned = [_plan(match, terms, match.bias if i == 0 else None, fake_mode, slabs)
               for i, terms in enumerate(groups)]
    with graph.inserting_before(rs):
        out = _insert(graph, match, planned[0], fake_mode)
        total = planned[0].result
        for g in planned[1:]:
            term = _insert(graph, match, g, fake_mode)
            with fake_mode:
                total = total + g.result
            out = graph.call_function(m.aten.add.Tensor, (out, term))
            m.set_val(out, fake_mode, lambda: total)
    match.wait.replace_all_uses_with(out)
    # The matmuls' [M, K] operand views go too when the op reads their N-D source instead: a dead view would
    # count as a second reader and make inductor store the producer's result where it could be fused.
    m.erase_dead(graph, match.between + [t.a for t in match.terms if m.is_call(t.a, m.VIEW_OPS)])
    if all_reduce:
        return out  # rewrite_matmul_all_reduce's caller records it
    record_fused(PATTERN, f"{len(match.terms)} matmul(s){' as one op each' if split else ' as K slabs' if slabs else ''}, "
                          f"scatter_dim={match.scatter_dim}"
                          f"{', rows-first' if planned[0].plan else ', batch-major' if planned[0].batch_major else ''}, "
                          f"reduce_op={match.reduce_op}, bias={match.bias is not None}, group={match.group_name}"
                          f"{f', reduced in {match.out_dtype}' if match.out_dtype is not None else ''}")
    return out


def check_worth_fusing(not_worth_fusing: Callable[..., Optional[str]], terms: List[_Term], world: int, rows: m.Size,
                       n: int, upcast: bool, replaces_all_reduce: bool = False) -> None:
    """Asks ``not_worth_fusing`` about the fused op for ``terms`` (the global GEMM shape; a symbolic M is asked as
    None, "at any M", as the graph serves every M); raises :class:`Skip` where it vetoes.  ``upcast``: the op would
    produce an fp32 result from half-precision operands.  ``replaces_all_reduce``: the op is half of a split
    all-reduce (weighed against the whole all-reduce)."""
    a = m.val(terms[0].a)
    k = world * sum(m.val(t.a).shape[1] for t in terms)
    # A sum's weights are concatenated along K into a contiguous (N-major) [K/world, N] tensor.
    weight = (m.val(terms[0].weight) if len(terms) == 1 else
              torch.empty((k // world, n), dtype=a.dtype, device="meta"))
    extra = {"out_dtype": torch.float32} if upcast else {}  # the split transport writes fp32 in some cases only
    if replaces_all_reduce:
        extra["replaces_all_reduce"] = True
    why = not_worth_fusing(PATTERN, a.device, world, rows if isinstance(rows, int) else None, k, n, a.dtype,
                           weight=weight, **extra)
    if why is not None:
        raise Skip("not worth fusing here", why)


def copied_bytes(terms: List[_Term]) -> Optional[int]:
    """Bytes the concatenations of a sum's operands copy: the operands that reach the matmuls (through reshapes and
    transposes) from the graph's inputs (weights, saved activations), which no kernel of the graph can write into a
    concatenation.  None where a size is symbolic."""
    total = 0
    for t in terms:
        for node in (t.a, t.weight):
            source = node
            while m.is_call(source, m.VIEW_OPS + m.TRANSPOSES):
                source = source.args[0]
            if source.op == "placeholder":
                val = m.val(node)
                if not isinstance(val.numel(), int):
                    return None
                total += val.numel() * val.element_size()
    return total


def _slabs(match: _ReduceScatterMatch, world: int, rows: m.Size,
           sum_as_slabs: Optional[Callable[..., bool]] = None) -> bool:
    """Whether a reduce-scatter of a sum of matmuls goes to the op as its K slabs, no operand copied: 2 or 3 terms of
    static shapes, every K (per rank) a multiple of 8 and all but the last of the split GEMMs' tile K, N a multiple of 8,
    the weights laid out alike and no cast between the sum and the collective but autocast's fp32 reduction where the
    split transport writes fp32 (two ranks, bf16 operands, N-major weights).  The operands go rows-first or, where the
    op reads them batch-major in place, as they are.  At a static M, ``sum_as_slabs`` (see
    :func:`fuse_matmul_reduce_scatter`) may still leave the sum to the other forms.  Where the split transport cannot
    run it after all, the op decomposes."""
    from fluxinductor.kernels.gemm_rs_split import MAX_SLABS, SLAB_K_MULTIPLE, float_result_reason

    if match.scatter_dim is None or not 2 <= len(match.terms) <= MAX_SLABS:
        return False
    if match.out_dtype is not None and float_result_reason(world, m.val(match.terms[0].weight),
                                                           match.out_dtype) is not None:
        return False
    ks = [m.val(t.a).shape[1] for t in match.terms]
    n = match.partial_shape[-1]
    if not all(isinstance(x, int) for x in ks + [n]) or n % 8 or any(k % 8 for k in ks) or \
            any(k % SLAB_K_MULTIPLE for k in ks[:-1]):
        return False
    weights = [m.val(t.weight) for t in match.terms]
    if len({(w.stride(0) == 1, w.stride(1) == 1) for w in weights}) != 1:
        return False
    if sum_as_slabs is None or not isinstance(rows, int):
        return True
    a = m.val(match.terms[0].a)
    return sum_as_slabs(a.device, world, rows, world * sum(ks), n, a.dtype)


def _per_term(match: _ReduceScatterMatch, world: int, rows: m.Size,
              not_worth_fusing: Optional[Callable[..., Optional[str]]],
              sum_per_term: Optional[Callable[..., bool]]) -> bool:
    """Whether a sum of matmuls is fused one op per term: ``sum_per_term`` says it is cheaper than the concatenation
    and each term alone is worth fusing."""
    if len(match.terms) < 2 or sum_per_term is None or not isinstance(rows, int):
        return False
    copied = copied_bytes(match.terms)
    a = m.val(match.terms[0].a)
    ks = [world * m.val(t.a).shape[1] for t in match.terms]
    if copied is None or not sum_per_term(a.device, world, rows, ks, match.partial_shape[-1], a.dtype, copied):
        return False
    if not_worth_fusing is not None:
        try:
            for term in match.terms:
                check_worth_fusing(not_worth_fusing, [term], world, rows, match.partial_shape[-1],
                                   upcast=match.out_dtype is not None)
        except Skip:
            return False
    return True


def fuse_matmul_reduce_scatter(graph: Graph, group_allowed: Callable[[str], bool],
                               not_worth_fusing: Optional[Callable[..., Optional[str]]] = None,
                               fuse_sums: bool = True,
                               sum_per_term: Optional[Callable[..., bool]] = None,
                               sum_as_slabs: Optional[Callable[..., bool]] = None) -> None:
    """Rewrite every ``matmul -> reduce_scatter`` in ``graph`` (in place) into
    ``fluxinductor.matmul_reduce_scatter``; record a skip for each reduce-scatter left alone.
    ``fuse_sums=False`` leaves reduce-scatters of a sum of matmuls alone (they would need cat copies).
    ``not_worth_fusing(op, device, world, m, k, n, dtype, weight=...)`` (global GEMM shape, m None where it is
    symbolic; a fake of the weight the fused op gets) may veto a match.  ``sum_per_term(device, world, m, ks, n,
    dtype, copied_bytes)`` (global shapes, each term's K in ``ks``; :func:`copied_bytes`): True to fuse a sum one op
    per term instead of over the concatenated K; None: always concatenated.  ``sum_as_slabs(device, world, m, k, n,
    dtype)`` (global shapes, the terms' K together; asked for a static M where :func:`_slabs` found the sum fits):
    False to leave the K slabs (which only the split transport runs) for the per-term or concatenated form; None:
    K slabs wherever they fit."""
    scatters = [n for n in graph.nodes if m.is_call(n, m.REDUCE_SCATTER)]
    if not scatters:
        return
    fake_mode = m.fake_mode_of(graph)
    for rs in m.each_collective(scatters):
        try:
            if fake_mode is None:
                raise Skip("no fake mode in graph metadata", rs.name)
            match = _match_reduce_scatter(rs, group_allowed, fuse_sums)
            rows = m.numel(match.partial_shape[:-1])
            world = rs.args[2]
            slabs = _slabs(match, world, rows, sum_as_slabs)
            per_term = not slabs and _per_term(match, world, rows, not_worth_fusing, sum_per_term)
            if not_worth_fusing is not None and not per_term:
                check_worth_fusing(not_worth_fusing, match.terms, world, rows, match.partial_shape[-1],
                                   upcast=match.out_dtype is not None)
            _rewrite(graph, match, fake_mode, per_term, slabs)
        except Skip as s:
            record_skip(PATTERN, s.reason, s.detail or rs.name)
