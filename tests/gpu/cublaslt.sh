# tests/gpu/cublaslt.sh, sourced by the GPU scripts (POSIX sh, safe under set -eu):
# cublaslt_dir prints the folder of the machine's libcublasLt.so.13 — the CUDA toolkit's, its
# pip wheel's, or the first under /usr or /opt — or nothing. The library is too large to carry,
# so every script looks for it on the machine, this way.
cublaslt_dir() {
    wheel=$(python3 -c 'import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__))' \
        2>/dev/null || true)
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
             /usr/local/cuda-13*/lib* ${wheel:+"$wheel/lib"}; do
        if [ -e "$d/libcublasLt.so.13" ]; then
            echo "$d"
            return
        fi
    done
    f=$(find /usr /opt -name libcublasLt.so.13 -print -quit 2>/dev/null || true)
    if [ -n "$f" ]; then dirname "$f"; fi
}
