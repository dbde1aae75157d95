# tests/gpu/devpack.sh: sourced first by the GPU scripts (run.sh, muse_mini.sh, bench.sh,
# serve_load.sh, table_laws.sh; bash) on the GPU machine. prepare.sh packs .devbin, .devlibs
# and .devmodels into .devpack.tar.xz (as plain folders they pass the device tool's 64 MiB of
# carried files; xz takes them to about 15 MiB). This sets root (the repo root, made the
# current folder), OUT (default /tmp/tmx-gpu, made), bin (.devbin) and lt (the machine's
# cuBLASLt folder: too large to carry, tests/gpu/cublaslt.sh finds it), unpacks the pack where
# its folders are not there already, and puts .devbin, .devlibs and lt on LD_LIBRARY_PATH.
# Returns 1 (with a message) when the pack does not unpack or .devbin/tmx is missing.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || return 1
OUT=${OUT:-/tmp/tmx-gpu}
mkdir -p "$OUT"
bin=$root/.devbin
if [ ! -x "$bin/tmx" ] && [ -f .devpack.tar.xz ]; then
    tar xJf .devpack.tar.xz || { echo "devpack.sh: .devpack.tar.xz does not unpack" >&2; return 1; }
fi
[ -x "$bin/tmx" ] || {
    echo "devpack.sh: .devbin/tmx missing: run tests/gpu/prepare.sh and carry .devpack.tar.xz" >&2
    return 1
}
. "$root/tests/gpu/cublaslt.sh"
lt=$(cublaslt_dir)
export LD_LIBRARY_PATH=$bin:$root/.devlibs${lt:+:$lt}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
