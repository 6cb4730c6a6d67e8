#!/usr/bin/env bash
# GPU path check on a CUDA host: pipelined H2D from a checkpoint, and the CUDA IPC warm hand-off.
# Needs torch with CUDA in the environment (pip install -e ".[dev]" with a CUDA torch wheel).
# Usage: benchmarks/gpu_check.sh [--quick | --smoke] [--json PATH]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
exec "$PY" benchmarks/gpu_check.py "$@"
