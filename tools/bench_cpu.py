"""CPU decode benchmark: tokens/s of `tmx generate` on generated Muse models.

Usage: python3 tools/bench_cpu.py [--threads 2] [--runs 3] [--out docs/perf]

Makes muse-tiny and the ~30M-parameter preset (F32 and BF16), runs greedy generation of 128
tokens after a 64-token prompt `--runs` times each, and writes cpu.json and cpu.md (median
decode and prefill tokens/s, machine, commit) under --out. A benchmark, not a test.
"""
import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PROMPT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it "
          "was the age of foolishness, it was the epoch of belief, it was the epoch of")
LINE = re.compile(r"(\d+) tokens, ([0-9.]+) tokens/s \(prompt: (\d+) tokens, ([0-9.]+) tokens/s\)")


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def read_bandwidth_gb_s():
    """Anchor: one thread summing a 512 MiB float32 array (numpy), best of 5."""
    import time
    import numpy as np
    a = np.ones(128 << 20, dtype=np.float32)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def run(cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "perf"))
    args = ap.parse_args()
    tmx = os.path.join(args.bin, "tmx")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in ("tiny", "30m"):
            for dtype in ("f32", "bf16"):
                d = os.path.join(tmp, f"{preset}-{dtype}")
                info = run([sys.executable, os.path.join(ROOT, "tools", "make_tiny_model.py"), d,
                            "--preset", preset, "--dtype", dtype])
                params = re.search(r"([0-9,]+) parameters \(([0-9,]+) active", info)
                dec, pre = [], []
                for _ in range(args.runs):
                    out = run([tmx, "generate", "--model", d, "--prompt", PROMPT, "-n",
                               str(args.n), "--temperature", "0", "--threads",
                               str(args.threads)])
                    m = LINE.search(out.strip().splitlines()[-1])
                    dec.append(float(m.group(2)))
                    pre.append(float(m.group(4)))
                    n_prompt = int(m.group(3))
                active = int(params.group(2).replace(",", ""))
                bytes_per_token = active * (4 if dtype == "f32" else 2)
                rows.append({"model": f"muse-{preset}", "dtype": dtype,
                             "parameters": params.group(1), "active_parameters": active,
                             "weight_bytes_per_token": bytes_per_token,
                             "prompt_tokens": n_prompt, "generated": args.n,
                             "decode_tok_s": statistics.median(dec),
                             "prefill_tok_s": statistics.median(pre), "runs": args.runs,
                             "decode_weight_gb_s": statistics.median(dec) * bytes_per_token / 1e9})
                print(rows[-1], flush=True)
    commit = run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]).strip()
    meta = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(),
            "load_average_1min_at_end": os.getloadavg()[0],
            "anchor_read_gb_s_1_thread": read_bandwidth_gb_s(),
            "cores": os.cpu_count(), "threads": args.threads, "commit": commit,
            "command": "python3 tools/bench_cpu.py --threads %d --runs %d" % (args.threads,
                                                                            args.runs)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    with open(os.path.join(args.out, "cpu.md"), "w") as f:
        f.write("# CPU decode speed\n\n")
        f.write(f"{meta['date']}, {meta['cpu']}, {meta['cores']} cores, {meta['threads']} "
                f"threads, commit {commit}. Reproduce: `{meta['command']}`.\n\n")
        f.write("Greedy decoding of %d tokens after the prompt; median of %d runs. Random "
                "weights (tools/make_tiny_model.py). Decode is bound by reading the active "
                "weights once per token: the last column is those bytes times tokens/s, to set "
                "against the machine's streaming read bandwidth. 1-minute load average at the "
                "end: %.2f (other work on the machine lowers these numbers). Anchor in the same "
                "run: one thread streams %.1f GB/s (numpy sum of 512 MiB).\n\n"
                % (args.n, args.runs, meta["load_average_1min_at_end"],
                   meta["anchor_read_gb_s_1_thread"]))
        f.write("| model | weights | parameters (active) | prompt tokens | prefill tok/s | "
                "decode tok/s | weight GB/s in decode |\n")
        f.write("|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['model']} | {r['dtype']} | {r['parameters']} "
                    f"({r['active_parameters']:,}) | {r['prompt_tokens']} | "
                    f"{r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
                    f"{r['decode_weight_gb_s']:.1f} |\n")


if __name__ == "__main__":
    main()
