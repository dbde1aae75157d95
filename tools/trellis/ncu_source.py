#!/usr/bin/env python3
"""ncu_source.py: where one kernel's warps stall and its shared-memory wavefronts go, per SASS
instruction, from Nsight Compute's source page (docs/perf/h200-codec.md, "The wide GEMM's
copies and constants").

Reads the CSV that `ncu -i REPORT --page source --csv --print-source sass` prints (a report
taken with --section SourceCounters --section WarpStateStats). Prints the share of each stall
reason over the kernel's samples, its shared-memory wavefronts and how many were excess (bank
conflicts), then the instructions with the most stall samples and with the most wavefronts.

    ncu -k KERNEL --launch-count 1 --section SourceCounters --section WarpStateStats \\
        -o rep BIN ARGS && ncu -i rep.ncu-rep --page source --csv --print-source sass \\
        | python3 tools/trellis/ncu_source.py [--top 8]
"""
import argparse
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
WAVES = "L1 Wavefronts Shared"
EXCESS = "L1 Wavefronts Shared Excessive"


def number(text):
    return float(text.replace(",", "")) if text.strip() else 0.0


def read(lines):
    """The source table's columns (name -> index) and rows: the first line that names SAMPLES
    is the header (ncu prints the kernel's name above it)."""
    rows = list(csv.reader(lines))
    for i, row in enumerate(rows):
        if SAMPLES in row:
            return ({name: j for j, name in enumerate(row)},
                    [r for r in rows[i + 1:] if len(r) == len(row)])
    sys.exit("ncu_source.py: no '%s' column (was the report taken with SourceCounters?)"
             % SAMPLES)


def summary(col, rows):
    """(stall reason -> share of the samples, wavefronts, excess wavefronts)."""
    reasons = [h for h in col if h.startswith("stall_") and "(Not Issued)" not in h]
    totals = {h[len("stall_"):]: sum(number(r[col[h]]) for r in rows) for h in reasons}
    all_samples = sum(totals.values()) or 1.0
    shares = {k: v / all_samples for k, v in totals.items()}
    waves = sum(number(r[col[WAVES]]) for r in rows) if WAVES in col else 0.0
    excess = sum(number(r[col[EXCESS]]) for r in rows) if EXCESS in col else 0.0
    return shares, waves, excess


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=8, help="instructions to list (8)")
    args = ap.parse_args()
    col, rows = read(sys.stdin)
    shares, waves, excess = summary(col, rows)
    print("stalls: " + ", ".join("%s %.1f%%" % (k, 100 * v) for k, v in
                                 sorted(shares.items(), key=lambda kv: -kv[1]) if v >= 0.01))
    print("shared wavefronts %.4g, excess %.4g (%.0f%%)"
          % (waves, excess, 100 * excess / waves if waves else 0.0))
    src = col.get("Source", 1)
    print("most stall samples:")
    for r in sorted(rows, key=lambda r: -number(r[col[SAMPLES]]))[:args.top]:
        print("  %8.0f  %s" % (number(r[col[SAMPLES]]), r[src].strip()))
    if WAVES in col:
        print("most shared wavefronts (excess):")
        for r in sorted(rows, key=lambda r: -number(r[col[WAVES]]))[:args.top]:
            print("  %10.0f (%.0f)  %s" % (number(r[col[WAVES]]),
                                           number(r[col[EXCESS]]) if EXCESS in col else 0.0,
                                           r[src].strip()))


if __name__ == "__main__":
    main()
