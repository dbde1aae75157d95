"""The scheduler (core/serve.c) through ctypes: requests run concurrently must give exactly the
tokens each gives alone, cancellation ends a request with ABORT, a full queue refuses with
BUSY, logprobs are a distribution's, and bad parameters are named."""
import ctypes as C
import math
import os
import subprocess
import sys
import threading
import time

import pytest

from tmx_engine import Engine, TmxError, _check, lib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
FINISH_NONE, FINISH_LENGTH, FINISH_STOP, FINISH_ABORT, FINISH_ERROR = range(5)
ERR_BUSY = -8


class SamplerParams(C.Structure):
    _fields_ = [("temperature", C.c_float), ("top_k", C.c_int), ("top_p", C.c_float),
                ("min_p", C.c_float), ("seed", C.c_uint64)]


class RequestParams(C.Structure):
    _fields_ = [("prompt", C.POINTER(C.c_int32)), ("n_prompt", C.c_int), ("max_tokens", C.c_int),
                ("sampling", SamplerParams), ("presence_penalty", C.c_float),
                ("frequency_penalty", C.c_float), ("repetition_penalty", C.c_float),
                ("bias_ids", C.POINTER(C.c_int32)), ("bias_values", C.POINTER(C.c_float)),
                ("n_bias", C.c_int), ("stop_ids", C.POINTER(C.c_int32)), ("n_stop_ids", C.c_int),
                ("ignore_eos", C.c_int), ("top_logprobs", C.c_int)]


class TokenEvent(C.Structure):
    _fields_ = [("id", C.c_uint64), ("token", C.c_int32), ("logprob", C.c_float),
                ("n_top", C.c_int), ("top_ids", C.POINTER(C.c_int32)),
                ("top_logprobs", C.POINTER(C.c_float)), ("finish", C.c_int),
                ("error", C.c_char_p), ("n_prompt", C.c_int), ("n_generated", C.c_int)]


CALLBACK = C.CFUNCTYPE(None, C.c_void_p, C.POINTER(TokenEvent))


class Server:
    """A tmx_serve on an engine; collects every request's events."""

    def __init__(self, engine):
        L = lib()
        L.tmx_serve_new.argtypes = [C.c_void_p, C.POINTER(C.c_void_p), C.POINTER(C.c_void_p)]
        L.tmx_serve_free.argtypes = [C.c_void_p]
        L.tmx_serve_submit.argtypes = [C.c_void_p, C.POINTER(RequestParams), CALLBACK, C.c_void_p,
                                       C.POINTER(C.c_uint64), C.POINTER(C.c_void_p)]
        L.tmx_serve_cancel.argtypes = [C.c_void_p, C.c_uint64]
        self.handle, err = C.c_void_p(), C.c_void_p()
        _check(L.tmx_serve_new(engine.handle, C.byref(self.handle), C.byref(err)), err)
        self.events, self.done, self.lock = {}, {}, threading.Lock()
        self.cb = CALLBACK(self._on_event)  # kept alive as long as the server

    def _on_event(self, _arg, ev):
        e = ev.contents
        item = {"token": e.token, "finish": e.finish, "logprob": e.logprob,
                "top": [(e.top_ids[i], e.top_logprobs[i]) for i in range(e.n_top)],
                "error": e.error.decode() if e.error else None}
        with self.lock:
            self.events.setdefault(e.id, []).append(item)
            if e.finish != FINISH_NONE:
                self.done[e.id].set()

    def submit(self, prompt, max_tokens, temperature=0.0, seed=0, top_logprobs=-1,
               stop_ids=(), ignore_eos=1, logit_bias=None, **penalties):
        arr = (C.c_int32 * len(prompt))(*prompt)
        stops = (C.c_int32 * max(1, len(stop_ids)))(*stop_ids)
        bias = logit_bias or {}
        bias_ids = (C.c_int32 * max(1, len(bias)))(*bias.keys())
        bias_values = (C.c_float * max(1, len(bias)))(*bias.values())
        p = RequestParams(prompt=arr, n_prompt=len(prompt), max_tokens=max_tokens,
                          sampling=SamplerParams(temperature, 0, 1.0, 0.0, seed),
                          repetition_penalty=penalties.get("repetition_penalty", 1.0),
                          presence_penalty=penalties.get("presence_penalty", 0.0),
                          frequency_penalty=penalties.get("frequency_penalty", 0.0),
                          bias_ids=bias_ids, bias_values=bias_values, n_bias=len(bias),
                          stop_ids=stops, n_stop_ids=len(stop_ids), ignore_eos=ignore_eos,
                          top_logprobs=top_logprobs)
        rid, err = C.c_uint64(), C.c_void_p()
        with self.lock:  # the event may arrive before submit returns
            status = lib().tmx_serve_submit(self.handle, C.byref(p), self.cb, None, C.byref(rid),
                                            C.byref(err))
            if status == 0:
                self.done[rid.value] = threading.Event()
        if status == ERR_BUSY:
            lib().tmx_free(err)
            return None
        _check(status, err)
        return rid.value

    def wait(self, rid, timeout=120):
        assert self.done[rid].wait(timeout), "request did not finish"
        return self.events[rid]

    def close(self):
        lib().tmx_serve_free(self.handle)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve-tiny")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_tiny_model.py"), str(out)],
                   check=True, capture_output=True)
    return str(out)


