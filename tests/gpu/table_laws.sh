#!/bin/bash
# tests/gpu/table_laws.sh: the K3 GEMV's variants on a GPU machine (docs/perf/h200-codec.md,
# "A cheaper decode"): TrellisMX v1's decode as it stands, v1 read from a 64 KB state table,
# law e4m3-pair from its 128 KB pair table or computed, 8 experts x [4096][4096] at one token,
# every kernel checked against a host decode. The bar to compare with: cuBLASLt FP8's
# 3.9e12 weights/s and 50% of copy bandwidth, 5.3e12 weights/s of K3 words and scales.
# Run from the repo root through the device tool after tests/gpu/prepare.sh:
#   run(command="bash tests/gpu/table_laws.sh", carry=[".devpack.tar.xz"])
# Writes $OUT/gemv-variants.json and gpu.txt, prints the table, then each kernel once under
# Nsight Compute (tools/trellis/ncu_variants.py: instructions and shared-memory wavefronts a
# tile, gemv-ncu.json; ncu.csv the counters); exits 1 when a kernel differs from the host.
set -u
. "$(dirname "$0")/devpack.sh" || exit 1
[ -x "$bin/trellis-gemv-variants" ] || {
    echo "table_laws.sh: .devbin/trellis-gemv-variants missing: build with CUDA, prepare.sh" >&2
    exit 1
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv \
    > "$OUT/gpu.txt" 2>&1
"$bin/trellis-gemv-variants" --json "$OUT/gemv-variants.json"
rc=$?
# Each kernel once under Nsight Compute: instructions and shared-memory wavefronts a tile.
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ -x "$ncu" ]; then
    timeout 300 "$ncu" --csv --log-file "$OUT/ncu.csv" \
        --metrics "$(python3 tools/trellis/ncu_variants.py --metrics)" \
        "$bin/trellis-gemv-variants" --profile > "$OUT/ncu-variants.txt" 2>&1 &&
        python3 tools/trellis/ncu_variants.py "$OUT/ncu.csv" "$OUT/ncu-variants.txt" \
            --json "$OUT/gemv-ncu.json"
fi
exit $rc
