"""Two GPUs (torchrun, NCCL): the seeded fuzz of tests/_fuzz.py through the fused ops, against an fp32 reference.

    torchrun --nproc-per-node 2 tests/gpu/run_fuzz_2rank.py --cases 10000 --out DIR

Each case (seeds ``--first-seed`` on, or ``--seeds``) draws M (rows per rank) from :data:`SIZES` (tile edges and
primes up to 4097), K and N from :data:`DIM_SIZES` (the same and more multiples of 8), redrawn until M * K * N of the global problem is at most ``--max-work`` (2^31), a dtype (bf16,
fp16, fp32), a bias or none, transposed and strided operands, gather and scatter dims of 3-D operands, 1-3 weights per
all-gather, ``sum`` / ``avg``, an fp32 ``out_dtype`` for half inputs; every rank builds every rank's operands on its
GPU from the seed (the ranks compare a checksum of them), so the reference needs no communication.  Each case runs
under each of ``--modes``:

* ``fused``: ``settings.override(dispatch="fused")`` plus the case's kernel tuning, cycled by seed (``seed % len``):
  the GEMM+RS transport for ``matmul_reduce_scatter`` and the split ``matmul_all_reduce`` (:data:`RS_TUNINGS`: NVLink
  stores, copy engine, split with either GEMM configuration, copy engine with one band), the AG+GEMM variant and
  waits for ``all_gather_matmul`` (:data:`AG_TUNINGS`); calls the kernels cannot take (fp32, K not a multiple of 8,
  ...) run the decomposition;
* ``auto``: the cost model's choice (no tuning); ``decomposed``: NCCL then cuBLAS.

Before each run fresh memory reads as NaN: ``torch.empty`` fills (``torch.use_deterministic_algorithms`` with
``fill_uninitialized_memory``), a ``--poison-mib`` tensor and tensors of the outputs' sizes are filled with NaN and
freed (the caching allocator hands their blocks out next), and the kernels' workspaces are filled with 0xFF bytes
(NaN in every dtype): both AG+GEMM symmetric buffers, the GEMM+RS buffer's slots of the case's layout, the copy
transport's outbox, the tail split's partial sums.  After each run: the kernels' error words, every output's shape,
dtype and error against the reference within ``_fuzz.TOLERANCE``, and the inputs unchanged.  Which path ran (the
kernel and its transport or variant, or the decomposition and why) is recorded per call.

Memory: ``torch.cuda.memory_allocated`` / ``max_memory_reserved`` and the workspaces' sizes after case ``--memory-at``
(1000) and at the end; growth of the allocated bytes beyond the workspaces' own growth counts as a failure.

Writes ``DIR/fuzz_gpu.json`` (rank 0: counts per mode / op / dtype / path, fallback reasons, worst errors, failures
each with its seed and a reproduction line, memory, timing) and ``DIR/fuzz_gpu_rank<r>.log``; prints a summary.  Exit
status 0 when every run of every case passed on every rank, 1 otherwise, 2 when a CUDA error stopped the run.  Every
wait is bounded: the kernels' by ``FLUXINDUCTOR_TIMEOUT_S``, the process group's collectives by ``--pg-timeout``.

``--device cpu`` runs the same flow on gloo (the decomposed path only, no poison of GPU memory): a dry run of the
script itself on a machine without GPUs (with a small ``--max-work``).
"""

from __future__ import annotations

import os

# Before torch initializes CUDA: deterministic mode (which fills torch.empty with NaN) wants a fixed cuBLAS workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from typing import Dict, List, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared fuzz

import _fuzz  # noqa: E402
from _dist import join_torchrun_group  # noqa: E402

# Rows per rank: around the kernels' tiles (64, 128, 256 rows), primes, up to 4097.
SIZES = (1, 7, 8, 64, 127, 128, 129, 255, 256, 257, 383, 509, 1021, 1023, 1024, 1025, 2039, 2047, 4093, 4095, 4096,
         4097)
