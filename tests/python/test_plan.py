"""tmx plan (core/plan.c, core/cli/plan.c, docs/plan.md) against hand counts and the engine.

- muse-tiny in BF16 (two shards) and its trellis-e4m3 K = 3 build from `tmx quantize` are
  planned from their headers; every per-rank figure is recounted here from the same headers by
  the sharding rules of issue 7, written out independently in `count_rank`.
- The same configs planned with --virtual (config.json only) give the same device bytes: the
  virtual tensor list is the real one.
- A header-only checkpoint with the full-size Muse widths (hidden 7168, 256 experts of
  4096 x 4096, vocab 202048; two layers, sparse files of ~58 GB that take no disk) is planned
  from its headers, quickly, and matches --virtual and the hand count.
- The KV pools the planner sizes are the ones the engine allocates (tmx_model_kv_usage).
- The reconstructed 816B config in docs/plan/ gives the figures docs/plan.md quotes.
- Errors are one line naming the flag or the file.
"""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from tmx_engine import BIN_DIR, Engine

ROOT = pathlib.Path(__file__).resolve().parents[2]
TMX = os.path.join(BIN_DIR, "tmx")
FULL_DIR = ROOT / "docs" / "plan" / "muse-816b"
GIB = 1 << 30


def plan(*args, check=True):
    r = subprocess.run([TMX, "plan", *map(str, args), "--json"], capture_output=True, text=True)
    if check and r.returncode not in (0, 3):
        raise AssertionError(f"tmx plan {' '.join(map(str, args))} failed:\n{r.stderr}")
    return json.loads(r.stdout) if r.returncode in (0, 3) else r


def header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), str(d / "bf16"),
                    "--dtype", "bf16", "--shards", "2"], check=True, capture_output=True)
    subprocess.run([TMX, "quantize", "--model", str(d / "bf16"), "--out", str(d / "k3"),
                    "--codec", "trellis-e4m3", "--bits", "3", "--threads", "2"], check=True,
                   capture_output=True)
    return {"bf16": d / "bf16", "k3": d / "k3"}


# --- an independent count ----------------------------------------------------------------------

def numel(shape):
    return math.prod(shape)


