#!/usr/bin/env bash
# Fuzzes the parsers that read untrusted input, each for a bounded time:
#   ./tools/fuzz.sh [SECONDS]   (default 60 per target)
# Targets: fuzz_safetensors (checkpoint headers), fuzz_template (chat templates), fuzz_api_http
# (the HTTP front end), fuzz_tokenizer (prompt text through muse-mini's tokenizer and back). Built with clang (libFuzzer + ASan + UBSan) in build-fuzz/; each keeps
# what it learns in build-fuzz/corpus-<target>/. Exits non-zero on a crash, leaving the input
# that caused it in build-fuzz/crash-*.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
targets=(fuzz_safetensors fuzz_template fuzz_api_http fuzz_tokenizer)
cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DTMX_FUZZ=ON -DTMX_TESTS=OFF >/dev/null
cmake --build build-fuzz --target "${targets[@]}" -j "$(nproc)"
cd build-fuzz
for t in "${targets[@]}"; do
  mkdir -p "corpus-$t"
  extra=()
  if [ "$t" = fuzz_safetensors ]; then
    extra=(-dict=../tests/fuzz/safetensors.dict ../tests/fuzz/seeds)
  elif [ "$t" = fuzz_template ]; then
    extra=(../tests/fuzz/template) # small templates of our own that use most of the language
  elif [ "$t" = fuzz_api_http ]; then
    extra=(../tests/fuzz/http) # one request of each route and feature, so that mutations start deep
  elif [ "$t" = fuzz_tokenizer ]; then
    extra=(../tests/fuzz/tokenizer) # a chat prompt with special tokens, Unicode, broken UTF-8
  fi
  echo "== $t: $seconds s"
  ./bin/"$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
             "corpus-$t" "${extra[@]}" 2>&1 | tail -n 12
done
