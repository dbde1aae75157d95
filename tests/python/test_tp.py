"""Tensor parallelism end to end (docs/tp.md): muse-tiny split over 2 and 4 ranks against 1.

muse-tiny's default shape has 2 KV heads, so the models here are variants of it (made with
tools/make_tiny_model.py's own functions) with 4 KV heads, so that 4 ranks hold one each:
  kv4     the 4-layer tiny (hybrid sliding/full attention, a dense layer, 3 MoE layers with
          8 experts and a shared expert), moe_intermediate_size 128, in BF16 and in F32;
  k3src   2 layers (dense + MoE), 4 experts, moe_intermediate_size 512 (TP = 4 cuts each
          expert into slices of 128, one Hadamard block), BF16, quantized at K = 3 with
          trellis-e4m3 and trellis-fp4 (about a minute each on two cores).

For every model, `tmx generate --tp N` (ranks on threads) must print the same greedy text for
40 tokens as TP = 1, and the logits of every position of two prompts through the engine API must
stay within TOL of TP = 1's (max |difference| / max |logit|). TP only reorders sums (the
all-reduces add in rank order, the codecs' activations are quantized per slice), so the
difference is rounding; measured on the 2-core development VM:

    model                TP = 2     TP = 4
    kv4 bf16             6.1e-7     7.4e-7
    kv4 f32              5.8e-7     6.7e-7
    k3 trellis-e4m3      2.8e-7     2.9e-7
    k3 trellis-fp4       2.2e-7     2.1e-7

TOL is 1e-4 for all, more than 100 times the largest of them. A config that does not split
is refused in one line naming the config.json field, and codec builds that cannot be cut in
one line naming the codec; a batched step of several sequences matches TP = 1; `tmx serve
--tp 2` answers as TP = 1 does; and under mpirun (when the build has MPI), `mpirun -np 2` and
`-np 4` of `tmx generate` print TP = 1's text.
"""
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from tmx_engine import BIN_DIR, Engine, TmxError

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import make_tiny_model  # noqa: E402

TMX = os.path.join(BIN_DIR, "tmx")
PROMPT = "Four score and seven years ago"
PROMPTS = [
    "Four score and seven years ago our fathers brought forth on this continent, a new nation.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
]
N_TOKENS = 40
TOL = 1e-4


def make_variant(out, dtype, **shape):
    """muse-tiny with `shape` overriding its config.json fields, written like the tool does."""
    tokenizer, special, n_tokens = make_tiny_model.build_tokenizer()
    cfg = make_tiny_model.preset_config("tiny", n_tokens, special)
    cfg.update(shape)
    cfg["torch_dtype"] = "float32" if dtype == "f32" else "bfloat16"
    weights = make_tiny_model.make_weights(cfg, np.random.default_rng(0))
    os.makedirs(out, exist_ok=True)
    make_tiny_model.write_json(os.path.join(out, "config.json"), cfg)
    make_tiny_model.write_json(os.path.join(out, "generation_config.json"), {
        "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
        "do_sample": False})
    make_tiny_model.write_tokenizer_files(out, tokenizer, special,
                                          cfg["max_position_embeddings"])
    make_tiny_model.write_weights(out, weights, dtype, 1)
    return str(out)


def run(*args, check=True, **kw):
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=900, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({r.returncode}):\n{r.stderr}")
    return r