def share(n, unit, tp):
    """Rank 0's part of n elements cut in slices of `unit`."""
    return min(n, -(-(-(-n // unit)) // tp) * unit)


DSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1, "I32": 4, "I8": 1}


def count_rank(model_dir, tp):
    """{part: bytes on rank 0} from the headers, by issue 7's rules and docs/plan.md's device
    forms (MXFP8 as it is, correction bias -> F32, CSF scales -> one byte per block)."""
    d = pathlib.Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    hd = cfg["head_dim"]
    parts = dict.fromkeys(["attention", "experts", "mlp", "vocab", "routers", "bridges", "norms",
                           "codec"], 0)
    tensors = {}
    for f in d.glob("model*.safetensors"):
        tensors.update(header(f))
    for name, t in tensors.items():
        shape, dt = t["shape"], t["dtype"]
        size = numel(shape) * DSIZE[dt]
        if name.endswith("_scale") and dt == "U8":
            parts["attention"] += size // tp  # MXFP8 scales: sharded with their codes
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            parts["vocab"] += size // shape[0] * share(shape[0], 1, tp)
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            parts["attention"] += size // tp  # heads divide: TP divides the KV heads
        elif name.endswith("o_proj.weight"):
            parts["attention"] += size // tp
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            key = "experts" if ".experts." in name else "mlp"
            parts[key] += size // shape[0] * share(shape[0], 16, tp)
        elif name.endswith("down_proj.weight"):
            key = "experts" if ".experts." in name else "mlp"
            parts[key] += size // shape[1] * share(shape[1], 16, tp)
        elif name.endswith("correction_bias"):
            parts["routers"] += numel(shape) * 4
        elif name.endswith("router.weight"):
            parts["routers"] += size
        elif "bridge_" in name:
            parts["bridges"] += size
        else:
            parts["norms"] += size  # norms, q/k norms, gates
    q = d / "hf_quant_config.json"
    block = json.loads(q.read_text())["block_size"] if q.exists() else 0
    for f in (d / "experts").glob("*.safetensors") if block else []:
        for name, t in header(f).items():
            s = t["shape"]
            if name.endswith(".trellis"):
                E, strips, cols, words = s
                axis = 2 if name.startswith("down") else 1
                per = (strips * cols * words * 4 + strips * 16 * cols * 16 // block) // s[axis]
                parts["experts"] += E * per * share(s[axis], 1, tp)
            elif name.endswith(".scale"):
                parts["codec"] += numel(s) * 4
    for f in (d / "coupled").glob("*.safetensors") if block else []:
        parts["codec"] += sum(numel(t["shape"]) for t in header(f).values())
    return parts


# --- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["bf16", "k3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_headers_match_hand_count(models, kind, tp):
    p = plan(models[kind], "--tp", tp)
    assert p["rank_bytes"] == count_rank(models[kind], tp)
    w = p["weights"]
    assert w["sharded"] == sum(p["rank_bytes"][k] for k in ("attention", "experts", "mlp", "vocab"))
    assert w["weights"] == w["sharded"] + w["replicated"]
    assert p["experts"] == ("bf16" if kind == "bf16" else "trellis-e4m3")
    assert p["files"] == (2 if kind == "bf16" else 1 + 3 + 3)  # shards, experts/, coupled/
    assert p["unused_tensors"] == 0


@pytest.mark.parametrize("kind", ["bf16", "k3"])
def test_virtual_is_the_real_tensor_list(models, kind):
    args = ("--tp", 2, "--context", 1024, "--seqs", 3, "--batch", 64, "--kv", "int8")
    real, virt = plan(models[kind], *args), plan(models[kind], "--virtual", *args)
    assert real["model_bytes"] == virt["model_bytes"]
    assert real["rank_bytes"] == virt["rank_bytes"]
    assert real["runtime"] == virt["runtime"] and real["kv_cache"] == virt["kv_cache"]


def test_kv_pools_are_the_engines(models):
    """The planner's pool sizes at TP 1 are tmx_model_kv_init's."""
    for ctx, seqs, batch, bs in ((1024, 3, 64, 16), (256, 8, 512, 8), (1000, 1, 7, 4)):
        p = plan(models["bf16"], "--context", ctx, "--seqs", seqs, "--batch", batch,
                 "--block-size", bs, "--kv", "int8")
        with Engine(str(models["bf16"]), ["threads=1", f"context={ctx}", f"batch={batch}",
                                          f"max_running={seqs}", f"kv_block_size={bs}",
                                          "kv_dtype=int8"]) as eng:
            u = eng.kv_usage()
        kv = p["kv_cache"]
        assert kv["full_positions"] == u.full_total * bs
        assert kv["sliding_positions"] == u.sliding_total * bs
        # int8: K and V of 2 KV heads x (32 bytes + an F32 scale) per layer
        assert kv["full_per_position"] == 1 * 2 * 2 * 36
        assert kv["sliding_per_position"] == 3 * 2 * 2 * 36


def write_header_only(path, tensors):
    """A safetensors file whose header describes `tensors` ({name: (dtype, shape)}) and whose
    data section is a hole: the file has its full size and takes no disk."""
    h, off = {}, 0
    for name, (dt, shape) in tensors.items():
        n = numel(shape) * DSIZE[dt]
        h[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(h).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + off)


@pytest.fixture(scope="module")
def full_width(tmp_path_factory):
    """Two layers (sliding, full) of the reconstructed 816B widths, BF16, header-only."""
    d = tmp_path_factory.mktemp("full-width")
    cfg = json.loads((FULL_DIR / "config.json").read_text())
    cfg.update(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    (d / "config.json").write_text(json.dumps(cfg))
    D, V, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    qd, kvd = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    E, lat, inter = cfg["n_routed_experts"], cfg["moe_latent_size"], cfg["moe_intermediate_size"]
    index = {}
    files = [{"model.embed_tokens.weight": ("BF16", [V, D]), "model.norm.weight": ("BF16", [D]),
              "lm_head.weight": ("BF16", [V, D])}]
    for layer in range(2):
        p = f"model.layers.{layer}."
        t = {p + "input_layernorm.weight": ("BF16", [D]),
             p + "post_attention_layernorm.weight": ("BF16", [D]),
             p + "self_attn.q_proj.weight": ("BF16", [qd, D]),
             p + "self_attn.k_proj.weight": ("BF16", [kvd, D]),
             p + "self_attn.v_proj.weight": ("BF16", [kvd, D]),
             p + "self_attn.o_proj.weight": ("BF16", [D, qd]),
             p + "self_attn.q_norm.weight": ("BF16", [hd]),
             p + "self_attn.k_norm.weight": ("BF16", [hd]),
             p + "attn_gate": ("BF16", [D]), p + "mlp_gate": ("BF16", [D]),
             p + "mlp.router.weight": ("BF16", [E, D]),
             p + "mlp.router.correction_bias": ("F32", [E]),
             p + "mlp.bridge_in.weight": ("BF16", [lat, D]),
             p + "mlp.bridge_out.weight": ("BF16", [D, lat]),
             p + "mlp.post_expert_norm.weight": ("BF16", [lat])}
        for e in range(E):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = ("BF16", [inter, lat])
            t[p + f"mlp.experts.{e}.up_proj.weight"] = ("BF16", [inter, lat])
            t[p + f"mlp.experts.{e}.down_proj.weight"] = ("BF16", [lat, inter])
        files.append(t)
    for i, t in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        write_header_only(d / name, t)
        index.update(dict.fromkeys(t, name))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    yield d
    for f in d.glob("*.safetensors"):  # ~58 GB of holes: do not leave them to pytest's keep-3
        f.unlink()


def test_full_width_header_only(full_width):
    args = ("--tp", 4, "--gpus", "4x96GiB", "--context", 262144, "--kv", "int8")
    real, virt = plan(full_width, *args), plan(full_width, "--virtual", *args)
    assert real["file_bytes"] > 50e9 and real["files"] == 3
    assert real["rank_bytes"] == virt["rank_bytes"] == count_rank(full_width, 4)
    # by hand: 2 layers x 256 experts x 3 matrices of 4096 x 4096 BF16, a quarter each
    assert real["rank_bytes"]["experts"] == 2 * 256 * 3 * 4096 * 4096 * 2 // 4
    assert real["rank_bytes"]["bridges"] == 2 * 2 * 4096 * 7168 * 2
    assert real["rank_bytes"]["vocab"] == 2 * 202048 // 4 * 7168 * 2


def test_reconstructed_816b_figures():
    """The numbers docs/plan.md quotes, recounted by hand."""
    p = plan(FULL_DIR, "--virtual", "--experts", "trellis-e4m3", "--tp", 4,
             "--gpus", "4x96GiB", "--context", 262144, "--kv", "int8")
    r = p["rank_bytes"]
    L, E, W = 62, 256, 4096 * 4096  # every layer MoE; latent = width = 4096
    assert r["experts"] == L * E * 3 * (W * 3 // 8 + W // 32) // 4  # 3-bit words + E4M3 scales
    assert r["attention"] == L * (2 * 8192 * 7168 + 2 * 2048 * 7168) * 33 // 32 // 4  # MXFP8
    assert r["vocab"] == 2 * 202048 * 7168 * 2 // 4
    assert r["bridges"] == L * 2 * 4096 * 7168 * 2
    assert r["routers"] == L * (256 * 7168 * 2 + 256 * 4)
    kv = p["kv_cache"]
    # int8: 16 full layers x K,V x 4 heads x (128 + 4) bytes per position, 262144 positions
    assert kv["full_per_position"] == 16 * 2 * 4 * 132 and kv["full_positions"] == 262144
    assert kv["sliding_positions"] == 2 * (-(-(2047 + 512) // 16) + 1) * 16
    assert p["fits"] and p["max_context"] == 262144 and p["max_seqs"] == 1
    assert round(p["total"] / GIB, 2) == 91.70
    bf16 = plan(FULL_DIR, "--virtual", "--experts", "trellis-e4m3", "--tp", 4,
                "--gpus", "4x96GiB", "--context", 262144, "--kv", "bf16")
    assert bf16["fits"] and bf16["max_context"] == 262144 and bf16["max_seqs"] == 1


@pytest.mark.parametrize("args,needle", [
    (["--tp", "3"], "--tp 3"),
    (["--gpus", "4x96"], "--gpus"),
    (["--gpus", "2x96GiB", "--tp", "4"], "--gpus"),
    (["--kv", "f16"], "--kv"),
    (["--context", "999999"], "--context"),
    (["--seqs", "0"], "--seqs"),
    (["--experts", "trellis-e4m3"], "--virtual"),
    (["--reserve", "lots"], "--reserve"),
])
def test_errors_name_the_flag(models, args, needle):
    r = plan(models["k3"], *args, check=False)
    assert r.returncode != 0 and r.stdout == ""
    assert needle in r.stderr and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("args", [["--tp", "4294967297"], ["--context", "1e3"], ["--bits", ""]])
def test_bad_numbers_name_the_flag(tmp_path, args):
    r = plan(tmp_path, *args, check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"tmx plan: {args[0]} expects an integer in [1, "), r.stderr


def test_errors_name_the_file(models, tmp_path):
    r = plan(tmp_path, check=False)
    assert "config.json" in r.stderr and r.stderr.count("\n") == 1
    (tmp_path / "config.json").write_text((models["bf16"] / "config.json").read_text())
    r = plan(tmp_path, check=False)
    assert str(tmp_path) in r.stderr and r.returncode != 0
    (tmp_path / "hf_quant_config.json").write_text('{"codec": "trellis-e4m3", "bits": 9}')
    r = plan(tmp_path, "--virtual", check=False)
    assert "hf_quant_config.json" in r.stderr and "bits" in r.stderr


def test_does_not_fit_exit_code(models):
    r = subprocess.run([TMX, "plan", str(models["k3"]), "--gpus", "1x1MiB"],
                       capture_output=True, text=True)
    assert r.returncode == 3 and "DOES NOT FIT" in r.stdout
