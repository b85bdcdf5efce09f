"""A small multi-process harness: run a function on N CPU ranks of a gloo process group.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` fresh interpreters (torch.multiprocessing,
"spawn"), joins them into one gloo group over a free local TCP port, calls ``fn(rank, world_size, *args)``
on each and returns the per-rank results in rank order.  A rank that raises makes ``run_ranks`` raise
:class:`RankError` carrying that rank's traceback; the other ranks are then killed, since they may be
blocked in a collective the failed rank will never join.  A hard timeout turns a hang into a failure.

``fn`` must be a top-level function of an importable module (spawn pickles it by name) and its result
must be picklable.  Each rank is single-threaded (``torch.set_num_threads(1)``, inductor
``compile_threads=1``) so that several ranks share the 2-core CI machine without thrashing.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch.multiprocessing as mp

# Seconds a whole job may take before its ranks are killed (override per call).
DEFAULT_TIMEOUT_S = 300.0
# After one rank fails, how long the others get to report their own error before they are killed.
_GRACE_AFTER_FAILURE_S = 5.0


class RankError(RuntimeError):
    """A rank raised, died or timed out; the message holds each failed rank's traceback."""


def count_calls(owner: Any, name: str, counter: Optional[Dict[str, int]] = None) -> Dict[str, int]:
    """Replace ``owner.<name>`` for the rest of this process by a wrapper that adds one to ``counter["n"]`` on each
    call (a new counter unless one is given, so that several functions can share one); returns the counter."""
    counter = {"n": 0} if counter is None else counter
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counter["n"] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    return counter


def join_torchrun_group(device_kind: str, pg_timeout_s: float) -> tuple:
    """(device, rank, world, group name) of a script under torchrun: NCCL on this rank's GPU (``device_kind``
    "cuda"), else gloo on the CPU, with collectives bounded by ``pg_timeout_s``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=pg_timeout_s)
    if device_kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device, dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    env: Dict[str, str],
    fn: Callable,
    args: tuple,
    results: "mp.Queue",
) -> None:
    try:
        os.environ.update(env)
        settings = sys.modules.get("fluxinductor.settings")
        if settings is not None:  # imported while ``fn`` was unpickled, before ``env`` was set: read it again
            settings.reload()
        if "TORCHINDUCTOR_CACHE_DIR" in env:  # one cache per rank (see run_ranks)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(env["TORCHINDUCTOR_CACHE_DIR"], f"rank{rank}")
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            OMP_NUM_THREADS="1",
        )
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        import torch._inductor.config as inductor_config

        # No compile worker pool: starting one costs more than it saves on tiny graphs and 2 cores.
        inductor_config.compile_threads = 1
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            # Destroy only after every rank is done with the group, so no rank leaves a peer stranded.
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - a dead peer; the parent reports the real failure
                pass
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Optional[Dict[str, str]] = None,
    cache_dir: Optional[str] = None,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return results by rank.

    ``env`` is set in every rank before torch is imported there (and fluxinductor's settings read it).
    ``cache_dir`` holds the ranks' ``TORCHINDUCTOR_CACHE_DIR``s (``<cache_dir>/rank<r>``); by default each job gets a fresh empty one, so
    no compile is served from an earlier job's FX graph cache.  Each rank has its own: when ranks shared
    one, a rank that compiled a graph identical to its peer's a moment later was served the peer's entry,
    skipped the passes, and recorded no fusion decisions (test_integer_matmul_is_skipped_and_exact failed
    that way in one CI run and in one of three reruns).  A later job given the same ``cache_dir`` hits rank by rank.
    """
    env = dict(env or {})
    # Scalar C++ kernels: without the vectorized ATen headers each kernel compiles ~4x faster, and the
    # tests are about graphs and ops, not inductor's vector codegen.
    env.setdefault("TORCHINDUCTOR_VEC_ISA_OK", os.environ.get("TORCHINDUCTOR_VEC_ISA_OK", "0"))
    tmp = None
    if cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="fluxinductor-test-cache-")
        cache_dir = tmp.name
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, env, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: Dict[int, Any] = {}
    failures: Dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) + len(failures) < world_size:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(world_size)) - set(outcome) - set(failures))
                failures.update({r: f"timed out after {timeout:.0f} s" for r in missing})
                break
            try:
                rank, ok, value = results.get(timeout=min(1.0, deadline - now))
            except queue_module.Empty:
                # A rank that died without reporting (segfault, OOM kill) never will.
                for rank, p in enumerate(procs):
                    if rank not in outcome and rank not in failures and not p.is_alive() and p.exitcode != 0:
                        # Its report may still be in flight; give the queue a moment.
                        try:
                            r2, ok2, v2 = results.get(timeout=1.0)
                            (outcome if ok2 else failures)[r2] = v2
                        except queue_module.Empty:
                            failures[rank] = f"process exited with code {p.exitcode} without a report"
                continue
            if ok:
                outcome[rank] = value
            else:
                failures[rank] = value
                # Peers may block forever on a collective this rank will not join: short deadline.
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
    finally:
        for p in procs:
            p.join(timeout=0.5 if failures else 10.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
        if tmp is not None:
            tmp.cleanup()
    if failures:
        parts = [f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures)]
        raise RankError(f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(parts))
    return [outcome[r] for r in range(world_size)]
