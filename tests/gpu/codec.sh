#!/bin/sh
# tests/gpu/codec.sh: the TrellisMX codecs' device path on a GPU (docs/perf/h200-codec.md):
# device decode against the CPU decoder bit for bit, the fused matmul and the expert block
# against the CPU, and the timings beside cuBLASLt. Exits non-zero if a check fails.
#
#     tests/gpu/codec.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds trellis-gpu-bench (a build with CUDA: cmake --build B --target
# trellis-gpu-bench) and, where the machine lacks them, the shared libraries it needs
# (libjansson.so.4); cuBLASLt is looked for on the machine (tests/gpu/cublaslt.sh).
set -eu
bin=$1
out=$2
mkdir -p "$out"
. "$(dirname "$0")/cublaslt.sh"
lt=$(cublaslt_dir)
export LD_LIBRARY_PATH="$bin${lt:+:$lt}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv | tee "$out/gpu.txt"
"$bin/trellis-gpu-bench" "$out/h200-codec.json"
