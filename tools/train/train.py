#!/usr/bin/env python3
"""Trains muse-mini, a small model of the Muse architecture, on the Gutenberg books, and exports
it in the Hugging Face layout that tmx loads.

    python3 tools/train/train.py --data DATA_DIR --out OUT_DIR [--minutes M] [--smoke]
    python3 tools/train/train.py --count           # parameters of the real config, then exit

DATA_DIR holds train.txt.xz and heldout.txt.xz (../shared/data/gutenberg) and, if present,
wiki.test.raw (WikiText-2 test, ../shared/data/eval). Steps:

1. tokenize both splits with tools/train/tokenizer.json (encode_batch: every core);
2. pretrain with bf16 autocast, fused AdamW, linear warmup then cosine decay over WALL-CLOCK
   time; the last --chat-fraction of the time mixes in synthetic ChatML conversations (a user
   asks to continue a book passage or for a story, the assistant answers with book text; loss
   on the assistant's tokens only), so that the chat template means something;
3. round the weights to BF16 (what is exported) and write OUT/muse-mini/: config.json,
   generation_config.json, tokenizer.json, tokenizer_config.json, sharded safetensors;
4. measure the exported weights, in float32: held-out books and WikiText-2 loss, perplexity
   and bits per byte; a few sampled texts;
5. the logits fixture: float32 logits of three prompts on the CPU (top-32 per position and the
   whole last row), checked against tools/reference/muse_ref.py.
Everything except the checkpoint goes to OUT/muse-mini-run.json, so that OUT holds 8 files.

The model computes exactly the graph of docs/model.md (the function muse_ref.py computes); the
routed experts are evaluated densely (every expert on every token, weight 0 for the unchosen
ones), which gives the same function and needs no gather/scatter. The router's correction bias
is no parameter: after every step it moves by ±bias_rate towards balancing the experts' loads
(DeepSeek-V3's auxiliary-loss-free balancing).
"""
import argparse
import json
import lzma
import math
import os
import random
import sys
import time

T_START = time.time()           # before torch's import, which takes seconds of the budget

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tools", "reference"))
import safetensors_io  # noqa: E402
import tokenizer as tk  # noqa: E402

MIB = 1 << 20
SHARD_LIMIT = 15 * MIB          # bytes per safetensors shard: files come back at <= 16 MiB
PARAM_LIMIT = 16_000_000        # the checkpoint lives in git: <= 32 MB in BF16
EXPORT_NAME = "muse-mini"
REPORT_NAME = "muse-mini-run.json"


def log(msg):
    print(f"[{time.time() - T_START:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Configuration


def make_config(smoke):
    """config.json of muse-mini (or of the --smoke model: same features, tiny sizes). Expert
    and bridge widths are multiples of 128, as TrellisMX requires."""
    if smoke:
        shape = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, sliding_window=16,
                     intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2,
                     moe_latent_size=32, moe_intermediate_size=32)
    else:
        shape = dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6,
                     num_key_value_heads=2, head_dim=64, sliding_window=256,
                     intermediate_size=1024, n_routed_experts=8, num_experts_per_tok=2,
                     moe_latent_size=128, moe_intermediate_size=128)
    n = shape["num_hidden_layers"]
    return {
        "architectures": ["MuseSparkForCausalLM"],
        "model_type": "muse_spark",
        "vocab_size": tk.VOCAB_SIZE,
        **shape,
        # Every 4th layer (from layer 3) attends to everything, the others to a window.
        "layer_types": ["full_attention" if i % 4 == 3 else "sliding_attention"
                        for i in range(n)],
        "max_position_embeddings": 1024,
        "rope_theta": 100000.0,
        "rope_local_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "dense_layers": [0],
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "router_score": "sigmoid",
        "residual_gates": True,
        "bos_token_id": tk.ENDOFTEXT,
        "eos_token_id": [tk.IM_END, tk.ENDOFTEXT],
        "image_token_id": tk.IMAGE,
        "audio_token_id": tk.AUDIO,
        "video_token_id": tk.VIDEO,
        "torch_dtype": "bfloat16",
    }


# ---------------------------------------------------------------------------------------------
# Model: module and attribute names are the checkpoint's tensor names (docs/model.md), except
# that the routed experts are stacked ([E][out][in]) and split at export.


