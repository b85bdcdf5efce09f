"""Split ``all_reduce(matmul)`` into a reduce-scatter and a later all-gather (sequence parallelism by the compiler).

Plain tensor parallelism (DTensor ``ColwiseParallel`` / ``RowwiseParallel`` with replicated activations, or an
explicit ``all_reduce`` after a row-parallel matmul) has neither an ``all_gather -> matmul`` nor a ``matmul ->
reduce_scatter`` for the other two passes to fuse: its graphs all-reduce every row-parallel output (and, in the
backward, every column-parallel input gradient).  An all-reduce is a reduce-scatter followed by an all-gather.  This
pass makes that split explicit, so the matmul-reduce-scatter pass fuses the first half into the matmul, and moves the
all-gather as late as it can::

    y  = wait_tensor(all_reduce(mm(a, W), "sum", group))      # [B, S, H], replicated
    h  = x + y                                                # x replicated: the residual stream
    n  = rms_norm(h)                                          # row-wise: reductions over the last dim only
    q  = mm(reshape(n, [B*S, H]), W_q)

becomes, with ``options={"split_all_reduce": "replicated"}`` (rank r of w; M = B*S rows, this rank's rows
``[r*M/w, (r+1)*M/w)``)::

    y_r = wait_tensor(reduce_scatter_tensor(reshape(mm(a, W), [M, H]), "sum", w, group))   # [M/w, H]
    h_r = slice(reshape(x, [M, H]), 0, r*M/w, (r+1)*M/w) + y_r
    n_r = rms_norm(h_r)                                       # on M/w rows
    n   = reshape(wait_tensor(all_gather_into_tensor(n_r, w, group)), [B, S, H])
    q   = mm(reshape(n, [B*S, H]), W_q)

and the all-gather pass fuses ``all_gather -> mm`` as well.  The ops between run on 1/w of the rows.  Slicing ``x``
assumes that it holds the same values on every rank, which the graph cannot show (an input, a gradient arriving
from the loss): DTensor's ``Replicate`` and tensor-parallel training guarantee it, a program that adds a
rank-dependent tensor to an all-reduced one does not.  So by default (``exact``) a full tensor is never sliced: the
rows stay sharded only through ops whose other operands are sharded the same way or broadcast over the rows, and in
the graph above the all-gather lands before the residual add (``h = x + all_gather(y_r)``): the reduce-scatter half
is still fused with the matmul, and the arithmetic is exactly the graph's.

Which ops keep the rows sharded (everything else reads the gathered tensor):

* pointwise ops (``torch.Tag.pointwise``, not random) whose other tensor operands are sharded the same way,
  broadcast over every leading dim (a ``[H]`` weight, a scalar), or (``replicated`` only) replicated with the same
  leading dims, sliced to this rank's rows (a view);
* reshapes that keep the last dim and the row count, and ``expand`` of the last dim;
* reductions over the last dim with ``keepdim=True`` (``sum``, ``mean``, ``amax``, ``amin``, ``var_mean``);
* ``sum`` over every row dim (a norm's weight gradient): a local sum, then an all-reduce of the small result.

A sharded value read by anything else (a permute, a graph output, a matmul reading it as its second operand, an op
this pass does not know) is all-gathered once, before its first such reader.  That all-gather is hidden when a
reader is a matmul's first operand (through reshapes or a dtype cast: the all-gather pass fuses it); otherwise it is
exposed.  Sharding on can gather several tensors where one would do (a LayerNorm's backward reads the gradient and
saved activations the graph cannot slice), so an all-reduce whose rows would expose more gathered bytes that way than
a gather right after its reduce-scatter is *confined*: every reader gets the gathered tensor at once (see
``_choose_plan``).  Confined, an all-reduce leaves one exposed all-gather, about half its traffic, so every candidate
is rewritten.  An all-reduce is a candidate only where the matmul-reduce-scatter pass will fuse
the reduce-scatter it becomes (a matmul or a sum of matmuls, read by nothing else; on GPUs, a shape the cost model
fuses), a static shape whose rows split evenly over the group, ``sum`` or ``avg``.

Under dynamic shapes the row count is symbolic: the graph cannot know that it splits over the group, so nothing is
sharded; each candidate all-reduce becomes one ``fluxinductor.matmul_all_reduce(a, W, b, reduce_op, group)`` op, which
at run time takes the fused reduce-scatter and an all-gather of its result where the rows split and the dispatcher
fuses the call, and the matmul and the all-reduce otherwise (the matmul-reduce-scatter pass's matcher, so sums of
matmuls, biases and autocast's upcast are taken as there).

An all-reduce of a matmul that is not split for another reason (static rows that do not split over the group, or a
split the pass manager's cost model vetoes, as at decode sizes, where the added all-gather costs more than the fused
reduce-scatter saves) becomes that same op where the pass manager says the op's one-shot all-reduce kernel could run
(``not_worth_fusing("matmul_all_reduce", ...)`` returns None: a GPU with the kernel, a dtype and N it takes); the op
then chooses per call between the one-shot kernel and the matmul and the all-reduce.  Elsewhere it stays as it is.

The slices bake this process's rank into the graph; under ``replicated`` the pass manager's uuid holds the rank so
that inductor's FX graph cache, which the ranks of a job may share, never serves one rank's graph to another.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

import torch
from torch.fx import Graph, Node

from fluxinductor.log import record_fused, record_skip
from fluxinductor.passes import _match as m
from fluxinductor.passes._match import Skip

PATTERN = "all_reduce_split"

ALL_REDUCE = m.c10d.all_reduce.default

# What a byte of row-wise work saved is worth in exposed all-gather bytes.  Measured on one H200
# (benchmarks/probe_row_work.py, benchmarks/results/row_work/h200_row_work.json): a compiled residual add + RMSNorm
# in bf16 on half of 4096-8192 rows saves 62-88 us, 0.049-0.071 of the time NCCL's all-gather takes (173 GB/s bus
# bandwidth on 2xH200) for the bytes the planner credits there; inductor fuses such chains into a kernel or two, so
# an op on its own would be worth more.
_ROW_WORK_CREDIT = 1 / 16

_LAST_DIM_REDUCTIONS = (m.aten.sum.dim_IntList, m.aten.mean.dim, m.aten.amax.default, m.aten.amin.default)
_VAR_MEAN = m.aten.var_mean.correction
_EXPAND = m.aten.expand.default
_ROW_SUMS = (m.aten.sum.dim_IntList, m.aten.sum.default)


@dataclass
class _Shard:
    """A value now held as this rank's rows: ``node`` is [M/w, last] (a tuple of those for ``var_mean``) and stands
    for the replicated ``shape`` (leading dims multiplying to M)."""

    node: Optional[Node]  # None during the dry run
    shape: Tuple[int, ...]
    rows: int
    group: str
    world: int
    rank: int

    @property
    def lead(self) -> Tuple[int, ...]:
        return self.shape[:-1]


@dataclass
class _Source:
    """A candidate all-reduce and what it becomes."""

    wait: Node
    all_reduce: Node
    operand: Node
    shape: Tuple[int, ...]
    rows: int
    reduce_op: str
    group: str
    world: int
    rank: int


def _group_rank(group_name: str) -> Tuple[int, int]:
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    return group.size(), group.rank()


def _match_source(ar: Node, group_allowed: Callable[[str], bool],
                  not_worth_fusing: Optional[Callable[..., Optional[str]]], fuse_sums: bool):
    """The candidate all-reduce ``ar`` as a :class:`_Source` to split where its rows are static, split over the group
    and the split is not vetoed; else as a :class:`_Whole` for one ``matmul_all_reduce`` where the rows are symbolic,
    or where the split is out but the op's one-shot kernel could run (:func:`_whole_reason`).  Raises :class:`Skip`
    where it is no candidate."""
    from fluxinductor.passes.matmul_reduce_scatter import check_worth_fusing, match_all_reduce

    match = match_all_reduce(ar, group_allowed, fuse_sums)  # raises Skip where the reduce-scatter won't fuse
    shape = tuple(match.partial_shape)
    try:
        world, rank = _group_rank(match.group_name)
    except Exception as e:  # noqa: BLE001 - an unknown group: leave the collective as it is
        raise Skip("cannot resolve the group", f"{match.group_name!r}: {type(e).__name__}: {e}")
    rows, n = m.numel(shape[:-1]), shape[-1]
    if world < 2:
        raise Skip("group of one rank", match.group_name)
    no_split = None
    if m.known_not_divisible(rows, world):
        no_split = Skip("rows do not split over the group", f"{shape}, {world} ranks")
    elif not_worth_fusing is not None:
        try:
            check_worth_fusing(not_worth_fusing, match.terms, world, rows, n, upcast=match.out_dtype is not None,
                               replaces_all_reduce=True)
        except Skip as veto:
            no_split = veto
    if no_split is not None:
        why = _whole_reason(not_worth_fusing, match, world, rows, n)
        if why is not None:
            raise no_split
        return _Whole(match, no_split.reason)
    if not all(isinstance(d, int) for d in shape):
        return _Whole(match, "symbolic rows")
    return _Source(match.wait, ar, ar.args[0], shape, rows, match.reduce_op, match.group_name, world, rank)


@dataclass
class _Whole:
    """An all-reduce the pass keeps whole as one ``fluxinductor.matmul_all_reduce`` (``match``: the reduce-scatter
    pass's), and why it is not split."""

    match: object
    why: str


def _whole_reason(not_worth_fusing: Optional[Callable[..., Optional[str]]], match, world: int, rows: m.Size,
                  n: int) -> Optional[str]:
    """Why an all-reduce the pass will not split should stay as it is rather than become one
    ``fluxinductor.matmul_all_reduce`` (``not_worth_fusing`` asked about op "matmul_all_reduce": the pass manager's
    answers None where the op's one-shot kernel could run), or None to rewrite it."""
    if not_worth_fusing is None:
        return "no veto function to ask"
    a = m.val(match.terms[0].a)
    k = world * sum(m.val(t.a).shape[1] for t in match.terms)
    return not_worth_fusing("matmul_all_reduce", a.device, world, rows if isinstance(rows, int) else None, k, n,
                            a.dtype)


def _lead_of(shape: Tuple[int, ...], ndim: int) -> Tuple[int, ...]:
    """The leading (row) dims of ``shape`` right-aligned to an ``ndim``-D result, padded with ones."""
    lead = tuple(shape[:-1]) if shape else ()
    return (1,) * (ndim - 1 - len(lead)) + lead


class _Planner:
    """Decides, node by node in graph order, which values stay sharded.  ``emit`` False: a dry run that only
    classifies and counts; True: builds the sharded nodes (the same decisions, in the same order)."""

    def __init__(self, graph: Graph, sources: Dict[Node, _Source], fake_mode, emit: bool, assume_replicated: bool,
                 confined: FrozenSet[Node] = frozenset(),
                 not_worth_fusing: Optional[Callable[..., Optional[str]]] = None):
        self.graph = graph
        self.not_worth_fusing = not_worth_fusing
        self.assume_replicated = assume_replicated
        self.confined = confined  # sources whose readers all get the gathered tensor (the rows go no further)
        self.origins: Dict[Node, FrozenSet[Node]] = {}  # sharded original -> the sources it is computed from
        self.sources = sources
        self.fake_mode = fake_mode
        self.emit = emit
        self.sharded: Dict[Node, _Shard] = {}
        self.gathered: Dict[Node, Node] = {}  # sharded original -> its all-gathered replacement
        self.gathered_rows: Dict[Node, Node] = {}  # sharded node -> the wait of its all-gather
        self.sliced: Dict[Tuple[Node, int, int], Node] = {}
        self.needs_full: Dict[Node, List[Node]] = {}  # sharded original -> readers of the full tensor
        self.row_sums = 0
        self.rows_saved: Dict[Node, int] = {}  # sharded original -> bytes of its full result no longer computed
        self.dead: List[Node] = []

    # -- new nodes ------------------------------------------------------------------------------------------------
    def _call(self, target, args: tuple, kwargs: Optional[dict] = None) -> Node:
        kwargs = kwargs or {}
        node = self.graph.call_function(target, args, kwargs)

        def fake(a):  # meta['val'] as it is: a tuple for var_mean
            return a.meta["val"] if isinstance(a, Node) else a

        m.set_val(node, self.fake_mode, lambda: target(*torch.fx.node.map_aggregate(args, fake),
                                                          **torch.fx.node.map_aggregate(kwargs, fake)))
        return node

    def _slice(self, full: Node, rows: int, world: int, rank: int, last: int) -> Node:
        key = (full, rows, last)
        if key not in self.sliced:
            flat = full if tuple(m.val(full).shape) == (rows, last) else self._call(
                m.aten.reshape.default, (full, [rows, last]))
            per = rows // world
            self.sliced[key] = self._call(m.SLICE, (flat, 0, rank * per, (rank + 1) * per))
        return self.sliced[key]

    def _gather(self, original: Node) -> Node:
        if original not in self.gathered:
            s = self.sharded[original]
            # One all-gather per sharded value: originals that are views of one value (each column-parallel linear
            # reshapes the norm's output for itself) share it, so the all-gather pass sees every matmul that reads
            # those rows and fuses them into one call.
            wait = self.gathered_rows.get(s.node)
            if wait is None:
                ag = self._call(m.ALL_GATHER, (s.node, s.world, s.group))
                ag.meta[m.INSERTED_BY] = PATTERN
                wait = self.gathered_rows[s.node] = self._call(m.WAIT, (ag,))
            self.gathered[original] = wait if len(s.shape) == 2 else self._call(
                m.aten.reshape.default, (wait, list(s.shape)))
        return self.gathered[original]

    # -- classification -------------------------------------------------------------------------------------------
    def _operand(self, arg, out_shape: Tuple[int, ...], ref: _Shard):
        """How a tensor operand of a row-local op reads in the sharded op: ('shard', node), ('slice', node),
        ('bcast', node) or None (incompatible)."""
        if not isinstance(arg, Node):
            return ("const", arg)
        if arg in self.sharded:
            s = self.sharded[arg]
            if (s.group, s.rows, s.world) != (ref.group, ref.rows, ref.world) or _lead_of(s.shape, len(out_shape)) \
                    != tuple(out_shape[:-1]):
                return None
            return ("shard", arg)
        v = m.val(arg)
        if v is None:
            return None
        shape = tuple(v.shape)
        if not all(isinstance(d, int) for d in shape):
            return None
        lead = _lead_of(shape, len(out_shape))
        if len(shape) <= 1 or all(d == 1 for d in lead):
            return ("bcast", arg)
        if lead == tuple(out_shape[:-1]) and self.assume_replicated:
            return ("slice", arg)
        return None

    def _row_local(self, node: Node) -> Optional[Tuple[str, _Shard]]:
        """('pointwise' | 'view' | 'expand' | 'reduce' | 'var_mean' | 'getitem', a sharded input) when ``node`` can
        run on the rows of its sharded inputs, else None."""
        ins = [a for a in node.all_input_nodes if a in self.sharded]
        ref = self.sharded[ins[0]]
        out = m.val(node)
        target = node.target
        if target is operator.getitem:
            parent = node.args[0]
            return ("getitem", ref) if parent in self.sharded and m.is_call(parent, _VAR_MEAN) else None
        if not isinstance(out, torch.Tensor) and target is not _VAR_MEAN:
            return None
        if target is _VAR_MEAN:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            nd = len(ref.shape)
            if (len(node.args) == 2 and node.kwargs.get("keepdim") and dims is not None and len(dims) == 1
                    and dims[0] % nd == nd - 1 and node.args[0] in self.sharded
                    and set(node.kwargs) <= {"keepdim", "correction"}):
                return ("var_mean", ref)
            return None
        shape = tuple(out.shape)
        if not shape or not all(isinstance(d, int) for d in shape) or math.prod(shape[:-1]) != ref.rows:
            return None
        schema = getattr(target, "_schema", None)
        if schema is None or schema.is_mutable:
            return None
        if m.is_call(node, m.VIEW_OPS):
            return ("view", ref) if shape[-1] == ref.shape[-1] else None
        if m.is_call(node, _EXPAND):
            return ("expand", ref) if tuple(shape[:-1]) == ref.lead and len(shape) == len(ref.shape) else None
        if m.is_call(node, _LAST_DIM_REDUCTIONS):
            dims = node.args[1] if len(node.args) > 1 else None
            keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            nd = len(ref.shape)
            if (node.args[0] in self.sharded and isinstance(dims, (list, tuple)) and len(dims) == 1
                    and dims[0] % nd == nd - 1 and keepdim and set(node.kwargs) <= {"keepdim", "dtype"}):
                return ("reduce", ref)
            return None
        tags = getattr(target, "tags", ())
        if torch.Tag.pointwise not in tags or torch.Tag.nondeterministic_seeded in tags:
            return None
        if set(node.kwargs) - {"memory_format", "dtype", "alpha", "rounding_mode", "approximate"}:
            return None
        if node.kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
            return None
        for arg in list(node.args) + list(node.kwargs.values()):
            if isinstance(arg, (list, tuple)) and any(isinstance(a, Node) for a in arg):
                return None
            if isinstance(arg, Node) and self._operand(arg, shape, ref) is None:
                return None
        return ("pointwise", ref)

    def _row_sum(self, node: Node) -> Optional[Tuple[_Shard, set]]:
        """The sharded input of a ``sum`` over every row dim (a norm weight's gradient) and the summed dims, else
        None."""
        if not m.is_call(node, _ROW_SUMS) or not isinstance(node.args[0], Node) or node.args[0] not in self.sharded:
            return None
        if any(isinstance(a, Node) for a in node.args[1:]) or set(node.kwargs) - {"dtype"}:
            return None
        s = self.sharded[node.args[0]]
        nd = len(s.shape)
        dims = list(range(nd)) if m.is_call(node, m.aten.sum.default) else node.args[1]
        if dims is None or len(dims) == 0:
            dims = list(range(nd))
        dims = {d % nd for d in dims}
        if not all(d in dims for d, size in enumerate(s.lead) if size > 1):
            return None
        return s, dims

    # -- the walk -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node in self.sources:
                self._source(self.sources[node])
                continue
            ins = [a for a in node.all_input_nodes if a in self.sharded]
            if not ins:
                continue
            if node.op == "call_function" and not any(a in self.confined for a in ins):
                kind = self._row_local(node)
                if kind is not None:
                    self._shard(node, *kind)
                    continue
                row_sum = self._row_sum(node)
                if row_sum is not None:
                    self._partial_sum(node, *row_sum)
                    continue
            for a in ins:
                self.needs_full.setdefault(a, []).append(node)
                if self.emit:
                    with self.graph.inserting_before(node):
                        node.replace_input_with(a, self._gather(a))

    def _source(self, src: _Source) -> None:
        shard = _Shard(None, src.shape, src.rows, src.group, src.world, src.rank)
        if self.emit:
            with self.graph.inserting_before(src.wait):
                flat = src.operand if len(src.shape) == 2 else self._call(
                    m.aten.reshape.default, (src.operand, [src.rows, src.shape[-1]]))
                rs = self._call(m.REDUCE_SCATTER, (flat, src.reduce_op, src.world, src.group))
                rs.meta[m.INSERTED_BY] = PATTERN
                shard.node = self._call(m.WAIT, (rs,))
            self.dead += [src.wait, src.all_reduce]
        self.sharded[src.wait] = shard
        self.origins[src.wait] = frozenset((src.wait,))

    def _shard(self, node: Node, kind: str, ref: _Shard) -> None:
        v = node.meta["val"]  # var_mean: (var, mean), both [..., 1] (m.val gives tensors only)
        shape = tuple((v[0] if kind == "var_mean" else v).shape)
        shard = _Shard(None, shape, ref.rows, ref.group, ref.world, ref.rank)
        if self.emit:
            with self.graph.inserting_before(node):
                shard.node = self._emit_local(node, kind, shape, ref)
            m.copy_debug_meta(shard.node, node)
            self.dead.append(node)
        self.sharded[node] = shard
        self.origins[node] = frozenset().union(*(self.origins[a] for a in node.all_input_nodes if a in self.sharded))
        if kind in ("pointwise", "expand", "reduce"):
            self.rows_saved[node] = ref.rows * shape[-1] * _itemsize(node) * (ref.world - 1) // ref.world

    def _emit_local(self, node: Node, kind: str, shape: Tuple[int, ...], ref: _Shard) -> Node:
        x = node.args[0]
        per = ref.rows // ref.world
        if kind == "getitem":
            return self._call(operator.getitem, (self.sharded[x].node, node.args[1]))
        if kind == "var_mean":
            return self._call(_VAR_MEAN, (self.sharded[x].node, [1]), dict(node.kwargs))
        if kind == "view":
            return self.sharded[x].node
        if kind == "expand":
            return self._call(_EXPAND, (self.sharded[x].node, [per, shape[-1]]))
        if kind == "reduce":
            return self._call(node.target, (self.sharded[x].node, [1], True), dict(node.kwargs))

        def local(arg):
            if not isinstance(arg, Node):
                return arg
            how, _ = self._operand(arg, shape, ref)
            if how == "shard":
                return self.sharded[arg].node
            v_shape = tuple(m.val(arg).shape)
            if how == "slice":
                return self._slice(arg, ref.rows, ref.world, ref.rank, v_shape[-1])
            # Broadcast over every row dim: [.., 1, last] -> [1, last]; a [last] vector or a scalar as it is.
            if len(v_shape) > 2:
                return self._call(m.aten.reshape.default, (arg, [1, v_shape[-1]]))
            return arg

        args = tuple(local(a) for a in node.args)
        kwargs = {k: local(v) for k, v in node.kwargs.items()}
        return self._call(node.target, args, kwargs)

    def _partial_sum(self, node: Node, s: _Shard, dims: set) -> None:
        self.row_sums += 1
        if not self.emit:
            return
        out_shape = list(m.val(node).shape)
        with self.graph.inserting_before(node):
            local_dims = [0, 1] if len(s.shape) - 1 in dims else [0]
            part = self._call(m.aten.sum.dim_IntList, (s.node, local_dims, True), dict(node.kwargs))
            part = self._call(m.aten.reshape.default, (part, out_shape))
            ar = self._call(ALL_REDUCE, (part, "sum", s.group))
            total = self._call(m.WAIT, (ar,))
        m.copy_debug_meta(part, node)
        node.replace_all_uses_with(total)
        self.dead.append(node)

    # -- the cost rule --------------------------------------------------------------------------------------------
    def cost(self) -> Tuple[int, float, Dict[Node, float]]:
        """The bytes of the all-gathers no matmul hides, and the plan's cost: those bytes less ``_ROW_WORK_CREDIT`` of
        the row-wise work it saves, in all and per source (for what is computed from that source alone)."""
        exposed, total, by_source = 0, 0.0, {}

        def charge(original: Node, amount: float) -> None:
            nonlocal total
            total += amount
            if len(self.origins[original]) == 1:
                (src,) = self.origins[original]
                by_source[src] = by_source.get(src, 0.0) + amount

        for original, readers in self.needs_full.items():
            if not self._gather_is_hidden(original, readers):
                s = self.sharded[original]
                size = s.rows * s.shape[-1] * _itemsize(original)
                exposed += size
                charge(original, size)
        for original, saved in self.rows_saved.items():
            charge(original, -_ROW_WORK_CREDIT * saved)
        return exposed, total, by_source

    def _gather_is_hidden(self, original: Node, readers: List[Node]) -> bool:
        """A matmul reads the gathered ``original`` as its first operand and the all-gather pass will fuse them (on a
        GPU, the cost model does not veto that all_gather_matmul)."""
        matmuls = [mm for r in readers for mm in _matmuls_fed(original, r)]
        if not matmuls:
            return False
        if self.not_worth_fusing is None:
            return True
        from fluxinductor.passes.all_gather_matmul import PATTERN as AG_PATTERN

        s, v = self.sharded[original], m.val(original)
        n = s.world * sum(m.val(mm).shape[-1] for mm in matmuls)
        return self.not_worth_fusing(AG_PATTERN, v.device, s.world, s.rows, s.shape[-1], n, v.dtype) is None


def _itemsize(node: Node) -> int:
    v = m.val(node)
    if isinstance(v, (tuple, list)):
        v = v[0]
    return v.element_size() if isinstance(v, torch.Tensor) else 4


def _matmuls_fed(original: Node, reader: Node, depth: int = 0) -> List[Node]:
    """The matmuls reading the gathered ``original`` as their first operand through ``reader`` (itself one, or
    reshapes and a dtype cast leading to them): the all-gather pass can fuse that gather with them."""
    operands = m.matmul_operands(reader)
    if operands is not None:
        return [reader] if operands[0] is original else []
    if depth < 4 and (m.is_call(reader, m.VIEW_OPS) or m.is_call(reader, m.CONVERT)) and reader.args[0] is original:
        return [mm for u in reader.users for mm in _matmuls_fed(reader, u, depth + 1)]
    return []


def _choose_plan(graph: Graph, sources: Dict[Node, _Source], fake_mode, assume_replicated: bool,
                 not_worth_fusing: Optional[Callable[..., Optional[str]]]) -> Tuple[FrozenSet[Node], int]:
    """Which sources to confine (their all-gather right after the reduce-scatter), and the exposed bytes then.

    Sharding a source's rows on through row-wise ops saves (w-1)/w of their work but may gather several tensors where
    one would do (a LayerNorm's backward reads the gradient and saved activations a graph cannot slice), and an exposed
    NVLink byte costs more than an HBM byte saved.  A plan's cost is its exposed all-gather bytes less
    ``_ROW_WORK_CREDIT`` times the bytes its row-wise ops no longer compute (so a norm's small statistics, gathered
    for the backward, do not outweigh running the norm on 1/w of the rows).  Each source is confined where the far
    plan costs more for what is computed from it alone than the confined plan does (what is computed from several
    sources is left out of that count), and the plan actually taken is the cheapest of those (far, per-source, all
    confined), the farther on a tie.  Confining every source exposes at most one gather per all-reduce, half the
    all-reduce's traffic, so some plan always takes communication off the critical path."""
    def dry_run(confined: FrozenSet[Node]) -> Tuple[int, float, Dict[Node, float]]:
        planner = _Planner(graph, sources, fake_mode, emit=False, assume_replicated=assume_replicated,
                           confined=confined, not_worth_fusing=not_worth_fusing)
        planner.run()
        return planner.cost()

    everything = frozenset(sources)
    far, near = dry_run(frozenset()), dry_run(everything)
    mixed = frozenset(s for s in sources if far[2].get(s, 0.0) > near[2].get(s, 0.0))
    plans = [(far[1], 0, far[0], frozenset()), (near[1], 2, near[0], everything)]
    if mixed and mixed != everything:
        exposed, cost, _ = dry_run(mixed)
        plans.append((cost, 1, exposed, mixed))
    _, _, exposed, confined = min(plans, key=lambda p: p[:2])
    return confined, exposed


def split_all_reduce(graph: Graph, group_allowed: Callable[[str], bool],
                     not_worth_fusing: Optional[Callable[..., Optional[str]]] = None,
                     assume_replicated: bool = False, fuse_sums: bool = True) -> int:
    """Rewrite the graph's candidate all-reduces (see the module docstring) in place; returns how many.
    ``assume_replicated``: full tensors of the same rows may be sliced to this rank's rows (see the module
    docstring for what that assumes)."""
    from fluxinductor.passes.matmul_reduce_scatter import rewrite_matmul_all_reduce

    reduces = [n for n in graph.nodes if m.is_call(n, ALL_REDUCE)]
    if not reduces:
        return 0
    fake_mode = m.fake_mode_of(graph)
    sources: Dict[Node, _Source] = {}
    whole = 0
    for ar in reduces:
        try:
            if fake_mode is None:
                raise Skip("no fake mode in graph metadata", ar.name)
            src = _match_source(ar, group_allowed, not_worth_fusing, fuse_sums)
            if isinstance(src, _Source):
                sources[src.wait] = src
                continue
            described = rewrite_matmul_all_reduce(src.match, PATTERN)
            record_fused(PATTERN, f"{ar.name}: {src.why}, matmul_all_reduce: {described}")
            whole += 1
        except Skip as s:
            record_skip(PATTERN, s.reason, s.detail or ar.name)
    if not sources:
        return whole
    confined, exposed = _choose_plan(graph, sources, fake_mode, assume_replicated, not_worth_fusing)
    planner = _Planner(graph, sources, fake_mode, emit=True, assume_replicated=assume_replicated, confined=confined)
    try:
        planner.run()
    except Exception as e:  # the graph is half rewritten: no correct way on but to stop, saying how to avoid it
        raise RuntimeError(f"fluxinductor all_reduce_split failed while rewriting ({type(e).__name__}: {e}); "
                           "split_all_reduce=\"off\" leaves all-reduces alone") from e
    m.erase_dead(graph, planner.dead)
    pos = m.positions(graph)
    leftover = [n.name for n in planner.dead if n in pos]
    if leftover:  # every replaced node must be unread now; anything else is a bug in the planner
        raise RuntimeError(f"fluxinductor all_reduce_split left nodes with readers: {leftover}")
    for src in sources.values():
        record_fused(PATTERN, f"{src.all_reduce.name}: {src.shape} over {src.world} ranks"
                              f"{', gathered at once' if src.wait in confined else ''}; graph: "
                              f"{len(planner.sharded)} values sharded, {len(planner.gathered)} gathered "
                              f"({exposed} B exposed), {planner.row_sums} row sums")
    return len(sources) + whole
