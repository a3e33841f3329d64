#!/bin/bash
# One-GPU benchmark: MFU of mha-1b and mla-1b (bf16, torch.compile), the SDPA kernels MLA dispatches
# to, measurement on/off, compile scope, peak memory per engine against the analytic estimate, and
# where the step's time goes (GEMM and attention rates at the recipe's shapes, kernel categories).
# Usage (on the GPU box, from the repo root): bash recipes/benchmarks/run_single_gpu.sh OUTDIR PART...
# with PART one or more of perf, accum, mem, gemm.
set -u
OUT=${1:?output directory}
shift
[ $# -gt 0 ] || { echo "name one or more parts: perf accum mem gemm"; exit 2; }
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.csv"
t() {  # name, recipe, overrides...
  local name=$1 recipe=$2; shift 2
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  echo "== $name" >&2
  timeout 300 python3 -m scaletool train "$recipe" --out "/tmp/runs/$name" "${sets[@]}" --json \
    > "$OUT/$name.json" 2> "/tmp/runs-$name.log" || { echo "FAILED $name"; tail -20 "/tmp/runs-$name.log"; }
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no json", e); sys.exit()
m = d["metrics"]
print(f"{sys.argv[1]}: tok/s={d['tokens_per_s']} mfu={d['mfu']} mfu_full={m['flops/mfu_full_attention']} "
      f"tflops={m['flops/achieved_tflops_per_gpu']} peak={d['peak_memory_bytes']} analytic={m['memory/analytic_bytes']} "
      f"rel={m['memory/analytic_rel_error']} resident={m['memory/resident_bytes']} loss {d['loss_first']}->{d['loss_last']}")
PY
}
L="train.log_every=10"
for PART in "$@"; do
if [ "$PART" = perf ]; then
python3 recipes/benchmarks/sdpa_dispatch.py recipes/mla-1b.yaml > "$OUT/sdpa_mla_compiled.json" 2>/tmp/sdpa.log || tail -5 /tmp/sdpa.log
python3 -c "import json;d=json.load(open('$OUT/sdpa_mla_compiled.json'));print(json.dumps(d['kernels'],indent=1))"
t mha-1b-single recipes/mha-1b.yaml $L
t mla-1b-single recipes/mla-1b.yaml $L
python3 -m scaletool train recipes/mha-1b.yaml --out /tmp/runs/nomeasure --set $L --no-measure --json > "$OUT/mha-1b-single-nomeasure.json" 2>/dev/null
python3 -c "import json;d=json.load(open('$OUT/mha-1b-single-nomeasure.json'));print('no-measure tok/s', d['tokens_per_s'], d['mfu'])"
t mha-1b-single-blockcompile recipes/mha-1b.yaml $L train.compile_scope=block
fi
if [ "$PART" = accum ]; then  # the optimizer step amortised over 4 micro-batches
t mha-1b-single-accum4 recipes/mha-1b.yaml $L train.grad_accum_steps=4 train.steps=20
t mla-1b-single-accum4 recipes/mla-1b.yaml $L train.grad_accum_steps=4 train.steps=20
fi
if [ "$PART" = mem ]; then
for e in ${ENGINES:-"single" "fsdp"} "deepspeed parallel.zero_stage=1" "deepspeed parallel.zero_stage=2" "deepspeed parallel.zero_stage=3"; do
  set -- $e
  name="mem-mha-1b-$1${2:+-z${2##*=}}"
  t "$name" recipes/mha-1b.yaml train.compile=false train.steps=8 train.measure_warmup_steps=3 parallel.engine=$1 ${2:-}
done
fi
if [ "$PART" = gemm ]; then  # the ceiling: GEMM and attention rates at the recipes' shapes; the step by kernel category
for r in mha-1b mla-1b; do
  python3 recipes/benchmarks/gemm_shapes.py recipes/$r.yaml > "$OUT/gemm-$r.json" 2>/tmp/gemm.log || tail -5 /tmp/gemm.log
  python3 recipes/benchmarks/profile_step.py recipes/$r.yaml > "$OUT/profile_$r.json" 2>/tmp/prof.log || tail -5 /tmp/prof.log
  python3 - "$OUT/gemm-$r.json" "$OUT/profile_$r.json" <<'PY'
import json, sys
g, p = (json.load(open(f)) for f in sys.argv[1:])
print(sys.argv[1], "square", g["square_8192_tflops"], "block", g["block_separate"]["tflops"], "attention",
      g["attention_fwd_bwd"], "floor ms", g["step_floor_ms"], "ceiling", g["mfu_ceiling"])
print(sys.argv[2], {k: round(v, 1) for k, v in p["ms_per_step_by_category"].items()}, round(p["ms_per_step_total"], 1))
PY
done
fi
done
