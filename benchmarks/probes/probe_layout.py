#!/usr/bin/env python3
"""What the batch-first layout of sequence-parallel activations costs around the fused ops (one GPU).

    python3 benchmarks/probes/probe_layout.py --out $OUT/probe_layout.json

Why: the fused ops run on 2-D row blocks, one per rank.  With [B, S, H] activations sharded on S and B > 1 (DTensor's
default ``sequence_dim=1`` with a batch), a rank's rows are not one block of the [B * S, H] matrix, so the op given
the N-D tensor has to move S first (``dispatch._rows_first``: a copy of its operand) and move it back in its result
(``dispatch._restore``: a copy of the output).  Since this change the passes put those permutes in the graph instead,
where inductor folds them into the pointwise kernels on either side.  This probe times, for TP = 2 shapes of an MLP
block at B > 1, each on the per-rank problem:

* ``gemm``: cuBLAS on the rows-first operands (what the op's GEMM costs);
* ``op_copies``: the copies the op made with the N-D tensor (operand in, result out), the overhead removed in
  inference;
* ``gelu_contiguous`` / ``gelu_rows_first``: an inductor-compiled gelu over the up projection's output, reading and
  writing [B, S, N] (the old graph) or reading the all-gather's rows-first output and writing the reduce-scatter's
  rows-first operand (the new graph): what the permutes cost once folded in.

No communication is involved; each contender is timed round-robin with the others (CUDA events, median).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness import git_sha, parse_problems, write_json  # noqa: E402

# (B, S, H, F): batch, global sequence, hidden, ffn.
DEFAULT = [(4, 4096, 4096, 14336), (8, 2048, 4096, 14336), (2, 4096, 8192, 28672)]


def _time(fns, iters: int, rounds: int):
    """Median ms per call of each fn, timed round-robin (``iters`` calls per timing, ``rounds`` timings each)."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / iters)
    return {name: statistics.median(v) for name, v in samples.items()}


def probe(b: int, s: int, h: int, f: int, world: int, iters: int, rounds: int) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    s_local, f_local = s // world, f // world
    rand = lambda *shape: torch.randn(*shape, device=dev, dtype=dt)  # noqa: E731
    # AG+GEMM (up projection): shard [B, S/w, H] -> out [B, S, F/w]; GEMM [S * B, H] @ [H, F/w].
    shard, w_up = rand(b, s_local, h), rand(h, f_local)
    up_rows = rand(s * b, f_local)              # the op's rows-first output
    # GEMM+RS (down projection): a [B, S, F/w] -> out [B, S/w, H]; GEMM [S * B, F/w] @ [F/w, H].
    a, w_down = rand(b, s, f_local), rand(f_local, h)
    down_rows = rand(s_local * b, h)            # the op's rows-first output (after the reduction)
    a_rows = a.transpose(0, 1).contiguous().reshape(-1, f_local)

    def ag_copies():  # dispatch._rows_first(shard) and dispatch._restore(out), as the op did for gather_dim 1
        shard.movedim(1, 0).contiguous()
        up_rows.view(s, b, f_local).movedim(0, 1).contiguous()

    def rs_copies():
        a.movedim(1, 0).contiguous()
        down_rows.view(s_local, b, h).movedim(0, 1).contiguous()

    gelu_old = torch.compile(lambda y: F.gelu(y), dynamic=False)
    def rows_first_gelu(y):  # the new graph's chain, from the all-gather's output to the reduce-scatter's operand
        mm_out = y.reshape(s, b, f_local).permute(1, 0, 2).reshape(b * s, f_local)  # what replaced the mm
        act = F.gelu(mm_out.view(b, s, f_local))
        return act.permute(1, 0, 2).contiguous().reshape(-1, f_local)

    gelu_new = torch.compile(rows_first_gelu, dynamic=False)
    up_nd = up_rows.view(b, s, f_local)
    # Elementwise, so the rows-first gelu equals gelu of the rows-first tensor.
    torch.testing.assert_close(gelu_new(up_rows), F.gelu(up_rows.float()).to(dt), rtol=1e-2, atol=1e-2)
    gathered = rand(s * b, h)                   # the op's rows-first gathered operand
    ms = _time({
        "ag_gemm": lambda: torch.mm(gathered, w_up),
        "ag_op_copies": ag_copies,
        "rs_gemm": lambda: torch.mm(a_rows, w_down),
        "rs_op_copies": rs_copies,
        "gelu_contiguous": lambda: gelu_old(up_nd),
        "gelu_rows_first": lambda: gelu_new(up_rows),
    }, iters, rounds)
    return {
        "B": b, "S": s, "H": h, "F": f, "world": world,
        "ag_problem": [s * b, h, f_local], "rs_problem": [s * b, f_local, h],
        "ms": ms,
        "ag_copies_vs_gemm": ms["ag_op_copies"] / ms["ag_gemm"],
        "rs_copies_vs_gemm": ms["rs_op_copies"] / ms["rs_gemm"],
        "gelu_rows_first_vs_contiguous": ms["gelu_rows_first"] / ms["gelu_contiguous"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", help="B,S,H,F;... (default: %s)" % ";".join(",".join(map(str, x)) for x in DEFAULT))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    sha, dirty = git_sha()
    rows = []
    for b, s, h, f in parse_problems(args.shapes, DEFAULT):
        row = probe(b, s, h, f, args.world, args.iters, args.rounds)
        rows.append(row)
        print(f"B={b} S={s} H={h} F={f}: " + " ".join(f"{k}={v:.4f}" for k, v in row["ms"].items())
              + f" | copies/gemm AG {row['ag_copies_vs_gemm']:.3f} RS {row['rs_copies_vs_gemm']:.3f}"
              f" | gelu rows-first/contiguous {row['gelu_rows_first_vs_contiguous']:.3f}", flush=True)
    write_json(args.out, {
        "schema": 1, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "git_sha": sha,
        "dirty": dirty, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "iters": args.iters, "rounds": args.rounds, "results": rows,
    })


if __name__ == "__main__":
    main()
