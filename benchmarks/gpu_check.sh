#!/usr/bin/env bash
# GPU path check on a CUDA host: pipelined H2D from a checkpoint, and the CUDA IPC warm hand-off; then, where
# vLLM's CUDA build is installed, vLLM's OffloadingConnector with the TensorCast tier end to end.
# Needs torch with CUDA in the environment (pip install -e ".[dev]" with a CUDA torch wheel).
# Usage: benchmarks/gpu_check.sh [--quick | --smoke] [--json PATH]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
"$PY" benchmarks/gpu_check.py "$@"
if "$PY" -c 'import vllm' 2>/dev/null; then
    # The same options; its JSON beside gpu_check's (PATH.json -> PATH-vllm-tier.json).
    tier_args=() prev=""
    for a in "$@"; do
        if [ "$prev" = "--json" ]; then a="${a%.json}-vllm-tier.json"; fi
        tier_args+=("$a") prev="$a"
    done
    "$PY" benchmarks/vllm_tier_check.py "${tier_args[@]}"
else
    echo "vLLM is not installed: the OffloadingConnector tier check is skipped (pip install vllm)"
fi
