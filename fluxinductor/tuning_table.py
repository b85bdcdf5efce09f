"""The tuning-table format: one JSON file per device and world size that :mod:`fluxinductor.cost_model` reads.

A table is ``fluxinductor/tuning/<device_key>_tp<world>.json`` (``"NVIDIA H200"`` -> ``nvidia_h200``)::

    {"format": 1, "device": "NVIDIA H200", "device_key": "nvidia_h200", "world": 2, "dtype": "bfloat16",
     "min_gain": 0.01, "source": {...where the numbers came from...},
     "entries": [{"op": "all_gather_matmul", "m": 4096, "k": 8192, "n": 28672,
                  "sequential_ms": 1.50, "fused_ms": 1.30, "fused_ok": true, ...,
                  "choice": "fused", "choice_with_asynctp": "fused"}, ...]}

Each row is one op at one *global* GEMM shape (M, K, N): the median time of the sequential path (NCCL then cuBLAS, or
cuBLAS then NCCL) and of each overlapped path the benchmark timed (``<path>_ms``; None where the path was
unavailable; ``<path>_ok`` False where its output failed the check), any other measured numbers for the record, and
the path the cost model's rule picks from them (``choice``; ``choice_with_asynctp`` with PyTorch's async-TP
allowed), and the run it came from (``measured``: the fields of its run's ``source`` that name the run; empty where
that is not known, as for rows of a table written before rows carried it).  After a merge the table's ``source`` is
the newest run's and ``earlier_sources`` keeps the others'.  A GEMM+RS row may name the split transport's faster
GEMM configuration (``split_config``).

This module writes tables from ``benchmarks/bench_ops.py`` results (:func:`table_from_bench`), loads them
(:func:`load_table`, re-read when the file changes), merges a run's rows into a table (:func:`merge_tables`) and
writes them (:func:`write_table`).  The lookup rule is :mod:`fluxinductor.cost_model`'s.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Callable, Dict, List, Optional, Tuple

# The table layout's version: load_table refuses any other.
TABLE_FORMAT = 1

# The overlapped contenders of bench_ops.py whose times become a row's ``<path>_ms`` columns (the split transport's
# two GEMM configurations fold into one ``fused_split`` column, :func:`split_columns`).
_SPLIT_CONTENDERS = ((0, "fused_split"), (2, "fused_split2"))

_lock = threading.Lock()
_loaded: Dict[str, Tuple[float, dict]] = {}  # path -> (mtime, table)


def _cost_model():
    # The cost model imports this module for its tables; this module needs the rule's names only when it runs.
    from fluxinductor import cost_model

    return cost_model


def load_table(path: str) -> Optional[dict]:
    """The table at ``path`` (re-read when the file changes), or ``None`` if there is none.

    A file that exists but cannot be parsed raises: a broken committed table must not silently turn
    every decision into "sequential".
    """
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return None
    with _lock:
        cached = _loaded.get(path)
        if cached is not None and cached[0] == mtime:
            return cached[1]
    with open(path) as f:
        table = json.load(f)
    if table.get("format") != TABLE_FORMAT or not isinstance(table.get("entries"), list):
        raise ValueError(f"{path}: not a fluxinductor tuning table of format {TABLE_FORMAT}")
    with _lock:
        _loaded[path] = (mtime, table)
    return table


def forget_loaded() -> None:
    """Drop every table :func:`load_table` holds (``cost_model.clear_cache`` calls this)."""
    with _lock:
        _loaded.clear()


def make_table(
    device_name: str, world: int, dtype, entries: List[dict], source: Optional[dict] = None
) -> dict:
    """A table in the format ``cost_model.choose`` reads.

    ``entries``: dicts with ``op, m, k, n, fused_ms, sequential_ms`` (``fused_ms`` None where the fused
    kernel was unavailable), optionally ``fused_copy_ms``, ``fused_split_ms``, ``asynctp_ms``, ``<path>_ok`` (False
    when that path's output failed the check) and any other measured numbers, which are kept for the record.
    """
    cm = _cost_model()
    measured = _run_of(source)
    rows = []
    for e in entries:
        row = dict(e)
        if measured and "measured" not in row:
            row["measured"] = measured
        row["op"] = cm.canonical_op(row["op"])
        for field in ("m", "k", "n"):
            row[field] = int(row[field])
        # What the default dispatch picks (a fused kernel or sequential), and with async-TP allowed.
        row["choice"] = cm._decide(cm._gains(row, cm.DEFAULT_PATHS), "")[0]
        row["choice_with_asynctp"] = cm._decide(cm._gains(row, cm.PATHS), "")[0]
        rows.append(row)
    rows.sort(key=lambda r: (r["op"], r["k"], r["n"], r["m"]))
    return {
        "format": TABLE_FORMAT,
        "device": device_name,
        "device_key": cm.device_key(device_name),
        "world": int(world),
        "dtype": cm.dtype_name(dtype),
        "min_gain": cm.MIN_GAIN,
        "source": source or {},
        "entries": rows,
    }


# The fields of a table's ``source`` that name the run each of its rows keeps as ``measured``.
_RUN_FIELDS = ("bench_json", "git_sha", "timestamp")


def _run_of(source: Optional[dict]) -> dict:
    return {k: source[k] for k in _RUN_FIELDS if k in (source or {})}


def merge_tables(old: Optional[dict], new: dict) -> dict:
    """``new`` plus the rows of ``old`` (same device and world) for shapes ``new`` did not measure.  A kept row without
    a ``measured`` gets an empty one (its run is not known: ``old`` may be a merge already), and ``old``'s sources go
    into ``earlier_sources``."""
    cm = _cost_model()
    if not old or old.get("device_key") != new["device_key"] or old.get("world") != new["world"]:
        return new
    if cm.dtype_name(old.get("dtype", "")) != new["dtype"]:
        return new
    measured = {(r["op"], r["m"], r["k"], r["n"]) for r in new["entries"]}
    kept = [r if "measured" in r else {**r, "measured": {}} for r in old.get("entries", [])
            if (cm.canonical_op(r["op"]), r["m"], r["k"], r["n"]) not in measured]
    merged = dict(new)
    earlier = [s for s in old.get("earlier_sources", []) + [old.get("source")] if s]
    merged["earlier_sources"] = [s for i, s in enumerate(earlier) if s not in earlier[:i] and s != new["source"]]
    merged["entries"] = sorted(kept + new["entries"], key=lambda r: (cm.canonical_op(r["op"]), r["k"], r["n"], r["m"]))
    return merged


def write_table(path: str, table: dict, merge: bool = True) -> dict:
    """Write ``table`` to ``path`` (merged with the rows already there when ``merge``); returns what was written.
    Every remembered cost-model answer is dropped, so the next lookup reads the new file."""
    if merge and os.path.exists(path):
        try:
            with open(path) as f:
                table = merge_tables(json.load(f), table)
        except (OSError, ValueError):
            pass
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    _cost_model().clear_cache()
    return table


def table_file(directory: str, table: dict) -> str:
    """Where ``table`` goes in a tuning folder: ``<directory>/<device_key>_tp<world>.json``."""
    return os.path.join(directory, f"{table['device_key']}_tp{table['world']}.json")


# ---------------------------------------------------------------------------------------------------
# Rows from a bench_ops.py run
# ---------------------------------------------------------------------------------------------------


# Per-rank K below which the split GEMM+RS's ping-pong configuration (2) hides an epilogue that weighs enough to
# decide a tie; from it on the cooperative one (0) with its tail split.
SPLIT_SHORT_K = 8192


def kept_split_config(times: Dict[int, float], k_per_rank: Optional[int] = None) -> int:
    """The split transport's configuration a row keeps, from the times of those that ran (and passed): the one faster
    by more than the cost model's noise margin (or the only one with a time); within the margin 2 (ping-pong 128x192)
    below :data:`SPLIT_SHORT_K` of ``k_per_rank``, else 0 (cooperative 128x256).  Measured with the GPU at its top
    clocks, as a table's lone runs and a first-call calibration are, the two were level at short K per rank; under the
    power cap that steps run at, 2 was 4-16% ahead at K 2048-5120 per rank and 0 4% ahead at K 14336 (2xH200,
    alternated rounds: benchmarks/results/split_one_launch/, its two-launch columns)."""
    if 2 not in times or 0 not in times:
        return 2 if 2 in times else 0
    margin = 1.0 - _cost_model().MIN_GAIN
    if times[2] < times[0] * margin:
        return 2
    if times[0] < times[2] * margin:
        return 0
    return 2 if k_per_rank is not None and k_per_rank < SPLIT_SHORT_K else 0


def split_columns(contenders: Dict[str, dict], ok: Callable[[str], Optional[bool]],
                  k_per_rank: Optional[int] = None) -> dict:
    """A row's split transport columns from bench_ops ``contenders`` (name -> record with ``ms``): the time of the
    configuration :func:`kept_split_config` keeps among those that passed their check (``k_per_rank`` breaks a tie),
    which one (``split_config``), and both times for the record.  ``ok(name)``: whether that contender's output passed
    its check (None where it has no time)."""
    times = {cfg: contenders.get(name, {}).get("ms") for cfg, name in _SPLIT_CONTENDERS}
    oks = {cfg: ok(name) for cfg, name in _SPLIT_CONTENDERS}
    config = kept_split_config({cfg: t for cfg, t in times.items() if t is not None and oks[cfg] is not False},
                               k_per_rank)
    cols = {"fused_split_ms": times[config], "fused_split_ok": oks[config]}
    if times[2] is not None or oks[2] is not None:
        cols.update(split_config=config, fused_split_config_ms={str(cfg): t for cfg, t in times.items()})
    return cols


def rows_from_bench(results: List[dict], world: Optional[int] = None) -> List[dict]:
    """Table rows (:func:`make_table`'s ``entries``) from bench_ops ``results``: one per op and shape that has a
    sequential (``nccl_seq``) time, with every overlapped path's time and whether it passed its check."""
    entries = []
    for r in results:
        c = r["contenders"]
        seq = c.get("nccl_seq", {}).get("ms")
        if seq is None:
            continue

        def ok(name: str, c=c) -> Optional[bool]:  # None where the path has no time to judge
            rec = c.get(name, {})
            return rec.get("rel_ok") if rec.get("ms") is not None else None

        entries.append({
            "op": r["op_key"], "m": r["M"], "k": r["K"], "n": r["N"],
            "fused_ms": c.get("fused", {}).get("ms"),
            "fused_ok": ok("fused"),
            "fused_error": c.get("fused", {}).get("error"),
            "sequential_ms": seq,
            "gemm_ms": c.get("gemm", {}).get("ms"),
            "fused_copy_ms": c.get("fused_copy", {}).get("ms"),
            "fused_copy_ok": ok("fused_copy"),
            **split_columns(c, ok, r["K"] // world if world else None),
            "asynctp_ms": c.get("asynctp", {}).get("ms"),
            "asynctp_ok": ok("asynctp"),
            "fused_nocomm_ms": c.get("fused_nocomm", {}).get("ms"),
        })
    return entries


def table_from_bench(data: dict, bench_json: str) -> dict:
    """The table of one bench_ops run (its JSON document ``data``, written to ``bench_json``): its rows, its device,
    world size and dtype, and where the numbers came from (``source``)."""
    env = data["environment"]
    source = {"bench_json": bench_json, "git_sha": env["git_sha"], "timestamp": env["timestamp"],
              "torch": env["torch"], "nccl": env["nccl"], "b_layout": env["b_layout"], "iters": env["iters"]}
    return make_table(env["device"], env["world"], env["dtype"], rows_from_bench(data["results"], env["world"]),
                      source)
