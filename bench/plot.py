#!/usr/bin/env python3
"""Plots for bench/bench.py results: TFLOP/s vs L, one figure per (dtype, D, causal),
one panel per phase, one line per provider; the title carries the date and the GPU.

    python3 bench/plot.py bench/results/results.json [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os

PHASE_LABEL = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward+backward"}
STYLE = {
    "piecewise": dict(color="tab:red", marker="o", linewidth=2.2),
    "piecewise_mma": dict(color="tab:orange", marker="o", linestyle="--"),
    "piecewise_det": dict(color="tab:red", marker="x", linestyle=":"),
    "piecewise_mma_det": dict(color="tab:brown", marker="x", linestyle="-."),
    "flex_composite": dict(color="tab:brown", marker="v"),
    "sdpa_flash": dict(color="tab:blue", marker="s"),
    "sdpa_cudnn": dict(color="tab:green", marker="^"),
    "torch_plain": dict(color="tab:gray", marker="x", linestyle="--"),
    "flag_attn": dict(color="tab:purple", marker="d", linestyle=":"),
}


def plot_main(res, out_dir):
    """Write one PNG per (dtype, D, causal) of res['main']; returns the paths.

    Raises ImportError (with the reason) when matplotlib is missing.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"matplotlib not importable ({type(e).__name__}: {e})")

    rows = res.get("main") or []
    h = res.get("header", {})
    configs = []
    for r in rows:
        k = (r["dtype"], r["D"], r["causal"])
        if k not in configs:
            configs.append(k)
    paths = []
    os.makedirs(out_dir, exist_ok=True)
    for dt, D, causal in configs:
        sub = [r for r in rows if (r["dtype"], r["D"], r["causal"]) == (dt, D, causal)]
        phases = []
        provs = []
        for r in sub:
            if r["phase"] not in phases:
                phases.append(r["phase"])
            if r["provider"] not in provs:
                provs.append(r["provider"])
        order = list(STYLE)
        provs.sort(key=lambda p: order.index(p) if p in order else len(order))
        fig, axes = plt.subplots(1, len(phases), figsize=(5.2 * len(phases), 4.2), squeeze=False)
        for ax, ph in zip(axes[0], phases):
            for p in provs:
                pts = sorted((r["L"], r["tflops"]) for r in sub
                             if r["phase"] == ph and r["provider"] == p and r.get("status") == "ok"
                             and r.get("tflops") is not None)
                if not pts:
                    continue
                xs, ys = zip(*pts)
                ax.plot(xs, ys, label=p, **STYLE.get(p, {}))
            ax.set_xscale("log", base=2)
            Ls = sorted({r["L"] for r in sub})
            ax.set_xticks(Ls)
            ax.set_xticklabels([str(x) for x in Ls])
            ax.set_xlabel("L (M = N)")
            ax.set_ylabel("effective TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.set_title(PHASE_LABEL.get(ph, ph))
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        fig.suptitle(f"{dt}, D={D}, {'causal' if causal else 'not causal'}, w=L/4 | "
                     f"{h.get('date_utc', '?')} | {h.get('gpu', '?')}", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"tflops_{dt}_d{D}_{'causal' if causal else 'noncausal'}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_json")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: beside the JSON)")
    a = ap.parse_args()
    with open(a.results_json) as f:
        res = json.load(f)
    for p in plot_main(res, a.out or os.path.dirname(os.path.abspath(a.results_json))):
        print(p)


if __name__ == "__main__":
    main()
