#!/bin/bash
# tests/gpu/step_profile.sh: where a decode step's time goes at each batch size, by kernel,
# under Nsight Compute (docs/perf/h200.md, "Waiting for the next run"). For each B, `tmx bench
# -b B -p 1 -n 2` on muse-mini, eager (no graphs, so that each kernel is its own launch): with
# one-token prompts every step of the run, prefill included, is a step of B tokens, so the
# kernels' times summed by name over the run, divided by its steps, are a step's. Prints, per
# kernel, µs a step at each B, largest first, and writes $OUT/step-profile.json.
# Run from the repo root through the device tool after tests/gpu/prepare.sh:
#   run(command="bash tests/gpu/step_profile.sh [B,...]", carry=[".devpack.tar.xz"])
set -u
. "$(dirname "$0")/devpack.sh" || exit 1
sizes=${1:-8,32}
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for b in ${sizes//,/ }; do
    timeout 240 "$ncu" --csv --log-file "$OUT/ncu-b$b.csv" --metrics gpu__time_duration.sum \
        "$bin/tmx" bench --model models/muse-mini -b "$b" -p 1 -n 2 --set kernels=cuda \
        --set graphs=false > "$OUT/bench-b$b.txt" 2>&1 || echo "B = $b: ncu or tmx bench failed ($OUT/bench-b$b.txt)"
done
python3 - "$OUT" "$sizes" <<'PY'
import collections, json, sys
sys.path.insert(0, "tools/trellis")
from ncu_variants import launches  # ncu's CSV: {launch: (kernel, {metric: value})}
out, sizes = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
# Steps a run of tmx bench -p 1 -n 2 makes: untimed (prompt + 2 decode) and timed (prompt + 2)
# rounds, each prompt one step of B one-token sequences.
STEPS = 6
per = {}
for b in sizes:
    t = collections.Counter()
    for kernel, m in launches(f"{out}/ncu-b{b}.csv").values():
        name = kernel.split("(")[0].replace("void ", "")
        t[name] += m["gpu__time_duration.sum"] / 1e3 / STEPS
    per[b] = t
names = sorted({n for t in per.values() for n in t}, key=lambda n: -per[sizes[-1]].get(n, 0))
print(f"{'kernel (us a step)':<60}" + "".join(f"{'B=' + str(b):>10}" for b in sizes))
for n in names:
    print(f"{n[:60]:<60}" + "".join(f"{per[b].get(n, 0):10.1f}" for b in sizes))
print(f"{'total':<60}" + "".join(f"{sum(per[b].values()):10.1f}" for b in sizes))
json.dump({"steps_per_run": STEPS, "us_per_step": {str(b): dict(per[b]) for b in sizes}},
          open(f"{out}/step-profile.json", "w"), indent=1)
PY