def tokens(events):
    return [e["token"] for e in events if e["token"] >= 0]


def test_concurrent_requests_match_single_sequences(tiny):
    prompts = [[506] + list(range(60 + 7 * i, 90 + 9 * i)) for i in range(6)]
    with Engine(tiny, ["threads=2", "max_running=4", "batch=16"]) as eng:
        want = []
        for p in prompts:
            seq = eng.seq(n_ctx=eng_ctx(eng))
            want.append(seq.greedy(p, 20))
            seq.close()
        srv = Server(eng)
        ids = [srv.submit(p, 20) for p in prompts]
        got = [tokens(srv.wait(r)) for r in ids]
        assert all(srv.events[r][-1]["finish"] == FINISH_LENGTH for r in ids)
        srv.close()
    assert got == want


def alone(eng, prompts, n):
    """Each prompt's n greedy tokens, run by itself."""
    want = []
    for p in prompts:
        seq = eng.seq()
        want.append(seq.greedy(p, n))
        seq.close()
    return want


def eng_ctx(eng):
    return lib().tmx_engine_n_ctx(eng.handle)


def test_stop_token_and_seeded_sampling(tiny):
    with Engine(tiny, ["threads=1"]) as eng:
        srv = Server(eng)
        prompt = [506, 70, 71, 72, 73]
        first = tokens(srv.wait(srv.submit(prompt, 8)))
        r = srv.submit(prompt, 8, stop_ids=[first[2]])
        ev = srv.wait(r)
        assert tokens(ev) == first[:3] and ev[-1]["finish"] == FINISH_STOP
        a = tokens(srv.wait(srv.submit(prompt, 16, temperature=1.0, seed=5)))
        b = tokens(srv.wait(srv.submit(prompt, 16, temperature=1.0, seed=5)))
        assert a == b
        srv.close()


@pytest.mark.parametrize("lengths", [[30, 30, 30, 12, 30, 20, 16, 24],
                                     [30, 30, 30, 30, 12, 30, 10, 30]])
