"""tests/gpu/first_request.py: what a fresh `tmx serve` makes its first request pay.

Starts `tmx serve` --starts times with config key warmup true and as many with false, taking
turns; each start waits for /health, then sends --requests completions one after another (a
prompt of about 230 tokens, each beginning differently so that none hits the prefix cache, one
token generated) and records each one's latency. Prints, per setting, the first requests'
latencies, their median and the median of the later ones, the median of each request in turn,
and the warm-up's own time from the server's log. --repeats gives the prompts other lengths
(the sentence's repeats for request 1, 2, ..., cycled; 12 is about 230 tokens): a request whose
length no earlier one had shows whether a new prompt width pays again. Standard library only,
so that it runs on the bare GPU machine:

    python3 tests/gpu/first_request.py BIN [--model DIR] [--kernels cuda] [--set KEY=VALUE]...
                                       [--starts N] [--requests N] [--repeats 12,12,6,6]
                                       [--json OUT]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
import urllib.request

SENTENCE = "It was a dark and stormy night; the rain fell in torrents, and "


def one_start(args, warmup, port):
    """The latencies (s) of --requests completions to a fresh server, and its warm-up time."""
    sets = [x for kv in [f"kernels={args.kernels}", f"warmup={warmup}"] + args.set
            for x in ("--set", kv)]
    log = tempfile.TemporaryFile("w+")
    p = subprocess.Popen([os.path.join(args.bin, "tmx"), "serve", "--model", args.model,
                          "--port", str(port)] + sets, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            if p.poll() is not None:
                log.seek(0)
                raise SystemExit(f"tmx serve exited: {log.read()[-2000:]}")
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        times = []
        for i in range(args.requests):
            prompt = f"{i} " + SENTENCE * args.repeats[i % len(args.repeats)]
            body = {"model": "x", "prompt": prompt, "max_tokens": 1, "temperature": 0}
            q = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                       {"Content-Type": "application/json"})
            t = time.perf_counter()
            urllib.request.urlopen(q, timeout=120).read()
            times.append(time.perf_counter() - t)
    finally:
        p.terminate()
        p.wait()
    log.seek(0)
    m = re.search(r"warm-up: .* in ([0-9.]+) ms", log.read())
    return times, float(m.group(1)) if m else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin", help="the folder with tmx and its plugins")
    ap.add_argument("--model", default="models/muse-mini")
    ap.add_argument("--kernels", default="cuda")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--repeats", default="12",
                    type=lambda v: [int(x) for x in v.split(",")])
    ap.add_argument("--port", type=int, default=18460)
    ap.add_argument("--json")
    args = ap.parse_args()
    runs = {"true": [], "false": []}
    for s in range(args.starts):
        for warmup in runs:
            runs[warmup].append(one_start(args, warmup, args.port))
    out = {}
    for warmup, rs in runs.items():
        first = [1e3 * t[0] for t, _ in rs]
        later = [1e3 * x for t, _ in rs for x in t[1:]]
        warm = [w for _, w in rs if w is not None]
        each = [statistics.median(1e3 * t[i] for t, _ in rs) for i in range(args.requests)]
        out[warmup] = {"first_ms": first, "first_median_ms": statistics.median(first),
                       "later_median_ms": statistics.median(later) if later else None,
                       "each_median_ms": each, "warmup_ms": warm}
        print(f"warmup={warmup}: first request {', '.join(f'{x:.1f}' for x in first)} ms "
              f"(median {out[warmup]['first_median_ms']:.1f}), later ones median "
              f"{out[warmup]['later_median_ms']:.1f} ms"
              + (f", warm-up {min(warm):.0f}-{max(warm):.0f} ms" if warm else ""))
        print(f"  each request's median (repeats {args.repeats}): "
              + ", ".join(f"{x:.1f}" for x in each) + " ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "kernels": args.kernels, "set": args.set,
                       "repeats": args.repeats, "runs": out}, f, indent=1)


if __name__ == "__main__":
    main()
