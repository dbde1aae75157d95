"""The tokenizer (core/tokenizer*.c) through ctypes, against the outside implementations:
tiktoken for o200k_base.tiktoken, and Hugging Face `tokenizers` for byte-level BPE
tokenizer.json files trained here. Ids must match exactly; so must decoded text."""
import ctypes as C
import json
import lzma
import pathlib
import random

import pytest

tiktoken = pytest.importorskip("tiktoken")
tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers  # noqa: E402

SHARED_DATA = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data"
LIBC = C.CDLL(None)
LIBC.free.argtypes = [C.c_void_p]

# Llama 3's pre-split pattern, as its tokenizer.json writes it.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

HANDMADE = [
    "Hello, world!", "hello world", "  leading and trailing  ", "tabs\tand\nnewlines\r\n\r\nend",
    " " * 37, "\n\n\n", "a  b   c    d", " \t \n \u3000 x", "日本語のテキストと中文字符", "한국어 텍스트입니다",
    "emoji 🎉👍🏽👨‍👩‍👧‍👦 🇫🇷 done", "Ünïcödé àccents ÀÉÎ", "Ελληνικά και русский текст", "مرحبا بالعالم",
    "हिन्दी पाठ", "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; i++) { a[i] += b[i]; }",
    "numbers 1234567890 3.14159 1e-9 0x1F 10,000,000", "I'm sure they'll've DONE IT'S; we'D",
    "mixed 中文 and English and 123 数字 ok", "\u00a0nbsp\u2003em space\u3000ideographic",
    "combining e\u0301 a\u0308 o\u0302\u0323", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙", "zero\u200bwidth\u200djoiner",
    "a\x85b !\x85 \x85\x85 x", "<html><body class=\"x\">&amp;</body></html>", "C:\\path\\to\\file.txt",
    "https://example.com/a/b?c=d&e=f#g", "ALLCAPS and camelCaseWords and snake_case_words",
    "!!!???...,,,;;;", "'quoted' \"double\" `back`", "line\r\nline\rline\n", "\t\t\tindent",
    "100% of $5.00 is €4.50 or ¥700", "½ ¼ ¾ ① ② ③ Ⅻ", "x" * 300, "ab" * 150, "1" * 50,
]
SPECIAL_TEXTS = [
    "<|endoftext|>", "a<|endoftext|>b", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>", "<|im_start|", "x <|im_end|> y", "<think>why</think> so",
]


# ---- the binding ---------------------------------------------------------------------------


class Tokenizer:
    """libtmx's tokenizer: encode, decode and the streaming detokenizer."""

    def __init__(self, lib, path):
        P, S, Z, I32P = C.c_void_p, C.c_char_p, C.c_size_t, C.POINTER(C.c_int32)
        lib.tmx_tokenizer_load.argtypes = [S, C.POINTER(P), C.POINTER(P)]
        lib.tmx_tokenizer_free.argtypes = [P]
        lib.tmx_tokenizer_n_vocab.argtypes = [P]
        lib.tmx_tokenizer_encode.argtypes = [P, S, Z, C.c_int, C.POINTER(I32P), C.POINTER(Z),
                                             C.POINTER(P)]
        lib.tmx_tokenizer_decode.argtypes = [P, I32P, Z, C.POINTER(P), C.POINTER(Z), C.POINTER(P)]
        lib.tmx_detok_push.argtypes = [P, P, C.c_int32, P, Z]
        lib.tmx_detok_flush.argtypes = [P, P, Z]
        self.lib, self.handle, err = lib, P(), P()
        self._check(lib.tmx_tokenizer_load(str(path).encode(), C.byref(self.handle), C.byref(err)), err)
        self.n_vocab = lib.tmx_tokenizer_n_vocab(self.handle)

    @staticmethod
    def _check(status, err):
        if status != 0:
            msg = C.string_at(err.value).decode() if err.value else f"status {status}"
            LIBC.free(err)
            raise RuntimeError(msg)

    def close(self):
        self.lib.tmx_tokenizer_free(self.handle)

    def encode(self, text, special=False):
        data = text.encode() if isinstance(text, str) else text
        ids, n, err = C.POINTER(C.c_int32)(), C.c_size_t(), C.c_void_p()
        self._check(self.lib.tmx_tokenizer_encode(self.handle, data, len(data), int(special),
                                                  C.byref(ids), C.byref(n), C.byref(err)), err)
        out = ids[:n.value]
        LIBC.free(ids)
        return out

    def decode(self, ids):
        arr = (C.c_int32 * max(1, len(ids)))(*ids)
        text, n, err = C.c_void_p(), C.c_size_t(), C.c_void_p()
        self._check(self.lib.tmx_tokenizer_decode(self.handle, arr, len(ids), C.byref(text),
                                                  C.byref(n), C.byref(err)), err)
        out = C.string_at(text.value, n.value)
        LIBC.free(text)
        return out

    def stream(self, ids):
        """The chunks tmx_detok hands out for ids, one per push, then the flush."""
        state = (C.c_ubyte * 16)()  # struct tmx_detok: pending[8], int n_pending
        buf = C.create_string_buffer(4096)
        chunks = []
        for i in ids:
            n = self.lib.tmx_detok_push(self.handle, state, i, buf, len(buf))
            assert n >= 0, f"detok_push refused id {i}"
            chunks.append(buf.raw[:n])
        n = self.lib.tmx_detok_flush(state, buf, len(buf))
        chunks.append(buf.raw[:n])
        return chunks


