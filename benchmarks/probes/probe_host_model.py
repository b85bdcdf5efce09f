"""Host time of compiled model steps, and where it goes: bench_model's Llama layers (full config, bf16, inference)
compiled per backend, each step enqueued behind a long GPU sleep so that the host is timed alone, the backends
alternated in rounds; then a cProfile of more steps of each (rank 0 prints the top entries by own and by cumulative
time, and ``--out`` records how much of a step goes to the pieces named in :data:`PIECES`).

    torchrun --nproc-per-node 2 benchmarks/probes/probe_host_model.py --backends nocomm,inductor,flux \
        [--tp plain --tokens 8 --compile-mode reduce-overhead] [--steps 20 --rounds 5] [--out host.json]

Backends: ``inductor`` and ``flux`` compile the tensor-parallel model (DTensor parameters); ``nocomm`` compiles
bench_model's no-communication replica (the same per-rank work and DTensor wrapping, no collective) with inductor.  ``--tokens N`` runs
bench_model's ``--tokens`` shape (plain TP: N one-token sequences; sequence parallel: one sequence of N tokens).
With FLUXINDUCTOR_DISPATCH=fused it shows how much of a flux step's host time the fused ops' Python (dispatch,
checks, launches) takes against inductor's.

``--timeline N``: then N host-exposed flux steps (barrier, synchronize, step: what bench_model times), each fused op's
host time stamped without a profiler: its entry (``dispatch.replay_key``, the op's first call) and the extension call
that enqueues it (``ag_push_call`` / ``gemm_rs_run``).  Rank 0 prints, per op of the step, the medians of: entry after
the step's start, Python before the extension call, the extension call; the JSON keeps them per rank.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the models
import models  # noqa: E402
from harness import exit_now, git_sha, write_json  # noqa: E402

_SLEEP_CYCLES = 50_000_000  # ~25 ms: longer than any step's enqueue

# Pieces of a step's host time, by (file suffix, function): cumulative time per step in the profile.
PIECES = {
    "tensor_subclass_unwrap": [("subclass_utils.py", "runtime_unwrap_tensor_subclasses")],
    "tensor_subclass_wrap": [("subclass_utils.py", "wrap_tensor_subclasses")],
    "dtensor_guards": [("guards.py", "guard_fn")],
    "cudagraph_trees": [("cudagraph_trees.py", "run")],
    "fluxinductor_ops": [("fluxinductor/ops.py", op) for op in ("all_gather_matmul", "matmul_reduce_scatter",
                                                                 "matmul_all_reduce")],
}


def host_steps(fn, x, steps: int, prof=None):
    """Host ms of each of ``steps`` calls, each enqueued behind a GPU sleep (profiled when ``prof`` is given)."""
    times = []
    for _ in range(steps):
        torch.cuda._sleep(_SLEEP_CYCLES)
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1e3)
        if prof is not None:
            prof.disable()
        torch.cuda.synchronize()
        dist.barrier()
    return times


_EXT_CALLS = ("ag_push_call", "gemm_rs_run", "ag_gemm_run", "one_shot_all_reduce")


def timeline(fn, x, steps: int) -> list:
    """Per op of a host-exposed step (in call order): medians over ``steps`` steps of µs from the step's start to the
    op's entry, from the entry to its extension call, and in that call (module docstring)."""
    from fluxinductor import dispatch
    from fluxinductor.kernels import loader

    ext = loader.extension()
    clock = time.perf_counter_ns
    stamps: list = []
    original_key = dispatch.replay_key

    def key_hook(op, *args):
        stamps.append((op, clock(), None))  # the op's entry
        return original_key(op, *args)

    def ext_hook(call):
        def hooked(*args):
            start = clock()
            out = call(*args)
            stamps.append((None, start, clock()))  # an extension call
            return out
        return hooked

    originals = {name: getattr(ext, name) for name in _EXT_CALLS if hasattr(ext, name)}
    dispatch.replay_key = key_hook
    for name, call in originals.items():
        setattr(ext, name, ext_hook(call))
    per_step = []
    try:
        for _ in range(steps):
            dist.barrier()
            torch.cuda.synchronize()
            stamps.clear()
            t0 = clock()
            fn(x)
            ops = []
            for op, start, end in stamps:
                if op is not None:
                    ops.append({"op": op, "entry_us": (start - t0) / 1e3})
                elif ops:
                    ops[-1].setdefault("python_us", (start - t0) / 1e3 - ops[-1]["entry_us"])
                    ops[-1]["ext_us"] = ops[-1].get("ext_us", 0.0) + (end - start) / 1e3
            per_step.append(ops)
            torch.cuda.synchronize()
    finally:
        dispatch.replay_key = original_key
        for name, call in originals.items():
            setattr(ext, name, call)
    rows = []
    for i in range(min(len(ops) for ops in per_step)):
        calls = [ops[i] for ops in per_step]
        rows.append({"op": calls[0]["op"], **{key: statistics.median(c.get(key, float("nan")) for c in calls)
                                              for key in ("entry_us", "python_us", "ext_us")}})
    return rows


