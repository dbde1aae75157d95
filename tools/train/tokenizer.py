#!/usr/bin/env python3
"""muse-mini's tokenizer: a byte-level BPE of 8,192 ids trained on the Gutenberg training books,
and the chat format that goes with it.

    python3 tools/train/tokenizer.py [--data ../shared/data/gutenberg/train.txt.xz]
                                     [--sample-mb 40] [--out tools/train/tokenizer.json]

trains the tokenizer on the first --sample-mb MB of the decompressed training text (the books
are in shuffled order, so that is a few dozen books of every kind) and writes tokenizer.json.
The result is committed; training is deterministic, so rerunning it gives the same file.

As a library (train.py, the tests): SPECIAL_TOKENS and their ids, CHAT_TEMPLATE (Jinja, the one
tokenizer_config.json ships) and render_chat(), which writes the same text in Python so that
training data and the template agree (tests/python/test_muse_mini.py checks that tmx's template
engine renders CHAT_TEMPLATE exactly as render_chat does).
"""
import argparse
import hashlib
import json
import lzma
import os

# Ids 0..5, in this order: the trainer gives special tokens the first ids.
# <|endoftext|> separates documents and begins every training window and every chat (it is the
# BOS); <|im_start|>/<|im_end|> frame chat turns (ChatML); the media placeholders are where an
# image, audio clip or video enters the text stream.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image|>", "<|audio|>",
                  "<|video|>"]
ENDOFTEXT, IM_START, IM_END, IMAGE, AUDIO, VIDEO = range(len(SPECIAL_TOKENS))
BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
VOCAB_SIZE = 8192

# Llama 3's pre-split pattern: words with their leading space, digits in groups of up to three,
# punctuation runs, newlines.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# ChatML with the BOS in front: tmx serve adds no BOS to chat prompts, the template writes it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def render_chat(messages, add_generation_prompt):
    """What CHAT_TEMPLATE renders for messages [{"role", "content"}]."""
    out = [BOS_TOKEN]
    for m in messages:
        out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def build(texts):
    """A trained tokenizers.Tokenizer over an iterable of strings."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def sample_text(path, sample_mb):
    """The first sample_mb MB of the decompressed text, cut at a line end, as lines of ~1 MB."""
    with lzma.open(path) as f:
        data = f.read(sample_mb * 1_000_000).decode("utf-8", errors="ignore")
    data = data[:data.rfind("\n") + 1]
    return [data[i:i + 1_000_000] for i in range(0, len(data), 1_000_000)]


def write_tokenizer_files(out_dir, tokenizer_json_path, max_length):
    """tokenizer.json (copied) and tokenizer_config.json with the chat template into out_dir."""
    with open(tokenizer_json_path, encoding="utf-8") as f:
        text = f.read()
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(text)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": BOS_TOKEN,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)},
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(repo, "..", "shared", "data", "gutenberg",
                                                   "train.txt.xz"))
    ap.add_argument("--sample-mb", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(here, "tokenizer.json"))
    args = ap.parse_args()
    if not os.path.exists(args.data):
        ap.error(f"--data {args.data}: no such file")
    if args.sample_mb < 1:
        ap.error("--sample-mb must be at least 1")

    tok = build(sample_text(args.data, args.sample_mb))
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"special token {t} got id {tok.token_to_id(t)}"
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    tok.save(args.out)
    digest = hashlib.sha256(open(args.out, "rb").read()).hexdigest()
    print(f"{args.out}: {VOCAB_SIZE} ids, sha256 {digest[:16]}")


if __name__ == "__main__":
    main()
