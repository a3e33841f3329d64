#!/bin/bash
# Tensor parallelism on one 2-GPU host: TP=2 against FSDP2 x2 per GPU, for mha-1b and mla-1b at 8 sequences
# per data-parallel rank (a TP=2 group reads 8, each FSDP2 rank reads 8), then where TP wins, then the
# engines' GPU tests under this machine's torch. Conventions of tp_study.sh: one `scaletool train --json`
# per run into OUTDIR/<name>.json (the run's environment: card, torch, CUDA), with a "study" key added
# (command, date, script); a run whose JSON already says completed is not run again.
#
# Parts (PARTS, default all, in this order):
#   eager     fsdp-x2 and tp2, eager                                   (4 runs)
#   compiled  the same with train.compile (per-block compile after the split: torchtitan's order)  (4)
#   async     tp2 compiled with parallel.async_tp (fused all-gather-matmul / matmul-reduce-scatter)  (2)
#   win       llama3-8b with L layers at T=8192: L and the micro-batch (sequences per rank) chosen from the
#             analytic estimate so FSDP2 without checkpointing exceeds this card's memory and TP=2 without it
#             fits; FSDP2 with full checkpointing, TP=2 without, and FSDP2 without (expected OOM)  (3)
#   profile   `scaletool profile` of mha-1b and mla-1b at TP=2 eager, rank 0: where the step's time goes
#   tests     python -m pytest tests/gpu (every engine and TP, eager/compiled/async, against one GPU)
# No run starts after DEADLINE_S (default 330 s) and each has a timeout (RUN_TIMEOUT_S, default 150 s), so one
# call ends within about 8 minutes; what was skipped is listed, and another call into the same OUTDIR
# (e.g. PARTS="async win") does the rest: eager + compiled, async + win, profile + tests fit about one call each.
#
# Usage (repo root, 2 GPUs): bash recipes/benchmarks/tp_gpu.sh OUTDIR
# Logic check on CPU (tiny recipe, gloo, torch.compile disabled, async TP fails as it must off CUDA):
#   TP_GPU_CPU=1 bash recipes/benchmarks/tp_gpu.sh /tmp/tp-gpu-check
# Writes OUTDIR/<name>.json, OUTDIR/<name>.log (failed runs), OUTDIR/profile-*.json, OUTDIR/gpu-tests.txt,
# OUTDIR/table.txt.
set -u
OUT=${1:?output directory}
mkdir -p "$OUT"
RUNS=${RUNS_DIR:-/tmp/tp-gpu-runs}
mkdir -p "$RUNS"
PY=${PYTHON:-python3}
PARTS=" ${PARTS:-eager compiled async win profile tests} "
DEADLINE_S=${DEADLINE_S:-330}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-150}
CPU=${TP_GPU_CPU:-0}
T0=$SECONDS
: > "$OUT/skipped.txt"
STEPS=(--set train.steps=14 --set train.measure_warmup_steps=4 --set train.log_every=7)

if [ "$CPU" = 1 ]; then
  export TORCH_COMPILE_DISABLE=1 OMP_NUM_THREADS=1   # compile=true runs eager: this checks the script, not speed
  declare -A RECIPE=([mha]="recipes/tiny.yaml --set model.attention=mha" [mla]="recipes/tiny.yaml")
  STEPS=(--set train.steps=4 --set train.measure_warmup_steps=1 --set train.log_every=2)
else
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpus.csv"
  declare -A RECIPE=([mha]="recipes/mha-1b.yaml" [mla]="recipes/mla-1b.yaml")
fi

done_ok() {  # name -> 0 when OUTDIR/<name>.json is a completed run
  "$PY" -c 'import json,sys; sys.exit(json.load(open(sys.argv[1])).get("status") != "completed")' "$OUT/$1.json" 2>/dev/null
}

run() {  # name nproc recipe-and-sets...
  local name=$1 n=$2
  shift 2
  if done_ok "$name"; then echo "== $name: done earlier"; return; fi
  if (( SECONDS - T0 > DEADLINE_S )); then echo "$name" >> "$OUT/skipped.txt"; echo "== $name: skipped (deadline)"; return; fi
  echo "== $name (nproc $n) at $((SECONDS - T0)) s"
  # the recipe, then the part's steps, then the run's own sets (a later --set wins)
  local cmd=("$PY" -m scaletool train "$1" "${STEPS[@]}" "${@:2}" --out "$RUNS/$name" --nproc-per-node "$n" --json)
  rm -rf "${RUNS:?}/$name" "$OUT/$name.log"
  if ! timeout "$RUN_TIMEOUT_S" "${cmd[@]}" > "$OUT/$name.json" 2> "$RUNS/$name.log"; then
    echo "FAILED $name (log: $OUT/$name.log)"
    cp "$RUNS/$name.log" "$OUT/$name.log"
    tail -5 "$RUNS/$name.log"
  fi
  "$PY" - "$OUT/$name.json" "$(date -u +%FT%TZ)" "${cmd[@]}" <<'PY'
import json, sys
path, date, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    d = json.load(open(path))
except (OSError, ValueError):
    d = {"status": "failed", "message": "no JSON result (see the .log)"}
d["study"] = {"script": "recipes/benchmarks/tp_gpu.sh", "date": date, "command": cmd}
json.dump(d, open(path, "w"), indent=1)
PY
}

