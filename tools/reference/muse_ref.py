#!/usr/bin/env python3
"""Float64 numpy reference of the Muse graph described in docs/model.md.

It is written from that document alone, one function per block, for clarity rather than speed,
and it is what tmx's engine is checked against.

    python3 tools/reference/muse_ref.py MODEL_DIR --prompt TEXT -n N [--bos] [--logits OUT.npy]
    python3 tools/reference/muse_ref.py MODEL_DIR --ids 1,2,3 -n N

prints the greedy continuation's ids and text; --logits saves the prompt's logits [n][n_vocab].

As a library:
    model = load(model_dir)
    logits = model.forward(ids)          # [len(ids)][n_vocab], full sequence, from scratch
    ids = model.greedy(prompt_ids, n)    # n greedy tokens, with a KV cache
"""
import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import safetensors_io  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Checkpoint reading


def read_safetensors(path):
    """{name: float64 array} of one .safetensors file. BF16 and F16 widen exactly."""
    tensors, _ = safetensors_io.load_file(path)
    out = {}
    for name, a in tensors.items():
        if a.dtype == np.uint16:
            a = safetensors_io.bf16_bits_to_f32(a)
        elif a.dtype not in (np.float16, np.float32):
            raise ValueError(f"{path}: tensor {name}: dtype {a.dtype} is not F32, BF16 or F16")
        out[name] = a.astype(np.float64)
    return out


def read_checkpoint(model_dir):
    """All tensors of model.safetensors, or of the shards model.safetensors.index.json lists."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(model_dir, "model.safetensors"))
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for shard in shards:
        tensors.update(read_safetensors(os.path.join(model_dir, shard)))
    return tensors


def tokenizer_size(model_dir):
    """Largest id of tokenizer.json (vocab and added tokens) + 1, or None without one."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        tok = json.load(f)
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]
    return max(ids) + 1


# ---------------------------------------------------------------------------------------------
# Configuration: docs/model.md's table, defaults included


class Config:
    def __init__(self, c):
        model_type = c["model_type"]
        if model_type == "qwen3":
            model_type = "llama"
        if model_type not in ("muse_spark", "llama"):
            raise ValueError(f"config.json: model_type {model_type!r} not supported")
        self.model_type = model_type
        self.vocab_size = c["vocab_size"]
        self.hidden = c["hidden_size"]
        self.n_layers = c["num_hidden_layers"]
        self.n_heads = c["num_attention_heads"]
        self.n_kv_heads = c.get("num_key_value_heads", self.n_heads)
        self.head_dim = c.get("head_dim") or self.hidden // self.n_heads
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.tie_word_embeddings = c.get("tie_word_embeddings", False)
        self.rope_theta = c.get("rope_theta", 10000.0)
        self.rope_local_theta = c.get("rope_local_theta", self.rope_theta)
        self.rope_scaling = c.get("rope_scaling")
        self.max_position_embeddings = c.get("max_position_embeddings", 4096)
        if model_type == "llama":
            self.sliding = [False] * self.n_layers
            self.dense = [True] * self.n_layers
            self.residual_gates = False
        else:
            types = c.get("layer_types") or ["full_attention"] * self.n_layers
            if len(types) != self.n_layers or \
                    not set(types) <= {"sliding_attention", "full_attention"}:
                raise ValueError("config.json: layer_types needs one "
                                 "sliding_attention/full_attention per layer")
            self.sliding = [t == "sliding_attention" for t in types]
            dense = set(c.get("dense_layers", []))
            self.dense = [i in dense for i in range(self.n_layers)]
            self.residual_gates = c.get("residual_gates", False)
        self.sliding_window = c.get("sliding_window") if any(self.sliding) else None
        if any(self.sliding) and not self.sliding_window:
            raise ValueError("config.json: sliding_window is required with sliding layers")
        if self.n_heads % self.n_kv_heads:
            raise ValueError("config.json: num_key_value_heads must divide num_attention_heads")
        self.intermediate = c.get("intermediate_size")
        self.n_experts = c.get("n_routed_experts")
        self.top_k = c.get("num_experts_per_tok")
        self.n_shared = c.get("n_shared_experts", 0)
        self.routed_scaling = c.get("routed_scaling_factor", 1.0)
        self.norm_topk_prob = c.get("norm_topk_prob", True)
        self.router_score = c.get("router_score", "sigmoid")
        self.bos_token_id = c.get("bos_token_id")
        eos = c.get("eos_token_id")
        self.eos_token_ids = [] if eos is None else eos if isinstance(eos, list) else [eos]


