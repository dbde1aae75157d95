#!/bin/bash
# tests/gpu/run.sh: checks the CUDA kernel set on a GPU machine with binaries built elsewhere.
#
# Here (no GPU needed; nvcc must be present so that kernels/cuda is built):
#   cmake -S . -B build-cuda && cmake --build build-cuda -j4 && tests/gpu/prepare.sh build-cuda
# There, through the device tool, from the repo root:
#   run(command="bash tests/gpu/run.sh", carry=[".devpack.tar.xz"])
#
# Steps, each logged under $OUT:
#   1. nvidia-smi                                   gpu.txt
#   2. tmx conform --kernels cuda (+ per-case time) conform.txt, conform.json
#   3. tmx-graph-check cuda                         graph.txt
#      tmx conform of matmul with bf16_mv, mx_mv off  conform-opt.txt
#      tmx-bench-matmul cuda: BF16 against MXFP8 weights   bench-matmul.json
#      tmx-bench-pick cuda: a step's argmax and topk against reading the logits  bench-pick.json
#   4. muse-tiny BF16 and F32 (when carried), every KV cache dtype, and its K3 builds (e4m3,
#      fp4; quantized on the machine from BF16 unless carried): 64 greedy tokens with kernels cpu
#      and cuda, texts compared; a longer cuda run for decode tokens/s  generate.txt, summary.json
#   5. logits: tmx eval-kld with the CPU as teacher and CUDA as model   kld.txt
#   6. compute-sanitizer memcheck over the conformance cases, when the machine allows it
#   7. the codecs' device bench (tests/gpu/codec.sh) when .gpu-codec is carried, and the SASS
#      of the K3 matmul kernel                                          h200-codec.json
# The device tool returns at most 8 files: the long logs travel in logs.tgz. The last thing
# printed is a summary table.
set -u
. "$(dirname "$0")/devpack.sh" || exit 1
mkdir -p "$OUT/logs"
echo "libcublasLt from: $lt"

nvidia-smi | tee "$OUT/logs/gpu.txt"
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)

# One process per op, so that a kernel that faults (a sticky CUDA error) fails its own op only.
echo "== conformance"
conform_rc=0
: > "$OUT/logs/conform.txt"
for op in embed rmsnorm matmul rope kv_store attention moe_route moe_experts moe_experts_partial \
    moe_combine swiglu add_gated add_rmsnorm qk_norm_rope gather argmax matmul_multi topk \
    logit_edit; do
    "$bin/tmx" conform --kernels cuda --filter "$op/" --repeat 20 --json "$OUT/c-$op.json" \
        >> "$OUT/logs/conform.txt" 2>&1 || conform_rc=1
done
cat "$OUT/logs/conform.txt"
python3 - "$OUT" <<'EOF'
import glob, json, sys
parts = [json.load(open(p)) for p in sorted(glob.glob(f"{sys.argv[1]}/c-*.json"))]
cases = list({c["name"]: c for p in parts for c in p["cases"]}.values())  # "rope/" also picks qk_norm_rope/
doc = {"kernels": "cuda", "cases_run": len(cases), "failed": sum(not c["pass"] for c in cases),
       "cases": cases}
json.dump(doc, open(f"{sys.argv[1]}/conform.json", "w"), indent=1)
EOF
rm -f "$OUT"/c-*.json

echo "== graphs"
"$bin/tmx-graph-check" cuda > "$OUT/graph.txt" 2>&1
graph_rc=$?
cat "$OUT/graph.txt"

# The large weights' GEMVs and split GEMMs, which the tensor-core GEMV (options bf16_mv and
# mx_mv, on) takes over from 2 tokens: checked with those options off.
echo "== matmul conformance with bf16_mv and mx_mv off"
TMX_KERNELS_CUDA_BF16_MV=false TMX_KERNELS_CUDA_MX_MV=false "$bin/tmx" conform --kernels cuda \
    --filter matmul > "$OUT/logs/conform-opt.txt" 2>&1
opt_rc=$?
tail -1 "$OUT/logs/conform-opt.txt"

