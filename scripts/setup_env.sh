#!/usr/bin/env bash
# Create (or bring up to date) the project's environment in .venv/ at the repository root.
#
# Idempotent: a stamp file records what was installed; a second run with the same inputs
# returns at once. mmcv 2.1.0 has no wheel for torch 2.13, so it is compiled from the sdist
# with its ops (about 15 min on 2 cores the first time); pip caches the built wheel, so later
# runs on the same machine, fresh clones included, take seconds.
#
# Environment variables:
#   PYTHON        interpreter used to create the venv (default: python3)
#   TORCH_SPEC    torch requirement (default: torch==2.13.0, the CPU build on this machine's
#                 disk). On a CUDA machine pick the build you need, e.g.
#                 TORCH_SPEC="torch==2.5.1" PIP_INDEX_URL=https://download.pytorch.org/whl/cu124
#                 mmcv is then compiled with its CUDA ops (nvcc must be on PATH).
#   MAX_JOBS      parallel compile jobs for mmcv (default: number of cores)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=.venv
STAMP=$VENV/.setup-stamp

# Everything that decides the environment's contents goes into the stamp (the kernel's
# source too: the editable install builds mita_seg._C once, so a changed kernel rebuilds).
want=$( { echo "$TORCH_SPEC"; cat "$0" requirements.txt setup.py pyproject.toml mita_seg/ops/csrc/*; } | sha256sum | cut -d' ' -f1)
if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
    exit 0
fi

echo "[setup] creating/updating $VENV (torch: $TORCH_SPEC)"
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip wheel 'setuptools<81' ninja
"${PIP[@]}" install -q "$TORCH_SPEC"

# mmcv: full build with ops, against the torch just installed (hence no build isolation).
if ! "$VENV/bin/python" -c "import mmcv, mmcv._ext; assert mmcv.__version__ == '2.1.0'" 2>/dev/null; then
    if "${PIP[@]}" cache list 'mmcv-2.1.0*' 2>/dev/null | grep -q mmcv; then
        echo "[setup] installing mmcv 2.1.0 with ops (the wheel built before, from pip's cache)"
    else
        echo "[setup] installing mmcv 2.1.0 with ops (compiling from source: ~15 min on 2 cores)"
    fi
    MMCV_WITH_OPS=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
        "${PIP[@]}" install --no-build-isolation mmcv==2.1.0
fi

"${PIP[@]}" install -q -r requirements.txt
"${PIP[@]}" install -q --no-build-isolation --no-deps -e .
"$VENV/bin/python" -c "import mmcv._ext, mmseg, mita_seg; print('[setup] ok: mmcv', mmcv.__version__, '| mmseg', mmseg.__version__)"
echo "$want" > "$STAMP"
