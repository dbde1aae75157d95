"""tmx eval-kld (core/cli/eval-kld.c, core/eval-kld.c, docs/fidelity.md) on muse-tiny.

The sanity checks of the seed 001 methodology: the teacher against itself scores exactly 0
with top-1 = 1; two runs are bit-identical; the per-token records match KL computed with
numpy in float64 from logits read through tmx_engine.py. Besides: the summary's statistics
recomputed from the records (bca() below is the Python mirror of tmx_eval_bootstrap, which
test_eval.c also quotes), --model-set reaching the model only (weights-only against serving
formats), `--paired` (serving against weights only on the same rows) recomputed from both
runs' records, the calibration-overlap screen, position buckets, the window cap, the plot tool,
one-line errors naming the flag or file, and --out: an interrupted run leaves the earlier run's
files whole, and an --out in a model's folder or over an input is refused.

The model is muse-tiny's K3 trellis-e4m3 build (one tmx quantize, ~40 s). Windows are short
(--window 64, --max-windows 4) so that every run takes a second or two.
"""
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from tmx_engine import BIN_DIR, Engine

ROOT = pathlib.Path(__file__).resolve().parents[2]
TMX = os.path.join(BIN_DIR, "tmx")
WINDOW, MAX_WINDOWS, THREADS = 64, 4, 2
Z95 = 1.959963984540054

ADJ = ["quiet", "old", "bright", "narrow", "distant", "heavy", "gentle", "silver"]
NOUN = ["river", "house", "letter", "garden", "road", "window", "bell", "harbour"]
VERB = ["waited by", "looked over", "ran past", "stood near", "fell across", "turned toward"]


def text_a(n):
    """English-like prose, deterministic."""
    return "".join(f"The {ADJ[i % 8]} {NOUN[i * 3 % 8]} {VERB[i % 6]} the {NOUN[i * 5 % 8]} "
                   f"in the {ADJ[i * 7 % 8]} morning. " for i in range(n))


def text_b(n):
    """A ledger of numbers and dates: another source."""
    return "".join(f"Entry {i}: {i * 37 % 1000} bushels on {1 + i % 28} March {1850 + i % 40}, "
                   f"paid {i * 13 % 97} shillings.\n" for i in range(n))


def run(*args, check=True):
    r = subprocess.run([TMX, "eval-kld", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise AssertionError(f"tmx eval-kld {' '.join(args)} failed:\n{r.stderr}")
    return r


def assert_one_line_errors(cases, prefix):
    """Each (args, name): tmx eval-kld fails with one stderr line that starts with prefix and
    names what is wrong."""
    for args, name in cases:
        r = run(*args, check=False)
        assert r.returncode != 0, args
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(prefix), (args, r.stderr)
        assert name in lines[0], (args, lines[0])


def evaluate(teacher, model, texts, out, *extra):
    args = ["--teacher", teacher, "--model", model, "--window", str(WINDOW), "--max-windows",
            str(MAX_WINDOWS), "--threads", str(THREADS), "--out", str(out)]
    for t in texts:
        args += ["--text", str(t)]
    run(*args, *extra)
    return load(out)


def load(out):
    with open(out / "summary.json") as f:
        summary = json.load(f)
    with open(out / "tokens.jsonl") as f:
        records = [json.loads(line) for line in f]
    return summary, records


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("muse-tiny")
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), str(d)],
                   check=True, capture_output=True)
    return str(d)


