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
python3 -m pytest -q -p no:cacheprovider -o addopts=-ra -m gpu tests/runtime/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -15

echo "== benchmarks/gpu.py"
python3 benchmarks/gpu.py --tokenizer .gpu_assets/tokenizer --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu_bench.log" | tail -40

echo "== serving: 512 requests (512 in / 128 out, concurrency 128): three runs on one freshly started server, then one after a restart"
SERVE=(--model dummy:llama-3-8b --tokenizer-path .gpu_assets/tokenizer --device cuda --dtype bfloat16)
BENCH=(--num-requests 512 --concurrency 128 --input-len 512 --output-len 128)
serve() {  # start a server on port 30000, print how long it took to answer /health with 200
  python3 -m radixlm.cli serve --port 30000 "${SERVE[@]}" > "$OUT/serve_$1.log" 2>&1 &
  SERVER=$!
  python3 - <<'PY'
import time, urllib.request
t0 = time.time()
while True:
    try:
        if urllib.request.urlopen("http://127.0.0.1:30000/health", timeout=5).status == 200:
            break
    except Exception:
        time.sleep(0.25)
print(f"server ready {time.time() - t0:.1f} s after launch")
PY
}
serve fresh
for i in 1 2 3; do
  python3 benchmarks/serving.py --url http://127.0.0.1:30000 "${BENCH[@]}" --out "$OUT/serving_fresh_$i.json" 2>&1 \
    | grep -E "output throughput|TTFT p50|TTFT p99|ITL p99|duration" | sed "s/^/run $i: /"
done
kill -TERM $SERVER; wait $SERVER
serve restart
python3 benchmarks/serving.py --url http://127.0.0.1:30000 "${BENCH[@]}" --out "$OUT/serving_restart.json" 2>&1 \
  | grep -E "output throughput|TTFT p50|TTFT p99|ITL p99|duration" | sed "s/^/after restart: /"
kill -TERM $SERVER; wait $SERVER
