"""Top steps (tmx_model_step_top): the step hands back each sequence's first candidates for a
sampler where the logits are (the kernel set's topk), and they must be the plain step's logits
sorted by logit / temperature (the lower id first among equal values), with the softmax
denominators over the whole row at the temperature and at 1; the row stays readable (tmx_model_read_logits) for a draw that
needs more of it. `tmx generate` samples from them where the logits would travel (from a GPU,
or between ranks: here tp = 2, since kernels.cpu's logits are host memory and one rank of it
samples them in place), and must print what it prints from logits read back: kernels.cpu sums
the denominator in id order as the host sampler does, so the draws are the same token for
token. `cpu22` (tests/plugins/kernels-cpu22.c) is kernels.cpu without the ops of ABI 2.3 and
later: no topk."""
import os
import subprocess

import numpy as np
import pytest

from test_greedy import SETS, TEST_PLUGINS
from test_model import PROMPTS, encode, make_model
from tmx_engine import BIN_DIR, Engine, TmxError

TOPK = Engine.TOPK


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