one_b() {  # mode (eager|compiled|async) -> the four or two runs of that part
  local mode=$1 r c
  for r in mha mla; do
    # shellcheck disable=SC2086
    set -- ${RECIPE[$r]} --set parallel.engine=fsdp --set train.micro_batch_size=8
    case $mode in
      eager) c=(--set train.compile=false) ;;
      compiled) c=(--set train.compile=true) ;;
      async) run "$r-tp2-compiled-async" 2 "$@" --set parallel.tensor_parallel=2 --set train.compile=true \
               --set parallel.async_tp=true; continue ;;
    esac
    run "$r-fsdp-x2-$mode" 2 "$@" --set parallel.tensor_parallel=1 "${c[@]}"
    run "$r-tp2-$mode" 2 "$@" --set parallel.tensor_parallel=2 "${c[@]}"
  done
}

[[ $PARTS == *" eager "* ]] && one_b eager
[[ $PARTS == *" compiled "* ]] && one_b compiled
[[ $PARTS == *" async "* ]] && one_b async

if [[ $PARTS == *" win "* ]]; then
  if [ "$CPU" = 1 ]; then
    win=(recipes/tiny.yaml --set model.n_layers=2 --set train.micro_batch_size=2)
  else  # the smallest L (then micro-batch) where FSDP2 needs checkpointing on this card and TP=2 does not
    read -r L MB <<< "$("$PY" - <<'PY'
import torch
from scaletool import analytic
from scaletool.config import load_recipe
cap = torch.cuda.get_device_properties(0).total_memory
def est(L, mb, tp, ac):
    r = load_recipe("recipes/llama3-8b.yaml", ["parallel.engine=fsdp", f"parallel.tensor_parallel={tp}", "parallel.world_size=2",
                    f"model.n_layers={L}", f"train.micro_batch_size={mb}", f"train.activation_checkpointing={ac}"])
    return analytic.tensor_parallel_memory(r, 2, tp)["total_bytes"]
pick = next(((L, mb) for mb in (1, 2, 4) for L in range(8, 33, 2)
             if est(L, mb, 1, "none") > 1.02 * cap and est(L, mb, 2, "none") < 0.85 * cap), (24, 1))
print(*pick)
PY
)"
    echo "== win case: llama3-8b, $L layers, micro-batch $MB, T=8192"
    win=(recipes/llama3-8b.yaml --set "model.n_layers=$L" --set "train.micro_batch_size=$MB" --set train.compile=false)
  fi
  STEPS_SAVED=("${STEPS[@]}")
  [ "$CPU" = 1 ] || STEPS=(--set train.steps=10 --set train.measure_warmup_steps=3 --set train.log_every=5)
  run win-fsdp-x2-fullac 2 "${win[@]}" --set parallel.engine=fsdp --set parallel.tensor_parallel=1 \
    --set train.activation_checkpointing=full
  run win-tp2-noac 2 "${win[@]}" --set parallel.engine=fsdp --set parallel.tensor_parallel=2 \
    --set train.activation_checkpointing=none
  run win-fsdp-x2-noac 2 "${win[@]}" --set parallel.engine=fsdp --set parallel.tensor_parallel=1 \
    --set train.activation_checkpointing=none --set train.steps=3 --set train.measure_warmup_steps=1
  STEPS=("${STEPS_SAVED[@]}")
fi

if [[ $PARTS == *" profile "* ]]; then  # where TP's eager step goes: rank 0's breakdown, 2 active steps
  for r in mha mla; do
    name=profile-$r-tp2-eager
    if done_ok "$name" || [ -s "$OUT/$name.json" ]; then continue; fi
    if (( SECONDS - T0 > DEADLINE_S )); then echo "$name" >> "$OUT/skipped.txt"; echo "== $name: skipped (deadline)"; continue; fi
    echo "== $name at $((SECONDS - T0)) s"
    # shellcheck disable=SC2086
    timeout "$RUN_TIMEOUT_S" "$PY" -m scaletool profile ${RECIPE[$r]} --out "$RUNS/$name" --nproc-per-node 2 \
      --set parallel.engine=fsdp --set parallel.tensor_parallel=2 --set train.micro_batch_size=8 \
      --set train.compile=false --set train.steps=8 --set profile.wait=4 --set profile.warmup=1 \
      --set profile.active=2 --set "profile.ranks=[0]" --json > "$OUT/$name.json" 2> "$RUNS/$name.log" \
      || { echo "FAILED $name"; cp "$RUNS/$name.log" "$OUT/$name.log"; tail -5 "$RUNS/$name.log"; }
  done