def generate(model, *extra, launcher=(), **kw):
    """The generated text of `tmx generate` (its last line, the speed, dropped)."""
    out = run(*launcher, TMX, "generate", "--model", model, "--prompt", PROMPT, "-n",
              str(N_TOKENS), *extra, **kw).stdout
    lines = out.rstrip("\n").split("\n")
    assert lines[-1].startswith(f"{N_TOKENS} tokens"), out
    return "\n".join(lines[:-1])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for dtype in ("bf16", "f32"):
        out[f"kv4-{dtype}"] = make_variant(tmp_path_factory.mktemp(f"kv4-{dtype}"), dtype,
                                           num_key_value_heads=4)
    src = make_variant(tmp_path_factory.mktemp("k3src"), "bf16", num_key_value_heads=4,
                       num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                       n_routed_experts=4, moe_intermediate_size=512)
    for codec in ("trellis-e4m3", "trellis-fp4"):
        d = tmp_path_factory.mktemp("k3") / codec
        run(TMX, "quantize", "--model", src, "--out", str(d), "--codec", codec, "--bits", "3",
            "--threads", "2")
        out[f"k3-{codec}"] = str(d)
    return out


MODELS = ["kv4-bf16", "kv4-f32", "k3-trellis-e4m3", "k3-trellis-fp4"]


@pytest.mark.parametrize("name", MODELS)
def test_greedy_text_matches_tp1(models, name):
    texts = {tp: generate(models[name], "--tp", str(tp), "--threads", "2") for tp in (1, 2, 4)}
    assert texts[1].strip(), "TP = 1 generated nothing"
    assert texts[2] == texts[1]
    assert texts[4] == texts[1]


