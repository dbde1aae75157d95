"""Top steps (tmx_model_step_top): the step hands back each sequence's first candidates for a
sampler where the logits are (the kernel set's topk), and they must be the plain step's logits
sorted by logit / temperature (the lower id first among equal values), with the softmax
denominators over the whole row at the temperature and at 1; the row stays readable (tmx_model_read_logits) for a draw that
needs more of it. `tmx generate` samples from them where the logits would travel (from a GPU,
or between ranks: here tp = 2, since kernels.cpu's logits are host memory and one rank of it
samples them in place), and must print what it prints from logits read back: kernels.cpu sums
the denominator in id order as the host sampler does, so the draws are the same token for
token. `cpu22` (tests/plugins/kernels-cpu22.c) is kernels.cpu without the ops of ABI 2.3 and
later: no topk. Logit edits (ABI 2.5, a request's logit bias and penalties) go on the logits
before topk, and the edited row is the one left to read."""
import os
import subprocess

import numpy as np
import pytest

from test_greedy import SETS, TEST_PLUGINS
from test_model import PROMPTS, encode, make_model
from tmx_engine import BIN_DIR, Engine, TmxError

TOPK = Engine.TOPK
# kernels.cpu as built against ABI 2.4 (tests/plugins/kernels-cpu24.c): topk, no logit_edit
CPU24 = ["kernels=cpu24", f"plugin_dir={TEST_PLUGINS}", "threads=2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory, "muse-tiny-top")


def reference(logits, t):
    """The first TOPK candidates of one row at temperature t, as tmx/kernels.h's topk says:
    their ids and logits, and the softmax denominators at t and at 1, the number of
    candidates."""
    y = (logits / np.float32(t)).astype(np.float32)
    ok = ~np.isnan(logits) & (logits != -np.inf)
    cols = np.nonzero(ok)[0]
    order = cols[np.lexsort((cols, -y[cols]))]
    first = order[:TOPK]
    total = np.exp(y[cols].astype(np.float64) - np.float64(y[order[0]])).sum()
    total1 = np.exp(logits[cols].astype(np.float64) - np.float64(logits[order[0]])).sum()
    return logits[first], first, total, len(cols), total1


def check(got, logits, temps):
    x, ids, stats = got
    for i, t in enumerate(temps):
        rx, rid, rsum, rn, rsum1 = reference(logits[i], t)
        k = len(rid)
        assert np.array_equal(ids[i, :k], rid)
        assert np.array_equal(x[i, :k], rx)
        assert np.all(ids[i, k:] == -1) and np.all(x[i, k:] == -np.inf)
        assert stats[i, 1] == rn
        assert stats[i, 0] == pytest.approx(rsum, rel=1e-12)
        assert stats[i, 2] == pytest.approx(rsum1, rel=1e-12)


def test_top_step_gives_the_first_candidates_of_the_logits(tiny):
    ids = [encode(tiny, t) for t in PROMPTS]
    temps = [0.7, 1.0, 1.6][: len(ids)]
    with Engine(tiny, ["threads=2"]) as eng:
        assert not eng.can_top()  # host memory: generate and serve sample the logits in place
        plain = [eng.seq(n_ctx=256) for _ in ids]
        top = [eng.seq(n_ctx=256) for _ in ids]
        logits = eng.step(plain, ids)
        got = eng.step_top(top, ids, temps)
        for _ in range(6):  # decode steps: feed both the first candidate
            check(got, logits, temps)
            for i in range(len(ids)):
                assert np.array_equal(eng.read_logits(i), logits[i])
            nxt = [[int(r[0])] for r in got[1]]
            logits = eng.step(plain, nxt)
            got = eng.step_top(top, nxt, temps)
        for s in plain + top:
            s.close()


def test_top_step_over_fewer_ids(tiny):
    ids = encode(tiny, PROMPTS[0])
    with Engine(tiny, ["threads=2"]) as eng:
        s = eng.seq(n_ctx=256)
        logits = eng.step([s], [ids])
        s.close()
        for n_vocab in (1, 100, eng.n_vocab - 1):
            s = eng.seq(n_ctx=256)
            check(eng.step_top([s], [ids], [0.9], n_vocab=n_vocab), logits[:, :n_vocab], [0.9])
            s.close()


def test_top_step_refusals(tiny):
    ids = encode(tiny, PROMPTS[0])
    with Engine(tiny, ["threads=2"]) as eng:
        for temps, n_vocab, msg in (([0.0], None, "temperature 0 of sequence 0"),
                                    ([float("nan")], None, "temperature nan"),
                                    ([1.0], eng.vocab_size + 1, "n_vocab")):
            s = eng.seq(n_ctx=256)
            with pytest.raises(TmxError, match=msg):
                eng.step_top([s], [ids], temps, n_vocab=n_vocab)
            s.close()
        with pytest.raises(TmxError, match="row 0 of the last step's 0"):
            eng.read_logits(0)
    with Engine(tiny, SETS["cpu22"]) as eng:
        assert not eng.can_top()
        s = eng.seq(n_ctx=256)
        with pytest.raises(TmxError, match="kernel set cpu22 has no topk"):
            eng.step_top([s], [ids], [1.0])
        s.close()


def edited(logits, edits):
    """A row of logits after edits (id, bias, penalty, rep), each step rounded to float32 as
    tmx_logit_edit_apply says."""
    x = logits.copy()
    for i, b, p, r in edits:
        v = (x[i] + np.float32(b)) - np.float32(p)
        x[i] = v / np.float32(r) if v > 0 else v * np.float32(r)
    return x


def some_edits(rng, n_vocab, low):
    """Edits of distinct ids, every kind, and a bias that lifts id `low` (a logit far down the
    row) to the first candidate."""
    ids = rng.choice(np.setdiff1d(np.arange(n_vocab), [low]), size=40, replace=False)
    e = [(int(i), float(rng.uniform(-5, 5)) if rng.random() < 0.7 else 0.0,
          float(rng.uniform(0, 3)) if rng.random() < 0.5 else 0.0,
          float(rng.choice([1.0, 1.3, 0.75]))) for i in ids]
    return e + [(int(low), 100.0, 0.0, 1.0)]


@pytest.mark.parametrize("tp", [1, 2])
def test_top_step_after_edits(tiny, tp):
    """A top step with logit edits (tmx serve's logit bias and penalties) gives the first
    candidates of the edited logits, and leaves the edited row to read; with tp = 2 each rank
    edits its vocabulary slice."""
    rng = np.random.default_rng(tp)
    ids = [encode(tiny, t) for t in PROMPTS]
    temps = [0.7, 1.0, 1.6][: len(ids)]
    with Engine(tiny, ["threads=2", f"tp={tp}"]) as eng:
        assert eng.can_edit() == (tp > 1)  # as can_top: one rank of kernels.cpu samples in place
        plain = [eng.seq(n_ctx=256) for _ in ids]
        top = [eng.seq(n_ctx=256) for _ in ids]
        logits = eng.step(plain, ids)
        for step in range(4):  # decode steps: feed both the first candidate
            edits = [some_edits(rng, eng.n_vocab, int(np.argmin(r))) for r in logits]
            if step == 1:
                edits[0] = []  # a row without edits beside edited ones
            got = eng.step_top(top, ids if step == 0 else nxt, temps, edits=edits)
            want = np.stack([edited(r, e) for r, e in zip(logits, edits)])
            check(got, want, temps)
            for i, e in enumerate(edits):
                assert np.array_equal(eng.read_logits(i), want[i])
                assert not e or got[1][i, 0] == e[-1][0]  # the lifted id
            nxt = [[int(r[0])] for r in got[1]]
            logits = eng.step(plain, nxt)
        for s in plain + top:
            s.close()


def test_top_step_edit_refusals(tiny):
    ids = encode(tiny, PROMPTS[0])
    with Engine(tiny, ["threads=2"]) as eng:
        for edits, msg in (([(5, 1.0, 0.0, 1.0), (5, 2.0, 0.0, 1.0)], "id 5 edited twice"),
                           ([(eng.n_vocab, 1.0, 0.0, 1.0)], "outside the vocabulary"),
                           ([(-1, 1.0, 0.0, 1.0)], "outside the vocabulary")):
            s = eng.seq(n_ctx=256)
            with pytest.raises(TmxError, match=msg):
                eng.step_top([s], [ids], [1.0], edits=[edits])
            s.close()
    with Engine(tiny, CPU24) as eng:
        assert not eng.can_edit()
        s = eng.seq(n_ctx=256)
        with pytest.raises(TmxError, match="kernel set cpu24 cannot edit logits"):
            eng.step_top([s], [ids], [1.0], edits=[[(5, 1.0, 0.0, 1.0)]])
        s.close()


@pytest.mark.parametrize("args", [["--temperature", "0.9"],
                                  ["--temperature", "1.3", "--top-p", "0.9"],
                                  ["--temperature", "0.8", "--top-k", "20", "--min-p", "0.02"]])
def test_generate_samples_from_the_candidates_as_from_the_logits(tiny, args):
    """kernels.cpu at tp = 2 (candidates, the row only when a draw walks past them) and cpu22
    (every row gathered) print the same text for one seed."""
    with Engine(tiny, ["threads=2", "tp=2"]) as eng:
        assert eng.can_top()
    cmd = [os.path.join(BIN_DIR, "tmx"), "generate", "--model", tiny, "--prompt", PROMPTS[0],
           "-n", "48", "--seed", "7", "--threads", "2", "--tp", "2"] + args
    texts = [subprocess.run(cmd + extra, check=True, capture_output=True,
                            text=True).stdout.rsplit("\n", 2)[0]
             for extra in ([], ["--set", "kernels=cpu22", "--set", f"plugin_dir={TEST_PLUGINS}"])]
    assert texts[0] == texts[1]
    assert len(texts[0]) > 20
