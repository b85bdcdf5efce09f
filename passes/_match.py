"""Helpers shared by the two rewrites: op handles, shape facts from ``meta['val']``, chunk recognition,
node placement and fake-mode evaluation of new nodes.

Nothing here changes a graph except :func:`hoist_before` and :func:`erase_dead`, which are only called
once a match has been accepted.
"""

from __future__ import annotations

import operator
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

# A size as a FakeTensor holds it: an int, or a SymInt under dynamic shapes.
Size = Union[int, torch.SymInt]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
WAIT = c10d.wait_tensor.default

# Reshapes keep the row-major order of the elements, whatever the strides of their input.  A chain of
# them ending in [M, K] is therefore the same tensor as ``x.reshape(M, K)``.
VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
TRANSPOSES = (aten.permute.default, aten.t.default, aten.transpose.int)
SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default)
SLICE = aten.slice.Tensor
CAT = aten.cat.default
MM = aten.mm.default
ADDMM = aten.addmm.default
CONVERT = torch.ops.prims.convert_element_type.default

# node.meta key naming the pass that put a collective into the graph (all_reduce_split's halves); the later passes
# report what they do with it apart from the user's own collectives (fluxinductor.log.collective_inserted_by).
INSERTED_BY = "fluxinductor_inserted_by"


def inserted_by(node: Node) -> Optional[str]:
    """The pass that inserted the collective ``node``, or None for one of the user's graph."""
    return node.meta.get(INSERTED_BY)


def each_collective(collectives: Iterable[Node]) -> Iterator[Node]:
    """Yield each collective with what is recorded meanwhile (fused, skipped) attributed to the pass that inserted it,
    if one did, so that rewrite_stats() counts each of the user's collectives once."""
    from fluxinductor.log import collective_inserted_by

    for node in collectives:
        with collective_inserted_by(inserted_by(node)):
            yield node


class Skip(Exception):
    """A match that must not be rewritten; ``str(self)`` is the reason recorded in the log."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


def is_call(node: object, targets) -> bool:
    if not isinstance(node, Node) or node.op != "call_function":
        return False
    if isinstance(targets, tuple):
        return node.target in targets
    return node.target == targets


def val(node: Node) -> Optional[torch.Tensor]:
    """The FakeTensor the graph recorded for ``node``, or None."""
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def static_shape(node: Node, what: str) -> Tuple[int, ...]:
    """``node``'s shape as plain ints; raises :class:`Skip` for a missing val or a symbolic size."""
    shape = shape_of(node, what)
    if not all(isinstance(s, int) for s in shape):
        raise Skip("symbolic shape", f"{what} {node.name} has shape {shape}")
    return shape


def shape_of(node: Node, what: str) -> Tuple[Size, ...]:
    """``node``'s shape, symbolic sizes included; raises :class:`Skip` for a missing val.

    Symbolic sizes are only ever compared with :func:`known_equal` and friends: a plain ``==`` on them would
    add a guard, and a pass running on an already-guarded graph must not add any.
    """
    v = val(node)
    if v is None:
        raise Skip("no tensor metadata", f"{what} {node.name} has no meta['val']")
    return tuple(v.shape)