@pytest.fixture(scope="module")
def open_tokenizer(libtmx):
    opened = []

    def open_(path):
        opened.append(Tokenizer(libtmx, path))
        return opened[-1]

    yield open_
    for tok in opened:
        tok.close()


# ---- inputs --------------------------------------------------------------------------------


def random_text(rng, n_chars):
    """Characters from many scripts, with spaces and newlines mixed in."""
    ranges = [(0x20, 0x7e), (0x20, 0x7e), (0x30, 0x39), (0x09, 0x0d), (0xa0, 0xff), (0x391, 0x3c9),
              (0x410, 0x44f), (0x300, 0x36f), (0x4e00, 0x9fff), (0x3040, 0x30ff), (0xac00, 0xd7a3),
              (0x1f300, 0x1faff), (0x1d400, 0x1d7ff), (0x600, 0x6ff), (0x900, 0x97f)]
    out = []
    for _ in range(n_chars):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def heldout_slices(shared_data, n=200):
    """n slices of the held-out books, from a few characters to a few pages."""
    text = lzma.open(shared_data / "gutenberg" / "heldout.txt.xz").read().decode()
    rng = random.Random(1234)
    slices = []
    for _ in range(n):
        length = int(2 ** rng.uniform(0, 13))
        start = rng.randrange(0, len(text) - length)
        slices.append(text[start:start + length])
    return slices


@pytest.fixture(scope="module")
def texts():
    rng = random.Random(42)
    return HANDMADE + [random_text(rng, rng.randint(0, 300)) for _ in range(100)]


@pytest.fixture(scope="module")
def heldout(shared_data):
    return heldout_slices(shared_data)


# ---- o200k_base.tiktoken against tiktoken --------------------------------------------------


@pytest.fixture(scope="module")
def o200k(shared_data, open_tokenizer):
    """(ours, tiktoken's) for the local o200k_base.tiktoken: tiktoken_ext's own definition of
    o200k_base (pattern, special tokens), with the file read from disk instead of the network."""
    import tiktoken.load
    import tiktoken_ext.openai_public as openai_public

    path = shared_data / "tokenizers" / "o200k_base.tiktoken"
    real_load = tiktoken.load.load_tiktoken_bpe
    openai_public.load_tiktoken_bpe = lambda url, expected_hash=None: real_load(str(path), expected_hash)
    try:
        spec = openai_public.o200k_base()
    finally:
        openai_public.load_tiktoken_bpe = real_load
    ref = tiktoken.Encoding("o200k_local", pat_str=spec["pat_str"],
                            mergeable_ranks=spec["mergeable_ranks"], special_tokens=spec["special_tokens"])
    return open_tokenizer(path), ref


def test_o200k_vocab(o200k):
    ours, ref = o200k
    assert ours.n_vocab == ref.n_vocab


def test_o200k_encode(o200k, texts, heldout):
    ours, ref = o200k
    for text in texts + heldout:
        assert ours.encode(text) == ref.encode_ordinary(text), text
        assert ours.decode(ours.encode(text)) == text.encode()


def test_o200k_special(o200k, texts):
    ours, ref = o200k
    for text in SPECIAL_TEXTS + [t + "<|endofprompt|>" + t for t in texts[:20]]:
        assert ours.encode(text, special=True) == ref.encode(text, allowed_special="all"), text
        assert ours.encode(text) == ref.encode_ordinary(text), text


