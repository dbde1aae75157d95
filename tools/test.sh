#!/usr/bin/env bash
# Builds tmx and runs every test (CMocka units through ctest, then the Python checks against
# the numpy reference and outside tokenizers). --sanitize builds with ASan + UBSan in
# build-asan/ instead of build/.
set -euo pipefail
cd "$(dirname "$0")/.."
./.ci/deps
dir=build flags=()
if [ "${1:-}" = "--sanitize" ]; then
  dir=build-asan flags=(-DCMAKE_BUILD_TYPE=Debug -DTMX_SANITIZE=ON)
fi
cmake -S . -B "$dir" -DPython3_EXECUTABLE="$PWD/.venv/bin/python3" "${flags[@]}" >/dev/null
cmake --build "$dir" -j "$(nproc)"
ASAN_OPTIONS=detect_leaks=1 ctest --test-dir "$dir" --output-on-failure -j "$(nproc)"
