"""`pdserve bench plot`: latency CDFs and goodput vs request rate, one line per configuration."""
from __future__ import annotations

import json
import os

import numpy as np


def load_results(paths: list[str]) -> dict[str, list[dict]]:
    by_label: dict[str, list[dict]] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for run in data if isinstance(data, list) else [data]:
            by_label.setdefault(run.get("label") or os.path.basename(path), []).append(run)
    return by_label


def plot_results(paths: list[str], out_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_label = load_results(paths)
    os.makedirs(out_dir, exist_ok=True)
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, runs in by_label.items():
        run = max(runs, key=lambda r: float(r["request_rate"]) if r["request_rate"] != "inf" else 1e9)
        for ax, values, name in ((axes[0], [t * 1000 for t in run["ttfts"] if t > 0], "TTFT (ms)"),
                                 (axes[1], [x * 1000 for itl in run["itls"] for x in itl], "ITL (ms)")):
            if values:
                xs = np.sort(values)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"{label} @ {run['request_rate']}/s")
                ax.set_xlabel(name)
                ax.set_ylabel("fraction of requests" if name.startswith("TTFT") else "fraction of tokens")
                ax.set_xscale("log")
                ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "latency_cdf.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    if any("request_goodput" in r for runs in by_label.values() for r in runs):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, runs in by_label.items():
            pts = sorted((float(r["request_rate"]), r.get("request_goodput", 0.0)) for r in runs
                         if r["request_rate"] != "inf")
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("goodput (req/s meeting SLOs)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, "goodput_vs_rate.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