# K and N: the same and more multiples of 8 (16-byte rows: the kernels' TMA needs them, other sizes decompose), so
# that about half the half-precision cases can run fused.
DIM_SIZES = SIZES + (16, 24, 64, 128, 136, 256, 264, 384, 520, 1024, 1032, 1536, 2056, 3072, 4096)
MODES = ("fused", "auto", "decomposed")
# Kernel tuning cycled over the cases under dispatch="fused" (every rank sets the same: the cycle is the seed's).
RS_TUNINGS = ({"gemm_rs_push": "store"}, {"gemm_rs_push": "copy"}, {"gemm_rs_push": "split"},
              {"gemm_rs_push": "split", "gemm_rs_split_config": 2}, {"gemm_rs_push": "copy", "gemm_rs_bands": 1})
AG_TUNINGS = ({}, {"ag_variant": 6}, {"ag_variant": 0}, {"ag_k_chunks": 1}, {"ag_tail_split": 1})
FIRST_SEED = 5_000_000
NAN_BYTE = 0xFF  # 0xFFFF is a NaN in bf16 and fp16, 0xFFFFFFFF in fp32


def _tuning_text(tuning: Dict[str, object]) -> str:
    return ",".join(f"{k}={v}" for k, v in tuning.items())


def _case_tuning(case: Dict[str, object], mode: str, forced: Optional[Dict[str, object]]) -> Dict[str, object]:
    if forced is not None:
        return dict(forced)
    if mode != "fused":
        return {}
    cycle = AG_TUNINGS if case["op"] == "all_gather_matmul" else RS_TUNINGS
    return dict(cycle[case["seed"] % len(cycle)])


# ---------------------------------------------------------------------------------------------------
# Which path a call ran: the kernel entry points and the fallback notes, wrapped.
# ---------------------------------------------------------------------------------------------------