def known_equal(a: Size, b: Size) -> bool:
    """``a == b``, true only where it holds for every value the graph's symbols may take."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def same_shape(x: Sequence[Size], y: Sequence[Size]) -> bool:
    return len(x) == len(y) and all(known_equal(a, b) for a, b in zip(x, y))


def known_divisible(size: Size, world: int) -> bool:
    return known_equal(size % world, 0)


def known_not_divisible(size: Size, world: int) -> bool:
    """``size`` provably leaves a remainder over ``world``; an unknown symbolic size does not."""
    if isinstance(size, int):
        return size % world != 0
    return statically_known_true(size % world != 0)


def reshape_arg(shape: Sequence[Size]) -> Optional[List[int]]:
    """``shape`` as a reshape argument of plain ints: a symbolic size becomes -1 (reshape infers it from the
    element count); None if more than one size is symbolic."""
    symbolic = [i for i, s in enumerate(shape) if not isinstance(s, int)]
    if len(symbolic) > 1:
        return None
    return [-1 if i in symbolic else s for i, s in enumerate(shape)]


def rows_first(shape: Sequence[Size], dim: int) -> Optional[Tuple[List[int], List[int], List[int]]]:
    """How to lay ``dim`` of an N-D tensor ``shape`` out first, so that its slices are whole row blocks of the
    [rows, last] matrix the fused ops run on: ``(perm, inverse, rest)``, where ``permute(x, perm)`` has ``dim``
    first and the other dims in their order, ``permute(y, inverse)`` undoes it, and ``rest`` lists the dims (of
    ``shape``) that follow ``dim`` in the permuted tensor but for the last: a rows-first result reshapes back to
    ``[-1] + [size of d for d in rest] + [its last dim]`` (see :func:`size_arg`).

    None where no permutation is needed: every dim before ``dim`` has size 1, so the order of the elements is
    already ``dim``-major.  With [B, S, H] sharded on S and B > 1, the permutes placed in the graph around the op
    let inductor write the operand in that order in the kernel that produces it, and read the result in it in
    the kernel that consumes it, instead of the op copying both (16-34% of the GEMM's time on MLP shapes, one
    H200: benchmarks/probe_layout.py)."""
    if dim == 0 or all(known_equal(s, 1) for s in shape[:dim]):
        return None
    perm = [dim] + [i for i in range(len(shape)) if i != dim]
    inverse = [perm.index(i) for i in range(len(shape))]
    return perm, inverse, perm[1:-1]


# The fused ops keep a batch-major layout (no permutes) when each rank's blocks of rows (S/w x the dims after S but the
# last) are whole tiles of their kernels: the AG+GEMM gathers [B, S/w, H] shards into [B, S, H] in place
# (csrc/include/fluxinductor/ag_gemm/scheduler.cuh, batch_rows), the GEMM+RS reads each owner's blocks of [B, S, K]
# (csrc/include/fluxinductor/common/blocked_rows.cuh).  The smallest tile M of the variants they pick on their own is
# 128.
BATCH_MAJOR_ROWS = 128


def batch_major(shape: Sequence[Size], dim: int) -> bool:
    """Whether the AG+GEMM of a shard of ``shape`` gathered on ``dim`` (a dim after a batch dim > 1, so that
    :func:`rows_first` would permute), or the GEMM+RS whose result has ``shape``, scattered on ``dim``, runs on the
    operand as it is: each rank's blocks of rows, prod(shape[dim:-1]), are known whole multiples of
    BATCH_MAJOR_ROWS.  Where the fused kernel still cannot keep that layout at run time (a forced
    variant of larger tiles, CUDA graph capture), the op permutes itself (fluxinductor.dispatch)."""
    rows = 1
    for s in shape[dim:-1]:
        if not isinstance(s, int):
            return False
        rows *= s
    return rows % BATCH_MAJOR_ROWS == 0


def size_arg(graph: Graph, node: Node, dim: int) -> Union[int, Node]:
    """Size ``dim`` of ``node`` as a reshape argument: the int, or (symbolic) a new ``sym_size`` node at the
    graph's insertion point."""
    size = val(node).shape[dim]
    if isinstance(size, int):
        return size
    sym = graph.call_function(aten.sym_size.int, (node, dim))
    sym.meta["val"] = size
    return sym


def view_size_args(node: Node, erased: Iterable[Node]) -> Optional[List[object]]:
    """The size list of the reshape ``node`` (ints and nodes computing symbolic sizes), for a new reshape to the
    same shape where :func:`reshape_arg` cannot express it (two symbolic sizes); None if ``node`` is not a reshape
    or a size is computed from one of ``erased`` (the new reshape would keep it alive)."""
    if not is_call(node, VIEW_OPS) or not isinstance(node.args[1], (list, tuple)):
        return None
    erased, stack, seen = set(erased), [a for a in node.args[1] if isinstance(a, Node)], set()
    while stack:
        n = stack.pop()
        if n in erased:
            return None
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return list(node.args[1])


def _arg_is(arg: object, size: Size) -> bool:
    """Whether a graph argument (an int, or a node computing a symbolic size) is known to equal ``size``."""
    if isinstance(arg, Node):
        arg = arg.meta.get("val")
    if isinstance(arg, bool) or not isinstance(arg, (int, torch.SymInt)):
        return False
    return known_equal(arg, size)


