"""Two-GPU checks of the fused all-gather + GEMM through its public interface (run under torchrun).

    torchrun --nproc-per-node 2 tests/gpu/run_ag_gemm_2rank.py [--calls 1000] [--bench out.json]

Checks (each rank prints "ALL CHECKS PASSED" at the end): the dispatcher's peer check accepts the group; numerics against an fp32 reference for awkward
shapes (M = world * 129, several weights of both layouts, with and without bias, gathered output), outputs
poisoned before every call; [B, S/w, K] shards gathered on S, batch-major in place where S/w is whole tiles;
unsupported shapes give a reason; ``--calls`` back-to-back calls with no hang and
no memory growth; ranks that disagree on the shard shape or on pushing get an error, not a hang.
With ``--bench``: times cuBLAS, the fused kernel with communication off, NCCL all-gather then cuBLAS, and
the fused op on the TP=2 shapes and writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def relative_error(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def reference(shard, weights, biases, group):
    world = dist.get_world_size(group)
    full = torch.empty((world * shard.shape[0], shard.shape[1]), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(full, shard, group=group)
    return full, [full.float() @ w.float() + (b.float() if b is not None else 0) for w, b in zip(weights, biases)]


def check_numerics(ag_gemm, group, rank, dtype):
    device = torch.device("cuda", rank)
    name = group.group_name
    for shard_rows, k, ns, with_bias, gathered in [
        (129, 264, [520, 136], True, True),
        (129, 264, [520], False, False),
        (1024, 1024, [2048, 1024, 512], True, True),
        (8, 64, [64], False, True),
        (512, 8192, [512, 1024], True, True),  # one wave, 8 MB shards (with ag_k_chunks=4: 2 MB blocks)
    ]:
        torch.manual_seed(1000 * rank + shard_rows + k)
        shard = torch.randn(shard_rows, k, dtype=dtype, device=device)
        # Even weights: the transposed view of an nn.Linear weight [N, K]; odd ones: row-major [K, N].
        stored = [torch.randn(n, k, dtype=dtype, device=device) if i % 2 == 0 else
                  torch.randn(k, n, dtype=dtype, device=device) for i, n in enumerate(ns)]
        for w in stored:  # every rank must hold the same weights: take rank 0's
            dist.broadcast(w, 0, group=group)
        weights = [w.t() if i % 2 == 0 else w for i, w in enumerate(stored)]
        biases = [torch.randn(n, dtype=dtype, device=device) if with_bias else None for n in ns]
        for b in biases:
            if b is not None:
                dist.broadcast(b, 0, group=group)
        check(ag_gemm.unsupported_reason(shard, weights, biases, name) is None, "should be supported")
        full, refs = reference(shard, weights, biases, group)
        for _ in range(3):  # alternate buffers (call parity) and reuse them
            # Poison what the allocator will hand out: fill a large block with NaN, free it.
            poison = torch.full((64 << 20,), float("nan"), dtype=dtype, device=device)
            del poison
            outputs, got = ag_gemm.all_gather_matmul(shard, weights, biases, name, gathered)
            torch.cuda.synchronize()
            ag_gemm.check_errors(device)
            for out, ref in zip(outputs, refs):
                check(out.shape == ref.shape, f"output shape {tuple(out.shape)}")
                check(not out.isnan().any(), "unwritten output")
                err = relative_error(out, ref)
                check(err <= 1e-2, f"relative error {err} for shard {shard_rows} K {k} N {out.shape[1]}")
            if gathered:
                check(torch.equal(got, full), "gathered differs")
            else:
                check(got.numel() == 0, "gathered should be empty")
    print(f"rank {rank}: numerics ok ({dtype})", flush=True)


def check_batch_major(group, rank):
    """The public op on [B, S/w, K] shards gathered on S (B > 1), under the fused dispatch: where S/w is whole 128-row
    tiles the kernel gathers batch-major in place (no permute), else the op permutes to rows-first itself; outputs
    (poisoned first) and the gathered [B, S, K] match the fp32 reference, over several calls (both buffer parities and
    the replayed signature)."""
    from fluxinductor import dispatch, ops, settings  # noqa: F401  (ops registers torch.ops.fluxinductor)

    device = torch.device("cuda", rank)
    world = dist.get_world_size(group)
    batch_major_calls = []
    results = dispatch._batch_major_results

    def counted(*args):
        batch_major_calls.append(1)
        return results(*args)

    dispatch._batch_major_results = counted
    try:
        with settings.override(dispatch="fused"):
            for batch, rows, k, ns, bias, expect_batch_major in [
                (4, 256, 1024, [4096, 512], True, True),
                (3, 384, 512, [1536], False, True),   # 3 tile rows per block, chunks that split blocks
                (2, 192, 512, [1024], True, False),   # blocks of 192 rows: not whole tiles, the op permutes
                (2, 256, 4096, [1024], False, True),  # one wave: 4 MB shards move in column blocks (3-D copies)
            ]:
                torch.manual_seed(100 * rank + batch + rows)
                shard = torch.randn(batch, rows, k, dtype=torch.bfloat16, device=device)
                stored = [torch.randn(n, k, dtype=torch.bfloat16, device=device) for n in ns]
                biases = [torch.randn(n, dtype=torch.bfloat16, device=device) if bias else None for n in ns]
                for t in stored + [b for b in biases if b is not None]:
                    dist.broadcast(t, 0, group=group)
                weights = [w.t() for w in stored]
                parts = [torch.empty_like(shard) for _ in range(world)]
                dist.all_gather(parts, shard, group=group)
                full = torch.cat(parts, 1)
                refs = [full.float() @ w.float() + (b.float() if b is not None else 0) for w, b in zip(weights, biases)]
                before = len(batch_major_calls)
                for _ in range(4):
                    poison = torch.full((64 << 20,), float("nan"), dtype=torch.bfloat16, device=device)
                    del poison
                    outputs, got = torch.ops.fluxinductor.all_gather_matmul(shard, weights, biases, 1,
                                                                            group.group_name, True)
                    torch.cuda.synchronize()
                    for out, ref in zip(outputs, refs):
                        check(out.shape == ref.shape, f"batch-major output shape {tuple(out.shape)}")
                        check(not out.isnan().any(), "batch-major: unwritten output")
                        err = relative_error(out, ref)
                        check(err <= 1e-2, f"batch-major: relative error {err} for {batch}x{rows}x{k}")
                    check(torch.equal(got, full), f"batch-major: gathered differs for {batch}x{rows}x{k}")
                took = len(batch_major_calls) - before
                check(took == (4 if expect_batch_major else 0),
                      f"{batch}x{rows}x{k}: {took} of 4 calls kept the batch-major layout")
    finally:
        dispatch._batch_major_results = results
    print(f"rank {rank}: batch-major calls ok", flush=True)


def check_unsupported(ag_gemm, group, rank):
    device = torch.device("cuda", rank)
    name = group.group_name
    shard = torch.randn(129, 129, dtype=torch.bfloat16, device=device)  # odd K: no 16-byte TMA rows
    reason = ag_gemm.unsupported_reason(shard, [torch.randn(129, 64, dtype=torch.bfloat16, device=device)],
                                        [None], name)
    check(reason is not None and "multiple of 8" in reason, f"odd K: {reason}")
    shard = torch.randn(129, 128, dtype=torch.bfloat16, device=device)
    reason = ag_gemm.unsupported_reason(shard, [torch.randn(128, 129, dtype=torch.bfloat16, device=device)],
                                        [None], name)
    check(reason is not None and "multiple of 8" in reason, f"odd N: {reason}")
    reason = ag_gemm.unsupported_reason(shard.float(), [torch.randn(128, 128, device=device)], [None], name)
    check(reason is not None, "float32 should be unsupported")
    print(f"rank {rank}: unsupported shapes give reasons", flush=True)


def check_many_calls(ag_gemm, group, rank, calls):
    device = torch.device("cuda", rank)
    name = group.group_name
    torch.manual_seed(5 + rank)
    shard = torch.randn(512, 1024, dtype=torch.bfloat16, device=device)
    weight = torch.randn(1024, 1024, dtype=torch.bfloat16, device=device)
    dist.broadcast(weight, 0, group=group)
    full, refs = reference(shard, [weight], [None], group)
    ag_gemm.all_gather_matmul(shard, [weight], [None], name, True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    start = time.time()
    for i in range(calls):
        outputs, got = ag_gemm.all_gather_matmul(shard, [weight], [None], name, True)
        del got
    torch.cuda.synchronize()
    elapsed = time.time() - start
    ag_gemm.check_errors(device)
    after = torch.cuda.memory_allocated(device)
    check(relative_error(outputs[0], refs[0]) <= 1e-2, "last of many calls is wrong")
    check(after <= before + (8 << 20), f"memory grew from {before} to {after} bytes over {calls} calls")
    print(f"rank {rank}: {calls} back-to-back calls in {elapsed:.2f} s, memory {before} -> {after}", flush=True)


def check_disagreement(ag_gemm, group, rank):
    device = torch.device("cuda", rank)
    rows = 64 if rank == 0 else 128
    shard = torch.randn(rows, 256, dtype=torch.bfloat16, device=device)
    weight = torch.randn(256, 256, dtype=torch.bfloat16, device=device)
    try:
        ag_gemm.all_gather_matmul(shard, [weight], [None], group.group_name, False)
    except ValueError as e:
        check("disagree" in str(e), f"unexpected error {e}")
        print(f"rank {rank}: disagreeing shapes raised: {e}", flush=True)
    else:
        raise AssertionError("ranks with different shard shapes did not raise")


def check_push_disagreement(ag_gemm, group, rank):
    """One rank pushing while the other pulls (rank 0 on 256-row tiles, ``settings.tuning.ag_variant=1``, with a shard
    of 128 rows, which it must pull): it would read a slot the peer never fills.  The first call of the layout raises
    on every rank, naming the push, instead of hanging or reading unfilled slots."""
    from fluxinductor import settings

    device = torch.device("cuda", rank)
    shard = torch.randn(128, 512, dtype=torch.bfloat16, device=device)
    weight = torch.randn(256, 512, dtype=torch.bfloat16, device=device).t()  # K-contiguous: the variants apply
    what = "push on one rank, pull on the other"
    with settings.override(ag_variant=1 if rank == 0 else None):
        check(ag_gemm.use_push(shard, [weight]) == (rank != 0), "the ranks should move shards differently")
        try:
            ag_gemm.all_gather_matmul(shard, [weight], [None], group.group_name, False)
        except ValueError as e:
            check("disagree" in str(e) and "push" in str(e), f"unexpected error {e}")
            print(f"rank {rank}: {what} raised: {e}", flush=True)
        else:
            raise AssertionError(f"{what} did not raise")


def time_ms(fn, group, warmup=5, iters=20):
    times = []
    for i in range(warmup + iters):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Keep the GPU busy while the host enqueues, so host-side launch cost stays out of every number.
        torch.cuda._sleep(1_000_000)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    median = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)  # max over ranks
    return median.item()


def bench(ag_gemm, group, rank, path):
    from fluxinductor import settings

    device = torch.device("cuda", rank)
    world = dist.get_world_size(group)
    name = group.group_name
    rows = []
    for m, k, n in [(4096, 12288, 49152), (2048, 8192, 28672)]:
        torch.manual_seed(rank)
        shard = torch.randn(m // world, k, dtype=torch.bfloat16, device=device)
        weight = torch.randn(n // world, k, dtype=torch.bfloat16, device=device).t()  # nn.Linear layout
        full = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        gathered = torch.empty(m, k, dtype=torch.bfloat16, device=device)

        def nccl_seq():
            dist.all_gather_into_tensor(gathered, shard, group=group)
            torch.mm(gathered, weight)

        row = {"m": m, "k": k, "n": n, "world": world,
               "gemm_cublas_ms": time_ms(lambda: torch.mm(full, weight), group),
               "gemm_fused_nocomm_ms": time_ms(lambda: ag_gemm.gemm_only(full, weight, None), group),
               "comm_nccl_ms": time_ms(lambda: dist.all_gather_into_tensor(gathered, shard, group=group), group),
               "nccl_seq_ms": time_ms(nccl_seq, group),
               "fused_ms": time_ms(lambda: ag_gemm.all_gather_matmul(shard, [weight], [None], name, False), group)}
        for chunks in (1, 4):
            with settings.override(ag_chunks=chunks):
                row[f"fused_chunks{chunks}_ms"] = time_ms(
                    lambda: ag_gemm.all_gather_matmul(shard, [weight], [None], name, False), group)
        # Tuning sweep: kernel variant x tile-order group height (communication off, then on).
        for variant in (0, 1, 2, 6):
            for group_rows in (4, 8, 16):
                row[f"nocomm_v{variant}_g{group_rows}_ms"] = time_ms(
                    lambda: ag_gemm.launch_gemm(full, weight, None, torch.empty(m, weight.shape[1], dtype=full.dtype,
                                                device=device), variant=variant, group_rows=group_rows), group)
            with settings.override(ag_variant=variant):
                row[f"fused_v{variant}_ms"] = time_ms(
                    lambda: ag_gemm.all_gather_matmul(shard, [weight], [None], name, False), group)
        t_gemm, t_seq = row["gemm_cublas_ms"], row["nccl_seq_ms"]
        row["efficiency"] = 1 - (row["fused_ms"] - t_gemm) / (t_seq - t_gemm)
        row["nocomm_vs_cublas"] = row["gemm_fused_nocomm_ms"] / t_gemm
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        del shard, weight, full, gathered
        torch.cuda.empty_cache()
    if rank == 0:
        record = {"device": torch.cuda.get_device_name(device), "gpus": world, "torch": torch.__version__,
                  "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                  "timing": "CUDA events, median of 20 after 5 warm-ups, barrier before each, max over ranks; "
                            "a ~0.5 ms GPU sleep before the start event hides host launch cost",
                  "rows": rows}
        with open(path, "w") as f:
            json.dump(record, f, indent=1)


def check_peers(group, rank):
    """The dispatcher's peer check passes these two GPUs (one host, NVLink: the 2xH200 machine is NV18), and a
    group on one GPU's rank alone has nothing to check."""
    from fluxinductor.kernels import peers

    device = torch.device("cuda", rank)
    verdict = peers.group_reason(group.group_name, device)
    check(verdict is None, f"peer check objects to the 2-GPU group: {verdict}")
    alone = dist.new_group([0])
    if rank == 0:
        check(peers.group_reason(alone.group_name, device) is None, "a one-rank group has no peers to object to")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--bench", default=None, help="write timings as JSON here")
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    from fluxinductor.kernels import ag_gemm

    if not args.skip_checks:
        check_peers(group, rank)
        check_numerics(ag_gemm, group, rank, torch.bfloat16)
        check_numerics(ag_gemm, group, rank, torch.float16)
        check_unsupported(ag_gemm, group, rank)
        check_batch_major(group, rank)
        check_many_calls(ag_gemm, group, rank, args.calls)
        check_disagreement(ag_gemm, group, rank)
        check_push_disagreement(ag_gemm, group, rank)
        # After a refused call the group still works.
        check_numerics(ag_gemm, group, rank, torch.bfloat16)
    if args.bench:
        bench(ag_gemm, group, rank, args.bench)
    print(f"rank {rank}: ALL CHECKS PASSED", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
