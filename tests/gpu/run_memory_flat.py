"""Two GPUs (torchrun, NCCL): memory stays flat across thousands of fused-op calls whose shape changes on every call.

    torchrun --nproc-per-node 2 tests/gpu/run_memory_flat.py [--calls 10000] [--auto-calls 2000] [--out DIR]

Calls ``torch.ops.fluxinductor.all_gather_matmul``, ``matmul_reduce_scatter`` and ``matmul_all_reduce`` with shapes
drawn (seeded, the same on every rank) from a set: rows per rank from :data:`ROWS` (1 to 8192, odd ones and tile edges
included, and a few seeded draws), (K, N) from :data:`DIMS`, a bias or none; no two consecutive calls have the same
shape.  Two passes: ``--calls`` calls under ``dispatch="fused"``, then ``--auto-calls`` under ``dispatch="auto"`` over
``--auto-rows`` of the row values (the largest among them: ``auto`` measures the paths of each new shape once,
:mod:`fluxinductor.calibration`, into a cache folder of its own under ``--out``).  Each pass starts with its first pass
over its shape set (every signature once, the largest shapes first), then draws at random.  Before the passes, a growth check calls ``all_gather_matmul`` with rows that double each time and holds
weak references to the symmetric buffers of each growth: an uncaptured growth must free the old ones.

Every ``--every`` (500) calls, on each rank: ``torch.cuda.memory_allocated`` / ``memory_reserved``, the device memory
in use outside the caching allocator (``mem_get_info``), the fused kernels' workspaces (AG+GEMM symmetric buffers:
``fluxinductor.kernels.symm.workspace_bytes()``; GEMM+RS symmetric buffer, its retired ones and the copy transport's
outbox; the one-shot all-reduce's buffers), the process RSS, and the host caches: the dispatcher's plans
(``dispatch._plans``), ``matmul_all_reduce``'s plans (``ops._all_reduce_plans``), the agreed signatures
(``agreement._agreed``), the AG+GEMM workspace's views, addresses and checked layouts, the GEMM+RS agreed signatures,
the calibration's verdicts, the fallback counters.

Results: every call of each pass's first pass and every ``--check-every``-th call after it is compared with an fp32
reference built from every rank's operands (each rank builds them all from the seed, so the reference needs no
communication); before a checked call fresh memory reads as NaN (``torch.empty`` filled, a freed NaN block, the
AG+GEMM symmetric buffers filled with 0xFF).

PASS when, on every rank: no result is wrong; in each pass, from the sample after its first pass to its end,
allocated, reserved and workspace bytes grow by at most max(1 % of the first value, 64 MiB) and RSS by at most 512 MiB;
the plan and agreement caches are within their caps (``_MAX_PLANS``, ``_MAX_AGREED``), hold no more entries than the
signatures called, and do not grow after each pass's first pass; an uncaptured growth freed the old symmetric buffers.
Writes ``DIR/memory_flat.json`` (rank 0: every rank's series, the verdict and its reasons); prints PASS or FAIL; exit
status 0 on PASS.

``--device cpu`` runs the same flow on gloo (the decomposed path; the device counters read 0) with small shapes: a dry
run of the script on a machine without GPUs.
"""

from __future__ import annotations

import os

# Before torch initializes CUDA: deterministic mode (which fills torch.empty with NaN) wants a fixed cuBLAS workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
import weakref  # noqa: E402
from typing import Dict, List, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared tolerances

from _dist import join_torchrun_group  # noqa: E402
from _fuzz import TOLERANCE  # noqa: E402

ROWS = (1, 2, 3, 7, 8, 63, 64, 65, 127, 128, 129, 255, 256, 257, 509, 511, 512, 513, 1021, 1023, 1024, 1025, 2047,
        2048, 2049, 3071, 4093, 4095, 4096, 4097, 6143, 8191, 8192)
EXTRA_ROWS = 8  # seeded draws from 1 .. --max-rows added to ROWS
DIMS = ((1024, 1024), (4096, 1536), (1536, 4096), (1032, 520))  # (K, N): N per rank for the all-gather's weight
CPU_DIMS = ((16, 8), (24, 40))
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
MIB = 1 << 20
GROWTH_FRACTION = 0.01
GROWTH_FLOOR = 64 * MIB
RSS_BOUND = 512 * MIB
NAN_BYTE = 0xFF  # a NaN in bf16, fp16 and fp32


