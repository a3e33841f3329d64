#!/bin/bash
# Two-GPU scaling of mha-1b and mla-1b: per-GPU tokens/s of FSDP2 and ZeRO-3 on 2 GPUs against
# `single` and against the same engine on 1 GPU of the same host, eager; single vs FSDP2 compiled
# (per-block compile there) for mha-1b. Prints peak and resident memory against the estimate.
# Usage (on a 2-GPU box, from the repo root): bash recipes/benchmarks/run_two_gpu.sh OUTDIR
set -u
OUT=${1:?output directory}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu2.csv"
S="--set train.log_every=10 --set train.steps=14 --set train.measure_warmup_steps=4"
t() {  # name, recipe, nproc, extra args...
  local name=$1 recipe=$2 n=$3; shift 3
  echo "== $name" >&2
  timeout 170 python3 -m scaletool train "recipes/$recipe.yaml" --out "/tmp/runs/$name" --nproc-per-node "$n" $S "$@" \
    --json > "$OUT/$name.json" 2> "/tmp/runs-$name.log" || { echo "FAILED $name"; tail -15 "/tmp/runs-$name.log"; }
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no json", e); sys.exit()
m = d["metrics"]
print(f"{sys.argv[1]}: world={d['environment']['world_size']} tok/s={d['tokens_per_s']:.0f} "
      f"per_gpu={m['throughput/tokens_per_s_per_gpu']:.0f} mfu={d['mfu']} peak={d['peak_memory_bytes']} "
      f"resident={m['memory/resident_bytes']} analytic={m['memory/analytic_bytes']} rel={m['memory/analytic_rel_error']}")
PY
}
E="--set train.compile=false"
Z="--set parallel.engine=deepspeed --set parallel.zero_stage=3"
for r in mha-1b mla-1b; do
  t "x2-$r-single-eager" $r 1 $E
  t "x2-$r-fsdp-eager-1" $r 1 $E --set parallel.engine=fsdp
  t "x2-$r-fsdp-eager" $r 2 $E --set parallel.engine=fsdp
  t "x2-$r-zero3-eager-1" $r 1 $E $Z
  t "x2-$r-zero3-eager" $r 2 $E $Z
done
t x2-mha-1b-single-compiled mha-1b 1
t x2-mha-1b-fsdp-compiled mha-1b 2 --set parallel.engine=fsdp
