#!/usr/bin/env bash
# The decode benchmark behind recipes/benchmarks/decode.md, on one GPU (about 6 minutes on an H100):
#   1. the CUDA tests of the decode kernels and of CUDA-graph decoding against eager decoding;
#   2. decode_bandwidth.py: the MLA latent kernel's launch shapes and MHA's SDPA step, one layer;
#   3. `scaletool decode` of mha-1b and mla-1b at batch 1 and the largest batch that fits, 4K and 32K,
#      with CUDA graphs and eagerly, plus MLA's torch-reference kernel and naive cache;
#   4. the FlashInfer peer (its rows say why if flashinfer is not installed).
# Usage (GPU machine, repo root):  bash recipes/benchmarks/decode.sh OUT_DIR
set -u
out=${1:?usage: decode.sh OUT_DIR}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider tests/kernels tests/decode/test_steps.py tests/measure/test_timing.py \
    2>&1 | tail -n 3 || exit 1
python3 recipes/benchmarks/decode_bandwidth.py --out "$out/decode-bandwidth.json" 2> "$out/decode-bandwidth.err"
run() {  # name, recipe, extra args...
    local name=$1 recipe=$2; shift 2
    python3 -m scaletool decode "recipes/$recipe.yaml" --batch 1,max --context 4096,32768 --new-tokens 32 \
        --dtype bf16 "$@" --json > "$out/decode-$name.json" 2> "$out/decode-$name.err"
    echo "== $name rc=$?"
    python3 - "$out/decode-$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for p in d["points"]:
    if p.get("error"):
        print(p["context"], p["batch"], p["error"]); continue
    s = p["decode_step_s"]
    print(f"ctx {p['context']} batch {p['batch']}: decode {p['decode_tokens_per_s']:.0f} tok/s, "
          f"{1e3 * s['median']:.2f} ms/step (p10 {1e3 * s['p10']:.2f}, p90 {1e3 * s['p90']:.2f}, n {s['n']}), "
          f"{p['decode_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s ({p['decode_bandwidth_fraction_of_peak']}), "
          f"prefill {p['prefill_tokens_per_s']:.0f} tok/s; graph {p['cuda_graph']}; {p['attention_kernel']}")
PY
}
run mha-1b-graph mha-1b
run mha-1b-eager mha-1b --no-cuda-graph
run mla-1b-graph mla-1b
run mla-1b-eager mla-1b --no-cuda-graph
run mla-1b-torch mla-1b --mla-kernel torch
run mla-1b-naive mla-1b --mla-mode naive
python3 recipes/benchmarks/peers/flashinfer_mla_decode.py --out "$out/flashinfer-mla-decode.json" \
    2> "$out/flashinfer-mla-decode.err"