def test_mxfp8_cut_inside_a_block(tmp_path):
    """A K3 build whose o_proj columns split over TP 4 (4 heads of 16: 16 columns a rank) cut
    through its MXFP8 blocks of 32: the ranks take that weight's BF16 values instead, and the
    text is TP 1's."""
    src = make_variant(tmp_path / "src", "bf16", num_key_value_heads=4, head_dim=16,
                       num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                       n_routed_experts=4, moe_intermediate_size=512)
    d = str(tmp_path / "k3")
    run(TMX, "quantize", "--model", src, "--out", d, "--codec", "trellis-e4m3", "--bits", "3",
        "--threads", "2")
    assert "o_proj.weight_scale" in pathlib.Path(d, "model.safetensors.index.json").read_text()
    texts = {tp: generate(d, "--tp", str(tp), "--threads", "2") for tp in (1, 4)}
    assert texts[1].strip(), "TP = 1 generated nothing"
    assert texts[4] == texts[1]
    # tmx plan counts a rank's q, k, v (16 of 64 rows of 128) as MXFP8 and its o_proj (16 of
    # 64 columns of 128 rows) as BF16, two layers
    p = json.loads(run(TMX, "plan", d, "--tp", "4", "--json").stdout)
    assert p["rank_bytes"]["attention"] == 2 * (3 * 16 * 128 * 33 // 32 + 128 * 16 * 2)


def prompt_ids(model):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    bos = json.loads(pathlib.Path(model, "config.json").read_text())["bos_token_id"]
    return [[bos] + tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]


def all_logits(model, tp, ids):
    with Engine(model, ["threads=2", f"tp={tp}"]) as eng:
        rows = []
        for x in ids:
            seq = eng.seq(n_ctx=256)
            rows.append(seq.forward(x).astype(np.float64))
            seq.close()
    return np.concatenate(rows)


@pytest.mark.parametrize("name", MODELS)
def test_logits_within_tolerance(models, name):
    ids = prompt_ids(models[name])
    ref = all_logits(models[name], 1, ids)
    for tp in (2, 4):
        got = all_logits(models[name], tp, ids)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        print(f"{name} tp={tp}: max |diff| / max |logit| = {err:.2e}")
        assert err <= TOL, (name, tp, err)
        assert np.array_equal(got.argmax(-1), ref.argmax(-1))


def test_batched_steps_match_tp1(models):
    """Several sequences per step (prefill of one while others decode): block tables, rows and
    the vocabulary all-gather of a real batch."""
    model = models["kv4-bf16"]
    ids = prompt_ids(model)

    def run_batch(tp):
        with Engine(model, ["threads=2", f"tp={tp}", "kv_block_size=8"]) as eng:
            a, b = eng.seq(n_ctx=256), eng.seq(n_ctx=256)
            out = [eng.step([a], [ids[0]])]
            nxt = int(out[-1][0].argmax())
            out.append(eng.step([a, b], [[nxt], ids[1]]))
            for _ in range(6):
                out.append(eng.step([a, b], [[int(r.argmax())] for r in out[-1]]))
            a.close()
            b.close()
        return np.concatenate(out).astype(np.float64)

    ref, got = run_batch(1), run_batch(2)
    assert np.abs(got - ref).max() / np.abs(ref).max() <= TOL
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("tp,kernels", [(2, "cpu"), (4, "cpu"), (2, "cpu22")])
def test_greedy_steps_pick_the_argmax(models, tp, kernels):
    """Greedy steps: each rank picks the best of its vocabulary slice and rank 0 the best of
    theirs (kernels.cpu), or the logits are gathered and picked on the host (cpu22, a set
    without argmax). Over every id, and over fewer ids that end inside the last rank's slice,
    inside rank 1's, and inside rank 0's (the other ranks then offer nothing)."""
    model = models["kv4-f32"]
    ids = prompt_ids(model)
    plugins = str(pathlib.Path(BIN_DIR).resolve().parent / "tests" / "plugins")
    extra = [f"kernels={kernels}", f"plugin_dir={plugins}"] if kernels == "cpu22" else []
    with Engine(model, ["threads=2", f"tp={tp}", "kv_block_size=8"] + extra) as eng:
        stride = -(-eng.vocab_size // tp)
        a = [eng.seq(n_ctx=256) for _ in ids]
        logits = eng.step(a, ids)
        for n_vocab in (eng.n_vocab, eng.n_vocab - 3, stride + 5, stride - 1):
            b = [eng.seq(n_ctx=256) for _ in ids]
            picks = eng.step_greedy(b, ids, n_vocab=n_vocab)
            assert np.array_equal(picks, logits[:, :n_vocab].argmax(-1)), n_vocab
            for s in b:
                s.close()
        for s in a:
            s.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_top_steps_merge_the_ranks_candidates(models, tp):
    """Sampled steps: each rank finds the first candidates of its vocabulary slice and rank 0
    merges them (kernels.cpu's topk); they must be the gathered logits' first candidates, over
    every id and over fewer ids that end inside the last rank's slice, rank 1's and rank 0's,
    and the row read back afterwards must be the gathered row."""
    from test_top import check
    model = models["kv4-f32"]
    ids = prompt_ids(model)
    temps = [0.7, 1.3][: len(ids)]
    with Engine(model, ["threads=2", f"tp={tp}", "kv_block_size=8"]) as eng:
        assert eng.can_top()
        stride = -(-eng.vocab_size // tp)
        a = [eng.seq(n_ctx=256) for _ in ids]
        logits = eng.step(a, ids)
        for n_vocab in (eng.n_vocab, eng.n_vocab - 3, stride + 5, stride - 1):
            b = [eng.seq(n_ctx=256) for _ in ids]
            check(eng.step_top(b, ids, temps, n_vocab=n_vocab), logits[:, :n_vocab], temps)
            for i in range(len(ids)):
                assert np.array_equal(eng.read_logits(i), logits[i])
            for s in b:
                s.close()
        for s in a:
            s.close()


def test_sampled_text_on_the_candidates_matches_the_logits(models):
    """`tmx generate --tp 2` sampling from the ranks' merged candidates (a row gathered only for
    a draw past them) prints what it prints from every row gathered (cpu22: no topk), for one
    seed and two settings."""
    plugins = str(pathlib.Path(BIN_DIR).resolve().parent / "tests" / "plugins")
    cpu22 = ["--set", "kernels=cpu22", "--set", f"plugin_dir={plugins}"]
    for sample in (["--temperature", "1.0"], ["--temperature", "0.7", "--top-p", "0.9"]):
        args = ["--tp", "2", "--seed", "11"] + sample
        text = generate(models["kv4-bf16"], *args)
        assert text == generate(models["kv4-bf16"], *args, *cpu22)
        assert len(text) > 40


def test_indivisible_config_is_one_line(tmp_path):
    model = str(tmp_path / "tiny")  # the default tiny: 2 KV heads
    run(sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), model)
    r = run(TMX, "generate", "--model", model, "--prompt", PROMPT, "-n", "4", "--tp", "4",
            check=False)
    assert r.returncode == 1
    lines = r.stderr.strip().split("\n")
    assert len(lines) == 1, r.stderr
    assert "config.json: num_key_value_heads = 2 does not split into tp = 4 ranks" in lines[0]
    with pytest.raises(TmxError, match="num_attention_heads = 4 does not split into tp = 3"):
        Engine(model, ["tp=3"])


def test_codec_refusals(tmp_path):
    """A codec build whose experts cannot be cut: intermediate 128 over 2 ranks is not whole
    128-wide Hadamard blocks (trellis-e4m3 refuses it when it opens the layer); a codec with no
    tensor-parallel path at all (the int8 example codec) is refused by name."""
    src = {dtype: make_variant(tmp_path / dtype, dtype, num_hidden_layers=2,
                               layer_types=["sliding_attention", "full_attention"],
                               n_routed_experts=2) for dtype in ("bf16", "f32")}
    int8_dir = str(pathlib.Path(BIN_DIR).resolve().parent / "tests" / "plugins")
    cases = [("trellis-e4m3", "bf16", [], "codec.trellis-e4m3: layer 1: intermediate 128 does "
              "not split into tp = 2 slices of whole 128-wide Hadamard blocks"),
             ("int8", "f32", [f"plugin_dir={int8_dir}"],
              "codec.int8 has no tensor-parallel path")]
    for codec, dtype, extra, msg in cases:
        out = str(tmp_path / codec)
        sets = [a for e in extra for a in ("--set", e)]
        run(TMX, "quantize", "--model", src[dtype], "--out", out, "--codec", codec, "--bits",
            "3", "--threads", "2", *sets)
        r = run(TMX, "generate", "--model", out, "--prompt", PROMPT, "-n", "4", "--tp", "2",
                *sets, check=False)
        assert r.returncode == 1 and len(r.stderr.strip().split("\n")) == 1, r.stderr
        assert msg in r.stderr, r.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_completion(model, tp):
    port = free_port()
    log = open(os.path.join(model, f"serve-tp{tp}.log"), "w+")
    proc = subprocess.Popen([TMX, "serve", "--model", model, "--port", str(port), "--tp",
                             str(tp), "--threads", "2"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"tmx serve exited: {log.seek(0) or log.read()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "tmx serve did not answer /health"
                time.sleep(0.1)
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 24,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            text = json.loads(r.read())["choices"][0]["text"]
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        log.close()
    assert rc == 0
    return text


def test_serve_tp2_answers_as_tp1(models):
    model = models["kv4-bf16"]
    assert serve_completion(model, 2) == serve_completion(model, 1)


def mpi_build():
    """mpirun is installed and libtmx.so links Open MPI (the build found it)."""
    if not shutil.which("mpirun"):
        return False
    r = subprocess.run(["ldd", os.path.join(BIN_DIR, "libtmx.so")], capture_output=True,
                       text=True)
    return "libmpi" in r.stdout


@pytest.mark.skipif(not mpi_build(), reason="no mpirun, or this build of libtmx.so has no MPI")
@pytest.mark.parametrize("np_", [2, 4])
def test_mpirun_matches_tp1(models, np_):
    model = models["kv4-bf16"]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl_vader_single_copy_mechanism="none")
    ref = generate(model, "--threads", "2")
    got = generate(model, launcher=("mpirun", "--oversubscribe", "-np", str(np_)), env=env)
    assert got == ref