def rmsnorm(x, w, eps):
    """x / sqrt(mean(x²) + eps) * w in float32, back in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return rmsnorm(x, self.weight, self.eps)


def rope_tables(head_dim, theta, n_pos):
    """cos, sin [n_pos][head_dim/2] of the angles p·θ^(-2i/head_dim), computed in float64."""
    inv_freq = theta ** (-torch.arange(0, head_dim // 2, dtype=torch.float64) * 2.0 / head_dim)
    angle = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angle).float(), torch.sin(angle).float()


def rope(x, cos, sin):
    """Rotate-half RoPE on x [B][heads][T][hd]: the pair (i, i + hd/2) turns by its angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg, sliding):
        super().__init__()
        hid, hd = cfg["hidden_size"], cfg["head_dim"]
        self.n_heads, self.n_kv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        self.q_proj = nn.Linear(hid, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(hid, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(hid, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, hid, bias=False)
        self.q_norm = RMSNorm(hd, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, cfg["rms_norm_eps"])
        self.sliding = sliding
        self.window = cfg["sliding_window"]

    def forward(self, x, cos, sin, masks):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd)
        q = rope(self.q_norm(q).transpose(1, 2), cos, sin)     # [B][heads][T][hd]
        k = rope(self.k_norm(k).transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        group = self.n_heads // self.n_kv                       # query head h reads KV head h // group
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        if self.sliding and T > self.window:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=masks)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(a.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, hid, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hid, inter, bias=False)
        self.up_proj = nn.Linear(hid, inter, bias=False)
        self.down_proj = nn.Linear(inter, hid, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, hid, n_experts):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, hid))
        # Selection only, never trained by gradient: moved by balance_experts().
        self.register_buffer("correction_bias", torch.zeros(n_experts))


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hid, lat, mi = cfg["hidden_size"], cfg["moe_latent_size"], cfg["moe_intermediate_size"]
        E = cfg["n_routed_experts"]
        self.E, self.k, self.lat, self.mi = E, cfg["num_experts_per_tok"], lat, mi
        self.scale = cfg["routed_scaling_factor"]
        self.eps = cfg["rms_norm_eps"]
        self.router = Router(hid, E)
        self.bridge_in = nn.Linear(hid, lat, bias=False)
        self.bridge_out = nn.Linear(lat, hid, bias=False)
        self.experts_gate = nn.Parameter(torch.empty(E, mi, lat))
        self.experts_up = nn.Parameter(torch.empty(E, mi, lat))
        self.experts_down = nn.Parameter(torch.empty(E, lat, mi))
        self.post_expert_norm = RMSNorm(lat, cfg["rms_norm_eps"])
        self.shared_experts = SwiGLU(hid, cfg["n_shared_experts"] * mi)

    def forward(self, x):
        """x [N][hidden] -> (m [N][hidden], tokens routed to each expert [E])."""
        N = x.shape[0]
        with torch.autocast(x.device.type, enabled=False):
            s = torch.sigmoid(F.linear(x.float(), self.router.weight.float()))   # [N][E]
            chosen = torch.topk(s + self.router.correction_bias, self.k, dim=-1).indices
            w = torch.gather(s, 1, chosen)
            w = w / w.sum(-1, keepdim=True) * self.scale
            coef = torch.zeros_like(s).scatter(1, chosen, w)                     # [N][E]
        z = self.bridge_in(x)                                                    # [N][lat]
        g = F.linear(z, self.experts_gate.reshape(self.E * self.mi, self.lat))
        u = F.linear(z, self.experts_up.reshape(self.E * self.mi, self.lat))
        a = (F.silu(g) * u).view(N, self.E, self.mi).transpose(0, 1)             # [E][N][mi]
        y = torch.bmm(a, self.experts_down.transpose(1, 2).to(a.dtype))          # [E][N][lat]
        y = self.post_expert_norm(y)
        y = torch.einsum("ne,enl->nl", coef.to(y.dtype), y)                      # [N][lat]
        m = self.bridge_out(y) + self.shared_experts(x)
        load = torch.zeros(self.E, device=x.device).scatter_add_(
            0, chosen.reshape(-1), torch.ones(chosen.numel(), device=x.device))
        return m, load


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        hid, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.sliding = cfg["layer_types"][layer] == "sliding_attention"
        self.input_layernorm = RMSNorm(hid, eps)
        self.self_attn = Attention(cfg, self.sliding)
        self.attn_gate = nn.Parameter(torch.ones(hid))
        self.post_attention_layernorm = RMSNorm(hid, eps)
        self.mlp_gate = nn.Parameter(torch.ones(hid))
        self.dense = layer in cfg["dense_layers"]
        self.mlp = SwiGLU(hid, cfg["intermediate_size"]) if self.dense else MoE(cfg)

    def forward(self, h, ropes, mask):
        cos, sin = ropes[self.sliding]
        h = h + self.attn_gate.to(h.dtype) * self.self_attn(self.input_layernorm(h), cos, sin,
                                                             mask)
        x = self.post_attention_layernorm(h)
        if self.dense:
            return h + self.mlp_gate.to(h.dtype) * self.mlp(x), None
        B, T, H = x.shape
        m, load = self.mlp(x.reshape(B * T, H))
        return h + self.mlp_gate.to(h.dtype) * m.view(B, T, H), load


class MuseModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class MuseForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = MuseModel(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        n_pos, hd = cfg["max_position_embeddings"], cfg["head_dim"]
        for name, theta in (("full", cfg["rope_theta"]), ("local", cfg["rope_local_theta"])):
            cos, sin = rope_tables(hd, theta, n_pos)
            self.register_buffer(f"cos_{name}", cos, persistent=False)
            self.register_buffer(f"sin_{name}", sin, persistent=False)
        W = cfg["sliding_window"]
        i = torch.arange(n_pos)
        # Query p sees keys j with p - W < j <= p.
        self.register_buffer("sliding_mask", (i[None, :] <= i[:, None]) &
                             (i[None, :] > i[:, None] - W), persistent=False)
        self.init_weights()

    def init_weights(self):
        """GPT-style N(0, 0.02) with residual-branch outputs scaled by 1/sqrt(2·layers); experts
        and bridge_in at N(0, 1/fan_in) so each expert output has a healthy scale before the
        post-expert norm; norms and residual gates at 1, correction bias at 0."""
        std, n_layers = 0.02, self.cfg["num_hidden_layers"]
        for name, p in self.named_parameters():
            if p.dim() == 1:
                continue
            if name.endswith(("experts_gate", "experts_up", "experts_down", "bridge_in.weight")):
                nn.init.normal_(p, std=p.shape[-1] ** -0.5)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "bridge_out.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * n_layers))
            else:
                nn.init.normal_(p, std=std)

    def hidden(self, ids):
        """Final hidden states [B][T][hidden] and the experts' loads [moe layers][E]."""
        T = ids.shape[1]
        ropes = {False: (self.cos_full[:T], self.sin_full[:T]),
                 True: (self.cos_local[:T], self.sin_local[:T])}
        mask = self.sliding_mask[:T, :T]
        h = self.model.embed_tokens(ids)
        loads = []
        for layer in self.model.layers:
            h, load = layer(h, ropes, mask)
            if load is not None:
                loads.append(load)
        return self.model.norm(h), torch.stack(loads)

    def forward(self, ids, targets=None):
        """ids [B][T] -> logits [B][T][vocab]; with targets (-100 = no loss) -> (mean loss,
        loads [moe layers][E])."""
        h, loads = self.hidden(ids)
        logits = self.lm_head(h)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100)
        return loss, loads


def count_parameters(cfg):
    """(total, active per token), from the module on the meta device."""
    with torch.device("meta"):
        model = MuseForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("correction_bias"))
    per_expert = 3 * cfg["moe_latent_size"] * cfg["moe_intermediate_size"]
    n_moe = cfg["num_hidden_layers"] - len(cfg["dense_layers"])
    idle = cfg["n_routed_experts"] - cfg["num_experts_per_tok"]
    return total, total - n_moe * idle * per_expert


@torch.no_grad()
def balance_experts(model, loads, rate):
    """Auxiliary-loss-free balancing: an expert that got more than the mean load this step has
    its correction bias lowered by rate, one that got less raised."""
    moe = [layer.mlp for layer in model.model.layers if not layer.dense]
    for mlp, load in zip(moe, loads):
        mlp.router.correction_bias += rate * torch.sign(load.mean() - load)


# ---------------------------------------------------------------------------------------------
# Checkpoint: Hugging Face names, experts split, BF16 except the F32 correction bias


def hf_tensors(model):
    """{name: float32 CPU tensor} in checkpoint order: embeddings, layers, norm, head."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().float().cpu()
        for proj in ("gate", "up", "down"):
            if name.endswith(f"mlp.experts_{proj}"):
                base = name[:-len(f"experts_{proj}")]
                for e in range(t.shape[0]):
                    out[f"{base}experts.{e}.{proj}_proj.weight"] = t[e].contiguous()
                break
        else:
            out[name] = t.contiguous()
    head = out.pop("lm_head.weight")
    out["lm_head.weight"] = head
    return out


def load_hf_tensors(model, tensors):
    """Inverse of hf_tensors: stacks the experts back and loads everything into model."""
    state = {}
    for name in model.state_dict():
        for proj in ("gate", "up", "down"):
            if name.endswith(f"mlp.experts_{proj}"):
                base = name[:-len(f"experts_{proj}")]
                n = model.cfg["n_routed_experts"]
                state[name] = torch.stack([tensors[f"{base}experts.{e}.{proj}_proj.weight"]
                                           for e in range(n)])
                break
        else:
            state[name] = tensors[name]
    model.load_state_dict(state)


def bf16_bits(t):
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def write_json(path, obj, indent=2):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, ensure_ascii=False)
        f.write("\n")


def write_checkpoint(out_dir, tensors, n_shards):
    """n_shards safetensors files of about equal size, each tensor whole, and the index. Cut
    points fall where the running total crosses k/n of the whole."""
    stored = {n: t.numpy() if n.endswith("correction_bias") else bf16_bits(t)
              for n, t in tensors.items()}
    names = list(stored)
    total = sum(a.nbytes for a in stored.values())
    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    shard_of, acc = {}, 0
    for name in names:
        shard_of[name] = min((acc + stored[name].nbytes // 2) * n_shards // total, n_shards - 1)
        acc += stored[name].nbytes
    for i, fname in enumerate(files):
        path = os.path.join(out_dir, fname)
        safetensors_io.save_file(path, {n: stored[n] for n in names if shard_of[n] == i},
                                 {"format": "pt"})
        if os.path.getsize(path) > SHARD_LIMIT:
            raise RuntimeError(f"{path}: {os.path.getsize(path)} bytes, over the shard limit "
                               f"{SHARD_LIMIT}: use more shards")
    write_json(os.path.join(out_dir, "model.safetensors.index.json"),
               {"metadata": {"total_size": total},
                "weight_map": {n: files[shard_of[n]] for n in names}})
    return total


def read_checkpoint(model_dir):
    """{name: float32 tensor} of the shards model.safetensors.index.json lists."""
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for shard in shards:
        tensors, _ = safetensors_io.load_file(os.path.join(model_dir, shard))
        for name, a in tensors.items():
            a = safetensors_io.bf16_bits_to_f32(a) if a.dtype == np.uint16 else a
            out[name] = torch.from_numpy(np.array(a, dtype=np.float32))
    return out


def export(model, cfg, out_dir, n_shards):
    """Writes the Hugging Face model directory; returns the checkpoint's bytes."""
    os.makedirs(out_dir, exist_ok=True)
    total = write_checkpoint(out_dir, hf_tensors(model), n_shards)
    write_json(os.path.join(out_dir, "config.json"), cfg)
    write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
        "do_sample": True, "temperature": 0.8, "top_p": 0.95})
    tk.write_tokenizer_files(out_dir, os.path.join(HERE, "tokenizer.json"),
                             cfg["max_position_embeddings"])
    return total


