#!/usr/bin/env python3
"""Writes a random-weight Muse checkpoint in the Hugging Face layout.

    python3 tools/make_tiny_model.py OUT_DIR [--seed N] [--dtype f32|bf16]
                                     [--preset tiny|30m|llama] [--shards N]

OUT_DIR gets config.json, model.safetensors (or N shards and model.safetensors.index.json),
tokenizer.json, tokenizer_config.json and generation_config.json. The output is a pure
function of the arguments: the tokenizer is trained here on an embedded public-domain text
and the weights come from numpy's default_rng(seed).

Presets (docs/model.md names every field):
  tiny  every Muse feature switched on at toy size (~1.8M parameters): hybrid sliding/full
        attention with a window smaller than test prompts, q/k norms, residual gates, one
        dense layer, routed experts behind bridges with correction bias and post-expert norm,
        a shared expert. Widths are multiples of 128 so the trellis codecs can quantize them.
  30m   the same architecture at ~30M parameters, for CPU benchmarks.
"""
import argparse
import collections
import json
import os
import sys

import numpy as np
import regex

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE trained on a fixed public-domain text

# Lincoln's Gettysburg Address (1863), the Preamble of the US Constitution (1787) and the
# opening of Dickens' A Tale of Two Cities (1859): all public domain.
TRAINING_TEXT = """\
Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal.
Now we are engaged in a great civil war, testing whether that nation, or any nation so \
conceived and so dedicated, can long endure. We are met on a great battle-field of that war. \
We have come to dedicate a portion of that field, as a final resting place for those who here \
gave their lives that that nation might live. It is altogether fitting and proper that we \
should do this.
But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- \
this ground. The brave men, living and dead, who struggled here, have consecrated it, far \
above our poor power to add or detract. The world will little note, nor long remember what \
we say here, but it can never forget what they did here. It is for us the living, rather, to \
be dedicated here to the unfinished work which they who fought here have thus far so nobly \
advanced. It is rather for us to be here dedicated to the great task remaining before us -- \
that from these honored dead we take increased devotion to that cause for which they gave the \
last full measure of devotion -- that we here highly resolve that these dead shall not have \
died in vain -- that this nation, under God, shall have a new birth of freedom -- and that \
government of the people, by the people, for the people, shall not perish from the earth.
We the People of the United States, in Order to form a more perfect Union, establish Justice, \
insure domestic Tranquility, provide for the common defence, promote the general Welfare, and \
secure the Blessings of Liberty to ourselves and our Posterity, do ordain and establish this \
Constitution for the United States of America.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age \
of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season \
of Light, it was the season of Darkness, it was the spring of hope, it was the winter of \
despair, we had everything before us, we had nothing before us, we were all going direct to \
Heaven, we were all going direct the other way -- in short, the period was so far like the \
present period, that some of its noisiest authorities insisted on its being received, for \
good or for evil, in the superlative degree of comparison only.
In 1787 and in 1863, in 1859 and in 2024: 42 men, 7 years, 100 days. "Yes," he said; 'no.'
"""

# The GPT-4 (cl100k) pre-tokenizer split: contractions, letter runs with one leading
# non-letter, digit groups of up to three, punctuation runs, newlines and other whitespace.
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

N_MERGES = 250
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start|>", "<|end|>",
                  "<|image|>", "<|video|>", "<|audio|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")


