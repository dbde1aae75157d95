#!/bin/bash
# tests/gpu/run.sh: checks the CUDA kernel set on a GPU machine with binaries built elsewhere.
#
# Here (no GPU needed; nvcc must be present so that kernels/cuda is built):
#   cmake -S . -B build-cuda && cmake --build build-cuda -j4 && tests/gpu/prepare.sh build-cuda
# There, through the device tool, from the repo root:
#   run(command="bash tests/gpu/run.sh", carry=[".devbin", ".devlibs", ".devmodels"])
#
# Steps, each logged under $OUT:
#   1. nvidia-smi                                   gpu.txt
#   2. tmx conform --kernels cuda (+ per-case time) conform.txt, conform.json
#   3. tmx-graph-check cuda                         graph.txt
#   4. muse-tiny BF16 and F32, every KV cache dtype: 64 greedy tokens with kernels cpu and cuda,
#      texts compared; a longer cuda run for decode tokens/s        generate.txt, summary.json
#   5. compute-sanitizer memcheck over the conformance cases, when the machine allows it
# The last thing printed is a summary table.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
OUT=${OUT:-/tmp/tmx-gpu}
mkdir -p "$OUT"
bin=$root/.devbin
[ -x "$bin/tmx" ] || { echo "run.sh: .devbin/tmx missing: run tests/gpu/prepare.sh and carry .devbin" >&2; exit 1; }

# cuBLASLt comes from the machine's toolkit (or its pip wheel): too large to carry.
lt=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib*; do
    [ -f "$d/libcublasLt.so.13" ] && { lt=$d; break; }
done
[ -n "$lt" ] || lt=$(dirname "$(find /usr /opt -name 'libcublasLt.so.13' -print -quit 2>/dev/null)")
export LD_LIBRARY_PATH=$root/.devlibs:$lt${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "libcublasLt from: $lt"

nvidia-smi | tee "$OUT/gpu.txt"
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)

# One process per op, so that a kernel that faults (a sticky CUDA error) fails its own op only.
echo "== conformance"
conform_rc=0
: > "$OUT/conform.txt"
for op in embed rmsnorm matmul rope kv_store attention moe_route moe_experts swiglu add_gated gather; do
    "$bin/tmx" conform --kernels cuda --filter "$op/" --repeat 20 --json "$OUT/c-$op.json" \
        >> "$OUT/conform.txt" 2>&1 || conform_rc=1
done
cat "$OUT/conform.txt"
python3 - "$OUT" <<'EOF'
import glob, json, sys
parts = [json.load(open(p)) for p in sorted(glob.glob(f"{sys.argv[1]}/c-*.json"))]
cases = [c for p in parts for c in p["cases"]]
doc = {"kernels": "cuda", "cases_run": len(cases), "failed": sum(not c["pass"] for c in cases),
       "cases": cases}
json.dump(doc, open(f"{sys.argv[1]}/conform.json", "w"), indent=1)
EOF
rm -f "$OUT"/c-*.json

echo "== graphs"
"$bin/tmx-graph-check" cuda > "$OUT/graph.txt" 2>&1
graph_rc=$?
cat "$OUT/graph.txt"

echo "== muse-tiny end to end"
prompt="Four score and seven years ago"
gen() { # model kernels kv n -> stdout of tmx generate; its stderr goes to generate.txt
    "$bin/tmx" generate --model ".devmodels/muse-tiny-$1" --prompt "$prompt" -n "$4" \
        --set kernels="$2" --set kv_dtype="$3" 2>> "$OUT/generate.txt"
}
: > "$OUT/generate.txt"
rows=()
for dt in bf16 f32; do
    for kv in f32 bf16 fp8 int8; do
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

echo "== compute-sanitizer (memcheck) over the conformance cases"
san="skipped"
if command -v compute-sanitizer > /dev/null; then
    timeout 45 compute-sanitizer --tool memcheck "$bin/tmx" conform --kernels cuda \
        > "$OUT/sanitizer.txt" 2>&1
    san=$(grep -E "ERROR SUMMARY|not supported|error" "$OUT/sanitizer.txt" | tail -1)
    [ -n "$san" ] || san="exit $? (see sanitizer.txt)"
fi
echo "$san"

python3 - "$OUT" "$conform_rc" "$graph_rc" "$san" "$gpu" "${rows[@]}" <<'EOF'
import json, os, sys
out, conform_rc, graph_rc, san, gpu, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6:]
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
summary = {"gpu": gpu, "conform_rc": conform_rc, "graph_rc": graph_rc, "sanitizer": san,
           "ops": ops, "failed": fails, "generate": rows}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(f"\n==== {gpu}")
print(f"{'op':<14}{'pass':>9}  worst err/tol")
for k, v in ops.items():
    print(f"{k:<14}{v['pass']:>5}/{v['cases']:<3}  {v['worst_err_over_tol']:.3f}")
print(f"conformance: {len(doc['cases']) - len(fails)}/{len(doc['cases'])} pass (rc {conform_rc})"
      + (f"; FAIL: {', '.join(fails)}" if fails else ""))
print(f"graph check: {'PASS' if graph_rc == 0 else 'FAIL'}; sanitizer: {san}")
for r in rows:
    a, b, c = r.split("|")
    print(f"  {a:<22} {b:<58} {c}")
EOF
