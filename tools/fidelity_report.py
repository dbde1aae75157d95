#!/usr/bin/env python3
"""Regenerates docs/perf/fidelity.md (+ fidelity.json, fidelity.png): how far muse-mini's K3
builds are from their BF16 teacher, by `tmx eval-kld` (docs/fidelity.md), on held-out books and
WikiText-2 test.

    tools/fidelity_report.py [--tmx BIN] [--windows N] [--threads N] [--work DIR] [--out DIR]

1. makes the builds if missing (tools/make_default_models.sh --fp4 --pair);
2. six runs of 2 x N windows of 1,024 tokens (muse-mini's context), N spread evenly over each
   source: K3 E4M3, K3 FP4 and K3 E4M3-pair (the experimental law of docs/trellismx.md §14),
   each in its serving formats and weights only (--model-set codec.trellis-*.activations=f32);
3. `tmx eval-kld --paired` on the same rows: FP4 and E4M3-pair against E4M3 (serving, weights
   only), and serving formats against weights only (E4M3, FP4);
4. the checks of ../shared/design/measuring.md: the teacher against itself is 0, the teacher's
   log-probabilities are bit-identical in all six runs, a second run of one path gives the
   same records;
5. writes the report, the JSON (every summary without its per-window list) and the plot.

Takes about 5 minutes on 2 cores with the default 20 windows per source (40 s a run). Needs
../shared/data (heldout.txt.xz, wiki.test.raw) and a built tmx; matplotlib only for the plot.
"""
import argparse
import datetime
import json
import lzma
import math
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
TEACHER = os.path.join(ROOT, "models", "muse-mini")
BUILDS = {"e4m3": ("muse-mini-k3", "trellis-e4m3", "E4M3"),
          "fp4": ("muse-mini-k3-fp4", "trellis-fp4", "NVFP4"),
          "pair": ("muse-mini-k3-pair", "trellis-e4m3-pair", "E4M3")}
LABELS = {"e4m3": "K3 E4M3", "fp4": "K3 FP4", "pair": "K3 E4M3-pair"}
WINDOW = 1024


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sh(*cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, **kw)


def eval_kld(a, model, out, texts, windows, *extra):
    """One tmx eval-kld run; returns its summary."""
    cmd = [a.tmx, "eval-kld", "--teacher", TEACHER, "--model", model, "--window", str(WINDOW),
           "--max-windows", str(windows), "--threads", str(a.threads), "--out", out, *extra]
    for t in texts:
        cmd += ["--text", t]
    t0 = time.time()
    sh(*cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log(f"  {os.path.basename(out)}: {time.time() - t0:.0f} s")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def records(out):
    with open(os.path.join(out, "tokens.jsonl")) as f:
        return [json.loads(line) for line in f]


def paired(a, out_a, out_b, out):
    sh(a.tmx, "eval-kld", "--paired", out_a, "--paired", out_b, "--out", out,
       stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "paired.json")) as f:
        return json.load(f)


# ---- checks -----------------------------------------------------------------------------------


def check_teacher_self(a, texts, work):
    s = eval_kld(a, TEACHER, os.path.join(work, "teacher-self"), texts, 2)
    recs = records(os.path.join(work, "teacher-self"))
    ok = all(r["kld"] == 0.0 and r["teacher_top1"] == r["model_top1"] for r in recs)
    return {"rows": len(recs), "all_zero": ok, "kld": s["headline"]["kld"]["mean"]}


def check_teacher_identical(work, names):
    """The teacher's log-probability of every row, bit for bit, across the runs."""
    ref = [r["teacher_logp"] for r in records(os.path.join(work, names[0]))]
    same = all([r["teacher_logp"] for r in records(os.path.join(work, n))] == ref
               for n in names[1:])
    return {"runs": len(names), "rows": len(ref), "identical": same}


