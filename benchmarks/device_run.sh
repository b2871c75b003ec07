#!/usr/bin/env bash
# One full check on a lent GPU machine (docs/benchmarks.md, "GPU"): the GPU tests, the decode /
# prefill benchmark, then serving right after a fresh start and again after a restart (the
# triton cache kept in the radixlm cache dir). Run from the repository root with the py3.12
# wheels in .whl and the default model's tokenizer in .gpu_assets/tokenizer; results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 RADIXLM_TOKENIZER=$PWD/.gpu_assets/tokenizer
export RADIXLM_CACHE=/tmp/radixlm-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers, sys; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)"

echo "== GPU tests"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -15

echo "== benchmarks/gpu.py"
python3 benchmarks/gpu.py --tokenizer .gpu_assets/tokenizer --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu_bench.log" | tail -40

echo "== serving: 512 requests (512 in / 128 out, concurrency 128) right after a fresh start, then after a restart"
SERVE=(--model dummy:llama-3-8b --tokenizer-path .gpu_assets/tokenizer --device cuda --dtype bfloat16)
for run in fresh restart; do
  python3 benchmarks/serving.py --launch --num-requests 512 --concurrency 128 --input-len 512 --output-len 128 \
    --out "$OUT/serving_$run.json" -- "${SERVE[@]}" 2>&1 | tee "$OUT/serving_$run.log" | tail -14
done
