#!/usr/bin/env bash
# Structured output on a lent GPU per grammar backend (docs/benchmarks.md, "Grammar backends on
# the GPU"), then the GPU tests. Run from the repository root with the py3.12 wheels in .whl and
# the default model's tokenizer in .gpu_assets/tokenizer; with .gpu_assets/head.tar (`git archive
# HEAD -o .gpu_assets/head.tar`) it runs that clean export instead of the working tree.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$PWD
TOK=$ROOT/.gpu_assets/tokenizer
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
if [ -f .gpu_assets/head.tar ]; then mkdir -p /tmp/w && tar -xf .gpu_assets/head.tar -C /tmp/w && cd /tmp/w; fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 RADIXLM_TOKENIZER=$TOK RADIXLM_CACHE=/tmp/radixlm-cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for b in llguidance xgrammar; do
  echo "== structured, $b"
  timeout 200 python3 benchmarks/gpu.py --tokenizer "$TOK" --structured-only --grammar-backend $b > "$OUT/structured_$b.log" 2>&1
  grep -E "^bs|json_schema .* tok/s" "$OUT/structured_$b.log"
done
echo "== bs64 json_schema vs free text after more warm-up, wall vs GPU kernel time (llguidance)"
timeout 200 python3 benchmarks/gpu_structured_gap.py --tokenizer "$TOK" 2>&1 | tee "$OUT/gap.log" | grep -E "^(warm|json|free)"
echo "== GPU tests"
timeout 170 python3 -m pytest -q -p no:cacheprovider -o addopts=-ra -m gpu tests/runtime/gpu -k "not flashinfer" 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