# ---------------------------------------------------------------------------------------------
# Data


def read_text(path, limit=None):
    """A text file, or an .xz one, decoded as UTF-8 with line endings kept as they are."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rb") as f:
        data = f.read(limit) if limit else f.read()
    return data.decode("utf-8", errors="ignore")


def split_chunks(text, size=1 << 16):
    """Pieces of about size characters, each ending after a blank line where one is near, so
    that encoding the pieces gives the tokens of the whole."""
    chunks, i = [], 0
    while i < len(text):
        j = text.find("\n\n", i + size)
        j = len(text) if j < 0 else j + 2
        chunks.append(text[i:j])
        i = j
    return chunks


def encode_stream(tok, text, deadline=None):
    """The text's token ids as an int32 array (no special tokens). Stops early, keeping what
    it has, once the deadline passes."""
    chunks = split_chunks(text)
    parts, group = [], 256
    for i in range(0, len(chunks), group):
        enc = tok.encode_batch(chunks[i:i + group], add_special_tokens=False)
        parts.extend(np.asarray(e.ids, dtype=np.int32) for e in enc)
        if deadline and time.time() > deadline and i + group < len(chunks):
            log(f"tokenizing: deadline reached after {i + group} of {len(chunks)} chunks")
            break
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


# Conversations for the chat phase: the assistant always answers with text from the books.
CONTINUE_PROMPTS = [
    "Continue this passage:\n{p}",
    "Please continue the story.\n\n{p}",
    "{p}\n\nWhat happens next?",
    "Here is the beginning of a passage. Continue it.\n\n{p}",
    "Go on from here:\n\n{p}",
]
OPEN_PROMPTS = [
    "Tell me a story.",
    "Write a passage from an old novel.",
    "Read me something from a book.",
    "Write a paragraph in the style of a nineteenth-century novel.",
    "Hello! Could you tell me a tale?",
]
FOLLOW_UPS = ["Go on.", "Continue.", "Please go on.", "And then?"]
SYSTEMS = ["You are a helpful assistant.",
           "You are a storyteller who writes in the style of old books."]


def paragraphs_at(text, pos, min_chars, max_chars):
    """Whole paragraphs from the first paragraph start after pos until min_chars are reached
    (at most max_chars: a long paragraph is cut after a sentence); returns (passage, end)."""
    start = text.find("\n\n", pos)
    if start < 0:
        return None, len(text)
    start += 2
    out, i = [], start
    while sum(map(len, out)) < min_chars:
        j = text.find("\n\n", i)
        if j < 0:
            return None, len(text)
        para = text[i:j].strip("\n")
        i = j + 2
        if para:
            out.append(para)
    passage = "\n\n".join(out)
    if len(passage) > max_chars:
        cut = passage.rfind(". ", 0, max_chars)
        if cut < min_chars // 2:
            return None, i
        passage = passage[:cut + 1]
    return passage, i - 2


def make_conversation(text, rng):
    """One conversation [{"role", "content"}] from a random place in the books, or None."""
    passage, end = paragraphs_at(text, rng.randrange(len(text)), 250, 900)
    if passage is None or sum(c.isalpha() for c in passage) < 0.6 * len(passage):
        return None
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    if rng.random() < 0.75:
        msgs.append({"role": "user", "content": rng.choice(CONTINUE_PROMPTS).format(p=passage)})
        answer, end = paragraphs_at(text, end, 250, 1100)
    else:
        msgs.append({"role": "user", "content": rng.choice(OPEN_PROMPTS)})
        answer = passage
    if answer is None:
        return None
    msgs.append({"role": "assistant", "content": answer})
    if rng.random() < 0.25:
        more, _ = paragraphs_at(text, end, 200, 800)
        if more is not None:
            msgs += [{"role": "user", "content": rng.choice(FOLLOW_UPS)},
                     {"role": "assistant", "content": more}]
    return msgs


def conversation_segments(msgs):
    """(text, trained) pieces whose concatenation is tk.render_chat(msgs, False): the model
    learns the assistant's content and its <|im_end|>, nothing else."""
    segs = [(tk.BOS_TOKEN, False)]
    for m in msgs:
        if m["role"] == "assistant":
            segs += [("<|im_start|>assistant\n", False), (m["content"] + "<|im_end|>", True),
                     ("\n", False)]
        else:
            segs.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", False))
    assert "".join(s for s, _ in segs) == tk.render_chat(msgs, False)
    return segs


