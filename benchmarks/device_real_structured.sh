#!/usr/bin/env bash
# Structured output with the default model's real weights on a lent GPU (docs/benchmarks.md,
# "Structured output on the GPU with real weights"). The GGUF (94 MiB) is over one call's 64 MiB
# (the tracked files, ~26 MiB, included), so it travels in 20 MB parts (`split -b 20000000 -d -a 1
# GGUF .gpu_assets/parts/part`: part0 .. part4), each call right after the last on the same warm
# machine: `... keep part0` (carry .gpu_assets/parts/part0), ... `keep part3`, then `... run [tests]`
# (carry .gpu_assets/parts/part4, .gpu_assets/tokenizer and .whl).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
KEEP=/tmp/keep  # outside the tree: the next call syncs the tree again
mkdir -p "$KEEP"
if [ -d .whl ] && [ ! -d "$KEEP/site" ]; then  # whichever call carries the wheels installs them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$KEEP/site" .whl/*.whl || exit 1
fi
if [ "${1:-}" = keep ]; then
  mv ".gpu_assets/parts/$2" "$KEEP/" || exit 1
  ls "$KEEP"; exit 0
fi
mv .gpu_assets/parts/part* "$KEEP/" || exit 1
cat "$KEEP"/part? > /tmp/smol.gguf || exit 1
sha256sum /tmp/smol.gguf
export PYTHONPATH=$PWD:$PWD/benchmarks:$KEEP/site PYTHONUNBUFFERED=1 RADIXLM_CACHE=/tmp/radixlm-cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# BENCH_ARGS: more arguments for the benchmark (--batches 16,64 --modes 2,6, say)
timeout 450 python3 benchmarks/gpu_real_structured.py --model /tmp/smol.gguf --profile ${BENCH_ARGS:-} \
  --out "$OUT/gpu_real_structured.json" 2>&1 | grep -v Warning > "$OUT/gpu_real_structured.log"
grep -E "^(jump|bs|profiled|phases)" "$OUT/gpu_real_structured.log"; grep -A24 "ncalls" "$OUT/gpu_real_structured.log" | cut -c1-150
if [ "${2:-}" = tests ]; then  # `... run tests`: then the GPU tests, on the same machine
  RADIXLM_TOKENIZER=$PWD/.gpu_assets/tokenizer timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts=-ra -m gpu tests/runtime/gpu -k "not flashinfer" 2>&1 | tail -4
fi
