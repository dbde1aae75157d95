#!/usr/bin/env bash
# tests/tp/netns.sh: tensor-parallel ranks on two "hosts" — two network namespaces joined by a
# veth pair — talking TCP through Open MPI (tcp BTL on the veth only; no shared memory).
#
#     tests/tp/netns.sh [BIN_DIR]      (default build/bin)
#
# Runs `tmx-comm-check --backend mpi` as two ranks, one per namespace, and checks that the
# traffic went over the veth; then `tmx generate` of muse-tiny (tools/make_tiny_model.py: 4
# heads, 2 KV heads) as the same two ranks, whose greedy text must be TP = 1's. Needs root
# (creating namespaces), ip (iproute2) and mpirun; when it cannot make the namespaces it says
# why and exits 77, which ctest counts as skipped. The model needs a Python with numpy and
# tokenizers ($PYTHON, else the repository's .venv, else python3); without one the generate
# part is skipped, and so (77) is the test after the collectives pass.
set -euo pipefail
root=$(realpath "$(dirname "$0")/../..")
bin=$(realpath "${1:-$root/build/bin}")
skip() { echo "SKIP: $*"; exit 77; }

command -v ip >/dev/null || skip "no ip command (iproute2 is not installed)"
command -v mpirun >/dev/null || skip "no mpirun (Open MPI is not installed)"
[ -x "$bin/tmx-comm-check" ] || { echo "FAIL: $bin/tmx-comm-check is not built"; exit 1; }

# Names carry the pid, so that runs side by side do not meet; the addresses live only inside
# the two namespaces.
ns0=tmx-tp0-$$ ns1=tmx-tp1-$$ net=10.199.77
cleanup() { ip netns del "$ns0" 2>/dev/null || true; ip netns del "$ns1" 2>/dev/null || true; }
trap cleanup EXIT
why=$(ip netns add "$ns0" 2>&1 && ip netns add "$ns1" 2>&1) ||
  skip "cannot create network namespaces: $why"
why=$(ip netns exec "$ns0" true 2>&1) || skip "cannot enter a network namespace: $why"
why=$(ip -n "$ns0" link add tv0 type veth peer name tv1 netns "$ns1" 2>&1) ||
  skip "cannot create a veth pair: $why"
ip -n "$ns0" addr add "$net.1/24" dev tv0
ip -n "$ns1" addr add "$net.2/24" dev tv1
for ns in "$ns0" "$ns1"; do ip -n "$ns" link set lo up; done
ip -n "$ns0" link set tv0 up
ip -n "$ns1" link set tv1 up

# The namespaces are two hosts to mpirun: it runs in $ns0 and starts its daemon on "host"
# $net.2 through an agent that stands in for ssh, entering $ns1 instead of logging in. Each
# rank then reaches its own host's daemon (PMIx, over that namespace's loopback), and the
# daemons and the ranks talk TCP on $net.0/24 only.
tmp=$(mktemp -d)
trap 'cleanup; rm -rf "$tmp"' EXIT
cat > "$tmp/enter" <<AGENT
#!/bin/sh
# called by mpirun as: enter HOST COMMAND...
host=\$1; shift
case "\$host" in
  $net.1) ns=$ns0 ;;
  $net.2) ns=$ns1 ;;
  *) echo "enter: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" sh -c "\$*"
AGENT
chmod +x "$tmp/enter"

# run_across CMD...: CMD as an MPI job of two ranks, rank 0 on $net.1 ($ns0), rank 1 on $net.2
# ($ns1).
run_across() {
  ip netns exec "$ns0" env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun -np 2 --host "$net.1:1,$net.2:1" --mca plm_rsh_agent "$tmp/enter" \
    --mca oob_tcp_if_include "$net.0/24" --mca pml ob1 --mca btl self,tcp \
    --mca btl_tcp_if_include "$net.0/24" --mca mpi_yield_when_idle 1 "$@"
}

tx_bytes() { ip netns exec "$ns0" cat /sys/class/net/tv0/statistics/tx_bytes; }

before=$(tx_bytes)
run_across "$bin/tmx-comm-check" --backend mpi
sent=$(( $(tx_bytes) - before ))
echo "veth $ns0 -> $ns1: $sent bytes"
# The timed 1 MB all-reduces alone move far more than this.
if [ "$sent" -lt $((1 << 20)) ]; then
  echo "FAIL: the ranks did not talk over the veth"
  exit 1
fi

# Greedy text: muse-tiny split over the two "hosts" against one rank outside them.
python=
for p in "${PYTHON:-}" "$root/.venv/bin/python3" python3; do
  if [ -n "$p" ] && "$p" -c 'import numpy, tokenizers' 2>/dev/null; then python=$p; break; fi
done
[ -n "$python" ] || skip "the collectives passed; no Python with numpy and tokenizers to make" \
  "muse-tiny for the generate part"
"$python" "$root/tools/make_tiny_model.py" "$tmp/tiny" >/dev/null
gen=("$bin/tmx" generate --model "$tmp/tiny" --prompt "Four score and seven years ago" -n 40
     --threads 1)
# the last line is the speed
text() { sed '$d'; }
ref=$("${gen[@]}" | text)
[ -n "$ref" ] || { echo "FAIL: TP = 1 generated nothing"; exit 1; }
before=$(tx_bytes)
got=$(run_across "${gen[@]}" | text)
sent=$(( $(tx_bytes) - before ))
echo "generate over the veth: $sent bytes"
if [ "$got" != "$ref" ]; then
  printf 'FAIL: the two namespaces generated\n%s\nTP = 1 generated\n%s\n' "$got" "$ref"
  exit 1
fi
# 40 steps, each with at least an all-reduce per layer and the logits' all-gather
if [ "$sent" -lt $((64 << 10)) ]; then
  echo "FAIL: the generate ranks did not talk over the veth"
  exit 1
fi
echo "generate: two namespaces == TP = 1"
echo PASS