def chat_rows(tok, text, n_conv, row_len, seed):
    """Conversations packed into rows of row_len tokens: (ids [R][row_len], trained [R][row_len]
    bool). A row is filled with whole conversations, then <|endoftext|> padding (not trained)."""
    rng = random.Random(seed)
    convs = []
    while len(convs) < n_conv:
        c = make_conversation(text, rng)
        if c is not None:
            convs.append(conversation_segments(c))
    flat = [s for segs in convs for s, _ in segs]
    enc = tok.encode_batch(flat, add_special_tokens=False)
    rows, flags, cur_ids, cur_flags, k = [], [], [], [], 0
    for segs in convs:
        ids, fl = [], []
        for _, trained in segs:
            e = enc[k].ids
            k += 1
            ids += e
            fl += [trained] * len(e)
        if len(ids) > row_len:
            continue
        if len(cur_ids) + len(ids) > row_len:
            pad = row_len - len(cur_ids)
            rows.append(cur_ids + [tk.ENDOFTEXT] * pad)
            flags.append(cur_flags + [False] * pad)
            cur_ids, cur_flags = [], []
        cur_ids += ids
        cur_flags += fl
    if cur_ids:
        pad = row_len - len(cur_ids)
        rows.append(cur_ids + [tk.ENDOFTEXT] * pad)
        flags.append(cur_flags + [False] * pad)
    return np.asarray(rows, dtype=np.int32), np.asarray(flags, dtype=bool)


class Batches:
    """Training batches of rows of T + 1 tokens on the device: x = row[:T], y = row[1:].
    Text rows are <|endoftext|> + T tokens from a random offset of the stream (how tmx
    prompts look: BOS, then text); chat rows come packed, with -100 where nothing is learned."""

    def __init__(self, stream, chat_ids, chat_flags, batch, T, device, seed):
        self.stream = torch.from_numpy(stream.astype(np.int64)).to(device)
        self.chat_ids = torch.from_numpy(chat_ids.astype(np.int64)).to(device)
        self.chat_flags = torch.from_numpy(chat_flags).to(device)
        self.batch, self.T, self.device = batch, T, device
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.arange = torch.arange(T, device=device)

    def text(self, n):
        off = torch.randint(0, len(self.stream) - self.T, (n,), generator=self.gen)
        tokens = self.stream[off.to(self.device)[:, None] + self.arange]
        bos = torch.full((n, 1), tk.ENDOFTEXT, dtype=torch.long, device=self.device)
        rows = torch.cat([bos, tokens], dim=1)
        return rows[:, :-1], rows[:, 1:]

    def chat(self, n):
        pick = torch.randint(0, len(self.chat_ids), (n,), generator=self.gen).to(self.device)
        rows, flags = self.chat_ids[pick], self.chat_flags[pick]
        return rows[:, :-1], torch.where(flags[:, 1:], rows[:, 1:], -100)

    def next(self, chat_share):
        """(x, y) [batch][T], contiguous in every phase: a compiled step guards on strides."""
        n_chat = int(round(self.batch * chat_share)) if len(self.chat_ids) else 0
        if n_chat == 0:
            x, y = self.text(self.batch)
        elif n_chat == self.batch:
            x, y = self.chat(n_chat)
        else:
            xt, yt = self.text(self.batch - n_chat)
            xc, yc = self.chat(n_chat)
            x, y = torch.cat([xt, xc]), torch.cat([yt, yc])
        return x.contiguous(), y.contiguous()


# ---------------------------------------------------------------------------------------------
# Training