fi

if [[ $PARTS == *" tests "* ]]; then
  if (( SECONDS - T0 > DEADLINE_S )); then echo "gpu-tests" >> "$OUT/skipped.txt"; echo "== tests/gpu: skipped (deadline)"
  else
    echo "== tests/gpu at $((SECONDS - T0)) s"
    "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' > "$OUT/gpu-tests.txt"
    timeout 420 "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider --basetemp "$RUNS/gpu-tests" >> "$OUT/gpu-tests.txt" 2>&1
    tail -3 "$OUT/gpu-tests.txt"
  fi
fi

"$PY" - "$OUT" <<'PY' | tee "$OUT/table.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for p in sorted(out.glob("*.json")):
    try:
        d = json.loads(p.read_text())
    except ValueError:
        continue
    if "study" in d:
        rows[p.stem] = d

def per_gpu(d):
    t, w = d["timing"]["tokens_per_s"], d["environment"]["world_size"]
    return t["median"] / w, t["p10"] / w, t["p90"] / w, t["n"]

def base_of(name):
    r, rest = name.split("-", 1)
    mode = "eager" if rest.endswith("eager") else "compiled"
    return "win-fsdp-x2-fullac" if r == "win" else f"{r}-fsdp-x2-{mode}"

ok = {k: d for k, d in rows.items() if d.get("status") == "completed"}
any_env = next(iter(ok.values()), {}).get("environment", {})
print(f"card {(any_env.get('gpu_names') or ['cpu'])[0]}, torch {any_env.get('torch')}, CUDA {any_env.get('cuda')}")
print(f"{'run':28} {'TP':>2} {'mb':>3} {'tok/s/GPU median [p10-p90] n':>32} {'vs FSDP2':>8} {'peak GiB':>8} {'est GiB':>7} {'rel':>7}")
for k, d in rows.items():
    if k not in ok:  # the first error line that is not a rank's exit notice
        log = out / f"{k}.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        why = next((x for x in lines if x.startswith("error: ") and not x.startswith("error: rank")),
                   next((x for x in reversed(lines) if "Error" in x), str(d.get("message", ""))))
        print(f"{k:28} {d.get('status', 'failed')}: {why[:100]}")
        continue
    med, p10, p90, n = per_gpu(d)
    b = ok.get(base_of(k))
    ratio = f"{med / per_gpu(b)[0]:.2f}" if b else "-"
    m, peak = d["metrics"], d.get("peak_memory_bytes")
    rel = m.get("memory/analytic_rel_error")
    print(f"{k:28} {d['recipe']['parallel']['tensor_parallel']:>2} {d['recipe']['train']['micro_batch_size']:>3} "
          f"{f'{med:,.0f} [{p10:,.0f}-{p90:,.0f}] {n}':>32} {ratio:>8} "
          f"{(f'{peak / 2**30:.2f}' if peak else '-'):>8} {m['memory/analytic_bytes'] / 2**30:>7.2f} "
          f"{(f'{rel:+.1%}' if rel is not None else '-'):>7}")
for r in ("mha", "mla"):  # the target: best TP over best FSDP2, per GPU
    tp = {k: per_gpu(d)[0] for k, d in ok.items() if k.startswith(f"{r}-tp2")}
    fs = {k: per_gpu(d)[0] for k, d in ok.items() if k.startswith(f"{r}-fsdp")}
    if tp and fs:
        bt, bf = max(tp, key=tp.get), max(fs, key=fs.get)
        print(f"{r}: best TP {bt} / best FSDP2 {bf} = {tp[bt] / fs[bf]:.2f}")
print("\nprofiler, rank 0, TP=2 eager (share of the step; exposed = not overlapped by compute)")
for p in sorted(out.glob("profile-*.json")):
    try:
        d = json.loads(p.read_text())
    except ValueError:
        d = None
    if not d or not d.get("step_time_s"):
        print(f"{p.stem}: no breakdown")
        continue
    co, step = d["communication_overlap"], d["step_time_s"]
    print(f"{p.stem:24} step {1e3 * step:7.1f} ms  communication {1e3 * co['communication_s']:6.1f} ms "
          f"({co['communication_s'] / step:.1%}), exposed {co['exposed_s'] / step:.1%}")
skipped = (out / "skipped.txt").read_text().split()
if skipped:
    print("skipped (deadline), run again into the same directory:", " ".join(skipped))
PY
echo "total $((SECONDS - T0)) s"
