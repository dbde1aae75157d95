#!/usr/bin/env bash
# The GPU run of muse-mini: tokenize, pretrain, chat phase, export, measure, fixture.
#
#   tools/train/run_gpu.sh DATA_DIR OUT_DIR [--minutes M] [other train.py options]
#
# DATA_DIR: train.txt.xz and heldout.txt.xz (../shared/data/gutenberg) and, optionally,
# wiki.test.raw (../shared/data/eval). OUT_DIR receives muse-mini/ (7 files) and
# muse-mini-run.json: 8 files, none over 15 MiB. --minutes is the training time (default 6);
# the whole run stays within 8.5 minutes. PYTHON overrides the interpreter (default python3).
# tools/train/README.md has the details.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 DATA_DIR OUT_DIR [--minutes M] [train.py options]" >&2
    exit 2
fi
data=$1 out=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec "${PYTHON:-python3}" "$here/train.py" --data "$data" --out "$out" "$@"
