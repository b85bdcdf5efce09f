#!/usr/bin/env python3
"""Plot bench_model results: per model, phase and JSON, each contender's host-exposed step time (median, p10-p90)
with the host-hidden device time beside it, and flux's G.

    python benchmarks/plot_model.py benchmarks/results/model/h200x2_tp2_*.json --out benchmarks/results/model/h200x2_tp2.png
"""

from __future__ import annotations

import json
import os
import sys
from typing import Iterator, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_clients import cli, finish  # noqa: E402

COLORS = {"inductor": "#1f77b4", "asynctp": "#ff7f0e", "flux": "#2ca02c", "nocomm": "#999999"}


def panels(path: str, data: dict) -> Iterator[Tuple[str, List[dict]]]:
    """(title, records of one model and phase) for every model and phase a bench_model JSON holds."""
    env = data.get("environment", {})
    settings = data.get("settings", {})
    seen: dict = {}
    for r in data.get("results", []):
        if r.get("ms") is None or r.get("mode") not in COLORS:
            continue
        seen.setdefault((r["model"], r["phase"]), []).append(r)
    for (model, phase), records in seen.items():
        shape = settings.get("models", {}).get(model, {})
        dims = ", ".join(f"{k} {shape[k]}" for k in ("hidden", "seq", "batch") if k in shape)
        title = (f"{model} {phase} ({dims})\n{env.get('device', '?')} x{env.get('world', '?')}, "
                 f"{settings.get('tp', 'sequence')} TP ({os.path.basename(path)})")
        yield title, sorted(records, key=lambda r: list(COLORS).index(r["mode"]))


def main() -> None:
    args, plt = cli(__doc__)
    found = [panel for path in args.json for panel in panels(path, json.load(open(path)))]
    if not found:
        raise SystemExit("no bench_model results in " + ", ".join(args.json))
    cols = min(2, len(found))
    rows = (len(found) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.8 * rows), squeeze=False)
    for ax, (title, records) in zip(axes.flat, found):
        names = [r["mode"] for r in records]
        xs = range(len(records))
        med = [r["ms"] for r in records]
        spread = [r.get("spread", {}) for r in records]
        err = [[m - s.get("p10_ms", m) for m, s in zip(med, spread)],
               [s.get("p90_ms", m) - m for m, s in zip(med, spread)]]
        ax.bar([x - 0.2 for x in xs], med, width=0.4, yerr=err, capsize=3, color=[COLORS[n] for n in names],
               label="host exposed (median, p10-p90)")
        hidden = [r.get("hidden_host_ms") or 0.0 for r in records]
        ax.bar([x + 0.2 for x in xs], hidden, width=0.4, color=[COLORS[n] for n in names], alpha=0.45,
               label="host hidden (device time)")
        for x, r in zip(xs, records):
            note = f"{r['ms']:.2f}"
            if r.get("gain") is not None:
                note += f"\nG {r['gain']:.2f}"
            ax.text(x - 0.2, r["ms"], note, ha="center", va="bottom", fontsize=7)
        low = min(min(med), min(h for h in hidden if h) if any(hidden) else min(med))
        ax.set_ylim(low * 0.9, max(med) * 1.06)
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("ms per step")
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=6, loc="lower right")
    finish(fig, axes, len(found), args.out)


if __name__ == "__main__":
    main()