def test_steps_that_sample_where_the_logits_are_draw_what_the_host_draws(tiny, lengths):
    # kernels.cpu's steps hand back each row's argmax (all greedy without logprobs) or, at
    # tp = 2 (one rank of kernels.cpu samples its host-memory logits in place), its first
    # candidates after the requests' logit bias and penalties (logit_edit), and gather a row
    # only for a draw that walks past them or a request that wants log probabilities with its
    # penalties; cpu24 (ABI 2.4, topk but no logit_edit) gathers every row of a step with a
    # request with bias or penalties, cpu22 (ABI 2.2, no argmax or topk) every row of every
    # step. The same seeds must give the same tokens and log probabilities, batched; the two
    # length lists end the requests that need the logits first or last.
    from test_greedy import SETS
    from test_top import CPU24
    sets = dict(SETS, cpu24=CPU24)
    prompts = [[506] + list(range(60 + 7 * i, 80 + 9 * i)) for i in range(8)]
    reqs = [dict(temperature=0.0), dict(temperature=1.0, seed=1), dict(temperature=0.7, seed=2),
            dict(temperature=1.2, seed=3, repetition_penalty=1.3),
            dict(temperature=0.9, seed=4, top_logprobs=5), dict(temperature=0.0, top_logprobs=0),
            dict(temperature=0.8, seed=6, frequency_penalty=0.7, presence_penalty=0.4,
                 logit_bias={70: 3.0, 71: -100.0, 300: 2.5}),
            dict(temperature=0.0, presence_penalty=1.5, top_logprobs=2, logit_bias={90: 1.0})]
    got = {}
    for kernels in ("cpu", "cpu24", "cpu22"):
        with Engine(tiny, sets[kernels] + ["max_running=8", "batch=16", "tp=2"]) as eng:
            srv = Server(eng)
            ids = [srv.submit(p, n, **r) for p, n, r in zip(prompts, lengths, reqs)]
            got[kernels] = [[e for e in srv.wait(r) if e["token"] >= 0] for r in ids]
            srv.close()
    # One request at a time: each step draws one row, on the scheduler's thread, where the
    # batched steps above draw theirs on the kernel set's threads, side by side.
    with Engine(tiny, sets["cpu22"] + ["max_running=1", "batch=16", "tp=2"]) as eng:
        srv = Server(eng)
        got["alone"] = [[e for e in srv.wait(srv.submit(p, n, **r)) if e["token"] >= 0]
                        for p, n, r in zip(prompts, lengths, reqs)]
        srv.close()
    for kernels in ("cpu", "cpu24", "alone"):
        for a, b, r in zip(got[kernels], got["cpu22"], reqs):
            assert [e["token"] for e in a] == [e["token"] for e in b]
            if "top_logprobs" in r:
                assert [e["logprob"] for e in a] == pytest.approx([e["logprob"] for e in b],
                                                                  abs=1e-6)
                assert ([[i for i, _ in e["top"]] for e in a] ==
                        [[i for i, _ in e["top"]] for e in b])
                assert all(len(e["top"]) == r["top_logprobs"] for e in a)
    assert [len(t) for t in got["cpu"]] == lengths
    assert 71 not in [e["token"] for e in got["cpu"][6]]  # its bias of -100


def test_logprobs_are_log_probabilities(tiny):
    with Engine(tiny, ["threads=1"]) as eng:
        srv = Server(eng)
        ev = srv.wait(srv.submit([506, 80, 81, 82], 4, top_logprobs=5))
        for e in ev[:-1] if ev[-1]["token"] < 0 else ev:
            top = e["top"]
            assert len(top) == 5
            assert top[0][0] == e["token"]  # greedy picks the most likely
            assert abs(top[0][1] - e["logprob"]) < 1e-6
            assert all(top[i][1] >= top[i + 1][1] for i in range(4))
            assert sum(math.exp(lp) for _, lp in top) <= 1.0 + 1e-5
        srv.close()


def test_cancel_and_busy(tiny):
    with Engine(tiny, ["threads=1", "max_running=1", "max_waiting=1"]) as eng:
        srv = Server(eng)
        long = srv.submit([506] + list(range(60, 100)), 900)
        queued = srv.submit([506, 61, 62], 5)
        assert srv.submit([506, 63], 5) is None  # one running, one waiting: full
        lib().tmx_serve_cancel(srv.handle, queued)
        assert srv.wait(queued)[-1]["finish"] == FINISH_ABORT
        lib().tmx_serve_cancel(srv.handle, long)
        ev = srv.wait(long)
        assert ev[-1]["finish"] == FINISH_ABORT and len(tokens(ev)) < 900
        # its blocks are back, and the metrics say so though no step ran after it
        deadline = time.monotonic() + 10
        while metrics(srv).kv_usage != 0:
            assert time.monotonic() < deadline, metrics(srv).kv_usage
            time.sleep(0.01)
        srv.close()


