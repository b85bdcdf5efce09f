"""Ranks on GPUs of one host as emulated nodes (every GPU a node, or nodes of the GPUs given): the inter-node path
(fluxinductor/kernels/internode.py) under ``settings.tuning.emulate_nodes``, its puts through NVSHMEM.  With the
environment of the call (NVSHMEM_DISABLE_P2P=1 and a remote transport) NVSHMEM carries them over that transport;
without, over its peer-to-peer path.

Checks (each prints a PASS or FAIL line; any FAIL exits non-zero):
  * the ops take the inter-node path (torch.ops.fluxinductor.* under FLUXINDUCTOR_DISPATCH=fused);
  * AG+GEMM: random non-zero operands, bf16 and fp16, shard rows 1, 7, 129 and 1000, one and two weights, bias,
    the gathered input returned, against an fp32 reference; the workspace's slots poisoned with NaN before each case;
  * GEMM+RS: bf16 and fp16, sum and avg, bias, odd rows per rank, N 4096 and 1000 (the reduction's scalar path);
  * torch.compile(backend="flux") of a sequence-parallel block (all-gather, two linears, reduce-scatter) matches eager;
  * 1000 back-to-back calls of each op with changing data, compared on the device, one host sync at the end;
  * a rank that skips a call: the others' waits give up after FLUXINDUCTOR_TIMEOUT_S and the host raises.
Prints "INTERNODE CHECKS PASSED" on each rank when every check passed.

    torchrun --nproc-per-node 2 tests/gpu/run_internode.py         # every GPU a node
    torchrun --nproc-per-node 4 tests/gpu/run_internode.py 2       # two nodes of two GPUs: rails, forwarding
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

FAILURES = []


def log(*args):
    print(f"[rank {dist.get_rank()}]", *args, flush=True)


def verdict(name, ok, detail=""):
    log(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
    if not ok:
        FAILURES.append(name)


def rel(out, ref):
    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-6)).item()


def poison(group_name, device):
    """NaN bytes over the workspace's data (both parities), behind a barrier on both sides."""
    from fluxinductor.kernels import internode

    ws = internode._workspaces.get((group_name, device.index))
    torch.cuda.synchronize(device)
    dist.barrier()
    if ws is not None and ws.buffer is not None:
        ws.buffer[internode._FLAG_BYTES:].fill_(0xFF)
    torch.cuda.synchronize(device)
    dist.barrier()


def check_all_gather_matmul(group_name, device, rank, world):
    ops = torch.ops.fluxinductor
    for dtype in (torch.bfloat16, torch.float16):
        for rows, k, ns, bias in ((1, 512, (256,), False), (7, 1024, (512, 384), True), (129, 2048, (1024,), True),
                                  (1000, 4096, (4096, 1024), False)):
            gen = torch.Generator(device=device).manual_seed(100 * rank + rows)
            shard = torch.randn(rows, k, device=device, generator=gen).to(dtype)
            torch.manual_seed(rows)  # the weights are the same on every rank
            weights = [(torch.randn(k, n, device=device) / k**0.5).to(dtype) for n in ns]
            biases = [torch.randn(n, device=device).to(dtype) if bias else None for n in ns]
            poison(group_name, device)
            with torch.no_grad():
                outputs, gathered = ops.all_gather_matmul(shard, weights, biases, 0, group_name, True)
            full = torch.empty(world * rows, k, device=device, dtype=dtype)
            dist.all_gather_into_tensor(full, shard)
            errs = [rel(o, full.float() @ w.float() + (0 if b is None else b.float()))
                    for o, w, b in zip(outputs, weights, biases)]
            ok = max(errs) < 2e-2 and torch.equal(gathered, full)
            verdict(f"all_gather_matmul {dtype} rows {rows} k {k} n {ns} bias {bias}", ok,
                    f"rel {[f'{e:.1e}' for e in errs]}, gathered equal {torch.equal(gathered, full)}")


def check_matmul_reduce_scatter(group_name, device, rank, world):
    ops = torch.ops.fluxinductor
    for dtype in (torch.bfloat16, torch.float16):
        for rows, k, n, bias, reduce_op in ((1, 512, 4096, False, "sum"), (7, 1024, 1000, True, "avg"),
                                            (129, 2048, 4096, True, "sum"), (1024, 4096, 1000, False, "sum")):
            gen = torch.Generator(device=device).manual_seed(7 * rank + rows)
            a = torch.randn(world * rows, k, device=device, generator=gen).to(dtype)
            w = (torch.randn(k, n, device=device, generator=gen) / k**0.5).to(dtype)
            b = torch.randn(n, device=device, generator=gen).to(dtype) if bias else None
            poison(group_name, device)
            with torch.no_grad():
                out = ops.matmul_reduce_scatter(a, w, b, reduce_op, 0, group_name)
            partial = (a @ w if b is None else torch.addmm(b, a, w)).float()
            dist.all_reduce(partial)
            ref = partial[rank * rows:(rank + 1) * rows] / (world if reduce_op == "avg" else 1)
            err = rel(out, ref)
            verdict(f"matmul_reduce_scatter {dtype} rows {rows} k {k} n {n} bias {bias} {reduce_op}", err < 2e-2,
                    f"rel {err:.1e}")