# ---------------------------------------------------------------------------------------------------
# Operands and calls.
# ---------------------------------------------------------------------------------------------------


class Operands:
    """Every rank's operands, built on every rank from one seed: per K an activation of ``world * max_rows`` rows
    (calls take its first rows), per (K, N) a weight held K-major ([N, K] transposed, as nn.Linear's), per N a bias."""

    def __init__(self, world: int, device: torch.device, dtype: torch.dtype, max_rows: int, dims, seed: int):
        g = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=g, device=device)

        self.a = {k: [randn(world * max_rows, k).to(dtype) for _ in range(world)] for k in sorted({k for k, _ in dims})}
        self.w = {(k, n): [(randn(n, k) / math.sqrt(k)).to(dtype).t() for _ in range(world)] for k, n in dims}
        self.b = {n: [(0.1 * randn(n)).to(dtype) for _ in range(world)] for n in sorted({n for _, n in dims})}


def run_call(sig: tuple, ops: Operands, rank: int, world: int, group_name: str) -> torch.Tensor:
    op, rows, (k, n), bias = sig
    a, w = ops.a[k][rank], ops.w[(k, n)][rank]
    b = ops.b[n][rank] if bias else None
    if op == "all_gather_matmul":
        (out,), _ = torch.ops.fluxinductor.all_gather_matmul(a[:rows], [w], [b], 0, group_name, False)
        return out
    if op == "matmul_reduce_scatter":
        return torch.ops.fluxinductor.matmul_reduce_scatter(a[:world * rows], w, b, "sum", 0, group_name)
    return torch.ops.fluxinductor.matmul_all_reduce(a[:rows], w, b, "sum", group_name)


def reference(sig: tuple, ops: Operands, rank: int, world: int) -> torch.Tensor:
    """The call's result in fp32 from the same (rounded) operands of every rank."""
    op, rows, (k, n), bias = sig
    a = [ops.a[k][r] for r in range(world)]
    w = [ops.w[(k, n)][r].float() for r in range(world)]
    b = [ops.b[n][r].float() if bias else None for r in range(world)]

    def term(x: torch.Tensor, r: int) -> torch.Tensor:
        out = x.float() @ w[r]
        return out if b[r] is None else out + b[r]

    if op == "all_gather_matmul":
        return term(torch.cat([a[r][:rows] for r in range(world)]), rank)
    if op == "matmul_reduce_scatter":
        mine = slice(rank * rows, (rank + 1) * rows)
        return sum(term(a[r][:world * rows][mine], r) for r in range(world))
    return sum(term(a[r][:rows], r) for r in range(world))


