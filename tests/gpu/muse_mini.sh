#!/bin/bash
# tests/gpu/muse_mini.sh: the trained default model on a GPU machine, CPU against CUDA.
#
# Run from the repo root through the device tool after tests/gpu/prepare.sh (binaries in
# .devbin, libraries in .devlibs, packed in .devpack.tar.xz), with models/muse-mini in the tree:
#   run(command="bash tests/gpu/muse_mini.sh", carry=[".devpack.tar.xz"])
# Steps, each logged under $OUT:
#   1. tmx quantize muse-mini to K3 with both codecs on the machine's cores (the builds are too
#      large to carry beside the teacher: the device tool takes 64 MiB)
#   2. teacher, K3 e4m3 and K3 fp4: 64 greedy tokens with kernels cpu and cuda, texts compared
#   3. logits: tmx eval-kld with the CPU as teacher and CUDA as model, same checkpoint, over
#      tests/gpu/muse-mini-text.txt (three 1,000-token samples of muse-mini on the CPU, seeds
#      1-3 at temperature 1, prompts "Chapter 1." to "Chapter 3."): a fixed text, so that runs
#      compare
#   4. decode tokens/s over 256 tokens: cuda with graphs, cuda eager, cpu
#   5. sampled (temperature 0.8, top-p 0.95, seed 7): 64 tokens with kernels cpu and cuda,
#      texts compared (the draws are the same wherever the logits round alike), and decode
#      tokens/s over 256 tokens with cuda graphs
# Prints a table last and writes $OUT/muse-mini.json.
set -u
. "$(dirname "$0")/devpack.sh" || exit 1
log=$OUT/muse-mini.txt
: > "$log"
work=/tmp/muse-mini-builds
mkdir -p "$work"
cores=$(nproc)

for codec in e4m3 fp4; do
    rm -rf "$work/k3-$codec"
    "$bin/tmx" quantize --model models/muse-mini --out "$work/k3-$codec" \
        --codec "trellis-$codec" --bits 3 --tokens 32768 --window 1024 -t "$cores" >> "$log" 2>&1 ||
        echo "quantize $codec failed" | tee -a "$log"
done

prompt="It was a dark and stormy night; the rain fell in torrents, and"
sample=(--temperature 0.8 --top-p 0.95 --seed 7)
# 64 tokens of model $dir with kernels cpu and cuda (more tmx generate arguments after the
# label); prints how the texts compare
cpu_vs_cuda() {
    local label=$1
    shift
    for k in cpu cuda; do
        "$bin/tmx" generate --model "$dir" --prompt "$prompt" -n 64 --set kernels=$k "$@" \
            > "$OUT/g-$k.txt" 2>> "$log"
        { echo "--- $m $k $label"; cat "$OUT/g-$k.txt"; } >> "$log"
    done
    python3 - "$OUT/g-cpu.txt" "$OUT/g-cuda.txt" <<'EOF'
import sys
a, b = (open(p, errors="replace").read().rsplit("\n", 2)[0] for p in sys.argv[1:3])
n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
print("identical" if a == b and a else f"differ@char{n}/{len(a)}")
EOF
}
rows=()
for m in teacher k3-e4m3 k3-fp4; do
    dir=models/muse-mini
    [ "$m" = teacher ] || dir=$work/$m
    same=$(cpu_vs_cuda greedy)
    sampled=$(cpu_vs_cuda sampled "${sample[@]}")
    kld=$("$bin/tmx" eval-kld --teacher "$dir" --model "$dir" --text tests/gpu/muse-mini-text.txt --window 512 \
            --max-windows 4 --calib none --resamples 500 --teacher-set kernels=cpu \
            --model-set kernels=cuda 2>> "$log" | grep '^headline' | cut -c 30-)
    speeds=""
    for run in "cuda true greedy" "cuda false greedy" "cpu true greedy" "cuda true sampled"; do
        set -- $run
        extra=()
        [ $3 = sampled ] && extra=("${sample[@]}")
        "$bin/tmx" generate --model "$dir" --prompt "$prompt" -n 256 --set kernels=$1 \
            --set graphs=$2 "${extra[@]}" > "$OUT/g-long.txt" 2>> "$log"
        tps=$(grep -ao '[0-9.]* tokens/s' "$OUT/g-long.txt" | head -1 | cut -d' ' -f1) # decode, not the prompt's
        speeds+="$1$([ $2 = false ] && echo -eager)$([ $3 = sampled ] && echo ' sampled') ${tps:-error}, "
    done
    rows+=("$m|$same|${kld:-error}|${speeds%, }|$sampled")
done
rm -f "$OUT"/g-*.txt

gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)
python3 - "$OUT" "$gpu" "$cores" "${rows[@]}" <<'EOF'
import json, sys
out, gpu, cores, rows = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
recs = []
for r in rows:
    m, same, kld, speeds, sampled = r.split("|")
    recs.append({"model": m, "greedy_64": same, "sampled_64": sampled,
                 "kld_cpu_vs_cuda": kld.strip(), "decode_tok_s_256": speeds})
json.dump({"gpu": gpu, "cpu_cores": int(cores), "runs": recs},
          open(f"{out}/muse-mini.json", "w"), indent=1)
print(f"\n==== muse-mini on {gpu} (cpu: {cores} cores)")
for x in recs:
    print(f"{x['model']:<9} greedy {x['greedy_64']:<18} sampled {x['sampled_64']:<18} "
          f"KLD/top-1 {x['kld_cpu_vs_cuda']}")
    print(f"{'':<9} tok/s: {x['decode_tok_s_256']}")
EOF
