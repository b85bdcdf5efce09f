"""Host cost of one call of the fused ops, per dispatch path (torchrun, any world size, CUDA).

A compiled model enqueues its kernels from the host; when a step's host work outruns the GPU, the GPU
idles and the op's device time no longer tells what the model pays.  For each shape and path this prints
(and writes as JSON):

  host_us    host time to enqueue one call while the GPU is kept busy by a sleep kernel (so no call can
             wait on the GPU; a call that synchronizes shows the sleep in this number);
  device_ms  device time of one call, events around it, host enqueue hidden by a sleep first;
  b2b_ms     wall time per call of ``--calls`` back-to-back calls, synchronized at the end: what a stream
             of such calls costs when host and device overlap.

Paths: ``fused``, ``auto`` and ``decomposed`` (``FLUXINDUCTOR_DISPATCH``), ``auto_asynctp`` (``auto`` with the
tuning field ``asynctp`` on), all through ``torch.ops.fluxinductor.*``; ``asynctp_op`` calls PyTorch's
``torch.ops.symm_mem.fused_*`` directly; ``nccl_seq`` is the functional collective then ``torch.mm``.
Operands have the sequence-parallel layout of a DTensor model, [1, S, H] sharded on dim 1.

The agreement across ranks (:mod:`fluxinductor.agreement`: one exchange on the first call of a signature, a set lookup
after): each path through ``torch.ops.fluxinductor`` is measured twice (``--agreement``), with the check
(``checked``) and with ``fluxinductor.agreement.check`` replaced by a no-op for the row (``bypassed``: no exchange and
no local checks; the op still builds the call's description).  Each such row also has

  first_us          host time of the signature's first call, the agreement and the dispatcher's plan forgotten
                    before it (the path's first call is made and discarded before, so that one-time set-up, a
                    workspace's growth or a communicator's start, is not in it), the device drained before and after;
  exchanges_first   agreement exchanges (``all_gather_object``) in that call: 1 when checked, 0 when bypassed;
  exchanges_steady  exchanges in all the calls after it (warm-up and the measured loops): 0;
  check_first_us    (checked) host time inside ``agreement.check`` in that first call: the exchange;
  check_us          (checked) median host time inside ``agreement.check`` of the calls after it: a set lookup and the
                    local checks.  The timer around the check adds well under a microsecond to the checked row's host_us.

A table at the end sets the two rows' host_us and first_us side by side.

Without CUDA (``--device cpu``, the default there) it runs on gloo with fp32 operands: the paths through
``torch.ops.fluxinductor`` (each runs the decomposition on CPU tensors) and ``nccl_seq`` (the functional collective
over gloo); host_us is then the median time of a whole call, device_ms and b2b_ms are not measured, and the CUDA-only
paths (``auto_asynctp``, ``asynctp_op``) are skipped.

``--tuning key=value[,...]`` sets kernel-tuning fields for the whole run (``fluxinductor.settings.set_tuning``).
``--profile PATH`` also runs cProfile over ``--calls`` calls of that path on rank 0 and prints the top
functions, so a slow path shows where its host time goes.

Usage: torchrun --nproc-per-node 4 benchmarks/probes/host_overhead.py --shapes rs:4096x8192x8192,ag:4096x8192x10240
       python -m torch.distributed.run --nproc-per-node 2 benchmarks/probes/host_overhead.py --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import platform
import pstats
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import add_tuning_argument, apply_tuning, git_sha, init_gpu_ranks, overridden, write_json  # noqa: E402

PATHS = ("nccl_seq", "decomposed", "fused", "auto", "auto_asynctp", "asynctp_op")
CUDA_ONLY_PATHS = ("auto_asynctp", "asynctp_op")
DEFAULT_SHAPES = {"cuda": "rs:4096x8192x8192,rs:4096x28672x8192,ag:4096x8192x10240,ag:4096x8192x57344",
                  "cpu": "rs:16x64x64,ag:16x64x64"}
DEFAULT_CALLS = {"cuda": 20, "cpu": 500}
AGREEMENT_VARIANTS = ("checked", "bypassed")
# The dispatch mode and kernel-tuning fields of each path through torch.ops.fluxinductor.
_PATH_SETTINGS = {
    "decomposed": ("decomposed", {}),
    "fused": ("fused", {}),
    "auto": ("auto", {"asynctp": False}),
    "auto_asynctp": ("auto", {"asynctp": True}),
}


@contextlib.contextmanager
def path_settings(path: str):
    """The dispatch mode and tuning of ``path`` for the ``with`` block (nothing for the paths that bypass it)."""
    mode, values = _PATH_SETTINGS.get(path, (None, {}))
    with overridden(**values, **({} if mode is None else {"dispatch": mode})):
        yield


def parse_shape(text: str):
    op, _, mkn = text.partition(":")
    if op not in ("ag", "rs") or not mkn:
        raise ValueError(f"shape {text!r}: expected ag:MxKxN or rs:MxKxN")
    m, k, n = (int(v) for v in mkn.split("x"))
    return op, m, k, n


@contextlib.contextmanager
def agreement_variant(variant, timer: List[float]):
    """For the ``with`` block (the ops look ``fluxinductor.agreement.check`` up at every call): ``bypassed``, the check
    is a no-op; ``checked``, it runs behind a timer that appends each call's seconds to ``timer``; None: untouched."""
    if variant is None:
        yield
        return
    from fluxinductor import agreement

    real = agreement.check

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            timer.append(time.perf_counter() - t0)

    agreement.check = timed if variant == "checked" else (lambda *args, **kwargs: None)
    try:
        yield
    finally:
        agreement.check = real


