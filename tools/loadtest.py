#!/usr/bin/env python3
"""Load test for `tmx serve`: many concurrent streaming chat clients, every stream checked.

    loadtest.py --model DIR [--tmx build/bin/tmx] [--set KEY=VALUE ...] [--threads N]
    loadtest.py --url http://127.0.0.1:8010
      [--clients 64] [--requests 4] [--seed 0] [--json OUT.json] [--md OUT.md]

Starts `tmx serve` on a free port (or uses --url), waits for /health, then runs --clients
threads, each sending --requests streaming chat completions one after another through the
official openai client (raw SSE lines, so that `data: [DONE]` itself is seen). The requests mix
prompt lengths, max_tokens, greedy and sampled decoding, with and without
stream_options.include_usage; all set ignore_eos, so each must end with finish_reason "length"
after exactly max_tokens tokens.

Every stream is checked: each line is `data: <json>` or blank, chunks parse and share one id, one
finish_reason arrives, a usage chunk comes last exactly when asked for (with the right counts),
the last data line is `data: [DONE]`. Across the run: every planned request was answered once
(response ids unique), and the server's /metrics counters moved by as many requests and tokens
as the clients saw. Reported: generated tokens/s overall, client-side TTFT, inter-chunk latency
and time per output token (p50/p99), and the server's own histograms. Exit status 0 when every
check passed.

A server this script started is stopped with SIGINT at the end; its output goes to --server-log,
which is scanned for sanitizer reports (AddressSanitizer, LeakSanitizer, UBSan runtime errors).
"""
import argparse
import datetime
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import openai

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

# --- the workload -----------------------------------------------------------------------------

SYSTEM = "You are a helpful assistant taking part in a load test. Answer at length."
WORDS = ("the of and to in is was for on that with as by at from his her an which were this be "
         "river mountain engine token cache kernel expert router memory thread stream socket "
         "paper window garden winter summer question answer number letter reason season moment "
         "quickly slowly gently loudly brightly darkly softly clearly simply wholly").split()
# (name, words in the user message, how many distinct prompts of this kind): repeats of a
# prompt exercise the prefix cache, as does the shared system message.
PROMPT_KINDS = (("short", 8, 4), ("medium", 60, 4), ("long", 200, 2))
MAX_TOKENS = (16, 32, 64, 128, 256)


def make_plan(clients, requests, seed, sampled_frac, usage_frac):
    """[client][i] -> request spec; deterministic in seed."""
    rng = random.Random(seed)
    prompts = {name: [" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."
                      for _ in range(k)]
               for name, n, k in PROMPT_KINDS}
    plan = []
    for c in range(clients):
        row = []
        for i in range(requests):
            kind = rng.choice(PROMPT_KINDS)[0]
            spec = {"client": c, "index": i, "kind": kind,
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": rng.choice(prompts[kind])}],
                    "max_tokens": rng.choice(MAX_TOKENS),
                    "include_usage": rng.random() < usage_frac}
            if rng.random() < sampled_frac:
                spec.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 31))
            else:
                spec.update(temperature=0.0)
            row.append(spec)
        plan.append(row)
    return plan


# --- one streamed request ---------------------------------------------------------------------

