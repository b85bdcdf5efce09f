"""Dynamic shapes on GPUs: one graph with a symbolic token dim, compiled with ``backend="flux"``, runs the fused
kernels at every length.  Run with torchrun on 2 GPUs (``device_run.sh`` step ``dtests``)::

    torchrun --nproc-per-node 2 tests/gpu/run_dynamic_2rank.py

A tensor-parallel MLP written with functional collectives (all-gather -> two matmuls, matmul -> reduce-scatter),
bf16, ``torch.compile(dynamic=True)`` with ``FLUXINDUCTOR_DISPATCH=fused`` (every eligible call on the kernels,
whatever the cost model says), forward and backward at token counts that are and are not multiples of the tiles.
Checks, per length: outputs and gradients against eager (norm-relative error <= 2e-2), no call of a fused op fell
back to the decomposition, and no compile after the first.  Prints ``rank r: ALL CHECKS PASSED`` or raises.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

HIDDEN, FFN = 1024, 4096
LENGTHS = (1024, 2000, 3072)  # global tokens; 2000 rows leave partial tiles


class SwiGLU(torch.nn.Module):
    def __init__(self, world: int, rank: int):
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def shard(shape, dim, scale):
            return torch.nn.Parameter((torch.randn(shape, generator=g) * scale).chunk(world, dim=dim)[rank].clone())

        self.w_gate = shard((HIDDEN, FFN), 1, HIDDEN ** -0.5)
        self.w_up = shard((HIDDEN, FFN), 1, HIDDEN ** -0.5)
        self.w_down = shard((FFN, HIDDEN), 0, FFN ** -0.5)

    def forward(self, x):
        group = dist.group.WORLD
        gathered = funcol.all_gather_tensor(x, 0, group)  # [M, H]
        h = torch.nn.functional.silu(gathered @ self.w_gate) * (gathered @ self.w_up)
        return funcol.reduce_scatter_tensor(h @ self.w_down, "sum", 0, group)  # [M / world, H]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    from fluxinductor import settings

    settings.configure(dispatch="fused")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    import fluxinductor
    from fluxinductor.kernels.symm import _enable_group

    _enable_group(dist.group.WORLD.group_name)
    eager = SwiGLU(world, rank).to(device=device, dtype=torch.bfloat16)
    flux = SwiGLU(world, rank).to(device=device, dtype=torch.bfloat16)
    compiled = torch.compile(flux, backend="flux", dynamic=True)
    for i, tokens in enumerate(LENGTHS):
        g = torch.Generator().manual_seed(10 + i)
        x = torch.randn(tokens, HIDDEN, generator=g).chunk(world)[rank].to(device, torch.bfloat16)
        grad = torch.randn(tokens // world, HIDDEN, generator=g).to(device, torch.bfloat16)
        before = fluxinductor.rewrite_stats()
        x_e, x_f = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y_e, y_f = eager(x_e), compiled(x_f)
        y_e.backward(grad)
        y_f.backward(grad)
        after = fluxinductor.rewrite_stats()
        errors = {"out": _rel(y_f, y_e), "grad_x": _rel(x_f.grad, x_e.grad)}
        for (name, p), q in zip(eager.named_parameters(), flux.parameters()):
            errors[name] = _rel(q.grad, p.grad)
            p.grad = q.grad = None
        bad = {k: v for k, v in errors.items() if not v <= 2e-2}
        assert not bad, f"rank {rank} tokens {tokens}: errors over 2e-2: {bad}"
        fused = {k: v - before["fused"].get(k, 0) for k, v in after["fused"].items() if v - before["fused"].get(k, 0)}
        if i == 0:
            assert fused.get("all_gather_matmul", 0) >= 2 and fused.get("matmul_reduce_scatter", 0) >= 2, fused
        else:
            assert not fused, f"rank {rank} tokens {tokens}: recompiled ({fused})"
        assert after["fallbacks"] == before["fallbacks"], \
            f"rank {rank} tokens {tokens}: fused ops ran decomposed: {after['fallbacks']}"
        print(f"rank {rank}: {tokens} tokens ok, errors " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()),
              flush=True)
    dist.barrier()
    print(f"rank {rank}: ALL CHECKS PASSED", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