def check_repeat(a, texts, work, name, model, extra):
    """A second run of one path on 2 windows per source; its windows that the first run also
    scored (same source and offset) must have identical records."""
    rep = os.path.join(work, name + "-repeat")
    s2 = eval_kld(a, model, rep, texts, 2, *extra)
    with open(os.path.join(work, name, "summary.json")) as f:
        s1 = json.load(f)
    where = {(w["source"], w["offset"]): w["index"] for w in s1["windows"]}
    match = {w["index"]: where[(w["source"], w["offset"])] for w in s2["windows"]
             if (w["source"], w["offset"]) in where}
    first = {}
    for r in records(os.path.join(work, name)):
        first.setdefault(r["window"], []).append(r)
    second = {}
    for r in records(rep):
        second.setdefault(r["window"], []).append(r)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "window"} for r in rs]  # noqa: E731
    same = all(strip(second[i]) == strip(first[j]) for i, j in match.items())
    return {"path": name, "windows_compared": len(match),
            "rows": sum(len(second[i]) for i in match), "identical": same}


# ---- the report -------------------------------------------------------------------------------


def ci(x, digits=4):
    return f"{x['mean']:.{digits}f} [{x['lo']:.{digits}f}, {x['hi']:.{digits}f}]"


def top1(t):
    return f"{100 * t['rate']:.2f}% [{100 * t['lo']:.2f}, {100 * t['hi']:.2f}]"


def ppl(x):
    return f"{math.exp(x['mean']):.1f} [{math.exp(x['lo']):.1f}, {math.exp(x['hi']):.1f}]"


def closer(d):
    """How A compares with B from the interval of A - B."""
    return ("closer to" if d["hi"] < 0 else "further from" if d["lo"] > 0 else
            "as close to (the interval holds 0)")


def machine():
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    gcc = subprocess.run(["gcc", "-dumpfullversion"], capture_output=True, text=True).stdout
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return {"date": datetime.date.today().isoformat(), "cpu": cpu, "cores": os.cpu_count(),
            "gcc": gcc.strip(), "commit": head + (" plus the working tree" if dirty else "")}


