#!/usr/bin/env python3
"""Plot client-framework results: per scenario, each contender's median time with its min-max range.

    python benchmarks/plot_clients.py benchmarks/results/clients/*.json --out benchmarks/results/clients/clients.png

Reads ``bench_clients.py`` JSON (torchtitan-style training: ``torchtitan_llama3``; transformers prefill and decode:
``transformers_llama``) and ``bench_torchtitan.py`` JSON (the torchtitan package's Trainer: ``torchtitan_trainer``).
"""

from __future__ import annotations

import argparse
import json
import os

COLORS = {"inductor": "#1f77b4", "asynctp": "#ff7f0e", "flux": "#2ca02c"}


def scenarios(path: str, data: dict):
    """(title, {contender: summary}) for every scenario the JSON holds."""
    name = os.path.basename(path)
    device = f"{data.get('device', '?')} x{data.get('world', '?')}"
    if "torchtitan_trainer" in data:
        cfg = data["torchtitan_trainer"]["config"]
        extra = "".join(f", {k}" for k in ("float8",) if cfg.get(k)) + (
            f", AC {cfg['checkpoint']}" if cfg.get("checkpoint", "none") != "none" else "")
        yield (f"torchtitan Trainer, {cfg['batch']}x{cfg['tokens'] // cfg['batch']} tokens{extra}\n{device} ({name})",
               {k: v["summary"] for k, v in data["torchtitan_trainer"]["contenders"].items() if "summary" in v})
    if "torchtitan_llama3" in data:
        t = data["torchtitan_llama3"]
        yield (f"torchtitan-style Llama3 training, batch {t.get('batch', 1)}\n{device} ({name})",
               {k: v["summary"] for k, v in t["contenders"].items() if "summary" in v})
    if "transformers_llama" in data:
        c = data["transformers_llama"].get("contenders", {})
        for what, label in (("prefill_ms", "prefill"), ("decode_ms_per_token", "decode, per token")):
            yield (f"transformers Llama {label}\n{device} ({name})", {k: v[what] for k, v in c.items() if what in v})


def cli(doc: str):
    """(arguments, pyplot) of a plotting CLI that reads result JSONs and writes one PNG (also plot_model.py's)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--out", required=True, help="PNG path")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return args, plt


def main() -> None:
    args, plt = cli(__doc__)
    panels = [s for path in args.json for s in scenarios(path, json.load(open(path))) if s[1]]
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, results) in zip(axes.flat, panels):
        names = [n for n in COLORS if n in results]
        med = [results[n]["median_ms"] for n in names]
        err = [[m - results[n]["min_ms"] for n, m in zip(names, med)],
               [results[n]["max_ms"] - m for n, m in zip(names, med)]]
        ax.bar(names, med, yerr=err, capsize=4, color=[COLORS[n] for n in names])
        base = results.get("inductor", {}).get("median_ms")
        for i, (n, m) in enumerate(zip(names, med)):
            ax.text(i, m * 0.5, f"{m:.2f}" + (f"\n{base / m:.2f}x" if base else ""), ha="center", fontsize=8,
                    color="white")
        ax.set_title(title, fontsize=8)
        ax.set_ylabel("ms (median, min-max)")
    finish(fig, axes, len(panels), args.out)


def finish(fig, axes, used: int, out: str) -> None:
    """Blank the grid's unused panels, save the figure to ``out`` and say so (also plot_model.py's)."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out} ({used} panels)")


if __name__ == "__main__":
    main()
