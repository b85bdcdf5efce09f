"""Measure, once, what the cost model could only estimate: the device's rates, and which path is fastest at a shape.

Where no tuning table measured a shape (another GPU, another world size, a shape far from every measured one), the
cost model estimates: from a roofline (:func:`fluxinductor.cost_model.roofline_ms`), or from the row of a similar
shape or of a smaller M (a seed).  Under ``auto`` dispatch the fused op's
first call of such a shape then comes here, on every rank of the group (the dispatcher decides a signature's path once,
and the agreement check has made every rank's signature the same):

1. :func:`ensure_rates`: the device's matmul rate and the group's all-gather bandwidth and latency, timed once per
   device and world size (a 4096x8192x8192 GEMM, all-gathers of 4 KiB and 16 MiB per rank); the cost model's roofline
   uses them from then on.  If the roofline with these rates still says the fused paths lose, nothing more is timed.
2. :func:`choose_measured`: each candidate path (the sequential one, and every fused path the call can take) runs on
   the call's own operands: one warm-up call each, then :data:`ROUNDS` rounds that alternate the candidates, each call
   timed with CUDA events after a small all-reduce has lined the ranks up and a GPU sleep has let the host enqueue the
   whole call (device time, as the tables were measured; in a training or prefill step the host runs ahead).  A path's time is its median over the
   rounds, taken at the slowest rank (an all-reduce of the times with MAX), so every rank reaches the same verdict: the
   cost model's rule (a path must beat sequential by more than ``cost_model.MIN_GAIN``; a near tie keeps the first
   candidate).  The split GEMM+RS transport is timed in each of its GEMM configurations (:func:`split_candidate`);
   the row keeps the fastest (``split_config``), which the dispatcher then runs.

Both answers are kept in memory and in a cache on disk, ``<calibration_dir>/<device_key>_tp<world>.json`` (the tuning
field ``calibration_dir``; default ``$XDG_CACHE_HOME/fluxinductor`` or ``~/.cache/fluxinductor``), so the next process
measures nothing.  A cached answer is used only when every rank has it: the ranks exchange their cached times in one
small all-reduce (a rank without them sends a "missing" mark and all of them measure), so ranks that read the file at
different moments still agree.  The group's rank 0 writes the file (whole, through a rename), with what each
measurement cost its first call, in seconds (``measured_s`` of the rates, ``calibration_s`` of each shape's row).

Nothing here runs under CUDA graph capture (a capture records collectives instead of running them): a captured call
reuses what its eager warm-up measured.  ``settings.tuning.calibrate`` off leaves the roofline estimate as the answer.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from fluxinductor import cost_model, settings, tuning_table
from fluxinductor.log import logger as log
from fluxinductor.log import note_once

CACHE_FORMAT = 1
# Timed rounds per candidate (after one warm-up call each); the median is kept.
ROUNDS = 5
# The rate probes: GEMM (M, K, N) and the all-gather's bytes per rank (latency, bandwidth).
_RATE_GEMM = (4096, 8192, 8192)
_RATE_SMALL_BYTES = 4096
_RATE_LARGE_BYTES = 16 << 20
# The path timed per GEMM configuration (:func:`split_candidate`).
_SPLIT = "fused_split"

_lock = threading.Lock()
_verdicts: Dict[tuple, Tuple[str, Dict[str, float]]] = {}  # (device_key, world, op, m, k, n, dtype, candidates) ->
_rates_done: set = set()  # (device_key, world)

Timer = Callable[[Callable[[], object]], float]


def cache_dir() -> str:
    """The folder of the calibration cache (``settings.tuning.calibration_dir`` or the user's cache folder)."""
    if settings.tuning.calibration_dir:
        return settings.tuning.calibration_dir
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fluxinductor")


def cache_path(device_name: str, world: int) -> str:
    return os.path.join(cache_dir(), f"{cost_model.device_key(device_name)}_tp{int(world)}.json")


def forget() -> None:
    """Forget every measured answer held in memory (the cost model's too); the disk cache stays."""
    with _lock:
        _verdicts.clear()
        _rates_done.clear()
    cost_model.forget_calibration()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


# ---------------------------------------------------------------------------------------------------
# The disk cache.
# ---------------------------------------------------------------------------------------------------


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable calibration cache %s (%s)", path, e)
        return {}
    return data if data.get("format") == CACHE_FORMAT else {}


def _write_cache(path: str, device_name: str, world: int, update: Callable[[dict], None]) -> None:
    """Read the cache at ``path``, apply ``update`` to it, write it back whole (a rename: readers never see half)."""
    try:
        data = _read_cache(path) or {"format": CACHE_FORMAT, "device": device_name, "world": int(world),
                                     "entries": []}
        update(data)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the answers still hold for this process
        log.warning("could not write the calibration cache %s (%s)", path, e)


def _row_key(row: dict) -> tuple:
    return row["op"], row["m"], row["k"], row["n"], row["dtype"]


# ---------------------------------------------------------------------------------------------------
# Timing, and agreeing on times.
# ---------------------------------------------------------------------------------------------------


# GPU sleep before each timed call (cycles, about 0.5 ms): the host enqueues the whole call meanwhile, so the events
# time the device's work, as bench_ops.py timed the tables (in a training step the host runs ahead of the GPU).
_SLEEP_CYCLES = 1_000_000


def _timer(device: torch.device, group: dist.ProcessGroup) -> Timer:
    """Seconds of one call of ``fn``: on a GPU, its device time, the ranks lined up by an all-reduce and the host's
    enqueue hidden behind a GPU sleep; elsewhere wall time after a barrier."""
    if device.type == "cuda":
        line_up = torch.zeros(1, device=device)

        def cuda_time(fn: Callable[[], object]) -> float:
            dist.all_reduce(line_up, group=group)
            torch.cuda._sleep(_SLEEP_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return cuda_time

    def wall_time(fn: Callable[[], object]) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return wall_time


def _agree(values: Sequence[Optional[float]], device: torch.device, group: dist.ProcessGroup
           ) -> Optional[List[float]]:
    """Every rank's ``values`` (None: this rank lacks them) maxed over the group, or None if any rank lacks them."""
    missing = any(v is None for v in values)
    vector = torch.tensor([1.0 if missing else 0.0] + [0.0 if v is None else float(v) for v in values],
                          dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=group)
    vector = vector.tolist()
    return None if vector[0] > 0 else vector[1:]


# ---------------------------------------------------------------------------------------------------
# The device's rates.
# ---------------------------------------------------------------------------------------------------


def ensure_rates(device: torch.device, group_name: str, world: int, timer: Optional[Timer] = None
                 ) -> cost_model.Rates:
    """The device's measured rates for this world size (measured on the first call in the process, or read from the
    cache when every rank has them), handed to the cost model.  Every rank of the group must call it together."""
    name = _device_name(device)
    key = (cost_model.device_key(name), int(world))
    if key in _rates_done:
        return cost_model.rates_for(name, world)
    group = _group(group_name)
    path = cache_path(name, world)
    cached = _read_cache(path).get("rates") or {}
    fields = ("matmul_tflops", "link_gbps", "latency_ms")
    # Agreed as costs (1/rate, latency), maxed: the slowest rank's numbers.
    as_costs = lambda values: [1.0 / values[0], 1.0 / values[1], values[2]]  # noqa: E731 - its own inverse
    have = [cached.get(f) for f in fields]
    agreed = _agree(as_costs(have) if all(isinstance(v, (int, float)) and v > 0 for v in have) else [None] * 3,
                    device, group)
    source = "measured (cached)"
    seconds = None
    if agreed is None:
        started = time.perf_counter()
        measured = _measure_rates(device, group, world, timer or _timer(device, group))
        agreed = _agree(as_costs(measured), device, group)
        source, seconds = "measured", time.perf_counter() - started
    agreed = as_costs(agreed)
    if source == "measured" and group.rank() == 0:
        _write_cache(path, name, world,
                     lambda data: data.__setitem__("rates", {**dict(zip(fields, agreed)), "measured_s": seconds}))
    rates = cost_model.Rates(*agreed, source=source, memory_gbps=cost_model.nominal_rates(name).memory_gbps)
    cost_model.set_measured_rates(name, world, rates)
    with _lock:
        _rates_done.add(key)
    note_once(f"rates of {name} at tp{world}, {source}: GEMM {rates.matmul_tflops:.0f} TFLOP/s, all-gather "
              f"{rates.link_gbps:.0f} GB/s, latency {rates.latency_ms * 1e3:.0f} us")
    return rates


def _measure_rates(device: torch.device, group: dist.ProcessGroup, world: int, timer: Timer) -> List[float]:
    """[matmul TFLOP/s, all-gather GB/s received per rank, collective latency ms] of this rank."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    m, k, n = _RATE_GEMM if device.type == "cuda" else (256, 256, 256)
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    t_mm = _median(timer, lambda: torch.mm(a, b))

    def gather(nbytes: int) -> float:
        shard = torch.ones(nbytes // a.element_size(), device=device, dtype=dtype)
        out = shard.new_empty(shard.numel() * world)
        return _median(timer, lambda: dist.all_gather_into_tensor(out, shard, group=group))

    large = _RATE_LARGE_BYTES if device.type == "cuda" else 1 << 20
    t_small, t_large = gather(_RATE_SMALL_BYTES), gather(large)
    received = (large - _RATE_SMALL_BYTES) * (world - 1)
    link_gbps = received / max(t_large - t_small, 1e-9) / 1e9
    return [2.0 * m * k * n / t_mm / 1e12, link_gbps, t_small * 1e3]


def _median(timer: Timer, fn: Callable[[], object]) -> float:
    timer(fn)  # warm-up
    return statistics.median(timer(fn) for _ in range(ROUNDS))


# ---------------------------------------------------------------------------------------------------
# The fastest path at one shape.
# ---------------------------------------------------------------------------------------------------


def choose_measured(op: str, device: torch.device, group_name: str, world: int, m: int, k: int, n: int, dtype,
                    candidates: Dict[str, Callable[[], object]], timer: Optional[Timer] = None) -> Tuple[str, str]:
    """(path, reason): the fastest of ``candidates`` (zero-argument callables running each path on the call's
    operands; ``"sequential"`` must be one, and the order breaks near ties) at the global GEMM (m, k, n), measured on
    every rank and agreed (module docstring), remembered in memory and on disk.  Every rank of the group must call it
    with the same arguments at the same call, outside CUDA graph capture."""
    if "sequential" not in candidates:
        raise ValueError("choose_measured needs a 'sequential' candidate to measure the others against")
    name = _device_name(device)
    names = tuple(candidates)
    dtype_s = cost_model.dtype_name(dtype)
    key = (cost_model.device_key(name), int(world), op, int(m), int(k), int(n), dtype_s, names)
    with _lock:
        known = _verdicts.get(key)
    if known is None:
        known = _measure_or_read(op, device, group_name, world, int(m), int(k), int(n), dtype_s, candidates, name,
                                 timer)
        with _lock:
            _verdicts[key] = known
    path, times = known
    shown = ", ".join(f"{p} {times[p]:.3f} ms" for p in names)
    reason = f"measured at M={m} K={k} N={n}: {shown}"
    note_once(f"{op}: calibration chose {path}, {reason}")
    return path, reason


def _measure_or_read(op: str, device: torch.device, group_name: str, world: int, m: int, k: int, n: int, dtype: str,
                     candidates: Dict[str, Callable[[], object]], name: str, timer: Optional[Timer]
                     ) -> Tuple[str, Dict[str, float]]:
    group = _group(group_name)
    names = list(candidates)
    path = cache_path(name, world)
    cached = next((r for r in _read_cache(path).get("entries", []) if _row_key(r) == (op, m, k, n, dtype)), {})
    times = _agree([_cached_time(cached, p) for p in names], device, group)
    fresh = times is None
    if fresh:
        started = time.perf_counter()
        timer = timer or _timer(device, group)
        for fn in candidates.values():
            timer(fn)  # warm-up: workspaces, autotuned kernels, NCCL's first use of the shape
        samples: Dict[str, List[float]] = {p: [] for p in names}
        for _ in range(ROUNDS):
            for p, fn in candidates.items():
                samples[p].append(timer(fn) * 1e3)
        times = _agree([statistics.median(samples[p]) for p in names], device, group)
    by_name = dict(zip(names, times))
    k_per_rank = k // world
    by_path, configs = _fold(by_name, k_per_rank)
    choice = _verdict(by_path)
    row = {"op": op, "m": m, "k": k, "n": n, "dtype": dtype, "choice": choice,
           **{f"{p}_ms": t for p, t in by_path.items()}}
    if configs:
        row.update(split_config=_split_config(configs, k_per_rank), fused_split_config_ms=configs)
    if op in (cost_model.ALL_GATHER_MATMUL, cost_model.MATMUL_REDUCE_SCATTER):
        cost_model.add_calibrated_row(name, world, row)
    if fresh:
        # What measuring cost this rank's first call of the shape, warm-ups and agreement included: on disk and in the
        # log only (rank 0's), not in the cost model's rows, which every rank and process must hold alike.
        seconds = time.perf_counter() - started
        log.info("%s at M=%d K=%d N=%d: calibrated in %.2f s", op, m, k, n, seconds)
        if group.rank() == 0:
            def update(data: dict) -> None:
                data["entries"] = [r for r in data.get("entries", []) if _row_key(r) != _row_key(row)] + [
                    {**row, "calibration_s": seconds}]

            _write_cache(path, name, world, update)
    return choice, by_name


def _split_config(configs: Dict[str, float], k_per_rank: Optional[int] = None) -> int:
    """The configuration a row keeps (``tuning_table.kept_split_config``, as bench_ops keeps a table's), from the
    row's times per configuration and the call's K per rank."""
    return tuning_table.kept_split_config({int(c): t for c, t in configs.items()}, k_per_rank)


def split_candidate(config: int) -> str:
    """The candidate name that times the split GEMM+RS transport in one of its GEMM configurations; the row keeps one
    configuration (``split_config``), the path's time is that one's, and each one's is kept too
    (``fused_split_config_ms``), as a table's row does."""
    return f"{_SPLIT}@{int(config)}"


def parse_candidate(name: str) -> Tuple[str, Optional[int]]:
    """(path, configuration or None) of a candidate name (:func:`split_candidate`)."""
    path, _, config = name.partition("@")
    return path, int(config) if config else None


def _cached_time(row: dict, name: str) -> Optional[float]:
    path, config = parse_candidate(name)
    if config is None:
        return row.get(f"{path}_ms")
    return row.get(f"{path}_config_ms", {}).get(str(config))


def _fold(by_name: Dict[str, float], k_per_rank: Optional[int] = None) -> Tuple[Dict[str, float], Dict[str, float]]:
    """(each path's time, the split transport's time per configuration): a path timed in several configurations takes
    the time of the one the row keeps (``k_per_rank``: the call's, as :func:`_split_config` takes it)."""
    by_path: Dict[str, float] = {}
    configs: Dict[str, float] = {}
    for name, t in by_name.items():
        path, config = parse_candidate(name)
        if config is None:
            by_path[path] = t
        elif path != _SPLIT:
            raise ValueError(f"only the {_SPLIT} path is timed per configuration, not {path!r}")
        else:
            configs[str(config)] = t
            by_path.setdefault(path, t)  # the path's place among the candidates (near ties keep the first)
    if configs:
        by_path[_SPLIT] = configs[str(_split_config(configs, k_per_rank))]
    return by_path, configs


def _verdict(times: Dict[str, float]) -> str:
    """The cost model's rule (``cost_model.pick``, ``cost_model.wins``) on measured times, candidates in their order."""
    seq = times["sequential"]
    gains = {p: (seq - t) / seq for p, t in times.items() if p != "sequential"}
    if not gains or seq <= 0:
        return "sequential"
    best, gain = cost_model.pick(gains, list(gains))
    return best if cost_model.wins(gain) else "sequential"