def build_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def write_report(a, info, runs, pairs, checks, texts):
    s0 = runs["e4m3-serving"]
    with open(texts[1], encoding="utf-8", newline="") as f:
        lines = [line for line in f.read().split("\r\n") if line.strip()]
    wiki_line = sum(map(len, lines)) / len(lines)
    src_names = ["held-out books", "WikiText-2 test"]
    L = []
    w = L.append
    w("# Fidelity of muse-mini's K3 builds\n")
    w("KL(teacher ‖ build) of the TrellisMX K3 builds of muse-mini "
      "(models/muse-mini/README.md) against their BF16 teacher, measured by `tmx eval-kld` as "
      "../shared/design/measuring.md asks (method: [../fidelity.md](../fidelity.md)). "
      "Regenerated, with every number below, by one command:\n")
    w("```sh\ntools/fidelity_report.py" + (f" --windows {a.windows}" if a.windows != 20 else "")
      + "      # about 5 minutes on 2 cores\n```\n")
    w(f"Measured {info['date']} on {info['cpu']} ({info['cores']} cores), CPU kernel set, "
      f"`--threads {a.threads}`, gcc {info['gcc']} Release, at commit {info['commit']}. Every "
      f"figure is in [fidelity.json](fidelity.json) (the summaries without their per-window "
      f"lists, the paired comparisons, the checks).\n")
    w("## Setup\n")
    n_rows = s0["headline"]["rows"]
    w(f"- **Teacher**: models/muse-mini, BF16 weights, F32 math on the CPU kernel set.")
    sizes = {k: build_bytes(os.path.join(ROOT, "models", BUILDS[k][0])) / 1e6 for k in BUILDS}
    w("- **Builds**: made by tools/make_default_models.sh --fp4 --pair (`tmx quantize --bits 3 "
      "--calib "
      "tools/train/calib-books.txt --tokens 16384 --window 1024`): "
      + ", ".join(f"{BUILDS[k][0]} (`{BUILDS[k][1]}`, {sizes[k]:.1f} MB)" for k in BUILDS)
      + ". Routed experts at 3 bits; attention MXFP8; "
      "the rest (embedding, lm_head, dense layer, shared experts, bridges, norms) as in the "
      "teacher.")
    w(f"- **Text**: the two held-out sources of ../shared/data (MANIFEST.md): the Gutenberg "
      f"held-out authors (Brontë, Christie, Lockhart; {s0['sources'][0]['tokens']:,} tokens) "
      f"and the WikiText-2 test split as distributed (CRLF line endings, ` @-@ ` tokenization; "
      f"{s0['sources'][1]['tokens']:,} tokens). Neither overlaps the calibration text (the "
      f"13-gram screen left out {s0['left_out']['windows']} windows).")
    w(f"- **Windows**: {WINDOW} tokens (the model's `max_position_embeddings`; BOS + 1,023 "
      f"text tokens), {a.windows} per source spread evenly over it: "
      f"{s0['headline']['windows']} windows, {n_rows:,} next-token rows per run, each window a "
      f"fresh sequence. Intervals: window-block bootstrap BCa 95% (5,000 resamples, seed 0); "
      f"top-1 with Wilson 95%.")
    w("- **Paths**: serving formats (the codec's activations: E4M3 per token for trellis-e4m3 "
      "and trellis-e4m3-pair, NVFP4 for trellis-fp4) and weights only (`--model-set "
      "codec.trellis-…activations=f32`: the decoded weights against F32 activations).\n")

    w("## The teacher\n")
    w("Negative log-likelihood of the actual next token under the BF16 teacher (nats per token) "
      "on the same windows, and its perplexity, with window-block bootstrap 95% intervals:\n")
    w("| source | windows | rows | NLL [95%] | perplexity [95%] |")
    w("|---|---|---|---|---|")
    for i, g in enumerate(s0["by_source"]):
        w(f"| {src_names[i]} | {g['windows']} | {g['rows']:,} | {ci(g['nll']['teacher'], 3)} | "
          f"{ppl(g['nll']['teacher'])} |")
    w(f"\nWikiText-2's figure is above ln 8192 = {math.log(8192):.2f} nats (a uniform guess) "
      f"because the model only ever saw Gutenberg's hard-wrapped lines (at most about 75 "
      f"characters): past about 70 characters without a line break it bets heavily on one, and "
      f"WikiText's paragraphs are single lines ({wiki_line:.0f} characters on average). Not a "
      f"measurement error; models/muse-mini/README.md has the per-token breakdown and the same "
      f"text wrapped at 70 columns.\n")
    w("## KLD and top-1 agreement\n")
    w("KL(teacher ‖ build) in nats over the full vocabulary (8,192 ids), FP64, every next-token "
      "row; headline = all windows (none left out by the calibration screen).\n")
    teacher_books = s0["by_source"][0]["nll"]["teacher"]["mean"]
    w("| build | activations | KLD [95%] | top-1 [95%] | KLD 0-256 | KLD 256-1,023 | "
      f"books | WikiText | books NLL (teacher {teacher_books:.4f}) |")
    w("|---|---|---|---|---|---|---|---|---|")
    for key in BUILDS:
        for path in ("serving", "f32"):
            s = runs[f"{key}-{path}"]
            h, pos, src = s["headline"], s["by_position"], s["by_source"]
            act = f"serving ({BUILDS[key][2]})" if path == "serving" else "f32 (weights only)"
            w(f"| {LABELS[key]} | {act} | {ci(h['kld'])} | "
              f"{top1(h['top1'])} | {pos[0]['kld']['mean']:.4f} | {pos[1]['kld']['mean']:.4f} | "
              f"{src[0]['kld']['mean']:.4f} | {src[1]['kld']['mean']:.4f} | "
              f"{src[0]['nll']['model']['mean']:.4f} |")
    w("\nBy source, with intervals:\n")
    w("| build | activations | books KLD [95%] | books top-1 | WikiText KLD [95%] | "
      "WikiText top-1 |")
    w("|---|---|---|---|---|---|")
    for key in BUILDS:
        for path in ("serving", "f32"):
            src = runs[f"{key}-{path}"]["by_source"]
            paths = "serving" if path == "serving" else "weights only"
            w(f"| {LABELS[key]} | {paths} | "
              f"{ci(src[0]['kld'])} | {top1(src[0]['top1'])} | {ci(src[1]['kld'])} | "
              f"{top1(src[1]['top1'])} |")

    w("\n## Paired on the same rows\n")
    w("`tmx eval-kld --paired A --paired B`: both runs scored the same windows against the same "
      "teacher, so the per-window sums pair up. A − B is the row-weighted mean of the per-token "
      "differences and A / B the ratio of the mean KLDs, each with its window-block bootstrap "
      "BCa 95% interval.\n")
    w("| A | B | KLD A | KLD B | A − B [95%] | A / B [95%] | books A − B | WikiText A − B |")
    w("|---|---|---|---|---|---|---|---|")
    for label_a, label_b, key in PAIRS_TEXT:
        p = pairs[key]
        h, src = p["headline"], p["by_source"]
        w(f"| {label_a} | {label_b} | {h['a']['kld']:.4f} | {h['b']['kld']:.4f} | "
          f"{ci(h['difference'])} | {ci(h['ratio'], 3)} | {ci(src[0]['difference'])} | "
          f"{ci(src[1]['difference'])} |")
    w("")
    fp4s, e4s = pairs["fp4-e4m3-serving"]["headline"], pairs["e4m3-serving-f32"]["headline"]
    fp4w, fp4a = pairs["fp4-e4m3-f32"]["headline"], pairs["fp4-serving-f32"]["headline"]
    w(f"In the seed's words: against the E4M3-operand build on the same {n_rows:,} rows, the "
      f"FP4 build adds {ci(fp4s['difference'])} nats in serving formats (ratio "
      f"{ci(fp4s['ratio'], 2)}); its weights alone are {closer(fp4w['difference'])} the "
      f"teacher than E4M3's ({fp4w['a']['kld']:.4f} against {fp4w['b']['kld']:.4f}; difference "
      f"{ci(fp4w['difference'])}). The serving formats add {ci(e4s['difference'])} over "
      f"weights only for E4M3 (ratio {ci(e4s['ratio'], 2)}) and {ci(fp4a['difference'])} for "
      f"FP4 (ratio {ci(fp4a['ratio'], 2)}).\n")
    prs, prw = pairs["pair-e4m3-serving"]["headline"], pairs["pair-e4m3-f32"]["headline"]
    w(f"The experimental E4M3-pair build (docs/trellismx.md §14: one trellis state for two "
      f"weights) against E4M3: {ci(prs['difference'])} nats in serving formats (ratio "
      f"{ci(prs['ratio'], 3)}), {ci(prw['difference'])} with its weights alone (ratio "
      f"{ci(prw['ratio'], 3)}).\n")

    w("## Checks\n")
    c = checks
    w(f"- The teacher against itself: {c['teacher_self']['rows']:,} rows (2 windows per source), "
      + ("every KLD exactly 0 and top-1 agreement 1." if c["teacher_self"]["all_zero"]
         else "NOT all zero."))
    w(f"- The teacher's log-probability of every row is "
      f"{'bit-identical' if c['teacher_identical']['identical'] else 'NOT identical'} in the "
      f"{c['teacher_identical']['runs']} runs ({c['teacher_identical']['rows']:,} rows each).")
    r = c["repeat"]
    w(f"- A second run of the {r['path']} path (2 windows per source): its "
      f"{r['windows_compared']} windows that the first run also scored give "
      f"{'byte-identical' if r['identical'] else 'DIFFERENT'} per-token records "
      f"({r['rows']:,} rows).")
    w("- The scoring against numpy in float64, the statistics against their Python mirror and "
      "known values: tests/python/test_eval_kld.py, tests/unit/test_eval.c.\n")
    if c.get("plot"):
        w("## By position\n")
        w("![KLD by position](fidelity.png)\n")
        w("Mean KLD at each position of the window over all headline windows (moving mean over "
          "16 positions), dashed: each run's mean; drawn by tools/plot_kld.py.\n")
    with open(os.path.join(a.out, "fidelity.md"), "w") as f:
        f.write("\n".join(L))