# ---------------------------------------------------------------------------------------------
# Blocks


def silu(v):
    return v / (1.0 + np.exp(-v))


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def softmax(v, axis=-1):
    e = np.exp(v - v.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def e4m3_round(x):
    """x rounded to the nearest E4M3 value, ties to even, saturating at ±448."""
    a = np.abs(x)
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -6)))        # subnormals share 2^-6's step
    step = 2.0 ** (e - 3)
    return np.sign(x) * np.minimum(np.rint(a / step) * step, 448.0)


def kv_round(x, dtype):
    """What a KV cache of `dtype` gives back for rows x [..][hd]: bf16 rounds each value; fp8
    and int8 divide each row by amax / 448 or amax / 127 and round (int8 clamped to ±127)."""
    if dtype == "f32":
        return x
    if dtype == "bf16":
        b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).astype(np.uint32)
        return b.view(np.float32).astype(np.float64)
    top = {"fp8": 448.0, "int8": 127.0}[dtype]
    s = np.abs(x).max(axis=-1, keepdims=True) / top
    safe = np.where(s == 0, 1.0, s)
    q = e4m3_round(x / safe) if dtype == "fp8" else np.clip(np.rint(x / safe), -127, 127)
    return q * s


def rmsnorm(v, w, eps):
    """v / sqrt(mean(v²) + eps) * w over the last axis."""
    return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * w


