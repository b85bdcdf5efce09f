"""What capturing the fused ops in the CUDA graph saves, on one GPU (a one-rank NCCL group).

Times a compiled stack of sequence-parallel blocks (``x + rs(w2(gelu(w1(ag(x)))))``, bf16, no grad) under
``mode="reduce-overhead"``, step after step with one synchronization at the end, so host time that the GPU waits for
shows.  Contenders, each in a fresh process (whether the fused ops may be captured is decided for the process):

* ``inductor``: ``backend="inductor"`` (the collectives are captured as they are);
* ``flux``: ``backend="flux"``, FLUXINDUCTOR_DISPATCH=fused, the ops between captured partitions (the default);
* ``flux_captured``: the same with ``fluxinductor.settings.configure(cuda_graphs=True)``, the ops inside the graph
  (the compile option ``cuda_graphs``'s process-wide default: ``torch.compile`` takes a mode or options, not both).

With one rank there is nothing to communicate: the fused ops are their GEMMs, and what differs is the host's part of a
step (partition replays, the ops' dispatch).  What overlap gains on several GPUs is not measured here.

    python3 benchmarks/probes/probe_cuda_graphs.py --out $OUT/cuda_graphs.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CONTENDERS = {
    "inductor": {"backend": "inductor", "env": {}},
    "flux": {"backend": "flux", "env": {"FLUXINDUCTOR_DISPATCH": "fused"}},
    "flux_captured": {"backend": "flux:captured", "env": {"FLUXINDUCTOR_DISPATCH": "fused"}},
}


def run_one(backend: str, tokens: int, hidden: int, ffn: int, blocks: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn as nn
    import torch.nn.functional as F

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    group = dist.group.WORLD

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(hidden, ffn)
            self.w2 = nn.Linear(ffn, hidden)

        def forward(self, x):
            gathered = funcol.all_gather_tensor(x, 0, group)
            return x + funcol.reduce_scatter_tensor(self.w2(F.gelu(self.w1(gathered))), "sum", 0, group)

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(blocks)]).to(device, torch.bfloat16)
    backend, _, captured = backend.partition(":")
    if backend == "flux":
        from fluxinductor import settings

        settings.configure(cuda_graphs=captured == "captured")
    compiled = torch.compile(model, backend=backend, mode="reduce-overhead")
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(10):  # warm-up, recording, replays
            compiled(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        rounds = []
        for _ in range(5):
            start.record()
            for _ in range(steps):
                out = compiled(x)
            end.record()
            end.synchronize()
            rounds.append(start.elapsed_time(end) / steps)
        err = ((out.float() - model(x).float()).norm() / model(x).float().norm()).item()
    dist.destroy_process_group()
    return {"ms_per_step": sorted(rounds)[len(rounds) // 2], "round_ms": rounds, "rel_err_vs_eager": err}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    parser.add_argument("--tokens", default="128,1024")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--child", default="")
    args = parser.parse_args()
    if args.child:
        backend, tokens = args.child.rsplit(":", 1)
        result = run_one(backend, int(tokens), args.hidden, args.ffn, args.blocks, args.steps)
        print("RESULT " + json.dumps(result), flush=True)
        return

    import torch

    results = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        row = {"tokens": tokens}
        for name, contender in CONTENDERS.items():
            env = dict(os.environ, **contender["env"], TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="probe-cg-"))
            cmd = [sys.executable, __file__, "--child", f"{contender['backend']}:{tokens}", "--hidden",
                   str(args.hidden), "--ffn", str(args.ffn), "--blocks", str(args.blocks), "--steps", str(args.steps)]
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
            row[name] = json.loads(lines[-1][7:]) if run.returncode == 0 and lines else {
                "error": (run.stdout + run.stderr)[-2000:]}
            print(tokens, name, row[name].get("ms_per_step", row[name].get("error")), flush=True)
        results.append(row)
    report = {
        "what": "ms per step of a compiled stack of SP blocks under mode='reduce-overhead', one-rank NCCL group",
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "git_sha": os.environ.get("FLUXINDUCTOR_GIT_SHA", ""),
        "shape": {"hidden": args.hidden, "ffn": args.ffn, "blocks": args.blocks, "steps": args.steps},
        "results": results,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
