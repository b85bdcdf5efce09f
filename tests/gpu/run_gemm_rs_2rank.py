"""Two ranks on two GPUs (torchrun --nproc-per-node 2): the public GEMM+RS interface over real symmetric memory.

Checks (each rank asserts; a failure exits non-zero):
  * random non-zero inputs, M not a multiple of the tile, odd N, both weight layouts, bias or not, sum and
    avg, bf16 and fp16: relative error vs an fp32 reference <= 1e-2, output poisoned with NaN first;
  * [B, S, K] operands scattered on S, read batch-major in place where S/world is whole tiles;
  * a sum of two and three matmuls (more_a, more_weights) through the op: the split transport's K slabs;
  * unsupported shapes give a reason (odd K);
  * 1000 back-to-back calls: no deadlock, no memory growth, last result correct;
  * ranks disagreeing on shapes: RuntimeError on both ranks, not a hang (new shape: the store check;
    known shapes: the device handshake), and the group works again after gemm_rs.reset().
With --bench: cuBLAS, NCCL sequential (GEMM then reduce_scatter), fused and gemm_only timings for the
issue's shapes; the JSON goes to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def log(*args):
    print(f"[rank {dist.get_rank()}]", *args, flush=True)


def make_weight(k, n, k_major, dtype, device, gen):
    if k_major:
        return (torch.randn(n, k, device=device, generator=gen) / k**0.5).to(dtype).t()
    return (torch.randn(k, n, device=device, generator=gen) / k**0.5).to(dtype)


def reference(a, w, bias, reduce_op, world, rank):
    partial = a.float() @ w.float() + (bias.float() if bias is not None else 0)
    dist.all_reduce(partial)
    if reduce_op == "avg":
        partial = partial / world
    rows = partial.shape[0] // world
    return partial[rank * rows:(rank + 1) * rows]


def rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def check_correctness(group_name, device, rank, world):
    from fluxinductor.kernels import gemm_rs

    cases = [
        # (M, K, N, dtype; M = world * rows per rank, k_major, bias, reduce_op)
        (world * 200, 264, 520, torch.bfloat16, True, True, "sum"),
        (world * 200, 264, 520, torch.bfloat16, True, True, "avg"),
        (world * 333, 128, 1001, torch.bfloat16, True, False, "sum"),  # odd N: K-major weight only
        (world * 512, 512, 768, torch.bfloat16, False, True, "avg"),
        (world * 256, 256, 1024, torch.float16, True, True, "sum"),
        (world * 1000, 1024, 2048, torch.bfloat16, True, True, "sum"),
        (world, 8, 8, torch.bfloat16, True, True, "sum"),  # one row per rank
    ]
    for i, (m, k, n, dtype, k_major, with_bias, op) in enumerate(cases):
        gen = torch.Generator(device=device).manual_seed(100 * i + rank)
        a = torch.randn(m, k, device=device, generator=gen).to(dtype)
        w = make_weight(k, n, k_major, dtype, device, gen)
        bias_gen = torch.Generator(device=device).manual_seed(7 + i)  # bias is replicated
        bias = torch.randn(n, device=device, generator=bias_gen).to(dtype) if with_bias else None
        reason = gemm_rs.unsupported_reason(a, w, bias, op, group_name)
        assert reason is None, reason
        out = torch.full((m // world, n), float("nan"), dtype=dtype, device=device)
        gemm_rs.matmul_reduce_scatter(a, w, bias, op, group_name, out=out)
        gemm_rs.check_error(group_name)
        ref = reference(a, w, bias, op, world, rank)
        err = rel(out, ref)
        assert not out.isnan().any(), f"case {i}: NaN left in the output"
        assert err <= 1e-2, f"case {i} {(m, k, n, dtype, k_major, with_bias, op)}: rel err {err}"
        log(f"case {i} m={m} k={k} n={n} {dtype} k_major={k_major} bias={with_bias} {op}: rel err {err:.2e}")
    from fluxinductor.kernels.gemm_rs_split import float_result_reason

    # Autocast's fp32 reduction of bf16 (fp16) partials (out_dtype): the fp32 sum of the rounded partials, for every
    # transport asked for; the tolerance is well under one rounding of the result to that dtype.  The split transport
    # writes it for bf16 and an N-major weight at two ranks, its own partial entering the sum unrounded (the others
    # take copy: a K-major weight here).
    fp32_cases = [("store", True, "sum", torch.bfloat16), ("copy", False, "avg", torch.bfloat16),
                  ("split", True, "sum", torch.bfloat16), ("split", False, "sum", torch.bfloat16),
                  ("split", False, "avg", torch.bfloat16), ("store", False, "sum", torch.float16),
                  ("copy", True, "avg", torch.float16)]
    for i, (transport, k_major, op, half) in enumerate(fp32_cases):
        m, k, n = world * 1000, 264, 520
        gen = torch.Generator(device=device).manual_seed(900 + 10 * i + rank)
        a = torch.randn(m, k, device=device, generator=gen).to(half)
        w = make_weight(k, n, k_major, half, device, gen)
        bias = torch.randn(n, device=device, generator=torch.Generator(device=device).manual_seed(9)).to(half)
        out = torch.full((m // world, n), float("nan"), dtype=torch.float32, device=device)
        gemm_rs.matmul_reduce_scatter(a, w, bias, op, group_name, out=out, transport=transport)
        gemm_rs.check_error(group_name)
        # Where the split transport writes the fp32 result itself (gemm_rs_split's rule), its own partial is exact.
        own_exact = transport == "split" and float_result_reason(world, w, torch.float32) is None
        exact = a.float() @ w.float() + bias.float()
        partials = [torch.empty_like(exact) for _ in range(world)]
        dist.all_gather(partials, exact)
        rows = slice(rank * (m // world), (rank + 1) * (m // world))
        ref = sum((p if own_exact and q == rank else p.to(half).float())[rows] for q, p in enumerate(partials))
        ref = ref / world if op == "avg" else ref
        err = rel(out, ref)
        tol = 1e-4 if half == torch.bfloat16 else 5e-5
        assert out.dtype == torch.float32 and err <= tol, f"fp32 result from {half}, {transport}: rel err {err}"
        log(f"fp32 result from {half}, {transport} {op} k_major={k_major} own partial exact={own_exact}: "
            f"rel err {err:.2e}")
    # A sum of matmuls through the op (N-major weights, as the backward's input gradients), fused dispatch: the K slabs,
    # whichever of the kernel module's entry points the dispatcher calls.
    from fluxinductor import settings

    for i, ks in enumerate(((128, 72), (512, 64, 64))):
        gen = torch.Generator(device=device).manual_seed(700 + 10 * i + rank)
        s, n = world * 256, 1024
        a_all = [torch.randn(1, s, k, device=device, generator=gen).to(torch.bfloat16) for k in ks]
        w_all = [make_weight(k, n, False, torch.bfloat16, device, gen) for k in ks]
        calls = []
        originals = {name: getattr(gemm_rs, name) for name in ("matmul_reduce_scatter", "prepare_matmul_reduce_scatter")}

        def spy(fn):
            def wrapped(*args, **kwargs):
                calls.append(len(kwargs.get("more", ())))
                return fn(*args, **kwargs)
            return wrapped

        for name, fn in originals.items():
            setattr(gemm_rs, name, spy(fn))
        try:
            with settings.override(dispatch="fused"):
                out = torch.ops.fluxinductor.matmul_reduce_scatter(a_all[0], w_all[0], None, "sum", 1, group_name,
                                                                   more_a=a_all[1:], more_weights=w_all[1:])
        finally:
            for name, fn in originals.items():
                setattr(gemm_rs, name, fn)
        gemm_rs.check_error(group_name)
        partial = sum(a.float() @ w.float() for a, w in zip(a_all, w_all))
        dist.all_reduce(partial)
        ref = partial[:, rank * (s // world):(rank + 1) * (s // world)]
        err = rel(out, ref)
        assert calls == [len(ks) - 1], f"K slabs {ks}: the kernel module saw {calls}"
        assert err <= 1e-2, f"K slabs {ks}: rel err {err}"
        log(f"K slabs {ks}: rel err {err:.2e}")
    a = torch.randn(64, 100, device=device, dtype=torch.bfloat16)
    w = torch.randn(100, 64, device=device, dtype=torch.bfloat16)
    assert "multiple of 8" in gemm_rs.unsupported_reason(a, w, None, "sum", group_name)
    a = torch.randn(63, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    assert "do not split" in gemm_rs.unsupported_reason(a, w, None, "sum", group_name)


def check_batch_major(group_name, device, rank, world):
    """The public op on [B, S, K] operands scattered on S (B > 1) under the fused dispatch: where S/world is whole
    128-row tiles the kernel reads each owner's blocks in place (no permute), else the op permutes itself; the
    [B, S/world, N] result (poisoned first) matches the fp32 reference over several calls (replays included)."""
    from fluxinductor import ops, settings  # noqa: F401  (ops registers torch.ops.fluxinductor)
    from fluxinductor.kernels import gemm_rs

    kept = []  # the batch_rows each fused call was prepared or run with
    real = gemm_rs.prepare_matmul_reduce_scatter, gemm_rs.matmul_reduce_scatter

    def spy(fn):
        def wrapped(*args, **kwargs):
            kept.append(kwargs.get("batch_rows", 0))
            return fn(*args, **kwargs)
        return wrapped

    gemm_rs.prepare_matmul_reduce_scatter, gemm_rs.matmul_reduce_scatter = map(spy, real)
    try:
        with settings.override(dispatch="fused"):
            for batch, rows, k, n, with_bias, batch_major in [
                (4, 256, 512, 1024, True, True),
                (3, 384, 264, 520, False, True),   # a partial K tile, odd tiles of N
                (2, 192, 256, 512, True, False),   # blocks of 192 rows: the op runs rows-first
            ]:
                gen = torch.Generator(device=device).manual_seed(7 * rank + batch)
                a = torch.randn(batch, world * rows, k, generator=gen, device=device, dtype=torch.bfloat16)
                w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
                bias = torch.randn(n, device=device, dtype=torch.bfloat16) if with_bias else None
                dist.broadcast(w, 0)
                if bias is not None:
                    dist.broadcast(bias, 0)
                full = a.float() @ w.float().t() + (bias.float() if bias is not None else 0)
                dist.all_reduce(full)
                ref = full[:, rank * rows:(rank + 1) * rows]
                before = len(kept)
                for _ in range(4):
                    poison = torch.full((64 << 20,), float("nan"), dtype=torch.bfloat16, device=device)
                    del poison
                    out = torch.ops.fluxinductor.matmul_reduce_scatter(a, w.t(), bias, "sum", 1, group_name)
                    torch.cuda.synchronize()
                    assert out.shape == (batch, rows, n), tuple(out.shape)
                    assert not out.isnan().any(), "batch-major: unwritten output"
                    err = rel(out, ref)
                    assert err <= 1e-2, f"batch-major {batch}x{rows}x{k}x{n}: relative error {err}"
                # the first call prepares the signature's run (later ones replay it): its batch rows say the layout
                assert kept[before:] and (kept[before] == rows if batch_major else kept[before] == 0), kept[before:]
    finally:
        gemm_rs.prepare_matmul_reduce_scatter, gemm_rs.matmul_reduce_scatter = real
    log("batch-major calls ok")


def check_many_calls(group_name, device, rank, world, calls=1000):
    from fluxinductor.kernels import gemm_rs

    m, k, n = 2 * 256, 512, 1024
    gen = torch.Generator(device=device).manual_seed(rank + 11)
    a = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
    w = make_weight(k, n, True, torch.bfloat16, device, gen)
    bias = torch.ones(n, device=device, dtype=torch.bfloat16)
    out = gemm_rs.matmul_reduce_scatter(a, w, bias, "sum", group_name)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    for _ in range(calls):
        out = gemm_rs.matmul_reduce_scatter(a, w, bias, "sum", group_name)
    gemm_rs.check_error(group_name)
    elapsed = time.perf_counter() - start
    after = torch.cuda.memory_allocated(device)
    assert after <= before, f"memory grew from {before} to {after} bytes over {calls} calls"
    err = rel(out, reference(a, w, bias, "sum", world, rank))
    assert err <= 1e-2, err
    log(f"{calls} back-to-back calls: {elapsed * 1e6 / calls:.1f} us/call, memory {before}->{after}, err {err:.2e}")


def check_disagreement(group_name, device, rank, world):
    from fluxinductor.kernels import gemm_rs

    k, n = 128, 256
    w = make_weight(k, n, True, torch.bfloat16, device, torch.Generator(device=device).manual_seed(1))

    def call(m):
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        return gemm_rs.matmul_reduce_scatter(a, w, None, "sum", group_name)

    # Shapes no rank has seen: caught by the store check before anything is launched.
    try:
        call(world * 160 if rank == 0 else world * 192)
        raise AssertionError("no error for ranks disagreeing on a new shape")
    except RuntimeError as e:
        assert "disagree" in str(e), e
        log("new shapes that disagree ->", str(e)[:100])
    # Shapes every rank has agreed on before: caught by the device handshake.
    for m in (world * 128, world * 256):
        call(m)
    gemm_rs.check_error(group_name)
    call(world * 128 if rank == 0 else world * 256)
    try:
        gemm_rs.check_error(group_name)
        raise AssertionError("no error for ranks disagreeing on known shapes")
    except RuntimeError as e:
        assert "different shapes" in str(e), e
        log("known shapes that disagree ->", str(e)[:100])
    try:
        call(world * 128)
        raise AssertionError("the failed group did not keep raising")
    except RuntimeError:
        pass
    gemm_rs.reset(group_name)
    dist.barrier()
    m = world * 128
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    out = gemm_rs.matmul_reduce_scatter(a, w, None, "sum", group_name)
    gemm_rs.check_error(group_name)
    assert rel(out, reference(a, w, None, "sum", world, rank)) <= 1e-2
    log("after reset the group works again")


def gemm_rs_reset(group_name):
    from fluxinductor.kernels import gemm_rs

    torch.cuda.synchronize()
    gemm_rs.reset(group_name)
    dist.barrier()


def time_ms(fn, warmup=5, iters=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    median = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def bench(group_name, device, rank, world, shapes, configs=(None,)):
    from fluxinductor import settings
    from fluxinductor.kernels import gemm_rs

    rows = []
    group = dist.group.WORLD
    for m, k_global, n in shapes:
        k = k_global // world
        gen = torch.Generator(device=device).manual_seed(rank)
        a = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        w = make_weight(k, n, True, torch.bfloat16, device, gen)  # transposed nn.Linear weight
        rs_out = torch.empty(m // world, n, device=device, dtype=torch.bfloat16)

        def nccl_seq():
            partial = torch.mm(a, w)
            dist.reduce_scatter_tensor(rs_out, partial, group=group)

        def comm_only(partial=torch.mm(a, w)):
            dist.reduce_scatter_tensor(rs_out, partial, group=group)

        t_gemm = time_ms(lambda: torch.mm(a, w))
        t_comm = time_ms(comm_only)
        t_seq = time_ms(nccl_seq)
        for config in configs:
            with settings.override(**(config or {})):
                t_only = time_ms(lambda: gemm_rs.gemm_only(a, w, None))
                t_fused = time_ms(lambda: gemm_rs.matmul_reduce_scatter(a, w, None, "sum", group_name))
                gemm_rs.check_error(group_name)
                nccl_seq()
                fused = gemm_rs.matmul_reduce_scatter(a, w, None, "sum", group_name)
            err = rel(fused, rs_out.float())
            eff = 1 - (t_fused - t_gemm) / (t_seq - t_gemm) if t_seq > t_gemm else float("nan")
            row = dict(m=m, k=k_global, n=n, config=config, cublas_gemm_ms=t_gemm, nccl_rs_ms=t_comm,
                       nccl_seq_ms=t_seq, fused_gemm_only_ms=t_only, fused_ms=t_fused, overlap_efficiency=eff,
                       gemm_only_vs_cublas=t_only / t_gemm, fused_vs_nccl_seq_rel_err=err)
            rows.append(row)
            if rank == 0:
                log(json.dumps(row))
    return rows


POSITIONAL_KEYS = ("gemm_rs_config", "gemm_rs_swizzle", "gemm_rs_raster")


def parse_variant(text):
    """'config,swizzle,raster[,push=copy][,bands=4]' -> the tuning (fluxinductor.settings.set_tuning fields) of one
    kernel variant."""
    tuning, position = {}, 0
    for item in text.split(","):
        item = item.strip()
        if "=" in item:
            key, value = item.split("=", 1)
            tuning["gemm_rs_" + key.strip().lower()] = value.strip()
        else:
            if item:
                tuning[POSITIONAL_KEYS[position]] = item
            position += 1
    return tuning


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--pushes", default="",
                        help="run the checks once per GEMM+RS transport in this comma-separated list "
                        "(settings.tuning.gemm_rs_push; empty: the default transport only)")
    parser.add_argument("--configs", default="",
                        help="kernel variants to time, ';'-separated, each 'config,swizzle,raster[,push=store|copy]"
                        "[,bands=N]' (empty fields = default); config needs a tuning build "
                        "(CMAKE_ARGS=-DFLUXINDUCTOR_KERNEL_TUNING=ON)")
    parser.add_argument("--shapes", default="4096x12288x49152,2048x8192x28672,8192x8192x28672,1024x8192x8192,"
                        "4096x28672x8192", help="global MxKxN to time with --bench, comma-separated")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    from fluxinductor import settings

    if not args.skip_checks:
        for push in args.pushes.split(",") if args.pushes else [""]:
            if push:
                log(f"checks with settings.tuning.gemm_rs_push={push}")
            with settings.override(gemm_rs_push=push or None):
                check_correctness(group_name, device, rank, world)
                check_batch_major(group_name, device, rank, world)
                check_many_calls(group_name, device, rank, world)
                check_disagreement(group_name, device, rank, world)
                gemm_rs_reset(group_name)
        log("all checks passed")
    if args.bench:
        configs = [None]
        if args.configs:
            configs = [parse_variant(variant) for variant in args.configs.split(";")]
        shapes = [tuple(int(x) for x in item.split("x")) for item in args.shapes.split(",") if item]
        rows = bench(group_name, device, rank, world, shapes, configs)
        if rank == 0 and args.json:
            meta = dict(device=torch.cuda.get_device_name(device), world=world, torch=torch.__version__,
                        cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())),
                        timing="CUDA events, median of 20 after 5 warm-ups, barrier before each, max over ranks",
                        dtype="bfloat16", weight="transposed nn.Linear weight (K-major)", rows=rows)
            with open(args.json, "w") as f:
                json.dump(meta, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