def test_batch_above_the_context_is_cut_to_it(tmp_path):
    # batch 512 over a context of 64: the KV cache takes steps of at most 64 tokens, and the
    # scheduler packs its steps to that, not to 512 (four 50-token prompts at once, on a model
    # of full attention only, whose prompt chunks no sliding window shortens, and no prefix
    # cache to hand them the prompts the single runs computed)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_tiny_model.py"),
                    str(tmp_path), "--preset", "llama"], check=True, capture_output=True)
    prompts = [[1] + list(range(100 + 50 * i, 149 + 50 * i)) for i in range(4)]
    cfg = ["threads=2", "context=64", "batch=512", "max_running=4", "prefix_cache=false"]
    with Engine(str(tmp_path), cfg) as eng:
        want = alone(eng, prompts, 8)
        srv = Server(eng)
        ids = [srv.submit(p, 8) for p in prompts]
        got = [srv.wait(r) for r in ids]
        srv.close()
    assert [e[-1]["finish"] for e in got] == [FINISH_LENGTH] * 4, got
    assert [tokens(e) for e in got] == want


def test_bad_parameters_are_named(tiny):
    with Engine(tiny, ["threads=1", "context=64"]) as eng:
        srv = Server(eng)
        with pytest.raises(TmxError, match="prompt"):
            srv.submit([506] * 64, 4)
        with pytest.raises(TmxError, match="max_tokens"):
            srv.submit([506], 0)
        with pytest.raises(TmxError, match="token id 99999"):
            srv.submit([99999], 4)
        with pytest.raises(TmxError, match="repetition_penalty"):
            srv.submit([506], 4, repetition_penalty=0.0)
        srv.close()


class Metrics(C.Structure):
    _fields_ = [("running", C.c_int), ("waiting", C.c_int), ("prompt_tokens", C.c_uint64),
                ("generation_tokens", C.c_uint64), ("finished", C.c_uint64 * 5),
                ("ttft_count", C.c_uint64 * 12), ("itl_count", C.c_uint64 * 12),
                ("ttft_sum", C.c_double), ("itl_sum", C.c_double), ("kv_usage", C.c_double),
                ("prefix_cache_queries", C.c_uint64), ("prefix_cache_hits", C.c_uint64),
                ("preemptions", C.c_uint64)]


def metrics(srv):
    m = Metrics()
    lib().tmx_serve_metrics.argtypes = [C.c_void_p, C.POINTER(Metrics)]
    lib().tmx_serve_metrics(srv.handle, C.byref(m))
    return m


def test_preemption_when_the_kv_cache_runs_out(tiny):
    # The cache holds 96 positions, one context's worth; four requests of 30 + 40 tokens need
    # 280. Newer requests are preempted and recompute later: every request still gets exactly
    # the tokens it gets alone.
    prompts = [[506] + list(range(100 + 31 * i, 129 + 31 * i)) for i in range(4)]
    cfg = ["threads=2", "context=96", "kv_tokens=96", "kv_block_size=8", "max_running=4",
           "batch=32"]
    with Engine(tiny, cfg) as eng:
        want = alone(eng, prompts, 40)
        srv = Server(eng)
        ids = [srv.submit(p, 40) for p in prompts]
        got = [tokens(srv.wait(r)) for r in ids]
        assert all(srv.events[r][-1]["finish"] == FINISH_LENGTH for r in ids)
        m = metrics(srv)
        srv.close()
    assert got == want
    assert m.preemptions > 0


def test_prefix_cache_hits_are_counted(tiny):
    prompt = [506] + list(range(300, 350))
    with Engine(tiny, ["threads=2", "kv_block_size=16"]) as eng:
        srv = Server(eng)
        first = tokens(srv.wait(srv.submit(prompt, 8)))
        m0 = metrics(srv)
        second = tokens(srv.wait(srv.submit(prompt, 8)))
        m1 = metrics(srv)
        srv.close()
    assert first == second
    assert m0.prefix_cache_hits == 0 and m0.prefix_cache_queries == len(prompt)
    assert m1.prefix_cache_hits - m0.prefix_cache_hits == 48  # three full blocks of 16
    assert 0 <= m1.kv_usage <= 1
    with Engine(tiny, ["threads=2", "kv_block_size=16", "prefix_cache=false"]) as eng:
        srv = Server(eng)  # no cache, no look-ups (as vLLM counts them)
        srv.wait(srv.submit(prompt, 8))
        m = metrics(srv)
        srv.close()
    assert m.prefix_cache_queries == 0 and m.prefix_cache_hits == 0