def run_request(client, model, spec):
    """Sends spec, reads its stream line by line and checks it. Returns a result record: times
    are seconds from sending; errors lists what was wrong (empty: the stream was fine)."""
    r = {"client": spec["client"], "index": spec["index"], "kind": spec["kind"],
         "max_tokens": spec["max_tokens"], "sampled": spec["temperature"] > 0,
         "include_usage": spec["include_usage"], "errors": [], "status": None, "id": None,
         "finish_reason": None, "usage": None, "chunk_times": [], "done": False}
    extra = {"ignore_eos": True}
    if "seed" in spec:
        extra["seed"] = spec["seed"]
    kw = dict(model=model, messages=spec["messages"], max_tokens=spec["max_tokens"],
              temperature=spec["temperature"], stream=True, extra_body=extra)
    if "top_p" in spec:
        kw["top_p"] = spec["top_p"]
    if spec["include_usage"]:
        kw["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    r["start"] = t0
    try:
        with client.chat.completions.with_streaming_response.create(**kw) as resp:
            r["status"] = resp.http_response.status_code
            read_stream(resp.iter_lines(), t0, r)
    except openai.APIStatusError as e:
        r["status"] = e.status_code
        r["errors"].append(f"HTTP {e.status_code}: {str(e)[:200]}")
    except Exception as e:  # a broken connection, a timeout: the request is lost, say why
        r["errors"].append(f"{type(e).__name__}: {str(e)[:200]}")
    r["end"] = time.perf_counter()
    if r["status"] == 200 and not r["errors"]:
        check_result(spec, r)
    return r


def read_stream(lines, t0, r):
    """Parses the SSE lines into r: content chunk times, finish_reason, usage, [DONE]."""
    err = r["errors"]
    usage_seen = 0
    for line in lines:
        now = time.perf_counter() - t0
        if line == "":
            continue
        if not line.startswith("data: "):
            err.append(f"not an SSE data line: {line[:80]!r}")
            continue
        data = line[len("data: "):]
        if r["done"]:
            err.append(f"data after [DONE]: {data[:80]!r}")
            continue
        if data == "[DONE]":
            r["done"] = True
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            err.append(f"chunk does not parse: {data[:80]!r}")
            continue
        if "error" in chunk:
            err.append(f"error event: {json.dumps(chunk['error'])[:200]}")
            continue
        if chunk.get("object") != "chat.completion.chunk":
            err.append(f"object is {chunk.get('object')!r}")
        if r["id"] is None:
            r["id"] = chunk.get("id")
        elif chunk.get("id") != r["id"]:
            err.append("chunk ids differ within one stream")
        if usage_seen:
            err.append("a chunk after the usage chunk")
        if chunk.get("usage") is not None:
            usage_seen += 1
            r["usage"] = chunk["usage"]
            if chunk.get("choices"):
                err.append("the usage chunk has choices")
        elif "usage" in chunk and not r["include_usage"]:
            err.append("usage key present though include_usage was not asked")
        for ch in chunk.get("choices") or []:
            if ch.get("index") != 0:
                err.append(f"choice index {ch.get('index')}")
            if r["finish_reason"] is not None:
                err.append("a choice chunk after finish_reason")
            if (ch.get("delta") or {}).get("content"):
                r["chunk_times"].append(now)
            if ch.get("finish_reason") is not None:
                r["finish_reason"] = ch["finish_reason"]
    if not r["done"]:
        err.append("the stream did not end with data: [DONE]")


def check_result(spec, r):
    err = r["errors"]
    if r["finish_reason"] is None:
        err.append("no finish_reason")
    elif r["finish_reason"] != "length":
        err.append(f"finish_reason {r['finish_reason']!r} (ignore_eos: expected 'length')")
    if r["id"] is None:
        err.append("no chunk carried an id")
    if spec["include_usage"]:
        u = r["usage"]
        if u is None:
            err.append("include_usage asked but no usage chunk")
        elif (u.get("completion_tokens") != spec["max_tokens"] or
              u.get("total_tokens") != u.get("prompt_tokens", 0) + u.get("completion_tokens", 0)
              or not u.get("prompt_tokens", 0) > 0):
            err.append(f"usage {u} (max_tokens {spec['max_tokens']})")
    elif r["usage"] is not None:
        err.append("a usage chunk though include_usage was not asked")
    if not r["chunk_times"]:
        err.append("no content arrived")


# --- the server and its metrics ---------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`tmx serve` started by this script; its output goes to log_path."""

    def __init__(self, tmx, model, settings, threads, log_path, start_timeout):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w+")
        self.args = [tmx, "serve", "--model", model, "--port", str(self.port)]
        for s in settings:
            self.args += ["--set", s]
        if threads:
            self.args += ["--threads", str(threads)]
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        wait_health(self.url, start_timeout, self.proc)

    def stop(self, timeout=120):
        """SIGINT, as a user would; returns the exit status and the sanitizer report lines."""
        self.proc.send_signal(signal.SIGINT)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        with open(self.log_path, errors="replace") as f:
            text = f.read()
        return rc, sanitizer_lines(text)


def sanitizer_lines(text):
    """The lines of a server log that sanitizers write: reports, their summaries, leak stacks."""
    keep = re.compile(r"(==\d+==|SUMMARY:|runtime error:|LeakSanitizer|AddressSanitizer|"
                      r"^\s+#\d+ 0x|^Direct leak|^Indirect leak)")
    return [ln for ln in text.splitlines() if keep.search(ln)]


def wait_health(url, timeout, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            sys.exit(f"tmx serve exited with {proc.returncode} before /health answered")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    sys.exit(f"{url}/health did not answer within {timeout} s")


def cpu_seconds(server):
    """CPU time (user + system) of this script and of the server it started: on a machine with
    few cores the clients compete with the server, and this says how much."""
    t = os.times()
    out = {"clients": t.user + t.system, "server": None}
    if server:
        with open(f"/proc/{server.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out["server"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def get(url, path, api_key):
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()


METRIC = re.compile(r'^tmx:([a-z_]+)(?:\{(.*)\})? (\S+)$')


def parse_metrics(text):
    """{name: value} for plain samples, {name: {label-suffix: value}} for labelled ones beyond
    model_name (finished_reason, le)."""
    out = {}
    for line in text.splitlines():
        m = METRIC.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        extra = [kv for kv in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels)
                 if kv[0] != "model_name"]
        if extra:
            out.setdefault(name, {})[extra[0][1]] = value
        else:
            out[name] = value
    return out


def metrics_delta(before, after):
    """Counters and histograms as after - before; gauges as after."""
    out = {}
    for name, v in after.items():
        b = before.get(name)
        if name.startswith(("num_requests_", "kv_cache_usage")):
            out[name] = v
        elif isinstance(v, dict):
            out[name] = {k: x - (b or {}).get(k, 0.0) for k, x in v.items()}
        else:
            out[name] = v - (b or 0.0)
    return out


def histogram_summary(m, name):
    """count, mean and p50/p99 of a server histogram, the quantiles interpolated inside buckets
    as Prometheus' histogram_quantile does (so no finer than the bucket bounds)."""
    buckets = m.get(name + "_bucket", {})
    bounds = sorted((math.inf if k == "+Inf" else float(k), v) for k, v in buckets.items())
    count = m.get(name + "_count", 0.0)
    out = {"count": int(count), "mean": m.get(name + "_sum", 0.0) / count if count else None,
           "buckets": {("+Inf" if b == math.inf else f"{b:g}"): int(v) for b, v in bounds}}
    for q in (0.5, 0.99):
        v, beyond = bucket_quantile(bounds, count, q)
        out[f"p{int(q * 100)}"] = v
        if beyond:  # in the +Inf bucket: v is the last finite bound, a lower limit
            out.setdefault("beyond_last_bucket", []).append(f"p{int(q * 100)}")
    return out


def bucket_quantile(bounds, count, q):
    """(value, whether it lies beyond the last finite bound)."""
    if not count:
        return None, False
    rank, lo, below = q * count, 0.0, 0.0
    for hi, cum in bounds:
        if cum >= rank:
            if hi == math.inf:
                return lo, True
            return (lo + (hi - lo) * (rank - below) / (cum - below) if cum > below else hi,
                    False)
        lo, below = hi, cum
    return lo, True


# --- the run ----------------------------------------------------------------------------------

def percentile(xs, q):
    """Linear interpolation between closest ranks; None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    i = int(pos)
    return xs[i] if i + 1 >= len(xs) else xs[i] + (xs[i + 1] - xs[i]) * (pos - i)


def run_clients(url, api_key, model, plan, timeout):
    """Runs each plan row on its own thread, all starting together; results in plan order.
    Meanwhile samples the server's gauges every half second: their peaks."""
    results = [[None] * len(row) for row in plan]
    start = threading.Barrier(len(plan))
    peaks = {"num_requests_running": 0.0, "num_requests_waiting": 0.0,
             "kv_cache_usage_perc": 0.0}
    finished = threading.Event()

    def sampler():
        while not finished.wait(0.5):
            try:
                m = parse_metrics(get(url, "/metrics", api_key))
            except OSError:
                continue
            for k in peaks:
                peaks[k] = max(peaks[k], m.get(k, 0.0))

    def worker(c):
        client = openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0,
                               timeout=timeout)
        start.wait()
        for i, spec in enumerate(plan[c]):
            results[c][i] = run_request(client, model, spec)
        client.close()

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(len(plan))]
    watcher = threading.Thread(target=sampler)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    finished.set()
    watcher.join()
    return results, peaks


