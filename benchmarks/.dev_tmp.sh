export OUT
CLOSED_ROUNDS=2 CLOSED_TAG=_cap24 CLOSED_ARGS="--program-active-cap 24" timeout 280 bash benchmarks/device_program_sched.sh closed
CLOSED_ROUNDS=2 CLOSED_TAG=_cap32 CLOSED_ARGS="--program-active-cap 32" timeout 280 bash benchmarks/device_program_sched.sh closed
grep -h "program scheduling\|off / on" $OUT/closed*.log
