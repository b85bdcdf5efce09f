"""Logging and rewrite statistics.

Every match a pass looks at ends in exactly one of two places: ``fused`` (rewritten) or ``skipped``
(left alone, with the reason).  ``FLUXINDUCTOR_LOG=1`` prints each decision as it is made.

In a job of several ranks every rank compiles the same graphs and, almost always, decides the same: so the
compile-time decisions (fused / skipped) and the run-time fallback notes are logged at INFO by rank 0 only and at
DEBUG by the others (``logging.getLogger("fluxinductor").setLevel(logging.DEBUG)`` shows every rank's, e.g. where
pipeline stages compile different graphs).  Warnings are logged on every rank.  Each line names its rank:
``[fluxinductor rank 1] ...``.  The counts of :func:`rewrite_stats` are kept on every rank alike.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from typing import Iterator, Optional

logger = logging.getLogger("fluxinductor")


def _rank() -> Optional[int]:
    """This process's rank in the default group; before the group exists, torchrun's ``RANK``; None outside a job."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK", "")
    return int(rank) if rank.isdigit() else None


class _RankFilter(logging.Filter):
    """Gives every record of the ``fluxinductor`` logger its ``rank`` (None outside a job of several ranks) and
    ``rank_prefix`` (``" rank N"`` or ``""``), so that a user's own handler can show them too."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank()
        record.rank = rank
        record.rank_prefix = "" if rank is None else f" rank {rank}"
        return True


logger.addFilter(_RankFilter())


def stream_handler(stream=None) -> logging.Handler:
    """The handler ``FLUXINDUCTOR_LOG`` adds: lines ``[fluxinductor rank N] message`` on ``stream`` (stderr)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("[fluxinductor%(rank_prefix)s] %(message)s"))
    return handler


def _configure_from_env() -> None:
    from fluxinductor import settings

    if settings.current.log:
        if not any(getattr(h, "_fluxinductor", False) for h in logger.handlers):
            handler = stream_handler()
            handler._fluxinductor = True  # type: ignore[attr-defined]
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


_configure_from_env()


def _decision_level() -> int:
    """INFO on rank 0 (or outside a job), DEBUG elsewhere: the level of a message every rank would repeat."""
    return logging.INFO if (_rank() or 0) == 0 else logging.DEBUG


_lock = threading.Lock()
_fused: collections.Counter = collections.Counter()
_skipped: collections.Counter = collections.Counter()
_fallbacks: collections.Counter = collections.Counter()
# Decisions about collectives a pass inserted itself (all_reduce_split's halves), kept apart from the user's.
_inserted_fused: collections.Counter = collections.Counter()
_inserted_skipped: collections.Counter = collections.Counter()
_inserting = threading.local()


@contextlib.contextmanager
def collective_inserted_by(pattern: Optional[str]) -> Iterator[None]:
    """Within the block, :func:`record_fused` and :func:`record_skip` are about a collective that the rewrite
    ``pattern`` inserted (e.g. the reduce-scatter half of a split all-reduce), not one of the user's: they are counted
    apart (``rewrite_stats()["inserted"]``) and logged at DEBUG, so that each collective of the user's graph counts
    once.  ``pattern`` None: the block is about the user's own collective (the ordinary case)."""
    previous = getattr(_inserting, "pattern", None)
    _inserting.pattern = pattern
    try:
        yield
    finally:
        _inserting.pattern = previous
_served: collections.Counter = collections.Counter()  # fused-op calls in graphs served from a cache


def record_fused(pattern: str, detail: str = "") -> None:
    """Count one rewrite of ``pattern`` (e.g. ``"all_gather_matmul"``)."""
    inserted_by = getattr(_inserting, "pattern", None)
    with _lock:
        (_fused if inserted_by is None else _inserted_fused)[pattern] += 1
    level = _decision_level() if inserted_by is None else logging.DEBUG
    logger.log(level, "fused %s%s%s", pattern, f": {detail}" if detail else "",
               f" (a collective {inserted_by} inserted)" if inserted_by else "")


def record_skip(pattern: str, reason: str, detail: str = "") -> None:
    """Count one match of ``pattern`` that was left unfused, and why."""
    inserted_by = getattr(_inserting, "pattern", None)
    with _lock:
        (_skipped if inserted_by is None else _inserted_skipped)[(pattern, reason)] += 1
    level = _decision_level() if inserted_by is None else logging.DEBUG
    logger.log(level, "skipped %s: %s%s%s", pattern, reason, f" ({detail})" if detail else "",
               f" (a collective {inserted_by} inserted)" if inserted_by else "")


def record_fallback(op: str, reason: str, path: str = "decomposed") -> None:
    """Count one run time call of a fused op that did not run fluxinductor's fused kernel: it took ``path``
    (the decomposition, or PyTorch's async-TP op where the cost model measured that faster)."""
    with _lock:
        first = _fallbacks[(op, reason)] == 0
        _fallbacks[(op, reason)] += 1
    # Logged once per (op, reason): the same fallback repeats every step.
    if first:
        logger.log(_decision_level(), "%s runs %s: %s", op, path, reason)


