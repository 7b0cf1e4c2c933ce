#!/usr/bin/env bash
# Download the wheels of bench/gpu/wheels.txt for the GPU machine (CPython 3.12, manylinux x86_64)
# into DEST (default .whl at the repository root). Run from the repository root, with network.
#   bash bench/gpu/fetch_wheels.sh [DEST] [PYTHON_VERSION]
set -euo pipefail
dest="${1:-.whl}"
pyver="${2:-3.12}"
mkdir -p "$dest"
grep -v '^\s*#' "$(dirname "$0")/wheels.txt" | grep -v '^\s*$' | while read -r req; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dest" "$req"
done
du -sh "$dest"
ls "$dest"
