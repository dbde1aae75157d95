#!/bin/bash
# tests/gpu/prepare.sh: gathers what tests/gpu/run.sh needs on a GPU machine that has the CUDA
# driver and toolkit but not tmx's other libraries, into three ignored folders at the repo root:
#   .devbin/     tmx, libtmx.so, the plugins, tmx-graph-check and trellis-gemv-variants from
#                BUILD/bin (no unit tests)
#   .devlibs/    the shared libraries they need that are neither glibc's nor CUDA's (ldd)
#   .devmodels/  muse-tiny in BF16 and F32 (tools/make_tiny_model.py)
# and packs the three into .devpack.tar.xz (tests/gpu/devpack.sh unpacks it there).
# Usage, from the repo root after building with nvcc present:
#   tests/gpu/prepare.sh [BUILD]        (default build-cuda)
# then run tests/gpu/run.sh or muse_mini.sh on the GPU machine carrying .devpack.tar.xz.
set -euo pipefail
build=${1:-build-cuda}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
[ -x "$build/bin/tmx" ] && [ -f "$build/bin/libtmx-kernels-cuda.so" ] ||
    { echo "prepare.sh: $build/bin lacks tmx or libtmx-kernels-cuda.so: build with nvcc first" >&2; exit 1; }
for d in .devbin/ .devlibs/ .devmodels/ .devpack.tar.xz; do
    grep -qx "/$d" .git/info/exclude 2>/dev/null || echo "/$d" >> .git/info/exclude
done
rm -rf .devbin .devlibs
mkdir -p .devbin .devlibs .devmodels
cp "$build"/bin/tmx "$build"/bin/tmx-graph-check "$build"/bin/tmx-bench-matmul "$build"/bin/tmx-bench-pick \
    "$build"/bin/libtmx*.so \
    .devbin/
# The codec's GEMV variants (docs/perf/h200-codec.md), when the build made them.
[ -x "$build/bin/trellis-gemv-variants" ] && cp "$build/bin/trellis-gemv-variants" .devbin/

# Everything ldd resolves outside glibc, the CUDA toolkit and our own folder.
for f in .devbin/*; do ldd "$f"; done | awk '$3 ~ /^\// {print $3}' | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
        libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
        libcublas*|libcudart*) ;;
        libtmx*) ;;
        *) cp -L "$lib" .devlibs/ ;;
    esac
done

py=python3
[ -x .venv/bin/python3 ] && py=.venv/bin/python3
for dt in bf16 f32; do
    [ -f .devmodels/muse-tiny-$dt/config.json ] ||
        "$py" tools/make_tiny_model.py .devmodels/muse-tiny-$dt --dtype $dt > /dev/null
done
tar cJf .devpack.tar.xz .devbin .devlibs .devmodels
du -sh .devbin .devlibs .devmodels .devpack.tar.xz