def pieces(stats: pstats.Stats, steps: int) -> dict:
    """µs per step: ``step``, all the profiled time, and each of :data:`PIECES` (cumulative time; the outermost call
    of a recursive function).  ``step`` is the profile's total, not a function's cumulative time: cProfile can count
    every call of the compiled frame's wrapper as recursive, and so none of them."""
    out = {"step": stats.total_tt * 1e6 / steps}
    for name, keys in PIECES.items():
        total = 0.0
        for (filename, _, func), (_, _, _, cumtime, _) in stats.stats.items():
            if any(filename.endswith(suffix) and func == fname for suffix, fname in keys):
                total += cumtime
        out[name] = total * 1e6 / steps
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="inductor,flux")
    p.add_argument("--tp", choices=("sequence", "plain"), default="sequence")
    p.add_argument("--tokens", type=int, default=None, help="bench_model's --tokens shape (default: the full config)")
    p.add_argument("--compile-mode", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--top", type=int, default=28)
    p.add_argument("--timeline", type=int, default=0, help="then this many host-exposed flux steps, each fused op's "
                   "host time stamped (module docstring)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (world,))
    solo = models.solo_mesh("cuda")  # the replica's: this rank alone, as bench_model's nocomm
    cfg = dict(models.CONFIGS["full"]["llama2"])
    if args.tokens is not None:
        cfg.update(models.tokens_shape(args.tp, args.tokens))
    x = torch.randn(models.input_shape("llama2", cfg, world, 1, args.tp), dtype=torch.bfloat16, device=device)
    backends = args.backends.split(",")
    fns = {}
    for backend in backends:
        if backend == "nocomm":
            model = models.build_nocomm("llama2", cfg, world, device, torch.bfloat16, 1, args.tp, solo)
        else:
            model = models.build_model("llama2", cfg, mesh, device, torch.bfloat16, 1, args.tp)
        if backend == "flux":
            import fluxinductor  # noqa: F401  (registers the backend)
        fns[backend] = torch.compile(model, backend="inductor" if backend == "nocomm" else backend,
                                     mode=args.compile_mode)
    times = {b: [] for b in backends}
    profiles = {}
    with torch.inference_mode():
        for backend, fn in fns.items():
            host_steps(fn, x, 5)  # compile, record CUDA graphs, warm up
        for _ in range(args.rounds):
            for backend, fn in fns.items():
                times[backend] += host_steps(fn, x, args.steps)
        for backend, fn in fns.items():
            profiles[backend] = cProfile.Profile()
            host_steps(fn, x, args.steps, profiles[backend])
    result = {}
    if args.timeline and "flux" in fns:
        with torch.inference_mode():
            rows = timeline(fns["flux"], x, args.timeline)
        everyone = [None] * world
        dist.all_gather_object(everyone, rows)
        result["flux_timeline_by_rank"] = everyone
        if rank == 0:
            print(f"=== flux timeline: per op, medians of {args.timeline} host-exposed steps, us "
                  "(entry after the step's start / Python before the extension call / the extension call), ranks "
                  + " | ".join(str(r) for r in range(world)), flush=True)
            for i, row in enumerate(rows):
                print(f"  {i:2d} {row['op']:24s} " + " | ".join(
                    f"{r[i]['entry_us']:8.1f} {r[i]['python_us']:6.1f} {r[i]['ext_us']:6.1f}" for r in everyone),
                    flush=True)
    for backend in backends:
        stats = pstats.Stats(profiles[backend])
        result[backend] = {"host_ms_median": statistics.median(times[backend]), "host_ms_min": min(times[backend]),
                           "profiled_us_per_step": pieces(stats, args.steps)}
        if rank == 0:
            print(f"=== {backend}: host ms per step, median {result[backend]['host_ms_median']:.3f}, "
                  f"min {result[backend]['host_ms_min']:.3f}; profiled us per step: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in result[backend]["profiled_us_per_step"].items()), flush=True)
            pstats.f8 = lambda v: f"{v * 1e6 / args.steps:8.1f}"  # us per step, not s in all
            print("(tottime and cumtime in us per step)", flush=True)
            for key in ("tottime", "cumulative"):
                out = io.StringIO()
                pstats.Stats(profiles[backend], stream=out).sort_stats(key).print_stats(args.top)
                print("\n".join(line[:200] for line in out.getvalue().splitlines()[6:]), flush=True)
    if rank == 0 and args.out:
        sha, dirty = git_sha()
        write_json(args.out, {"probe": "probe_host_model", "device": torch.cuda.get_device_name(), "world": world,
                              "git_sha": sha, "git_dirty": dirty, "torch": torch.__version__, "args": vars(args),
                              "config": cfg, "results": result})
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_now(0)  # everything is written; no process-group teardown (it hangs at exit with captured collectives)
