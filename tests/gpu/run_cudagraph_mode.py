"""torch.compile(backend="flux") on one GPU (a one-rank NCCL group), with FLUXINDUCTOR_DISPATCH=fused:

* mode="reduce-overhead": the fused ops are captured with the rest of the graph (the per-compile option cuda_graphs,
  on by default; no partitions), their kernels launched inside the capture (one rank: the calls are their GEMMs), and
  their replays give the same results; prints "CUDAGRAPH MODE OK".  With ``--no-cuda-graphs``
  (``fluxinductor.settings.configure(cuda_graphs=False)``) the compile is plain inductor's: nothing fused, one graph;
* training steps under bf16 and under fp16 autocast (fp32 weights and input): the backward's fp32 reduce-scatter of a
  half-precision matmul (or of the sum of three, as Q/K/V's input gradient is) runs the GEMM+RS kernel with an fp32
  output; prints "AUTOCAST OK" after all three.

    FLUXINDUCTOR_DISPATCH=fused python tests/gpu/run_cudagraph_mode.py [--no-cuda-graphs]
"""

from __future__ import annotations

import os
import tempfile

# A fresh inductor cache: a graph served from an earlier run's FX graph cache runs no pass, so nothing would be counted.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fluxinductor-one-rank-")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch._functorch.config  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# torch 2.11's AOTAutograd cache keys autocast as on/off, not by its dtype: the fp16 step would be served the bf16
# step's compiled graph, bf16 numerics and no pass run (seen on one H200; pytorch/pytorch#181564 adds the dtype).
torch._functorch.config.enable_autograd_cache = False


hidden, ffn, tokens = 512, 1536, 1000  # 1000 rows: not a multiple of the tile


def make_block(group, projections=1):
    """``x + rs(w2(gelu(sum_i w1_i(ag(x)))))``: with 3 projections the gathered input feeds three matmuls, as Q/K/V's
    does, and its gradient is their sum."""
    import torch.distributed._functional_collectives as funcol

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(hidden, ffn)
            self.more = nn.ModuleList(nn.Linear(hidden, ffn) for _ in range(projections - 1))
            self.w2 = nn.Linear(ffn, hidden)

        def forward(self, x):
            gathered = funcol.all_gather_tensor(x, 0, group)
            h = self.w1(gathered)
            for projection in self.more:
                h = h + projection(gathered)
            partial = self.w2(F.gelu(h))
            return x + funcol.reduce_scatter_tensor(partial, "sum", 0, group)

    return Block


def reduce_overhead(device, group):
    from torch._dynamo.utils import counters

    import fluxinductor
    from fluxinductor import settings
    from fluxinductor.kernels import ag_gemm

    # The fused all-gather calls made under capture (cuda_graphs=True; one rank: no peers, so its GEMMs).
    captured = []
    fused_call = ag_gemm.all_gather_matmul

    def counting_call(*args, **kw):
        if torch.cuda.is_current_stream_capturing():
            captured.append(args[0].shape)
        return fused_call(*args, **kw)

    ag_gemm.all_gather_matmul = counting_call

    Block = make_block(group)
    torch.manual_seed(0)
    reference = Block().to(device)
    model = Block().to(device, torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()})
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    fluxinductor.reset_rewrite_stats()
    # Where an allocation made under capture outlives it (inductor checks), say where it came from.
    torch._inductor.config.triton.cudagraph_trees_history_recording = settings.kernels_under_capture()
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
    if not settings.current.cuda_graphs:
        # the ops may not be captured: the compile is plain inductor's, one graph, nothing fused
        assert stats["fused"] == {}, stats
        assert not captured, captured
        assert counters["inductor"]["cudagraph_partitions"] <= 1, counters["inductor"]
        ag_gemm.all_gather_matmul = fused_call
        print("CUDAGRAPH MODE OK", flush=True)
        return
    assert stats["fused"] == {"all_gather_matmul": 1, "matmul_reduce_scatter": 1}, stats
    # A call under capture would have decomposed with the reason "CUDA graph capture ...": none did.
    assert stats["fallbacks"] == {}, stats["fallbacks"]
    assert counters["inductor"]["cudagraph_skips"] == 0, counters["inductor"]
    # the op was captured (one recording), so the replays ran its kernels from the graph
    assert len(captured) == 1, captured
    assert counters["inductor"]["cudagraph_partitions"] <= 1, counters["inductor"]
    ag_gemm.all_gather_matmul = fused_call
    print("CUDAGRAPH MODE OK", flush=True)


def autocast_training(device, group, half, projections=1):
    import fluxinductor
    from fluxinductor.kernels import gemm_rs

    # Which GEMM+RS kernels ran: (operand dtype, result dtype) per launch.
    launched = []
    launch = gemm_rs.launch

    def counting_launch(a, weight, bias, out, **kw):
        launched.append((a.dtype, out.dtype))
        return launch(a, weight, bias, out, **kw)

    gemm_rs.launch = counting_launch
    Block = make_block(group, projections)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(1)
        model = Block().to(device)  # fp32 weights
        x = torch.randn(tokens, hidden, device=device, requires_grad=True)
        fluxinductor.reset_rewrite_stats()
        run = torch.compile(model, backend="flux") if compiled else model
        for _ in range(2):  # a second step: the compiled graphs again, with the kernels' buffers reused
            x.grad = None
            model.zero_grad()
            with torch.autocast("cuda", dtype=half):
                out = run(x)
            out.float().pow(2).mean().backward()
        results.append((out.float().detach(), x.grad.clone(), model.w1.weight.grad.clone(),
                        fluxinductor.rewrite_stats()))
    (o0, gx0, gw0, _), (o1, gx1, gw1, stats) = results
    errors = {name: ((b - a).norm() / a.norm()).item() for name, a, b in
              (("out", o0, o1), ("x.grad", gx0, gx1), ("w1.grad", gw0, gw1))}
    print(f"{half} autocast, {projections} projection(s), errors:", errors)
    print(f"{half} autocast, {projections} projection(s), stats:", stats)
    assert gx1.dtype == torch.float32
    assert all(e <= 2e-2 for e in errors.values()), errors
    assert stats["fused"].get("matmul_reduce_scatter", 0) == 2, stats  # the forward's and the backward's fp32 one
    assert stats["skipped"].get("matmul_reduce_scatter", {}) == {}, stats
    assert stats["fallbacks"] == {}, stats["fallbacks"]  # every call ran a fused kernel
    print("GEMM+RS launches (operands, result):", launched)
    assert launched.count((half, torch.float32)) == 2, launched  # the backward's, in both steps
    assert launched.count((half, half)) == 2, launched  # the forward's
    assert len(launched) == 4, launched
    gemm_rs.launch = launch


def main():
    import sys

    from fluxinductor import settings

    if "--no-cuda-graphs" in sys.argv[1:]:
        settings.configure(cuda_graphs=False)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    group = dist.group.WORLD
    reduce_overhead(device, group)
    for half in (torch.bfloat16, torch.float16):
        autocast_training(device, group, half)
    # the input's gradient is the fp32 sum of three upcast half matmuls: one GEMM+RS over the concatenated K
    autocast_training(device, group, torch.bfloat16, projections=3)
    print("AUTOCAST OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
