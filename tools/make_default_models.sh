#!/usr/bin/env bash
# Makes the default model: the K3 TrellisMX builds of muse-mini that `tmx serve` runs without
# --model, from the committed BF16 teacher models/muse-mini, with `tmx quantize`.
#
#   models/muse-mini-k3       trellis-e4m3, 3 bits per weight (always)
#   models/muse-mini-k3-fp4   trellis-fp4, 3 bits per weight (with --fp4)
#   models/muse-mini-k3-pair  trellis-e4m3-pair, 3 bits per weight (with --pair; the
#                             experimental law of docs/trellismx.md §14, CPU only)
#
# The builds are made here rather than committed (.gitignore lists them): 23 MB each, and every
# call of the device tool carries the working tree, which may hold at most 64 MiB. A build that
# is present and matches its trellismx-manifest.json (`tmx inspect --verify`) is kept; any other
# is made again, in a temporary folder that is moved into place once complete, so an
# interrupted run leaves no half build behind.
#
# Calibration: tools/train/calib-books.txt, 24 passages (74 KB) cut at evenly spaced places from
# ../shared/data/gutenberg/train.txt.xz (the training books; none of the held-out authors, no
# WikiText), of which the first 16,384 tokens are used, in windows of 1,024 (the model's
# context). Against tmx's built-in 6 KB sample it lowers KL(teacher || K3 E4M3) from 0.0417 to
# 0.0353 nats (paired difference 0.0064 [0.0044, 0.0080], 16 windows of held-out books and
# WikiText-2; models/muse-mini/README.md).
#
# usage: tools/make_default_models.sh [--fp4] [--pair] [--force] [--tmx BIN] [--out DIR]
#                                     [--threads N]
#   --fp4        also make muse-mini-k3-fp4
#   --pair       also make muse-mini-k3-pair
#   --force      make the builds again even when they verify
#   --tmx BIN    the tmx executable (default: build/bin/tmx)
#   --out DIR    the folder the builds go in (default: models)
#   --threads N  quantize threads (default: every core)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmx="$root/build/bin/tmx" out="$root/models" threads="$(nproc)" fp4=0 pair=0 force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --fp4) fp4=1 ;;
    --pair) pair=1 ;;
    --force) force=1 ;;
    --tmx) tmx="${2:?--tmx needs a path}"; shift ;;
    --out) out="${2:?--out needs a folder}"; shift ;;
    --threads) threads="${2:?--threads needs a number}"; shift ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "make_default_models.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
teacher="$root/models/muse-mini"
calib="$root/tools/train/calib-books.txt"
fail() { echo "make_default_models.sh: $1" >&2; exit 2; }
[ -x "$tmx" ] || fail "--tmx $tmx: no such executable (build tmx first)"
[ -f "$teacher/config.json" ] || fail "$teacher: the teacher is missing"
mkdir -p "$out"

# build_one NAME CODEC: one build, unless it is there and verifies.
build_one() {
  local dir="$out/$1" tmp="$out/.$1.tmp"
  if [ "$force" = 0 ] && [ -d "$dir" ] && "$tmx" inspect --verify "$dir" >/dev/null 2>&1; then
    echo "$dir: present, matches its manifest"
    return
  fi
  echo "$dir: making it (tmx quantize --codec $2, about a minute on 2 cores)"
  rm -rf "$tmp"
  "$tmx" quantize --model "$teacher" --out "$tmp" --codec "$2" --bits 3 --calib "$calib" \
    --tokens 16384 --window 1024 --threads "$threads" > "$out/.$1.log" 2>&1 \
    || { cat "$out/.$1.log" >&2; exit 1; }
  "$tmx" inspect --verify "$tmp" >/dev/null
  rm -rf "$dir" "$out/.$1.log"
  mv "$tmp" "$dir"
  echo "$dir: made, $(du -sh "$dir" | cut -f1)"
}

build_one muse-mini-k3 trellis-e4m3
if [ "$fp4" = 1 ]; then build_one muse-mini-k3-fp4 trellis-fp4; fi
if [ "$pair" = 1 ]; then build_one muse-mini-k3-pair trellis-e4m3-pair; fi
