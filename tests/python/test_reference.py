"""Self-checks of the muse-tiny generator (tools/make_tiny_model.py) and of the numpy reference
(tools/reference/muse_ref.py). None of them needs the C engine."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "tools" / "make_tiny_model.py"
sys.path.insert(0, str(ROOT / "tools" / "reference"))
import muse_ref  # noqa: E402

PROMPT = ("Four score and seven years ago our fathers brought forth on this continent, "
          "a new nation, conceived in Liberty.")


def generate(out_dir, *args):
    subprocess.run([sys.executable, str(GENERATOR), str(out_dir), *args], check=True,
                   capture_output=True)
    return out_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return muse_ref.load(str(tiny_dir))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer, tiny):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    assert len(ids) > 2 * tiny.cfg.sliding_window
    return ids


def read_config(model_dir):
    return json.loads((Path(model_dir) / "config.json").read_text())


# ---------------------------------------------------------------------------------------------
# Generator


def test_generator_is_deterministic(tmp_path, tiny_dir):
    again = generate(tmp_path / "again")
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (tiny_dir / name).read_bytes() == (again / name).read_bytes(), name
    other = generate(tmp_path / "seed1", "--seed", "1")
    weights = "model.safetensors"
    assert (other / weights).read_bytes() != (tiny_dir / weights).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def doc_config_fields():
    """Field names of the config.json table in docs/model.md."""
    text = (ROOT / "docs" / "model.md").read_text()
    table = text.split("## config.json", 1)[1].split("\n## ", 1)[0]
    fields = []
    for line in table.splitlines():
        if not line.startswith("| ") or line.startswith("| field"):
            continue
        fields += re.findall(r"[a-z_]+", line.split("|")[1])
    return fields


def test_config_has_every_documented_field(tiny_dir):
    cfg = read_config(tiny_dir)
    fields = doc_config_fields()
    assert "routed_scaling_factor" in fields and "rope_local_theta" in fields
    assert [f for f in fields if f not in cfg] == []
    assert cfg["model_type"] == "muse_spark"


def test_tiny_switches_every_feature_on(tiny_dir, tiny):
    cfg = read_config(tiny_dir)
    n_layers = cfg["num_hidden_layers"]
    assert set(cfg["layer_types"]) == {"sliding_attention", "full_attention"}
    assert len(cfg["layer_types"]) == n_layers
    assert cfg["rope_local_theta"] != cfg["rope_theta"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert 0 < len(cfg["dense_layers"]) < n_layers
    assert cfg["residual_gates"] and cfg["n_shared_experts"] > 0
    assert cfg["routed_scaling_factor"] != 1.0 and cfg["norm_topk_prob"]
    assert not cfg["tie_word_embeddings"]
    for width in ("hidden_size", "moe_latent_size", "moe_intermediate_size", "intermediate_size"):
        assert cfg[width] % 128 == 0, width
    assert cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] > tiny.n_vocab
    assert cfg["bos_token_id"] < tiny.n_vocab
    assert all(e < tiny.n_vocab for e in cfg["eos_token_id"])


def test_tensors_have_documented_shapes(tiny_dir, tiny):
    cfg = read_config(tiny_dir)
    hid, hd = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    lat, mi = cfg["moe_latent_size"], cfg["moe_intermediate_size"]
    inter, n_exp = cfg["intermediate_size"], cfg["n_routed_experts"]
    want = {"model.embed_tokens.weight": (cfg["vocab_size"], hid), "model.norm.weight": (hid,),
            "lm_head.weight": (cfg["vocab_size"], hid)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        want |= {p + "input_layernorm.weight": (hid,),
                 p + "post_attention_layernorm.weight": (hid,),
                 p + "self_attn.q_proj.weight": (nq * hd, hid),
                 p + "self_attn.k_proj.weight": (nkv * hd, hid),
                 p + "self_attn.v_proj.weight": (nkv * hd, hid),
                 p + "self_attn.o_proj.weight": (hid, nq * hd),
                 p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                 p + "attn_gate": (hid,), p + "mlp_gate": (hid,)}
        if layer in cfg["dense_layers"]:
            want |= {p + "mlp.gate_proj.weight": (inter, hid),
                     p + "mlp.up_proj.weight": (inter, hid),
                     p + "mlp.down_proj.weight": (hid, inter)}
            continue
        sh = cfg["n_shared_experts"] * mi
        want |= {p + "mlp.router.weight": (n_exp, hid), p + "mlp.router.correction_bias": (n_exp,),
                 p + "mlp.bridge_in.weight": (lat, hid), p + "mlp.bridge_out.weight": (hid, lat),
                 p + "mlp.post_expert_norm.weight": (lat,),
                 p + "mlp.shared_experts.gate_proj.weight": (sh, hid),
                 p + "mlp.shared_experts.up_proj.weight": (sh, hid),
                 p + "mlp.shared_experts.down_proj.weight": (hid, sh)}
        for e in range(n_exp):
            want |= {p + f"mlp.experts.{e}.gate_proj.weight": (mi, lat),
                     p + f"mlp.experts.{e}.up_proj.weight": (mi, lat),
                     p + f"mlp.experts.{e}.down_proj.weight": (lat, mi)}
    assert {n: a.shape for n, a in tiny.t.items()} == want


def safetensors_header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def test_bf16_checkpoint_widens_exactly(tmp_path, tiny):
    model_dir = generate(tmp_path / "bf16", "--dtype", "bf16")
    header = safetensors_header(model_dir / "model.safetensors")
    dtypes = {n: h["dtype"] for n, h in header.items() if n != "__metadata__"}
    assert {d for n, d in dtypes.items() if n.endswith("correction_bias")} == {"F32"}
    assert {d for n, d in dtypes.items() if not n.endswith("correction_bias")} == {"BF16"}
    bf16 = muse_ref.load(str(model_dir))
    for name, a in tiny.t.items():
        b = bf16.t[name]
        if name.endswith("correction_bias"):
            assert np.array_equal(b, a), name
            continue
        # bf16 keeps the top 16 bits of an f32, rounded: at most half a unit of its 8-bit
        # mantissa away, and exactly representable (low 16 bits zero).
        assert np.all(np.abs(b - a) <= np.abs(a) * 2.0 ** -8), name
        assert np.all((b.astype(np.float32).view(np.uint32) & 0xFFFF) == 0), name


def test_sharded_checkpoint_loads_the_same_tensors(tmp_path, tiny):
    model_dir = generate(tmp_path / "sharded", "--shards", "2")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (model_dir / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(tiny.t)
    for shard in shards:
        assert {n for n in safetensors_header(model_dir / shard) if n != "__metadata__"} == \
            {n for n, s in index["weight_map"].items() if s == shard}
    sharded = muse_ref.load(str(model_dir))
    assert all(np.array_equal(sharded.t[n], a) for n, a in tiny.t.items())


def test_30m_preset_size(tmp_path):
    model_dir = generate(tmp_path / "30m", "--preset", "30m")
    model = muse_ref.load(str(model_dir))
    n_params = sum(a.size for a in model.t.values())
    assert 25e6 < n_params < 40e6
    assert set(read_config(model_dir)["layer_types"]) == {"sliding_attention", "full_attention"}


# ---------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_round_trips(tokenizer, tiny_dir):
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start|>", "<|end|>", "<|image|>",
               "<|video|>", "<|audio|>"]
    n_ids = tokenizer.get_vocab_size(with_added_tokens=True)
    assert 400 <= n_ids <= 600
    ids = [tokenizer.token_to_id(s) for s in special]
    assert sorted(ids) == list(range(n_ids - len(special), n_ids))
    cfg = read_config(tiny_dir)
    assert cfg["bos_token_id"] == tokenizer.token_to_id("<|begin_of_text|>")
    assert cfg["eos_token_id"][0] == tokenizer.token_to_id("<|end_of_text|>")
    for text in [PROMPT, "Hello, wörld! 12345 naïve café — ½ 日本語 🙂\n\n\tend  ",
                 "It's what we'll do; they've gone.", ""]:
        enc = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(enc.ids, skip_special_tokens=False) == text
    enc = tokenizer.encode("<|start|>user\nHi<|end|>", add_special_tokens=False)
    assert enc.ids[0] == tokenizer.token_to_id("<|start|>")
    assert enc.ids[-1] == tokenizer.token_to_id("<|end|>")
    # Merges learned from the embedded text: common words are single tokens.
    assert len(tokenizer.encode(" the nation", add_special_tokens=False).ids) == 2


def test_tokenizer_config_and_chat_template(tiny_dir):
    jinja2 = pytest.importorskip("jinja2")
    tc = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tc["bos_token"] == "<|begin_of_text|>" and tc["eos_token"] == "<|end_of_text|>"
    text = jinja2.Template(tc["chat_template"]).render(
        bos_token=tc["bos_token"], add_generation_prompt=True,
        messages=[{"role": "user", "content": "Hi"}])
    assert text == "<|begin_of_text|><|start|>user\nHi<|end|>\n<|start|>assistant\n"


# ---------------------------------------------------------------------------------------------
# Reference model


def test_logits_have_tokenizer_width_and_vary(tiny, prompt_ids):
    logits = tiny.forward(prompt_ids)
    assert logits.shape == (len(prompt_ids), tiny.n_vocab)
    assert np.all(np.isfinite(logits))
    assert len(set(np.argmax(logits, axis=-1))) > len(prompt_ids) // 3


def test_incremental_matches_full_forward(tiny, prompt_ids):
    full = tiny.forward(prompt_ids)
    cache = muse_ref.Cache(tiny.cfg.n_layers)
    split = 5
    parts = [tiny.step(prompt_ids[:split], cache)]
    parts += [tiny.step([t], cache) for t in prompt_ids[split:]]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=1e-10)


def test_greedy_matches_recomputed_argmax(tiny, prompt_ids):
    out = tiny.greedy(prompt_ids, 8)
    seq = list(prompt_ids)
    for _ in range(8):
        seq.append(int(np.argmax(tiny.forward(seq)[-1])))
    assert out == seq[len(prompt_ids):]


def test_greedy_text_varies(tiny, prompt_ids):
    out = tiny.greedy(prompt_ids, 64)
    assert len(set(out)) >= 24


def test_sliding_window_masks_old_positions(tiny, prompt_ids):
    window = tiny.cfg.sliding_window
    windowed = tiny.forward(prompt_ids)
    tiny.cfg.sliding_window = 10**9
    try:
        unwindowed = tiny.forward(prompt_ids)
    finally:
        tiny.cfg.sliding_window = window
    # Positions before the window fills see the same keys either way; later ones do not.
    np.testing.assert_allclose(windowed[:window], unwindowed[:window], rtol=0, atol=1e-12)
    assert np.all(np.abs(windowed[window:] - unwindowed[window:]).max(axis=-1) > 1e-3)


def test_correction_bias_changes_selection(tiny, prompt_ids):
    cfg = tiny.cfg
    moe_layers = [i for i in range(cfg.n_layers) if not cfg.dense[i]]
    # Selections for the inputs of each MoE layer, with and without the bias.
    h = np.random.default_rng(0).standard_normal((len(prompt_ids), cfg.hidden))
    changed = 0
    for layer in moe_layers:
        p = f"model.layers.{layer}.mlp."
        router, bias = tiny.t[p + "router.weight"], tiny.t[p + "router.correction_bias"]
        assert np.any(bias != 0)
        with_bias, w1 = muse_ref.route(h, router, bias, cfg)
        without, w0 = muse_ref.route(h, router, np.zeros_like(bias), cfg)
        changed += np.sum(np.any(np.sort(with_bias) != np.sort(without), axis=-1))
        # The bias only selects: where the selection agrees, so do the weights.
        same = np.all(with_bias == without, axis=-1)
        np.testing.assert_allclose(w1[same], w0[same], rtol=0, atol=1e-15)
        assert np.allclose(w1.sum(axis=-1), cfg.routed_scaling)
    assert changed > 0
    logits = tiny.forward(prompt_ids)
    saved = {i: tiny.t[f"model.layers.{i}.mlp.router.correction_bias"] for i in moe_layers}
    try:
        for i in moe_layers:
            tiny.t[f"model.layers.{i}.mlp.router.correction_bias"] = np.zeros_like(saved[i])
        unbiased = tiny.forward(prompt_ids)
    finally:
        for i in moe_layers:
            tiny.t[f"model.layers.{i}.mlp.router.correction_bias"] = saved[i]
    assert np.abs(logits - unbiased).max() > 1e-3


def test_route_ties_go_to_lower_index(tiny):
    cfg = tiny.cfg
    router = np.zeros((cfg.n_experts, cfg.hidden))
    chosen, w = muse_ref.route(np.ones((1, cfg.hidden)), router, np.zeros(cfg.n_experts), cfg)
    assert list(chosen[0]) == list(range(cfg.top_k))
    np.testing.assert_allclose(w, cfg.routed_scaling / cfg.top_k)


def test_gqa_query_head_reads_its_group():
    q = np.ones((1, 4, 8))
    k = np.ones((1, 2, 8))
    v = np.stack([np.zeros((1, 8)), np.ones((1, 8))], axis=1)   # KV head 0 is 0, head 1 is 1
    a = muse_ref.attention(q, k, v, np.zeros(1), np.zeros(1), None)
    assert a[0, :, 0].tolist() == [0.0, 0.0, 1.0, 1.0]


def test_rope_is_relative():
    rng = np.random.default_rng(0)
    inv_freq = muse_ref.rope_inv_freq(16, 10000.0, None)
    q, k = rng.standard_normal((1, 1, 16)), rng.standard_normal((1, 1, 16))
    np.testing.assert_array_equal(muse_ref.rope(q, np.zeros(1), inv_freq), q)

    def score(pq, pk):
        return np.sum(muse_ref.rope(q, np.array([pq]), inv_freq) *
                      muse_ref.rope(k, np.array([pk]), inv_freq))

    assert score(7.0, 3.0) == pytest.approx(score(104.0, 100.0), abs=1e-9)
    assert score(7.0, 3.0) != pytest.approx(score(7.0, 5.0), abs=1e-6)


def test_rope_scaling():
    base = muse_ref.rope_inv_freq(128, 500000.0, None)
    linear = muse_ref.rope_inv_freq(128, 500000.0, {"rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(linear, base / 4.0)
    llama3 = muse_ref.rope_inv_freq(128, 500000.0, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    wavelen = 2 * np.pi / base
    high = wavelen < 8192 / 4.0
    low = wavelen > 8192 / 1.0
    assert high.any() and low.any() and (~high & ~low).any()
    np.testing.assert_allclose(llama3[high], base[high])
    np.testing.assert_allclose(llama3[low], base[low] / 8.0)
    mid = ~high & ~low
    assert np.all((llama3[mid] < base[mid]) & (llama3[mid] > base[mid] / 8.0))


def test_llama_config_is_dense_full_attention(tiny_dir):
    cfg = read_config(tiny_dir)
    cfg.update(model_type="llama")
    llama = muse_ref.Config(cfg)
    assert llama.dense == [True] * llama.n_layers
    assert llama.sliding == [False] * llama.n_layers
    assert not llama.residual_gates and llama.sliding_window is None
    assert muse_ref.Config(dict(cfg, model_type="qwen3")).model_type == "llama"
    assert llama.eos_token_ids == cfg["eos_token_id"]
    assert muse_ref.Config(dict(cfg, eos_token_id=7)).eos_token_ids == [7]
    del cfg["num_key_value_heads"], cfg["head_dim"]
    plain = muse_ref.Config(cfg)
    assert plain.n_kv_heads == plain.n_heads and plain.head_dim == plain.hidden // plain.n_heads


def test_llama_runs_the_same_graph(tiny, tiny_dir, prompt_ids):
    """A one-layer llama built from muse-tiny's dense layer equals that layer run as Muse with
    full attention and no gates; without q/k norm tensors (plain Llama) the result changes."""
    cfg = read_config(tiny_dir)
    cfg.update(num_hidden_layers=1, layer_types=["full_attention"], residual_gates=False)
    tensors = {n: a for n, a in tiny.t.items() if not n.startswith("model.layers.")
               or n.startswith("model.layers.0.")}
    muse = muse_ref.Model(muse_ref.Config(cfg), tensors, tiny.n_vocab)
    llama = muse_ref.Model(muse_ref.Config(dict(cfg, model_type="llama")), tensors, tiny.n_vocab)
    np.testing.assert_array_equal(llama.forward(prompt_ids), muse.forward(prompt_ids))
    no_qk_norm = {n: a for n, a in tensors.items() if "_norm." not in n or "layernorm" in n}
    assert len(no_qk_norm) == len(tensors) - 2
    plain = muse_ref.Model(muse_ref.Config(dict(cfg, model_type="llama")), no_qk_norm, tiny.n_vocab)
    assert np.abs(plain.forward(prompt_ids) - llama.forward(prompt_ids)).max() > 1e-3
