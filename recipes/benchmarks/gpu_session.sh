#!/bin/bash
# One 4-GPU host, several 10-minute device calls: the scaling study, tensor parallelism, the parallel
# sweep (issue 15), the GPU training-dynamics study and ALiBi's cost (issue 19), the peers and MoE
# dispatch (issue 16). Stages run in the order given while DEADLINE_S (seconds from start) allows;
# a stage that would not fit is deferred and says so. State lives in $ST (sweep results directories,
# run JSONs, logs) and is packed to $OUT/state.tgz.NN (15 MiB parts) at the end of every call; a call on a
# fresh machine unpacks .gpu/state.tgz (the last call's parts joined, copied back and carried) and resumes: sweeps skip what is
# recorded, stages that finished are not rerun.
#
# Usage (repository root of the GPU machine; carry .whl and .gpu/state.tgz):
#   bash recipes/benchmarks/gpu_session.sh DEADLINE_S STAGE...
# Stages: demo dyn s1 s2 s4 tp lanes l8b comp4 prof posbg (see the `case` below for what each runs).
# The estimate and count modes of the sweeps run on a CPU beforehand (same results directories).
# DEADLINE_S must end well inside the call's limit: the state is packed after the last stage, and a call
# killed at its limit brings nothing back. After each call, here:
#   cat /work/.device/N/state.tgz.* > .gpu/state.tgz
# Measured on 4x H100 (2026-11-26): demo 71 s, dyn 820 s (24 points, 105-165 s each, four at once),
# s1 82 s, s2 130 s, s4 367 s; a 4-GPU eager point of mha-1b takes 26-40 s, a compiled one 40 s.
set -u
DEADLINE=${1:?deadline in seconds}; shift
T0=$(date +%s)
ST=${ST:-/tmp/st}
OUT=${OUT:-/tmp/out}
mkdir -p "$ST" "$OUT"
if [ ! -f "$ST/.restored" ] && [ -f .gpu/state.tgz ]; then tar -xzf .gpu/state.tgz -C "$ST"; fi
touch "$ST/.restored"
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
CALL=$(date -u +%H%M)
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > "$ST/gpus-$CALL.csv"
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)" \
  > "$ST/versions-$CALL.txt" 2>&1
LOG="$ST/log-$CALL.txt"
exec > >(tee -a "$LOG") 2>&1

BG=()
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
sw() { timeout --signal=INT $(($(left) - 25)) python3 -m scaletool sweep "$@"; }  # a cut sweep resumes next call

stage() {  # name, seconds it needs, command...
  local name=$1 need=$2 t rc; shift 2
  if [ -f "$ST/done.$name" ]; then echo "== $name: done in an earlier call"; return; fi
  if [ "$(left)" -lt "$need" ]; then echo "== $name: deferred ($(left) s left, needs about $need)"; return; fi
  echo "== $name ($(left) s left) $(date -u +%T)"
  t=$(date +%s)
  "$@"; rc=$?
  echo "== $name: rc $rc after $(($(date +%s) - t)) s"
  [ $rc = 0 ] && touch "$ST/done.$name"
}