def check(sig: tuple, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Optional[str]:
    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    out = out.float()
    if not torch.isfinite(out).all():
        return f"{int((~torch.isfinite(out)).sum())} non-finite values"
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    if not err <= TOLERANCE[dtype]:
        return f"relative error {err:.3g} > {TOLERANCE[dtype]}"
    return None


# ---------------------------------------------------------------------------------------------------
# Memory and caches.
# ---------------------------------------------------------------------------------------------------


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _one_shot_workspaces() -> list:
    try:
        from fluxinductor.kernels import one_shot
    except Exception:  # noqa: BLE001 - no one-shot kernel module: no workspace
        return []
    return list(getattr(one_shot, "_workspaces", {}).values())


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _gemm_rs_states() -> list:
    try:
        from fluxinductor.kernels import gemm_rs_group
    except Exception:  # noqa: BLE001 - no extension: no GEMM+RS state
        return []
    return list(gemm_rs_group._states.values())


def sample(device: torch.device) -> Dict[str, int]:
    """This rank's memory counters and host cache sizes now (after draining the device)."""
    from fluxinductor import agreement, calibration, dispatch, log, ops
    from fluxinductor.kernels import symm

    out: Dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        out.update(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device),
                   device_used=total - free)
        out["outside_allocator"] = out["device_used"] - out["reserved"]
    else:
        out.update(allocated=0, reserved=0, device_used=0, outside_allocator=0)
    states = _gemm_rs_states()
    out["ag_symmetric_bytes"] = symm.workspace_bytes()
    out["rs_symmetric_bytes"] = sum(s.capacity for s in states)
    out["rs_retired_bytes"] = sum(buf.numel() for s in states for buf, _ in s.retired)
    out["rs_outbox_bytes"] = sum(s.copy.outbox.numel() for s in states if s.copy is not None and s.copy.outbox is not None)
    one_shot = _one_shot_workspaces()
    out["one_shot_bytes"] = sum(_nbytes(ws.buffer) + _nbytes(ws.partials) + _nbytes(ws.signals)
                                + sum(_nbytes(buf) + _nbytes(partials) for buf, _, partials in ws.retired)
                                for ws in one_shot)
    out["workspace"] = sum(out[k] for k in ("ag_symmetric_bytes", "rs_symmetric_bytes", "rs_retired_bytes",
                                            "rs_outbox_bytes", "one_shot_bytes"))
    out["rss"] = _rss()
    out["plans"] = len(dispatch._plans)
    out["all_reduce_plans"] = len(getattr(ops, "_all_reduce_plans", ()))
    out["agreed"] = len(agreement._agreed)
    workspaces = list(symm._workspaces.values())
    out["ag_views"] = sum(len(ws._views) for ws in workspaces)
    out["ag_addresses"] = sum(len(ws._addresses) for ws in workspaces)
    out["ag_checked_layouts"] = sum(len(ws.checked_layouts) for ws in workspaces)
    out["ag_retired_buffers"] = sum(len(ws.retired) for ws in workspaces)
    out["rs_agreed"] = sum(len(s.agreed) for s in states)
    out["rs_retired_buffers"] = sum(len(s.retired) for s in states)
    out["fallback_keys"] = len(log._fallbacks)
    out["calibration_verdicts"] = len(getattr(calibration, "_verdicts", ()))
    return out


def poison(device: torch.device, nbytes: int) -> None:
    """Fresh memory reads as NaN for the next call: a freed NaN block of ``nbytes``, the AG+GEMM symmetric buffers
    filled with 0xFF bytes (every rank, then a barrier: no peer writes into them before they are filled)."""
    if device.type != "cuda":
        return
    from fluxinductor.kernels import symm

    big = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device=device)
    del big
    for ws in symm._workspaces.values():
        for buffer in ws.buffers:
            if buffer is not None:
                buffer.fill_(NAN_BYTE)
    torch.cuda.synchronize(device)
    dist.barrier()


# ---------------------------------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------------------------------


