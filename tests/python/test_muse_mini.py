"""muse-mini, the model tools/train/ trains: its tokenizer and chat template in tmx, and its
checkpoint in tmx and in the numpy reference against the PyTorch logits saved when it was
exported.

The logits part needs models/muse-mini (committed after the GPU run) and the run's report,
tests/fixtures/muse-mini/muse-mini-run.json, whose "fixture" holds three prompts' ids, the
top-32 ids and logits of every position and the whole last row, computed in float32 by PyTorch
from the exported BF16 weights. It skips while models/muse-mini is absent. MUSE_MINI_MODEL and
MUSE_MINI_FIXTURE point it elsewhere (e.g. at a `train.py --smoke` export).

Bound: max |got - want| / max |want| <= 1e-4 over every stored logit of a prompt, as
tests/python/test_model.py bounds the engine against the reference; and no logit outside a
position's stored top-32 may exceed its 32nd by more than that. Needs numpy and a built tmx only.

The default model: tools/make_default_models.sh makes the K3 E4M3 build from models/muse-mini
(once per module, in a temporary folder, about a minute on 2 cores); the script keeps a build
that verifies, `tmx serve` without --model serves it as "muse-mini-trellismx-k3", and its KL
divergence from the teacher on held-out books stays near the measured one (docs/perf/fidelity.md).
"""
import ctypes as C
import json
import lzma
import os
import pathlib
import random
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from tmx_engine import BIN_DIR, Engine, lib

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "reference"))
sys.path.insert(0, str(REPO / "tools" / "train"))
sys.path.insert(0, str(REPO / "tools"))
import muse_ref  # noqa: E402
import tokenizer as tk  # noqa: E402

MODEL = pathlib.Path(os.environ.get("MUSE_MINI_MODEL", REPO / "models" / "muse-mini"))
FIXTURE = pathlib.Path(os.environ.get("MUSE_MINI_FIXTURE", REPO / "tests" / "fixtures" /
                                      "muse-mini" / "muse-mini-run.json"))
TOKENIZER = REPO / "tools" / "train" / "tokenizer.json"
REL_TOL = 1e-4
LIBC = C.CDLL(None)
LIBC.free.argtypes = [C.c_void_p]


def encode(text, special=True):
    """tmx's encoding of text with tools/train/tokenizer.json."""
    L = lib()
    P, Z = C.c_void_p, C.c_size_t
    L.tmx_tokenizer_load.argtypes = [C.c_char_p, C.POINTER(P), C.POINTER(P)]
    L.tmx_tokenizer_free.argtypes = [P]
    L.tmx_tokenizer_encode.argtypes = [P, C.c_char_p, Z, C.c_int,
                                       C.POINTER(C.POINTER(C.c_int32)), C.POINTER(Z), C.POINTER(P)]
    tok, err = P(), P()
    assert L.tmx_tokenizer_load(str(TOKENIZER).encode(), C.byref(tok), C.byref(err)) == 0
    data = text.encode()
    ids, n = C.POINTER(C.c_int32)(), Z()
    try:
        assert L.tmx_tokenizer_encode(tok, data, len(data), int(special), C.byref(ids),
                                      C.byref(n), C.byref(err)) == 0
        out = ids[:n.value]
        LIBC.free(ids)
    finally:
        L.tmx_tokenizer_free(tok)
    return out


# ---- tokenizer and chat template (always run) ------------------------------------------------


def test_tokenizer_matches_hf(shared_data):
    """tools/train/tokenizer.json: tmx's ids are the `tokenizers` package's, on held-out book
    text, WikiText and chat text with special tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    ref = tokenizers.Tokenizer.from_file(str(TOKENIZER))
    assert ref.get_vocab_size(with_added_tokens=True) == tk.VOCAB_SIZE
    text = lzma.open(shared_data / "gutenberg" / "heldout.txt.xz").read().decode()
    wiki = (shared_data / "eval" / "wiki.test.raw").read_bytes().decode()
    rng = random.Random(5)
    inputs = [tk.render_chat([{"role": "user", "content": "Hi <|image|> there"}], True),
              "numbers 1234567 and 3.14, \"quotes\" -- dashes\r\n\ttabs", "<|im_end|>x<|video|>"]
    for source in (text, wiki):
        for _ in range(60):
            n = int(2 ** rng.uniform(0, 12))
            start = rng.randrange(len(source) - n)
            inputs.append(source[start:start + n])
    for s in inputs:
        assert encode(s) == ref.encode(s, add_special_tokens=False).ids, s[:80]


def render_with_tmx(model_dir, context):
    """tokenizer_config.json's chat template rendered by tmx, with its bos/eos tokens."""
    L = lib()
    J = C.CDLL("libjansson.so.4")
    J.json_loads.restype = C.c_void_p
    J.json_loads.argtypes = [C.c_char_p, C.c_size_t, C.c_void_p]
    J.json_object_update.argtypes = [C.c_void_p, C.c_void_p]
    J.json_delete.argtypes = [C.c_void_p]
    P = C.c_void_p
    L.tmx_chat_template_load.argtypes = [C.c_char_p, C.POINTER(P), C.POINTER(P), C.POINTER(P)]
    L.tmx_template_render.argtypes = [P, P, P, C.POINTER(P), C.POINTER(C.c_size_t),
                                      C.POINTER(P)]
    L.tmx_template_free.argtypes = [P]
    tpl, special, err = P(), P(), P()
    assert L.tmx_chat_template_load(str(model_dir).encode(), C.byref(tpl), C.byref(special),
                                    C.byref(err)) == 0
    ctx = J.json_loads(json.dumps(context).encode(), 0, None)
    J.json_object_update(ctx, special)
    out, n = P(), C.c_size_t()
    try:
        assert L.tmx_template_render(tpl, ctx, None, C.byref(out), C.byref(n), C.byref(err)) == 0
        text = C.string_at(out.value, n.value).decode()
        LIBC.free(out)
    finally:
        J.json_delete(ctx)
        J.json_delete(special)
        L.tmx_template_free(tpl)
    return text


