#!/usr/bin/env python3
"""ncu_variants.py: what bounds each GEMV variant of trellis-gemv-variants, from Nsight
Compute's counters (docs/perf/h200-codec.md, "A cheaper decode"): per kernel launch, its
time, instructions issued and shared-memory load wavefronts per tile (256 weights) and how
many of those wavefronts were bank conflicts, with the SM's issue and shared-memory pipe
loads. The variants' names come from the tool's own table, printed during the same run.

    ncu --csv --log-file ncu.csv --metrics $(python3 tools/trellis/ncu_variants.py --metrics) \\
        trellis-gemv-variants --profile > variants.txt
    python3 tools/trellis/ncu_variants.py ncu.csv variants.txt [--json OUT]
"""
import argparse
import csv
import json
import sys

METRICS = {
    "gpu__time_duration.sum": "ns",
    "smsp__inst_executed.sum": "instructions",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": "shared load wavefronts",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": "bank conflicts",
    "sm__inst_executed.avg.pct_of_peak_sustained_elapsed": "issue %",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed": "smem pipe %",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram %",
}
TILES = 8 * 4096 * 4096 // 256  # one matrix launch: 8 experts x [4096][4096]


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:  # "n/a", empty
        return float("nan")


def launches(path):
    """{launch id: (kernel name, {metric: value})} from ncu's CSV (header: the line with "ID")."""
    lines = open(path, errors="replace").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    out = {}
    for row in csv.DictReader(lines[start:]):
        _, vals = out.setdefault(int(row["ID"]), (row["Kernel Name"], {}))
        vals[row["Metric Name"]] = number(row["Metric Value"])
    return out


def variant_names(path):
    """The tool's variant names in launch order: its table's rows, after the header "variant"."""
    rows = open(path, errors="replace").read().splitlines()
    start = next(i for i, line in enumerate(rows) if line.startswith("variant"))
    out = []
    for line in rows[start + 1:]:
        try:
            float(line[46:].split()[0])  # a row: the name, then its times
        except (IndexError, ValueError):
            break  # the table ends (or the tool stopped: what ran is still counted)
        out.append(line[:46].strip())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="?")
    ap.add_argument("variants", nargs="?")
    ap.add_argument("--json")
    ap.add_argument("--metrics", action="store_true", help="print the --metrics list for ncu")
    a = ap.parse_args()
    if a.metrics:
        print(",".join(METRICS))
        return 0
    if not a.csv or not a.variants:
        ap.error("needs the ncu CSV and the tool's output")
    gemv = [v for _, v in sorted(launches(a.csv).items()) if "gemv" in v[0]]
    names = variant_names(a.variants)
    if len(gemv) < 2 * len(names):
        sys.exit(f"ncu_variants: {len(gemv)} GEMV launches for {len(names)} variants (expected two each)")
    rows = []
    for i, name in enumerate(names):
        m = dict.fromkeys(METRICS, float("nan"))
        m.update(gemv[2 * i + 1][1])  # the two-matrix launch, as the tool's weights/s
        tiles = 2 * TILES
        rows.append({"variant": name, "us": m["gpu__time_duration.sum"] / 1e3,
                     "instr_per_tile": m["smsp__inst_executed.sum"] / tiles,
                     "smem_ld_wavefronts_per_tile":
                         m["l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"] / tiles,
                     "bank_conflicts_per_tile":
                         m["l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"] / tiles,
                     "issue_pct": m["sm__inst_executed.avg.pct_of_peak_sustained_elapsed"],
                     "smem_pipe_pct":
                         m["l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed"],
                     "dram_pct": m["dram__throughput.avg.pct_of_peak_sustained_elapsed"]})
    print(f"{'variant (two matrices a launch)':<46} {'us':>8} {'instr/t':>8} {'ld wf/t':>8} "
          f"{'confl/t':>8} {'issue%':>7} {'smem%':>6} {'dram%':>6}")
    for r in rows:
        print(f"{r['variant']:<46} {r['us']:8.1f} {r['instr_per_tile']:8.2f} "
              f"{r['smem_ld_wavefronts_per_tile']:8.2f} {r['bank_conflicts_per_tile']:8.2f} "
              f"{r['issue_pct']:7.1f} {r['smem_pipe_pct']:6.1f} {r['dram_pct']:6.1f}")
    if a.json:
        json.dump({"tiles_per_launch": 2 * TILES, "variants": rows}, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