@pytest.fixture(scope="module")
def k3(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("k3") / "trellis-e4m3"
    subprocess.run([TMX, "quantize", "--model", tiny, "--out", str(d), "--codec", "trellis-e4m3",
                    "--bits", "3", "--threads", str(THREADS)], check=True, capture_output=True)
    return str(d)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    d = tmp_path_factory.mktemp("texts")
    (d / "a.txt").write_text(text_a(120))
    (d / "b.txt").write_text(text_b(80))
    return [d / "a.txt", d / "b.txt"]


@pytest.fixture(scope="module")
def served(tiny, k3, texts, tmp_path_factory):
    """The K3 build in its serving formats: (summary, records, outdir)."""
    out = tmp_path_factory.mktemp("served")
    return (*evaluate(tiny, k3, texts, out), out)


@pytest.fixture(scope="module")
def weights_only(tiny, k3, texts, tmp_path_factory):
    """The same build, weights only (F32 activations): (summary, records, outdir)."""
    out = tmp_path_factory.mktemp("weights-only")
    return (*evaluate(tiny, k3, texts, out, "--model-set",
                      "codec.trellis-e4m3.activations=f32"), out)


# --- the sanity checks -------------------------------------------------------------------------

def test_teacher_against_itself_is_exactly_zero(tiny, texts, tmp_path):
    summary, records = evaluate(tiny, tiny, texts, tmp_path)
    assert len(records) == 2 * MAX_WINDOWS * (WINDOW - 1)
    assert all(r["kld"] == 0.0 and r["teacher_top1"] == r["model_top1"] for r in records)
    assert all(r["teacher_logp"] == r["model_logp"] for r in records)
    h = summary["headline"]
    assert h["kld"] == {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    assert h["top1"]["rate"] == 1.0 and h["top1"]["hi"] == 1.0
    assert summary["calibration"] is None  # muse-tiny is no tmx quantize build


def test_two_runs_are_bit_identical(tiny, k3, texts, served, tmp_path):
    evaluate(tiny, k3, texts, tmp_path)
    out = served[2]
    assert (tmp_path / "summary.json").read_bytes() == (out / "summary.json").read_bytes()
    assert (tmp_path / "tokens.jsonl").read_bytes() == (out / "tokens.jsonl").read_bytes()


def window_ids(records, w):
    rows = sorted((r for r in records if r["window"] == w), key=lambda r: r["row"])
    return [r["input"] for r in rows] + [rows[-1]["target"]], rows


def test_scoring_matches_numpy_float64(tiny, k3, served):
    """Logits through tmx_engine.py (same engine settings as the command), KL in float64 by
    numpy on sampled rows of two windows, against the per-token records."""
    _, records, _ = served
    overrides = [f"context={WINDOW}", "max_running=1", "prefix_cache=false",
                 f"threads={THREADS}"]
    rng = np.random.default_rng(0)
    with Engine(tiny, overrides) as te, Engine(k3, overrides) as me:
        for w in (0, MAX_WINDOWS + 1):  # one window of each source
            ids, rows = window_ids(records, w)
            assert len(ids) == WINDOW and ids[0] == rows[0]["input"]
            ts, ms = te.seq(WINDOW), me.seq(WINDOW)
            tl = ts.forward(ids).astype(np.float64)
            ml = ms.forward(ids).astype(np.float64)
            ts.close()
            ms.close()
            for row in sorted(rng.choice(WINDOW - 1, 8, replace=False)):
                lp = tl[row] - tl[row].max()
                lp -= np.log(np.exp(lp).sum())
                lq = ml[row] - ml[row].max()
                lq -= np.log(np.exp(lq).sum())
                kl = float(np.sum(np.exp(lp) * (lp - lq)))
                rec = rows[row]
                assert rec["kld"] == pytest.approx(kl, rel=1e-9, abs=1e-12)
                assert rec["teacher_top1"] == int(np.argmax(tl[row]))
                assert rec["model_top1"] == int(np.argmax(ml[row]))
                assert rec["teacher_logp"] == pytest.approx(lp[ids[row + 1]], rel=1e-9)
                assert rec["model_logp"] == pytest.approx(lq[ids[row + 1]], rel=1e-9)


# --- the statistics ----------------------------------------------------------------------------

M64 = (1 << 64) - 1


def splitmix64(state):
    while True:
        state = (state + 0x9E3779B97F4A7C15) & M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        yield z ^ (z >> 31)


def ncdf(x):
    return 0.5 * math.erfc(-x / math.sqrt(2))


def nquantile(p):
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        lo, hi = (mid, hi) if ncdf(mid) < p else (lo, mid)
    return 0.5 * (lo + hi)


def bca(sums, rows, resamples, seed, level=0.95):
    """tmx_eval_bootstrap in Python: the same draws, sums in the same order."""
    n, S, R = len(sums), sum(sums), sum(rows)
    est = S / R
    if n == 1:
        return est, est, est
    jk = [(S - s) / (R - r) for s, r in zip(sums, rows)]
    m = sum(jk) / n
    den = sum((m - j) ** 2 for j in jk)
    a = sum((m - j) ** 3 for j in jk) / (6 * den ** 1.5) if den > 0 else 0.0
    draws, theta = splitmix64(seed), []
    for _ in range(resamples):
        s = r = 0.0
        for _ in range(n):
            i = ((next(draws) >> 32) * n) >> 32
            s += sums[i]
            r += rows[i]
        theta.append(s / r)
    edge = 0.5 / resamples
    p0 = (sum(t < est for t in theta) + sum(t <= est for t in theta)) / (2 * resamples)
    z0 = nquantile(min(max(p0, edge), 1 - edge))
    theta.sort()
    ends = []
    for k, tail in enumerate((0.5 * (1 - level), 1 - 0.5 * (1 - level))):
        z = z0 + nquantile(tail)
        q = ncdf(z0 + z / (1 - a * z)) if 1 - a * z > 0 else k
        pos = q * (resamples - 1)
        i = math.floor(pos)
        ends.append(theta[-1] if i >= resamples - 1 else theta[0] if i < 0 else
                    theta[i] + (pos - i) * (theta[i + 1] - theta[i]))
    return est, ends[0], ends[1]


def wilson(k, n, z=Z95):
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, c - h), min(1.0, c + h)


def test_summary_recomputed_from_records(served):
    summary, records, _ = served
    assert summary["window"] == WINDOW and summary["resamples"] == 5000
    wins = summary["windows"]
    assert len(wins) == 2 * MAX_WINDOWS and all(w["headline"] for w in wins)
    sums, rows, agree = [0.0] * len(wins), [0] * len(wins), 0
    for r in records:  # file order: window by window, row by row, as the command sums
        sums[r["window"]] += r["kld"]
        rows[r["window"]] += 1
        agree += r["teacher_top1"] == r["model_top1"]
    est, lo, hi = bca(sums, rows, 5000, summary["seed"])
    h = summary["headline"]
    assert h["rows"] == len(records) and h["windows"] == len(wins)
    assert h["kld"]["mean"] == pytest.approx(est, rel=1e-12)
    assert h["kld"]["lo"] == pytest.approx(lo, rel=1e-12)
    assert h["kld"]["hi"] == pytest.approx(hi, rel=1e-12)
    assert lo < est < hi
    assert h["top1"]["agree"] == agree
    assert (h["top1"]["lo"], h["top1"]["hi"]) == pytest.approx(wilson(agree, len(records)))
    # by source: the first MAX_WINDOWS windows are a.txt's
    for s, g in enumerate(summary["by_source"]):
        sel = slice(s * MAX_WINDOWS, (s + 1) * MAX_WINDOWS)
        assert g["source"].endswith("ab"[s] + ".txt")
        assert g["kld"]["mean"] == pytest.approx(sum(sums[sel]) / sum(rows[sel]), rel=1e-12)
    assert summary["by_position"] == [{**h, "positions": [0, WINDOW - 1]}]
    # the NLLs, with the same bootstrap over their per-window sums
    for side in ("teacher", "model"):
        nll = [0.0] * len(wins)
        for r in records:
            nll[r["window"]] -= r[f"{side}_logp"]
        est, lo, hi = bca(nll, rows, 5000, summary["seed"])
        assert h["nll"][side] == pytest.approx({"mean": est, "lo": lo, "hi": hi}, rel=1e-12)
        assert lo < est < hi


def test_weights_only_reaches_the_model_only(tiny, k3, texts, served, weights_only):
    summary, records, _ = weights_only
    assert summary["model"]["overrides"] == ["codec.trellis-e4m3.activations=f32"]
    assert summary["teacher"]["overrides"] == []
    serving = served[0]["headline"]["kld"]["mean"]
    weights = summary["headline"]["kld"]["mean"]
    assert 0 < weights != serving > 0
    # the teacher side is untouched: its log-probabilities are those of the serving run
    assert [r["teacher_logp"] for r in records] == [r["teacher_logp"] for r in served[1]]
    # each engine's own overrides reach it alone: a context shorter than the window is an
    # error of that engine
    for flag in ("--teacher", "--model"):
        r = run("--teacher", tiny, "--model", k3, "--text", str(texts[0]), "--window", "16",
                flag + "-set", "context=8", check=False)
        assert r.returncode != 0
        assert r.stderr.startswith(f"tmx eval-kld: {flag} ") and "context 8" in r.stderr


def paired(a, b, out):
    r = run("--paired", str(a), "--paired", str(b), "--out", str(out))
    with open(out / "paired.json") as f:
        return json.load(f), r.stdout


def test_paired_recomputed_from_both_runs(served, weights_only, tmp_path):
    """Serving formats (A) against weights only (B) on the same rows: A - B and A / B with the
    bootstrap of tmx_eval_bootstrap over per-window sums, overall, by source and by position."""
    p, out = paired(served[2], weights_only[2], tmp_path)
    assert p["a"] == str(served[2]) and p["b"] == str(weights_only[2])
    assert p["b_model"]["overrides"] == ["codec.trellis-e4m3.activations=f32"]
    n = len(served[0]["windows"])
    ka, kb, rows = [0.0] * n, [0.0] * n, [0] * n
    for ra, rb in zip(served[1], weights_only[1]):
        ka[ra["window"]] += ra["kld"]
        kb[rb["window"]] += rb["kld"]
        rows[ra["window"]] += 1
    diff = [x - y for x, y in zip(ka, kb)]

    def check(g, sel):
        est, lo, hi = bca([diff[i] for i in sel], [rows[i] for i in sel], 5000, 0)
        assert g["difference"] == pytest.approx({"mean": est, "lo": lo, "hi": hi}, rel=1e-9)
        est, lo, hi = bca([ka[i] for i in sel], [kb[i] for i in sel], 5000, 0)
        assert g["ratio"] == pytest.approx({"mean": est, "lo": lo, "hi": hi}, rel=1e-9)
        assert g["a"]["kld"] == pytest.approx(sum(ka[i] for i in sel) / sum(rows[i] for i in sel))
        assert g["b"]["kld"] == pytest.approx(sum(kb[i] for i in sel) / sum(rows[i] for i in sel))

    h = p["headline"]
    assert h["windows"] == n and h["rows"] == len(served[1])
    check(h, range(n))
    assert h["a"]["kld"] == served[0]["headline"]["kld"]["mean"]
    assert h["a"]["top1"] == served[0]["headline"]["top1"]["rate"]
    for s, g in enumerate(p["by_source"]):
        check(g, range(s * MAX_WINDOWS, (s + 1) * MAX_WINDOWS))
    assert p["by_position"] == [{**h, "positions": [0, WINDOW - 1]}]
    assert out.splitlines()[0] == f"A: {served[2]}" and "headline (both)" in out


def test_paired_against_the_teacher_has_no_ratio(tiny, texts, served, tmp_path):
    """B = the teacher scored against itself: A - B is A's KLD, A / B is undefined."""
    evaluate(tiny, tiny, texts, tmp_path / "self")
    p, _ = paired(served[2], tmp_path / "self", tmp_path / "p")
    assert p["headline"]["ratio"] is None
    assert p["headline"]["b"]["kld"] == 0.0
    assert p["headline"]["difference"]["mean"] == pytest.approx(
        served[0]["headline"]["kld"]["mean"], rel=1e-12)


def test_paired_refuses_runs_of_other_rows(tiny, k3, texts, served, tmp_path):
    fewer = tmp_path / "fewer"
    run("--teacher", tiny, "--model", k3, "--text", str(texts[0]), "--text", str(texts[1]),
        "--window", str(WINDOW), "--max-windows", str(MAX_WINDOWS - 1), "--out", str(fewer))
    other = tmp_path / "other"  # the same windows' shape over another text
    run("--teacher", tiny, "--model", k3, "--text", str(texts[1]), "--text", str(texts[0]),
        "--window", str(WINDOW), "--max-windows", str(MAX_WINDOWS), "--out", str(other))
    cases = [
        (["--paired", str(served[2])], "two run folders"),
        (["--paired", str(served[2]), "--paired", str(fewer)], "not the same windows"),
        (["--paired", str(served[2]), "--paired", str(other)], str(other)),
        (["--paired", str(served[2]), "--paired", str(tmp_path / "absent")], "absent"),
        (["--paired", str(served[2]), "--paired", str(served[2]), "--teacher", tiny],
         "no --teacher"),
    ]
    assert_one_line_errors(cases, "tmx eval-kld: --paired")


def test_calibration_overlap_leaves_windows_out(tiny, k3, texts, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text(texts[0].read_text())  # a.txt was the calibration text
    summary, _ = evaluate(tiny, k3, texts, tmp_path / "out", "--calib", str(calib))
    wins = summary["windows"]
    assert [w["headline"] for w in wins] == [False] * MAX_WINDOWS + [True] * MAX_WINDOWS
    assert all(w["overlap"] == 1.0 for w in wins[:MAX_WINDOWS])
    assert all(w["overlap"] <= 0.05 for w in wins[MAX_WINDOWS:])
    assert summary["left_out"]["windows"] == MAX_WINDOWS
    assert summary["headline"]["windows"] == MAX_WINDOWS
    assert summary["by_source"][0]["rows"] == 0  # a.txt is all left out
    assert summary["all"]["rows"] == summary["headline"]["rows"] + summary["left_out"]["rows"]
    assert summary["calibration"]["text"]["source"] == str(calib)


def test_default_calibration_is_the_builds(served):
    cal = served[0]["calibration"]
    assert cal["text"]["source"] == "built-in"  # quantize-report.json of the build says so
    assert cal["text"]["named_by"].endswith("quantize-report.json")
    assert cal["text"]["tokens"] > 1000 and cal["ngram"] == 13 and cal["max_overlap"] == 0.05


def test_position_buckets_and_window_cap(tiny, k3, tmp_path):
    text = tmp_path / "long.txt"
    text.write_text(text_a(200) + text_b(200))
    r = run("--teacher", tiny, "--model", k3, "--text", str(text), "--window", "300",
            "--max-windows", "2", "--threads", str(THREADS), "--out", str(tmp_path / "o"))
    summary, _ = load(tmp_path / "o")
    pos = summary["by_position"]
    assert [p["positions"] for p in pos] == [[0, 256], [256, 299]]
    assert [p["rows"] for p in pos] == [2 * 256, 2 * 43]
    total = sum(p["kld"]["mean"] * p["rows"] for p in pos)
    assert total / summary["headline"]["rows"] == pytest.approx(summary["headline"]["kld"]["mean"])
    assert "positions 256-299" in r.stdout
    # muse-tiny holds 1,024 positions: a longer window is cut to that
    run("--teacher", tiny, "--model", tiny, "--text", str(text), "--window", "5000",
        "--max-windows", "1", "--out", str(tmp_path / "cap"))
    assert load(tmp_path / "cap")[0]["window"] == 1024


def test_plot(served, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "kld.png"
    subprocess.run([sys.executable, str(ROOT / "tools" / "plot_kld.py"), str(served[2]), "-o",
                    str(png)], check=True, capture_output=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- bad input ---------------------------------------------------------------------------------

def test_bad_input_is_one_line_naming_the_flag_or_file(tiny, texts, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    t = str(texts[0])
    base = ["--teacher", tiny, "--model", tiny]
    cases = [
        ([], "--teacher"),
        (["--teacher", tiny], "--model"),
        (base, "--text"),
        (base + ["--text", str(tmp_path / "absent.txt")], "absent.txt"),
        (base + ["--text", t, "--window", "1"], "--window"),
        (base + ["--text", t, "--window", "x"], "--window"),
        (base + ["--text", t, "--max-windows", "0"], "--max-windows"),
        (base + ["--text", t, "--resamples", "0"], "--resamples"),
        (base + ["--text", t, "--resamples", "4294967297"], "--resamples"),
        (base + ["--text", t, "--window", "2.5"], "--window"),
        (base + ["--text", t, "--seed", "-3"], "--seed"),
        (base + ["--text", str(short), "--window", "64"], "short.txt"),
        (base + ["--text", t, "--calib", str(tmp_path / "nocalib.txt")], "nocalib.txt"),
        (base + ["--text", t, "--window", "16", "--out", str(tmp_path / "no" / "dir")], "--out"),
        (["--teacher", str(tmp_path / "nomodel"), "--model", tiny, "--text", t], "nomodel"),
        (["--teacher", tiny, "--model", str(tmp_path / "nomodel"), "--text", t], "--model"),
        (base + ["--text", t, "stray"], "stray"),
    ]
    assert_one_line_errors(cases, "tmx eval-kld: ")


# --- the output folder -------------------------------------------------------------------------

def test_interrupted_run_keeps_the_earlier_results(tiny, k3, served, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(served[2], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    long = tmp_path / "long.txt"
    long.write_text(text_a(4000))  # hundreds of windows: still running at the first
    p = subprocess.Popen([TMX, "eval-kld", "--teacher", tiny, "--model", k3, "--text", str(long),
                          "--window", str(WINDOW), "--threads", str(THREADS), "--out", str(out)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        if "window 2/" in line:
            p.send_signal(signal.SIGINT)
            break
    p.communicate()
    assert p.returncode == -signal.SIGINT
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.suffix != ".tmp"} == before


def test_out_over_inputs_or_in_a_model_is_refused(tiny, k3, texts, served, tmp_path):
    out = tmp_path / "E2"
    shutil.copytree(served[2], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    models = {d: sorted(os.listdir(d)) for d in (tiny, k3)}
    base = ["--teacher", tiny, "--model", k3, "--window", str(WINDOW), "--max-windows", "1"]
    t = ["--text", str(texts[0])]
    cases = [
        (base + ["--text", str(out / "tokens.jsonl"), "--out", str(out)],
         f"writing {out}/tokens.jsonl would replace --text {out}/tokens.jsonl"),
        (base + t + ["--calib", str(out / "summary.json"), "--out", str(out)],
         "would replace --calib"),
        (base + t + ["--out", k3], f"--out {k3}: is the --model folder {k3}"),
        (base + t + ["--out", tiny], f"--out {tiny}: is the --teacher folder {tiny}"),
        (base + t + ["--out", os.path.join(k3, "experts")], "--model folder"),
    ]
    assert_one_line_errors(cases, "tmx eval-kld: --out")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert {d: sorted(os.listdir(d)) for d in (tiny, k3)} == models
