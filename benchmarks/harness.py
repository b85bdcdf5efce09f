"""What the benchmark programs and probes share: the run context (process group, barriers, agreement between
ranks), the timing loop, the environment record, kernel-tuning settings (``--tuning``), the JSON writer and the
table cells.

``bench_ops.py`` and ``bench_model.py`` build on :class:`RunContext` and :func:`time_iterations`; the probes under
``probes/`` use the smaller pieces (:func:`git_sha`, :func:`write_json`, :func:`init_gpu_ranks`, :func:`apply_tuning`).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ContextBroken(RuntimeError):
    """A CUDA error left the context unusable: no further GPU work or collective can run."""


def git_sha() -> Tuple[Optional[str], Optional[bool]]:
    """(commit, dirty): ``FLUXINDUCTOR_GIT_SHA`` when set (the device copy's .git may lag the working tree it
    was given), else the checkout's."""
    if os.environ.get("FLUXINDUCTOR_GIT_SHA"):
        return os.environ["FLUXINDUCTOR_GIT_SHA"], None
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if sha.returncode == 0 and sha.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                   capture_output=True, text=True, timeout=10)
            return sha.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("FLUXINDUCTOR_GIT_SHA") or None, None


def output_prefix(out: str) -> str:
    """An ``--out`` prefix (the scripts write ``<prefix>.json`` and more): a path ending in ``.json`` names the JSON
    itself, so ``x.json`` writes ``x.json``, not ``x.json.json``."""
    return out[: -len(".json")] if out.endswith(".json") else out


def sanitize(o):
    """``o`` with inf/nan (not JSON) as strings and every dict key a string."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {str(k): sanitize(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [sanitize(v) for v in o]
    return o


def parse_problems(text: Optional[str], default: Sequence[Tuple[int, ...]]) -> List[Tuple[int, ...]]:
    """"M,K,N;M,K,N" as a list of integer tuples, or ``default`` when ``text`` is empty."""
    return list(default) if not text else [tuple(int(x) for x in s.split(",")) for s in text.split(";")]


def write_json(path: str, data: dict) -> None:
    """Write ``data`` (sanitized) to ``path`` atomically, so a run killed mid-write leaves the last good file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(sanitize(data), f, indent=1, allow_nan=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def init_gpu_ranks() -> Tuple[int, int, torch.device, str]:
    """Rank setup of the torchrun GPU diagnostics: NCCL initialised on this rank's GPU, the world group
    registered with torch symmetric memory, ``torch.ops.fluxinductor`` and ``torch.ops.symm_mem`` loaded.
    Returns (rank, world, device, group name)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group_name = dist.group.WORLD.group_name
    from torch.distributed import _symmetric_memory  # noqa: F401 - registers torch.ops.symm_mem

    import fluxinductor  # noqa: F401 - registers torch.ops.fluxinductor
    from fluxinductor.kernels.symm import _enable_group

    _enable_group(group_name)
    return rank, world, device, group_name


# ---------------------------------------------------------------------------------------------------
# Kernel tuning and dispatch mode (fluxinductor.settings)
# ---------------------------------------------------------------------------------------------------


def parse_tuning(spec: Optional[str]) -> Dict[str, str]:
    """``"ag_variant=5,gemm_rs_push=copy"`` -> ``{"ag_variant": "5", "gemm_rs_push": "copy"}`` (empty for None/"").
    The values stay strings: ``fluxinductor.settings.set_tuning`` parses and validates them."""
    values: Dict[str, str] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--tuning: {item!r} is not key=value")
        values[key.strip()] = value.strip()
    return values


def _settings():
    try:
        from fluxinductor import settings
    except ImportError as e:
        raise RuntimeError(f"this needs fluxinductor.settings, which this fluxinductor lacks ({e})") from e
    return settings


def apply_tuning(spec) -> Dict[str, str]:
    """Set fluxinductor's kernel-tuning fields for this process (``fluxinductor.settings.set_tuning``, which raises on
    an unknown field or a bad value): ``spec`` is a ``--tuning`` string or a dict.  Every rank calls it with the same
    values.  Returns what was set."""
    values = parse_tuning(spec) if isinstance(spec, str) or spec is None else dict(spec)
    if values:
        _settings().set_tuning(**values)
    return values


@contextlib.contextmanager
def overridden(**values) -> Iterator[None]:
    """fluxinductor settings (``dispatch``, a compile option's default) and kernel-tuning fields set for the ``with``
    block and restored after it (``fluxinductor.settings.override``): one contender's dispatch mode, transport or
    configuration.  No values: nothing is touched."""
    if not values:
        yield
        return
    with _settings().override(**values):
        yield


def dispatch_mode(mode: Optional[str]) -> contextlib.AbstractContextManager:
    """The dispatcher's mode (``auto``, ``fused``, ``decomposed``; the setting ``FLUXINDUCTOR_DISPATCH`` sets at
    import) for the ``with`` block; None: left as it is."""
    return overridden(**({} if mode is None else {"dispatch": mode}))


def add_tuning_argument(parser) -> None:
    parser.add_argument("--tuning", default=None, metavar="KEY=VALUE[,KEY=VALUE]",
                        help="fluxinductor kernel-tuning fields for this run (fluxinductor.settings.set_tuning; "
                             "docs/settings.md lists them), e.g. ag_variant=5")


# ---------------------------------------------------------------------------------------------------
# Run context: process group, barriers, agreement between ranks
# ---------------------------------------------------------------------------------------------------


class RunContext:
    """One rank of a benchmark run: its device, the process group (NCCL on GPUs, gloo on CPU) and the helpers every
    measurement needs.  ``device``: "auto" (CUDA when available), "cuda" or "cpu".  A plain ``python script.py``
    (no torchrun) runs as one rank on ``default_port``."""

    # The group agreement and result exchange go over (None: the default group).
    ctrl = None

    def __init__(self, device: str, pg_timeout_s: float, default_port: int):
        want = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
        self.is_cuda = want == "cuda"
        if "MASTER_ADDR" not in os.environ:  # one rank, without torchrun
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", str(default_port)),
                              RANK="0", WORLD_SIZE="1")
        self.local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        if self.is_cuda:
            if not torch.cuda.is_available():
                raise SystemExit("--device cuda but CUDA is not available")
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self.backend = "nccl" if self.is_cuda else "gloo"
        kwargs = dict(backend=self.backend, timeout=datetime.timedelta(seconds=pg_timeout_s))
        if self.is_cuda:
            kwargs["device_id"] = self.device
        try:
            dist.init_process_group(**kwargs)
        except TypeError:  # older torch without device_id
            kwargs.pop("device_id", None)
            dist.init_process_group(**kwargs)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.broken: Optional[str] = None

    def barrier(self) -> None:
        if self.is_cuda:
            dist.barrier(device_ids=[self.local_rank])
        else:
            dist.barrier()

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (pickled; small objects only)."""
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def context_ok(self) -> bool:
        """False once a CUDA error has made the context unusable (later work would only fail or hang)."""
        if not self.is_cuda:
            return True
        try:
            torch.cuda.synchronize()
            return True
        except Exception as e:  # noqa: BLE001
            self.broken = self.broken or f"{type(e).__name__}: {e}"
            return False

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.is_cuda else "cpu"