def lr_at(step, progress, args):
    """Linear warmup over warmup steps, then cosine from lr to lr·min_lr_ratio as the wall-clock
    progress (0..1) of the training time goes by."""
    warm = min(1.0, (step + 1) / args.warmup)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * warm * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def make_optimizer(model, args):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def train(model, batches, args, device, train_end):
    """Trains until train_end (time.time()), or for args.steps steps if set; returns the
    training log."""
    opt = make_optimizer(model, args)
    step_fn = model
    if args.compile:
        step_fn = torch.compile(model)
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    chat_start = 1.0 - args.chat_fraction
    curve, tokens, step = [], 0, 0
    t_first = None                 # progress is measured from the end of the first (compiling) step
    pending, pending_n = torch.zeros((), device=device), 0
    t_log, tok_log = time.time(), 0
    while True:
        now = time.time()
        if (step >= args.steps if args.steps else now >= train_end and step > 0):
            break
        if args.steps:
            progress = step / args.steps
        else:
            progress = 0.0 if t_first is None else (now - t_first) / max(1e-9, train_end - t_first)
        chat = progress >= chat_start
        lr = lr_at(step, progress, args)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = batches.next(args.chat_share if chat else 0.0)
        try:
            with amp:
                loss, loads = step_fn(x, y)
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - a failed compile falls back to eager mode
            if step_fn is model:
                raise
            log(f"torch.compile failed ({type(exc).__name__}: {str(exc)[:300]}); eager mode")
            opt.zero_grad(set_to_none=True)
            torch._dynamo.reset()
            step_fn = model
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balance_experts(model, loads, args.bias_rate)
        step += 1
        n_tok = int((y != -100).sum()) if chat else y.numel()
        tokens += n_tok
        tok_log += y.numel()
        pending += loss.detach()
        pending_n += 1
        if t_first is None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_first = time.time()
            log(f"first step done ({'compiled' if step_fn is not model else 'eager'}), "
                f"loss {loss.item():.3f}")
            t_log, tok_log = time.time(), 0
        if step % args.log_every == 0 or step == args.steps or time.time() >= train_end:
            mean = (pending / pending_n).item()             # one device sync per log line
            pending, pending_n = torch.zeros((), device=device), 0
            if not math.isfinite(mean):
                raise RuntimeError(f"step {step}: loss is {mean}")
            dt = time.time() - t_log
            rate = tok_log / dt if dt > 0 else 0.0
            t_log, tok_log = time.time(), 0
            curve.append({"step": step, "tokens": tokens, "loss": round(mean, 4),
                          "lr": float(f"{lr:.3g}"), "phase": "chat" if chat else "text",
                          "t": round(time.time() - T_START, 1)})
            log(f"step {step:5d}  {'chat' if chat else 'text'}  loss {mean:.4f}  lr {lr:.2e}  "
                f"{rate / 1e3:.0f}k tok/s  tokens {tokens / 1e6:.1f}M")
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.time() - t_first if t_first else 0.0
    return {"steps": step, "tokens_seen": tokens, "batch_rows": args.batch, "seq_len": args.seq,
            "compiled": step_fn is not model, "seconds_after_first_step": round(seconds, 1),
            "loss_curve": curve}


def round_to_bf16(model):
    """The weights as exported: every parameter rounded to BF16 (the bias stays F32)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


# ---------------------------------------------------------------------------------------------
# Measurements


@torch.no_grad()
def evaluate(model, stream, n_bytes, T, batch, device):
    """Loss of the whole stream in windows <|endoftext|> + T tokens (every token predicted once,
    from at most T - 1 tokens before it in its window), float32 compute."""
    n = len(stream)
    total, count = 0.0, 0
    starts = list(range(0, n, T))
    for i in range(0, len(starts), batch):
        group = starts[i:i + batch]
        rows = [np.concatenate([[tk.ENDOFTEXT], stream[s:s + T]]) for s in group]
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), tk.ENDOFTEXT, dtype=np.int64)
        tgt = np.full((len(rows), width), -100, dtype=np.int64)
        for j, r in enumerate(rows):
            ids[j, :len(r)] = r
            tgt[j, :len(r) - 1] = r[1:]
        x = torch.from_numpy(ids[:, :-1]).to(device)
        y = torch.from_numpy(tgt[:, :-1]).to(device)
        logits = model(x).float()
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1),
                               ignore_index=-100, reduction="sum")
        total += loss.item()
        count += int((y != -100).sum())
    nll = total / max(1, count)
    return {"tokens": count, "bytes": n_bytes, "loss": round(nll, 5),
            "perplexity": round(math.exp(nll), 3),
            "bits_per_byte": round(total / math.log(2) / max(1, n_bytes), 5)}


def prompt_ids(tok, text):
    """The ids tmx runs for a prompt: text with special tokens parsed, <|endoftext|> in front
    unless it is there (a rendered chat starts with it)."""
    ids = tok.encode(text, add_special_tokens=False).ids
    return ids if ids[:1] == [tk.ENDOFTEXT] else [tk.ENDOFTEXT] + ids


@torch.no_grad()
def sample(model, tok, ids, n, device, seed, temperature=0.8, top_k=40):
    """n sampled tokens after ids (stops at an end-of-sequence id); full recompute each step."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    eos = set(model.cfg["eos_token_id"])
    T = model.cfg["max_position_embeddings"]
    for _ in range(n):
        x = torch.tensor([(ids + out)[-T:]], device=device)
        logits = model(x)[0, -1].float().cpu() / temperature
        top = torch.topk(logits, top_k)
        pick = top.indices[torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)]
        out.append(int(pick))
        if out[-1] in eos:
            break
    return tok.decode(out, skip_special_tokens=False)


FIXTURE_TEXT = ("It was a dark and stormy night; the rain fell in torrents, except at occasional "
                "intervals, when it was checked by a violent gust of wind")
FIXTURE_CHAT = [{"role": "user", "content": "Continue this passage:\nThe old house stood at "
                 "the end of the lane, and nobody had lived in it for years."}]