def rope_inv_freq(head_dim, theta, scaling):
    """θ^(-2i/head_dim) for i < head_dim/2, with linear or Llama 3 scaling applied."""
    inv_freq = theta ** (-np.arange(0, head_dim // 2, dtype=np.float64) * 2.0 / head_dim)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Wavelengths shorter than original_ctx/high_freq_factor keep their frequency, longer
        # than original_ctx/low_freq_factor are divided by factor, and in between the two are
        # blended linearly in original_ctx/wavelength.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        original_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2.0 * math.pi / inv_freq
        smooth = np.clip((original_ctx / wavelen - low) / (high - low), 0.0, 1.0)
        return (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
    raise ValueError(f"config.json: rope_scaling type {kind!r} not supported")


def rope(x, positions, inv_freq):
    """Rotate-half RoPE on x [n][heads][head_dim]: the pair (i, i + head_dim/2) of position p
    turns by p·inv_freq[i]."""
    angle = positions[:, None] * inv_freq[None, :]         # [n][head_dim/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(q, k, v, q_pos, k_pos, window):
    """Causal GQA attention. q [n][n_heads][hd]; k, v [m][n_kv_heads][hd] hold every position
    so far (k_pos). A query at p sees keys j <= p, and only j > p - window if window is set."""
    n_heads, hd = q.shape[1], q.shape[2]
    group = n_heads // k.shape[1]
    k = np.repeat(k, group, axis=1)                        # query head h reads KV head h // group
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)  # [n_heads][n][m]
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    scores = np.where(visible[None], scores, -np.inf)
    return np.einsum("hqk,khd->qhd", softmax(scores), v)    # [n][n_heads][hd]


def swiglu(x, gate, up, down):
    """down(silu(gate(x)) ⊙ up(x)), weights in [out][in] layout."""
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def route(x, router, bias, cfg):
    """Top-k experts of each token and their weights: ([n][k] ids, [n][k] weights). The bias
    only selects; ties go to the lower expert index."""
    logits = x @ router.T                                   # [n][n_experts]
    s = softmax(logits) if cfg.router_score == "softmax" else sigmoid(logits)
    # A stable sort of -(s + bias) keeps equal keys in index order.
    chosen = np.argsort(-(s + bias), axis=-1, kind="stable")[:, :cfg.top_k]
    w = np.take_along_axis(s, chosen, axis=-1)
    if cfg.norm_topk_prob:
        w = w / w.sum(axis=-1, keepdims=True)
    return chosen, w * cfg.routed_scaling


def moe(x, t, p, cfg):
    """Routed experts in the bridge latent, plus the shared expert on x. x [n][hidden]."""
    chosen, weight = route(x, t[p + "router.weight"], t[p + "router.correction_bias"], cfg)
    z = x @ t[p + "bridge_in.weight"].T                     # [n][latent]
    y = np.zeros_like(z)
    for e in np.unique(chosen):
        rows, slot = np.nonzero(chosen == e)
        ep = p + f"experts.{e}."
        y_e = swiglu(z[rows], t[ep + "gate_proj.weight"], t[ep + "up_proj.weight"],
                     t[ep + "down_proj.weight"])
        y_e = rmsnorm(y_e, t[p + "post_expert_norm.weight"], cfg.eps)
        y[rows] += weight[rows, slot][:, None] * y_e
    m = y @ t[p + "bridge_out.weight"].T
    if cfg.n_shared:
        sp = p + "shared_experts."
        m += swiglu(x, t[sp + "gate_proj.weight"], t[sp + "up_proj.weight"],
                    t[sp + "down_proj.weight"])
    return m


# ---------------------------------------------------------------------------------------------
# Model


class Cache:
    """Keys (after RoPE) and values of every position seen, per layer."""

    def __init__(self, n_layers):
        self.k = [None] * n_layers                          # [pos][n_kv_heads][hd]
        self.v = [None] * n_layers
        self.n = 0


class Model:
    def __init__(self, cfg, tensors, n_vocab, kv_dtype="f32"):
        self.cfg = cfg
        self.kv_dtype = kv_dtype
        self.t = tensors
        self.n_vocab = n_vocab
        self.inv_freq_full = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.inv_freq_local = rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, cfg.rope_scaling)
        self.lm_head = tensors["model.embed_tokens.weight"] if cfg.tie_word_embeddings \
            else tensors["lm_head.weight"]

    def attention_block(self, layer, x, positions, cache):
        cfg, t = self.cfg, self.t
        p = f"model.layers.{layer}.self_attn."
        n = x.shape[0]
        q = (x @ t[p + "q_proj.weight"].T).reshape(n, cfg.n_heads, cfg.head_dim)
        k = (x @ t[p + "k_proj.weight"].T).reshape(n, cfg.n_kv_heads, cfg.head_dim)
        v = (x @ t[p + "v_proj.weight"].T).reshape(n, cfg.n_kv_heads, cfg.head_dim)
        if p + "q_norm.weight" in t:
            q = rmsnorm(q, t[p + "q_norm.weight"], cfg.eps)
        if p + "k_norm.weight" in t:
            k = rmsnorm(k, t[p + "k_norm.weight"], cfg.eps)
        sliding = cfg.sliding[layer]
        inv_freq = self.inv_freq_local if sliding else self.inv_freq_full
        q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)
        k, v = kv_round(k, self.kv_dtype), kv_round(v, self.kv_dtype)
        if cache.k[layer] is not None:
            k = np.concatenate([cache.k[layer], k])
            v = np.concatenate([cache.v[layer], v])
        cache.k[layer], cache.v[layer] = k, v
        a = attention(q, k, v, positions, np.arange(k.shape[0], dtype=np.float64),
                      cfg.sliding_window if sliding else None)
        return a.reshape(n, -1) @ t[p + "o_proj.weight"].T

    def mlp_block(self, layer, x):
        t = self.t
        p = f"model.layers.{layer}.mlp."
        if self.cfg.dense[layer]:
            return swiglu(x, t[p + "gate_proj.weight"], t[p + "up_proj.weight"],
                          t[p + "down_proj.weight"])
        return moe(x, t, p, self.cfg)

    def step(self, ids, cache):
        """Runs ids at the positions after the cache's; returns their logits [n][n_vocab]."""
        cfg, t = self.cfg, self.t
        positions = np.arange(cache.n, cache.n + len(ids), dtype=np.float64)
        h = t["model.embed_tokens.weight"][np.asarray(ids)]    # [n][hidden]
        for layer in range(cfg.n_layers):
            p = f"model.layers.{layer}."
            x = rmsnorm(h, t[p + "input_layernorm.weight"], cfg.eps)
            a = self.attention_block(layer, x, positions, cache)
            h = h + (t[p + "attn_gate"] * a if cfg.residual_gates else a)
            x = rmsnorm(h, t[p + "post_attention_layernorm.weight"], cfg.eps)
            m = self.mlp_block(layer, x)
            h = h + (t[p + "mlp_gate"] * m if cfg.residual_gates else m)
        cache.n += len(ids)
        logits = rmsnorm(h, t["model.norm.weight"], cfg.eps) @ self.lm_head.T
        return logits[:, :self.n_vocab]

    def forward(self, ids):
        """Logits [len(ids)][n_vocab] of a whole sequence starting at position 0."""
        return self.step(ids, Cache(self.cfg.n_layers))

    def greedy(self, prompt_ids, n, stop=()):
        """n argmax tokens after the prompt (fewer if one of `stop` comes out; it is kept)."""
        cache = Cache(self.cfg.n_layers)
        logits = self.step(prompt_ids, cache)[-1]
        out = []
        while len(out) < n:
            token = int(np.argmax(logits))
            out.append(token)
            if token in stop:
                break
            logits = self.step([token], cache)[-1]
        return out


