#!/usr/bin/env python3
"""Plot bench_model results: per model, phase and JSON, each contender's host-exposed step time (median, p10-p90)
with the host-hidden device time beside it, and flux's G; a ``--tokens`` sweep as one panel per JSON and phase: each
contender's speed-up over inductor against the tokens per step (hollow markers: flux fused nothing, its graph is
inductor's).

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


def sweep_panels(path: str, data: dict) -> Iterator[Tuple[str, dict]]:
    """(title, {mode: [(tokens, record)]}) per phase of a ``--tokens`` sweep's JSON (none for other JSONs)."""
    env, settings = data.get("environment", {}), data.get("settings", {})
    if not settings.get("tokens"):
        return
    by_phase: dict = {}
    for r in data.get("results", []):
        if r.get("ms") is not None and r.get("mode") in COLORS and "@" in r["model"]:
            tokens = int(r["model"].split("@")[1])
            by_phase.setdefault(r["phase"], {}).setdefault(r["mode"], []).append((tokens, r))
    for phase, by_mode in by_phase.items():
        title = (f"llama2 {phase}, {settings.get('tp', 'sequence')} TP, {settings.get('compile_mode') or 'default'} "
                 f"mode{', dynamic' if settings.get('dynamic') else ''}\n{env.get('device', '?')} "
                 f"x{env.get('world', '?')} ({os.path.basename(path)})")
        yield title, {m: sorted(v, key=lambda tr: tr[0]) for m, v in by_mode.items()}


def draw_sweep(ax, title: str, by_mode: dict) -> None:
    inductor = {t: r["ms"] for t, r in by_mode.get("inductor", [])}
    for mode, points in by_mode.items():
        points = [(t, r) for t, r in points if t in inductor]
        if mode == "inductor" or not points:
            continue
        xs = [t for t, _ in points]
        ys = [inductor[t] / r["ms"] for t, r in points]
        lo = [y - inductor[t] / r["spread"]["p90_ms"] for (t, r), y in zip(points, ys)]
        hi = [inductor[t] / r["spread"]["p10_ms"] - y for (t, r), y in zip(points, ys)]
        ax.errorbar(xs, ys, yerr=[lo, hi], color=COLORS[mode], capsize=2, label=mode)
        fused = False
        for x, y, (_, r) in zip(xs, ys, points):
            # Hollow: flux fused nothing in the graph this size ran, which is inductor's then.  A size whose first
            # call compiled nothing (dynamic shapes) ran the graph the size before it compiled.
            if r.get("graphs_compiled_first_call", 1):
                fused = bool((r.get("rewrite_stats") or {}).get("fused_forward"))
            hollow = mode == "flux" and not fused
            ax.plot([x], [y], "o", color=COLORS[mode], markerfacecolor="white" if hollow else COLORS[mode],
                    markersize=5, zorder=3)
    ax.axhline(1.0, color="black", linewidth=0.7)
    ax.axhline(0.99, color="black", linewidth=0.5, linestyle=":")
    ax.plot([], [], "o", color=COLORS["flux"], markerfacecolor="white", label="flux ran inductor's graph")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per step")
    ax.set_ylabel("speed-up over inductor (host exposed)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=6)


def _grid(plt, panels: int):
    """(figure, axes) of a grid of ``panels`` panels, two per row."""
    cols = min(2, panels)
    rows = (panels + cols - 1) // cols
    return plt.subplots(rows, cols, figsize=(6.4 * cols, 3.8 * rows), squeeze=False)


def main() -> None:
    args, plt = cli(__doc__)
    datas = [(path, json.load(open(path))) for path in args.json]
    is_sweep = [bool(d.get("settings", {}).get("tokens")) for _, d in datas]
    if any(is_sweep):
        if not all(is_sweep):
            raise SystemExit("plot --tokens sweeps and other bench_model runs into separate PNGs")
        sweeps = [panel for path, d in datas for panel in sweep_panels(path, d)]
        fig, axes = _grid(plt, len(sweeps))
        for ax, (title, by_mode) in zip(axes.flat, sweeps):
            draw_sweep(ax, title, by_mode)
        finish(fig, axes, len(sweeps), args.out)
        return
    found = [panel for path, d in datas for panel in panels(path, d)]
    if not found:
        raise SystemExit("no bench_model results in " + ", ".join(args.json))
    fig, axes = _grid(plt, len(found))
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
