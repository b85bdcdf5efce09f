"""Two ranks on two GPUs (torchrun --nproc-per-node 2): the one-shot all-reduce (fluxinductor/kernels/one_shot.py)
over real symmetric memory.

Checks (each prints a PASS or FAIL line; any FAIL exits non-zero):
  * correctness: random non-zero operands, bf16/fp16/fp32, M in {1, 7, 64, 129, 256}, N in {4096, 8192, 8200}, with
    and without bias (sum; avg for some), output poisoned with NaN first, against an fp32 reference (the partials
    rounded to the operands' dtype, as the matmul rounds them); both ranks' outputs bit for bit equal; the fp32 result
    of bf16 operands and the fused residual add;
  * the op: torch.ops.fluxinductor.matmul_all_reduce under FLUXINDUCTOR_DISPATCH=fused took the one-shot path;
  * the residual add and RMSNorm fused into the reduction (torch.ops.fluxinductor.matmul_all_reduce_rms_norm, both
    forms, bf16 and fp32, with and without bias) against the fp32 reference, eagerly and replayed in a CUDA graph;
  * compiled: two plain tensor-parallel MLP blocks (DTensor, RowwiseParallel all-reduces), each output followed by the
    residual add and an RMSNorm (Hugging Face's form, then F.rms_norm's), under torch.compile(backend="flux",
    mode="reduce-overhead"): both all-reduces become the fused op and the replays match eager;
  * 1000 back-to-back calls with changing data, checked without a host sync between them;
  * a call captured in a CUDA graph, replayed 100 times with new inputs (eager calls between some replays);
  * a rank that never calls: the other's kernel gives up after FLUXINDUCTOR_TIMEOUT_S (1 s here) and the host
    raises instead of hanging; after one_shot.reset on both ranks the group works again.
Prints "ONE-SHOT CHECKS PASSED" on each rank when every check passed.

    torchrun --nproc-per-node 2 tests/gpu/run_one_shot_2rank.py
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist

FAILURES = []


def log(*args):
    print(f"[rank {dist.get_rank()}]", *args, flush=True)


def verdict(name, ok, detail=""):
    log(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
    if not ok:
        FAILURES.append(name)


def tolerance(dtype):
    return 2e-2 if dtype != torch.float32 else 1e-5


def operands(rows, k, n, dtype, device, seed, bias):
    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(rows, k, device=device, generator=gen).to(dtype)
    w = (torch.randn(k, n, device=device, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, device=device, generator=gen).to(dtype) if bias else None
    return a, w, b


def reference(a, w, b, reduce_op, world):
    """fp32: all_reduce(a @ w + b): each rank's partial with its own bias (rounded to the operands' dtype, as the
    matmul into the buffer rounds it), summed over ranks (divided by world for avg).  The operands, bias included,
    differ per rank (seeded by rank): a kernel that added one rank's bias world times would fail here."""
    partial = (a @ w if b is None else torch.addmm(b, a, w)).float()
    dist.all_reduce(partial)
    return partial / world if reduce_op == "avg" else partial


def rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def same_on_every_rank(out):
    """Whether every rank's ``out`` (the same shape and dtype on every rank) holds the same bytes (NaNs included)."""
    gathered = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, out.contiguous())
    return all(torch.equal(g.view(torch.uint8), gathered[0].view(torch.uint8)) for g in gathered)


