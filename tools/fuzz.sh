#!/usr/bin/env bash
# Fuzzes the safetensors parser for a bounded time: ./tools/fuzz.sh [SECONDS] (default 60).
# Builds core/fuzz/fuzz_safetensors.c with clang (libFuzzer + ASan + UBSan) in build-fuzz/, starts
# from the seeds in tests/fuzz/seeds/ and keeps what it learns in build-fuzz/corpus/. Exits non-zero
# on a crash, leaving the input that caused it in build-fuzz/crash-*.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DTMX_FUZZ=ON -DTMX_TESTS=OFF >/dev/null
cmake --build build-fuzz --target fuzz_safetensors -j "$(nproc)"
mkdir -p build-fuzz/corpus
cd build-fuzz
./bin/fuzz_safetensors -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
                       -dict=../tests/fuzz/safetensors.dict -print_final_stats=1 \
                       corpus ../tests/fuzz/seeds