def load(model_dir, kv_dtype="f32"):
    """kv_dtype: the KV cache's dtype to model (f32, bf16, fp8, int8)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = Config(json.load(f))
    tensors = read_checkpoint(model_dir)
    n_vocab = tokenizer_size(model_dir) or cfg.vocab_size
    return Model(cfg, tensors, min(n_vocab, cfg.vocab_size), kv_dtype)


# ---------------------------------------------------------------------------------------------
# Command line


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text, encoded with tokenizer.json (special tokens parsed)")
    src.add_argument("--ids", help="comma-separated prompt ids")
    ap.add_argument("--bos", action="store_true", help="prepend bos_token_id to the prompt")
    ap.add_argument("-n", type=int, default=16, help="tokens to generate")
    ap.add_argument("--logits", help="save the prompt's logits [n][n_vocab] as .npy")
    args = ap.parse_args()

    model = load(args.model_dir)
    tokenizer = None
    if os.path.exists(os.path.join(args.model_dir, "tokenizer.json")):
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(os.path.join(args.model_dir, "tokenizer.json"))
    if args.prompt is not None:
        if tokenizer is None:
            sys.exit(f"{args.model_dir}: no tokenizer.json to encode --prompt with")
        ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids
    else:
        ids = [int(s) for s in args.ids.split(",") if s.strip()]
    if args.bos:
        if model.cfg.bos_token_id is None:
            sys.exit(f"{args.model_dir}/config.json: --bos needs bos_token_id")
        ids = [model.cfg.bos_token_id] + ids
    if args.logits:
        np.save(args.logits, model.forward(ids))
    out = model.greedy(ids, args.n)
    print("prompt:", ",".join(map(str, ids)))
    print("ids:", ",".join(map(str, out)))
    if tokenizer is not None:
        print("text:", repr(tokenizer.decode(out, skip_special_tokens=False)))


if __name__ == "__main__":
    main()
