#!/bin/bash
# Two-GPU scaling: per-GPU tokens/s of FSDP2 and ZeRO-3 on 2 GPUs against `single` on 1 GPU of the
# same host, eager (all three engines) and compiled (single vs FSDP2; per-block compile there).
# Usage (on a 2-GPU box, from the repo root): bash recipes/benchmarks/run_two_gpu.sh OUTDIR
set -u
OUT=${1:?output directory}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu2.csv"
S="--set train.log_every=10 --set train.steps=14 --set train.measure_warmup_steps=4"
t() {  # name, nproc, extra args...
  local name=$1 n=$2; shift 2
  echo "== $name" >&2
  timeout 170 python3 -m scaletool train recipes/mha-1b.yaml --out "/tmp/runs/$name" --nproc-per-node "$n" $S "$@" \
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
      f"analytic={m['memory/analytic_bytes']} rel={m['memory/analytic_rel_error']}")
PY
}
t x2-single-eager 1 --set train.compile=false
t x2-fsdp-eager 2 --set train.compile=false --set parallel.engine=fsdp
t x2-zero3-eager 2 --set train.compile=false --set parallel.engine=deepspeed --set parallel.zero_stage=3
t x2-fsdp-compiled 2 --set parallel.engine=fsdp
t x2-single-compiled 1
