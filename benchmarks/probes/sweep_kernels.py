#!/usr/bin/env python3
"""Kernel tuning sweep on one GPU: our fused GEMMs with communication off against cuBLAS, per configuration.

    python3 benchmarks/probes/sweep_kernels.py --op ag --out $OUT/sweep_ag.json
    python3 benchmarks/probes/sweep_kernels.py --op rs --out $OUT/sweep_rs.json
    python3 benchmarks/probes/sweep_kernels.py --op rs-split --tail-splits 1,4 --out $OUT/sweep_rs_split.json
    python3 benchmarks/probes/sweep_kernels.py --op ag --variants 0 --stock 0,1,2 --out $OUT/sweep_ag_stock.json

Needs an extension built with CMAKE_ARGS=-DFLUXINDUCTOR_KERNEL_TUNING=ON for the tuning variants (AG variants
1-5 and 7; GEMM+RS configurations 1-6); a variant the build lacks is recorded with its error.

``--stock`` (tuning builds) adds stock CUTLASS GEMMs on the same problems (csrc/tuning/probe_stock_gemm.h: CUTLASS's own
persistent and stream-K schedulers, no fluxinductor code in the kernel), which separates what our scheduler and
mainloop wrapper cost from CUTLASS's own distance to cuBLAS.

Shapes are the *global* (M, K, N) of benchmarks/bench_ops.py at TP = ``--world``; the per-rank problem is
AG: [M, K] @ [K, N/w] (the gathered input), GEMM+RS: [M, K/w] @ [K/w, N].  The weight is the transposed
nn.Linear view (K-major), as in a model.  ``rs-split``: the split GEMM+RS transport's two GEMMs (``gemm_only(split=
True)``: rows [0, M/2), then [M/2, M) reading a zero source C), one contender per ``--tail-splits`` value.

Per shape: cuBLAS (``torch.mm``, its kernel name read from the profiler) and every configuration are timed
round-robin: ``--rounds`` rounds, each timing every contender ``--iters // --rounds`` times after one
warm-up call.  An H200 under sustained GEMM load slows down by several percent within a minute (measured:
cuBLAS 3.22 -> 3.35 ms over one shape's sweep when contenders were timed one after another), so timing them
in blocks would favour whichever ran first.  CUDA events around each call, a GPU sleep before the start
event so host launch time is hidden; ``ms`` is the median over all rounds, ``round_ms`` the per-round
medians.  Each configuration's output is checked against cuBLAS's (relative Frobenius error) before
timing; ``ratio`` is its median over cuBLAS's.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import git_sha, parse_problems, write_json  # noqa: E402

SHAPES = [(4096, 12288, 49152), (8192, 8192, 28672), (2048, 8192, 28672), (16384, 8192, 28672),
          (1024, 8192, 8192), (512, 8192, 28672), (3072, 8192, 28672), (4096, 49152, 12288)]


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> List[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # keeps the GPU busy while the host enqueues the timed call
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_round_robin(fns: Dict[str, Callable[[], object]], warmup: int, iters: int,
                     rounds: int) -> Dict[str, List[List[float]]]:
    """Per contender, the times of each round (``rounds`` rounds of ``iters // rounds`` calls each)."""
    for fn in fns.values():
        time_ms(fn, warmup, 0)
    per_round = max(1, iters // rounds)
    times: Dict[str, List[List[float]]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(time_ms(fn, 1, per_round))
    return times


def cublas_kernel_name(fn: Callable[[], object]) -> Optional[str]:
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]
        return max(names, key=len) if names else None
    except Exception as e:  # noqa: BLE001 - the name is a diagnostic, never fatal
        return f"(profiler failed: {e})"


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def configs(op: str, quick: bool, tail_splits: Optional[List[int]] = None,
            tail_waves: Optional[List[int]] = None, split_configs: Optional[List[int]] = None,
            ag_variants: Optional[List[int]] = None, ag_groups: Optional[List[int]] = None) -> List[Dict[str, int]]:
    waves = tail_waves or [1]
    if op == "ag":
        variants = (ag_variants or [0, 1, 3, 4, 6]) if not quick else [0]
        groups = (ag_groups or [4, 8, 16]) if not quick else [8]
        if tail_splits is None:
            from fluxinductor import settings
            tail_splits = [settings.tuning.ag_tail_split]
        return [{"variant": v, "group_rows": g, "tail_split": t, "tail_waves": w}
                for v, g, t, w in itertools.product(variants, groups, tail_splits, waves)
                if t > 1 or w == waves[0]]
    if op == "rs-split":
        rows = [{"split": 1, "split_config": 0, "tail_split": t, "tail_waves": w}
                for t, w in itertools.product(tail_splits or [1, 4], waves) if t > 1 or w == waves[0]]
        return rows + [{"split": 1, "split_config": c, "tail_split": t, "tail_waves": w}
                       for c in split_configs or [] if c != 0
                       for t, w in itertools.product(tail_splits or [1, 4], waves) if t > 1 or w == waves[0]]
    cfgs = [0, 1, 4, 5, 6] if not quick else [0]
    orders = [(1, 0), (4, 2), (8, 2), (4, 1)] if not quick else [(1, 0)]
    return [{"config": c, "swizzle": s, "raster": r} for c, (s, r) in itertools.product(cfgs, orders)]


def run_config(op: str, cfg: Dict[str, int], a: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor):
    # The launchers read these kernel-tuning fields per call, so each contender sets its own (round-robin timing).
    from fluxinductor import settings

    if op == "ag":
        from fluxinductor.kernels import ag_gemm

        def call_ag():
            settings.set_tuning(tail_split_waves=cfg["tail_waves"])
            return ag_gemm.launch_gemm(a, w_t, None, out, variant=cfg["variant"], group_rows=cfg["group_rows"],
                                       tail_split=cfg["tail_split"])
        return call_ag
    from fluxinductor.kernels import gemm_rs

    if op == "rs-split":
        def call_split():
            settings.set_tuning(tail_split_waves=cfg["tail_waves"])
            return gemm_rs.gemm_only(a, w_t, None, out=out, split=True, tail_split=cfg["tail_split"],
                                     split_config_choice=cfg["split_config"])
        return call_split

    def call():
        settings.set_tuning(gemm_rs_config=cfg["config"], gemm_rs_swizzle=cfg["swizzle"], gemm_rs_raster=cfg["raster"])
        return gemm_rs.gemm_only(a, w_t, None, out=out)
    return call


def stock_gemm(config: int, a: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor) -> Callable[[], object]:
    """A stock CUTLASS GEMM (csrc/tuning/probe_stock_gemm.h) of out = a @ w_t, its workspace allocated once."""
    from fluxinductor.kernels import symm

    ext = symm.extension()
    (m, k), n = a.shape, w_t.shape[1]
    if not hasattr(ext, "probe_stock_gemm_workspace"):  # exported by tuning builds only
        raise RuntimeError("the stock CUTLASS GEMMs exist only in tuning builds "
                           "(CMAKE_ARGS=-DFLUXINDUCTOR_KERNEL_TUNING=ON)")
    size = ext.probe_stock_gemm_workspace(config, m, n, k)
    if size < 0:
        raise RuntimeError(f"no stock CUTLASS GEMM configuration {config}")
    workspace = torch.empty(max(size, 1), dtype=torch.uint8, device=a.device)

    def call():
        ext.probe_stock_gemm_run(config, a.data_ptr(), m, k, a.stride(0), w_t.data_ptr(), n, w_t.stride(1),
                                 out.data_ptr(), out.stride(0), workspace.data_ptr(), 0,
                                 torch.cuda.current_stream().cuda_stream)
    return call


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=["ag", "rs", "rs-split"], required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--shapes", default=None, help="M,K,N;M,K,N (global shapes); default: bench_ops' list")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="default configuration only")
    p.add_argument("--tail-splits", default=None,
                   help="--op ag / rs-split: comma-separated tail-split values to compare (tuning fields ag_tail_split / "
                        "gemm_rs_tail_split; default: ag the default, rs-split 1,4)")
    p.add_argument("--tail-waves", default=None,
                   help="--op ag / rs-split: comma-separated tail_split_waves values (default 1)")
    p.add_argument("--split-configs", default=None,
                   help="--op rs-split: comma-separated gemm_rs_split_config values besides 0 (2; 1 in tuning builds)")
    p.add_argument("--variants", default=None, help="--op ag: comma-separated variants (default 0,1,3,4,6)")
    p.add_argument("--groups", default=None, help="--op ag: comma-separated group heights (default 4,8,16)")
    p.add_argument("--stock", default=None,
                   help="--op ag: comma-separated stock CUTLASS GEMM configurations to time too (csrc/tuning/probe_stock_gemm.h:"
                        " 0 persistent 128x256 c2x1, 1 stream-K 128x256 c2x1, 2 persistent 256x128 c1x2; tuning builds)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    shapes = parse_problems(args.shapes, SHAPES)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    sha, dirty = git_sha()
    data = {"schema": 1, "op": args.op, "world": args.world, "device": torch.cuda.get_device_name(dev),
            "torch": torch.__version__, "git_sha": sha, "dirty": dirty, "warmup": args.warmup, "iters": args.iters,
            "rounds": args.rounds,
            "results": []}
    for m, k, n in shapes:
        if args.op == "ag":
            mm, kk, nn = m, k, n // args.world
        else:
            mm, kk, nn = m, k // args.world, n
        a = torch.randn(mm, kk, device=dev, dtype=torch.bfloat16)
        w = torch.randn(nn, kk, device=dev, dtype=torch.bfloat16) / kk ** 0.5
        w_t = w.t()  # [K, N], K-major: the transposed nn.Linear weight
        ref = torch.mm(a, w_t)
        out = torch.empty(mm, nn, device=dev, dtype=torch.bfloat16)
        entry = {"M": m, "K": k, "N": n, "problem": [mm, kk, nn], "configs": []}
        cublas_fn = lambda: torch.mm(a, w_t)  # noqa: E731
        entry["cublas_kernel"] = cublas_kernel_name(cublas_fn)
        fns: Dict[str, Callable[[], object]] = {"cublas": cublas_fn}
        splits = [int(t) for t in args.tail_splits.split(",")] if args.tail_splits else None
        waves = [int(t) for t in args.tail_waves.split(",")] if args.tail_waves else None
        split_configs = [int(c) for c in args.split_configs.split(",")] if args.split_configs else None
        groups = [int(g) for g in args.groups.split(",")] if args.groups else None
        ag_variants = [int(v) for v in args.variants.split(",")] if args.variants else None
        for i, cfg in enumerate(configs(args.op, args.quick, splits, waves, split_configs, ag_variants, groups)):
            row = dict(cfg)
            try:
                fn = run_config(args.op, cfg, a, w_t, out)
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                row["rel_err"] = rel(out, ref)
                fns[str(i)] = fn
            except Exception as e:  # noqa: BLE001 - a variant this build lacks, or one that fails: record it
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            entry["configs"].append(row)
        for config in ([int(c) for c in args.stock.split(",")] if args.stock and args.op == "ag" else []):
            row = {"stock": config}
            try:
                fn = stock_gemm(config, a, w_t, out)
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                row["rel_err"] = rel(out, ref)
                fns[str(len(entry["configs"]))] = fn  # keyed by its row, as the configurations are
            except Exception as e:  # noqa: BLE001 - not a tuning build, or a failed launch: record it
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            entry["configs"].append(row)
        times = time_round_robin(fns, args.warmup, args.iters, args.rounds)
        med = {name: statistics.median([t for r in rounds for t in r]) for name, rounds in times.items()}
        entry["cublas_ms"] = med["cublas"]
        entry["cublas_round_ms"] = [statistics.median(r) for r in times["cublas"]]
        for i, row in enumerate(entry["configs"]):
            if str(i) in med:
                row["ms"] = med[str(i)]
                row["round_ms"] = [statistics.median(r) for r in times[str(i)]]
                row["ratio"] = row["ms"] / med["cublas"]
        ok = [r for r in entry["configs"] if "ms" in r and r["rel_err"] < 2e-2]
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        entry["best"] = best
        data["results"].append(entry)
        rounds = entry["cublas_round_ms"]
        print(f"{args.op} M={m} K={k} N={n} problem={mm}x{kk}x{nn} cuBLAS {med['cublas']:.3f} ms "
              f"(rounds {rounds[0]:.3f} .. {rounds[-1]:.3f}) "
              f"[{entry['cublas_kernel']}]", flush=True)
        for row in entry["configs"]:
            cfg = {key: row[key] for key in row
                   if key in ("variant", "group_rows", "tail_split", "tail_waves", "config", "swizzle", "raster",
                              "split", "split_config", "stock")}
            if "ms" in row:
                print(f"   {cfg} {row['ms']:.3f} ms  x{row['ratio']:.3f}  err {row['rel_err']:.1e}", flush=True)
            else:
                print(f"   {cfg} {row['error']}", flush=True)
        write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
