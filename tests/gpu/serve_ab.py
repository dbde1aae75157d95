"""tests/gpu/serve_ab.py: `tmx serve` on one kernel set against another, over HTTP.

Starts `tmx serve` twice on the same model and kernel set name: once as built (BIN), once with
TMX_PLUGIN_PATH=ALT, a folder holding another build of that set (an older commit's, say one
without an optional op). Each gets the same seeded completions, first one at a time, then all
at once (the server batches them), and the two must give the same texts; log probabilities
within 1e-4 (the sets may sum a softmax in another order). It also times the concurrent batch
(completion tokens over wall seconds, the median of --rounds batches, the two servers taking
turns so that the machine's drift falls on both). The requests mix logit bias, presence, frequency and
repetition penalties, log probabilities and plain sampling, so that the steps take every way
the server has. Standard library only, so that it runs on the bare GPU machine:

    python3 tests/gpu/serve_ab.py BIN ALT [--model DIR] [--kernels cuda] [--set KEY=VALUE]...
                                  [--rounds N] [--json OUT]

Prints one line a phase and exits 1 when a text differs.
"""
import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.request

PROMPTS = ["It was a dark and stormy night", "The king said", "Once upon a time",
           "In the beginning", "She opened the door and", "The ship sailed", "He wrote that",
           "At dawn the army"]
REQUESTS = [dict(temperature=0.8, top_p=0.95, seed=3, frequency_penalty=0.8,
                 presence_penalty=0.5),
            dict(temperature=1.0, seed=9, logit_bias={"13": 4.0, "11": -100}),
            dict(temperature=0.0, repetition_penalty=1.3),
            dict(temperature=0.7, seed=5, repetition_penalty=1.2, frequency_penalty=0.3,
                 logit_bias={"262": 2.0}),
            dict(temperature=0.9, seed=11, presence_penalty=1.0, logprobs=3),
            dict(temperature=0.6, seed=1),
            dict(temperature=0.0, frequency_penalty=1.5),
            dict(temperature=1.1, top_k=40, seed=21, repetition_penalty=1.1)]


def serve(args, env_extra, port):
    env = dict(os.environ, **env_extra)
    sets = [x for kv in [f"kernels={args.kernels}"] + args.set for x in ("--set", kv)]
    return subprocess.Popen([os.path.join(args.bin, "tmx"), "serve", "--model", args.model,
                             "--port", str(port)] + sets,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def complete(base, i):
    body = dict(REQUESTS[i], model="x", prompt=PROMPTS[i], max_tokens=48, ignore_eos=True)
    q = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(q, timeout=120))


def started(args, env_extra, port):
    """A server, once it answers /health, and its address."""
    p = serve(args, env_extra, port)
    base = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            urllib.request.urlopen(base + "/health", timeout=1).read()
            return p, base
        except OSError:
            time.sleep(0.1)
    p.terminate()
    sys.exit(f"serve_ab: tmx serve on port {port} did not start")


def batch(base):
    """Every request at once (the server batches them): the answers and tokens/s."""
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        t0 = time.perf_counter()
        many = list(pool.map(lambda i: complete(base, i), range(len(REQUESTS))))
        secs = time.perf_counter() - t0
    return many, sum(r["usage"]["completion_tokens"] for r in many) / secs


def compare(a, b):
    """Texts equal, and the worst log-probability difference where both have them."""
    same, worst = 0, 0.0
    for x, y in zip(a, b):
        cx, cy = x["choices"][0], y["choices"][0]
        same += cx["text"] == cy["text"]
        lx, ly = cx.get("logprobs"), cy.get("logprobs")
        if lx and ly and cx["text"] == cy["text"]:
            for u, v in zip(lx["token_logprobs"], ly["token_logprobs"]):
                worst = max(worst, abs(u - v))
    return same, worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("alt")
    ap.add_argument("--model", default="models/muse-mini")
    ap.add_argument("--kernels", default="cuda")
    ap.add_argument("--set", action="append", default=[], help="a config key for both servers")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json")
    args = ap.parse_args()
    servers = [started(args, {}, 18431), started(args, {"TMX_PLUGIN_PATH": args.alt}, 18432)]
    try:
        got = [[[complete(base, i) for i in range(len(REQUESTS))], batch(base)[0]]
               for _, base in servers]
        rates = [[], []]
        for _ in range(args.rounds):
            for s, (_, base) in enumerate(servers):
                rates[s].append(batch(base)[1])
    finally:
        for p, _ in servers:
            p.terminate()
            p.wait()
    new, old = got
    rate = [sorted(r)[len(r) // 2] for r in rates]
    doc = {"requests": len(REQUESTS), "rounds": args.rounds}
    ok = True
    for phase, i in (("one at a time", 0), ("concurrent", 1)):
        same, worst = compare(new[i], old[i])
        ok &= same == len(REQUESTS) and worst < 1e-4
        print(f"{phase}: {same} of {len(REQUESTS)} texts equal, worst logprob difference "
              f"{worst:.3g}")
        doc[phase.replace(" ", "_")] = {"same": same, "worst_logprob": worst}
    print(f"concurrent batch: {rate[0]:.1f} tokens/s as built, {rate[1]:.1f} with {args.alt} "
          f"(median of {args.rounds})")
    doc.update(tok_s_built=rates[0], tok_s_alt=rates[1], text0=new[0][0]["choices"][0]["text"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