def agree(ctx: RunContext, local: dict) -> Tuple[List[dict], Optional[str]]:
    """Every rank's ``local`` record (which holds an ``"error"``) and the error to report, None when no rank failed:
    the first rank's error, prefixed by the failed ranks unless every rank failed.  Every rank gets the same answer,
    so all of them go on (or stop) together."""
    everyone = ctx.gather(local)
    errors = [r["error"] for r in everyone]
    failed = [i for i, e in enumerate(errors) if e is not None]
    if not failed:
        return everyone, None
    first = errors[failed[0]]
    return everyone, (first if len(failed) == ctx.world else f"rank(s) {failed}: {first}")


def settle(ctx: RunContext, turns: Sequence[Callable[[], Optional[str]]], settle_s: float) -> dict:
    """Run ``turns`` in order, again and again, until rank 0 has run them for ``settle_s`` seconds: untimed work that
    brings the GPU to the clock a timed run holds it at.  Each turn is collective and returns the same answer on every
    rank: None, or why the settle stops (the timed rounds then record the failure).  Every rank runs the same turns.
    Returns the rounds run and the seconds rank 0 took, with ``stopped`` where a turn stopped it."""
    start, rounds = time.monotonic(), 0
    while True:
        for turn in turns:
            stopped = turn()
            if stopped is not None:
                return {"rounds": rounds, "s": round(time.monotonic() - start, 3), "stopped": stopped}
        rounds += 1
        elapsed = time.monotonic() - start
        first = ctx.gather({"more": elapsed < settle_s, "s": elapsed})[0]
        if not first["more"]:
            return {"rounds": rounds, "s": round(first["s"], 3)}


