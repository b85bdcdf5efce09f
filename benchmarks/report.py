"""Print a markdown table of a bench_ops or bench_model JSON (what README.md's tables are pasted from).

    python benchmarks/report.py benchmarks/results/h200x2_tp2_ops_rs.json
    python benchmarks/report.py benchmarks/results/h200x2_tp2_model.json
    python benchmarks/report.py benchmarks/results/h200x4_tp4_ops_ag.json fluxinductor/tuning/nvidia_h200_tp4.json

With a cost-model table as second argument, an op table shows the fused kernel against each contender and
the path that table picks by default for each shape (the "auto" column of a run is measured with the table
the run started from, which the run itself then replaces).
"""

from __future__ import annotations

import json
import sys


def efficiency(t: float, gemm: float, seq: float) -> float:
    """Flux's overlap efficiency: 1 is perfect overlap, 0 no better than collective-then-GEMM."""
    return 1.0 - (t - gemm) / (seq - gemm)


def model_table(bench: dict) -> None:
    env = bench["environment"]
    print(f"{env['device']} x{env['world']}, torch {env['torch']}, git {str(env['git_sha'])[:10]}; "
          f"ms per step, max over ranks\n")
    rows: dict = {}
    for r in bench["results"]:
        rows.setdefault((r["model"], r["phase"]), {})[r["mode"]] = r.get("ms")
    modes = ["eager", "inductor", "asynctp", "flux", "flux_fused"]
    print("| model | phase | " + " | ".join(modes) + " | flux vs inductor |")
    print("|---|---|" + "---|" * (len(modes) + 1))
    for (model, phase), t in rows.items():
        cells = " | ".join("-" if t.get(m) is None else f"{t[m]:.3f}" for m in modes)
        ratio = "-" if not (t.get("flux") and t.get("inductor")) else f"{t['inductor'] / t['flux']:.2f}x"
        print(f"| {model} | {phase} | {cells} | {ratio} |")


def fused_table(bench: dict, table: dict) -> None:
    """The fused kernel (each GEMM+RS transport where measured) against each contender, and what the table's
    default path for the shape costs: "default" is the time of the path the table picks, from this run (for the
    split transport, in the configuration the table keeps for the shape), and "default nocomm / cuBLAS" the same
    kernels with communication off against cuBLAS."""
    rows_by_shape = {(r["op"], r["m"], r["k"], r["n"]): r for r in table["entries"]}
    ops = {"AG+GEMM": "all_gather_matmul", "GEMM+RS": "matmul_reduce_scatter"}
    print("| op | M | K | N | cuBLAS | NCCL seq | async-TP | fused nocomm | fused | fused copy | fused split "
          "| fused split2 | E fused | E async-TP | default path | E default | default vs seq | default vs async-TP "
          "| default nocomm / cuBLAS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for row in bench["results"]:
        c = {name: rec.get("ms") for name, rec in row["contenders"].items()}
        gemm, seq, atp, fused = c["gemm"], c["nccl_seq"], c["asynctp"], c["fused"]
        entry = rows_by_shape.get((ops.get(row["op"], row["op"]), row["M"], row["K"], row["N"]), {})
        path = entry.get("choice", "-")
        split2 = entry.get("split_config") == 2
        t = {"fused": fused, "fused_copy": c.get("fused_copy"),
             "fused_split": c.get("fused_split2" if split2 else "fused_split"), "sequential": seq}.get(path)
        nocomm = {"fused": c.get("fused_nocomm"), "fused_copy": c.get("fused_nocomm"),
                  "fused_split": c.get("split2_nocomm" if split2 else "split_nocomm")}.get(path)
        shown = path + (" (2)" if path == "fused_split" and split2 else "")
        shown = shown if t is not None else f"{shown} (not timed here)"
        print(f"| {row['op']} | {row['M']} | {row['K']} | {row['N']} | {fmt(gemm)} | {fmt(seq)} | {fmt(atp)} "
              f"| {fmt(c.get('fused_nocomm'))} | {fmt(fused)} | {fmt(c.get('fused_copy'))} "
              f"| {fmt(c.get('fused_split'))} | {fmt(c.get('fused_split2'))} "
              f"| {efficiency(fused, gemm, seq):.2f} | {efficiency(atp, gemm, seq):.2f} | {shown} "
              + ("| - | - | - " if t is None else
                 f"| {efficiency(t, gemm, seq):.2f} | {seq / t:.2f}x | {atp / t:.2f}x ")
              + ("| - |" if nocomm is None else f"| {nocomm / gemm:.3f} |"))


def main(path: str, table_path: str = "") -> None:
    with open(path) as f:
        bench = json.load(f)
    if bench["results"] and "mode" in bench["results"][0]:
        model_table(bench)
        return
    env = bench["environment"]
    header = (f"{env['device']} x{env['world']}, {env['dtype']}, torch {env['torch']}, NCCL {env['nccl']}, "
              f"git {str(env['git_sha'])[:10]}, host overhead {env.get('host_overhead', 'exposed')}; ms, "
              f"median of {env['iters']}, max over ranks")
    if table_path:
        with open(table_path) as f:
            table = json.load(f)
        print(f"{header}; default path from {table_path.split('/')[-1]}\n")
        fused_table(bench, table)
        return
    print(header + "\n")
    print("| op | M | K | N | cuBLAS | NCCL seq | async-TP | fused | auto (path) | E fused | E auto "
          "| auto vs seq | auto vs async-TP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in bench["results"]:
        c = {name: rec.get("ms") for name, rec in row["contenders"].items()}
        path_auto = (row["contenders"]["auto"].get("path") or "-").split(":")[0]
        gemm, seq, atp, fused, auto = c["gemm"], c["nccl_seq"], c["asynctp"], c["fused"], c["auto"]
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        print(f"| {row['op']} | {row['M']} | {row['K']} | {row['N']} | {fmt(gemm)} | {fmt(seq)} | {fmt(atp)} "
              f"| {fmt(fused)} | {fmt(auto)} ({path_auto}) | {efficiency(fused, gemm, seq):.2f} "
              f"| {efficiency(auto, gemm, seq):.2f} | {seq / auto:.2f}x | {atp / auto:.2f}x |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(*sys.argv[1:3])