def summarize(plan, results, before, after):
    flat = [r for row in results for r in row]
    planned = sum(len(row) for row in plan)
    ok = [r for r in flat if r is not None and not r["errors"]]
    failed = [r for r in flat if r is not None and r["errors"]]
    # Tokens: the usage chunk's count where asked; otherwise max_tokens, which a stream that
    # ended with "length" under ignore_eos must have produced (the server counter checks it).
    gen = sum(r["usage"]["completion_tokens"] if r["usage"] else r["max_tokens"] for r in ok)
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok if r["usage"])
    t_first = min(r["start"] for r in flat if r)
    t_last = max(r["end"] for r in flat if r)
    wall = t_last - t_first
    ttft = [r["chunk_times"][0] for r in ok]
    gaps = [b - a for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    tpot = [(r["chunk_times"][-1] - r["chunk_times"][0]) / (r["max_tokens"] - 1)
            for r in ok if r["max_tokens"] > 1]
    latency = [r["end"] - r["start"] for r in ok]
    m = metrics_delta(before, after)
    finished = sum(m.get("request_success_total", {}).values()) + m.get("request_failure_total",
                                                                          0)
    ids = [r["id"] for r in flat if r and r["id"]]
    accepted = [r for r in flat if r and r["status"] == 200]
    checks = {
        "every planned request answered once": len(flat) == planned and None not in flat,
        "every stream well-formed and complete": not failed,
        "response ids unique": len(ids) == len(set(ids)),
        "server finished as many requests as it accepted": finished == len(accepted),
        "server generated exactly as many tokens": m.get("generation_tokens_total") == gen,
    }
    ms = lambda x: None if x is None else round(x * 1000, 2)
    return {
        "requests": {"planned": planned, "ok": len(ok), "failed": len(failed),
                     "server_finished": finished,
                     "by_status": count_by(flat, "status"),
                     "sampled": sum(r["sampled"] for r in ok),
                     "with_usage": sum(r["include_usage"] for r in ok)},
        "wall_s": round(wall, 3),
        "tokens": {"generated": gen, "prompt_with_usage": prompt,
                   "server_generated": m.get("generation_tokens_total"),
                   "server_prompt": m.get("prompt_tokens_total")},
        "throughput": {"generated_tok_s": round(gen / wall, 1),
                       "requests_s": round(len(ok) / wall, 2)},
        "client_ms": {
            "ttft_p50": ms(percentile(ttft, 0.5)), "ttft_p99": ms(percentile(ttft, 0.99)),
            "itl_p50": ms(percentile(gaps, 0.5)), "itl_p99": ms(percentile(gaps, 0.99)),
            "tpot_p50": ms(percentile(tpot, 0.5)), "tpot_p99": ms(percentile(tpot, 0.99)),
            "latency_p50": ms(percentile(latency, 0.5)),
            "latency_p99": ms(percentile(latency, 0.99))},
        "server": {
            "ttft_s": histogram_summary(m, "time_to_first_token_seconds"),
            "itl_s": histogram_summary(m, "inter_token_latency_seconds"),
            "finished_by_reason": m.get("request_success_total", {}),
            "failures": m.get("request_failure_total"),
            "prefix_cache_queries": m.get("prefix_cache_queries_total"),
            "prefix_cache_hits": m.get("prefix_cache_hits_total"),
            "preemptions": m.get("num_preemptions_total"),
            "kv_cache_usage_after": m.get("kv_cache_usage_perc"),
            "running_after": m.get("num_requests_running"),
            "waiting_after": m.get("num_requests_waiting")},
        "checks": checks,
        "errors": [{"client": r["client"], "index": r["index"], "errors": r["errors"][:5]}
                   for r in failed[:20]],
    }


def count_by(rs, key):
    out = {}
    for r in rs:
        k = str(r[key]) if r else "none"
        out[k] = out.get(k, 0) + 1
    return out


def fmt(x, unit=""):
    if x is None:
        return "-"
    if isinstance(x, float):
        x = f"{int(x):,}" if x.is_integer() else f"{x:.4g}" if abs(x) < 1 else f"{x:,.1f}"
    return f"{x}{unit}"


def to_markdown(rep):
    s, c, sv = rep["summary"], rep["summary"]["client_ms"], rep["summary"]["server"]
    pk = rep["server_peaks"]
    q = s["requests"]
    sec = lambda h, k: "-" if h[k] is None else (
        (">" if k in h.get("beyond_last_bucket", ()) else "") + f"{h[k] * 1000:.2f}")
    rows = [
        ("model", rep["model"]),
        ("clients × requests", f"{rep['clients']} × {rep['requests_per_client']}"),
        ("server settings", " ".join(rep["settings"]) or "defaults"),
        ("requests ok / planned", f"{q['ok']} / {q['planned']} ({q['sampled']} sampled, "
                                  f"{q['with_usage']} with usage)"),
        ("wall time", fmt(s["wall_s"], " s")),
        ("CPU time during the run", ", ".join(f"{k} {v:.1f} s" for k, v in
                                              rep["cpu_s"].items())),
        ("generated tokens", f"{s['tokens']['generated']} (server counter "
                             f"{fmt(s['tokens']['server_generated'])})"),
        ("**throughput**", f"**{fmt(s['throughput']['generated_tok_s'])} generated tok/s**, "
                           f"{fmt(s['throughput']['requests_s'])} req/s"),
        ("TTFT p50 / p99 (client)", f"{fmt(c['ttft_p50'])} / {fmt(c['ttft_p99'])} ms"),
        ("inter-chunk latency p50 / p99 (client)", f"{fmt(c['itl_p50'])} / "
                                                   f"{fmt(c['itl_p99'])} ms"),
        ("time per output token p50 / p99 (client)", f"{fmt(c['tpot_p50'])} / "
                                                     f"{fmt(c['tpot_p99'])} ms"),
        ("request latency p50 / p99 (client)", f"{fmt(c['latency_p50'])} / "
                                               f"{fmt(c['latency_p99'])} ms"),
        ("TTFT p50 / p99 / mean (server histogram)",
         f"{sec(sv['ttft_s'], 'p50')} / {sec(sv['ttft_s'], 'p99')} / "
         f"{sec(sv['ttft_s'], 'mean')} ms (n={sv['ttft_s']['count']})"),
        ("ITL p50 / p99 / mean (server histogram)",
         f"{sec(sv['itl_s'], 'p50')} / {sec(sv['itl_s'], 'p99')} / "
         f"{sec(sv['itl_s'], 'mean')} ms (n={sv['itl_s']['count']})"),
        ("prefix cache hits / queries (tokens)", f"{fmt(sv['prefix_cache_hits'])} / "
                                                 f"{fmt(sv['prefix_cache_queries'])}"),
        ("preemptions", fmt(sv["preemptions"])),
        ("peak running / waiting / KV usage (sampled every 0.5 s)",
         f"{fmt(pk['num_requests_running'])} / {fmt(pk['num_requests_waiting'])} / "
         f"{pk['kv_cache_usage_perc']:.1%}"),
        ("finished by reason (server)", ", ".join(f"{k} {int(v)}" for k, v in
                                                  sv["finished_by_reason"].items())),
    ]
    if "server_exit" in rep:
        ex = rep["server_exit"]
        rows.append(("server exit (SIGINT)", f"status {ex['status']}, "
                     f"{len(ex['sanitizer_lines'])} sanitizer report lines"))
    rows += [(f"check: {k}", "pass" if v else "**FAIL**") for k, v in s["checks"].items()]
    out = ["| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="model folder: start `tmx serve` on it")
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8010")
    ap.add_argument("--tmx", default=os.path.join(ROOT, "build", "bin", "tmx"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to tmx serve (repeatable)")
    ap.add_argument("--threads", type=int, help="passed to tmx serve")
    ap.add_argument("--server-log", help="tmx serve output (default: a file in /tmp)")
    ap.add_argument("--start-timeout", type=float, default=120)
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="per client, one after another")
    ap.add_argument("--sampled", type=float, default=0.25, help="fraction with temperature 0.8")
    ap.add_argument("--usage", type=float, default=0.75,
                    help="fraction asking stream_options.include_usage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--md", help="write the markdown table here")
    args = ap.parse_args()

    server = None
    if args.model:
        log = args.server_log or f"/tmp/tmx-loadtest-{os.getpid()}.log"
        server = Server(args.tmx, args.model, args.set, args.threads, log, args.start_timeout)
        url = server.url
    else:
        url = args.url.rstrip("/")
        wait_health(url, args.start_timeout)
    try:
        model = json.loads(get(url, "/v1/models", args.api_key))["data"][0]
        plan = make_plan(args.clients, args.requests, args.seed, args.sampled, args.usage)
        before = parse_metrics(get(url, "/metrics", args.api_key))
        cpu0 = cpu_seconds(server)
        results, peaks = run_clients(url, args.api_key, model["id"], plan, args.timeout)
        cpu1 = cpu_seconds(server)
        after = parse_metrics(get(url, "/metrics", args.api_key))
    except BaseException:
        if server:
            server.stop()
        raise
    rep = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": model["id"], "max_model_len": model.get("max_model_len"),
           "server_args": server.args if server else None, "url": None if server else url,
           "settings": args.set, "clients": args.clients, "requests_per_client": args.requests,
           "seed": args.seed, "summary": summarize(plan, results, before, after),
           "cpu_s": {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0 if cpu0[k] is not None},
           "server_peaks": peaks}
    if server:
        rc, lines = server.stop()
        rep["server_exit"] = {"status": rc, "log": server.log_path, "sanitizer_lines": lines}
    passed = all(rep["summary"]["checks"].values()) and (
        not server or (rc == 0 and not rep["server_exit"]["sanitizer_lines"]))
    rep["passed"] = passed
    md = to_markdown(rep)
    print(md)
    for e in rep["summary"]["errors"]:
        print(f"client {e['client']} request {e['index']}: {'; '.join(e['errors'])}",
              file=sys.stderr)
    if server and rep["server_exit"]["sanitizer_lines"]:
        print("\n".join(rep["server_exit"]["sanitizer_lines"][:60]), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
            f.write("\n")
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