@contextlib.contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Dump every thread's stack and exit if the block runs longer than ``seconds``: a contender that hangs (a flag
    never set, a peer stuck in a collective) must not eat the whole device call; the JSON is already saved."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def exit_now(rc: int) -> None:
    """Flush and leave without process-group or symmetric-memory teardown, which has hung at exit in some
    torch/NVSHMEM versions and would cost a device call its outputs' time.  Everything must be written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------


def align_ranks(token: torch.Tensor, group=None) -> None:
    """A one-element all-reduce of ``token`` behind a GPU sleep (``time_iterations``' ``before_start``): every rank's
    start event waits for the slowest rank, so neither the host's skew leaving the barrier nor the ranks' different
    sleeps (a sleep of so many cycles lasts longer on a GPU whose clock is lower) is timed; it would land on whichever
    rank started first once the work synchronizes the ranks."""
    dist.all_reduce(token, group=group)


def time_iterations(ctx: RunContext, fn: Callable[[], object], warmup: int, iters: int,
                    sleep_cycles: Optional[int] = None, before_start: Optional[Callable[[], None]] = None,
                    before_iter: Optional[Callable[[], None]] = None,
                    sleeps: Optional[List[float]] = None) -> Tuple[List[float], List[float]]:
    """(device ms, host ms) of each of ``iters`` calls of ``fn`` after ``warmup`` warm-ups; ``dist.barrier`` and
    ``cuda.synchronize`` before every call.

    On CUDA, CUDA events bracket the call; ``sleep_cycles`` (None: no sleep) keeps the GPU busy while the host
    enqueues it, so the events measure device time and host launch cost stays out; ``before_start`` runs between
    the sleep and the start event (bench_ops aligns the ranks' start there).  Host ms: the time the host took to
    enqueue the call.  On CPU both are ``time.perf_counter`` around the call.  ``before_iter`` runs before the
    barrier (bench_model drops gradients there).  ``sleeps`` (CUDA, with a sleep): gets each timed call's time in ms
    from before the sleep to the start event (``before_start``'s work included): a sleep of so many cycles lasts
    longer on an idle GPU's clock than under load, and the host is hidden only where this outlasts the enqueue."""
    times: List[float] = []
    host: List[float] = []
    if ctx.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before_sleep = torch.cuda.Event(enable_timing=True)
    for i in range(warmup + iters):
        if before_iter is not None:
            before_iter()
        ctx.barrier()
        ctx.sync()
        if ctx.is_cuda:
            if sleep_cycles is not None:
                before_sleep.record()
                torch.cuda._sleep(sleep_cycles)
            if before_start is not None:
                before_start()
            start.record()
            h0 = time.perf_counter()
            fn()
            h1 = time.perf_counter()
            end.record()
            end.synchronize()
            t = start.elapsed_time(end)
            if sleeps is not None and sleep_cycles is not None and i >= warmup:
                sleeps.append(before_sleep.elapsed_time(start))
        else:
            h0 = time.perf_counter()
            fn()
            h1 = time.perf_counter()
            t = (h1 - h0) * 1e3
        if i >= warmup:
            times.append(float(t))
            host.append((h1 - h0) * 1e3)
    return times, host


class Timer:
    """Host-exposed time of one call: barrier first, then CUDA events around it (wall clock on CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def per_rank_summary(per_rank: List[List[float]]) -> dict:
    """``ms`` (the maximum over ranks of each rank's median: the reported time), ``rank_median_ms`` and
    ``iter_max_median_ms`` (the median of per-call maxima over ranks) from each rank's per-call times."""
    medians = [statistics.median(t) for t in per_rank]
    return {"ms": max(medians), "rank_median_ms": medians,
            "iter_max_median_ms": statistics.median(max(col) for col in zip(*per_rank))}


# ---------------------------------------------------------------------------------------------------
# Environment record and table cells
# ---------------------------------------------------------------------------------------------------

# Environment variables a result records (the ones that change what runs or how fast).
ENV_PREFIXES = ("NCCL_", "TORCH_SYMM_MEM", "NVSHMEM_", "FLUXINDUCTOR_", "CUDA_VISIBLE")


def environment(ctx: RunContext, dtype: torch.dtype, fields: Optional[dict] = None,
                env_prefixes: Iterable[str] = ENV_PREFIXES, tuning_values: Optional[dict] = None) -> dict:
    """What a result was measured on: device, world size, backend, dtype, ``fields`` (the script's own), versions
    (torch, CUDA, NCCL, Python), git sha, time, argv, the relevant environment variables, the kernel-tuning values
    given (``tuning``), the GPU's SM count, memory and capability, and whether fluxinductor's extension loaded."""
    sha, dirty = git_sha()
    env = {"device": ctx.device_name(), "world": ctx.world, "backend": ctx.backend,
           "dtype": str(dtype).replace("torch.", "")}
    env.update(fields or {})
    env.update({
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_sha": sha,
        "git_dirty": dirty,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "argv": sys.argv,
        "env": {k: v for k, v in os.environ.items() if k.startswith(tuple(env_prefixes))},
        "tuning": dict(tuning_values or {}),
    })
    if ctx.is_cuda:
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001
            pass
        props = torch.cuda.get_device_properties(ctx.device)
        env["sm_count"] = props.multi_processor_count
        env["total_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["capability"] = f"{props.major}.{props.minor}"
    try:
        import fluxinductor._C  # noqa: F401

        env["fluxinductor_extension"] = "loaded"
    except Exception as e:  # noqa: BLE001
        env["fluxinductor_extension"] = f"not loaded: {type(e).__name__}: {e}"
    return env


def cell(x, fmt: str = "{:.3f}", width: int = 8) -> str:
    """One right-aligned table cell: ``x`` formatted, or "-" where it is missing."""
    return ("-" if x is None else fmt.format(x)).rjust(width)
