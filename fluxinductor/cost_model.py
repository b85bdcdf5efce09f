"""Measured cost model: run an overlapped path only where it was measured to beat NCCL-then-GEMM.

The tables are data, not code: ``fluxinductor/tuning/<device_key>_tp<world>.json``, written by
``benchmarks/bench_ops.py --emit-tuning`` from a real run on that device at that world size and kept
under version control.  A table holds, per op and global GEMM shape (M, K, N), the median time of the
sequential path (NCCL collective then cuBLAS, or cuBLAS then NCCL) and of the overlapped paths
(:data:`PATHS`): ``fused`` (fluxinductor's kernels), ``fused_copy`` (the GEMM+RS kernel with its
copy-engine transport), ``fused_split`` (GEMM+RS as a ring of stock CUTLASS GEMMs with the copy engine between
them) and ``asynctp`` (PyTorch's async-TP ops, ``torch.ops.symm_mem.fused_*``, which the
dispatcher may run instead, opt-in: ``settings.set_tuning(asynctp=True)``).

Shapes are *global* GEMM shapes, the convention of ``docs/performance.md`` (see :func:`global_mkn`):

- ``all_gather_matmul``: each rank holds A_shard [M/world, K] and B [K, N/world]; out [M, N/world].
- ``matmul_reduce_scatter``: each rank holds A [M, K/world] and B [K/world, N]; out [M/world, N].

Lookup rule of :func:`choose`, in order:

1. No table for this device and world size, or a dtype the table does not cover
   -> ``("sequential", "no tuning table for <device_key> tp<world>")``.
2. Rows of the op with exactly this (K, N): sorted by M.
   - M equal to a measured M: that row's gain.
   - M between two measured Ms: the gain interpolated linearly in log(M) between the two neighbours.
   - M above the measured range: the gain of the largest measured M (the end row).
   - M below the measured range: ``"sequential"``.  Not extrapolated: below the smallest measured M a collective
     costs its latency, not its bytes, and the overlapped paths lose there (decode sizes) by more than any
     neighbour shows.
3. Otherwise, if M is below the smallest M measured for the op, ``"sequential"`` (as above).  Else rows whose K and N are each within a factor :data:`SIMILAR_KN` of this K and N: the row
   nearest in log(flops) = log(2*M*K*N), if it is within a factor :data:`MAX_FLOPS_RATIO`; its gain.
   (K and N separately: the collective moves M*K (AG) or M*N (RS) elements, so swapping them, at the same
   K*N, changes the communication share.)
4. Otherwise ``("sequential", "no measured shape near ...")``.

The gain of a path in a row is ``(t_sequential - t_path) / t_sequential``; a path whose time is missing
(unavailable, raised, failed its correctness check, or not measured: older tables have no ``asynctp_ms``)
has gain -inf, and so has ``asynctp`` on shapes faster than :data:`ASYNCTP_MIN_SEQUENTIAL_MS` sequentially.
Each path's gain is interpolated on its own; the path with the highest gain (``fused`` on a tie within
:data:`MIN_GAIN`) is returned if that gain is above :data:`MIN_GAIN`, so a difference within timing noise,
an unmeasured shape or an unmeasured device always means ``"sequential"``.  ``choose(..., paths=...)``
limits the candidates (the dispatcher offers ``asynctp`` only with ``settings.tuning.asynctp`` and PyTorch's
ops present).  Forcing the fused kernel regardless of this table is the dispatcher's business
(``FLUXINDUCTOR_DISPATCH=fused``), not this module's.

A GEMM+RS row may also name the split transport's faster GEMM configuration, ``split_config`` (0: cooperative
128x256, 2: ping-pong 128x192; bench_ops times both and keeps the one faster by more than :data:`MIN_GAIN`, a tie by
K per rank: ``tuning_table.kept_split_config``);
:func:`split_config` gives the dispatcher the nearest row's (same K and N nearest in log M, else the nearest-flops
rule above), None (the kernel's default, 0) where no row has one.

A table measured a call's shape where it has rows of the same (K, N) at Ms on both sides of the call's (or rules the
call out below its smallest M).  A row above the measured range, or of a similar shape, is only a *seed*: it decides
as it did, but as an estimate (below), so the op's first call of the shape measures it.

Where no table row answers (no table for this device or world size, no rows for the op, no measured shape near),
:func:`decide` estimates from a roofline (:func:`roofline_ms`): the GEMM at the device's matmul rate, the collective
at its link bandwidth plus one collective's latency, and the fused op as the longer of the two plus what the last
chunk's GEMM (AG+GEMM) or the last tile's send (GEMM+RS) cannot hide, a fixed overhead and a GEMM slowdown.  The rates
(:class:`Rates`) are the device's measured ones once :mod:`fluxinductor.calibration` measured them (at run time, agreed
by every rank), else nominal ones for the device name (:func:`nominal_rates`).  Such a decision is an *estimate*
(``Decision.estimated``): the pass rewrites on it, and under ``auto`` dispatch the op's first call of the shape times
the paths and keeps the faster (:mod:`fluxinductor.calibration`); those measured rows
(:func:`add_calibrated_row`) then answer like a table's, for the same (K, N) at that M or between two measured Ms.
A calibrated GEMM+RS row also names the split transport's faster configuration, which :func:`split_config` prefers to
the table's nearest row.

``FLUXINDUCTOR_TUNING_DIR`` replaces the packaged table folder (used by the tests, and to try a table
before committing it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

from fluxinductor import settings, tuning_table
# The table format (read, written, merged) is tuning_table's; these names stay importable from here.
from fluxinductor.tuning_table import TABLE_FORMAT, load_table, make_table, merge_tables, write_table  # noqa: F401

# Fused must beat sequential by more than this fraction of the sequential time (medians of 20 runs
# differ by ~1% between repeated runs on the same machine, so smaller gains are noise).
MIN_GAIN = 0.01
# Shapes whose K and N are each within this factor count as "similar" for the nearest-flops rule.
SIMILAR_KN = 2.0
# ... and the nearest row must be within this factor in flops.
MAX_FLOPS_RATIO = 4.0

# The overlapped paths a table row can time, besides the "sequential" reference: fluxinductor's fused
# kernel (GEMM+RS peer tiles by NVLink stores), the same kernel with the copy-engine transport (GEMM+RS only),
# the split GEMM+RS transport (a ring of stock GEMMs), PyTorch's async-TP op.  The order breaks near ties.
PATHS = ("fused", "fused_copy", "fused_split", "asynctp")
# What the dispatcher offers by default (async-TP is opt-in).
DEFAULT_PATHS = ("fused", "fused_copy", "fused_split")
# async-TP is not chosen for shapes whose sequential time is below this (ms): through the dispatcher its
# host-side work (many small launches and barriers) was not hidden there.  Measured on 2xH200:
# GEMM+RS 1024x8192x8192 async-TP alone 0.138 ms, the same op picked by auto 0.229 ms, sequential 0.149 ms;
# from 0.6 ms sequential up auto matched async-TP alone within noise.
ASYNCTP_MIN_SEQUENTIAL_MS = 0.3

# Splitting an all-reduce into a fused matmul + reduce-scatter and an all-gather moves the same bytes as the
# all-reduce but pays one more collective's latency: the split is taken only where the fused reduce-scatter saves
# more than this (ms).  NCCL's all-gather of a small tensor on 2xH200, host exposed
# (benchmarks/probes/collective_latency.py, benchmarks/results/collective_latency/).
SPLIT_ALL_REDUCE_LATENCY_MS = 0.03

# The roofline's fused op: its GEMM runs this much slower than cuBLAS (the fused kernels measured 1.00-1.13x cuBLAS
# with communication off, bench_ops on 2xH200) and it pays this fixed cost per peer (flag waits, the barrier, a second
# launch).  With the nominal H200 rates the roofline then picks fused or sequential as the committed tables' measured
# choice does on 30 of 30 rows at TP=2 and 36 of 38 at TP=4 (tests/ops/test_calibration.py).
FUSED_GEMM_SLOWDOWN = 0.05
FUSED_OVERHEAD_MS_PER_PEER = 0.02

ALL_GATHER_MATMUL = "all_gather_matmul"
MATMUL_REDUCE_SCATTER = "matmul_reduce_scatter"
_OP_ALIASES = {
    "all_gather_matmul": ALL_GATHER_MATMUL,
    "ag_gemm": ALL_GATHER_MATMUL,
    "ag+gemm": ALL_GATHER_MATMUL,
    "matmul_reduce_scatter": MATMUL_REDUCE_SCATTER,
    "gemm_rs": MATMUL_REDUCE_SCATTER,
    "gemm+rs": MATMUL_REDUCE_SCATTER,
}
# dtypes whose tensor-core rate and element size match the bf16 the tables are measured in.
_HALF_DTYPES = ("bfloat16", "float16")

_lock = threading.Lock()
_generation = 0  # clear_cache() calls (table_version)
_calibration_version = 0  # rows and rates added (the memo key of decide)


class Decision(NamedTuple):
    """:func:`decide`'s answer: the path, why, and whether it is a roofline estimate (no measured row answered)."""

    path: str
    reason: str
    estimated: bool