echo "== matmul: BF16 against MXFP8 weights"
"$bin/tmx-bench-matmul" cuda "$OUT/bench-matmul.json" > "$OUT/logs/bench-matmul.txt" 2>&1
bench_rc=$?
cat "$OUT/logs/bench-matmul.txt"

echo "== picks: argmax and topk on the device against logits read back"
"$bin/tmx-bench-pick" cuda "$OUT/bench-pick.json" > "$OUT/logs/bench-pick.txt" 2>&1
pick_rc=$?
cat "$OUT/logs/bench-pick.txt"

echo "== muse-tiny end to end"
# Its K3 builds are quantized here from the BF16 model when .devmodels lacks them (beside the
# binaries and the models they would pass the device tool's 64 MiB); a few seconds each.
for build in k3:e4m3 k3fp4:fp4; do
    name=${build%%:*} codec=${build#*:}
    [ -f ".devmodels/muse-tiny-$name/config.json" ] && continue
    [ -f .devmodels/muse-tiny-bf16/config.json ] || break
    rm -rf ".devmodels/muse-tiny-$name"
    "$bin/tmx" quantize --model .devmodels/muse-tiny-bf16 --out ".devmodels/muse-tiny-$name" \
        --codec "trellis-$codec" --bits 3 -t "$(nproc)" >> "$OUT/logs/quantize.txt" 2>&1 ||
        echo "quantize $codec failed (logs/quantize.txt)"
done
prompt="Four score and seven years ago"
gen() { # model kernels kv n -> stdout of tmx generate; its stderr goes to generate.txt
    "$bin/tmx" generate --model ".devmodels/muse-tiny-$1" --prompt "$prompt" -n "$4" \
        --set kernels="$2" --set kv_dtype="$3" 2>> "$OUT/generate.txt"
}
: > "$OUT/generate.txt"
rows=()
models=""
for b in bf16 f32 k3 k3fp4; do [ -f ".devmodels/muse-tiny-$b/config.json" ] && models+=" $b"; done
for dt in $models; do
    kvs="f32 bf16 fp8 int8"
    case $dt in k3*) kvs="f32 fp8" ;; esac
    for kv in $kvs; do
        gen $dt cpu $kv 64 > "$OUT/g-cpu.txt"
        gen $dt cuda $kv 64 > "$OUT/g-cuda.txt"
        { echo "--- $dt kv=$kv cpu"; cat "$OUT/g-cpu.txt"; echo "--- $dt kv=$kv cuda"; cat "$OUT/g-cuda.txt"; } >> "$OUT/generate.txt"
        # the text is everything before the final "N tokens, X tokens/s" line
        same=$(python3 - "$OUT/g-cpu.txt" "$OUT/g-cuda.txt" <<'EOF'
import sys
a, b = (open(p, errors="replace").read().rsplit("\n", 2)[0] for p in sys.argv[1:3])
n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
print("identical" if a == b else f"differ@char{n}/{len(a)}")
EOF
)
        tps=$(grep -ao '[0-9.]* tokens/s' "$OUT/g-cuda.txt" | head -1 | cut -d' ' -f1)
        rows+=("$dt kv=$kv|$same|${tps:-error}")
    done
    # decode speed over 512 tokens: cuda with graphs (the default), cuda eager, cpu
    speeds=""
    for run in "cuda true" "cuda false" "cpu true"; do
        set -- $run
        "$bin/tmx" generate --model ".devmodels/muse-tiny-$dt" --prompt "$prompt" -n 512 \
            --set kernels=$1 --set graphs=$2 > "$OUT/g-long.txt" 2>> "$OUT/generate.txt"
        tail -1 "$OUT/g-long.txt" >> "$OUT/generate.txt"
        tps=$(grep -ao '[0-9.]* tokens/s' "$OUT/g-long.txt" | head -1 | cut -d' ' -f1)
        speeds+="$1$([ $2 = false ] && echo -eager) ${tps:-error}, "
    done
    rows+=("$dt 512 tokens tok/s|${speeds%, }|")
done
rm -f "$OUT"/g-*.txt