def test_o200k_stream(o200k, texts):
    """Every chunk is whole UTF-8, and together they are Python's errors="replace" decode."""
    ours, _ = o200k
    rng = random.Random(7)
    inputs = [t.encode() for t in texts] + [rng.randbytes(rng.randint(0, 200)) for _ in range(200)]
    for data in inputs:
        ids = ours.encode(data)
        assert ours.decode(ids) == data
        chunks = ours.stream(ids)
        for chunk in chunks:
            chunk.decode("utf-8")  # strict: raises on a broken sequence
        assert b"".join(chunks) == data.decode("utf-8", errors="replace").encode()


# ---- tokenizer.json against Hugging Face tokenizers -----------------------------------------


def training_text():
    """Python's own sources (always there) and, when present, some Gutenberg training books."""
    import argparse
    import textwrap
    text = [pathlib.Path(m.__file__).read_text() for m in (argparse, textwrap, json.decoder)]
    text += HANDMADE
    if SHARED_DATA.is_dir():
        with lzma.open(SHARED_DATA / "gutenberg" / "train.txt.xz") as f:
            text.append(f.read(2_000_000).decode(errors="ignore"))
    return text


def train(pre_tokenizer, out, ignore_merges=False):
    """A ~1000-token byte-level BPE with special and added tokens, saved to out."""
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(), trainer)
    tok.add_tokens(["<think>", "</think>"])
    tok.save(str(out))
    return out


PRE_TOKENIZERS = {
    "split": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    "bytelevel": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "prefix_space": lambda: pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True),
}


@pytest.fixture(scope="module", params=sorted(PRE_TOKENIZERS))
def hf_json(request, tmp_path_factory):
    return train(PRE_TOKENIZERS[request.param](), tmp_path_factory.mktemp("tok") / "tokenizer.json")


def round_trips(path):
    """Whether decode(encode(text)) gives text back: not when a prefix space is added."""
    pre = json.loads(path.read_text())["pre_tokenizer"]
    return not (pre["type"] == "ByteLevel" and pre["add_prefix_space"])


def compare_with_hf(ours, path, inputs):
    ref = tokenizers.Tokenizer.from_file(str(path))
    assert ours.n_vocab == ref.get_vocab_size(with_added_tokens=True)
    for text in inputs:
        ids = ref.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, special=True) == ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False).encode(), text
        assert ours.decode(ids) == text.encode() or not round_trips(path)
    ref.encode_special_tokens = True  # special tokens as text; other added tokens still match
    for text in inputs:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text


def test_hf_json(hf_json, open_tokenizer, texts):
    compare_with_hf(open_tokenizer(hf_json), hf_json, texts + SPECIAL_TEXTS)


def test_hf_json_heldout(hf_json, open_tokenizer, heldout):
    compare_with_hf(open_tokenizer(hf_json), hf_json, heldout)


def test_hf_json_merge_spellings(hf_json, open_tokenizer, texts, tmp_path):
    """Merges as "a b" strings (older files) read the same as [a, b] pairs (newer files)."""
    doc = json.loads(hf_json.read_text())
    assert isinstance(doc["model"]["merges"][0], list)
    doc["model"]["merges"] = [" ".join(pair) for pair in doc["model"]["merges"]]
    strings = tmp_path / "strings.json"
    strings.write_text(json.dumps(doc, ensure_ascii=False))
    compare_with_hf(open_tokenizer(strings), strings, texts[:60])


def test_hf_json_ignore_merges(open_tokenizer, texts, tmp_path):
    """With ignore_merges, a word that is a whole token skips the merges (Llama 3)."""
    path = train(PRE_TOKENIZERS["split"](), tmp_path / "tokenizer.json", ignore_merges=True)
    assert json.loads(path.read_text())["model"]["ignore_merges"] is True
    compare_with_hf(open_tokenizer(path), path, texts + SPECIAL_TEXTS)


def test_hf_json_stream(hf_json, open_tokenizer, texts):
    ours = open_tokenizer(hf_json)
    rng = random.Random(11)
    inputs = [t.encode() for t in texts] + [rng.randbytes(rng.randint(0, 200)) for _ in range(100)]
    for data in inputs:
        ids = ours.encode(data)
        full = ours.decode(ids)
        assert full == data or not round_trips(hf_json)
        chunks = ours.stream(ids)
        for chunk in chunks:
            chunk.decode("utf-8")
        assert b"".join(chunks) == full.decode("utf-8", errors="replace").encode()


def test_hf_json_unsupported(open_tokenizer, hf_json, tmp_path):
    doc = json.loads(hf_json.read_text())
    doc["normalizer"] = {"type": "NFKC"}
    bad = tmp_path / "nfkc.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(RuntimeError, match=r"nfkc\.json: normalizer"):
        open_tokenizer(bad)