@dataclass(frozen=True)
class Rates:
    """What the roofline (:func:`roofline_ms`) knows of a device and group.

    ``matmul_tflops``: the dense half-precision GEMM rate cuBLAS reaches on large shapes; ``link_gbps``: the bytes a
    rank receives in an all-gather (or sends in a reduce-scatter) per second, GB/s, on large messages;
    ``latency_ms``: one collective's fixed cost; ``source``: where the numbers came from; ``memory_gbps``: the bytes
    a device-to-device copy reads plus writes per second, GB/s (nominal: not measured by the calibration)."""

    matmul_tflops: float
    link_gbps: float
    latency_ms: float
    source: str
    memory_gbps: float = 1500.0


# Nominal rates per device-name pattern, first match wins; what the committed H200 tables imply: cuBLAS at
# 750-790 TFLOP/s on the Llama shapes, NCCL all-gather 218 GB/s received per rank at TP=2 and 300 at TP=4.  Copy
# bandwidth: 85% of the HBM's (an H200 copy of two 235 MB weights ran in 223 us in a training step's profile).
_NOMINAL = (
    ("h800", Rates(750.0, 100.0, 0.03, "nominal H800", 2850.0)),
    (r"h20\b", Rates(140.0, 220.0, 0.03, "nominal H20", 3400.0)),
    ("nvl|pcie", Rates(600.0, 100.0, 0.03, "nominal H100 PCIe/NVL", 1700.0)),
    ("h200|gh200", Rates(750.0, 220.0, 0.03, "nominal H200 SXM", 4100.0)),
    ("h100", Rates(750.0, 220.0, 0.03, "nominal H100 SXM", 2850.0)),
)
_UNKNOWN_RATES = Rates(300.0, 50.0, 0.05, "nominal, device not known")
_measured_rates: Dict[Tuple[str, int], Rates] = {}
_calibrated: Dict[Tuple[str, int], List[dict]] = {}  # (device_key, world) -> measured rows (with "dtype")


