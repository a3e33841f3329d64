#!/bin/bash
# Tensor parallelism on one 4-GPU host (NVLink): TP=2, TP=4 and FSDP2 x TP 2x2 against FSDP2 alone, for
# mha-1b and mla-1b, eager bf16. Per-GPU tokens/s, peak memory against the estimate
# (analytic.tensor_parallel_memory), the analytic bytes on the wire per step and GPU
# (analytic.communication), and the profiler's communication share (exposed and overlapped).
#
# Two batch regimes, because where tensor parallelism pays depends on the per-GPU batch:
#   rank8   8 sequences per data-parallel rank (the recipes' micro-batch): TP groups see fewer sequences
#           per step than FSDP2 alone (global batch 8 x world / TP);
#   global8 the same global batch of 8 sequences for every layout: FSDP2 alone runs 8 / world sequences
#           per GPU (2 on 4 GPUs), TP=4 runs all 8 on each group (the small-per-GPU-batch regime).
# Layouts: 2 GPUs: fsdp, tp2; 4 GPUs: fsdp, tp4, 2x2 (fsdp2 x tp2). Same card, same session for all.
# Then `scaletool profile` of the 4-GPU layouts (rank8) for the communication share, and one compiled
# attempt (per-block compile of the tensor-parallel blocks: torchtitan's order) that may fail.
#
# Usage (on the 4-GPU box, from the repo root): bash recipes/benchmarks/tp_study.sh OUTDIR
# RECIPES="mha-1b mla-1b" REGIMES="rank8 global8" LAYOUTS="fsdp-x2 tp2 fsdp-x4 tp4 2x2" PROFILE=1 COMPILED=1 pick
# the parts (defaults: all). A rank8 tp4 run is the global8 tp4 run (8 sequences per group either way): with
# both regimes it runs once, as global8.
# Writes OUTDIR/<recipe>-<regime>-<layout>.json (train results), OUTDIR/profile-<recipe>-<layout>.json,
# OUTDIR/analytic.txt, OUTDIR/table.txt (the comparison), OUTDIR/gpus.csv.
set -u
OUT=${1:?output directory}
mkdir -p "$OUT" /tmp/tp-runs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpus.csv"
STEPS="--set train.steps=14 --set train.measure_warmup_steps=4 --set train.log_every=7 --set train.compile=false"

layout_sets() {  # layout -> "nproc tensor_parallel"
  case $1 in
    fsdp-x2) echo "2 1" ;; tp2) echo "2 2" ;; fsdp-x4) echo "4 1" ;; tp4) echo "4 4" ;; 2x2) echo "4 2" ;;
  esac
}

micro_batch() {  # regime nproc tp -> sequences per micro-batch and data-parallel rank
  case $1 in rank8) echo 8 ;; global8) echo $((8 * $3 / $2)) ;; esac
}

python3 - "$OUT" ${RECIPES:-mha-1b mla-1b} <<'PY' | tee "$OUT/analytic.txt"
import sys
from scaletool import analytic
from scaletool.config import load_recipe
from scaletool.fmt import gib
layouts = {"fsdp-x2": (2, 1), "tp2": (2, 2), "fsdp-x4": (4, 1), "tp4": (4, 4), "2x2": (4, 2)}
for recipe in sys.argv[2:]:
    for regime in ("rank8", "global8"):
        for name, (world, tp) in layouts.items():
            mb = 8 if regime == "rank8" else 8 * tp // world
            r = load_recipe(f"recipes/{recipe}.yaml", ["parallel.engine=fsdp", f"parallel.tensor_parallel={tp}",
                                                        f"train.micro_batch_size={mb}", "train.compile=false"])
            mem = analytic.tensor_parallel_memory(r, world, tp)
            c = analytic.communication(r, world, tp)
            print(f"{recipe:7} {regime:7} {name:7} mb={mb} peak={gib(mem['total_bytes'])} "
                  f"act={gib(mem['activations_bytes'])} wire/GPU/step tp={gib(c['tp_wire_bytes'])} "
                  f"dp={gib(c['dp_wire_bytes'])}")
PY

run() {  # recipe regime layout
  local recipe=$1 regime=$2 layout=$3 n tp mb name
  read -r n tp <<< "$(layout_sets "$layout")"
  mb=$(micro_batch "$regime" "$n" "$tp")
  name=$recipe-$regime-$layout
  echo "== $name (nproc $n, tensor_parallel $tp, micro_batch_size $mb)" >&2
  timeout 400 python3 -m scaletool train "recipes/$recipe.yaml" --out "/tmp/tp-runs/$name" --nproc-per-node "$n" \
    --set parallel.engine=fsdp --set "parallel.tensor_parallel=$tp" --set "train.micro_batch_size=$mb" $STEPS \
    --json > "$OUT/$name.json" 2> "/tmp/tp-runs/$name.log" || { echo "FAILED $name"; tail -15 "/tmp/tp-runs/$name.log"; }
}

