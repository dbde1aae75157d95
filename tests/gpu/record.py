#!/usr/bin/env python3
"""Writes docs/perf/h200.md and docs/perf/h200-kernels.json from the files tests/gpu/run.sh
left under $OUT (conform.json, summary.json, graph.txt, generate.txt, kld.txt), as the device tool
returned them here:

    python3 tests/gpu/record.py FILES_DIR [--docs DIR]

Only what those files hold is written: no number is made up or carried over."""
import argparse
import datetime
import json
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", type=pathlib.Path)
    ap.add_argument("--docs", type=pathlib.Path, default=ROOT / "docs" / "perf")
    a = ap.parse_args()
    conform = json.loads((a.files / "conform.json").read_text())
    summary = json.loads((a.files / "summary.json").read_text())
    graph = [l for l in (a.files / "graph.txt").read_text().splitlines()
             if l.rstrip().endswith(("PASS", "FAIL")) or "  PASS  " in l or "  FAIL  " in l]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip() != ""
    gpu = [f.strip() for f in summary["gpu"].split(",")] + ["?", "?", "?"]
    meta = {"date": datetime.date.today().isoformat(), "gpu": gpu[0], "driver": gpu[1],
            "memory": gpu[2], "commit": commit + ("+uncommitted" if dirty else ""),
            "command": "tests/gpu/prepare.sh build-cuda, then bash tests/gpu/run.sh on the GPU",
            "op_time": "us: mean wall time of one op over 20 runs queued back to back and one "
                       "sync (tmx conform --repeat 20); conformance shapes are small, so these "
                       "mostly measure launch overhead"}
    kld, name = {}, None  # kld.txt: "--- model" then eval-kld's table, or a failure line
    for line in (a.files / "kld.txt").read_text().splitlines() if (a.files / "kld.txt").exists() else []:
        if line.startswith("--- "):
            name = line[4:].strip()
            kld[name] = "failed"
        elif name and line.startswith("headline"):
            kld[name] = " ".join(line.split()[1:])
    doc = {"meta": meta, "logits_cpu_vs_cuda": kld,
           "conformance": {"cases": conform["cases_run"], "failed": conform["failed"],
                           "by_op": summary["ops"], "cases": conform["cases"]},
           "graph_check": graph, "sanitizer": summary["sanitizer"],
           "muse_tiny": summary["generate"]}
    a.docs.mkdir(parents=True, exist_ok=True)
    (a.docs / "h200-kernels.json").write_text(json.dumps(doc, indent=1) + "\n")

    md = [f"# CUDA kernel set on an H200\n",
          f"{meta['date']}, {meta['gpu']} ({meta['memory']}), driver {meta['driver']}, commit "
          f"{meta['commit']}. Reproduce: {meta['command']}; then "
          f"`python3 tests/gpu/record.py <returned files>`. Raw numbers: h200-kernels.json.\n",
          "## Conformance (`tmx conform --kernels cuda`)\n",
          f"{conform['cases_run'] - conform['failed']} of {conform['cases_run']} cases pass. "
          "Error is the normalized max error against conform.c's float64 reference; the last "
          "column is the worst error of the op's cases over its tolerance.\n",
          "| op | cases | pass | worst err / tol |", "|---|---|---|---|"]
    for op, v in summary["ops"].items():
        md.append(f"| {op} | {v['cases']} | {v['pass']} | {v['worst_err_over_tol']:.3f} |")
    if summary["failed"]:
        md.append("\nFailing cases: " + ", ".join(f"`{n}`" for n in summary["failed"]) + ".")
    md += ["\n## Graphs and memory checks (`tmx-graph-check cuda`, compute-sanitizer)\n"]
    md += [f"    {l}" for l in graph]
    md += [f"\ncompute-sanitizer memcheck over the conformance cases: {summary['sanitizer']}\n",
           "## muse-tiny end to end (`tmx generate`, greedy, 64 tokens)\n",
           "Texts of kernels cpu and cuda compared for each KV cache dtype; the last column is "
           "the cuda run's decode tokens/s as tmx generate reports it (64 tokens, so start-up "
           "dominated). The 512-token rows compare decode speed: cuda with graphs (the core's "
           "default), cuda eager (`--set graphs=false`), cpu (16 cores of the GPU machine).\n",
           "| run | result | cuda tok/s |", "|---|---|---|"]
    for r in summary["generate"]:
        what, result, tps = r.split("|")
        md.append(f"| {what} | {result} | {tps} |")
    if kld:
        md += ["\n## Logits: CPU teacher, CUDA model (`tmx eval-kld`)\n",
               "KL(cpu || cuda) in nats over the full vocabulary and top-1 agreement, 4 windows "
               "of 256 tokens of README.md, the same checkpoint on both kernel sets; 95% BCa "
               "and Wilson intervals.\n",
               "| model | windows | rows | KLD [95%] | top-1 [95%] |", "|---|---|---|---|---|"]
        for m, v in kld.items():
            f = v.split()
            md.append(f"| {m} | {f[0]} | {f[1]} | {' '.join(f[2:5])} | {' '.join(f[5:])} |"
                      if len(f) >= 7 else f"| {m} | {v} | | | |")
    mini = a.files / "muse-mini.json"
    if mini.exists():  # tests/gpu/muse_mini.sh
        mm = json.loads(mini.read_text())
        doc["muse_mini"] = mm
        (a.docs / "h200-kernels.json").write_text(json.dumps(doc, indent=1) + "\n")
        md += ["\n## muse-mini, the trained default model (`tests/gpu/muse_mini.sh`)\n",
               "The BF16 teacher and its K3 builds (made on the GPU machine by `tmx quantize` "
               "with its built-in calibration sample): 64 greedy tokens with kernels cpu and "
               "cuda compared; KL(cpu || cuda) and top-1 over windows of 512 tokens of "
               "README.md; decode tokens/s over 256 tokens (cuda with graphs, cuda eager, cpu on "
               f"{mm['cpu_cores']} cores).\n",
               "| model | greedy 64 tokens | KLD, top-1 (windows, rows, value [95%]) | decode tok/s |",
               "|---|---|---|---|"]
        for r in mm["runs"]:
            md.append(f"| {r['model']} | {r['greedy_64']} | {r['kld_cpu_vs_cuda']} | "
                      f"{r['decode_tok_s_256']} |")
    (a.docs / "h200.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