def check_correctness(group_name, device, rank, world):
    from fluxinductor.kernels import one_shot

    k = 256
    worst = {}
    equal = True
    unequal = []
    cases = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows in (1, 7, 64, 129, 256):
            for n in (4096, 8192, 8200):
                for bias in (False, True):
                    reduce_op = "avg" if (rows + n) % 3 == 0 else "sum"
                    a, w, b = operands(rows, k, n, dtype, device, 1000 * rank + rows + n + bias, bias)
                    out = torch.full((rows, n), float("nan"), dtype=dtype, device=device)
                    one_shot.matmul_all_reduce(a, w, b, reduce_op, group_name, out=out)
                    ref = reference(a, w, b, reduce_op, world)
                    err = rel(out, ref) if not out.isnan().any() else float("inf")
                    worst[dtype] = max(worst.get(dtype, 0.0), err)
                    if not same_on_every_rank(out):
                        equal = False
                        unequal.append(f"{str(dtype)[6:]} {rows}x{n} {reduce_op}{' bias' if bias else ''}")
                    cases += 1
    for dtype, err in worst.items():
        verdict(f"correctness {dtype} ({cases // 3} shapes)", err <= tolerance(dtype), f"worst rel err {err:.3g}")
    verdict("every rank wrote the same bits", equal, f"{len(unequal)} cases differ: {', '.join(unequal[:6])}"
            if unequal else "")

    # An fp32 result of bf16 partials, and the residual add.
    a, w, b = operands(64, k, 8192, torch.bfloat16, device, 77 + rank, True)
    residual = torch.randn(64, 8192, device=device, generator=torch.Generator(device=device).manual_seed(5))
    out = torch.full((64, 8192), float("nan"), dtype=torch.float32, device=device)
    one_shot.matmul_all_reduce(a, w, b, "sum", group_name, torch.float32, residual=residual, out=out)
    err = rel(out, reference(a, w, b, "sum", world) + residual)
    verdict("fp32 result of bf16 partials + residual", err <= 1e-5, f"rel err {err:.3g}")
    one_shot.check_error(group_name, device)


def check_op(group_name, device, rank, world):
    from fluxinductor import ops, settings

    with settings.override(dispatch="fused"):
        ops.clear_plans()
        a, w, b = operands(2 * 16, 512, 4096, torch.bfloat16, device, 11 + rank, True)
        out = torch.ops.fluxinductor.matmul_all_reduce(a.view(2, 16, 512), w, b, "sum", group_name)
        ref = reference(a, w, b, "sum", world).view(2, 16, 4096)
        paths = {plan[0] for plan in ops._all_reduce_plans.values()}
        verdict("op under fused dispatch took the one-shot path", paths == {"oneshot"}, str(paths))
        err = rel(out, ref)
        verdict("op result", out.shape == (2, 16, 4096) and err <= 2e-2, f"rel err {err:.3g}")


def check_rms_norm(group_name, device, rank, world):
    """The op with the residual add and RMSNorm: one-shot path (fused dispatch), outputs poisoned, against fp32: h =
    residual + all_reduce(a @ w + b), rounded to the dtype as the graph rounds it, then the norm of that h."""
    from fluxinductor import ops, settings

    worst = {}
    equal = True
    with settings.override(dispatch="fused"):
        ops.clear_plans()
        for dtype in (torch.bfloat16, torch.float32):
            for rows, n, bias, after_cast in ((1, 8192, False, True), (7, 4096, True, False), (64, 8192, True, True),
                                              (129, 4104, False, False)):
                a, w, b = operands(rows, 256, n, dtype, device, 31 * rows + n + rank, bias)
                gen = torch.Generator(device=device).manual_seed(rows + n)  # the same residual and weight everywhere
                residual = torch.randn(rows, n, device=device, generator=gen).to(dtype)
                norm_weight = (1 + 0.1 * torch.randn(n, device=device, generator=gen)).to(dtype)
                h, normed = torch.ops.fluxinductor.matmul_all_reduce_rms_norm(
                    a.view(1, rows, 256), w, b, "sum", group_name, residual.view(1, rows, n), norm_weight, 1e-5,
                    after_cast)
                h_ref = (reference(a, w, b, "sum", world) + residual.float()).to(dtype)
                normed_ref = ops.rms_norm_reference(h_ref.float(), norm_weight.float(), 1e-5, True)
                err = max(rel(h.view(rows, n), h_ref.float()), rel(normed.view(rows, n), normed_ref))
                worst[dtype] = max(worst.get(dtype, 0.0), err if not normed.isnan().any() else float("inf"))
                equal = equal and same_on_every_rank(h) and same_on_every_rank(normed)
        paths = {plan[0] for plan in ops._all_reduce_plans.values()}
        verdict("RMSNorm op under fused dispatch took the one-shot path", paths == {"oneshot"}, str(paths))
    for dtype, err in worst.items():
        verdict(f"RMSNorm op {dtype}: h and normed", err <= tolerance(dtype), f"worst rel err {err:.3g}")
    verdict("RMSNorm op: every rank wrote the same bits", equal)

    # Captured in a CUDA graph, replayed with new inputs.
    rows, n = 16, 8192
    a_static, w, b = operands(rows, 512, n, torch.bfloat16, device, 77 + rank, True)
    residual = torch.randn(rows, n, device=device, generator=torch.Generator(device=device).manual_seed(3)).to(
        torch.bfloat16)
    norm_weight = torch.rand(n, device=device, generator=torch.Generator(device=device).manual_seed(4)).to(
        torch.bfloat16) + 0.5
    with settings.override(dispatch="fused"):
        torch.ops.fluxinductor.matmul_all_reduce_rms_norm(a_static, w, b, "sum", group_name, residual, norm_weight,
                                                          1e-6, False)  # eager first: the plan and the workspace
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h_static, normed_static = torch.ops.fluxinductor.matmul_all_reduce_rms_norm(
                a_static, w, b, "sum", group_name, residual, norm_weight, 1e-6, False)
    worst = 0.0
    for i in range(20):
        a_static.copy_(operands(rows, 512, n, torch.bfloat16, device, 600 + 3 * i + rank, False)[0])
        normed_static.fill_(float("nan"))
        graph.replay()
        h_ref = (reference(a_static, w, b, "sum", world) + residual.float()).to(torch.bfloat16)
        normed_ref = ops.rms_norm_reference(h_ref.float(), norm_weight.float(), 1e-6, False)
        worst = max(worst, rel(normed_static, normed_ref) if not normed_static.isnan().any() else float("inf"))
    torch.cuda.synchronize()
    verdict("RMSNorm op in a CUDA graph: 20 replays", worst <= 2e-2, f"worst rel err {worst:.3g}")


