#!/usr/bin/env bash
# Install SGLang 0.5.23 for tests/integrations/test_sglang*.py into a virtual environment, CPU only.
#
#   .ci/install-sglang.sh [PIP...]     PIP: that environment's pip, e.g. .venv/bin/pip or python -m pip
#                                      (default: python -m pip, the active environment's)
#
# SGLang's own requirements pin a CUDA torch and GPU kernels, so it goes in without dependencies, followed by
# the packages it imports on the paths the tests use (server-side imports, host pools, the cache controller).
# Every install is held to the CPU torch already installed by a constraints file (CONSTRAINTS, default
# .venv/constraints.txt, else a temporary one with torch==2.13.0): unconstrained, these would replace it
# with a CUDA build. torchvision is not installed (its PyPI build is CUDA-only and fails to import beside the
# CPU torch); the tests put a stand-in on their own path. Idempotent: pip leaves satisfied requirements alone.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=.ci/pip-target.sh
source .ci/pip-target.sh "$@"
torch_before="$("$PYTHON" -c 'import torch; print(torch.__version__)')"

"${PIP[@]}" install -q -c "$CONSTRAINTS" --no-deps "sglang==0.5.23"
# Imported by `import sglang` and its server-side utilities:
"${PIP[@]}" install -q -c "$CONSTRAINTS" numpy orjson psutil pybase64 requests triton packaging pillow starlette \
    msgspec pydantic pyzmq tqdm IPython aiohttp setproctitle
# Imported by the host pools (sglang.srt.mem_cache.pool_host) and HiCacheController:
"${PIP[@]}" install -q -c "$CONSTRAINTS" apache-tvm-ffi "transformers>=5.19,<6" dill sentencepiece \
    compressed-tensors gguf

torch_after="$("$PYTHON" -c 'import torch; print(torch.__version__)')"
if [ "$torch_before" != "$torch_after" ]; then
    echo "install-sglang: torch changed from $torch_before to $torch_after" >&2
    exit 1
fi
if "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torchvision") is None)'; then
    echo "install-sglang: note: torchvision is installed in this environment (the SGLang tests do not use it)" >&2
fi
echo "install-sglang: sglang $("$PYTHON" -c 'import importlib.metadata as m; print(m.version("sglang"))') ready"
