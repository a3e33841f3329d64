#!/usr/bin/env bash
# The `scaletool decode` benchmark behind recipes/benchmarks/decode.md: the fused Triton MLA kernel
# checked against the torch reference, then the 1B MHA and MLA recipes (and MLA's torch-reference
# kernel and naive cache) at the largest batch fitting the GPU, bf16, 4K and 32K context.
# Usage (GPU machine, repo root):  bash recipes/benchmarks/decode.sh OUT_DIR
set -u
out=${1:?usage: decode.sh OUT_DIR}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'PY' || exit 1
import torch
from scaletool.decode import kernels
assert kernels.triton_available(), "Triton/CUDA missing"
for B, H, S in [(3, 16, 1000), (1, 16, 5), (130, 16, 4096), (2, 20, 333), (4, 4, 64)]:
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda").bfloat16()
    q, qp, c, k = mk(B, H, 512), mk(B, H, 64), mk(B, S + 7, 512)[:, :S], mk(B, S + 7, 64)[:, :S]
    got = kernels.latent_attention(q, qp, c, k, 192 ** -0.5, kernel="triton").float()
    want = kernels.latent_attention_reference(q.float(), qp.float(), c.float(), k.float(), 192 ** -0.5)
    err = (got - want).abs().max().item()
    print(f"triton vs reference B={B} H={H} S={S}: max |diff| {err:.2e}")
    assert err < 2e-2
PY
run() {  # name, recipe, extra args...
    local name=$1 recipe=$2; shift 2
    python3 -m scaletool decode "recipes/$recipe.yaml" --batch max --context 4096,32768 --new-tokens 32 \
        --dtype bf16 "$@" --json > "$out/decode-$name.json" 2> "$out/decode-$name.err"
    echo "== $name rc=$?"; tail -n 3 "$out/decode-$name.err"
    python3 - "$out/decode-$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for p in d["points"]:
    if "error" in p:
        print(p["context"], p["batch"], p["error"]); continue
    print(f"ctx {p['context']} batch {p['batch']}: decode {p['decode_tokens_per_s']:.0f} tok/s "
          f"{p['decode_ms_per_token']:.2f} ms/step, bw {p['decode_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s "
          f"({p['decode_bandwidth_fraction_of_peak']}), prefill {p['prefill_tokens_per_s']:.0f} tok/s, "
          f"cache {p['kv_cache_bytes_measured']} meas / {p['kv_cache_bytes_allocator']} alloc / "
          f"{p['kv_cache_bytes_analytic']} analytic; {p['attention_kernel']}")
PY
}
run mha-1b mha-1b
run mla-1b mla-1b
run mla-1b-torch mla-1b --mla-kernel torch
run mla-1b-naive mla-1b --mla-mode naive
