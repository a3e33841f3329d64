#!/usr/bin/env bash
# The distributed tests (DDP, FSDP2, ZeRO-1/2/3, TP, FSDP2 x TP) under the oldest torch pyproject.toml allows,
# in a second virtual environment beside CI's. PyPI's Linux torch of that version is a CUDA build: the venv
# pulls its NVIDIA libraries (about 5 GB; 2.5 min to install here), which the CPU tests load but never use.
#   bash .ci/torch-floor.sh            # venv in .venv-floor (kept; a second run reuses it)
#   FLOOR_VENV=/tmp/v bash .ci/torch-floor.sh
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(python3 -c 'import re,sys; print(re.search(r"\"torch>=([0-9.]+)\"", open("pyproject.toml").read())[1])')
venv=${FLOOR_VENV:-.venv-floor}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/pip" install -q "torch==$floor.*" -e '.[test]'
"$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/train/test_train_distributed.py tests/train/test_tensor_parallel.py
