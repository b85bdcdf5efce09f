#!/usr/bin/env python3
"""Plot a bench_ops JSON: per op, time per contender per shape, absolute and relative to NCCL sequential.

    python benchmarks/plot.py benchmarks/results/h200x2_tp2_ops_rs.json [out.png]

``bench_ops.py`` calls :func:`plot_results` itself after a run; this CLI redraws from a committed JSON.
"""

from __future__ import annotations

import json
import sys

CONTENDERS = ("gemm", "comm", "nccl_seq", "asynctp", "fused_nocomm", "split_nocomm", "fused", "fused_copy",
              "fused_split", "auto")
COLORS = {"gemm": "#999999", "comm": "#cccccc", "nccl_seq": "#1f77b4", "asynctp": "#ff7f0e",
          "fused_nocomm": "#bcbd22", "split_nocomm": "#8c564b", "fused": "#2ca02c", "fused_copy": "#17becf", "fused_split": "#9467bd", "auto": "#d62728"}


def plot_results(data: dict, png: str) -> str:
    """Draw ``data`` (a bench_ops JSON) into ``png``; returns a one-line message."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = []
    for r in data["results"]:
        if r["op"] not in ops:
            ops.append(r["op"])
    if not ops:
        return "plot skipped: no results"
    fig, axes = plt.subplots(2, len(ops), figsize=(7.5 * len(ops), 8.5), squeeze=False)
    env = data.get("environment", {})
    for col, op in enumerate(ops):
        rows = sorted((r for r in data["results"] if r["op"] == op), key=lambda r: (r["K"] * r["N"], r["M"]))
        labels = [f"{r['M']}\n{r['K']}\n{r['N']}" for r in rows]
        present = [c for c in CONTENDERS if any(r["contenders"].get(c, {}).get("ms") for r in rows)]
        width = 0.8 / max(1, len(present))
        for row, relative in ((0, False), (1, True)):
            ax = axes[row][col]
            for i, c in enumerate(present):
                xs, ys = [], []
                for j, r in enumerate(rows):
                    t = r["contenders"].get(c, {}).get("ms")
                    seq = r["contenders"].get("nccl_seq", {}).get("ms")
                    if t is None or (relative and not seq):
                        continue
                    xs.append(j - 0.4 + width * (i + 0.5))
                    ys.append(t / seq if relative else t)
                ax.bar(xs, ys, width=width, label=c, color=COLORS.get(c))
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels(labels, fontsize=7)
            if relative:
                ax.axhline(1.0, color="black", linewidth=0.8)
                ax.set_ylabel("time / NCCL sequential (lower is better)")
            else:
                ax.set_yscale("log")
                ax.set_ylabel("ms (median, max over ranks)")
                ax.set_title(f"{op}  ({env.get('device', '?')} x{env.get('world', '?')}, {env.get('dtype', '')})")
            ax.set_xlabel("M / K / N (global)", fontsize=8)
            if row == 0 and col == 0:
                ax.legend(fontsize=8, ncol=2)
    fig.suptitle(f"bench_ops  torch {env.get('torch', '?')}  sha {str(env.get('git_sha'))[:10]}  {env.get('timestamp', '')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return f"wrote {png}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    src = argv[0]
    png = argv[1] if len(argv) > 1 else (src[:-5] if src.endswith(".json") else src) + ".png"
    with open(src) as f:
        data = json.load(f)
    try:
        print(plot_results(data, png))
    except ImportError as e:
        print(f"plot skipped: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