echo "== logits: CPU teacher, CUDA model"
: > "$OUT/kld.txt"
for dt in $models; do
    echo "--- $dt" >> "$OUT/kld.txt"
    "$bin/tmx" eval-kld --teacher ".devmodels/muse-tiny-$dt" --model ".devmodels/muse-tiny-$dt" \
        --text README.md --window 256 --max-windows 4 --calib none --resamples 200 \
        --teacher-set kernels=cpu --model-set kernels=cuda -o "$OUT/logs/kld-$dt" \
        >> "$OUT/kld.txt" 2>&1 || echo "eval-kld failed: rc $?" >> "$OUT/kld.txt"
done
cat "$OUT/kld.txt"

echo "== compute-sanitizer (memcheck) over the conformance cases"
san="skipped"
if command -v compute-sanitizer > /dev/null; then
    timeout 45 compute-sanitizer --tool memcheck "$bin/tmx" conform --kernels cuda \
        > "$OUT/logs/sanitizer.txt" 2>&1
    san=$(grep -E "ERROR SUMMARY|not supported|error" "$OUT/logs/sanitizer.txt" | tail -1)
    [ -n "$san" ] || san="exit $? (see sanitizer.txt)"
fi
echo "$san"

codec_rc=skipped
if [ -x .gpu-codec/trellis-gpu-bench ]; then
    echo "== codec device bench"
    sh tests/gpu/codec.sh .gpu-codec "$OUT/logs/codec" > "$OUT/logs/codec.txt" 2>&1
    codec_rc=$?
    cp "$OUT/logs/codec/h200-codec.json" "$OUT/" 2>/dev/null
    tail -40 "$OUT/logs/codec.txt"
    command -v cuobjdump > /dev/null &&
        cuobjdump -sass -arch sm_90a .gpu-codec/trellis-gpu-bench > "$OUT/logs/sass.txt" 2>&1
fi

python3 - "$OUT" "$conform_rc" "$graph_rc" "$san" "$gpu" "$codec_rc" "$bench_rc" "$pick_rc" \
    "$opt_rc" "${rows[@]}" <<'EOF'
import json, os, sys
out, conform_rc, graph_rc, san, gpu, codec_rc, bench_rc, pick_rc, opt_rc = sys.argv[1:10]
conform_rc, graph_rc, opt_rc, rows = int(conform_rc), int(graph_rc), int(opt_rc), sys.argv[10:]
path = f"{out}/conform.json"
doc = json.load(open(path)) if os.path.exists(path) else {"cases": []}
fails = [c["name"] for c in doc["cases"] if not c["pass"]]
ops = {}
for c in doc["cases"]:
    o = ops.setdefault(c["op"], {"cases": 0, "pass": 0, "worst_err_over_tol": 0.0})
    o["cases"] += 1
    o["pass"] += c["pass"]
    if c["tol"] and c["err"] is not None:
        o["worst_err_over_tol"] = max(o["worst_err_over_tol"], c["err"] / c["tol"])
summary = {"gpu": gpu, "conform_rc": conform_rc, "conform_opt_rc": opt_rc, "graph_rc": graph_rc,
           "sanitizer": san,
           "codec_rc": codec_rc, "bench_matmul_rc": bench_rc, "bench_pick_rc": pick_rc, "ops": ops, "failed": fails,
           "generate": rows}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(f"\n==== {gpu}")
print(f"{'op':<14}{'pass':>9}  worst err/tol")
for k, v in ops.items():
    print(f"{k:<14}{v['pass']:>5}/{v['cases']:<3}  {v['worst_err_over_tol']:.3f}")
print(f"conformance: {len(doc['cases']) - len(fails)}/{len(doc['cases'])} pass (rc {conform_rc})"
      + (f"; FAIL: {', '.join(fails)}" if fails else ""))
print(f"matmul with bf16_mv and mx_mv off: {'PASS' if opt_rc == 0 else 'FAIL'}")
print(f"graph check: {'PASS' if graph_rc == 0 else 'FAIL'}; sanitizer: {san}; codec bench rc: "
      f"{codec_rc}; matmul bench rc: {bench_rc}; pick bench rc: {pick_rc}")
for r in rows:
    a, b, c = r.split("|")
    print(f"  {a:<22} {b:<58} {c}")
EOF
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