FIXTURE_LONG_TOKENS = 320       # longer than the sliding window of 256
FIXTURE_TOP = 32


def fixture_prompts(tok, heldout_text):
    """Three prompts: [{"text", "bos" (ids = [bos] + encode(text)), "ids"}]. The long one is
    held-out text from the preface of Jane Eyre on, past the sliding window."""
    start = max(0, heldout_text.find("A preface to the first edition"))
    long_ids = tok.encode(heldout_text[start:start + 4 * FIXTURE_LONG_TOKENS],
                          add_special_tokens=False).ids[:FIXTURE_LONG_TOKENS]
    long_text = tok.decode(long_ids)
    chat = tk.render_chat(FIXTURE_CHAT, True)
    prompts = []
    for text, bos in ((FIXTURE_TEXT, True), (chat, False), (long_text, True)):
        ids = tok.encode(text, add_special_tokens=False).ids
        prompts.append({"text": text, "bos": bos, "ids": ([tk.ENDOFTEXT] if bos else []) + ids})
    return prompts


@torch.no_grad()
def make_fixture(export_dir, cfg, tok, heldout_text):
    """Float32 CPU logits of the exported checkpoint for the fixture prompts, and their
    agreement with the float64 numpy reference."""
    model = MuseForCausalLM(cfg)
    load_hf_tensors(model, read_checkpoint(export_dir))
    model.eval()
    prompts = fixture_prompts(tok, heldout_text)
    import muse_ref
    ref = muse_ref.load(export_dir)
    worst = 0.0
    for p in prompts:
        logits = model(torch.tensor([p["ids"]]))[0].float()             # [n][vocab]
        top = torch.topk(logits, FIXTURE_TOP, dim=-1)
        p["top_ids"] = top.indices.tolist()
        p["top_logits"] = [[float(f"{v:.6g}") for v in row] for row in top.values.tolist()]
        p["last_logits"] = [float(f"{v:.6g}") for v in logits[-1].tolist()]
        want = ref.forward(p["ids"])
        err = float(np.abs(logits.numpy() - want).max() / np.abs(want).max())
        p["torch_vs_reference"] = float(f"{err:.3g}")
        worst = max(worst, err)
    return {"top": FIXTURE_TOP, "dtype": "float32", "prompts": prompts,
            "torch_vs_reference_max_rel_err": float(f"{worst:.3g}")}


# ---------------------------------------------------------------------------------------------


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="folder with train.txt.xz, heldout.txt.xz [, wiki.test.raw]")
    ap.add_argument("--out", help="output folder (muse-mini/ and muse-mini-run.json go there)")
    ap.add_argument("--minutes", type=float, default=6.0,
                    help="wall-clock minutes of training, both phases (default 6)")
    ap.add_argument("--total-minutes", type=float, default=8.5,
                    help="the whole run's limit: training is cut short so that it holds")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, little data, a few steps: checks every code path")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: time)")
    ap.add_argument("--count", action="store_true", help="print the parameter count and exit")
    ap.add_argument("--batch", type=int, default=64, help="rows per step")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per row")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100, help="warmup steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="correction-bias step")
    ap.add_argument("--chat-fraction", type=float, default=0.1,
                    help="last fraction of the training time that mixes in chat rows")
    ap.add_argument("--chat-share", type=float, default=0.5, help="chat rows in those batches")
    ap.add_argument("--chat-conversations", type=int, default=8000)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="torch.compile the training step (auto: on CUDA)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    if not args.count and not (args.data and args.out):
        ap.error("--data and --out are required")
    if args.smoke:
        # Rows long enough for whole conversations, so the chat phase runs too.
        for name, value in (("batch", 4), ("seq", 512), ("warmup", 5), ("log_every", 5),
                            ("chat_conversations", 200)):
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, value)
    if args.seq > 1024:
        ap.error("--seq must be at most max_position_embeddings (1024)")
    return args


