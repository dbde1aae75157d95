#!/bin/bash
# tests/gpu/serve_load.sh: `tmx serve` on a GPU under many concurrent streaming clients.
#
# tools/loadtest.py drives the server through the official openai client, which the GPU
# machine lacks: carry it as wheels (the device tool's README says how to download them for
# its Python; here, .whl/ holds openai and what it needs that the machine's image does not).
# Run from the repo root after tests/gpu/prepare.sh, with models/muse-mini in the tree:
#   run(command="bash tests/gpu/serve_load.sh", carry=[".devpack.tar.xz", ".whl"])
# Arguments (optional): the model folder (default models/muse-mini), then
# "CLIENTS:MAX_RUNNING" pairs (default 1:8 8:8 32:32 64:64). Every stream is checked by
# loadtest.py; a pair's report lands in $OUT/load-CLIENTS-MAX_RUNNING.json, and a table of all
# of them is printed last and written to $OUT/serve-load.json.
set -u
. "$(dirname "$0")/devpack.sh" || exit 1
if ! python3 -c 'import openai' 2> /dev/null; then
    [ -d .whl ] || { echo "serve_load.sh: no openai package and no .whl/ to install it from" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

model=${1:-models/muse-mini}
shift
pairs=("$@")
[ ${#pairs[@]} -gt 0 ] || pairs=(1:8 8:8 32:32 64:64)
rc=0
for p in "${pairs[@]}"; do
    clients=${p%:*} running=${p#*:}
    PYTHONUNBUFFERED=1 python3 tools/loadtest.py --model "$model" --tmx "$bin/tmx" \
        --set kernels=cuda --set max_running="$running" --clients "$clients" --requests 4 \
        --server-log "$OUT/serve-$clients-$running.log" \
        --json "$OUT/load-$clients-$running.json" > "$OUT/load-$clients-$running.md" || rc=1
done

gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)
python3 - "$OUT" "$gpu" "$model" "${pairs[@]}" <<'EOF'
import json, os, sys
out, gpu, model, pairs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
rows = []
for p in pairs:
    c, r = p.split(":")
    path = f"{out}/load-{c}-{r}.json"
    if not os.path.exists(path):
        rows.append({"clients": int(c), "max_running": int(r), "passed": False})
        continue
    rep = json.load(open(path))
    s = rep["summary"]
    rows.append({"clients": int(c), "max_running": int(r), "passed": rep["passed"],
                 "wall_s": s["wall_s"], "generated_tok_s": s["throughput"]["generated_tok_s"],
                 "requests_ok": s["requests"]["ok"], **s["client_ms"],
                 "server_cpu_s": rep.get("cpu_s")})
json.dump({"gpu": gpu, "model": model, "runs": rows}, open(f"{out}/serve-load.json", "w"), indent=1)
print(f"\n==== tmx serve, {model}, kernels cuda, on {gpu}")
print("clients running passed  tok/s   ttft p50/p99 ms   tpot p50/p99 ms")
for x in rows:
    if "wall_s" not in x:
        print(f"{x['clients']:>7} {x['max_running']:>7} no report")
        continue
    print(f"{x['clients']:>7} {x['max_running']:>7} {str(x['passed']):<6} "
          f"{x['generated_tok_s']:>7.0f} {x['ttft_p50']:>7.1f} / {x['ttft_p99']:<7.1f} "
          f"{x['tpot_p50']:>6.2f} / {x['tpot_p99']:.2f}")
EOF
exit $rc