demo() {  # four one-GPU points: one at a time on GPU 0, then four at once on GPUs 0-3
  local t
  t=$(date +%s); sw recipes/sweeps/parallel-4gpu.yaml -o "$ST/parallel-4gpu-seq" --gpus 0 || return 1
  echo "sequential_wall_s $(($(date +%s) - t))" > "$ST/parallel-4gpu-walls.txt"
  t=$(date +%s); sw recipes/sweeps/parallel-4gpu.yaml -o "$ST/parallel-4gpu-par" --parallel 4 --gpus 0,1,2,3 || return 1
  echo "parallel4_wall_s $(($(date +%s) - t))" >> "$ST/parallel-4gpu-walls.txt"
}
dyn() { sw training-dynamics-gpu -o "$ST/training-dynamics-gpu" --parallel 4 --gpus 0,1,2,3; }
s1() { sw recipes/sweeps/scaling-1gpu.yaml -o "$ST/scaling-1gpu" --parallel 4 --gpus 0,1,2,3; }
s2() { sw recipes/sweeps/scaling-2gpu.yaml -o "$ST/scaling-2gpu" --parallel 2 --gpus 0,1,2,3; }
s4() { sw recipes/sweeps/scaling-4gpu.yaml -o "$ST/scaling-4gpu"; }
comp4() { sw recipes/sweeps/mla-compression-4gpu.yaml -o "$ST/mla-compression-4gpu"; }
tp() {
  RECIPES="mha-1b mla-1b" REGIMES=global8 LAYOUTS="fsdp-x4 tp4 2x2" PROFILE=0 COMPILED=0 \
    timeout $(($(left) - 20)) bash recipes/benchmarks/tp_study.sh "$ST/tp"
  RECIPES=mha-1b REGIMES=rank8 LAYOUTS="fsdp-x4 2x2" PROFILE=0 COMPILED=0 \
    timeout $(($(left) - 20)) bash recipes/benchmarks/tp_study.sh "$ST/tp"
  [ "$(ls "$ST"/tp/*-*-*.json 2>/dev/null | wc -l)" -ge 8 ]
}
l8b() {  # Llama-3-8B under FSDP2 on 4 GPUs, full activation checkpointing, 8192-token sequences
  timeout $(($(left) - 15)) python3 -m scaletool train recipes/llama3-8b.yaml --nproc-per-node 4 --out /tmp/l8b \
    --set train.steps=12 --set train.measure_warmup_steps=4 --set train.log_every=4 --json \
    > "$ST/llama3-8b-fsdp-x4.json" 2> "$ST/llama3-8b-fsdp-x4.log"
}
lanes() {  # four one-GPU benchmarks, one per GPU, at once: each compares within its own process or sweep
  mkdir -p "$ST/peers" "$ST/moe"
  local lim=$(($(left) - 20)) pids=()
  CUDA_VISIBLE_DEVICES=0 timeout $lim python3 recipes/benchmarks/peers/torchtitan_train.py recipes/mha-1b.yaml \
    --torch-compat --out "$ST/peers/torchtitan-mha-1b.json" > "$ST/peers/torchtitan-mha-1b.log" 2>&1 & pids+=($!)
  CUDA_VISIBLE_DEVICES=1 timeout $lim python3 recipes/benchmarks/peers/torchtitan_train.py recipes/mla-1b.yaml \
    --torch-compat --out "$ST/peers/torchtitan-mla-1b.json" > "$ST/peers/torchtitan-mla-1b.log" 2>&1 & pids+=($!)
  CUDA_VISIBLE_DEVICES=2 timeout $lim python3 recipes/benchmarks/moe_dispatch.py "$ST/moe" > "$ST/moe/log.txt" 2>&1 &
  pids+=($!)
  (CUDA_VISIBLE_DEVICES=3 timeout $lim python3 recipes/benchmarks/position_encodings.py recipes/mha-1b.yaml \
     --out "$ST/positions-mha-1b.json" > "$ST/positions.log" 2>&1
   CUDA_VISIBLE_DEVICES=3 sw recipes/sweeps/mla-rope.yaml -o "$ST/mla-rope" --mode train --mode decode) & pids+=($!)
  wait "${pids[@]}"  # these four only: a bare wait would also wait for the log's tee (see the end)
  ls -la "$ST/peers" "$ST/moe"
}
prof() {  # the profiler's communication and overlap share per engine, mha-1b on 4 GPUs, eager
  local name sets
  for name in fsdp zero3 ddp; do
    case $name in
      fsdp) sets="--set parallel.engine=fsdp" ;;
      zero3) sets="--set parallel.engine=deepspeed --set parallel.zero_stage=3" ;;
      ddp) sets="--set parallel.engine=ddp" ;;
    esac
    timeout $(($(left) - 15)) python3 -m scaletool profile recipes/mha-1b.yaml --nproc-per-node 4 --out "/tmp/prof-$name" \
      $sets --set train.compile=false --set train.steps=8 --set profile.wait=4 --set profile.warmup=1 \
      --set profile.active=2 --set "profile.ranks=[0]" --json > "$ST/profile-x4-$name.json" 2> "$ST/profile-x4-$name.log"
  done
}

for s in "$@"; do
  case $s in
    demo) stage demo 90 demo ;;
    dyn) stage dyn 250 dyn ;;   # resumes: a cut sweep keeps its finished points
    s1) stage s1 130 s1 ;;
    s2) stage s2 90 s2 ;;
    s4) stage s4 120 s4 ;;      # resumes too
    tp) stage tp 200 tp ;;
    lanes) stage lanes 300 lanes ;;
    l8b) stage l8b 120 l8b ;;
    comp4) stage comp4 150 comp4 ;;
    prof) stage prof 120 prof ;;
    posbg)  # ALiBi's cost on GPU 3 in the background (the stages after it must leave GPU 3 free at first)
      if [ ! -f "$ST/positions-mha-1b.json" ]; then
        CUDA_VISIBLE_DEVICES=3 timeout 200 python3 recipes/benchmarks/position_encodings.py recipes/mha-1b.yaml \
          --out "$ST/positions-mha-1b.json" > "$ST/positions.log" 2>&1 &
        BG+=($!)
      fi ;;
    *) echo "unknown stage $s" ;;
  esac
done
# the background stages only: a bare `wait` also waits for the tee behind `exec > >(tee ...)`, which never
# ends while this shell's stdout is open (the 2026-11-26 session lost a call's state to exactly that)
[ ${#BG[@]} -gt 0 ] && wait "${BG[@]}"
echo "== end ($(left) s left)"
# at most 16 MiB a file comes back: the state in 15 MiB parts (cat state.tgz.* > state.tgz)
tar -czf - -C "$ST" --exclude='*trace*' --exclude='checkpoints' --exclude='*.pt' --exclude='.restored' . \
  | split -b 15M -d - "$OUT/state.tgz."
cp "$LOG" "$OUT/"
ls -la "$OUT"