def check_path(group_name, device):
    from fluxinductor import dispatch
    from fluxinductor.kernels import internode

    dispatch.clear_plans()
    shard = torch.randn(64, 512, device=device, dtype=torch.bfloat16)
    w = torch.randn(512, 256, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        fused = dispatch.all_gather_matmul(shard, [w], [None], 0, group_name, False)
        plan = [p for k, p in dispatch._plans.items() if k[0] == "all_gather_matmul"]
    ok = fused is not None and plan and plan[0][0] == "internode" and (group_name, device.index) in internode._workspaces
    verdict("the dispatcher takes the inter-node path", bool(ok), f"plan {plan}")


def check_compiled(group_name, device, rank):
    import torch.distributed._functional_collectives as funcol
    import torch.nn as nn
    import torch.nn.functional as F

    from fluxinductor.kernels import internode

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
    compiled = torch.compile(model, backend="flux")
    ws = internode._workspaces[(group_name, device.index)]
    worst = 0.0
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(1024, 512, device=device, dtype=torch.bfloat16, generator=torch.Generator(
                device=device).manual_seed(10 * rank + step))
            before = ws.epoch
            out = compiled(x)
            calls = ws.epoch - before
            worst = max(worst, rel(out, model(x).float()))
    verdict("torch.compile(backend='flux') through the inter-node path", worst < 2e-2 and calls == 2,
            f"rel {worst:.1e}, inter-node calls per step {calls}")


def check_many_calls(group_name, device, rank, world, calls=1000):
    ops = torch.ops.fluxinductor
    k, n, rows = 1024, 2048, 256
    torch.manual_seed(3)
    w = (torch.randn(k, n, device=device) / k**0.5).to(torch.bfloat16)
    w_rs = (torch.randn(k, n, device=device) / k**0.5).to(torch.bfloat16)
    worst = torch.zeros((), device=device)
    gen = torch.Generator(device=device).manual_seed(rank)
    with torch.no_grad():
        for i in range(calls):
            shard = torch.randn(rows, k, device=device, generator=gen).to(torch.bfloat16)
            (out,), _ = ops.all_gather_matmul(shard, [w], [None], 0, group_name, False)
            full = torch.empty(world * rows, k, device=device, dtype=torch.bfloat16)
            dist.all_gather_into_tensor(full, shard)
            ref = full.float() @ w.float()
            worst = torch.maximum(worst, (out.float() - ref).norm() / ref.norm())
            a = torch.randn(world * rows, k, device=device, generator=gen).to(torch.bfloat16)
            rs = ops.matmul_reduce_scatter(a, w_rs, None, "sum", 0, group_name)
            partial = (a @ w_rs).float()
            dist.all_reduce(partial)
            ref = partial[rank * rows:(rank + 1) * rows]
            worst = torch.maximum(worst, (rs.float() - ref).norm() / ref.norm())
    err = worst.item()
    verdict(f"{calls} back-to-back calls of each op", err < 2e-2, f"worst rel {err:.1e}")


def check_late_rank(group_name, device, rank, world):
    from fluxinductor.kernels import internode

    ops = torch.ops.fluxinductor
    shard = torch.randn(64, 512, device=device, dtype=torch.bfloat16)
    w = torch.randn(512, 256, device=device, dtype=torch.bfloat16)
    with torch.no_grad():  # a call both ranks make: the group agrees on the signature (a collective step)
        ops.all_gather_matmul(shard, [w], [None], 0, group_name, False)
    internode.check_errors(device, synchronize=True)
    dist.barrier()
    raised = None
    if rank != 1:  # rank 1 never makes this one
        with torch.no_grad():
            ops.all_gather_matmul(shard, [w], [None], 0, group_name, False)
        try:
            internode.check_errors(device, synchronize=True)
        except Exception as e:  # noqa: BLE001 - the check below names what was raised
            raised = e
        verdict("a missing peer: the wait gives up and the host raises",
                raised is not None and ("did not arrive" in str(raised) or "timed out" in str(raised)),
                f"{type(raised).__name__}: {str(raised)[:160]}")
    dist.barrier()


def main():
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    from fluxinductor import settings

    os.environ["FLUXINDUCTOR_DISPATCH"] = "fused"
    os.environ.setdefault("FLUXINDUCTOR_TIMEOUT_S", "3")
    settings.reload()
    gpus_per_node = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    settings.set_tuning(emulate_nodes=gpus_per_node)
    group_name = dist.group.WORLD.group_name
    check_path(group_name, device)
    if gpus_per_node > 1:
        from fluxinductor.kernels import internode

        ws = internode._workspaces[(group_name, device.index)]
        verdict(f"{world // gpus_per_node} nodes of {gpus_per_node}: the all-gather goes by rails", ws.rails is not None,
                f"rails {ws.rails}, node peers {ws.local}")
    check_all_gather_matmul(group_name, device, rank, world)
    check_matmul_reduce_scatter(group_name, device, rank, world)
    check_compiled(group_name, device, rank)
    check_many_calls(group_name, device, rank, world)
    check_late_rank(group_name, device, rank, world)
    if FAILURES:
        log("FAILED:", ", ".join(FAILURES))
    else:
        log("INTERNODE CHECKS PASSED")
    sys.stdout.flush()
    os._exit(1 if FAILURES else 0)  # no NVSHMEM teardown: it has hung at exit in some torch/NVSHMEM versions


if __name__ == "__main__":
    main()