class Run:
    def __init__(self, args, rank: int, world: int, device: torch.device, group_name: str):
        self.args, self.rank, self.world, self.device, self.group_name = args, rank, world, device, group_name
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.dims = DIMS if device.type == "cuda" else CPU_DIMS
        rng = random.Random(args.seed)
        rows = {r for r in ROWS if r <= args.max_rows} | {args.max_rows}
        rows |= {rng.randint(1, args.max_rows) for _ in range(EXTRA_ROWS)}
        self.rows = sorted(rows, reverse=True)
        step = max(1, len(self.rows) // max(1, args.auto_rows))
        self.auto_rows = self.rows[::step][:args.auto_rows]  # the largest first
        self.ops = Operands(world, device, self.dtype, args.max_rows, self.dims, args.seed)
        # the largest output in fp32: the poison covers the blocks any output or reference may be handed next
        self.poison_bytes = world * args.max_rows * max(max(k, n) for k, n in self.dims) * 4
        self.calls = 0
        self.samples: List[Dict[str, object]] = []
        self.failures: List[str] = []
        self.checked = 0
        self.signatures: set = set()
        self.first_pass_end: Dict[str, int] = {}

    def shapes(self, rows: List[int]) -> List[tuple]:
        """Every signature of these rows, the largest rows first, consecutive ones never equal."""
        return [(op, r, dims, bias) for r in rows for dims in self.dims for op in OPS for bias in (False, True)]

    def one(self, sig: tuple, mode: str, checked: bool) -> None:
        if checked:
            poison(self.device, self.poison_bytes)
        out = run_call(sig, self.ops, self.rank, self.world, self.group_name)
        self.calls += 1
        self.signatures.add((mode,) + sig)
        if checked:
            self.checked += 1
            why = check(sig, out, reference(sig, self.ops, self.rank, self.world), self.dtype)
            if why is not None:
                self.failures.append(f"{mode} call {self.calls} {sig[0]} rows {sig[1]} (K, N) {sig[2]} "
                                     f"bias {sig[3]}: {why}")
        del out
        if self.calls % self.args.every == 0:
            self.record(mode)

    def record(self, mode: str, note: str = "") -> Dict[str, object]:
        s = {"call": self.calls, "pass": mode, "note": note, "signatures": len(self.signatures),
             "seconds": round(time.monotonic() - self.start, 2), **sample(self.device)}
        self.samples.append(s)
        return s

    def growth_check(self) -> Dict[str, object]:
        """AG+GEMM calls (fused) whose rows double, from 1 MiB of symmetric buffer to the largest K's: at each growth
        the old buffers' weak references must die (unless a call was captured, which keeps them)."""
        from fluxinductor import settings
        from fluxinductor.kernels import symm

        k, n = self.dims[0]
        out = {"growths": 0, "old_buffers_alive": 0, "captured": False, "capacities": []}
        rows = max(1, MIB // (self.world * k * self.dtype.itemsize))
        with settings.override(dispatch="fused"), torch.no_grad():
            while rows <= self.args.max_rows:
                ws = symm.existing_workspace(self.group_name, self.device) if self.device.type == "cuda" else None
                before = ws.capacity_bytes if ws is not None else 0
                old = [weakref.ref(b) for b in (ws.buffers if ws is not None else []) if b is not None]
                self.one(("all_gather_matmul", rows, (k, n), False), "growth", checked=True)
                ws = symm.existing_workspace(self.group_name, self.device) if self.device.type == "cuda" else None
                if ws is not None and ws.capacity_bytes > before:
                    out["capacities"].append(ws.capacity_bytes)
                    if old:
                        out["growths"] += 1
                        out["old_buffers_alive"] += sum(ref() is not None for ref in old)
                    out["captured"] = ws.captured
                rows *= 2
        return out

    def run_pass(self, mode: str, calls: int) -> Dict[str, object]:
        from fluxinductor import settings

        rng = random.Random(f"{self.args.seed}/{mode}")
        rows = self.auto_rows if mode == "auto" else self.rows
        shapes = self.shapes(rows)
        first = min(calls, len(shapes))
        previous = None
        start_call = self.calls
        with settings.override(dispatch=mode), torch.no_grad():
            for sig in shapes[:first]:
                self.one(sig, mode, checked=True)
            baseline = self.record(mode, "after the first pass")
            self.first_pass_end[mode] = self.calls
            previous = shapes[first - 1]
            for i in range(calls - first):
                sig = previous
                while sig == previous:
                    sig = (rng.choice(OPS), rng.choice(rows), rng.choice(self.dims), rng.random() < 0.5)
                self.one(sig, mode, checked=i % self.args.check_every == 0)
                previous = sig
            end = self.record(mode, "end of the pass")
        return {"calls": self.calls - start_call, "first_pass_calls": first, "baseline": baseline, "end": end}

    def verdict(self, passes: Dict[str, Dict[str, object]], growth: Dict[str, object]) -> List[str]:
        """This rank's reasons to fail (empty: passed)."""
        from fluxinductor import agreement, dispatch, ops

        reasons = list(self.failures[:50])
        if len(self.failures) > 50:
            reasons.append(f"... {len(self.failures) - 50} more wrong results")
        for mode, p in passes.items():
            base = p["baseline"]
            after = [s for s in self.samples if s["pass"] == mode and s["call"] >= base["call"]]
            for key in ("allocated", "reserved", "workspace"):
                bound = max(GROWTH_FRACTION * base[key], GROWTH_FLOOR)
                grew = max(s[key] for s in after) - base[key]
                p[f"{key}_growth"] = grew
                if grew > bound:
                    reasons.append(f"{mode}: {key} grew {grew / MIB:.1f} MiB after the first pass (bound "
                                   f"{bound / MIB:.1f} MiB; {base[key] / MIB:.1f} -> {max(s[key] for s in after) / MIB:.1f})")
            grew = max(s["rss"] for s in after) - base["rss"]
            p["rss_growth"] = grew
            if grew > RSS_BOUND:
                reasons.append(f"{mode}: RSS grew {grew / MIB:.1f} MiB after the first pass (bound {RSS_BOUND / MIB:.0f})")
            for key in ("plans", "all_reduce_plans", "agreed"):
                grown = [s for s in after if s[key] != base[key]]
                if grown:
                    reasons.append(f"{mode}: {key} cache grew after the first pass over every shape: {base[key]} -> "
                                   f"{grown[-1][key]} at call {grown[-1]['call']}")
        caps = {"plans": dispatch._MAX_PLANS, "all_reduce_plans": getattr(ops, "_MAX_PLANS", dispatch._MAX_PLANS),
                "agreed": agreement._MAX_AGREED}
        for s in self.samples:
            for key, cap in caps.items():
                if s[key] > cap:
                    reasons.append(f"call {s['call']}: {key} cache over its cap: {s[key]} > {cap}")
                if s[key] > s["signatures"]:
                    reasons.append(f"call {s['call']}: {key} cache holds more entries ({s[key]}) than the "
                                   f"{s['signatures']} signatures called")
        if growth["old_buffers_alive"] and not growth["captured"]:
            reasons.append(f"{growth['old_buffers_alive']} old symmetric buffers alive after "
                           f"{growth['growths']} uncaptured growths")
        return reasons


def _git() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001
        return os.environ.get("FLUXINDUCTOR_GIT_SHA", "unknown")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10000, help="calls under dispatch=fused")
    parser.add_argument("--auto-calls", type=int, default=2000, help="calls under dispatch=auto (0: none)")
    parser.add_argument("--auto-rows", type=int, default=12, help="row values the auto pass draws from")
    parser.add_argument("--every", type=int, default=500, help="record memory every this many calls")
    parser.add_argument("--check-every", type=int, default=10,
                        help="after a pass's first pass, compare every this many-th result with the reference")
    parser.add_argument("--max-rows", type=int, default=None, help="rows per rank at most (default 8192; cpu 64)")
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument("--pg-timeout", type=float, default=120.0, help="seconds a collective may wait")
    parser.add_argument("--no-fill-empty", action="store_true", help="leave torch.empty unfilled")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run on gloo")
    parser.add_argument("--out", default="memory_flat_out", help="folder for memory_flat.json")
    args = parser.parse_args()
    if args.max_rows is None:
        args.max_rows = 8192 if args.device == "cuda" else 64

    device, rank, world, group_name = join_torchrun_group(args.device, args.pg_timeout)

    import fluxinductor.ops  # noqa: F401 - registers torch.ops.fluxinductor
    from fluxinductor import log, settings

    warnings.filterwarnings("ignore", message=".*deterministic.*")
    warnings.filterwarnings("ignore", message=".*allow_tf32.*")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference: IEEE fp32
    if not args.no_fill_empty and device.type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    # auto's calibration measures each new shape once and caches it on disk: a folder of this run's own, so the run
    # neither reads nor adds to the user's cache
    calibration_dir = os.path.abspath(os.path.join(args.out, "calibration"))
    if rank == 0:
        shutil.rmtree(calibration_dir, ignore_errors=True)
    dist.barrier()
    settings.set_tuning(peer_check_timeout_s=args.pg_timeout, calibration_dir=calibration_dir)
    from fluxinductor.kernels import extension_available

    unavailable = extension_available() if device.type == "cuda" else "CPU tensors"
    kernels = "loaded" if unavailable is None else f"unavailable ({unavailable})"

    run = Run(args, rank, world, device, group_name)
    run.start = time.monotonic()
    run.record("start")
    growth = run.growth_check()
    passes: Dict[str, Dict[str, object]] = {"fused": run.run_pass("fused", args.calls)}
    if args.auto_calls > 0:
        passes["auto"] = run.run_pass("auto", args.auto_calls)
    reasons = run.verdict(passes, growth)
    if unavailable is None:
        if run.samples[-1]["workspace"] == 0:
            reasons.append("no fused kernel ran (the workspaces are empty)")
        if growth["growths"] == 0:
            reasons.append("the growth check saw no growth of the AG+GEMM symmetric buffers")
    elapsed = time.monotonic() - run.start
    mine = {"rank": rank, "reasons": reasons, "samples": run.samples, "passes": passes, "growth_check": growth,
            "calls": run.calls, "checked": run.checked, "wrong": len(run.failures),
            "signatures": len(run.signatures), "fallbacks": log.rewrite_stats()["fallbacks"], "seconds": elapsed}
    everyone: List[Optional[Dict[str, object]]] = [None] * world
    dist.all_gather_object(everyone, mine)
    passed = all(not r["reasons"] for r in everyone)
    if rank == 0:
        summary = {
            "schema": "fluxinductor.memory_flat/1",
            "what": "fused ops called with a shape that changes every call: memory, workspaces and host caches "
                    "sampled every --every calls, results checked against an fp32 reference",
            "command": "torchrun --nproc-per-node 2 tests/gpu/run_memory_flat.py " + " ".join(sys.argv[1:]),
            "git": _git(), "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "world": world, "kernels": kernels, "dtype": str(run.dtype).replace("torch.", ""),
            "rows": run.rows, "dims (K, N)": [list(d) for d in run.dims], "ops": list(OPS),
            "bounds": {"allocated, reserved, workspace": f"max({GROWTH_FRACTION:.0%} of the value after the first "
                       f"pass, {GROWTH_FLOOR // MIB} MiB)", "rss": f"{RSS_BOUND // MIB} MiB",
                       "caches": "within their caps, no more entries than signatures called, no growth after the "
                                 "first pass"},
            "passed": passed, "seconds": round(elapsed, 1), "ranks": everyone,
        }
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "memory_flat.json")
        with open(path, "w") as f:
            json.dump(summary, f, indent=1, default=str)
            f.write("\n")
        _print_summary(summary, path)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if passed else 1


