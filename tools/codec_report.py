#!/usr/bin/env python3
"""Encoder figures for docs/perf/codec.md: tmx quantize's speed and the bits a build stores.

    python3 tools/codec_report.py [--bin build/bin] [--threads 2] [--sizes 128,1024]
                                  [--experts 4]

For each size S it makes a Muse model like muse-tiny (BF16, tools/make_tiny_model.py) but with
one dense and one MoE layer of --experts experts, moe_latent_size = moe_intermediate_size = S,
and quantizes it at K = 3 with both TrellisMX codecs on --threads threads. It prints Markdown:

- encoder throughput: expert weights per second of the codec's layer_encode (scales, LDLQ,
  Viterbi, CSF, files; Hessians apart) on --threads cores, from its CPU seconds in
  quantize-report.json ("encode_cpu") divided by the threads: the machine may be shared, and
  CPU time is what other load does not inflate (experts split evenly, so the threads are busy
  throughout); the wall seconds are shown beside it;
- the projection to the reconstructed full-size config (../shared/design/muse-architecture.md:
  62 MoE layers x 256 experts x 3 matrices of 4096 x 4096): CPU seconds per weight fitted as
  a + b*S over the sizes (the Viterbi search costs the same per weight at every size; the LDLQ
  feedback, the Cholesky factor and the proxy error grow with the matrix side) and evaluated
  at S = 4096;
- bits per weight actually stored, read from the experts/ and coupled/ files: trellis words,
  block scales raw (8 bits per block) and after CSF, matrix scales, sign vectors.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import make_tiny_model as mtm  # noqa: E402
import safetensors_io  # noqa: E402

FULL = {"layers": 62, "experts": 256, "side": 4096}  # reconstructed full-size config
CODECS = [("trellis-e4m3", 32), ("trellis-fp4", 16)]


def make_model(out, side, experts):
    tokenizer, special, n_tokens = mtm.build_tokenizer()
    cfg = mtm.preset_config("tiny", n_tokens, special)
    cfg.update(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
               n_routed_experts=experts, moe_latent_size=side, moe_intermediate_size=side,
               torch_dtype="bfloat16")
    weights = mtm.make_weights(cfg, np.random.default_rng(0))
    os.makedirs(out, exist_ok=True)
    mtm.write_json(os.path.join(out, "config.json"), cfg)
    mtm.write_tokenizer_files(out, tokenizer, special, cfg["max_position_embeddings"])
    mtm.write_weights(out, weights, "bf16", 1)


def stored_bits(build):
    """Bits per expert weight in each part of a build's experts/ and coupled/ files."""
    parts = {"trellis": 0, "scales (CSF)": 0, "matrix scales": 0, "sign vectors": 0}
    weights = 0
    for f in sorted(pathlib.Path(build, "experts").glob("*.safetensors")):
        tensors, _ = safetensors_io.load_file(f)
        for name, a in tensors.items():
            proj, kind = name.split(".", 1)
            if kind == "trellis":
                parts["trellis"] += a.nbytes
                e, tr, tc, _ = a.shape
                weights += e * tr * tc * 256
            elif kind == "scale":
                parts["matrix scales"] += a.nbytes
            else:
                parts["scales (CSF)"] += a.nbytes
    for f in pathlib.Path(build, "coupled").glob("*.safetensors"):
        parts["sign vectors"] += sum(a.nbytes for a in safetensors_io.load_file(f)[0].values())
    files = sum(p.stat().st_size for d in ("experts", "coupled")
                for p in pathlib.Path(build, d).glob("*"))
    return {k: 8 * v / weights for k, v in parts.items()}, 8 * files / weights


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=str(ROOT / "build" / "bin"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="128,1024")
    ap.add_argument("--experts", type=int, default=4)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tmx = os.path.join(args.bin, "tmx")
    rows, bits = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for side in sizes:
            model = os.path.join(tmp, f"model-{side}")
            make_model(model, side, args.experts)
            for codec, block in CODECS:
                out = os.path.join(tmp, f"{codec}-{side}")
                subprocess.run([tmx, "quantize", "--model", model, "--out", out, "--codec", codec,
                                "--bits", "3", "--threads", str(args.threads)], check=True,
                               capture_output=True)
                with open(os.path.join(out, "quantize-report.json")) as f:
                    layer = json.load(f)["layers"][0]
                n = args.experts * 3 * side * side
                sec = layer["seconds"]
                rows.append((codec, side, n, sec["encode_cpu"], sec["encode"], sec["hessians"],
                             layer["proxy_error_mean"]))
                bits.append((codec, side, block, *stored_bits(out)))

    T = args.threads
    print(f"### Encoder throughput, K = 3, {T} threads\n")
    print(f"| codec | matrix side | expert weights | encode CPU s | wall s | weights/s on {T} "
          "cores | Hessians s | mean proxy error |\n|---|---|---|---|---|---|---|---|")
    for codec, side, n, cpu, wall, hess, proxy in rows:
        print(f"| {codec} | {side} | {n:,} | {cpu:.1f} | {wall:.1f} | {n * T / cpu:,.0f} | "
              f"{hess:.2f} | {proxy:.4f} |")
    full = FULL["layers"] * FULL["experts"] * 3 * FULL["side"] ** 2
    print(f"\nProjection to the reconstructed full-size config ({FULL['layers']} layers x "
          f"{FULL['experts']} experts x 3 matrices of {FULL['side']}^2 = {full:.3g} weights), "
          f"CPU seconds per weight fitted as a + b*side over the sizes above:\n")
    print(f"| codec | CPU s/weight at {FULL['side']} | weights/s on {T} cores | {T} cores | "
          "64 cores (linear) |\n|---|---|---|---|---|")
    for codec, _ in CODECS:
        pts = [(side, cpu / n) for c, side, n, cpu, _, _, _ in rows if c == codec]
        xs, ys = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts])
        b, a = np.polyfit(xs, ys, 1) if len(pts) > 1 else (0.0, ys[0])
        t = a + b * FULL["side"]
        days = full * t / 86400
        print(f"| {codec} | {t:.3g} | {T / t:,.0f} | {days / T:,.0f} days | "
              f"{days / 64:,.1f} days |")
    print("\n### Bits per expert weight stored, K = 3\n")
    print("| codec | matrix side | trellis | scales raw | scales CSF | matrix scales | "
          "sign vectors | total | files |\n|---|---|---|---|---|---|---|---|---|")
    for codec, side, block, parts, files in bits:
        total = sum(parts.values())
        print(f"| {codec} | {side} | {parts['trellis']:.4f} | {8 / block:.4f} | "
              f"{parts['scales (CSF)']:.4f} | {parts['matrix scales']:.6f} | "
              f"{parts['sign vectors']:.6f} | {total:.4f} | {files:.4f} |")


if __name__ == "__main__":
    main()
