"""Logging and rewrite statistics.

Every match a pass looks at ends in exactly one of two places: ``fused`` (rewritten) or ``skipped``
(left alone, with the reason).  ``FLUXINDUCTOR_LOG=1`` prints each decision as it is made.
"""

from __future__ import annotations

import collections
import logging
import os
import threading

logger = logging.getLogger("fluxinductor")


def _configure_from_env() -> None:
    if os.environ.get("FLUXINDUCTOR_LOG", "0") not in ("", "0"):
        if not any(getattr(h, "_fluxinductor", False) for h in logger.handlers):
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[fluxinductor] %(message)s"))
            handler._fluxinductor = True  # type: ignore[attr-defined]
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


_configure_from_env()

_lock = threading.Lock()
_fused: collections.Counter = collections.Counter()
_skipped: collections.Counter = collections.Counter()
_fallbacks: collections.Counter = collections.Counter()
_served: collections.Counter = collections.Counter()


def record_fused(pattern: str, detail: str = "") -> None:
    """Count one rewrite of ``pattern`` (e.g. ``"all_gather_matmul"``)."""
    with _lock:
        _fused[pattern] += 1
    logger.info("fused %s%s", pattern, f": {detail}" if detail else "")


def record_skip(pattern: str, reason: str, detail: str = "") -> None:
    """Count one match of ``pattern`` that was left unfused, and why."""
    with _lock:
        _skipped[(pattern, reason)] += 1
    logger.info("skipped %s: %s%s", pattern, reason, f" ({detail})" if detail else "")


def record_fallback(op: str, reason: str, path: str = "decomposed") -> None:
    """Count one run time call of a fused op that did not run fluxinductor's fused kernel: it took ``path``
    (the decomposition, or PyTorch's async-TP op where the cost model measured that faster)."""
    with _lock:
        first = _fallbacks[(op, reason)] == 0
        _fallbacks[(op, reason)] += 1
    # Logged once per (op, reason): the same fallback repeats every step.
    if first:
        logger.info("%s runs %s: %s", op, path, reason)


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
    logger.info("%s", message)


def rewrite_stats() -> dict:
    """Counts since the last :func:`reset_rewrite_stats`.

    Returns ``{"fused": {pattern: n}, "skipped": {pattern: {reason: n}}, "fallbacks": {op: {reason: n}},
    "from_cache": {op: n}}``.  A compile served from inductor's FX graph or AOTAutograd cache runs no pass, so it adds
    nothing to ``fused`` or ``skipped``; ``from_cache`` counts the fused-op calls in the served graphs' code instead.
    """
    with _lock:
        skipped: dict = {}
        for (pattern, reason), n in _skipped.items():
            skipped.setdefault(pattern, {})[reason] = n
        fallbacks: dict = {}
        for (op, reason), n in _fallbacks.items():
            fallbacks.setdefault(op, {})[reason] = n
        return {"fused": dict(_fused), "skipped": skipped, "fallbacks": fallbacks, "from_cache": dict(_served)}


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

    fused = {k: v - before["fused"].get(k, 0) for k, v in after["fused"].items()}
    served = {k: v - before.get("from_cache", {}).get(k, 0) for k, v in after.get("from_cache", {}).items()}
    return {"fused": {k: v for k, v in fused.items() if v},
            "from_cache": {k: v for k, v in served.items() if v},
            "skipped": nested(after["skipped"], before["skipped"]),
            "fallbacks": nested(after["fallbacks"], before["fallbacks"])}


def reset_rewrite_stats() -> None:
    """Zero the counts that :func:`rewrite_stats` reports."""
    with _lock:
        _fused.clear()
        _skipped.clear()
        _fallbacks.clear()
        _served.clear()