for recipe in ${RECIPES:-mha-1b mla-1b}; do
  for regime in ${REGIMES:-rank8 global8}; do
    for layout in ${LAYOUTS:-fsdp-x2 tp2 fsdp-x4 tp4 2x2}; do
      [ "$regime-$layout" = rank8-tp4 ] && [[ " ${REGIMES:-rank8 global8} " == *" global8 "* ]] && continue
      [ -s "$OUT/$recipe-$regime-$layout.json" ] && continue   # done by an earlier call into the same OUT
      run "$recipe" "$regime" "$layout"
    done
  done
done

if [ "${PROFILE:-1}" = 1 ]; then
  for recipe in ${RECIPES:-mha-1b mla-1b}; do
    for layout in fsdp-x4 tp4 2x2; do
      read -r n tp <<< "$(layout_sets "$layout")"
      name=profile-$recipe-$layout
      echo "== $name" >&2
      timeout 400 python3 -m scaletool profile "recipes/$recipe.yaml" --out "/tmp/tp-runs/$name" --nproc-per-node "$n" \
        --set parallel.engine=fsdp --set "parallel.tensor_parallel=$tp" --set train.compile=false \
        --set train.steps=8 --set profile.wait=4 --set profile.warmup=1 --set profile.active=2 --set profile.ranks=[0] \
        --json > "$OUT/$name.json" 2> "/tmp/tp-runs/$name.log" || { echo "FAILED $name"; tail -15 "/tmp/tp-runs/$name.log"; }
    done
  done
fi

if [ "${COMPILED:-1}" = 1 ]; then
  name=mha-1b-rank8-2x2-compiled
  echo "== $name (exploratory: compile of tensor-parallel blocks)" >&2
  timeout 500 python3 -m scaletool train recipes/mha-1b.yaml --out "/tmp/tp-runs/$name" --nproc-per-node 4 \
    --set parallel.engine=fsdp --set parallel.tensor_parallel=2 --set train.steps=14 --set train.measure_warmup_steps=6 \
    --set train.log_every=7 --json > "$OUT/$name.json" 2> "/tmp/tp-runs/$name.log" \
    || { echo "FAILED $name"; tail -15 "/tmp/tp-runs/$name.log"; }
fi

python3 - "$OUT" <<'PY' | tee "$OUT/table.txt"
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])

def load(p):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None

runs = {}
for p in sorted(out.glob("*-rank8-*.json")) + sorted(out.glob("*-global8-*.json")):
    recipe, regime = re.match(r"(.+)-(rank8|global8)-", p.stem).groups()
    runs[p.stem] = (recipe, regime, load(p))
ok = {k: v for k, v in runs.items() if v[2] and v[2].get("status") == "completed"}
per_gpu = {k: d["metrics"]["throughput/tokens_per_s_per_gpu"] for k, (_, _, d) in ok.items()}
base = {(r, g, d["environment"]["world_size"]): per_gpu[k] for k, (r, g, d) in ok.items()
        if d["recipe"]["parallel"]["tensor_parallel"] == 1}
print(f"{'run':34} {'GPUs':>4} {'TP':>3} {'mb':>3} {'tok/s/GPU':>10} {'vs fsdp':>8} {'peak GiB':>9} {'est GiB':>8} {'rel':>7}")
for k, (recipe, regime, d) in runs.items():
    if k not in ok:
        print(f"{k:34} failed or missing")
        continue
    m, world = d["metrics"], d["environment"]["world_size"]
    ref = base.get((recipe, regime, world))
    rel = m["memory/analytic_rel_error"]
    print(f"{k:34} {world:>4} {d['recipe']['parallel']['tensor_parallel']:>3} {d['recipe']['train']['micro_batch_size']:>3} "
          f"{per_gpu[k]:>10.0f} {(per_gpu[k] / ref if ref else float('nan')):>8.2f} "
          f"{(d['peak_memory_bytes'] or 0) / 2**30:>9.2f} {m['memory/analytic_bytes'] / 2**30:>8.2f} "
          f"{(rel if rel is not None else float('nan')):>+7.1%}")
print("\nprofiler, rank 0 (share of the step; exposed = not overlapped by compute)")
for p in sorted(out.glob("profile-*.json")):
    d = load(p)
    if not d or not d.get("step_time_s"):
        print(f"{p.stem}: no breakdown")
        continue
    co, step = d["communication_overlap"], d["step_time_s"]
    print(f"{p.stem:26} step {1e3 * step:7.1f} ms  communication {1e3 * co['communication_s']:6.1f} ms "
          f"({co['communication_s'] / step:.1%}), exposed {co['exposed_s'] / step:.1%}, "
          f"overlap ratio {co['overlap_ratio']}")
PY
