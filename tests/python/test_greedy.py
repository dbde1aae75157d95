"""Greedy steps (tmx_model_step_greedy): the step picks each sequence's next token where the
logits are (the kernel set's argmax), and that pick must be the argmax of the logits the plain
step returns, over the tokenizer's ids or fewer, for batches of several sequences and over
several decode steps. kernels.cpu has argmax; `cpu22` (tests/plugins/kernels-cpu22.c) is the
same set as one built against ABI 2.2 presents it, without argmax, so the core reads the logits
back and picks on the host. Tensor-parallel greedy steps are in test_tp.py."""
import pathlib

import numpy as np
import pytest

from test_model import PROMPTS, encode, make_model
from tmx_engine import BIN_DIR, Engine, TmxError

TEST_PLUGINS = str(pathlib.Path(BIN_DIR).resolve().parent / "tests" / "plugins")
SETS = {"cpu": ["threads=2"], "cpu22": ["kernels=cpu22", f"plugin_dir={TEST_PLUGINS}",
                                        "threads=2"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory, "muse-tiny-greedy")


@pytest.mark.parametrize("kernels", SETS)
def test_greedy_step_is_the_argmax_of_the_logits(tiny, kernels):
    ids = [encode(tiny, t) for t in PROMPTS]
    with Engine(tiny, SETS[kernels]) as eng:
        plain = [eng.seq(n_ctx=256) for _ in ids]
        greedy = [eng.seq(n_ctx=256) for _ in ids]
        logits = eng.step(plain, ids)
        picks = eng.step_greedy(greedy, ids)
        seen = set()
        for _ in range(12):  # each step: every sequence's pick, then feed it to both
            want = logits.argmax(axis=1)
            assert np.array_equal(picks, want)
            seen.update(want.tolist())
            logits = eng.step(plain, [[t] for t in want])
            picks = eng.step_greedy(greedy, [[t] for t in picks])
        for s in plain + greedy:
            s.close()
    assert len(seen) > 6, "the picks should not be one token repeated"


@pytest.mark.parametrize("kernels", SETS)
def test_greedy_step_over_fewer_ids(tiny, kernels):
    ids = encode(tiny, PROMPTS[0])
    with Engine(tiny, SETS[kernels]) as eng:
        s = eng.seq(n_ctx=256)
        logits = eng.step([s], [ids])[0]
        s.close()
        for n_vocab in (1, 7, 100, eng.n_vocab - 1):
            s = eng.seq(n_ctx=256)
            assert eng.step_greedy([s], [ids], n_vocab=n_vocab)[0] == logits[:n_vocab].argmax()
            s.close()


def test_greedy_step_refuses_bad_n_vocab(tiny):
    ids = encode(tiny, PROMPTS[0])
    with Engine(tiny, ["threads=2"]) as eng:
        for bad in (-1, eng.vocab_size + 1):
            s = eng.seq(n_ctx=256)
            with pytest.raises(TmxError, match=rf"n_vocab {bad} outside \[1, {eng.vocab_size}\]"):
                eng.step_greedy([s], [ids], n_vocab=bad)
            s.close()
