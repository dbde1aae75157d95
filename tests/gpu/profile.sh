#!/bin/sh
# tests/gpu/profile.sh: one launch of a codec kernel under Nsight Compute, summarized: its
# duration and pipe loads, where its warps stall and where its shared-memory wavefronts go,
# per SASS instruction (tools/trellis/ncu_source.py; docs/perf/h200-codec.md, "The wide
# GEMM's copies and constants").
#
#     tests/gpu/profile.sh BIN_DIR OUT_DIR KERNEL SKIP [MODE]
#
# BIN_DIR as for tests/gpu/codec.sh; KERNEL a mangled name (cuobjdump -symbols lists them,
# e.g. _Z14mm_wide_kernelILi3ELb0ELi256ELb1EEv9mm_params); SKIP the launches of it to pass
# over first (118: the --groups table's 512 tokens an expert for the wide kernels); MODE the
# bench's mode, --groups (default) or --sweep. Writes OUT_DIR/KERNEL.csv (the source page)
# and OUT_DIR/KERNEL.txt (the details page), and prints the summary.
set -eu
bin=$1
out=$2
kernel=$3
skip=$4
mode=${5:---groups}
mkdir -p "$out"
. "$(dirname "$0")/cublaslt.sh"
lt=$(cublaslt_dir)
export LD_LIBRARY_PATH="$bin${lt:+:$lt}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
rep=$(mktemp -d)/rep
"$ncu" --clock-control none --kernel-name-base mangled -k "$kernel" --launch-skip "$skip" \
    --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    --import-source no -o "$rep" "$bin/trellis-gpu-bench" "$mode" "$out/bench.json" \
    > "$out/$kernel.log" 2>&1
"$ncu" -i "$rep.ncu-rep" --page details --print-units base > "$out/$kernel.txt"
"$ncu" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$out/$kernel.csv"
rm -rf "$(dirname "$rep")"
grep -E "Duration|Compute \(SM\) Throughput|L1/TEX Cache Throughput|Eligible Warps|Warp Cycles Per Issued" \
    "$out/$kernel.txt" || true
python3 "$(dirname "$0")/../../tools/trellis/ncu_source.py" < "$out/$kernel.csv"
