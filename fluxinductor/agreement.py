"""Agreement across ranks on a fused op's call, checked once per call signature.

A fused op's collective assumes that every rank of the group calls it with the same shapes, dtypes and arguments
(tensor parallelism: each rank holds a shard of the same size).  A rank that does not (rows that differ per rank, fp32
on one rank and fp64 on another, the same bytes in another shape) makes the collective abort on one rank while its
peers return a result, or return a silently wrong one everywhere.  So the first call of each (op, signature, group)
exchanges a small descriptor of the call across the group (one ``all_gather_object``), and raises the same
:class:`RanksDisagreeError` on every rank, naming the ranks and what differs.  A signature the group agreed on is
remembered: later calls cost a dict lookup and no communication.

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


class RanksDisagreeError(ValueError):
    """The ranks of a group called a fused op with different shapes, dtypes or arguments (raised on every rank)."""


def forget() -> None:
    """Forget the agreed signatures (tests)."""
    _agreed.clear()
    _unchecked_under_capture.clear()


def check(op: str, group: dist.ProcessGroup, group_name: str, fields: Dict[str, object],
          local_check: Callable[[], None]) -> None:
    """Run ``local_check`` (raises ``ValueError`` on bad input, before any collective) and, on the first call of the
    signature ``fields`` (name -> value; every rank must pass equal values), check that every rank of ``group`` agrees.

    Raises the local error on the rank whose input failed, and :class:`RanksDisagreeError` on every other rank (and on
    every rank where the descriptors differ)."""
    try:
        local_check()
        local_error: Optional[ValueError] = None
    except ValueError as e:
        local_error = e
    key = (op, group_name, tuple(fields.values()))
    if key in _agreed:
        if local_error is not None:  # not reached where ``fields`` hold all the local check reads
            raise local_error
        return
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
    descriptors: List[Optional[Tuple[Dict[str, object], Optional[str]]]] = [None] * world
    dist.all_gather_object(descriptors, (fields, None if local_error is None else str(local_error)), group=group)
    ranks = dist.get_process_group_ranks(group)
    if local_error is not None:
        raise local_error
    refused = [(ranks[i], why) for i, (_, why) in enumerate(descriptors) if why is not None]
    if refused:
        raise RanksDisagreeError(
            f"fluxinductor::{op} on group {group_name!r}: "
            + "; ".join(f"rank {r} refused the call: {why}" for r, why in refused)
            + f" (this rank, {dist.get_rank()}, had no error; every rank stops here rather than wait for it)")
    differences = _differences([d[0] for d in descriptors], ranks)
    if differences:
        raise RanksDisagreeError(
            f"fluxinductor::{op}: the ranks of group {group_name!r} called it with different inputs: "
            + "; ".join(differences)
            + ". Every rank must pass the same shapes, dtypes and arguments (each rank's shard of the same size).")
    _remember(key)


def _remember(key: tuple) -> None:
    if len(_agreed) >= _MAX_AGREED:
        _agreed.clear()
    _agreed.add(key)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _differences(descriptors: List[Dict[str, object]], ranks: List[int]) -> List[str]:
    """``"<field>: rank 0 <value>, rank 1 <value>"`` for each field whose values differ, ranks grouped by value."""
    out = []
    for name in descriptors[0]:
        by_value: Dict[str, List[int]] = {}
        for rank, d in zip(ranks, descriptors):
            by_value.setdefault(_show(d.get(name)), []).append(rank)
        if len(by_value) > 1:
            out.append(f"{name}: " + ", ".join(f"{_ranks(rs)} {value}" for value, rs in by_value.items()))
    return out


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
