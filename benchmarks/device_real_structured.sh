#!/usr/bin/env bash
# Structured output with the default model's real weights on a lent GPU (docs/benchmarks.md,
# "Structured output on the GPU with real weights"). The GGUF (94 MiB) is over one call's 64 MiB,
# so it travels in three parts (.gpu_assets/p1 p2 p3: `head -c`/`tail -c` of the file), each call
# right after the last on the same warm machine: `... keep p1` (carry .gpu_assets/p1), `... keep p2`
# (carry .gpu_assets/p2), then `... run [tests]` (carry .gpu_assets/p3, .gpu_assets/tokenizer and
# .whl: one call carries 64 MiB at most, the tracked files included).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
KEEP=/tmp/keep  # outside the tree: the next call syncs the tree again
mkdir -p "$KEEP"
if [ -d .whl ] && [ ! -d "$KEEP/site" ]; then  # whichever call carries the wheels installs them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$KEEP/site" .whl/*.whl || exit 1
fi
if [ "${1:-}" = keep ]; then
  mv ".gpu_assets/$2" "$KEEP/" || exit 1
  ls "$KEEP"; exit 0
fi
cat "$KEEP/p1" "$KEEP/p2" .gpu_assets/p3 > /tmp/smol.gguf || exit 1
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
