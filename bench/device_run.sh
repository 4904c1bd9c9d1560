#!/bin/bash
# tinygrad's path on a lent GPU, every stage time-boxed within ~9 minutes; figures and logs land in $OUT.
# Here first: .venv/bin/python bench/device_kit.py (assembles .gpu/, git-ignored). Then through the
# device tool, from the checkout's root with `.gpu` carried:  bash bench/device_run.sh
# Overrides: PY (python3), DEVS (devices to try, "CUDA NV AMD"), RUN_ARGS (bench/device_run.py's options),
# BUDGET (seconds in all, 540), SKIP (stage names: run tests), OUT (/tmp/out). A dry run on a CPU:
#   PY=.venv/bin/python DEVS=CPU RUN_ARGS="--shape smollm2-135m --layers 2 --streams 1,2 --prompt 64 --beside 2" bash bench/device_run.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 XDG_CACHE_HOME=/tmp/xdg
PY=${PY:-python3}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=$OUT/log.txt; T0=$(date +%s); BUDGET=${BUDGET:-540}
say() { echo "=== [$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
skipped() { [[ " ${SKIP:-} " == *" $1 "* ]] && say "skipped: $1"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
stage() {  # stage LIMIT CMD...: at most LIMIT seconds (fewer where the budget is short), output to the log
  local limit=$1; shift; local l; l=$(left); [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -lt 20 ]; then say "skipped (the budget): $*"; return 124; fi
  say "(<= ${limit}s) $*"; timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1; local rc=$?; say "rc=$rc"; return $rc
}

# what the machine lacks, from the kit; the default model's stand-in (its tokenizer) on the path
$PY -c "import tinygrad" 2>/dev/null || $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl 2>&1 | tail -3 | tee -a "$LOG"
export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD:$PWD/tests
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
$PY -c 'import sys, numpy, tinygrad, flask, llguidance, gguf; print("python", sys.version.split()[0], "numpy", numpy.__version__)' 2>&1 | tee -a "$LOG"

# which device runs a float16 product, as the server would set tinygrad up (prepare_tinygrad)
cat > /tmp/device_smoke.py <<'PYEOF'
from webapp.engine.model.tinygrad_setup import prepare_tinygrad
prepare_tinygrad()
from tinygrad import Device, Tensor, dtypes
a = Tensor.ones(1024, 1024, dtype=dtypes.float16).contiguous().realize()
assert (a @ a).float().mean().item() == 1024
print("runs on", Device.DEFAULT)
PYEOF
FOUND=""
for d in ${DEVS:-CUDA NV AMD}; do DEV=$d stage 60 $PY /tmp/device_smoke.py && { FOUND=$d; break; }; done
[ -z "$FOUND" ] && { say "no device ran"; tail -60 "$LOG"; exit 1; }
export DEV=$FOUND
say "DEV=$DEV"

# the figures: an 8B-shaped Q4_K_M and F16 file each loaded, warmed up and served (bench/device_run.py)
skipped run || stage $(( $(left) - 150 )) $PY bench/device_run.py "$OUT" ${RUN_ARGS:-} --budget $(( $(left) - 170 ))

# the device path's model tests: every architecture against its float64 reference, the lanes, the blocks
skipped tests || stage 140 $PY -m pytest -q -rfE -p no:cacheprovider -k "tinygrad or device" \
  tests/integration/test_architectures.py tests/integration/test_device_blocks.py tests/integration/test_device_lanes.py

say "done"
cat "$OUT/device_run.md" 2>/dev/null | tee -a "$LOG"
grep -E "passed|failed|error" "$LOG" | tail -5