CONVERSATIONS = [
    [{"role": "user", "content": "Continue this passage:\nThe house was dark."}],
    [{"role": "system", "content": "You are a storyteller."},
     {"role": "user", "content": "Tell me a story."},
     {"role": "assistant", "content": "Once, long ago, there was a mill.\n\nIt burned."},
     {"role": "user", "content": "Go on. «ünïcode» \"quotes\" \\ back"}],
]


def test_chat_template_renders_as_training_data(tmp_path):
    """The template tokenizer_config.json ships renders, in tmx, exactly the text train.py
    trained on (tk.render_chat), and so does Python jinja2 where installed."""
    tk.write_tokenizer_files(str(tmp_path), str(TOKENIZER), 1024)
    for msgs in CONVERSATIONS:
        for gen in (True, False):
            want = tk.render_chat(msgs, gen)
            got = render_with_tmx(tmp_path, {"messages": msgs, "add_generation_prompt": gen})
            assert got == want
    pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    tpl = env.from_string(tk.CHAT_TEMPLATE)
    for msgs in CONVERSATIONS:
        assert tpl.render(messages=msgs, add_generation_prompt=True, bos_token=tk.BOS_TOKEN) \
            == tk.render_chat(msgs, True)


# ---- the trained checkpoint against the PyTorch logits ----------------------------------------


@pytest.fixture(scope="module")
def fixture():
    if not (MODEL / "config.json").exists():
        pytest.skip(f"{MODEL} is absent: it is trained on a GPU by tools/train/run_gpu.sh "
                    f"(tools/train/README.md)")
    assert FIXTURE.exists(), f"{FIXTURE} is missing: copy the run's muse-mini-run.json there"
    fx = json.loads(FIXTURE.read_text())["fixture"]
    assert "error" not in fx, f"{FIXTURE}: the run could not make the fixture: {fx['error']}"
    return fx


def check_logits(got, prompt, top):
    """got [n][n_vocab] against a fixture prompt: the stored top-k values and last row, and
    no other logit above a position's k-th."""
    ids = np.asarray(prompt["top_ids"])                       # [n][top]
    want = np.asarray(prompt["top_logits"], dtype=np.float64)
    last = np.asarray(prompt["last_logits"], dtype=np.float64)
    assert got.shape == (len(prompt["ids"]), len(last))
    scale = max(np.abs(want).max(), np.abs(last).max())
    err = np.abs(np.take_along_axis(got, ids, axis=1) - want).max() / scale
    assert err <= REL_TOL, f"top-{top} logits: max relative error {err:.2e}"
    err = np.abs(got[-1] - last).max() / scale
    assert err <= REL_TOL, f"last row: max relative error {err:.2e}"
    rest = got.copy()
    np.put_along_axis(rest, ids, -np.inf, axis=1)
    over = (rest.max(axis=1) - want[:, -1]).max() / scale
    assert over <= REL_TOL, f"a logit outside the top-{top} is above the {top}th by {over:.2e}"


def test_fixture_prompts_encode_alike(fixture):
    for p in fixture["prompts"]:
        ids = p["ids"][1:] if p["bos"] else p["ids"]
        assert encode(p["text"]) == ids, p["text"][:60]


def test_tmx_matches_pytorch(fixture):
    with Engine(str(MODEL), ["threads=2"]) as eng:
        for p in fixture["prompts"]:
            seq = eng.seq(n_ctx=1024)
            got = seq.forward(p["ids"]).astype(np.float64)
            seq.close()
            check_logits(got, p, fixture["top"])


def test_reference_matches_pytorch(fixture):
    ref = muse_ref.load(str(MODEL))
    for p in fixture["prompts"]:
        check_logits(ref.forward(p["ids"]), p, fixture["top"])


# ---- the default model: muse-mini's K3 build, made at set-up ----------------------------------

