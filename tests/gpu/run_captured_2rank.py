"""Two (or more) ranks, one GPU each (torchrun --nproc-per-node 2), with ``fluxinductor.settings.configure(
cuda_graphs=True)`` (the process-wide default of the per-compile option): the fused ops captured in CUDA graphs over
real symmetric memory.

Checks (each rank asserts; a failure exits non-zero):
  * all_gather_matmul (the push, two weights, the gathered A) and matmul_reduce_scatter (the stores or, with
    --gemm-rs-push split, the split transport; bias, sum and avg) captured with torch.cuda.graph after eager warm-up calls: each of --replays replays, with new operands
    copied into the captured inputs and the outputs poisoned, matches an fp32 reference; eager calls of the same ops
    between replays still match (they then wait for every peer: a replay may have used either buffer);
  * no fallback was taken under capture (every call captured the fused kernels) and no error word is set;
  * torch.compile(mode="reduce-overhead") of a sequence-parallel block: replays match eager.
Prints "CAPTURED CHECKS PASSED" on each rank.

    torchrun --nproc-per-node 2 tests/gpu/run_captured_2rank.py [--gemm-rs-push split]   (dispatch: fused)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def log(*args):
    print(f"[rank {dist.get_rank()}]", *args, flush=True)


def rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def check_ops(group_name, device, rank, world, replays):
    import fluxinductor
    from fluxinductor import settings
    from fluxinductor.kernels import ag_gemm, gemm_rs

    gen = torch.Generator(device=device).manual_seed(1234)  # the same weights on every rank
    rows, k, n1, n2 = 512, 1024, 2048, 520
    shard = torch.empty(rows, k, dtype=torch.bfloat16, device=device)
    w1 = (torch.randn(n1, k, device=device, generator=gen) / k**0.5).to(torch.bfloat16).t()
    w2 = (torch.randn(k, n2, device=device, generator=gen) / k**0.5).to(torch.bfloat16)
    b1 = torch.randn(n1, device=device, generator=gen).to(torch.bfloat16)
    a = torch.empty(world * 200, 264, dtype=torch.bfloat16, device=device)
    w3 = (torch.randn(264, 776, device=device, generator=gen) / 16).to(torch.bfloat16)
    b3 = torch.randn(776, device=device, generator=gen).to(torch.bfloat16)

    def step():
        (o1, o2), gathered = torch.ops.fluxinductor.all_gather_matmul(shard, [w1, w2], [b1, None], 0, group_name, True)
        summed = torch.ops.fluxinductor.matmul_reduce_scatter(a, w3, b3, "sum", 0, group_name)
        averaged = torch.ops.fluxinductor.matmul_reduce_scatter(a, w3, None, "avg", 0, group_name)
        return o1, o2, gathered, summed, averaged

    def refill():
        shard.copy_(torch.randn(rows, k, device=device))
        a.copy_(torch.randn(a.shape, device=device))

    def check(outs, what):
        o1, o2, gathered, summed, averaged = outs
        full = torch.empty(world * rows, k, dtype=shard.dtype, device=device)
        dist.all_gather_into_tensor(full, shard)
        assert torch.equal(gathered, full), f"{what}: gathered A differs"
        assert rel(o1, full.float() @ w1.float() + b1.float()) <= 1e-2, what
        assert rel(o2, full.float() @ w2.float()) <= 1e-2, what
        partial = a.float() @ w3.float()
        total = partial + b3.float()
        dist.all_reduce(total)
        dist.all_reduce(partial)
        part = a.shape[0] // world
        assert rel(summed, total[rank * part:(rank + 1) * part]) <= 1e-2, what
        assert rel(averaged, partial[rank * part:(rank + 1) * part] / world) <= 1e-2, what

    fluxinductor.reset_rewrite_stats()
    for _ in range(2):  # eager warm-up: sets up the buffers and the peer check
        refill()
        check(step(), "eager warm-up")
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        step()  # warm-up on a side stream, as torch.cuda.graph's documentation asks
    torch.cuda.current_stream(device).wait_stream(stream)
    if settings.tuning.gemm_rs_push == "split":  # the captured GEMM+RS runs the split transport, not the stores one
        out = torch.empty(a.shape[0] // world, w3.shape[1], dtype=a.dtype, device=device)
        why = gemm_rs.captured_split_reason(gemm_rs._state(group_name, device), a, w3, b3, out)
        assert why is None, why
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    stats = fluxinductor.rewrite_stats()
    assert stats["fallbacks"] == {}, stats["fallbacks"]
    for i in range(replays):
        refill()
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        if i % 10 == 0 or i == replays - 1:
            check(captured, f"replay {i}")
        if i % 25 == 0:
            check(step(), f"eager call after replay {i}")
    torch.cuda.synchronize(device)
    ag_gemm.check_errors(device)
    gemm_rs.check_error(group_name, device)
    log(f"ops: {replays} replays and eager calls between them match")


def check_compiled(group_name, device):
    import torch.distributed._functional_collectives as funcol
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(512, 1536)
            self.w2 = nn.Linear(1536, 512)

        def forward(self, x):
            gathered = funcol.all_gather_tensor(x, 0, group_name)
            partial = self.w2(F.gelu(self.w1(gathered)))
            return x + funcol.reduce_scatter_tensor(partial, "sum", 0, group_name)

    torch.manual_seed(0)
    model = Block().to(device, torch.bfloat16)
    compiled = torch.compile(model, backend="flux", mode="reduce-overhead")
    with torch.no_grad():
        for step in range(8):
            x = torch.randn(1024, 512, device=device, dtype=torch.bfloat16)
            out = compiled(x).clone()
            ref = model(x)
            assert rel(out, ref.float()) <= 2e-2, (step, rel(out, ref.float()))
    log("reduce-overhead: replays match eager")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--gemm-rs-push", choices=["store", "split"], default="store",
                        help="the GEMM+RS transport of every call, eager and captured")
    args = parser.parse_args()
    from fluxinductor import settings

    # The kernels run under torch.cuda.graph captures too, and every call takes them: under `auto` this check's small
    # shapes would run NCCL then cuBLAS, and the split transport is captured only after an eager split call.
    settings.configure(cuda_graphs=True, dispatch="fused")
    settings.set_tuning(gemm_rs_push=args.gemm_rs_push)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    group_name = dist.group.WORLD.group_name
    check_ops(group_name, device, dist.get_rank(), dist.get_world_size(), args.replays)
    check_compiled(group_name, device)
    log("CAPTURED CHECKS PASSED")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
