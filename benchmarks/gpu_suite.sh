#!/bin/bash
# The test suite on a GPU machine: the default tier, then `-m "slow or perf"`,
# each under a time limit (T_DEFAULT, T_SLOW seconds; 560 s together by
# default, to fit one 10-minute device call). Logs under $OUT (or /tmp/out);
# prints each tier's failures and last line. From the project's root:
#   bash benchmarks/gpu_suite.sh
# A tier cut off by its limit still lists the failures it reached.
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi -L; XLA_FLAGS=--xla_force_host_platform_device_count=4 python3 -c \
  "import jax; print('jax', jax.__version__, jax.default_backend(),
  jax.devices(), 'cpu devices:', len(jax.devices('cpu')))"
} 2>&1 | tee "$OUT/info.log"

tier() {  # tier NAME SECONDS [PYTEST ARGS...]
  local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
  timeout -k 10 "$limit" python3 -m pytest tests -vv -n "${WORKERS:-14}" \
    -p no:cacheprovider --tb=short -rfE --durations=10 "$@" \
    > "$OUT/$name.log" 2>&1
  echo "=== $name rc=$? in $(( $(date +%s) - t0 ))s (limit ${limit}s)"
  grep -oE "(FAILED|ERROR) tests/[^ ]+" "$OUT/$name.log" | sort -u | head -40
  tail -n 1 "$OUT/$name.log"; echo
}
tier default "${T_DEFAULT:-250}"
tier slow_perf "${T_SLOW:-310}" -m "slow or perf"