def check_float(node: Node, what: str) -> torch.dtype:
    v = val(node)
    if v is None:
        raise Skip("no tensor metadata", f"{what} {node.name} has no meta['val']")
    if not v.dtype.is_floating_point:
        raise Skip("non-floating dtype", f"{what} {node.name} is {v.dtype}")
    return v.dtype


def numel(shape: Sequence[Size]) -> Size:
    n = 1
    for s in shape:
        n *= s
    return n


def ordered_chunks(parts: Sequence[object], world: int) -> Optional[Tuple[Node, int, List[Node]]]:
    """If ``parts`` are the ``world`` equal, in-order chunks of one tensor along one dim, return
    ``(source, dim, chunk_nodes)``; else None.

    Recognized chunk forms (what ``torch.chunk`` / ``torch.narrow`` become after decomposition):
    ``getitem(split(source, size, dim), i)``, ``getitem(split_with_sizes(source, sizes, dim), i)`` and
    ``slice(source, dim, i * size, (i + 1) * size)``.  ``chunk_nodes`` are the nodes between source and
    the parts' consumer (split, getitems or slices), for erasing later.
    """
    if len(parts) != world or not all(isinstance(p, Node) for p in parts):
        return None
    first = parts[0]
    if first.target is operator.getitem and is_call(first.args[0], SPLIT_OPS):
        split = first.args[0]
        source = split.args[0]
        src_val = val(source)
        if src_val is None:
            return None
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        dim %= src_val.dim()
        size = src_val.shape[dim]
        if not known_divisible(size, world):
            return None
        chunk = size // world
        sizes = split.args[1]
        if split.target == aten.split.Tensor:
            if not _arg_is(sizes, chunk):
                return None
        elif len(sizes) != world or not all(_arg_is(s, chunk) for s in sizes):
            return None
        for i, p in enumerate(parts):
            if p.target is not operator.getitem or p.args[0] is not split or p.args[1] != i:
                return None
        return source, dim, [split] + list(parts)
    if is_call(first, SLICE):
        source = first.args[0]
        src_val = val(source)
        if src_val is None:
            return None
        dim = first.args[1] % src_val.dim()
        size = src_val.shape[dim]
        if not known_divisible(size, world):
            return None
        chunk = size // world
        for i, p in enumerate(parts):
            if not is_call(p, SLICE) or p.args[0] is not source or len(p.args) < 4:
                return None
            step = p.args[4] if len(p.args) > 4 else 1
            if p.args[1] % src_val.dim() != dim or step != 1:
                return None
            if not (_arg_is(p.args[2], i * chunk) and _arg_is(p.args[3], (i + 1) * chunk)):
                return None
        return source, dim, list(parts)
    return None


def cat_dim(cat: Node) -> int:
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    return dim % val(cat).dim()


def only_user(node: Node) -> Optional[Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def positions(graph: Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def ancestors_after(node: Node, limit: int, pos: dict) -> List[Node]:
    """``node`` and its ancestors that sit at or after graph position ``limit``."""
    seen, stack, found = set(), [node], []
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, Node) or pos[n] < limit:
            continue
        seen.add(n)
        found.append(n)
        stack.extend(n.all_input_nodes)
    return found


def hoist_before(anchor: Node, nodes: Iterable[Node], pos: dict) -> None:
    """Move ``nodes`` (already closed under their inputs that sit after ``anchor``) before ``anchor``,
    keeping their relative order."""
    for n in sorted(set(nodes), key=pos.__getitem__):
        anchor.prepend(n)


def is_pure(node: Node) -> bool:
    if node.op != "call_function":
        return node.op == "get_attr"
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    if schema.is_mutable:
        return False
    return node.target.namespace in ("aten", "prims") and not node.is_impure()


# Python callables that dynamic-shape graphs use to compute sizes (``mul = s0 * 2``); they read no tensor.
_SIZE_FUNCTIONS = frozenset(getattr(torch, f) for f in ("sym_float", "sym_int", "sym_max", "sym_min", "sym_not",
                                                          "sym_ite", "sym_sum") if hasattr(torch, f))


def _is_size_arithmetic(node: Node) -> bool:
    """``node`` computes a size from sizes (``operator.mul(s0, 2)``, ``torch.sym_max``): it cannot mutate a tensor."""
    target = node.target
    if getattr(target, "__module__", None) not in ("_operator", "operator", "math") and target not in _SIZE_FUNCTIONS:
        return False
    return not any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes)


