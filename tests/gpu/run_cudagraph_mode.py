"""torch.compile(backend="flux", mode="reduce-overhead") on one GPU (a one-rank NCCL group): the fused ops run their
kernels on every call while inductor captures the rest of the graph in CUDA graphs (the ops are tagged
cudagraph_unsafe, so the graph is partitioned around them).  Prints "CUDAGRAPH MODE OK" at the end.

    FLUXINDUCTOR_DISPATCH=fused python tests/gpu/run_cudagraph_mode.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def main():
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    import torch.distributed._functional_collectives as funcol
    from torch._dynamo.utils import counters

    import fluxinductor

    group = dist.group.WORLD
    hidden, ffn, tokens = 512, 1536, 1000  # 1000 rows: not a multiple of the tile

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(hidden, ffn)
            self.w2 = nn.Linear(ffn, hidden)

        def forward(self, x):
            gathered = funcol.all_gather_tensor(x, 0, group)
            partial = self.w2(F.gelu(self.w1(gathered)))
            return x + funcol.reduce_scatter_tensor(partial, "sum", 0, group)

    torch.manual_seed(0)
    reference = Block().to(device)
    model = Block().to(device, torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()})
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    fluxinductor.reset_rewrite_stats()
    compiled = torch.compile(model, backend="flux", mode="reduce-overhead")
    worst = 0.0
    with torch.no_grad():
        for step in range(6):  # warm-up, recording, then replays
            x = torch.randn(tokens, hidden, device=device)
            out = compiled(x.to(torch.bfloat16)).float().clone()  # a replay reuses its output buffers
            ref = reference(x.to(torch.bfloat16).float())
            err = ((out - ref).norm() / ref.norm()).item()
            worst = max(worst, err)
            print(f"step {step}: relative error {err:.2e}", flush=True)
    stats = fluxinductor.rewrite_stats()
    print("stats:", stats)
    print("inductor counters:", {k: v for k, v in counters["inductor"].items() if "cudagraph" in k})
    assert worst <= 1e-2, worst
    assert stats["fused"] == {"all_gather_matmul": 1, "matmul_reduce_scatter": 1}, stats
    # A call under capture would have decomposed with the reason "CUDA graph capture ...": none did.
    assert stats["fallbacks"] == {}, stats["fallbacks"]
    assert counters["inductor"]["cudagraph_skips"] == 0, counters["inductor"]
    assert counters["inductor"]["cudagraph_partitions"] >= 2, counters["inductor"]  # captured around the ops
    dist.destroy_process_group()
    print("CUDAGRAPH MODE OK", flush=True)


if __name__ == "__main__":
    main()
