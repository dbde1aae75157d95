#!/bin/bash
# tests/gpu/matmul_ab.sh: one boolean option of kernels.cuda, off against on, for the dense
# matmuls: the matmul conformance cases, the graph check and memcheck with it on, then
# tmx-bench-matmul (BF16 and MXFP8 weights of the 816B model's attention projections and
# lm_head, 1 to 64 tokens) off and on in alternating rounds, and a table of µs a call.
# Run from the repo root through the device tool after tests/gpu/prepare.sh:
#   run(command="bash tests/gpu/matmul_ab.sh mx_mv", carry=[".devpack.tar.xz"])
# Arguments: OPTION [ROUNDS (default 2)]. Writes $OUT/ab-OPTION-*.json and the logs; exits 1
# if a check fails.
set -u
. "$(dirname "$0")/devpack.sh" || exit 1
opt=${1:?usage: matmul_ab.sh OPTION [ROUNDS]}
rounds=${2:-2}
var=TMX_KERNELS_CUDA_$(echo "$opt" | tr '[:lower:]' '[:upper:]')
rc=0
env "$var=true" "$bin/tmx" conform --kernels cuda --filter matmul \
    > "$OUT/ab-$opt-conform.txt" 2>&1 || rc=1
echo "conformance with $opt on: $(tail -1 "$OUT/ab-$opt-conform.txt")"
env "$var=true" "$bin/tmx-graph-check" cuda > "$OUT/ab-$opt-graph.txt" 2>&1
graph_rc=$?
[ "$graph_rc" -eq 0 ] || rc=1
echo "graph check with $opt on: rc $graph_rc"
if command -v compute-sanitizer > /dev/null; then
    env "$var=true" timeout 120 compute-sanitizer --tool memcheck "$bin/tmx" conform \
        --kernels cuda --filter matmul > "$OUT/ab-$opt-memcheck.txt" 2>&1
    grep -a "ERROR SUMMARY" "$OUT/ab-$opt-memcheck.txt" || echo "memcheck: no summary"
fi
for r in $(seq "$rounds"); do
    for v in false true; do
        env "$var=$v" "$bin/tmx-bench-matmul" cuda "$OUT/ab-$opt-$v-$r.json" \
            > "$OUT/ab-$opt-$v-$r.txt" 2>&1 || rc=1
    done
done
python3 - "$OUT" "$opt" "$rounds" <<'EOF'
import json, sys
out, opt, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
us = {}  # (weight, n) -> {(format, on): [µs of each round]}
for r in range(1, rounds + 1):
    for on in ("false", "true"):
        for run in json.load(open(f"{out}/ab-{opt}-{on}-{r}.json"))["runs"]:
            for form in ("bf16", "mxfp8"):
                if f"{form}_us" in run:
                    cell = us.setdefault((run["weight"], run["n"]), {})
                    cell.setdefault((form, on), []).append(run[f"{form}_us"])
cols = [(f, o) for f in ("bf16", "mxfp8") for o in ("false", "true")]
print(f"\nµs a call, {opt} off / on, rounds separated by '/'")
print(f"{'weight':<10}{'n':>4}" + "".join(f"{f + (' on' if o == 'true' else ' off'):>20}"
                                         for f, o in cols))
for (w, n), cell in us.items():
    print(f"{w:<10}{n:>4}" + "".join(f"{'/'.join(f'{x:.1f}' for x in cell.get(c, [])):>20}"
                                     for c in cols))
EOF
exit $rc
