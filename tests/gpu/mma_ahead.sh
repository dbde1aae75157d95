#!/bin/bash
# tests/gpu/mma_ahead.sh: the experimental form of bf16_mma_kernel (option
# kernels.cuda.bf16_mma_ahead: each step's loads a step ahead, one barrier a step) against the
# default one, on a GPU machine. Checks it first (the matmul and matmul_multi conformance
# cases and the graph check, with the option on), then `tmx bench` on muse-mini at the batch
# sizes the kernel takes, greedy and sampled (0.8, top-p 0.95), two rounds alternating off and
# on. Writes $OUT/mma-ahead/{conform,graph}.txt and bench-<sampled|greedy>-<off|on>-<round>.json,
# and prints a table of decode tok/s last.
# Run from the repo root through the device tool after tests/gpu/prepare.sh:
#   run(command="bash tests/gpu/mma_ahead.sh", carry=[".devpack.tar.xz"])
set -u
. "$(dirname "$0")/devpack.sh" || exit 1
out=$OUT/mma-ahead
mkdir -p "$out"
rc=0
export TMX_KERNELS_CUDA_BF16_MMA_AHEAD=true
for op in matmul matmul_multi; do
    "$bin/tmx" conform --kernels cuda --filter "$op/" >> "$out/conform.txt" 2>&1 || rc=1
done
"$bin/tmx-graph-check" cuda > "$out/graph.txt" 2>&1 || rc=1
tail -n 3 "$out/conform.txt" "$out/graph.txt"
sizes=9,16,32,64
for round in 1 2; do
    for ahead in false true; do
        for pick in greedy sampled; do
            args=()
            [ "$pick" = sampled ] && args=(--temperature 0.8 --top-p 0.95)
            TMX_KERNELS_CUDA_BF16_MMA_AHEAD=$ahead "$bin/tmx" bench --model models/muse-mini \
                -b "$sizes" -p 128 -n 128 --set kernels=cuda "${args[@]}" \
                --json "$out/bench-$pick-$ahead-$round.json" > /dev/null 2>&1 || rc=1
        done
    done
done
python3 - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(f"{out}/bench-*.json")):
    pick, ahead, rnd = os.path.basename(f)[6:-5].split("-")
    for r in json.load(open(f))["runs"]:
        rows.setdefault((pick, r["batch"]), {}).setdefault(ahead, []).append(r["decode_tok_s"])
print(f"{'decode tok/s':<10} {'B':>4} {'off (rounds)':>22} {'on (rounds)':>22}")
for (pick, b), v in sorted(rows.items()):
    fmt = lambda xs: " / ".join(f"{x:,.0f}" for x in xs)
    print(f"{pick:<10} {b:>4} {fmt(v.get('false', [])):>22} {fmt(v.get('true', [])):>22}")
PY
exit $rc
