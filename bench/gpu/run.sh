#!/usr/bin/env bash
# One part of the diffusion benchmark on a CUDA machine that has torch/transformers but neither
# diffusers nor omni-core's dependencies: installs .whl/ (bench/gpu/fetch_wheels.sh) into /tmp/site,
# runs bench/diffusion.py (or bench/$OMNI_BENCH.py) from this source tree and leaves its tables, JSON and
# log under $OUT.
#   bash bench/gpu/run.sh PRESET [bench/diffusion.py options]     PRESET: 1.2b, 8.5b (or tiny: a smoke test)
#   OMNI_BENCH=minimax_h3 bash bench/gpu/run.sh h200 --layers 8   the MiniMax-H3 benchmark (bench/minimax_h3.py)
#   OMNI_BENCH=hunyuan_image3 bash bench/gpu/run.sh h200 --layers 8   HunyuanImage-3.0 (bench/hunyuan_image3.py)
set -uo pipefail
preset="${1:?usage: bench/gpu/run.sh PRESET [options]}"
shift
export OUT="${OUT:-/tmp/omni-bench-out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
bench="${OMNI_BENCH:-diffusion}"
export PYTHONPATH="/tmp/site:$PWD:$PWD/cli:$PWD/plugins/omni-cosmos3:$PWD/plugins/omni-minimax-h3:$PWD/plugins/omni-hunyuan"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
nvidia-smi > "$OUT/nvidia-smi-$preset.txt" 2>&1 || true
# Stop short of the machine's 10-minute limit so the tables are complete and come back.
timeout -s INT "${OMNI_BENCH_TIMEOUT:-570}" python3 "bench/$bench.py" --device cuda --dtype bfloat16 --preset "$preset" "$@" \
    2>&1 | grep -v -e "Loading pipeline components" -e "WeightNorm" | tee "$OUT/log-$preset.txt"
exit "${PIPESTATUS[0]}"
