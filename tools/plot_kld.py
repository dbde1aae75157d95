#!/usr/bin/env python3
"""Plots KL divergence by position in the window from the output folders of `tmx eval-kld`.

    tools/plot_kld.py OUTDIR [OUTDIR ...] -o kld.png [--label NAME ...] [--smooth N] [--all]

For each folder: the mean KLD over the headline windows (summary.json's windows with
"headline": true; --all takes every window) at each row position, read from tokens.jsonl, as
a line smoothed over N positions (default: window / 64, at least 1), with the headline mean as
a dashed level. Several folders share the axes (e.g. serving formats against weights only).
The C command never needs this: it is a separate step (docs/fidelity.md).
"""
import argparse
import json
import os
import sys

import numpy as np


def load(outdir, every_window):
    with open(os.path.join(outdir, "summary.json")) as f:
        summary = json.load(f)
    keep = {w["index"] for w in summary["windows"] if every_window or w["headline"]}
    rows = summary["window"] - 1
    total, count = np.zeros(rows), np.zeros(rows)
    with open(os.path.join(outdir, "tokens.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r["window"] in keep:
                total[r["row"]] += r["kld"]
                count[r["row"]] += 1
    if not count.any():
        raise SystemExit(f"{outdir}: no rows in the selected windows")
    return summary, total, count


def smooth(total, count, n):
    """Row-weighted moving mean over n positions (sums, then divide: empty rows weigh 0)."""
    k = np.ones(n)
    t, c = np.convolve(total, k, "same"), np.convolve(count, k, "same")
    return np.where(c > 0, t / np.maximum(c, 1), np.nan)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdirs", nargs="+", help="tmx eval-kld --out folders")
    ap.add_argument("-o", "--out", required=True, help="the PNG to write")
    ap.add_argument("--label", action="append", default=[], help="one per folder, in order")
    ap.add_argument("--smooth", type=int, default=0, help="positions per moving mean")
    ap.add_argument("--all", action="store_true", help="every window, not only the headline")
    ap.add_argument("--title", default="KL(teacher || model) by position")
    a = ap.parse_args()
    if a.label and len(a.label) != len(a.outdirs):
        sys.exit("plot_kld.py: give one --label per folder, or none")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for i, d in enumerate(a.outdirs):
        summary, total, count = load(d, a.all)
        n = a.smooth or max(1, summary["window"] // 64)
        label = a.label[i] if a.label else os.path.basename(os.path.normpath(d))
        line, = ax.plot(np.arange(len(total)), smooth(total, count, n), lw=1.2,
                        label=f"{label}")
        ax.axhline(total.sum() / count.sum(), color=line.get_color(), ls="--", lw=0.8)
    ax.set_xlabel("position in the window (row r predicts token r + 1)")
    ax.set_ylabel("mean KLD (nats)")
    ax.set_title(a.title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out)
    print(a.out)


if __name__ == "__main__":
    main()
