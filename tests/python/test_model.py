"""The C engine against the independent numpy float64 reference (tools/reference/muse_ref.py).

muse-tiny has a sliding window of 16 positions; every prompt here is longer, so the window,
the sliding layers' ring-buffer KV cache and chunked prefill across window boundaries are all
exercised. Bound: max |C - ref| / max |ref| <= 1e-4 per logits row with F32 weights.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tmx_engine import BIN_DIR, Engine, TmxError

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
sys.path.insert(0, os.path.join(ROOT, "tools", "reference"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import muse_ref  # noqa: E402
import safetensors_io  # noqa: E402

PROMPTS = [
    "Once upon a time, in a kingdom by the sea, there lived a king who had three daughters.",
    "The quick brown fox jumps over the lazy dog; then it runs into the forest and hides.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief.",
]
REL_TOL = 1e-4


def make_model(tmp_path_factory, name, *args):
    out = tmp_path_factory.mktemp(name)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_tiny_model.py"), str(out),
                    *args], check=True, capture_output=True)
    return str(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory, "muse-tiny")


@pytest.fixture(scope="module")
def tiny_bf16_sharded(tmp_path_factory):
    return make_model(tmp_path_factory, "muse-tiny-bf16", "--dtype", "bf16", "--shards", "2",
                      "--seed", "3")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_model(tmp_path_factory, "llama-tiny", "--preset", "llama", "--dtype", "bf16")


def encode(model_dir, text):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ref = muse_ref.load(model_dir)
    bos = ref.cfg.bos_token_id if hasattr(ref.cfg, "bos_token_id") else None
    ids = tok.encode(text, add_special_tokens=False).ids
    return ([bos] if bos is not None else []) + ids


def max_rel_err(c, r):
    return float(np.max(np.abs(c - r), axis=-1).max() / np.abs(r).max())


def check_logits(model_dir, overrides=(), n_batch=512):
    ref = muse_ref.load(model_dir)
    with Engine(model_dir, list(overrides) + [f"batch={n_batch}"]) as eng:
        for text in PROMPTS:
            ids = encode(model_dir, text)
            assert len(ids) > 2 * 16, "prompts must be longer than the sliding window"
            want = ref.forward(ids)
            seq = eng.seq(n_ctx=256)
            got = seq.forward(ids)
            seq.close()
            assert got.shape == want.shape
            err = max_rel_err(got, want)
            assert err <= REL_TOL, f"max relative error {err:.2e} > {REL_TOL} on {text[:30]!r}"


def test_logits_match_reference_f32(tiny):
    check_logits(tiny, ["threads=2"])


def test_logits_match_reference_bf16_sharded(tiny_bf16_sharded):
    check_logits(tiny_bf16_sharded, ["threads=2"])


def test_logits_match_reference_llama(tiny_llama):
    # model_type llama: dense layers, full attention, tied embeddings, Llama 3.1 RoPE scaling.
    check_logits(tiny_llama, ["threads=2"])


def test_chunked_prefill_matches_reference(tiny):
    # Steps of 7 tokens: queries of one step see keys written by the previous ones, and the
    # sliding layers give back blocks that left the window as the prompt goes on.
    check_logits(tiny, ["threads=1"], n_batch=7)


def test_greedy_64_tokens_identical(tiny):
    ref = muse_ref.load(tiny)
    with Engine(tiny, ["threads=2"]) as eng:
        for text in PROMPTS[:2]:
            ids = encode(tiny, text)
            want = ref.greedy(ids, 64)
            seq = eng.seq(n_ctx=256)
            got = seq.greedy(ids, 64)
            seq.close()
            assert got == want
            assert len(set(got)) > 8, "greedy text should not be one token repeated"


def test_thread_count_does_not_change_logits(tiny):
    ids = encode(tiny, PROMPTS[0])
    outs = []
    for threads in (1, 2):
        with Engine(tiny, [f"threads={threads}"]) as eng:
            seq = eng.seq(n_ctx=128)
            outs.append(seq.forward(ids))
            seq.close()
    assert np.array_equal(outs[0], outs[1])


def test_context_full_is_an_error(tiny):
    with Engine(tiny) as eng:
        seq = eng.seq(n_ctx=8)
        with pytest.raises(TmxError, match="context full"):
            seq.forward(list(range(9)))
        seq.close()


def test_generate_cli_prints_greedy_text_and_speed(tiny):
    from tokenizers import Tokenizer
    ref = muse_ref.load(tiny)
    ids = encode(tiny, PROMPTS[0])
    want = Tokenizer.from_file(os.path.join(tiny, "tokenizer.json")).decode(
        ref.greedy(ids, 24), skip_special_tokens=False)
    out = subprocess.run([os.path.join(BIN_DIR, "tmx"), "generate", "--model", tiny,
                          "--prompt", PROMPTS[0], "-n", "24", "--temperature", "0"],
                         check=True, capture_output=True, text=True).stdout
    text, _, last = out.rstrip("\n").rpartition("\n")
    assert re.fullmatch(r"\d+ tokens, [0-9.]+ tokens/s \(prompt: \d+ tokens, [0-9.]+ tokens/s\)",
                        last), last
    assert text == want


def test_generate_cli_sampling_is_seeded(tiny):
    cmd = [os.path.join(BIN_DIR, "tmx"), "generate", "--model", tiny, "--prompt", "The king",
           "-n", "32", "--temperature", "0.9", "--top-p", "0.95", "--top-k", "40"]
    runs = [subprocess.run(cmd + ["--seed", s], check=True, capture_output=True,
                           text=True).stdout.rsplit("\n", 2)[0] for s in ("1", "1", "2")]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_generate_cli_errors_are_one_line(tiny, tmp_path):
    tmx = os.path.join(BIN_DIR, "tmx")
    r = subprocess.run([tmx, "generate", "--model", str(tmp_path), "--prompt", "x"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and str(tmp_path) in r.stderr and r.stderr.count("\n") == 1
    r = subprocess.run([tmx, "generate", "--model", tiny, "--prompt", "x", "--temperature", "-1"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "temperature" in r.stderr and r.stderr.count("\n") == 1
    r = subprocess.run([tmx, "generate", "--model", tiny, "--prompt", "x", "--config",
                        str(tmp_path)], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr == f"tmx generate: {tmp_path}: is a folder, not a " \
                                             "configuration file\n"
    r = subprocess.run([tmx, "generate", "--model", tiny, "--prompt", "x", "--set",
                        "kernels=nope"], capture_output=True, text=True)
    searched = r.stderr.split(" not found in ")[1].strip().split(", ")
    assert r.returncode != 0 and len(searched) == len(set(searched)), r.stderr
    r = subprocess.run([tmx, "inspect", tiny, "more"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith('tmx inspect: unexpected argument "more"')


def copy_model(src, dst, tensors=None, tokenizer=None):
    """src copied to dst, with `tensors(dict)` and `tokenizer(dict)` edited in place first."""
    shutil.copytree(src, dst)
    if tensors:
        path = os.path.join(dst, "model.safetensors")
        ts, meta = safetensors_io.load_file(path)
        ts = {name: t.copy() for name, t in ts.items()}
        tensors(ts)
        safetensors_io.save_file(path, ts, meta)
    if tokenizer:
        path = os.path.join(dst, "tokenizer.json")
        with open(path) as f:
            tok = json.load(f)
        tokenizer(tok)
        with open(path, "w") as f:
            json.dump(tok, f)
    return str(dst)


def test_generate_file_and_chat_prompts(tiny, tmp_path):
    """--file (a path or -) and --chat give the text they stand for: greedy output and prompt
    length equal --prompt's with that text."""
    tmx = os.path.join(BIN_DIR, "tmx")

    def run(*args, stdin=None):
        r = subprocess.run([tmx, "generate", "--model", tiny, "-n", "8", *args], input=stdin,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return r.stdout.rsplit("\n", 2)[0], re.search(r"prompt: (\d+) tokens", r.stdout)[1]

    text = "Once upon a time, in a kingdom by the sea,"
    (tmp_path / "prompt.txt").write_text(text + "\n")  # the final newline is not the prompt's
    want = run("--prompt", text)
    assert run("--file", str(tmp_path / "prompt.txt")) == want
    assert run("-f", "-", stdin=text + "\n") == want
    # The tiny model's template, as transformers renders it for one system and one user turn.
    chat = ("<|begin_of_text|><|start|>system\nBe brief.<|end|>\n<|start|>user\n" + text +
            "<|end|>\n<|start|>assistant\n")
    assert run("--chat", "--system", "Be brief.", "--prompt", text) == \
        run("--no-bos", "--prompt", chat)
    for args, message in ((["--prompt", "x", "--file", "y"], "give one of --prompt"),
                          (["--prompt", "x", "--system", "y"], "--system needs --chat"),
                          (["--file", str(tmp_path / "none.txt")], "none.txt: No such file")):
        r = subprocess.run([tmx, "generate", "--model", tiny, *args], capture_output=True,
                           text=True)
        assert r.returncode != 0 and message in r.stderr.splitlines()[0], r.stderr


@pytest.mark.parametrize("args, option", [
    *[(["-n", v], "--n-predict") for v in ("1e30", "inf", "nan", "4294967297", "2.7", "")],
    *[(["--top-k", v], "--top-k") for v in ("1e20", "2.5", "-1")],
    *[(["--seed", v], "--seed") for v in ("1.5", "nan", "1e40", "-2", "18446744073709551616")],
    (["--temperature", "1e40"], "--temperature"), (["--top-p", "nan"], "--top-p"),
    (["--min-p", "2"], "--min-p"),
])
def test_generate_cli_refuses_bad_numbers(tmp_path, args, option):
    """Refused while the options are parsed, before the model (absent here) is opened."""
    r = subprocess.run([os.path.join(BIN_DIR, "tmx"), "generate", "--model", str(tmp_path),
                        "--prompt", "x", *args], capture_output=True, text=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"tmx generate: {option} expects "), lines[0]


def test_generate_cli_prints_long_tokens(tiny, tmp_path):
    """Two added tokens of 400 bytes at padded ids, and weights that make greedy decoding pick
    one of them at every step: the final norm keeps dimension 0 alone and their lm_head rows
    are +e0 and -e0 (every other row zero), so one of them has the one positive logit."""
    with Engine(tiny) as eng:
        n_tok = eng.n_vocab
    long_ids = {n_tok: "a" * 400, n_tok + 1: "b" * 400}

    def tensors(ts):
        ts["model.norm.weight"][:] = 0
        ts["model.norm.weight"][0] = 1
        ts["lm_head.weight"][:] = 0
        ts["lm_head.weight"][n_tok, 0] = 1
        ts["lm_head.weight"][n_tok + 1, 0] = -1

    def tokenizer(tok):
        tok["added_tokens"] += [{"id": i, "content": t, "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False}
                                for i, t in long_ids.items()]

    model = copy_model(tiny, tmp_path / "long", tensors, tokenizer)
    out = subprocess.run([os.path.join(BIN_DIR, "tmx"), "generate", "--model", model,
                          "--prompt", PROMPTS[0], "-n", "3"],
                         check=True, capture_output=True, text=True).stdout
    text, _, last = out.rstrip("\n").rpartition("\n")
    assert last.startswith("3 tokens, ")
    assert len(text) == 3 * 400 and set(text) <= {"a", "b"}, text[:80]


def test_shape_mismatch_names_every_dimension(tiny, tmp_path):
    def tensors(ts):
        ts["model.norm.weight"] = ts["model.norm.weight"][:64].copy()

    model = copy_model(tiny, tmp_path / "short-norm", tensors)
    with pytest.raises(TmxError, match=re.escape(
            "tensor model.norm.weight has shape [64], config.json implies [128]")):
        Engine(model)


def test_tokenizer_id_beyond_the_model_is_named(tiny, tmp_path):
    """tiny's vocab_size is 576; an added token at 600 would index past embed_tokens."""
    def tokenizer(tok):
        tok["added_tokens"].append(dict(tok["added_tokens"][-1], id=600, content="<|far|>"))

    model = copy_model(tiny, tmp_path / "far-token", tokenizer=tokenizer)
    with pytest.raises(TmxError, match=re.escape(
            f"{model}/tokenizer.json: token id 600 is not below the model's vocab_size (576, "
            f"{model}/config.json)")):
        Engine(model)


def test_tensors_the_model_does_not_read_are_named(tiny, tmp_path):
    """config.json that describes one layer fewer than the weights: the last layer's tensors
    are loaded by nothing, and tmx says so (it still runs the model the config describes)."""
    model = copy_model(tiny, tmp_path / "fewer-layers")
    path = os.path.join(model, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    last = cfg["num_hidden_layers"] - 1
    cfg["num_hidden_layers"] = last
    cfg["layer_types"] = cfg["layer_types"][:last]
    with open(path, "w") as f:
        json.dump(cfg, f)
    r = subprocess.run([os.path.join(BIN_DIR, "tmx"), "generate", "--model", model, "--prompt",
                        PROMPTS[0], "-n", "1"], capture_output=True, text=True, check=True)
    assert re.search(rf"warning: {re.escape(model)}: \d+ tensors of the checkpoint are not used "
                     rf"by the model that config.json describes \(the first: model\.layers\."
                     rf"{last}\.", r.stderr), r.stderr
    r = subprocess.run([os.path.join(BIN_DIR, "tmx"), "generate", "--model", tiny, "--prompt",
                        PROMPTS[0], "-n", "1"], capture_output=True, text=True, check=True)
    assert "not used" not in r.stderr


def test_inspect_fails_on_a_quant_config_that_does_not_read(tiny, tmp_path):
    model = copy_model(tiny, tmp_path / "bad-quant-config")
    with open(os.path.join(model, "hf_quant_config.json"), "w") as f:
        f.write('{"codec": 5}')
    r = subprocess.run([os.path.join(BIN_DIR, "tmx"), "inspect", model, "--no-tensors"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "codec unknown" in r.stdout
    assert r.stderr == f'tmx inspect: {model}/hf_quant_config.json: field "codec" must be a ' \
                       'string\n'