def test_warm_up_runs_the_model_and_gives_its_blocks_back(tiny):
    # The server runs a whole step's prompt (batch = 32 tokens: ids 0..31) and decode steps
    # before it takes requests, then frees that sequence: nothing is in use and no request is
    # counted, but the prompt's two blocks of 16 are in the prefix cache, so a request that
    # starts with the same ids finds them, and gets the same tokens as without the warm-up.
    prompt = list(range(40))
    got = {}
    for warm in ("true", "false"):
        with Engine(tiny, ["threads=2", "batch=32", "kv_block_size=16", f"warmup={warm}"]) as eng:
            srv = Server(eng)
            m0, u = metrics(srv), eng.kv_usage()
            assert m0.prompt_tokens == 0 and m0.generation_tokens == 0
            assert u.full_used == 0 and u.sliding_used == 0
            got[warm] = tokens(srv.wait(srv.submit(prompt, 8)))
            m1 = metrics(srv)
            srv.close()
        assert m1.prefix_cache_hits == (32 if warm == "true" else 0)
    assert got["true"] == got["false"]


def test_generation_config_eos_ends_generation(tiny, tmp_path):
    # An id listed only in generation_config.json stops generation too (gpt-oss lists <|call|>
    # there).
    import json
    import shutil
    prompt = [506, 70, 71, 72, 73]
    with Engine(tiny, ["threads=1"]) as eng:
        seq = eng.seq()
        first = seq.greedy(prompt, 1)[0]
        seq.close()
    model = tmp_path / "with-generation-config"
    shutil.copytree(tiny, model)
    with open(model / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [first]}, f)
    with Engine(str(model), ["threads=1"]) as eng:
        srv = Server(eng)
        ev = srv.wait(srv.submit(prompt, 8, ignore_eos=0))
        srv.close()
    assert tokens(ev) == [first] and ev[-1]["finish"] == FINISH_STOP


def test_tight_kv_cache_does_not_thrash(tiny):
    # 16 blocks of 8 positions and up to 8 running requests, for 10 requests of 21 + 40 tokens
    # (8 blocks each; 80 in all): a request is admitted only when the cache has room for its
    # prompt, and a preempted one waits at the head of the queue until there is room again,
    # instead of being preempted at every step. Greedy and seeded requests give exactly the
    # tokens they give alone, and the prefix cache counts each prompt once.
    prompts = [[506] + list(range(100 + 23 * i, 120 + 23 * i)) for i in range(10)]
    temps = [0.0 if i % 3 else 1.0 for i in range(10)]
    with Engine(tiny, ["threads=2", "context=128", "max_running=1"]) as eng:
        alone = Server(eng)
        want = [tokens(alone.wait(alone.submit(p, 40, temperature=t, seed=i)))
                for i, (p, t) in enumerate(zip(prompts, temps))]
        alone.close()
    cfg = ["threads=2", "context=128", "kv_tokens=128", "kv_block_size=8", "max_running=8",
           "batch=32"]
    with Engine(tiny, cfg) as eng:
        srv = Server(eng)
        ids = [srv.submit(p, 40, temperature=t, seed=i)
               for i, (p, t) in enumerate(zip(prompts, temps))]
        got = [tokens(srv.wait(r)) for r in ids]
        assert all(srv.events[r][-1]["finish"] == FINISH_LENGTH for r in ids)
        m = metrics(srv)
        srv.close()
    assert got == want
    # Before the fix: 27 preemptions here, and 10,285 prompt tokens looked up for 210.
    assert 0 < m.preemptions <= 2 * len(prompts)
    assert m.prefix_cache_queries == sum(len(p) for p in prompts)