class _HFNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class _TorchNorm(_HFNorm):
    def forward(self, x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, 1e-5)


class _Block(torch.nn.Module):
    def __init__(self, dim, ffn, norm):
        super().__init__()
        self.up = torch.nn.Linear(dim, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, dim, bias=False)
        self.norm = norm(dim)

    def forward(self, x, normed):
        h = x + self.down(torch.nn.functional.gelu(self.up(normed)))
        return h, self.norm(h)


class _Model(torch.nn.Module):
    def __init__(self, dim, ffn):
        super().__init__()
        self.first = _Block(dim, ffn, _HFNorm)
        self.second = _Block(dim, ffn, _TorchNorm)

    def forward(self, x):
        h, normed = self.first(x, x)
        h, normed = self.second(h, normed)
        return h * normed  # both used, as the next layer would


def check_compiled(group_name, device, rank, world):
    import fluxinductor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)  # the same weights on every rank
    model = _Model(1024, 4096).to(device, torch.bfloat16)
    mesh = init_device_mesh("cuda", (world,))
    for block in (model.first, model.second):
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(4, 8, 1024, device=device, dtype=torch.bfloat16)
    # A graph served from an earlier run's caches runs no pass, so nothing would be counted.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    with torch.no_grad():
        want = model(x).float()
        fluxinductor.reset_rewrite_stats()
        compiled = torch.compile(model, backend="flux", mode="reduce-overhead")
        worst = 0.0
        for _ in range(4):
            got = compiled(x).float()
            worst = max(worst, rel(got, want))
    stats = fluxinductor.rewrite_stats()
    fused = stats["fused"].get("all_reduce_rms_norm", 0) + stats["inserted"]["fused"].get("all_reduce_rms_norm", 0)
    verdict("compiled: both all-reduces fused with the residual add and RMSNorm", fused == 2, str(stats))
    verdict("compiled: replays match eager", worst <= 2e-2, f"worst rel err {worst:.3g}")


def check_back_to_back(group_name, device, rank, world, calls=1000):
    from fluxinductor.kernels import one_shot

    rows, k, n = 64, 512, 8192
    inputs = [operands(rows, k, n, torch.bfloat16, device, 300 + 10 * i + rank, True) for i in range(4)]
    refs = [reference(a, w, b, "sum", world) for a, w, b in inputs]
    torch.cuda.synchronize()
    errors = []
    start = time.perf_counter()
    for i in range(calls):
        a, w, b = inputs[i % 4]
        out = one_shot.matmul_all_reduce(a, w, b, "sum", group_name)
        errors.append(((out.float() - refs[i % 4]).norm() / refs[i % 4].norm()))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    worst = torch.stack(errors).max().item()
    verdict(f"{calls} back-to-back calls", worst <= 2e-2, f"worst rel err {worst:.3g}, {elapsed * 1e6 / calls:.1f} us "
            "per call")
    one_shot.check_error(group_name, device)