PAIRS = {  # key: (A run, B run)
    "fp4-e4m3-serving": ("fp4-serving", "e4m3-serving"),
    "fp4-e4m3-f32": ("fp4-f32", "e4m3-f32"),
    "pair-e4m3-serving": ("pair-serving", "e4m3-serving"),
    "pair-e4m3-f32": ("pair-f32", "e4m3-f32"),
    "e4m3-serving-f32": ("e4m3-serving", "e4m3-f32"),
    "fp4-serving-f32": ("fp4-serving", "fp4-f32"),
}
PAIRS_TEXT = [
    ("K3 FP4, serving", "K3 E4M3, serving", "fp4-e4m3-serving"),
    ("K3 FP4, weights only", "K3 E4M3, weights only", "fp4-e4m3-f32"),
    ("K3 E4M3, serving", "K3 E4M3, weights only", "e4m3-serving-f32"),
    ("K3 FP4, serving", "K3 FP4, weights only", "fp4-serving-f32"),
    ("K3 E4M3-pair, serving", "K3 E4M3, serving", "pair-e4m3-serving"),
    ("K3 E4M3-pair, weights only", "K3 E4M3, weights only", "pair-e4m3-f32"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tmx", default=os.path.join(ROOT, "build", "bin", "tmx"))
    ap.add_argument("--windows", type=int, default=20, help="windows per source (default 20)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--work", default="/tmp/tmx-fidelity", help="eval-kld output folders")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "perf"))
    a = ap.parse_args()
    heldout_xz = os.path.join(DATA, "gutenberg", "heldout.txt.xz")
    wiki = os.path.join(DATA, "eval", "wiki.test.raw")
    for p in (heldout_xz, wiki):
        if not os.path.exists(p):
            sys.exit(f"fidelity_report.py: {p} is missing (../shared/data)")
    if not os.access(a.tmx, os.X_OK):
        sys.exit(f"fidelity_report.py: --tmx {a.tmx}: no such executable (build tmx first)")
    t0 = time.time()
    sh(os.path.join(ROOT, "tools", "make_default_models.sh"), "--fp4", "--pair", "--tmx", a.tmx,
       "--threads", str(a.threads))
    os.makedirs(a.work, exist_ok=True)
    heldout = os.path.join(a.work, "heldout.txt")
    with lzma.open(heldout_xz) as src, open(heldout, "wb") as dst:
        shutil.copyfileobj(src, dst)
    texts = [heldout, wiki]

    runs = {}
    for key, (name, codec, _) in BUILDS.items():
        for path in ("serving", "f32"):
            run = f"{key}-{path}"
            log(f"eval-kld {run} ({2 * a.windows} windows)")
            extra = [] if path == "serving" else ["--model-set", f"codec.{codec}.activations=f32"]
            runs[run] = eval_kld(a, os.path.join(ROOT, "models", name),
                                 os.path.join(a.work, run), texts, a.windows, *extra)
    pairs = {k: paired(a, os.path.join(a.work, x), os.path.join(a.work, y),
                       os.path.join(a.work, "paired-" + k)) for k, (x, y) in PAIRS.items()}
    log("checks")
    checks = {"teacher_self": check_teacher_self(a, texts, a.work),
              "teacher_identical": check_teacher_identical(a.work, list(runs)),
              "repeat": check_repeat(a, texts, a.work, "fp4-serving",
                                     os.path.join(ROOT, "models", BUILDS["fp4"][0]), [])}
    try:
        sh(sys.executable, os.path.join(ROOT, "tools", "plot_kld.py"),
           *[os.path.join(a.work, r) for r in runs],
           *sum([["--label", r.replace("-f32", " weights only").replace("-", " ")]
                 for r in runs], []),
           "-o", os.path.join(a.out, "fidelity.png"),
           stdout=subprocess.DEVNULL)
        checks["plot"] = True
    except (subprocess.CalledProcessError, OSError) as exc:
        log(f"no plot: {exc}")
        checks["plot"] = False
    info = machine()
    info["seconds"] = round(time.time() - t0)
    for s in runs.values():
        s.pop("windows")
    with open(os.path.join(a.out, "fidelity.json"), "w") as f:
        json.dump({"machine": info, "windows_per_source": a.windows, "runs": runs,
                   "paired": pairs, "checks": checks}, f, indent=1)
        f.write("\n")
    write_report(a, info, runs, pairs, checks, texts)
    log(f"done in {info['seconds']} s: {os.path.join(a.out, 'fidelity.md')}")


if __name__ == "__main__":
    main()