def record_served(op_calls: dict) -> None:
    """Count the fused ops a graph served from inductor's FX graph or AOTAutograd cache calls (``{op: calls}``): no
    pass ran for it, so :func:`record_fused` was not called, yet the graph may well run fused ops."""
    with _lock:
        _served.update(op_calls)
    if op_calls:
        logger.info("graph served from inductor's cache (no pass ran); it calls %s",
                    ", ".join(f"fluxinductor.{op} x{n}" for op, n in sorted(op_calls.items())))
    else:
        logger.info("graph served from inductor's cache (no pass ran); it calls no fused op")


_notes: set = set()


def note_once(message: str) -> None:
    """Log ``message`` the first time it is seen: a run time choice that is not a fallback (the fused kernel still
    runs), such as a GEMM+RS call taking another transport than the one asked for."""
    with _lock:
        if message in _notes:
            return
        _notes.add(message)
    logger.log(_decision_level(), "%s", message)


def _nest(counter: collections.Counter) -> dict:
    out: dict = {}
    for (key, reason), n in counter.items():
        out.setdefault(key, {})[reason] = n
    return out


def rewrite_stats() -> dict:
    """Counts since the last :func:`reset_rewrite_stats`, on this rank::

        {"fused":     {pattern: n},            # collectives of the user's graph rewritten by ``pattern``
         "skipped":   {pattern: {reason: n}},  # matches of the user's graph left alone, by reason
         "fallbacks": {op: {reason: n}},       # run time calls of a fused op that ran no fused kernel
         "inserted":  {"fused": {pattern: n}, "skipped": {pattern: {reason: n}}},
         "from_cache": {op: n}}               # fused-op calls in graphs served from inductor's caches

    Each collective of the user's graph counts once, under the rewrite that took it: ``all_gather_matmul`` an
    all-gather fused with the matmul(s) reading it, ``matmul_reduce_scatter`` a reduce-scatter fused with the
    matmul(s) feeding it, ``all_reduce_split`` an all-reduce split into a reduce-scatter (fused with its matmul) and
    an all-gather, or made one ``matmul_all_reduce`` op under dynamic shapes.  What later passes do with the
    collectives a pass inserted (the split all-reduce's halves) is counted under ``inserted`` instead: e.g. plain TP
    with two all-reduces gives ``fused == {"all_reduce_split": 2}`` and ``inserted["fused"] ==
    {"matmul_reduce_scatter": 2}`` (plus ``"all_gather_matmul"`` where a gathered half fused with the next matmul);
    an all-reduce kept whole as ``matmul_all_reduce`` whose residual add and RMSNorm are then fused into it counts
    under ``fused["all_reduce_split"]`` and ``inserted["fused"]["all_reduce_rms_norm"]``.
    A skip is counted per match looked at (an all-gather may count one per matmul reading it).  A compile served
    from inductor's FX graph or AOTAutograd cache runs no pass, so it adds nothing to ``fused`` or ``skipped``;
    ``from_cache`` counts the fused-op calls in the served graphs' code instead.
    """
    with _lock:
        return {"fused": dict(_fused), "skipped": _nest(_skipped), "fallbacks": _nest(_fallbacks),
                "inserted": {"fused": dict(_inserted_fused), "skipped": _nest(_inserted_skipped)},
                "from_cache": dict(_served)}


def rewrite_stats_delta(after: dict, before: dict) -> dict:
    """``after - before`` for two :func:`rewrite_stats` snapshots, in the same layout, zero counts left out."""

    def nested(a: dict, b: dict) -> dict:
        out: dict = {}
        for key, reasons in a.items():
            for reason, n in reasons.items():
                n -= b.get(key, {}).get(reason, 0)
                if n:
                    out.setdefault(key, {})[reason] = n
        return out

    def flat(a: dict, b: dict) -> dict:
        return {k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0)}

    empty = {"fused": {}, "skipped": {}}
    inserted_after, inserted_before = after.get("inserted", empty), before.get("inserted", empty)
    return {"fused": flat(after["fused"], before["fused"]),
            "skipped": nested(after["skipped"], before["skipped"]),
            "fallbacks": nested(after["fallbacks"], before["fallbacks"]),
            "inserted": {"fused": flat(inserted_after["fused"], inserted_before["fused"]),
                         "skipped": nested(inserted_after["skipped"], inserted_before["skipped"])},
            "from_cache": flat(after.get("from_cache", {}), before.get("from_cache", {}))}


def reset_rewrite_stats() -> None:
    """Zero the counts that :func:`rewrite_stats` reports."""
    with _lock:
        _fused.clear()
        _skipped.clear()
        _fallbacks.clear()
        _inserted_fused.clear()
        _inserted_skipped.clear()
        _served.clear()
