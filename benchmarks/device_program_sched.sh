#!/usr/bin/env bash
# Program-aware scheduling on vs off, and client-driven vs /run_program, on a lent GPU machine
# (docs/benchmarks.md). Run from the repository root with the py3.12 wheels in .whl (llguidance's
# abi3 package in .whl/site) and the default model's tokenizer folder in .gpu_assets/tokenizer;
# the model is dummy:smollm2-135m (the default model's shape, random weights). Results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site:$PWD/.whl/site PYTHONUNBUFFERED=1 RADIXLM_CACHE=/tmp/radixlm-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__)"
SERVER="--model dummy:smollm2-135m --tokenizer-path .gpu_assets/tokenizer --device cuda"
for step in "$@"; do
  case $step in
    sched) python3 benchmarks/run_program.py --scheduling --programs 64 --rounds 2 --dtype bfloat16 \
             --server-args "$SERVER" --out "$OUT/program_scheduling_gpu.json" 2>&1 | tee "$OUT/sched.log" ;;
    ways) python3 benchmarks/run_program.py --sizes 1,32 --repeats 3 --dtype bfloat16 \
            --server-args "$SERVER" --out "$OUT/run_program_gpu.json" 2>&1 | tee "$OUT/ways.log" ;;
  esac
done
