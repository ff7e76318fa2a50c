#!/usr/bin/env bash
# The GPU checks of mita_seg in one prepared run (under 8 minutes on one H100/H200).
#
#   scripts/gpu_check.sh LOG_DIR
#
# Needs a CUDA machine with torch (and pytest) installed; no mmcv/mmseg: the operator package
# imports without them. Writes LOG_DIR/env.txt (GPU, driver, torch), LOG_DIR/tests.txt (the
# operator tests that need CUDA: the varlen backend's kernels, low precision on CUDA, every
# backend against the dense reference) and LOG_DIR/benchmark.txt (tools/benchmark.py
# --level op --device cuda: MiTA varlen vs SDPA vs the blocked backend, fwd and fwd+bwd,
# fp16/bf16/fp32, N = 1025 / 4097 / 16385 / 65537, peak CUDA memory).
# Exit status: non-zero if the tests fail (the benchmark still runs).
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh LOG_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(), torch.cuda.get_device_capability())"; } 2>&1 | tee "$out/env.txt"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" \
    || exit 1

echo "== tests ($(date +%T))"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -o addopts='--import-mode=importlib -ra' \
    tests/test_varlen.py "tests/test_precision.py::test_low_precision_within_flash_tolerance" \
    2>&1 | tee "$out/tests.txt"
status=${PIPESTATUS[0]}

echo "== benchmark ($(date +%T))"
timeout 240 "$PY" tools/benchmark.py --level op --device cuda --min-run-time 0.1 \
    2>&1 | tee "$out/benchmark.txt"
echo "== done ($(date +%T)); tests exit status $status"
exit "$status"
