#!/usr/bin/env bash
# Two nodes, 8 GPUs each: torchrun with a c10d rendezvous on the first node, FSDP2, a checkpoint
# every 100 steps and up to 2 restarts of the worker group (each resumes from the newest checkpoint).
# Run it on both nodes, with the same HEAD and OUT (a shared filesystem):
#   HEAD=node001 NODE_RANK=0 launch/torchrun-two-node.sh     # on node001
#   HEAD=node001 NODE_RANK=1 launch/torchrun-two-node.sh     # on node002
# Extra arguments go to `scaletool launch torchrun` (--dry-run prints the torchrun command instead of running it).
set -euo pipefail
: "${HEAD:?set HEAD to the hostname or address of the first node}"
: "${NODE_RANK:?set NODE_RANK to 0 on the first node and 1 on the second}"
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m scaletool launch torchrun "${RECIPE:-recipes/mla-1b.yaml}" \
    --nnodes 2 --nproc-per-node "${NPROC_PER_NODE:-8}" --node-rank "$NODE_RANK" \
    --rdzv-endpoint "$HEAD:${PORT:-29500}" --max-restarts 2 \
    --out "${OUT:-runs/mla-1b-2x8}" \
    --set parallel.engine=fsdp --set train.checkpoint_every=100 \
    "$@"
