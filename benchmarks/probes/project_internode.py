#!/usr/bin/env python3
"""A projection on paper: the hierarchical (NVLink inside a node, NVSHMEM over InfiniBand between nodes) AG+GEMM and
GEMM+RS on 2 nodes x 8 GPUs (TP=16), against NCCL then cuBLAS.  Nothing here is measured across nodes; every input is
an assumption named below, and the output is what the model predicts, not a result.

Per rank, global GEMM M x K x N, TP = nodes * gpus_per_node = w, bf16 (2 bytes):

* GEMM: ``T_gemm = 2 M K N / w / F`` with F the achieved dense bf16 rate (``--tflops``), times the kernel's slowdown
  with the communication on (``--ag-slowdown`` / ``--rs-slowdown``: the fused kernels with communication off against
  cuBLAS on 2xH200, docs/performance.md "Kernels with the communication off").
* The chunk a rank contributes or receives: ``C = (M / w) * K * 2`` (AG+GEMM, a row shard of A) or ``(M / w) * N * 2``
  (GEMM+RS, one rank's rows of the output).
* Hierarchical transfer, rail-aligned (GPU g of one node talks to GPU g of the other over its own NIC):
  AG: each rank receives its rail peer's shard over InfiniBand (``C / B_ib``) and 14 shards over NVLink (the 7 of its
  node and the 7 its node's GPUs received from their rail peers, forwarded: ``14 C / B_nvl``); the GEMM consumes the
  local shard first, then node-local ones, then remote ones as they land.
  RS: the tiles bound for the other node are computed first and reduced inside the node (``7 C / B_nvl``), then one
  reduced chunk per rank crosses InfiniBand (``C / B_ib``) while the node-local tiles are computed and reduced
  (``7 C / B_nvl``).
* NCCL then cuBLAS: the collective moves the same bytes over the same links (an inter-node ring or tree cannot beat
  ``C / B_ib`` per rank, nor ``14 C / B_nvl`` inside a node), plus its latency (``--nccl-latency-us``), with nothing
  hidden: ``T_seq = max(C / B_ib, 14 C / B_nvl) + L_nccl + T_gemm`` (cuBLAS rate, no slowdown).
* Fused: ``T = max(T_gemm', exposed_comm + tail) + n_chunks * sync``, where the communication that cannot start
  before the GEMM does (AG: the remote shards' InfiniBand time, pipelined with their NVLink forwarding; RS: the
  remote-bound half of the GEMM, its reduction inside the node and its InfiniBand transfer as a pipeline of
  ``--pieces`` pieces) must fit beside the GEMM, and ``tail`` is the
  GEMM work that waits on the last chunk (AG: 1/w of the GEMM) or the transfer after the last tile (RS: one chunk
  over NVLink); ``sync`` is a per-chunk signal wait (``--sync-us``).
* Overlap efficiency ``E = 1 - (T - T_gemm) / (T_seq - T_gemm)`` with ``T_gemm`` at cuBLAS's rate (Flux's definition).

    python benchmarks/probes/project_internode.py --out benchmarks/results/projection/internode_2x8.json
"""

from __future__ import annotations

import argparse
import json

SHAPES = {  # Flux's shapes (arXiv 2406.06858), M swept
    "all_gather_matmul": (12288, 49152),
    "matmul_reduce_scatter": (49152, 12288),
}
MS = (1024, 2048, 4096, 8192, 16384)


def project(op: str, m: int, k: int, n: int, a) -> dict:
    w = a.nodes * a.gpus_per_node
    f = a.tflops * 1e12
    b_nvl, b_ib = a.nvlink_gbs * 1e9 * a.nvlink_eff, a.ib_gbits / 8 * 1e9 * a.ib_eff
    gemm = 2.0 * m * k * n / w / f
    chunk = (m / w) * (k if op == "all_gather_matmul" else n) * 2
    ib, nvl_all = chunk / b_ib, 14 * chunk / b_nvl
    seq = max(ib, nvl_all) + a.nccl_latency_us * 1e-6 + gemm
    if op == "all_gather_matmul":
        slowed = gemm * a.ag_slowdown
        # remote shards: InfiniBand, then forwarded inside the node; the node-local NVLink traffic runs beside it.
        remote_ready = ib + chunk / b_nvl + a.ib_latency_us * 1e-6
        comm_done = max(remote_ready, 14 * chunk / b_nvl)
        fused = max(slowed, comm_done + gemm / w)
    else:
        slowed = gemm * a.rs_slowdown
        # remote-bound tiles are the first half of the GEMM; they stream out in --pieces pieces: each piece is
        # reduced inside the node, then crosses InfiniBand, while the next is computed (a three-stage pipeline:
        # its slowest stage plus the fill of one piece through all three); the node-local reduction trails the
        # last tile by one chunk over NVLink.
        stages = (slowed / 2, 7 * chunk / b_nvl, ib + a.ib_latency_us * 1e-6)
        remote_sent = max(stages) + sum(stages) / a.pieces
        fused = max(slowed + chunk / b_nvl, remote_sent)
    chunks = w - 1
    fused += chunks * a.sync_us * 1e-6
    e = 1 - (fused - gemm) / (seq - gemm)
    return {"op": op, "M": m, "K": k, "N": n, "gemm_ms": gemm * 1e3, "chunk_MB": chunk / 1e6,
            "ib_ms": ib * 1e3, "nvlink_ms": nvl_all * 1e3, "sequential_ms": seq * 1e3, "fused_ms": fused * 1e3,
            "speedup": seq / fused, "E": e}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--tflops", type=float, default=700.0, help="achieved dense bf16 TFLOPS per GPU (H100/H800 SXM)")
    p.add_argument("--nvlink-gbs", type=float, default=450.0, help="NVLink GB/s per GPU, one way")
    p.add_argument("--nvlink-eff", type=float, default=0.8, help="achieved share of it (2xH200: ~0.8 for NCCL)")
    p.add_argument("--ib-gbits", type=float, default=400.0, help="InfiniBand Gb/s per GPU (one NIC each)")
    p.add_argument("--ib-eff", type=float, default=0.9)
    p.add_argument("--ib-latency-us", type=float, default=5.0)
    p.add_argument("--nccl-latency-us", type=float, default=30.0)
    p.add_argument("--pieces", type=int, default=8, help="GEMM+RS: pieces the remote-bound half streams out in")
    p.add_argument("--sync-us", type=float, default=1.0, help="per-chunk signal wait in the fused kernel")
    p.add_argument("--ag-slowdown", type=float, default=1.02, help="AG+GEMM kernel vs cuBLAS, communication off")
    p.add_argument("--rs-slowdown", type=float, default=1.08, help="GEMM+RS kernel vs cuBLAS, communication off")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = [project(op, m, k, n, a) for op, (k, n) in SHAPES.items() for m in MS]
    print(f"{'op':<22} {'M':>6} {'gemm ms':>8} {'seq ms':>8} {'fused ms':>9} {'speedup':>8} {'E':>6}")
    for r in rows:
        print(f"{r['op']:<22} {r['M']:>6} {r['gemm_ms']:>8.3f} {r['sequential_ms']:>8.3f} {r['fused_ms']:>9.3f} "
              f"{r['speedup']:>7.2f}x {r['E']:>6.2f}")
    if a.out:
        import os

        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump({"what": "projection on paper, not a measurement", "assumptions": vars(a), "rows": rows},
                      fh, indent=1)


if __name__ == "__main__":
    main()