class PathRecorder:
    """Records, per call of a fused op, the kernels it ran (GEMM+RS with its effective transport, AG+GEMM push or
    pull with its variant) and the fallbacks it noted (decomposed or async-TP, with the reason)."""

    def __init__(self) -> None:
        self.events: List[tuple] = []
        self.kernels_reason: Optional[str] = None
        from fluxinductor import dispatch, ops

        def recorded_fallback(real):
            def record_fallback(op, reason, path="decomposed"):
                self.events.append(("fallback", path, reason))
                return real(op, reason, path)
            return record_fallback

        dispatch.record_fallback = recorded_fallback(dispatch.record_fallback)
        ops.record_fallback = recorded_fallback(ops.record_fallback)
        try:
            from fluxinductor.kernels import ag_gemm, gemm_rs
        except Exception as e:  # noqa: BLE001 - no extension: every call decomposes, and the summary says why
            self.kernels_reason = f"{type(e).__name__}: {e}"
            return
        self.ag_gemm, self.gemm_rs = ag_gemm, gemm_rs
        real_rs, real_ag = gemm_rs.matmul_reduce_scatter, ag_gemm.all_gather_matmul
        prepare_rs, prepare_ag = gemm_rs.prepare_matmul_reduce_scatter, ag_gemm.prepare_all_gather_matmul

        def matmul_reduce_scatter(a2d, weight, bias, reduce_op, group_name, **kwargs):
            self.events.append(("kernel", self._rs_transport(a2d, weight, bias, group_name, kwargs)))
            return real_rs(a2d, weight, bias, reduce_op, group_name, **kwargs)

        def all_gather_matmul(shard2d, weights, biases, group_name, return_gathered, **kwargs):
            self.events.append(("kernel", self._ag_variant(shard2d, weights, group_name)))
            return real_ag(shard2d, weights, biases, group_name, return_gathered, **kwargs)

        # The dispatcher runs a signature's calls through the function these prepare (its first call and its
        # replays) wherever they return one, and the two functions above only where they return None.
        def prepare_matmul_reduce_scatter(a2d, weight, bias, reduce_op, group_name, **kwargs):
            run = prepare_rs(a2d, weight, bias, reduce_op, group_name, **kwargs)
            return self._recorded(run, lambda: self._rs_transport(a2d, weight, bias, group_name, kwargs))

        def prepare_all_gather_matmul(shard2d, weights, biases, group_name, return_gathered, *args, **kwargs):
            run = prepare_ag(shard2d, weights, biases, group_name, return_gathered, *args, **kwargs)
            return self._recorded(run, lambda: self._ag_variant(shard2d, weights, group_name))

        gemm_rs.matmul_reduce_scatter = matmul_reduce_scatter
        ag_gemm.all_gather_matmul = all_gather_matmul
        gemm_rs.prepare_matmul_reduce_scatter = prepare_matmul_reduce_scatter
        ag_gemm.prepare_all_gather_matmul = prepare_all_gather_matmul

    def _recorded(self, run, label):
        """``run`` (a prepared call, or None), recording its kernel (``label()``, taken now) at each call."""
        if run is None:
            return None
        path = label()

        def recorded(*args, **kwargs):
            self.events.append(("kernel", path))
            return run(*args, **kwargs)

        return recorded

    def _rs_transport(self, a2d, weight, bias, group_name, kwargs) -> str:
        gemm_rs = self.gemm_rs
        mode = gemm_rs.push_mode(kwargs.get("transport", "store"))
        if mode == "split":
            world = dist.get_world_size(_group(group_name))
            if gemm_rs.split_reason(world, weight, bias, None, kwargs.get("out_dtype")) is not None:
                return "gemm_rs:copy (split declined)"
            return f"gemm_rs:split{gemm_rs.resolve_split_config(a2d.dtype, kwargs.get('split_config_choice'))}"
        return f"gemm_rs:{mode}"

    def _ag_variant(self, shard2d, weights, group_name) -> str:
        ag_gemm = self.ag_gemm
        push = ag_gemm.use_push(shard2d, weights)
        world = dist.get_world_size(_group(group_name))
        try:
            variants = sorted({ag_gemm.kernel_variant(shard2d.dtype, w, world * shard2d.shape[0], shard2d.shape[0])
                               for w in weights})
        except Exception:  # noqa: BLE001 - the label only
            variants = ["?"]
        return f"ag_gemm:{'push' if push else 'pull'}/v{','.join(map(str, variants))}"

    def path(self) -> str:
        kernels = [e[1] for e in self.events if e[0] == "kernel"]
        if kernels:
            return "+".join(dict.fromkeys(kernels))
        if any(e[1] != "decomposed" for e in self.events if e[0] == "fallback"):
            return "asynctp"
        return "decomposed"

    def reasons(self) -> List[str]:
        return [e[2] for e in self.events if e[0] == "fallback" and e[1] == "decomposed"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


# ---------------------------------------------------------------------------------------------------
# Poison and memory.
# ---------------------------------------------------------------------------------------------------


def _output_bytes(case: Dict[str, object]) -> List[int]:
    """Bytes of each tensor the op allocates for its results (the fused path's outputs and gathered input)."""
    world, dtype = case["world"], case["dtype"]
    size = torch.tensor([], dtype=case.get("out_dtype") or dtype).element_size()
    if case["op"] == "all_gather_matmul":
        rows = world * case["shards"][0].numel() // case["k"]
        return [rows * w.shape[1] * size for w in case["weights"][0]] + [rows * case["k"] * size]
    rows = case["partials"][0].numel() // case["k"]
    if case["op"] == "matmul_reduce_scatter":
        rows //= world
    return [rows * case["n"] * size, rows * case["n"] * size * world]


def poison(case: Dict[str, object], device: torch.device, poison_bytes: int, group_name: str) -> None:
    """Fill freed caching-allocator blocks and the kernels' workspaces with NaN (see the module docstring)."""
    if device.type != "cuda":
        return
    big = torch.full((poison_bytes // 4,), float("nan"), dtype=torch.float32, device=device)
    small = [torch.full((max(1, n // 4),), float("nan"), dtype=torch.float32, device=device)
             for n in _output_bytes(case)]
    del big, small
    try:
        from fluxinductor.kernels import gemm_rs, symm, tail_split
    except Exception:  # noqa: BLE001 - no extension, no workspaces
        return
    for ws in symm._workspaces.values():
        for buffer in ws.buffers:
            if buffer is not None:
                buffer.fill_(NAN_BYTE)
    if case["op"] != "all_gather_matmul" and case["dtype"] in (torch.bfloat16, torch.float16):
        m = case["partials"][0].numel() // case["k"]
        _, data_offset, end = gemm_rs.buffer_layout(m, case["n"], case["world"], case["dtype"])
        state = gemm_rs._states.get((group_name, device.index))
        if state is not None and state.buffer is not None:
            state.buffer[data_offset:min(end, state.capacity)].fill_(NAN_BYTE)
    for state in gemm_rs._states.values():
        if state.copy is not None and state.copy.outbox is not None:
            state.copy.outbox.fill_(NAN_BYTE)
    for scratch in tail_split._scratch.values():
        scratch.partials.fill_(float("nan"))


def memory(device: torch.device) -> Dict[str, int]:
    """The caching allocator's counters and the fused kernels' persistent workspaces, in bytes (counts of retired
    buffers: kept after a growth, freed never)."""
    if device.type != "cuda":
        return {"memory_allocated": 0}
    torch.cuda.synchronize(device)
    out = {"memory_allocated": torch.cuda.memory_allocated(device),
           "memory_reserved": torch.cuda.memory_reserved(device),
           "max_memory_reserved": torch.cuda.max_memory_reserved(device)}
    try:
        from fluxinductor.kernels import gemm_rs, symm, tail_split
    except Exception:  # noqa: BLE001
        return out
    out["ag_symmetric_bytes"] = sum(2 * ws.capacity_bytes for ws in symm._workspaces.values())
    out["ag_retired_buffers"] = sum(len(ws.retired) for ws in symm._workspaces.values())
    out["rs_symmetric_bytes"] = sum(s.capacity for s in gemm_rs._states.values())
    out["rs_retired_buffers"] = sum(len(s.retired) for s in gemm_rs._states.values())
    out["rs_outbox_bytes"] = sum(s.copy.outbox.numel() for s in gemm_rs._states.values()
                                 if s.copy is not None and s.copy.outbox is not None)
    out["tail_split_scratch_bytes"] = sum(s.partials.numel() * 4 + s.flags.numel() * 4
                                          for s in tail_split._scratch.values())
    return out


def memory_growth(at: Dict[str, int], end: Dict[str, int]) -> Dict[str, object]:
    """Each counter's growth, and the allocated bytes' growth beyond the workspaces' (``unexplained_bytes``)."""
    growth = {k: end.get(k, 0) - at.get(k, 0) for k in end}
    workspaces = sum(growth.get(k, 0) for k in ("rs_outbox_bytes", "tail_split_scratch_bytes", "ag_symmetric_bytes",
                                                "rs_symmetric_bytes"))
    growth["unexplained_bytes"] = max(0, growth["memory_allocated"] - max(0, workspaces))
    return growth


# ---------------------------------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------------------------------


def _flat(items) -> List[torch.Tensor]:
    return [t for item in items for t in (item if isinstance(item, list) else [item]) if t is not None]


def _rank_inputs(case: Dict[str, object], rank: int) -> List[torch.Tensor]:
    """The operands ``rank`` passes to the op."""
    key = "shards" if case["op"] == "all_gather_matmul" else "partials"
    return _flat([case[key][rank], case["weights"][rank], case["biases"][rank]])


def _checksum(case: Dict[str, object]) -> float:
    """A sum over every rank's operands: the ranks compare it (each built them all from the seed)."""
    key = "shards" if case["op"] == "all_gather_matmul" else "partials"
    tensors = _flat(list(case[key]) + list(case["weights"]) + list(case["biases"]))
    return float(sum(t.double().sum() for t in tensors).item())


def _reduced(values: List[float], device: torch.device, op=dist.ReduceOp.MAX) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _normalized(reason: str) -> str:
    return re.sub(r"\d+", "#", reason)


def _repro(seed: int, mode: str, tuning: Dict[str, object], args) -> str:
    line = (f"torchrun --nproc-per-node 2 tests/gpu/run_fuzz_2rank.py --seeds {seed} --modes {mode} "
            f"--max-work {args.max_work} --out /tmp/fuzz_repro")
    return line + (f" --tuning {_tuning_text(tuning)}" if tuning else "")


def run_case(case, mode, tuning, rank, device, group_name, recorder, args) -> Dict[str, object]:
    """One run of ``case`` under ``mode`` and ``tuning``: (path, failures, worst error, kernel error)."""
    from fluxinductor import settings

    poison(case, device, args.poison_mib << 20, group_name)
    _sync(device)
    _reduced([0.0], device)  # every rank's poison is done before any peer writes into its buffers
    inputs = _rank_inputs(case, rank)
    before = [t.clone() for t in inputs]
    recorder.events.clear()
    failures: List[str] = []
    worst = 0.0
    kernel_error = False
    got = None
    try:
        with settings.override(dispatch=mode, **tuning), torch.no_grad():
            got = _fuzz.run_op(case, rank, group_name)
        _sync(device)
    except Exception as e:  # noqa: BLE001 - recorded with the seed; a CUDA error is checked for below
        failures.append(f"raised {type(e).__name__}: {str(e)[:400]}")
    path = recorder.path()
    if recorder.kernels_reason is None and device.type == "cuda":
        for check in (lambda: recorder.gemm_rs.check_error(group_name, device, synchronize=True),
                      lambda: recorder.ag_gemm.check_errors(device, synchronize=True)):
            try:
                check()
            except RuntimeError as e:
                kernel_error = True
                failures.append(f"kernel error word: {str(e)[:300]}")
    if got is not None:
        found, worst = _fuzz.check_outputs(case, got, _fuzz.reference(case, rank) if args.lazy_reference else
                                           case["_expected"])
        described = _fuzz.describe(case) + ": "
        failures += [f[len(described):] if f.startswith(described) else f for f in found]
    if not all(torch.equal(a, b) for a, b in zip(inputs, before)):
        failures.append("the op changed its inputs")
    del got, before
    return {"path": path, "failures": failures, "worst": worst, "kernel_error": kernel_error,
            "reasons": recorder.reasons()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10000)
    parser.add_argument("--first-seed", type=int, default=FIRST_SEED)
    parser.add_argument("--seeds", default="", help="comma-separated seeds to run instead (reproductions)")
    parser.add_argument("--modes", default="fused,auto", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--tuning", default="", help="key=value[,key=value]: this tuning for every run, instead of "
                        "the cycle")
    parser.add_argument("--max-work", type=int, default=2**31, help="the most M * K * N of a case")
    parser.add_argument("--poison-mib", type=int, default=256)
    parser.add_argument("--memory-at", type=int, default=1000, help="the case after which memory is first recorded")
    parser.add_argument("--pg-timeout", type=float, default=120.0, help="seconds a collective may wait")
    parser.add_argument("--no-fill-empty", action="store_true", help="leave torch.empty unfilled")
    parser.add_argument("--lazy-reference", action="store_true", help="compute the reference per run (less memory)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run on gloo")
    parser.add_argument("--out", required=True, help="folder for fuzz_gpu.json and the per-rank logs")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            parser.error(f"--modes: {m!r} is not one of {MODES}")

    device, rank, world, group_name = join_torchrun_group(args.device, args.pg_timeout)
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, f"fuzz_gpu_rank{rank}.log"), "w")

    def log(*parts, echo=False):
        line = " ".join(str(p) for p in parts)
        log_file.write(line + "\n")
        log_file.flush()
        if echo and rank == 0:
            print(line, flush=True)

    import fluxinductor.ops  # noqa: F401 - registers torch.ops.fluxinductor
    from fluxinductor import settings

    warnings.filterwarnings("ignore", message=".*deterministic.*")
    warnings.filterwarnings("ignore", message=".*allow_tf32.*")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference and the fp32 cases: IEEE fp32
    if not args.no_fill_empty:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    forced = settings.parse_tuning(args.tuning) if args.tuning else None
    base = {"peer_check_timeout_s": args.pg_timeout}
    settings.set_tuning(**base)
    recorder = PathRecorder()
    seeds = [int(s) for s in args.seeds.split(",") if s] or list(range(args.first_seed, args.first_seed + args.cases))
    memory_at = min(args.memory_at, max(1, len(seeds) // 2))
    log(f"rank {rank}/{world} on {_device_name(device)}; torch {torch.__version__}; "
        f"{len(seeds)} cases, modes {modes}, max work {args.max_work}; kernels: {recorder.kernels_reason or 'loaded'}",
        echo=True)

    counts: Dict[str, int] = collections.Counter()  # "mode|op|dtype|path"
    reasons: Dict[str, int] = collections.Counter()  # "mode|op|normalized reason"
    worst: Dict[str, float] = {}
    failures: List[Dict[str, object]] = []
    memory_marks: Dict[str, Dict[str, int]] = {}
    fatal = None
    start = time.monotonic()
    done = 0
    for index, seed in enumerate(seeds, 1):
        case = _fuzz.make_case(seed, SIZES, world, device, args.max_work, DIM_SIZES)
        dtype = str(case["dtype"]).replace("torch.", "")
        checksum = _checksum(case)
        checksums = _reduced([checksum, -checksum], device)
        if abs(checksums[0] + checksums[1]) > 1e-6 * max(1.0, abs(checksums[0])):
            failures.append({"seed": seed, "mode": "-", "tuning": "", "rank": rank, "case": _fuzz.describe(case),
                             "what": f"the ranks built different operands (checksums {checksums})", "repro": ""})
        if not args.lazy_reference:
            case["_expected"] = _fuzz.reference(case, rank)
        for mode in modes:
            tuning = _case_tuning(case, mode, forced)
            try:
                r = run_case(case, mode, tuning, rank, device, group_name, recorder, args)
            except Exception as e:  # noqa: BLE001 - a CUDA error (a trapped kernel) ends the run; reported below
                fatal = f"seed {seed} mode {mode} tuning {_tuning_text(tuning)}: {type(e).__name__}: {e}"
                break
            where = f"{mode}|{case['op']}|{dtype}|{r['path']}"
            counts[where] += 1
            worst[where] = max(worst.get(where, 0.0), r["worst"]) if r["worst"] == r["worst"] else float("nan")
            for reason in dict.fromkeys(r["reasons"]):
                reasons[f"{mode}|{case['op']}|{_normalized(reason)}"] += 1
            for what in r["failures"]:
                failures.append({"seed": seed, "mode": mode, "tuning": _tuning_text(tuning), "rank": rank,
                                 "path": r["path"], "case": _fuzz.describe(case), "what": what,
                                 "repro": _repro(seed, mode, tuning, args)})
                log(f"FAIL seed {seed} {mode} [{_tuning_text(tuning)}] {r['path']}: {what} | {_fuzz.describe(case)}")
            # Every rank resets together where any rank's kernels reported an error, then goes on.
            if _reduced([1.0 if r["kernel_error"] else 0.0], device)[0]:
                recorder.gemm_rs.reset(group_name)
                log(f"seed {seed} {mode}: a kernel error on some rank; GEMM+RS state reset")
        if fatal is not None:
            break
        del case
        done = index
        if index == memory_at:
            memory_marks[f"after case {index}"] = memory(device)
        if index % 500 == 0 or index == len(seeds):
            elapsed = time.monotonic() - start
            log(f"{index}/{len(seeds)} cases, {len(failures)} failures on this rank, {elapsed:.0f} s "
                f"({index / elapsed:.1f} cases/s)", echo=True)
    elapsed = time.monotonic() - start
    if fatal is not None:
        log(f"STOPPED: {fatal}", echo=True)
        print(f"[rank {rank}] STOPPED: {fatal}", file=sys.stderr, flush=True)
    else:
        memory_marks["end"] = memory(device)

    mine = {"rank": rank, "device": _device_name(device), "counts": dict(counts),
            "reasons": dict(reasons), "worst": worst, "failures": failures, "memory": memory_marks, "fatal": fatal,
            "done": done, "seconds": elapsed}
    with open(os.path.join(args.out, f"fuzz_gpu_rank{rank}.json"), "w") as f:
        json.dump(mine, f, indent=1)
    if fatal is not None:  # the context may be gone, and the peer may be waiting in a collective: no gather
        log_file.close()
        return 2
    everyone: List[Optional[Dict[str, object]]] = [None] * world
    dist.all_gather_object(everyone, mine)
    status = 0
    if rank == 0:
        summary = _summary(everyone, args, modes, seeds, memory_at, elapsed)
        with open(os.path.join(args.out, "fuzz_gpu.json"), "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
        _print_summary(summary, args)
        status = 0 if summary["passed"] else 1
    status = int(_reduced([float(status)], device)[0])
    log(f"exit status {status}")
    log_file.close()
    dist.destroy_process_group()
    return status


def _nest(flat: Dict[str, object]) -> Dict[str, object]:
    out: Dict[str, object] = {}
    for key, value in sorted(flat.items()):
        *parts, last = key.split("|")
        node = out
        for p in parts:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def _git_sha() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        sha = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001
        return os.environ.get("FLUXINDUCTOR_GIT_SHA", "unknown")


def _summary(everyone, args, modes, seeds, memory_at, elapsed) -> Dict[str, object]:
    failures = [f for r in everyone for f in r["failures"]]
    memory_report = {}
    memory_failed = False
    for r in everyone:
        marks = r["memory"]
        at, end = marks.get(f"after case {memory_at}"), marks.get("end")
        report = {"after_case": memory_at, "at": at, "end": end}
        if at is not None and end is not None:
            report["growth"] = memory_growth(at, end)
            memory_failed |= report["growth"]["unexplained_bytes"] > 64 << 20
        memory_report[f"rank {r['rank']}"] = report
    cases_run = min(r["done"] for r in everyone)
    return {
        "what": "fluxinductor fused ops on 2 GPUs (NCCL) against an fp32 reference: tests/_fuzz.py cases with the GPU "
                "sizes, each under every mode; fused mode cycles the kernel tuning by seed",
        "command": "torchrun --nproc-per-node 2 tests/gpu/run_fuzz_2rank.py " + " ".join(sys.argv[1:]),
        "git": _git_sha(),
        "devices": [r["device"] for r in everyone],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "seeds": [seeds[0], seeds[-1]] if not args.seeds else seeds,
        "cases": cases_run,
        "modes": modes,
        "tunings": {"forced": args.tuning or None, "matmul_reduce_scatter and matmul_all_reduce": list(RS_TUNINGS),
                    "all_gather_matmul": list(AG_TUNINGS)},
        "sizes": {"rows per rank": list(SIZES), "K and N": list(DIM_SIZES)},
        "max_work": args.max_work,
        "fill_empty_with_nan": not args.no_fill_empty,
        "tolerance": {str(k).replace("torch.", ""): v for k, v in _fuzz.TOLERANCE.items()},
        "counts": _nest(everyone[0]["counts"]),
        "decomposed_reasons": _nest(everyone[0]["reasons"]),
        "worst_error": {f"rank {r['rank']}": _nest({k: v if v == v else "nan" for k, v in r["worst"].items()})
                        for r in everyone},
        "failed_runs": len({(f["seed"], f["mode"]) for f in failures}),
        "failure_lines": len(failures),
        "failures": failures[:500],
        "memory": memory_report,
        "memory_grew": memory_failed,
        "stopped": [r["fatal"] for r in everyone if r["fatal"]],
        "seconds": round(elapsed, 1),
        "cases_per_second": round(cases_run / elapsed, 2) if elapsed else None,
        "passed": not failures and not memory_failed and cases_run == len(seeds),
    }


def _print_summary(summary: Dict[str, object], args) -> None:
    print(f"\n{summary['cases']} cases x modes {summary['modes']} in {summary['seconds']} s "
          f"({summary['cases_per_second']} cases/s) on {summary['devices']}")
    for mode, ops in summary["counts"].items():
        for op, dtypes in ops.items():
            for dtype, paths in dtypes.items():
                print(f"  {mode:10s} {op:22s} {dtype:9s} " + ", ".join(f"{p} {n}" for p, n in paths.items()))
    for rank, report in summary["memory"].items():
        growth, at, end = report.get("growth"), report.get("at") or {}, report.get("end") or {}
        if growth is not None:
            print(f"  memory {rank} after case {report['after_case']} -> end: allocated {at.get('memory_allocated')} "
                  f"-> {end.get('memory_allocated')} B, max reserved {at.get('max_memory_reserved')} -> "
                  f"{end.get('max_memory_reserved')} B, unexplained growth {growth['unexplained_bytes']} B; at the "
                  "end " + ", ".join(f"{k} {end.get(k)}" for k in ("ag_symmetric_bytes", "rs_symmetric_bytes",
                                                                   "rs_outbox_bytes", "ag_retired_buffers",
                                                                   "rs_retired_buffers")))
    print(f"  failed runs: {summary['failed_runs']} ({summary['failure_lines']} lines)")
    for f in summary["failures"][:20]:
        print(f"    rank {f['rank']} seed {f['seed']} {f['mode']} [{f['tuning']}] {f.get('path', '')}: {f['what']}\n"
              f"      {f['case']}\n      {f['repro']}")
    for line in summary["stopped"]:
        print(f"  STOPPED: {line}")
    print(("PASSED" if summary["passed"] else "FAILED") + f": {os.path.join(args.out, 'fuzz_gpu.json')}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
