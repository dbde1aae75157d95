#!/bin/bash
# tests/gpu/bench.sh: `tmx bench` on a GPU machine: the engine's prefill and decode tokens/s
# at several batch sizes, with CUDA graphs and without, for muse-mini and its K3 e4m3 build
# (quantized on the machine, as muse_mini.sh does, unless /tmp/muse-mini-builds has it), then
# muse-mini sampled at 0.8 with top-p 0.95.
# Run from the repo root through the device tool after tests/gpu/prepare.sh:
#   run(command="bash tests/gpu/bench.sh", carry=[".devpack.tar.xz"])
# Arguments (optional): the batch sizes (default 1,8,32,64,128,256). Writes
# $OUT/bench-<model>-graphs-<true|false>.json and bench-muse-mini-sampled.json, and prints the
# tables.
set -u
. "$(dirname "$0")/devpack.sh" || exit 1
sizes=${1:-1,8,32,64,128,256}
k3=/tmp/muse-mini-builds/k3-e4m3
if [ ! -f "$k3/config.json" ]; then
    mkdir -p /tmp/muse-mini-builds
    "$bin/tmx" quantize --model models/muse-mini --out "$k3" --codec trellis-e4m3 --bits 3 \
        --tokens 32768 --window 1024 -t "$(nproc)" > "$OUT/quantize.txt" 2>&1 ||
        echo "quantize failed (quantize.txt)"
fi
rc=0
for m in models/muse-mini "$k3"; do
    for graphs in true false; do
        name=$(basename "$m")-graphs-$graphs
        "$bin/tmx" bench --model "$m" -b "$sizes" -p 128 -n 128 --set kernels=cuda \
            --set graphs=$graphs --json "$OUT/bench-$name.json" || rc=1
        echo
    done
done
# sampled as tmx serve samples: the device's candidates, rows read back when a draw needs more
"$bin/tmx" bench --model models/muse-mini -b "$sizes" -p 128 -n 128 --set kernels=cuda \
    --temperature 0.8 --top-p 0.95 --json "$OUT/bench-muse-mini-sampled.json" || rc=1
exit $rc
