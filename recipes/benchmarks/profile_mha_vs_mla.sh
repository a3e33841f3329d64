#!/bin/bash
# Operator breakdown of mha-1b vs mla-1b on one GPU (bf16): where a training step's time goes.
# Eager runs separate FFN matmuls from the others (module annotations) and run the training-dynamics
# monitors; compiled runs (the recipes' default) show the kernels that MFU figures come from.
# Usage (on the GPU box, from the repo root): bash recipes/benchmarks/profile_mha_vs_mla.sh OUTDIR
# MODES="eager compiled" (default) picks the runs; SNAPSHOT=0 skips the memory-snapshot check.
# Writes OUTDIR/<recipe>-<eager|compiled>.json (each run's profile/breakdown.json), OUTDIR/compare.txt.
set -u
OUT=${1:?output directory}
mkdir -p "$OUT"
for recipe in mha-1b mla-1b; do
  for mode in ${MODES:-eager compiled}; do
    name=$recipe-$mode
    sets=(--set train.steps=8 --set profile.wait=4 --set profile.warmup=1 --set profile.active=2
          --set train.log_every=8 --set "train.compile=$([ $mode = compiled ] && echo true || echo false)")
    [ $mode = eager ] && sets+=(--monitors --set profile.monitors.every=4)
    echo "== $name" >&2
    timeout 200 python3 -m scaletool profile "recipes/$recipe.yaml" --out "/tmp/profile-runs/$name" "${sets[@]}" \
      --json > "$OUT/$name.json" 2> "/tmp/profile-$name.log" || { echo "FAILED $name"; tail -20 "/tmp/profile-$name.log"; }
    grep -h "warning: .*collapse" "/tmp/profile-$name.log" | head -3
  done
done
# the CUDA memory snapshot path, once (not in the runs above: recording allocations slows the profiled steps)
if [ "${SNAPSHOT:-1}" = 1 ]; then
  timeout 150 python3 -m scaletool profile recipes/mla-1b.yaml --out /tmp/profile-runs/snapshot --set train.steps=4 \
    --set profile.wait=1 --set profile.warmup=1 --set profile.active=1 --set train.compile=false \
    --set profile.memory_snapshot=true > /dev/null 2> /tmp/profile-snapshot.log || tail -20 /tmp/profile-snapshot.log
  ls -la /tmp/profile-runs/snapshot/profile/
fi
python3 - "$OUT" <<'PY' | tee "$OUT/compare.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {}
for p in sorted(out.glob("*-*.json")):
    try:
        runs[p.stem] = json.loads(p.read_text())
    except ValueError:
        print(f"{p.name}: no breakdown")
names = list(runs)
print("step time (ms, trace / loop clock): " + ", ".join(
    f"{n} {1e3 * r['step_time_s']:.1f} / {1e3 * (r['loop_step_time_s'] or 0):.1f}" for n, r in runs.items()))
for key in ("categories", "modules"):
    labels = list(next(iter(runs.values()))[key]) if runs else []
    print(f"\n{key} (share of step, ms)")
    print(f"{'':15}" + "".join(f"{n:>24}" for n in names))
    for lab in labels:
        print(f"{lab:15}" + "".join(
            f"{100 * (runs[n][key][lab]['share'] or 0):>14.1f}% {1e3 * runs[n][key][lab]['time_s']:>7.2f}"
            for n in names))
for n, r in runs.items():
    print(f"\n{n}: top kernels")
    for op in r["top_ops"][:8]:
        print(f"  {100 * op['share']:5.1f}%  {op['category']:13} {op['name'][:100]}")
    for note in r.get("notes", []):
        print(f"  note: {note}")
PY
