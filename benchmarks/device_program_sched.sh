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
    # Programs arriving over time (Poisson) into servers capped at 16 running requests, below the
    # demand (one ToT program alone forks 27 leaves). The 64 programs take ~500 bs16 steps of ~6 ms
    # (H100 bs1 decode: ~5.8 ms a step with the host's work), ~3 s, so ~20 programs/s: 24/s loads
    # the cap about fully, 48/s overloads it ~2x; the programs arrive over ~2.7 s and ~1.3 s.
    # ~100 s a rate (4 server starts). ARRIVE_RATES and ARRIVE_ARGS (more server flags, e.g.
    # "--policy fcfs") change them.
    arrive) for rate in ${ARRIVE_RATES:-24 48}; do
              python3 benchmarks/run_program.py --scheduling --programs 64 --rounds 2 --dtype bfloat16 \
                --arrival-rate "$rate" --server-args "$SERVER --max-running-requests 16 ${ARRIVE_ARGS:-}" \
                --out "$OUT/program_arrivals_r$rate.json" 2>&1 | tee "$OUT/arrive_r$rate.log"
            done ;;
    # A closed loop: 64 clients, each sending its next program as soon as its last one answered
    # (64 programs in flight until 256 were sent), into servers capped at 16 running requests.
    # CLOSED_ARGS: more server flags; CLOSED_TAG: a suffix for the result files.
    # CLOSED_GPUS=0,1 (a two-GPU machine): each server on a GPU of its own. CLOSED_PROGRAMS: programs
    # a round (256; more make the p99 steadier: 256 programs' p99 is their third-worst).
    closed) python3 benchmarks/run_program.py --scheduling --programs ${CLOSED_PROGRAMS:-256} --concurrency 64 --rounds ${CLOSED_ROUNDS:-3} \
              ${CLOSED_GPUS:+--server-gpus "$CLOSED_GPUS"} \
              --dtype bfloat16 --server-args "$SERVER --max-running-requests 16 --max-queued-requests 100000 ${CLOSED_ARGS:-}" \
              --out "$OUT/program_closed_loop_gpu${CLOSED_TAG:-}.json" 2>&1 | tee "$OUT/closed${CLOSED_TAG:-}.log" ;;
    ways) python3 benchmarks/run_program.py --sizes 1,32 --repeats 3 --dtype bfloat16 \
            --server-args "$SERVER" --out "$OUT/run_program_gpu.json" 2>&1 | tee "$OUT/ways.log" ;;
  esac
done