class ExchangeCounter:
    """Counts calls of ``torch.distributed.all_gather_object`` (the agreement's exchange) inside :meth:`counting`."""

    def __init__(self) -> None:
        self.count = 0
        self.active = False
        real = dist.all_gather_object

        def counted(*args, **kwargs):
            if self.active:
                self.count += 1
            return real(*args, **kwargs)

        dist.all_gather_object = counted

    @contextlib.contextmanager
    def counting(self):
        """Yields a dict whose ``exchanges`` is set, when the block ends, to the calls made in it."""
        before, self.active = self.count, True
        counted = {}
        try:
            yield counted
        finally:
            self.active = False
            counted["exchanges"] = self.count - before


def make_call(path: str, op: str, m: int, k: int, n: int, world: int, group_name: str, device):
    """A no-argument callable running one call of ``op`` (global shape m, k, n) on ``path``."""
    import torch.distributed._functional_collectives as funcol

    gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # torch 2.13 deprecates the *_tensor names (a FutureWarning per call) for *_single; older torch has only the former
    all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    if op == "ag":
        shard = torch.randn(1, m // world, k, device=device, dtype=dtype, generator=gen)
        weight = (torch.randn(n // world, k, device=device, dtype=dtype, generator=gen) / k**0.5).t()
        if path == "nccl_seq":
            return lambda: torch.matmul(all_gather(shard, 1, group_name), weight)
        if path == "asynctp_op":
            return lambda: torch.ops.symm_mem.fused_all_gather_matmul(shard, [weight], 1, group_name)
        fn = torch.ops.fluxinductor.all_gather_matmul
        return lambda: fn(shard, [weight], [None], 1, group_name, False)
    a = torch.randn(1, m, k // world, device=device, dtype=dtype, generator=gen)
    weight = (torch.randn(n, k // world, device=device, dtype=dtype, generator=gen) / k**0.5).t()
    if path == "nccl_seq":
        return lambda: reduce_scatter(torch.matmul(a, weight), "sum", 1, group_name)
    if path == "asynctp_op":
        return lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, weight, "sum", 1, group_name)
    fn = torch.ops.fluxinductor.matmul_reduce_scatter
    return lambda: fn(a, weight, None, "sum", 1, group_name)


def _wait(out):
    # funcol results are AsyncCollectiveTensors: wait so the collective is part of the call.
    t = out[0] if isinstance(out, (list, tuple)) else out
    if isinstance(t, (list, tuple)):
        t = t[0]
    return t.wait() if hasattr(t, "wait") else t


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_call(call, device, counter: ExchangeCounter, timer: List[float]) -> dict:
    """Host time of a signature's first call (the agreement and the dispatcher's plan forgotten first), the agreement
    exchanges it made and the time inside the check (``timer``, see :func:`agreement_variant`)."""
    from fluxinductor import agreement, dispatch

    agreement.forget()
    dispatch.clear_plans()
    _sync(device)
    dist.barrier()
    timer.clear()
    with counter.counting() as counted:
        t0 = time.perf_counter()
        _wait(call())
        first_us = (time.perf_counter() - t0) * 1e6
    _sync(device)
    return {"first_us": first_us, "exchanges_first": counted["exchanges"],
            "check_first_us": sum(timer) * 1e6 if timer else None}


def measure_cpu(call, calls: int) -> dict:
    """CPU tensors: each call runs to its end on the host, so host_us is the median time of one whole call."""
    for _ in range(3):
        _wait(call())
    dist.barrier()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        _wait(call())
        times.append((time.perf_counter() - t0) * 1e6)
    return {"host_us": statistics.median(times), "device_ms": None, "b2b_ms": None}


def measure(call, calls: int, sleep_cycles: int) -> dict:
    for _ in range(3):
        _wait(call())
    torch.cuda.synchronize()
    # host_us: enqueue `calls` calls behind a long sleep kernel.
    dist.barrier()
    torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    for _ in range(calls):
        _wait(call())
    host_us = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    # device_ms: one call at a time, host enqueue hidden.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device = []
    for _ in range(calls):
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles // 20)
        start.record()
        _wait(call())
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end))
    # b2b_ms: back-to-back calls, wall time.
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        _wait(call())
    torch.cuda.synchronize()
    b2b_ms = (time.perf_counter() - t0) * 1e3 / calls
    return {"host_us": host_us, "device_ms": statistics.median(device), "b2b_ms": b2b_ms}


def init_cpu_ranks():
    """Rank setup without CUDA: gloo, ``torch.ops.fluxinductor`` loaded.  Returns (rank, world, device, group name)."""
    dist.init_process_group("gloo")
    import fluxinductor.ops  # noqa: F401 - registers torch.ops.fluxinductor

    return dist.get_rank(), dist.get_world_size(), torch.device("cpu"), dist.group.WORLD.group_name


def run_row(args, text: str, path: str, variant, world: int, group_name: str, device, counter: ExchangeCounter,
            rank: int) -> dict:
    """One row: ``path`` for shape ``text``, with the agreement ``variant`` (None: a path that has none)."""
    op, m, k, n = parse_shape(text)
    row = {"op": op, "m": m, "k": k, "n": n, "path": path, "agreement": variant}
    timer: List[float] = []
    try:
        call = make_call(path, op, m, k, n, world, group_name, device)
        with agreement_variant(variant, timer):
            if variant is not None:
                _wait(call())  # the path's one-time set-up, outside first_us
                row.update(first_call(call, device, counter, timer))
            timer.clear()
            with counter.counting() as counted:
                row.update(measure(call, args.calls, args.sleep_cycles) if device.type == "cuda"
                           else measure_cpu(call, args.calls))
            if variant is not None:
                row["exchanges_steady"] = counted["exchanges"]
                row["check_us"] = statistics.median(timer) * 1e6 if timer else None
            if path == args.profile and variant != "bypassed":
                profile(call, args, text, path, device, rank)
    except Exception as e:  # noqa: BLE001 - one failing path does not end the run
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def profile(call, args, text: str, path: str, device, rank: int) -> None:
    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        _wait(call())
    prof.disable()
    _sync(device)
    if rank == 0:
        pstats.f8 = lambda x: f"{x * 1e6 / args.calls:8.1f}"  # us per call, not s in all
        for order in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(order).print_stats(args.profile_top)
            print(f"--- cProfile {text} {path} ({args.calls} calls), by {order} ---\n"
                  + "(tottime and cumtime in us per call)\n" + s.getvalue()[-9000:], flush=True)


def _cell(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def side_by_side(rows: List[dict]) -> List[str]:
    """host_us and first_us with the agreement checked and bypassed, per shape and path."""
    pairs: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        if r.get("agreement") in AGREEMENT_VARIANTS and "error" not in r:
            pairs.setdefault((r["op"], r["m"], r["k"], r["n"], r["path"]), {})[r["agreement"]] = r
    lines = [f"{'shape':22s} {'path':11s} {'host_us checked':>16s} {'bypassed':>9s} {'diff':>7s}   "
             f"{'first_us checked':>17s} {'bypassed':>9s} {'diff':>8s}   {'in check: first':>15s} {'later':>6s}   "
             "exchanges first/steady"]
    for (op, m, k, n, path), v in pairs.items():
        c, b = v.get("checked"), v.get("bypassed")
        if c is None or b is None:
            continue
        lines.append(f"{op}:{m}x{k}x{n:<10} {path:11s} {c['host_us']:16.1f} {b['host_us']:9.1f} "
                     f"{c['host_us'] - b['host_us']:7.1f}   {c['first_us']:17.1f} {b['first_us']:9.1f} "
                     f"{c['first_us'] - b['first_us']:8.1f}   {_cell(c.get('check_first_us'), '{:15.1f}')} "
                     f"{_cell(c.get('check_us'), '{:6.1f}')}   {c['exchanges_first']}/{c['exchanges_steady']} checked, "
                     f"{b['exchanges_first']}/{b['exchanges_steady']} bypassed")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu: gloo, fp32 operands, the CUDA-only paths skipped (default where CUDA is absent)")
    p.add_argument("--shapes", default=None, help=f"default: {DEFAULT_SHAPES['cuda']} (cpu: {DEFAULT_SHAPES['cpu']})")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--agreement", default=",".join(AGREEMENT_VARIANTS),
                   help="the agreement variants of each path through torch.ops.fluxinductor: checked, bypassed")
    p.add_argument("--calls", type=int, default=None, help=f"default: {DEFAULT_CALLS['cuda']} (cpu: "
                   f"{DEFAULT_CALLS['cpu']})")
    p.add_argument("--sleep-cycles", type=int, default=200_000_000, help="GPU sleep behind the host_us loop")
    p.add_argument("--profile", default=None, choices=PATHS, help="cProfile this path on rank 0")
    p.add_argument("--profile-top", type=int, default=25, help="entries printed per sort order of --profile")
    p.add_argument("--out", default=None, help="write JSON here (rank 0)")
    add_tuning_argument(p)
    args = p.parse_args(argv)
    variants = [v for v in args.agreement.split(",") if v]
    for v in variants:
        if v not in AGREEMENT_VARIANTS:
            p.error(f"--agreement: {v!r} is not one of {AGREEMENT_VARIANTS}")
    shapes = args.shapes or DEFAULT_SHAPES[args.device]
    args.calls = args.calls or DEFAULT_CALLS[args.device]

    rank, world, device, group_name = init_gpu_ranks() if args.device == "cuda" else init_cpu_ranks()
    tuning_values = apply_tuning(args.tuning)
    counter = ExchangeCounter()
    paths = [q for q in args.paths.split(",") if q]
    skipped = [q for q in paths if device.type != "cuda" and q in CUDA_ONLY_PATHS]
    if skipped and rank == 0:
        print(f"skipped without CUDA: {', '.join(skipped)}", flush=True)

    rows = []
    for text in shapes.split(","):
        for path in paths:
            if path in skipped:
                continue
            with path_settings(path):
                for variant in (variants or [None]) if path in _PATH_SETTINGS else [None]:
                    row = run_row(args, text, path, variant, world, group_name, device, counter, rank)
                    gathered = [None] * world
                    dist.all_gather_object(gathered, row)
                    if rank != 0:
                        continue
                    worst = dict(row)
                    for key in ("host_us", "device_ms", "b2b_ms", "first_us", "exchanges_first", "exchanges_steady",
                                "check_first_us", "check_us"):
                        vals = [g.get(key) for g in gathered if g.get(key) is not None]
                        worst[key] = max(vals) if vals else None
                    rows.append(worst)
                    label = path + ("" if variant is None else f"/{variant}")
                    first = "" if variant is None else (f"  first {_cell(worst.get('first_us'), '{:9.1f}')} us"
                                                        f"  in check {_cell(worst.get('check_us'), '{:5.1f}')} us")
                    print(f"{text:22s} {label:22s} host {_cell(worst.get('host_us'), '{:8.1f}')} us  device "
                          f"{_cell(worst.get('device_ms'), '{:7.3f}')} ms  b2b {_cell(worst.get('b2b_ms'), '{:7.3f}')} ms"
                          f"{first}  {worst.get('error', '')}", flush=True)
    if rank == 0:
        print("\nagreement checked vs bypassed (max over ranks):\n" + "\n".join(side_by_side(rows)), flush=True)
    if rank == 0 and args.out:
        sha, dirty = git_sha()
        name = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.processor() or 'unknown'})"
        write_json(args.out, {"schema": "fluxinductor.host_overhead/2", "device": name, "world": world,
                              "torch": torch.__version__, "git_sha": sha, "git_dirty": dirty,
                              "tuning": tuning_values, "calls": args.calls, "skipped_paths": skipped,
                              "note": "max over ranks; agreement: checked, bypassed (agreement.check a no-op) or "
                                      "null (a path that does not go through torch.ops.fluxinductor)",
                              "rows": rows})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