def _print_summary(summary: Dict[str, object], path: str) -> None:
    print(f"memory_flat on {summary['device']} x{summary['world']}, kernels {summary['kernels']}, "
          f"{summary['seconds']} s")
    for r in summary["ranks"]:
        g = r["growth_check"]
        print(f" rank {r['rank']}: {r['calls']} calls ({r['signatures']} signatures), {r['checked']} checked, "
              f"{r['wrong']} wrong; growth check: {g['growths']} growths, {g['old_buffers_alive']} old buffers "
              f"alive, capacities {g['capacities']}")
        for mode, p in r["passes"].items():
            b, e = p["baseline"], p["end"]
            print(f"  {mode:5s} {p['calls']} calls: after first pass -> end: allocated {_mib(b['allocated'])} -> "
                  f"{_mib(e['allocated'])}, reserved {_mib(b['reserved'])} -> {_mib(e['reserved'])}, workspace "
                  f"{_mib(b['workspace'])} -> {_mib(e['workspace'])}, outside allocator "
                  f"{_mib(b['outside_allocator'])} -> {_mib(e['outside_allocator'])}, rss {_mib(b['rss'])} -> "
                  f"{_mib(e['rss'])}; plans {b['plans']} -> {e['plans']}, all-reduce plans "
                  f"{b['all_reduce_plans']} -> {e['all_reduce_plans']}, agreed {b['agreed']} -> {e['agreed']}, "
                  f"ag views {b['ag_views']} -> {e['ag_views']}, fallback keys {b['fallback_keys']} -> "
                  f"{e['fallback_keys']}")
        for why in r["reasons"][:20]:
            print(f"  FAIL rank {r['rank']}: {why}")
    print(("PASS" if summary["passed"] else "FAIL") + f" memory_flat: {path}", flush=True)


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}M"


if __name__ == "__main__":
    sys.exit(main())