def main():
    args = parse_args()
    cfg = make_config(args.smoke)
    total, active = count_parameters(cfg)
    log(f"muse-mini{' (smoke)' if args.smoke else ''}: {total:,} parameters, {active:,} active "
        f"per token")
    if total > PARAM_LIMIT:
        sys.exit(f"config: {total:,} parameters, over the limit of {PARAM_LIMIT:,}")
    if 2 * total > args.shards * SHARD_LIMIT:
        sys.exit(f"--shards {args.shards}: {2 * total:,} bytes do not fit in shards of "
                 f"{SHARD_LIMIT:,}")
    if args.count:
        return
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    args.compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        log(f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    train_file = os.path.join(args.data, "train.txt.xz")
    heldout_file = os.path.join(args.data, "heldout.txt.xz")
    for path in (train_file, heldout_file):
        if not os.path.exists(path):
            sys.exit(f"--data {args.data}: {os.path.basename(path)} is missing")
    wiki_file = next((p for p in (os.path.join(args.data, "wiki.test.raw"),
                                  os.path.join(args.data, "eval", "wiki.test.raw"))
                      if os.path.exists(p)), None)
    run_end = T_START + 60 * args.total_minutes
    reserve = 20 if args.smoke else 75           # export, evaluation, samples, fixture

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(HERE, "tokenizer.json"))
    limit = 2_000_000 if args.smoke else None
    train_text = read_text(train_file, limit)
    heldout_text = read_text(heldout_file, 80_000 if args.smoke else None)
    wiki_text = read_text(wiki_file, 30_000 if args.smoke else None) if wiki_file else None
    log(f"read {len(train_text) / 1e6:.1f}M + {len(heldout_text) / 1e6:.1f}M"
        f"{f' + {len(wiki_text) / 1e6:.1f}M' if wiki_text else ''} characters")
    train_stream = encode_stream(tok, train_text, deadline=T_START + 150)
    log(f"train: {len(train_stream):,} tokens ({len(train_text) / len(train_stream):.2f} "
        f"characters/token)")
    chat_ids, chat_flags = chat_rows(tok, train_text, args.chat_conversations, args.seq + 1,
                                     args.seed)
    log(f"chat: {len(chat_ids)} rows of {args.seq + 1} tokens, "
        f"{int(chat_flags.sum()):,} trained tokens")
    if args.chat_fraction > 0 and len(chat_ids) == 0:
        sys.exit(f"--seq {args.seq}: no conversation fits in a row")
    heldout_stream = encode_stream(tok, heldout_text)
    wiki_stream = encode_stream(tok, wiki_text) if wiki_text else None

    model = MuseForCausalLM(cfg).to(device)
    batches = Batches(train_stream, chat_ids, chat_flags, args.batch, args.seq, device,
                      args.seed)
    t0 = time.time()
    train_end = min(t0 + 60 * args.minutes, run_end - reserve)
    if args.steps:
        train_end = float("inf")
    log(f"training for {(min(train_end, run_end) - t0) / 60:.2f} minutes"
        if not args.steps else f"training for {args.steps} steps")
    report = {"config": cfg, "parameters": total, "active_parameters": active,
              "data": {"train_tokens": int(len(train_stream)),
                       "train_characters": len(train_text),
                       "chat_rows": int(len(chat_ids)),
                       "chat_trained_tokens": int(chat_flags.sum())},
              "args": {k: v for k, v in vars(args).items() if k not in ("data", "out")}}
    report["train"] = train(model, batches, args, device, train_end)
    log(f"trained {report['train']['steps']} steps, {report['train']['tokens_seen']:,} tokens")

    round_to_bf16(model)
    model.eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    export_dir = os.path.join(args.out, EXPORT_NAME)
    report["checkpoint_bytes"] = export(model, cfg, export_dir, args.shards)
    log(f"exported {export_dir}")
    report_path = os.path.join(args.out, REPORT_NAME)

    def step(name, fn):
        """Runs one measurement; a failure is recorded, not fatal: the checkpoint is written."""
        try:
            report[name] = fn()
        except Exception as exc:  # noqa: BLE001
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"{name} failed: {type(exc).__name__}: {exc}")
        write_json(report_path, report, indent=None)

    eval_batch = 8 if args.smoke else 32
    step("heldout", lambda: evaluate(model, heldout_stream, len(heldout_text.encode()), args.seq,
                                     eval_batch, device))
    if wiki_stream is not None:
        step("wikitext2_test", lambda: evaluate(model, wiki_stream, len(wiki_text.encode()),
                                                args.seq, eval_batch, device))
    n_sample = 24 if args.smoke else 160
    sample_prompts = [FIXTURE_TEXT, tk.render_chat(FIXTURE_CHAT, True),
                      tk.render_chat([{"role": "user", "content": "Tell me a story."}], True)]
    step("samples", lambda: [
        {"prompt": p, "text": sample(model, tok, prompt_ids(tok, p), n_sample, device,
                                     args.seed + i)} for i, p in enumerate(sample_prompts)])
    step("fixture", lambda: make_fixture(export_dir, cfg, tok, heldout_text))
    report["seconds"] = round(time.time() - T_START, 1)
    write_json(report_path, report, indent=None)
    for name in ("heldout", "wikitext2_test"):
        if name in report:
            log(f"{name}: {json.dumps(report[name])}")
    if "samples" in report and isinstance(report["samples"], list):
        for s in report["samples"]:
            log(f"sample: {s['prompt'][-60:]!r} -> {s['text'][:300]!r}")
    fx = report.get("fixture", {})
    log(f"fixture: torch float32 vs numpy reference, max relative error "
        f"{fx.get('torch_vs_reference_max_rel_err', fx.get('error'))}")
    files = []
    for dirpath, _, names in os.walk(args.out):
        files += [os.path.join(dirpath, n) for n in names]
    for path in sorted(files):
        log(f"  {os.path.relpath(path, args.out)}: {os.path.getsize(path):,} bytes")
    too_big = [p for p in files if os.path.getsize(p) > 16 * MIB]
    if len(files) > 8 or too_big:
        sys.exit(f"{args.out}: {len(files)} files, over 16 MiB: {too_big}; at most 8 come back")
    log(f"done in {report['seconds']} s")


if __name__ == "__main__":
    main()