def check_graph(group_name, device, rank, world, replays=100):
    from fluxinductor.kernels import one_shot

    rows, k, n = 32, 512, 8192
    a_static, w, b = operands(rows, k, n, torch.bfloat16, device, 900 + rank, True)
    one_shot.matmul_all_reduce(a_static, w, b, "sum", group_name)  # eager: sets up the workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = one_shot.matmul_all_reduce(a_static, w, b, "sum", group_name)
    worst = 0.0
    eager_worst = 0.0
    for i in range(replays):
        new_a = operands(rows, k, n, torch.bfloat16, device, 5000 + 7 * i + rank, False)[0]
        a_static.copy_(new_a)
        out_static.fill_(float("nan"))
        graph.replay()
        ref = reference(a_static, w, b, "sum", world)
        worst = max(worst, rel(out_static, ref) if not out_static.isnan().any() else float("inf"))
        if i % 10 == 5:  # eager calls between replays share the counters and the buffer
            eager = one_shot.matmul_all_reduce(new_a, w, b, "sum", group_name)
            eager_worst = max(eager_worst, rel(eager, ref))
    torch.cuda.synchronize()
    verdict(f"CUDA graph: {replays} replays with new inputs", worst <= 2e-2, f"worst rel err {worst:.3g}")
    verdict("eager calls between replays", eager_worst <= 2e-2, f"worst rel err {eager_worst:.3g}")
    one_shot.check_error(group_name, device)


def check_timeout(group_name, device, rank, world):
    from fluxinductor import settings
    from fluxinductor.kernels import one_shot

    a, w, b = operands(8, 256, 4096, torch.bfloat16, device, 42 + rank, False)
    one_shot.matmul_all_reduce(a, w, b, "sum", group_name)  # both ranks: a healthy call first
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        with settings.override(timeout_s=1.0):
            start = time.perf_counter()
            one_shot.matmul_all_reduce(a, w, b, "sum", group_name)  # rank 1 never makes this call
            raised = None
            try:
                one_shot.check_error(group_name, device)
            except RuntimeError as e:
                raised = str(e)
            elapsed = time.perf_counter() - start
        verdict("a peer that never calls: the caller raises after the timeout",
                raised is not None and "never entered" in raised and elapsed < 30,
                f"after {elapsed:.1f} s: {raised}")
        raised_next = False
        try:
            one_shot.matmul_all_reduce(a, w, b, "sum", group_name)
        except RuntimeError:
            raised_next = True
        verdict("the next call on the failed group raises", raised_next)
    torch.cuda.synchronize()
    dist.barrier()
    one_shot.reset(group_name)
    out = one_shot.matmul_all_reduce(a, w, b, "sum", group_name)
    err = rel(out, reference(a, w, None, "sum", world))
    verdict("the group works again after reset", err <= 2e-2, f"rel err {err:.3g}")


def main():
    from fluxinductor import settings

    settings.configure(cuda_graphs=True)  # the kernels run under torch.cuda.graph captures too
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    group_name = dist.group.WORLD.group_name
    rank, world = dist.get_rank(), dist.get_world_size()
    from fluxinductor.kernels import one_shot

    a, w, _ = operands(4, 64, 4096, torch.bfloat16, device, 0, False)
    reason = one_shot.unsupported_reason(a, w, None, "sum", group_name)
    if reason is not None:
        verdict("one-shot kernel available", False, reason)
    else:
        for check in (check_correctness, check_op, check_rms_norm, check_compiled, check_back_to_back, check_graph,
                      check_timeout):
            try:
                check(group_name, device, rank, world)
            except Exception as e:  # noqa: BLE001 - reported as a failure, the other checks still run
                verdict(check.__name__, False, f"{type(e).__name__}: {e}")
                break  # a failed collective step leaves the ranks out of step
    if not FAILURES:
        log("ONE-SHOT CHECKS PASSED")
    dist.destroy_process_group()
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
