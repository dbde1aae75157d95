"""`tmx bench`: the engine's prefill and decode tokens/s at several batch sizes (core/cli/bench.c).
Timings vary; what is checked is what the command says it ran: a row and a JSON run per batch
size in order, rates that are the tokens over the times it reports, prompts packed into steps
of at most `batch` tokens as the server packs them, max_running raised to the largest batch,
tensor parallelism, sampled decoding (the rows it reads back, and the host's time drawing and
reading them), and one-line errors for bad options."""
import json
import os
import subprocess

import pytest

from test_model import make_model
from tmx_engine import BIN_DIR

TMX = os.path.join(BIN_DIR, "tmx")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory, "muse-tiny-bench")


def bench(model, *args):
    return subprocess.run([TMX, "bench", "--model", model, "--threads", "2", *args],
                          capture_output=True, text=True, timeout=300)


def test_rows_and_json_agree(tiny, tmp_path):
    out = tmp_path / "bench.json"
    # 12 sequences: above the default max_running (8), which the command raises
    r = bench(tiny, "-b", "1,3,12", "-p", "20", "-n", "6", "--set", "batch=32", "--json",
              str(out))
    assert r.returncode == 0, r.stderr
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    doc = json.loads(out.read_text())
    assert (doc["prompt"], doc["n_predict"], doc["kernels"], doc["tp"]) == (20, 6, "cpu", 1)
    assert [x["batch"] for x in doc["runs"]] == [int(row[0]) for row in rows] == [1, 3, 12]
    for x, row in zip(doc["runs"], rows):
        b = x["batch"]
        assert x["prefill_s"] > 0 and x["decode_s"] > 0
        assert x["prefill_tok_s"] == pytest.approx(b * 20 / x["prefill_s"])
        assert x["decode_tok_s"] == pytest.approx(b * 6 / x["decode_s"])
        assert x["ms_per_step"] == pytest.approx(1e3 * x["decode_s"] / 6)
        # b prompts of 20 tokens in steps of at most 32, filled sequence by sequence
        assert x["prefill_steps"] == -(-b * 20 // 32) == int(row[2])
        assert float(row[3]) == pytest.approx(x["decode_tok_s"], abs=0.1)
        assert x["draw_ms_per_step"] == x["read_back_ms_per_step"] == 0  # greedy: no draws


@pytest.mark.parametrize("tp", [1, 2])
def test_sampled(tiny, tmp_path, tp):
    # With 2 ranks the model takes top steps (the logits would travel between ranks): draws
    # that need more than the candidates read their row back, and the run counts them.
    out = tmp_path / "bench.json"
    r = bench(tiny, "-b", "1,3", "-p", "8", "-n", "40", "--temperature", "1.5", "--top-p",
              "0.99", "--tp", str(tp), "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "sampled at 1.5, top-p 0.99" in r.stdout.splitlines()[0]
    doc = json.loads(out.read_text())
    assert (doc["temperature"], doc["top_p"], doc["tp"]) == (1.5, 0.99, tp)
    back = [x["rows_read_back"] for x in doc["runs"]]
    assert all(0 <= b <= x["batch"] * 40 for b, x in zip(back, doc["runs"]))
    # the host's time drawing, and reading rows back (within the decode's time)
    for x in doc["runs"]:
        assert 0 < x["draw_ms_per_step"] + x["read_back_ms_per_step"] < x["ms_per_step"]
        assert (x["read_back_ms_per_step"] > 0) == (x["rows_read_back"] > 0)
    if tp == 1:
        assert back == [0, 0]  # plain steps: every row is on the host already
    else:
        assert sum(back) > 0  # a random model at 1.5 spreads past 256 candidates


def test_tensor_parallel(tiny):
    r = bench(tiny, "-b", "2", "-p", "8", "-n", "4", "--tp", "2")
    assert r.returncode == 0, r.stderr
    assert "tp 2" in r.stdout.splitlines()[0]


@pytest.mark.parametrize("args, message", [
    (["-b", "0"], "--batch expects up to 16 sizes in 1..4096 separated by commas, got \"0\""),
    (["-b", "4,x"], "--batch expects up to 16 sizes"),
    (["-p", "0"], "--prompt expects an integer in [1, 1048576], got \"0\""),
    (["-p", "1.5"], "--prompt expects an integer in [1, 1048576], got \"1.5\""),
    (["-n", "-1"], "--n-predict expects an integer in [0, 1048576], got \"-1\""),
    (["--temperature", "-1"], "--temperature expects a number in [0, 100], got \"-1\""),
    (["--top-p", "0"], "--top-p expects a number in [1e-06, 1], got \"0\""),
    (["-b", "12", "--set", "max_running=4"],
     "--batch 12 is above the 4 sequences a step takes (config keys max_running = 4"),
    (["-b", "1,8", "-p", "4", "-n", "1", "--set", "batch=7"],
     "--batch 8 is above the 7 sequences a step takes (config keys max_running = 8, batch = 7"),
    (["-p", "200", "-n", "100", "--set", "context=256"],
     "--prompt (200) + --n-predict (100) exceed the context of 256 tokens"),
])
def test_bad_options_get_one_line(tiny, args, message):
    r = bench(tiny, *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tmx bench: ") and message in lines[0], lines
