# Sourced by the .ci/install-*.sh scripts: which environment they install into, held to the CPU torch.
#
# Sets PIP (the arguments, else `python -m pip`), PYTHON (that environment's interpreter) and CONSTRAINTS
# (CONSTRAINTS, default .venv/constraints.txt, else a temporary file with torch==2.13.0: unconstrained, a
# dependency would replace the CPU torch with a CUDA build).
PIP=("$@")
[ "${#PIP[@]}" -gt 0 ] || PIP=(python -m pip)
if [ "${#PIP[@]}" -ge 3 ] && [ "${PIP[1]}" = "-m" ]; then
    PYTHON="${PIP[0]}"
else
    PYTHON="$(dirname "${PIP[0]}")/python"
fi
CONSTRAINTS="${CONSTRAINTS:-.venv/constraints.txt}"
if [ ! -f "$CONSTRAINTS" ]; then
    CONSTRAINTS="$(mktemp)"
    echo "torch==2.13.0" > "$CONSTRAINTS"
fi