TMX = os.path.abspath(os.path.join(BIN_DIR, "tmx"))  # the server runs in another folder
DEFAULT_NAME = "muse-mini-trellismx-k3"


def make_default(out):
    return subprocess.run([str(REPO / "tools" / "make_default_models.sh"), "--tmx", TMX,
                           "--out", str(out), "--threads", "2"],
                          check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def default_root(tmp_path_factory):
    """A folder holding models/muse-mini-k3, made by tools/make_default_models.sh."""
    if not (REPO / "models" / "muse-mini" / "config.json").exists():
        pytest.skip("models/muse-mini is absent")
    root = tmp_path_factory.mktemp("default")
    make_default(root / "models")
    return root


def test_make_default_models_keeps_a_build_that_verifies(default_root):
    build = default_root / "models" / "muse-mini-k3"
    r = make_default(default_root / "models")
    assert f"{build}: present, matches its manifest" in r.stdout
    subprocess.run([TMX, "inspect", "--verify", str(build)], check=True, capture_output=True)
    report = json.loads((build / "quantize-report.json").read_text())
    assert report["codec"] == "trellis-e4m3" and report["bits"] == 3
    assert report["calibration"]["source"].endswith("tools/train/calib-books.txt")
    assert report["calibration"]["tokens"] == 16384
    assert not (default_root / "models" / "muse-mini-k3-fp4").exists()  # only with --fp4


def test_default_build_runs_its_experts_on_the_kernel_sets_threads(default_root):
    """kernels.cpu lends its pool to the codec (tmx_codec_i.use_threads): one set of threads."""
    build = default_root / "models" / "muse-mini-k3"
    r = subprocess.run([TMX, "generate", "--model", str(build), "--prompt", "Once", "-n", "2",
                        "--threads", "2", "--set", "log_level=debug"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "codec.trellis-e4m3 runs on kernel set cpu's 2 threads" in r.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def serve(cwd, *args):
    """tmx serve without --model, run in cwd; returns (process, base URL) once it answers."""
    port = free_port()
    proc = subprocess.Popen([TMX, "serve", "--port", str(port), "--threads", "2", *args],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"tmx serve exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            get_json(base + "/v1/models")
            return proc, base
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("tmx serve did not answer within 60 s")


def stop(proc):
    proc.terminate()
    assert proc.wait(timeout=60) == 0


def test_serve_without_model_serves_the_default(default_root):
    proc, base = serve(default_root)
    try:
        models = get_json(base + "/v1/models")["data"]
        assert [m["id"] for m in models] == [DEFAULT_NAME]
        body = json.dumps({"model": DEFAULT_NAME, "max_tokens": 16, "temperature": 0,
                           "messages": [{"role": "user", "content": "Tell me a story."}]})
        req = urllib.request.Request(base + "/v1/chat/completions", body.encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            choice = json.loads(r.read())["choices"][0]
        assert choice["message"]["content"].strip() and choice["finish_reason"] == "length"
    finally:
        stop(proc)
    proc, base = serve(default_root, "--served-model-name", "book-teller")
    try:
        assert [m["id"] for m in get_json(base + "/v1/models")["data"]] == ["book-teller"]
    finally:
        stop(proc)


def test_serve_without_model_or_default_names_the_script(tmp_path):
    if (REPO / "models" / "muse-mini-k3" / "config.json").exists():
        pytest.skip("the repository has models/muse-mini-k3: tmx serve would find and serve it")
    r = subprocess.run([TMX, "serve", "--port", str(free_port())], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "tmx serve: no --model given and the default model models/muse-mini-k3 is missing: "
        "make it with tools/make_default_models.sh, or pass --model DIR"]


def test_default_build_stays_close_to_the_teacher(default_root, shared_data, tmp_path):
    """Two 1,024-token windows of held-out books: the K3 E4M3 build's KL divergence and top-1
    agreement, and the teacher's loss there. docs/perf/fidelity.md measured KLD 0.03 and top-1
    89% on 20 windows; the bounds leave room for window-to-window spread, not for a broken
    codec (muse-tiny-like errors are 0.4 nats)."""
    text = tmp_path / "heldout.txt"
    text.write_bytes(lzma.open(shared_data / "gutenberg" / "heldout.txt.xz").read())
    out = tmp_path / "kld"
    subprocess.run([TMX, "eval-kld", "--teacher", str(REPO / "models" / "muse-mini"), "--model",
                    str(default_root / "models" / "muse-mini-k3"), "--text", str(text),
                    "--window", "1024", "--max-windows", "2", "--threads", "2", "--out",
                    str(out)], check=True, capture_output=True)
    h = json.loads((out / "summary.json").read_text())["headline"]
    assert h["rows"] == 2 * 1023
    assert 0 < h["kld"]["mean"] < 0.06
    assert h["top1"]["rate"] > 0.85
    assert 3.0 < h["nll"]["teacher"]["mean"] < 4.5