def byte_to_unicode():
    """The byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68
    bytes (controls, space, 0x7f-0xa0, 0xad) map to U+0100 upwards in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xa1, 0xac + 1)) \
        + list(range(0xae, 0xff + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def train_bpe(text, n_merges):
    """Classic BPE over pre-split words: merge the most frequent adjacent pair, ties going to
    the pair with the lower ids. Returns the merges as (left id, right id), in order; token
    256 + i is merge i, tokens 0..255 are the bytes."""
    words = collections.Counter(tuple(w.encode()) for w in regex.findall(SPLIT_REGEX, text))
    words = [(list(w), n) for w, n in sorted(words.items())]
    merges = []
    for new_id in range(256, 256 + n_merges):
        pairs = collections.Counter()
        for w, n in words:
            for pair in zip(w, w[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w, _ in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i:i + 2] = [new_id]
                i += 1
    return merges


def build_tokenizer():
    """Returns (tokenizer.json object, {special token: id}, number of ids)."""
    b2u = byte_to_unicode()
    token_bytes = [bytes([b]) for b in range(256)]
    merges = train_bpe(TRAINING_TEXT, N_MERGES)
    for left, right in merges:
        token_bytes.append(token_bytes[left] + token_bytes[right])

    def show(bs):
        return "".join(b2u[b] for b in bs)

    vocab = {show(bs): i for i, bs in enumerate(token_bytes)}
    special = {tok: len(token_bytes) + i for i, tok in enumerate(SPECIAL_TOKENS)}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": tok, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for tok, i in special.items()],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT_REGEX}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab,
                  "merges": [show(token_bytes[a]) + " " + show(token_bytes[b])
                             for a, b in merges]},
    }
    return tokenizer, special, len(token_bytes) + len(special)


# ---------------------------------------------------------------------------------------------
# Model configuration

def preset_config(preset, n_tokens, special):
    """config.json for a preset. vocab_size is the tokenizer's size rounded up to a multiple of
    64, so the checkpoint has padded embedding/head rows that logits must drop."""
    vocab_size = (n_tokens + 63) // 64 * 64
    if preset == "llama":
        # A dense Llama-family model: every layer dense with full attention, tied embeddings and
        # Llama 3.1 RoPE scaling, so that path of the graph is checked too.
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": vocab_size, "hidden_size": 128, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "intermediate_size": 256, "max_position_embeddings": 1024, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
            "bos_token_id": special["<|begin_of_text|>"],
            "eos_token_id": special["<|end_of_text|>"],
        }
    if preset == "tiny":
        shape = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32,
                     layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                  "sliding_attention"],
                     sliding_window=16, intermediate_size=256, n_routed_experts=8,
                     num_experts_per_tok=2, moe_latent_size=128, moe_intermediate_size=128,
                     max_position_embeddings=1024)
    else:
        shape = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=64,
                     layer_types=["full_attention" if i % 4 == 3 else "sliding_attention"
                                  for i in range(8)],
                     sliding_window=128, intermediate_size=1024, n_routed_experts=16,
                     num_experts_per_tok=2, moe_latent_size=256, moe_intermediate_size=256,
                     max_position_embeddings=4096)
    return {
        "architectures": ["MuseSparkForCausalLM"],
        "model_type": "muse_spark",
        "vocab_size": vocab_size,
        **shape,
        "rope_theta": 10000.0,
        "rope_local_theta": 1000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "dense_layers": [0],
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "router_score": "sigmoid",
        "residual_gates": True,
        "bos_token_id": special["<|begin_of_text|>"],
        "eos_token_id": [special["<|end_of_text|>"], special["<|end|>"]],
        "image_token_id": special["<|image|>"],
        "video_token_id": special["<|video|>"],
        "audio_token_id": special["<|audio|>"],
    }


# ---------------------------------------------------------------------------------------------
# Random weights
#
# Matrices are N(0, 1/fan_in) so every projection keeps its input's scale; embeddings are
# N(0, 1) so the residual stream starts at RMS 1. Norm weights are 1 + small noise and residual
# gates lie in [0.5, 1.5], so each one is exercised without blowing up the residual stream.
# Attention outputs are scaled up a little so that context, not only the current token,
# steers the next-token choice and greedy text does not fall into a short cycle. The router
# correction bias is about a quarter of the spread of the sigmoid scores: it changes roughly a
# third of the selections while every expert still gets tokens.
ATTN_OUT_GAIN = 2.0
LM_HEAD_GAIN = 2.0
CORRECTION_BIAS_STD = 0.05


def make_weights(cfg, rng):
    """Returns {tensor name: float32 array} in a fixed order (the order draws are made)."""
    hid, hd = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    muse = cfg["model_type"] == "muse_spark"
    lat, mi = cfg.get("moe_latent_size", 0), cfg.get("moe_intermediate_size", 0)
    shared = cfg.get("n_shared_experts", 0) * mi
    dense_layers = cfg["dense_layers"] if muse else range(cfg["num_hidden_layers"])
    w = {}

    def linear(name, rows, cols, gain=1.0):
        w[name] = rng.standard_normal((rows, cols)) * (gain / np.sqrt(cols))

    def norm(name, n):
        w[name] = 1.0 + 0.1 * rng.standard_normal(n)

    def gate(name, n):
        w[name] = rng.uniform(0.5, 1.5, n)

    w["model.embed_tokens.weight"] = rng.standard_normal((cfg["vocab_size"], hid))
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        norm(p + "input_layernorm.weight", hid)
        linear(p + "self_attn.q_proj.weight", nq * hd, hid)
        linear(p + "self_attn.k_proj.weight", nkv * hd, hid)
        linear(p + "self_attn.v_proj.weight", nkv * hd, hid)
        linear(p + "self_attn.o_proj.weight", hid, nq * hd, gain=ATTN_OUT_GAIN)
        if muse:
            norm(p + "self_attn.q_norm.weight", hd)
            norm(p + "self_attn.k_norm.weight", hd)
            gate(p + "attn_gate", hid)
        norm(p + "post_attention_layernorm.weight", hid)
        if muse:
            gate(p + "mlp_gate", hid)
        if layer in dense_layers:
            inter = cfg["intermediate_size"]
            linear(p + "mlp.gate_proj.weight", inter, hid)
            linear(p + "mlp.up_proj.weight", inter, hid)
            linear(p + "mlp.down_proj.weight", hid, inter)
            continue
        n_exp = cfg["n_routed_experts"]
        linear(p + "mlp.router.weight", n_exp, hid)
        w[p + "mlp.router.correction_bias"] = CORRECTION_BIAS_STD * rng.standard_normal(n_exp)
        linear(p + "mlp.bridge_in.weight", lat, hid)
        linear(p + "mlp.bridge_out.weight", hid, lat)
        for e in range(n_exp):
            linear(p + f"mlp.experts.{e}.gate_proj.weight", mi, lat)
            linear(p + f"mlp.experts.{e}.up_proj.weight", mi, lat)
            linear(p + f"mlp.experts.{e}.down_proj.weight", lat, mi)
        norm(p + "mlp.post_expert_norm.weight", lat)
        if shared:
            linear(p + "mlp.shared_experts.gate_proj.weight", shared, hid)
            linear(p + "mlp.shared_experts.up_proj.weight", shared, hid)
            linear(p + "mlp.shared_experts.down_proj.weight", hid, shared)
    norm("model.norm.weight", hid)
    if not cfg["tie_word_embeddings"]:
        linear("lm_head.weight", cfg["vocab_size"], hid, gain=LM_HEAD_GAIN)
    return {name: a.astype(np.float32) for name, a in w.items()}


def count_parameters(cfg, weights):
    """(total, active per token): a token runs num_experts_per_tok of the routed experts."""
    total = sum(a.size for a in weights.values())
    if cfg["model_type"] != "muse_spark":
        return total, total
    idle = cfg["n_routed_experts"] - cfg["num_experts_per_tok"]
    expert = sum(weights[f"model.layers.{layer}.mlp.experts.0.{proj}_proj.weight"].size
                 for layer in range(cfg["num_hidden_layers"]) if layer not in cfg["dense_layers"]
                 for proj in ("gate", "up", "down"))
    return total, total - idle * expert


# ---------------------------------------------------------------------------------------------
# Output files

def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_weights(out_dir, weights, dtype, n_shards):
    """model.safetensors, or n_shards files of about equal size plus the index that maps each
    tensor to its shard. The router correction bias stays F32 in every dtype."""
    stored = {}
    for name, a in weights.items():
        stored[name] = a if dtype == "f32" or name.endswith("correction_bias") \
            else safetensors_io.Bf16(a)
    meta = {"format": "pt"}
    if n_shards == 1:
        safetensors_io.save_file(os.path.join(out_dir, "model.safetensors"), stored, meta)
        return
    names = list(stored)
    total = sum(safetensors_io.nbytes(stored[n]) for n in names)
    shard_of, acc = {}, 0
    for name in names:
        shard_of[name] = min(acc * n_shards // total, n_shards - 1)
        acc += safetensors_io.nbytes(stored[name])
    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    for i, fname in enumerate(files):
        part = {n: stored[n] for n in names if shard_of[n] == i}
        safetensors_io.save_file(os.path.join(out_dir, fname), part, meta)
    write_json(os.path.join(out_dir, "model.safetensors.index.json"),
               {"metadata": {"total_size": total},
                "weight_map": {n: files[shard_of[n]] for n in names}})


def write_tokenizer_files(out_dir, tokenizer, special, max_length):
    """tokenizer.json has no post-processor, so encoding adds no BOS; the chat template
    writes it."""
    write_json(os.path.join(out_dir, "tokenizer.json"), tokenizer)
    write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for tok, i in special.items()},
    })


def main():
    ap = argparse.ArgumentParser(description="Write a random-weight Muse checkpoint.")
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--preset", choices=["tiny", "30m", "llama"], default="tiny")
    ap.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    args = ap.parse_args()
    if args.shards < 1:
        ap.error("--shards must be at least 1")

    tokenizer, special, n_tokens = build_tokenizer()
    cfg = preset_config(args.preset, n_tokens, special)
    cfg["torch_dtype"] = "float32" if args.dtype == "f32" else "bfloat16"
    weights = make_weights(cfg, np.random.default_rng(args.seed))

    os.makedirs(args.out_dir, exist_ok=True)
    write_json(os.path.join(args.out_dir, "config.json"), cfg)
    write_json(os.path.join(args.out_dir, "generation_config.json"), {
        "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
        "do_sample": False})
    write_tokenizer_files(args.out_dir, tokenizer, special, cfg["max_position_embeddings"])
    write_weights(args.out_dir, weights, args.dtype, args.shards)
    total, active = count_parameters(cfg, weights)
    print(f"{args.out_dir}: {cfg['model_type']} preset {args.preset}, {args.dtype}, seed {args.seed}: "
          f"{total:,} parameters ({active:,} active per token), {n_tokens} tokenizer ids, "
          f"vocab_size {cfg['vocab_size']}")


if __name__ == "__main__":
    main()