def mutation_between(start: Node, end: Node) -> Optional[Node]:
    """The first node strictly between ``start`` and ``end`` (graph order) that may mutate a tensor.

    A rewrite that moves a read from ``start``'s position to ``end``'s must not cross one.
    """
    node = start.next
    while node is not end and node.op != "root":
        if node.op == "call_function":
            schema = getattr(node.target, "_schema", None)
            if schema is None:
                # Higher-order ops and Python callables: only getitem and size arithmetic are known to be harmless.
                if node.target is not operator.getitem and not _is_size_arithmetic(node):
                    return node
            elif schema.is_mutable:
                return node
        node = node.next
    return None


def erase_dead(graph: Graph, nodes: Iterable[Node]) -> None:
    """Erase those of ``nodes`` that have no users, latest first (so a chain goes in one call)."""
    pos = positions(graph)
    for n in sorted(set(nodes), key=lambda n: pos.get(n, -1), reverse=True):
        if n in pos and not n.users:
            graph.erase_node(n)


def fake_mode_of(graph: Graph):
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    return detect_fake_mode(vals)


def set_val(node: Node, fake_mode, fn: Callable[[], object]) -> None:
    """Set ``node.meta['val']`` to ``fn()`` evaluated under the graph's fake mode."""
    with fake_mode:
        node.meta["val"] = fn()


def call_view(graph: Graph, fake_mode, target, x: Node, arg: list) -> Node:
    """A new ``target(x, arg)`` node (a permute or a reshape, inserted at the graph's insertion point) with its
    fake value; ``arg`` may hold size nodes (:func:`size_arg`)."""
    node = graph.call_function(target, (x, arg))
    set_val(node, fake_mode, lambda: target(val(x), [a.meta["val"] if isinstance(a, Node) else a for a in arg]))
    return node


def call_contiguous(graph: Graph, fake_mode, x: Node) -> Node:
    """A new ``clone(x, memory_format=contiguous)`` node: the graph's other nodes were traced with a contiguous
    tensor there (an ``aten.view`` of it would fail on a permuted one).  Inductor lowers the clone to a
    pointwise read that it fuses into the kernels consuming it; it copies only where a consumer needs memory
    (an extern kernel, a graph output)."""
    node = graph.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
    set_val(node, fake_mode, lambda: val(x).clone(memory_format=torch.contiguous_format))
    return node


def copy_debug_meta(new: Node, old: Node) -> None:
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in old.meta:
            new.meta[key] = old.meta[key]


def matmul_operands(node: Node) -> Optional[Tuple[Node, Node, Optional[Node]]]:
    """``(a, weight, bias)`` of ``mm(a, weight)`` or ``addmm(bias, a, weight)`` with alpha = beta = 1;
    None for anything else (an addmm with scaling is not ``a @ weight + bias``)."""
    if is_call(node, MM) and not node.kwargs:
        return node.args[0], node.args[1], None
    if is_call(node, ADDMM) and len(node.args) == 3:
        if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1:
            return None
        return node.args[1], node.args[2], node.args[0]
    return None


def check_weight_and_bias(weight: Node, bias: Optional[Node], k: int, dtype: torch.dtype, what: str) -> int:
    """Checks a matmul's weight [K, N] and bias [N]; returns N.  Raises :class:`Skip`."""
    w_shape = static_shape(weight, "weight")
    if len(w_shape) != 2 or w_shape[0] != k:
        raise Skip("unexpected weight shape", f"{what}: weight {w_shape}, K={k}")
    if val(weight).dtype != dtype:
        raise Skip("mixed dtypes", f"{what}: weight {val(weight).dtype}, activation {dtype}")
    n = w_shape[1]
    if bias is not None:
        if not isinstance(bias, Node):
            raise Skip("non-tensor bias", what)
        b_shape = static_shape(bias, "bias")
        # addmm broadcasts a [M, N] or [1, N] bias too; the fused op takes only a per-column bias.
        if b_shape != (n,):
            raise Skip("bias is not a [N] vector", f"{what}: bias {b_shape}")
        if val(bias).dtype != dtype:
            raise Skip("mixed dtypes", f"{what}: bias {val(bias).dtype}, activation {dtype}")
    return n
