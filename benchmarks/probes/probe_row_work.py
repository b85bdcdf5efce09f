"""What running a residual add and an RMSNorm on 1/w of the rows saves, on one GPU: the basis of
``passes/all_reduce_split._ROW_WORK_CREDIT``.

The all-reduce split's planner weighs an exposed all-gather (bytes over NVLink) against the row-wise work that keeping
rows sharded saves (bytes through HBM).  This times the inductor-compiled ``n = rms_norm(x + y) * w`` (bf16, as
inductor fuses it) on M and on M / world rows and prints the time saved per byte the planner credits (the full
outputs of the chain's pointwise ops and reductions times (w - 1) / w), next to the NCCL all-gather bandwidth
(``--allgather-gbps``) to give the credit in gathered bytes.

    python3 benchmarks/probes/probe_row_work.py --out $OUT/row_work.json
"""

from __future__ import annotations

import argparse
import json

import torch


def block(x, y, w):
    h = x + y
    hf = h.float()
    n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype) * w
    return h, n


def time_ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x8192,8192x8192,4096x12288")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--allgather-gbps", type=float, default=173.0,
                        help="NCCL all-gather bus bandwidth (173 GB/s measured at 64 MB on 2xH200)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    compiled = torch.compile(block)
    rows_out = []
    for shape in args.shapes.split(","):
        m, n = (int(v) for v in shape.split("x"))
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        times = {}
        for rows in (m, m // args.world):
            x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            y = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            times[rows] = time_ms(lambda: compiled(x, y, w))
        saved_ms = times[m] - times[m // args.world]
        # What the planner counts as saved: the full [M, N] outputs of add, float cast, pow, mul, cast back and mul
        # by w (three bf16, three fp32; the [M, 1] results are left out), times (w - 1) / w.
        credited = m * n * (2 + 4 + 4 + 4 + 2 + 2) * (args.world - 1) // args.world
        # An exposed all-gather of G output bytes moves G (w - 1) / w per rank at the bus bandwidth.
        gathered_per_ms = args.allgather_gbps * 1e6 * args.world / (args.world - 1)
        credit = saved_ms * gathered_per_ms / credited
        row = {"m": m, "n": n, "full_ms": times[m], "sharded_ms": times[m // args.world], "saved_ms": saved_ms,
               "credited_bytes": credited, "credit_in_gathered_bytes_per_byte": credit}
        rows_out.append(row)
        print(json.dumps(row))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "world": args.world,
              "allgather_gbps": args.allgather_gbps, "rows": rows_out}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