def nominal_rates(device_name: str) -> Rates:
    """The rates assumed for a device before any measurement (by its name: ``"NVIDIA H100 80GB HBM3"`` ...)."""
    name = device_name.lower()
    for pattern, rates in _NOMINAL:
        if re.search(pattern, name):
            return rates
    return _UNKNOWN_RATES


def rates_for(device_name: str, world: int) -> Rates:
    """The measured rates for this device and world size if :func:`set_measured_rates` has them, else nominal."""
    return _measured_rates.get((device_key(device_name), int(world))) or nominal_rates(device_name)


def set_measured_rates(device_name: str, world: int, rates: Rates) -> None:
    """Use ``rates`` (measured and agreed by every rank, :mod:`fluxinductor.calibration`) for this device and world."""
    global _calibration_version
    with _lock:
        _measured_rates[(device_key(device_name), int(world))] = rates
        _calibration_version += 1


def add_calibrated_row(device_name: str, world: int, row: dict) -> None:
    """A measured row (the table's row format plus ``"dtype"``) for :func:`decide` where no table answers."""
    global _calibration_version
    key = (device_key(device_name), int(world))
    with _lock:
        rows = [r for r in _calibrated.get(key, [])
                if (r["op"], r["m"], r["k"], r["n"], r["dtype"]) != (row["op"], row["m"], row["k"], row["n"],
                                                                      row["dtype"])]
        _calibrated[key] = rows + [dict(row)]
        _calibration_version += 1


def calibration_digest() -> str:
    """What :func:`decide` knows beyond the tables (measured rates and rows), as text for the pass manager's uuid."""
    with _lock:
        rates = sorted((k, dataclasses.astuple(r)) for k, r in _measured_rates.items())
        rows = sorted((k, sorted(json.dumps(r, sort_keys=True) for r in v)) for k, v in _calibrated.items())
    return repr((rates, rows))


def roofline_ms(op: str, world: int, m: int, k: int, n: int, dtype, rates: Rates) -> Tuple[float, float]:
    """(sequential, fused) time in ms of the global GEMM (m, k, n) on ``world`` ranks, by the roofline.

    Each rank does 1/world of the flops.  The collective moves (world-1)/world of the gathered A (M*K, AG+GEMM) or of
    the partial output (M*N, GEMM+RS) per rank.  Sequential: the two one after the other.  Fused: the longer of the
    GEMM (slowed by :data:`FUSED_GEMM_SLOWDOWN`) and the collective plus the 1/world of the GEMM that must follow it,
    plus :data:`FUSED_OVERHEAD_MS_PER_PEER` for each peer."""
    op = canonical_op(op)
    size = 4 if dtype_name(dtype) == "float32" else 2
    gemm = 2.0 * m * k * n / world / (rates.matmul_tflops * 1e12) * 1e3
    moved = (m * k if op == ALL_GATHER_MATMUL else m * n) * size * (world - 1) / world
    comm = rates.latency_ms + moved / (rates.link_gbps * 1e9) * 1e3
    fused = max(gemm * (1.0 + FUSED_GEMM_SLOWDOWN), comm + gemm / world) + FUSED_OVERHEAD_MS_PER_PEER * (world - 1)
    return gemm + comm, fused


