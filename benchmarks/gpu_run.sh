#!/bin/bash
# One time-boxed GPU run of the project's GPU figures; logs under $OUT.
#
#   bash benchmarks/gpu_run.sh                   # on the GPU machine, ~9 min at most
#   GPU_RUN_SMOKE=1 bash benchmarks/gpu_run.sh   # tiny sizes: checks the commands on a CPU
#
# Run from the repository root. Parts, each under its own time limit (the
# limits add up to 8.7 minutes; first calls on a GPU take 10-40 s each):
#   race     benchmarks/nanogpt_race.py, 600 steps: AdamW against kfac_adamw
#            at nanoGPT's shakespeare-char configuration, time to AdamW's best
#   profile  benchmarks/gpt_race.py --profile at that size: first call and
#            step of AdamW, kfac_adamw and kfac_optimizer; the parts of the step
#   step     benchmarks/step_time.py: the MLP's step and first call, batch 2048
# The test tiers on a GPU are benchmarks/gpu_suite.sh, a call of their own.
# Each part's log is $OUT/<part>.log; the race's plot $OUT/nanogpt_race.png.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
CACHE=${GPU_RUN_CACHE:-/tmp/kfac_jax_lite_cache}  # JAX's persistent compilation cache

if [ -n "$GPU_RUN_SMOKE" ]; then  # tiny sizes, for checking this script on a CPU
  GPT=(--width 32 --layers 1 --heads 2 --context 16 --batch-size 8)
  RACE=(--smoke)
  STEP=(--models mlp --batch-size 32)
else  # nanoGPT's shakespeare-char size
  GPT=(--width 384 --layers 6 --heads 6 --context 256 --batch-size 64)
  RACE=(--steps 600)
  STEP=(--models mlp --batch-size 2048)
fi

{ nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import sys, jax, jaxlib, optax, flax; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'optax', optax.__version__, 'flax', flax.__version__, jax.devices())"
  git rev-parse --short HEAD 2>/dev/null || echo "no git checkout"
} > "$OUT/info.log" 2>&1
cat "$OUT/info.log"

part() {  # part NAME SECONDS CMD...: CMD under a time limit, its log kept, its end shown
  local n=$1 s=$2; shift 2; local t0; t0=$(date +%s)
  timeout "$s" "$@" > "$OUT/$n.log" 2>&1; local rc=$?
  echo "=== $n rc=$rc in $(( $(date +%s) - t0 ))s (limit ${s}s)"; tail -n 15 "$OUT/$n.log"
}

part race 290 $PY benchmarks/nanogpt_race.py "${RACE[@]}" \
  --plot "$OUT/nanogpt_race.png" --compilation-cache "$CACHE"
part profile 170 $PY benchmarks/gpt_race.py --profile "${GPT[@]}"
part step 60 $PY benchmarks/step_time.py "${STEP[@]}" --periods 10 \
  --stats-fractions "" --no-breakdown --rounds 3 --steps-per-round 10
