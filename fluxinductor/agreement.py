"""Agreement across ranks on a fused op's call, checked once per call signature.

A fused op's collective assumes that every rank of the group calls it with the same shapes, dtypes and arguments
(tensor parallelism: each rank holds a shard of the same size), under the same settings that choose its path (the
dispatch mode: a fused kernel on one rank and the decomposition's collective on another never meet).  A rank that does
not (rows that differ per rank, fp32 on one rank and fp64 on another, the same bytes in another shape, another
``FLUXINDUCTOR_DISPATCH``) makes the collective abort on one rank while its peers return a result, or return a silently
wrong one everywhere.  So the first call of each (op, signature, group) exchanges a small descriptor of the call (the
op's name, its ``fields``) across the group (one ``all_gather_object``), and raises the same
:class:`RanksDisagreeError` on every rank, naming the ranks and what differs: a field, or the op itself (ranks at
different fused ops, e.g. compiled with different ``split_all_reduce``).  A signature the group agreed on is
remembered: later calls cost a dict lookup and no communication.

A peer that never joins a collective of the op (it exited, or it runs other code) fails the collective on this rank
when the transport notices (a closed connection at once, otherwise the process group's timeout); that error is raised
as :class:`PeerFailureError` (:func:`peer_failure`), which names the op, the group, this rank and the peers, and says
what to do.  The decomposition's collectives are wrapped the same way (:mod:`fluxinductor.ops`).

What this does not catch: a rank that calls with a new signature while its peers repeat one the group agreed on
(they skip the exchange it joins, and the collectives then mismatch as plain ones would); a per-call check would cost
a collective on every call.

A call whose local checks fail (a weight dtype that differs from the input's, a bias of the wrong shape) still takes
part in the exchange on its first call, so that its peers raise as well (naming the rank that refused and why) rather
than wait in a collective it never joins; the failing rank raises its own error.

Under CUDA graph capture there is no exchange (a collective there would be recorded into the graph): the signature
must have been agreed on by an eager call before (the warm-up every capture has).  A captured call of a signature
never seen eagerly is not checked; that is logged once per signature, since refusing it would fail a program whose
ranks may well agree.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from fluxinductor.log import logger

# Signatures the group agreed on: (op, group name, the descriptor's values).
_agreed: set = set()
_MAX_AGREED = 4096
_unchecked_under_capture: set = set()
# Changes with every :func:`forget`: what is keyed by it (the dispatcher's replays) was agreed on before.
generation = 0


class RanksDisagreeError(ValueError):
    """The ranks of a group called a fused op with different shapes, dtypes, arguments or settings, or called different
    fused ops (raised on every rank)."""


class PeerFailureError(getattr(dist, "DistError", RuntimeError)):
    """A collective of a fused op failed on this rank because a peer did not take part in it (it exited, hangs, or
    runs other code); the call has no result.  The original error is its ``__cause__``."""


def peer_failure(op: str, group: dist.ProcessGroup, group_name: str, what: str, error: BaseException
                 ) -> PeerFailureError:
    """The :class:`PeerFailureError` for ``error``, raised by ``what`` (e.g. ``"its all-gather"``) of ``op`` on
    ``group``: the group, this rank, the peers that could have failed it, the likely cause where the transport's
    message tells it (a closed connection: a peer exited; a timeout: a peer did not join), and what to do."""
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    peers = [r for r in ranks if r != me]
    suspects = _ranks(peers) if len(peers) == 1 else "one of " + _ranks(peers)
    text = str(error)
    lowered = text.lower()
    if any(s in lowered for s in ("closed by peer", "reset by peer", "broken pipe", "connection refused",
                                  "connection closed")):
        cause = f"{suspects} exited (crashed or was killed) before or during it"
    elif "timed out" in lowered or "timeout" in lowered:
        cause = (f"{suspects} did not join it within the process group's timeout: it is stuck, or it runs other code "
                 "(it did not call this op here)")
    else:
        cause = f"it failed ({type(error).__name__}); {suspects} may have exited or run other code"
    return PeerFailureError(
        f"fluxinductor::{op} on group {group_name!r} (ranks {','.join(map(str, ranks))}), rank {me}: {what} did not "
        f"complete: {cause}. The call has no result. What to do: read the error or log of {suspects} first; every rank "
        "of the group must call the same fused ops in the same order, with the same settings and compile options "
        "(FLUXINDUCTOR_DISPATCH, split_all_reduce); the group cannot be used after this: end the job "
        f"(destroy the process group) and restart it. The collective's error: {text}")


def forget() -> None:
    """Forget the agreed signatures (tests)."""
    global generation
    _agreed.clear()
    _unchecked_under_capture.clear()
    generation += 1


def check(op: str, group: dist.ProcessGroup, group_name: str, fields: Dict[str, object],
          local_check: Callable[[], None]) -> None:
    """On the first call of the signature ``fields`` (name -> value; every rank must pass equal values), run
    ``local_check`` (raises ``ValueError`` on bad input, before any collective) and check that every rank of ``group``
    agrees.  ``fields`` must hold everything ``local_check`` reads: a signature that passed once is not checked again.

    Raises the local error on the rank whose input failed, and :class:`RanksDisagreeError` on every other rank (and on
    every rank where the descriptors differ)."""
    key = (op, group_name, tuple(fields.values()))
    if key in _agreed:  # its first call passed ``local_check``, and ``fields`` hold all that the check reads
        return
    try:
        local_check()
        local_error: Optional[ValueError] = None
    except ValueError as e:
        local_error = e
    world = group.size()
    if world == 1:
        if local_error is not None:
            raise local_error
        _remember(key)
        return
    if _capturing():
        if local_error is not None:
            raise local_error
        if key not in _unchecked_under_capture:
            _unchecked_under_capture.add(key)
            logger.warning("fluxinductor::%s: not checked for agreement across ranks (%s): CUDA graph capture before "
                           "an eager call of the signature; run the graph once eagerly (a warm-up) to check it", op,
                           _describe(fields))
        return
    descriptors: List[Optional[Tuple[str, Dict[str, object], Optional[str]]]] = [None] * world
    try:
        dist.all_gather_object(descriptors, (op, fields, None if local_error is None else str(local_error)),
                               group=group)
    except RuntimeError as e:
        raise peer_failure(op, group, group_name, "the exchange of the call's description (its first call)", e) from e
    ranks = dist.get_process_group_ranks(group)
    if local_error is not None:
        raise local_error
    refused = [(ranks[i], why) for i, (_, _, why) in enumerate(descriptors) if why is not None]
    if refused:
        raise RanksDisagreeError(
            f"fluxinductor::{op} on group {group_name!r}: "
            + "; ".join(f"rank {r} refused the call: {why}" for r, why in refused)
            + f" (this rank, {dist.get_rank()}, had no error; every rank stops here rather than wait for it)")
    if any(d[0] != op for d in descriptors):
        raise RanksDisagreeError(
            f"fluxinductor: the ranks of group {group_name!r} called different fused ops at the same point: "
            + _by_value([d[0] for d in descriptors], ranks) + ". Every rank must call the same fused ops in the same order (the same model, compiled with "
            "the same options, e.g. split_all_reduce, and the same settings).")
    differences = _differences([d[1] for d in descriptors], ranks)
    if differences:
        raise RanksDisagreeError(
            f"fluxinductor::{op}: the ranks of group {group_name!r} called it with different inputs: "
            + "; ".join(differences)
            + ". Every rank must pass the same shapes, dtypes, layouts and arguments (each rank's shard of the same size) "
            "and run with the same settings.")
    _remember(key)


def _remember(key: tuple) -> None:
    if len(_agreed) >= _MAX_AGREED:
        _agreed.clear()
    _agreed.add(key)


def _capturing() -> bool:
    from fluxinductor.kernels import symm

    return symm.capturing()


def _differences(descriptors: List[Dict[str, object]], ranks: List[int]) -> List[str]:
    """``"<field>: rank 0 <value>, rank 1 <value>"`` for each field whose values differ, ranks grouped by value."""
    out = []
    for name in dict.fromkeys(name for d in descriptors for name in d):
        values = [d.get(name) for d in descriptors]
        if any(_show(v) != _show(values[0]) for v in values):
            out.append(f"{name}: " + _by_value(values, ranks))
    return out


def _by_value(values: List[object], ranks: List[int]) -> str:
    """``"rank 0 <value>, ranks 1,2 <value>"``: each rank's value, ranks grouped by value."""
    by_value: Dict[str, List[int]] = {}
    for rank, value in zip(ranks, values):
        by_value.setdefault(_show(value), []).append(rank)
    return ", ".join(f"{_ranks(rs)} {value}" for value, rs in by_value.items())


def _ranks(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _show(value: object) -> str:
    if isinstance(value, torch.Size):
        return str(list(value))
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return repr(value) if isinstance(value, str) else str(value)


def _describe(fields: Dict[str, object]) -> str:
    return ", ".join(f"{name} {_show(value)}" for name, value in fields.items())
