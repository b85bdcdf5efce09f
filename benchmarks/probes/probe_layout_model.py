#!/usr/bin/env python3
"""The models of bench_model.py at B > 1, compiled, on one GPU with the communication taken out (fake group).

    FLUXINDUCTOR_DISPATCH=decomposed python3 benchmarks/probes/probe_layout_model.py --label new --out $OUT/x.json

One process joins torch's fake process group as rank 0 of ``--world`` ranks: the collectives in the graph do
nothing (their outputs are left unwritten), so what is timed is every kernel but the communication: GEMMs,
pointwise kernels and the layout copies around the ops.  Run under ``FLUXINDUCTOR_DISPATCH=decomposed`` the passes
rewrite every match and the ops run their decomposition (collective, then cuBLAS), which does not depend on the
extension.  Running it once per version of ``passes/`` (``--label``) compares how each lays out batch-first
sequence-parallel activations ([B, S/w, H] with B > 1): before the rows-first rewrite, the op given
``gather_dim=1`` concatenated the gathered chunks along S (a copy of the gathered input) and, for the reduce-scatter,
stacked the partial's S chunks (a copy of the partial); rows-first, inductor folds the permutes into the kernels
beside the ops.  ``FLUXINDUCTOR_DISABLE=1`` gives plain inductor on the same graph for reference.

Per (model, phase): median ms over ``--iters`` steps (CUDA events, synchronized), and the number of kernels in the
generated forward code.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import git_sha, write_json  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama2,mlp")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=None, help="global sequence length per batch element (default: the "
                   "config's llama2 S)")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--phases", default="fwd,fwd_bwd")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--label", required=True, help="what this run's passes/ are (recorded)")
    p.add_argument("--config", choices=("full", "small"), default="full",
                   help="bench_model's sizes (small: a CPU smoke)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    import fluxinductor  # noqa: F401  (registers the backend)
    from bench_model import CONFIGS, _step, build_model
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    mesh = init_device_mesh(args.device, (args.world,))
    dev, dt = torch.device(args.device, 0 if cuda else None), torch.bfloat16 if cuda else torch.float32
    rows = []
    args.seq = args.seq or CONFIGS[args.config]["llama2"]["seq"]
    for name in args.models.split(","):
        cfg = dict(CONFIGS[args.config][name])
        if name == "llama2":
            cfg.update(batch=args.batch, seq=args.seq, layers=args.layers)
            shard_dim, shape = 1, (args.batch, args.seq // args.world, cfg["hidden"])
        else:
            cfg.update(tokens=args.seq)
            shard_dim, shape = 1, (args.batch, args.seq // args.world, cfg["hidden"])
        model = build_model(name, cfg, mesh, dev, dt, shard_dim)
        x = torch.randn(shape, device=dev, dtype=dt)
        for phase in args.phases.split(","):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="flux")
            grad = torch.randn(shape, device=dev, dtype=dt) if phase == "fwd_bwd" else None
            x.requires_grad_(grad is not None)

            def step():
                return _step(compiled, x, grad)

            _, codes = run_and_get_code(step)
            kernels = [len(re.findall(r"^\s+(?:triton_\w+\.run|cpp_fused_\w+|extern_kernels\.\w+)\(", c, re.M))
                       for c in codes]
            for _ in range(3):
                step()
            times = []
            for _ in range(args.iters):
                if cuda:
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                else:
                    t0 = time.perf_counter()
                    step()
                    times.append((time.perf_counter() - t0) * 1e3)
            row = {"model": name, "phase": phase, "batch": args.batch, "seq": args.seq, "world": args.world,
                   "layers": args.layers if name == "llama2" else None, "ms": statistics.median(times),
                   "kernels_per_graph": kernels}
            rows.append(row)
            print(f"{args.label} {name} {phase} B={args.batch}: {row['ms']:.3f} ms, kernels {kernels}", flush=True)
            x.grad = None
            model.zero_grad(set_to_none=True)
    from fluxinductor import settings

    sha, dirty = git_sha()
    write_json(args.out, {
        "schema": 1, "label": args.label, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "config": args.config,
        "git_sha": sha, "dirty": dirty, "dispatch": settings.current.dispatch,
        "disabled": settings.current.disable,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timing": "one process, fake process group (collectives do nothing); CUDA events around each step, median",
        "results": rows,
    })


if __name__ == "__main__":
    main()