def sum_per_term(world: int, m: int, ks: List[int], n: int, dtype, copied_bytes: int, rates: Rates) -> bool:
    """Whether a reduce-scatter of a sum of matmuls ``sum_i a_i @ w_i`` (global M, each term's global K in ``ks``,
    N) is better fused as one op per term, results added (each term pays its own collective, which its own GEMM must
    hide), than as one op over the concatenated K, which pays for copying ``copied_bytes`` into the concatenations
    (operands no fusion writes there directly: weights, as a rule).  By the roofline (:func:`roofline_ms`): on 2xH200
    the gate/up input gradient of a Llama layer (hidden 8192, FFN 28672, 4096 tokens) is cheaper per term, its
    weights' copy (470 MB) costing more than a second reduce-scatter hidden under a 1.2 ms GEMM; Q/K/V's is
    cheaper concatenated, its K/V GEMMs too short to hide a reduce-scatter each."""
    size = 4 if dtype_name(dtype) == "float32" else 2
    per_ms = lambda nbytes: nbytes / (rates.memory_gbps * 1e9) * 1e3  # noqa: E731 - read plus write, ms
    concatenated = roofline_ms(MATMUL_REDUCE_SCATTER, world, m, sum(ks), n, dtype, rates)[1] + per_ms(2 * copied_bytes)
    # Each added term reads two [M/world, N] results and writes one.
    per_term = (sum(roofline_ms(MATMUL_REDUCE_SCATTER, world, m, k, n, dtype, rates)[1] for k in ks)
                + per_ms(3 * (len(ks) - 1) * m // world * n * size))
    return per_term < concatenated


def canonical_op(op: str) -> str:
    """``"all_gather_matmul"`` or ``"matmul_reduce_scatter"`` for any accepted alias (``"AG+GEMM"``, ...)."""
    try:
        return _OP_ALIASES[op.lower()]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; expected one of {sorted(set(_OP_ALIASES.values()))}") from None


def device_key(device_name: str) -> str:
    """File-name key of a device: ``"NVIDIA H200"`` -> ``"nvidia_h200"``."""
    key = re.sub(r"[^a-z0-9]+", "_", device_name.strip().lower()).strip("_")
    return key or "unknown"


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"bf16"`` -> ``"bfloat16"``."""
    name = str(dtype).replace("torch.", "")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        name, name
    )


def global_mkn(op: str, world: int, a_rows: int, k_local: int, n_local: int) -> Tuple[int, int, int]:
    """The global (M, K, N) of a per-rank problem, in the tables' convention.

    all_gather_matmul: ``a_rows`` = rows of the shard (M/world), ``k_local`` = K, ``n_local`` = columns
    of this rank's B (N/world) -> (a_rows*world, K, n_local*world).
    matmul_reduce_scatter: ``a_rows`` = M, ``k_local`` = K/world, ``n_local`` = N
    -> (M, k_local*world, N).
    """
    op = canonical_op(op)
    if op == ALL_GATHER_MATMUL:
        return a_rows * world, k_local, n_local * world
    return a_rows, k_local * world, n_local


def tuning_dir() -> str:
    """The folder the tables are read from: ``$FLUXINDUCTOR_TUNING_DIR`` or the packaged ``tuning/``."""
    return settings.current.tuning_dir or os.path.join(os.path.dirname(__file__), "tuning")


def table_path(device_name: str, world: int) -> str:
    return _table_path(tuning_dir(), device_name, int(world))


@functools.lru_cache(maxsize=64)
def _table_path(directory: str, device_name: str, world: int) -> str:
    return os.path.join(directory, f"{device_key(device_name)}_tp{world}.json")


# How long a looked-up table version serves the calls after it.  The dispatcher asks for it on every ``auto`` call, and
# asking the file system each time cost 25-190 us of host time per fused call on the 2xH200 machine
# (benchmarks/probes/host_overhead.py at torchtitan's Llama3 shapes, the auto path against the fused one:
# benchmarks/results/host_one_call/h200x2_host_llama3_dim4096_run*.json).
TABLE_RECHECK_S = 1.0
_versions: Dict[Tuple[str, int], Tuple[float, tuple]] = {}
_clock = time.monotonic


def table_version(device_name: str, world: int) -> tuple:
    """What identifies the table :func:`choose` reads for this device and world size: its path, its file's mtime
    (None: no file) and how many times :func:`clear_cache` ran.  The dispatcher keys its remembered decisions by it.
    The mtime is looked up again after :data:`TABLE_RECHECK_S` (an edited table counts within that); another path (a
    new tuning folder) or :func:`clear_cache` looks it up at once."""
    path = table_path(device_name, world)
    key = (path, _generation)
    now = _clock()
    seen = _versions.get(key)
    if seen is None or now - seen[0] >= TABLE_RECHECK_S:
        seen = _versions[key] = (now, (path, _mtime(path), _generation))
    return seen[1]


def _mtime(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def generation() -> int:
    """How many times :func:`clear_cache` ran (what is keyed by the tables' versions)."""
    return _generation


def clear_cache() -> None:
    """Forget every loaded table (they are also re-read whenever their file's mtime changes)."""
    global _generation
    with _lock:
        _generation += 1
        _versions.clear()
        tuning_table.forget_loaded()
        _choices.clear()
        _split_configs.clear()
        _savings.clear()
        _decisions.clear()


def forget_calibration() -> None:
    """Forget the measured rates and rows (tests; :mod:`fluxinductor.calibration` keeps its own memory too)."""
    global _calibration_version
    with _lock:
        _measured_rates.clear()
        _calibrated.clear()
        _decisions.clear()
        _calibration_version += 1


def _gain(row: dict, path: str = "fused") -> float:
    t, seq = row.get(f"{path}_ms"), row.get("sequential_ms")
    if row.get(f"{path}_ok") is False or t is None or seq is None or not t > 0 or not seq > 0:
        return -math.inf
    if path == "asynctp" and seq < ASYNCTP_MIN_SEQUENTIAL_MS:
        return -math.inf
    return (seq - t) / seq


def _gains(row: dict, paths: Tuple[str, ...]) -> Dict[str, float]:
    return {p: _gain(row, p) for p in paths}


def wins(gain: float) -> bool:
    # The epsilon keeps a gain of exactly MIN_GAIN (up to float rounding) on the "sequential" side.
    return gain > MIN_GAIN + 1e-9


def _describe(row: dict, paths: Tuple[str, ...] = ("fused",)) -> str:
    parts = []
    for path in paths:
        t = row.get(f"{path}_ms")
        if t is None and path != "fused":
            continue  # an optional path this table did not measure
        text = f"{path} " + ("unavailable" if t is None else f"{t:.3f} ms")
        if row.get(f"{path}_ok") is False:
            text += " (failed its check)"
        parts.append(text)
    seq = row.get("sequential_ms")
    seq_s = "?" if seq is None else f"{seq:.3f} ms"
    return f"M={row['m']} K={row['k']} N={row['n']}: {', '.join(parts)} vs sequential {seq_s}"


def pick(gains: Dict[str, float], order) -> Tuple[str, float]:
    """(path, gain): the first path in ``order`` whose gain over sequential is within :data:`MIN_GAIN` of the best (a
    near tie keeps the earlier path; measured at TP=4: async-TP picked on a 0.6% op-level lead ran the SP MLP 15%
    slower than the kernel).  The caller decides whether that gain wins (:func:`wins`)."""
    top = max(gains.values())
    best = next(p for p in order if p in gains and (gains[p] == top or gains[p] >= top - MIN_GAIN))
    return best, gains[best]


def _decide(gains: Dict[str, float], basis: str) -> Tuple[str, str]:
    best, gain = pick(gains, PATHS)
    gain_s = "-inf" if gain == -math.inf else f"{gain * 100:+.1f}%"
    if wins(gain):
        return best, f"{basis}; {best} gain {gain_s} > {MIN_GAIN * 100:.0f}%"
    return "sequential", f"{basis}; best gain {gain_s} ({best}) <= {MIN_GAIN * 100:.0f}%"


def choose_from_table(table: dict, op: str, m: int, k: int, n: int,
                      paths: Tuple[str, ...] = PATHS) -> Tuple[str, str]:
    """Apply the lookup rule (module docstring) to one loaded table."""
    choice, reason, _ = _choose_from_table(table, op, m, k, n, paths)
    return choice, reason


def _choose_from_table(table: dict, op: str, m: int, k: int, n: int, paths: Tuple[str, ...] = PATHS,
                       kinds: Tuple[str, ...] = ("exact", "between", "above", "similar", "below")
                       ) -> Tuple[str, str, bool]:
    """(choice, reason, answered): ``answered`` False where no row of the kinds in ``kinds`` is there to read (no rows
    for the op, or none near), so that :func:`decide` estimates instead."""
    op = canonical_op(op)
    paths = tuple(p for p in PATHS if p in paths)
    if not paths:
        return "sequential", "no overlapped path is allowed", True
    rows = [r for r in table["entries"] if canonical_op(r["op"]) == op]
    if not rows:
        return "sequential", f"no {op} rows in the tuning table", False
    kind, basis, t, reason = _basis(rows, op, m, k, n)
    if kind not in kinds:
        return "sequential", reason or f"no measured {op} row at M={m} K={k} N={n}", False
    if kind == "below":
        return "sequential", reason, True
    if kind == "between":
        lo, hi = basis
        gains = {}
        for path in paths:
            g_lo, g_hi = _gain(lo, path), _gain(hi, path)
            # never interpolate towards a shape where the path was not measured to work
            gains[path] = -math.inf if -math.inf in (g_lo, g_hi) else g_lo + t * (g_hi - g_lo)
        return _decide(gains, f"interpolated in log M between [{_describe(lo, paths)}] and "
                              f"[{_describe(hi, paths)}]") + (True,)
    (r,) = basis
    prefix = {"exact": "measured", "above": "nearest measured M (above the range)",
              "similar": "nearest measured shape by flops with similar K and N"}[kind]
    return _decide(_gains(r, paths), f"{prefix} {_describe(r, paths)}") + (True,)


def _basis(rows: List[dict], op: str, m: int, k: int, n: int) -> Tuple[str, tuple, float, str]:
    """Which of an op's ``rows`` the lookup rule (module docstring) reads at (m, k, n): ``(kind, rows, t, reason)``
    with kind ``"exact"`` / ``"above"`` / ``"similar"`` (one row), ``"between"`` (the two neighbours in M, ``t`` the
    position in log M between them), ``"below"`` or ``"none"`` (no row; ``reason`` says why)."""
    same_kn = sorted((r for r in rows if r["k"] == k and r["n"] == n), key=lambda r: r["m"])
    if same_kn:
        for r in same_kn:
            if r["m"] == m:
                return "exact", (r,), 0.0, ""
        if m < same_kn[0]["m"]:
            return "below", (), 0.0, (f"M={m} is below the measured range (smallest M={same_kn[0]['m']} at K={k} "
                                      f"N={n})")
        if m > same_kn[-1]["m"]:
            return "above", (same_kn[-1],), 0.0, ""
        lo = max((r for r in same_kn if r["m"] < m), key=lambda r: r["m"])
        hi = min((r for r in same_kn if r["m"] > m), key=lambda r: r["m"])
        t = (math.log(m) - math.log(lo["m"])) / (math.log(hi["m"]) - math.log(lo["m"]))
        return "between", (lo, hi), t, ""
    smallest = min(r["m"] for r in rows)
    if m < smallest:
        return "below", (), 0.0, f"M={m} is below the measured range (smallest {op} M={smallest})"
    best = _nearest_similar(rows, m, k, n)
    if best is not None:
        return "similar", (best,), 0.0, ""
    return "none", (), 0.0, f"no measured {op} shape near M={m} K={k} N={n}"


def _saving(row: dict, path: str) -> float:
    """The row's measured saving of ``path`` over the sequential path, ms (0 where the path did not run)."""
    t, seq = row.get(f"{path}_ms"), row.get("sequential_ms")
    if row.get(f"{path}_ok") is False or t is None or seq is None:
        return 0.0
    return seq - t


def saving_from_table(table: dict, op: str, m: int, k: int, n: int, path: str) -> float:
    """The time ``path`` saves over the sequential path at the global GEMM (m, k, n), in ms, by the rows
    :func:`choose_from_table` reads: the row itself, interpolated in log M, the largest M's saving scaled by M above
    the range, the nearest-flops row's scaled by flops; 0 below the measured range and with no row near."""
    op = canonical_op(op)
    rows = [r for r in table["entries"] if canonical_op(r["op"]) == op]
    if not rows:
        return 0.0
    kind, basis, t, _ = _basis(rows, op, m, k, n)
    if kind in ("below", "none"):
        return 0.0
    if kind == "between":
        lo, hi = basis
        return _saving(lo, path) + t * (_saving(hi, path) - _saving(lo, path))
    (r,) = basis
    return _saving(r, path) * (m * float(k) * n) / (r["m"] * float(r["k"]) * r["n"])


# choose() results by (table file, its mtime, arguments): the dispatcher asks on every call of a fused op,
# and a model repeats a few shapes; the lookup itself (filtering rows, interpolating, formatting the reason)
# cost ~100 us of host time per call on the 4xH200 machine (benchmarks/probes/host_overhead.py).
_choices: Dict[tuple, Tuple[str, str]] = {}
_split_configs: Dict[tuple, Optional[int]] = {}
_savings: Dict[tuple, float] = {}
_MAX_CHOICES = 4096


def choose(op: str, device_name: str, world: int, m: int, k: int, n: int, dtype,
           paths: Tuple[str, ...] = PATHS) -> Tuple[str, str]:
    """Choose the path for one call: ``("fused" | "fused_copy" | "fused_split" | "asynctp" | "sequential", reason)``.

    ``op``: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"`` (aliases: ``"ag_gemm"``, ``"AG+GEMM"``,
    ``"gemm_rs"``, ``"GEMM+RS"``).  ``device_name``: e.g. ``torch.cuda.get_device_name()``.
    (m, k, n): the *global* GEMM shape (see :func:`global_mkn`).  ``dtype``: torch dtype or its name.
    ``paths``: the overlapped paths that may be chosen (a subset of :data:`PATHS`).
    Answers are remembered per table file version (its mtime), so an edited table takes effect at once.
    """
    path = table_path(device_name, world)
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        mtime = None
    memo = (path, mtime, op, int(m), int(k), int(n), str(dtype), tuple(paths))
    return _remembered(_choices, memo, lambda: _choose(op, device_name, world, m, k, n, dtype, paths, path))


def saving_ms(op: str, device_name: str, world: int, m: int, k: int, n: int, dtype, path: str) -> float:
    """:func:`saving_from_table` for this device's table at this world size (0 without a table or for a dtype it does
    not cover): what a pass weighs against the cost a rewrite adds (an all-reduce split in two collectives)."""
    table_file = table_path(device_name, world)
    try:
        mtime = os.stat(table_file).st_mtime
    except OSError:
        mtime = None

    def compute() -> float:
        m_, k_, n_ = int(m), int(k), int(n)
        table = load_table(table_file) if mtime is not None else None
        if table is not None:
            want, have = dtype_name(dtype), dtype_name(table.get("dtype", "bfloat16"))
            if want != have and not (want in _HALF_DTYPES and have in _HALF_DTYPES):
                return 0.0
            if _choose_from_table(table, op, m_, k_, n_, kinds=_MEASURED_KINDS)[2]:
                return saving_from_table(table, op, m_, k_, n_, path)
        rows = _calibrated_rows(device_name, world, op, dtype)
        if rows and _basis(rows, canonical_op(op), m_, k_, n_)[0] in ("exact", "between"):
            return saving_from_table({"entries": rows}, op, m_, k_, n_, path)
        if table is not None and _choose_from_table(table, op, m_, k_, n_, kinds=_SEED_KINDS)[2]:
            return saving_from_table(table, op, m_, k_, n_, path)
        if dtype_name(dtype) not in _HALF_DTYPES:
            return 0.0
        seq, fused = roofline_ms(op, world, m_, k_, n_, dtype, rates_for(device_name, world))
        return max(0.0, seq - fused)

    return _remembered(_savings, (table_file, mtime, _calibration_version, op, int(m), int(k), int(n), str(dtype),
                                  path), compute)


def split_all_reduce_veto(device_name: str, world: int, m: int, k: int, n: int, dtype,
                          paths: Tuple[str, ...] = PATHS) -> Optional[str]:
    """Why an all-reduce after the matmul (m, k, n) should stay whole, or None where splitting it pays: the best of
    ``paths`` at this shape saves more over matmul-then-reduce-scatter than the all-gather the split adds costs
    (:data:`SPLIT_ALL_REDUCE_LATENCY_MS`); the bytes are the all-reduce's either way."""
    op = MATMUL_REDUCE_SCATTER
    best = max((saving_ms(op, device_name, world, m, k, n, dtype, p) for p in paths), default=0.0)
    if best > SPLIT_ALL_REDUCE_LATENCY_MS:
        return None
    return (f"an all-reduce split at M={m} K={k} N={n} saves {best * 1e3:.0f} us in its fused reduce-scatter, "
            f"not more than the {SPLIT_ALL_REDUCE_LATENCY_MS * 1e3:.0f} us the added all-gather costs")


def _remembered(store: dict, memo: tuple, compute):
    """``store[memo]``, computed by ``compute()`` the first time (the store is emptied when it reaches
    :data:`_MAX_CHOICES`)."""
    with _lock:
        if memo in store:
            return store[memo]
    answer = compute()
    with _lock:
        if len(store) >= _MAX_CHOICES:
            store.clear()
        store[memo] = answer
    return answer


def _nearest_similar(rows: List[dict], m: int, k: int, n: int) -> Optional[dict]:
    """Of ``rows`` whose K and N are each within :data:`SIMILAR_KN` of (k, n), the one nearest in log flops, if it is
    within :data:`MAX_FLOPS_RATIO`; else None."""
    similar = [r for r in rows
               if abs(math.log(r["k"] / k)) <= math.log(SIMILAR_KN) and abs(math.log(r["n"] / n)) <= math.log(SIMILAR_KN)]
    if not similar:
        return None
    flops = 2.0 * m * float(k) * float(n)
    best = min(similar, key=lambda r: abs(math.log(2.0 * r["m"] * r["k"] * r["n"] / flops)))
    return best if abs(math.log(2.0 * best["m"] * best["k"] * best["n"] / flops)) <= math.log(MAX_FLOPS_RATIO) else None


def split_config_from_table(table: dict, m: int, k: int, n: int) -> Optional[int]:
    """The split GEMM+RS transport's configuration (``split_config``) of the row nearest to the GEMM+RS shape (M, K, N):
    among rows that recorded one, the same (K, N) nearest in log M, else K and N each within :data:`SIMILAR_KN` and
    nearest in log flops within :data:`MAX_FLOPS_RATIO`; None where no such row exists (the kernel's default)."""
    rows = [r for r in table.get("entries", [])
            if canonical_op(r["op"]) == "matmul_reduce_scatter" and r.get("split_config") is not None]
    same_kn = [r for r in rows if r["k"] == k and r["n"] == n]
    if same_kn:
        return int(min(same_kn, key=lambda r: (abs(math.log(r["m"] / m)), r["m"]))["split_config"])
    best = _nearest_similar(rows, m, k, n)
    return None if best is None else int(best["split_config"])


def split_config(device_name: str, world: int, m: int, k: int, n: int, dtype) -> Optional[int]:
    """The split transport's configuration for the GEMM+RS shape (M, K, N): a calibrated row's of this very shape
    (:mod:`fluxinductor.calibration` times each configuration), else :func:`split_config_from_table` for this
    device's table at this world size (None without either, or for a dtype the table does not cover), remembered like
    :func:`choose`'s answers."""
    path = table_path(device_name, world)
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        mtime = None

    def compute() -> Optional[int]:
        for r in _calibrated_rows(device_name, world, MATMUL_REDUCE_SCATTER, dtype):
            if (r["m"], r["k"], r["n"]) == (int(m), int(k), int(n)) and r.get("split_config") is not None:
                return int(r["split_config"])
        table = None if mtime is None else load_table(path)
        if table is None or dtype_name(dtype) != dtype_name(table.get("dtype", "bfloat16")):
            return None
        return split_config_from_table(table, int(m), int(k), int(n))

    return _remembered(_split_configs, (path, mtime, _calibration_version, int(m), int(k), int(n), str(dtype)),
                       compute)


def _choose(op: str, device_name: str, world: int, m: int, k: int, n: int, dtype, paths: Tuple[str, ...],
            path: str) -> Tuple[str, str]:
    return _choose_answered(op, device_name, world, m, k, n, dtype, paths, path)[:2]


def _choose_answered(op: str, device_name: str, world: int, m: int, k: int, n: int, dtype, paths: Tuple[str, ...],
                     path: str, kinds: Tuple[str, ...] = ("exact", "between", "above", "similar", "below")
                     ) -> Tuple[str, str, bool]:
    key = device_key(device_name)
    table = load_table(path)
    if table is None:
        return "sequential", f"no tuning table for {key} tp{int(world)}", False
    want = dtype_name(dtype)
    have = dtype_name(table.get("dtype", "bfloat16"))
    if want != have and not (want in _HALF_DTYPES and have in _HALF_DTYPES):
        return "sequential", f"the tuning table for {key} tp{int(world)} was measured in {have}, not {want}", True
    return _choose_from_table(table, op, int(m), int(k), int(n), tuple(paths), kinds)


_decisions: Dict[tuple, Decision] = {}


# The table answers that measured the call's own (K, N) around its M (or rule it out below the measured range);
# the others ("above" the range, a "similar" shape's row) are seeds (module docstring).
_MEASURED_KINDS = ("exact", "between", "below")
_SEED_KINDS = ("above", "similar")


def decide(op: str, device_name: str, world: int, m: int, k: int, n: int, dtype,
           paths: Tuple[str, ...] = PATHS) -> Decision:
    """The table where it measured this (K, N) around this M; else the calibrated rows (the same (K, N) at this M or
    between two measured Ms); else an estimate: the table's row above the measured range or of a similar shape (a
    seed), or the roofline (module docstring).  Remembered like :func:`choose`'s answers, and forgotten whenever a
    measured row or measured rates are added."""
    table_file = table_path(device_name, world)
    try:
        mtime = os.stat(table_file).st_mtime
    except OSError:
        mtime = None
    memo = (table_file, mtime, _calibration_version, op, int(m), int(k), int(n), str(dtype), tuple(paths))
    return _remembered(_decisions, memo,
                       lambda: _decide_all(op, device_name, world, int(m), int(k), int(n), dtype, tuple(paths),
                                           table_file))


def _calibrated_rows(device_name: str, world: int, op: str, dtype) -> List[dict]:
    want = dtype_name(dtype)
    family = _HALF_DTYPES if want in _HALF_DTYPES else (want,)
    op = canonical_op(op)
    with _lock:
        rows = list(_calibrated.get((device_key(device_name), int(world)), ()))
    return [r for r in rows if r["op"] == op and dtype_name(r["dtype"]) in family]


def _decide_all(op: str, device_name: str, world: int, m: int, k: int, n: int, dtype, paths: Tuple[str, ...],
                table_file: str) -> Decision:
    choice, reason, answered = _choose_answered(op, device_name, world, m, k, n, dtype, paths, table_file,
                                                _MEASURED_KINDS)
    if answered:
        return Decision(choice, reason, False)
    rows = _calibrated_rows(device_name, world, op, dtype)
    if rows:
        c, r, found = _choose_from_table({"entries": rows}, op, m, k, n, paths, kinds=("exact", "between"))
        if found:
            return Decision(c, f"calibrated on this device: {r}", False)
    seed, seed_reason, answered = _choose_answered(op, device_name, world, m, k, n, dtype, paths, table_file,
                                                   _SEED_KINDS)
    if answered:
        return Decision(seed, f"{seed_reason} (a seed: this shape was not measured)", True)
    return _estimate(op, device_name, world, m, k, n, dtype, paths, reason)


def _estimate(op: str, device_name: str, world: int, m: int, k: int, n: int, dtype, paths: Tuple[str, ...],
              why: str) -> Decision:
    fused_paths = [p for p in ("fused", "fused_copy", "fused_split") if p in paths]
    if dtype_name(dtype) not in _HALF_DTYPES:
        return Decision("sequential", f"{why}; no estimate for {dtype_name(dtype)}", True)
    if not fused_paths:
        return Decision("sequential", f"{why}; no fused path can run the call", True)
    rates = rates_for(device_name, world)
    seq, fused = roofline_ms(op, world, m, k, n, dtype, rates)
    gain = (seq - fused) / seq
    basis = (f"{why}; roofline ({rates.source}: {rates.matmul_tflops:.0f} TFLOP/s, {rates.link_gbps:.0f} GB/s, "
             f"{rates.latency_ms * 1e3:.0f} us) at M={m} K={k} N={n}: sequential {seq:.3f} ms, fused {fused:.3f} ms, "
             f"gain {gain * 100:+.1f}%")
    if wins(gain):
        return Decision(fused_paths[0], basis, True)
    return Decision("sequential", basis, True)


def lookup_description() -> str:
    """One line naming the rule, for logs."""
    return (
        f"exact (K,N) -> log-M interpolation/nearest M; else nearest log-flops with K and N each within "
        f"{SIMILAR_KN:g}x (flops within {MAX_FLOPS_RATIO:g}x); fused only if gain > {MIN_GAIN * 100:.0f}%"
    )

