#!/usr/bin/env bash
# The GPU check: one script for a GPU machine (an H200 with no network and its own python3 with a
# CUDA build of torch). It builds ampfuse there against that torch, runs the test suite (the CUDA
# tests run there; they skip elsewhere), runs compute-sanitizer memcheck over a small CUDA subset
# where the tool works, runs the GPU benchmarks and a short GPU demo, and writes everything under
# $OUT (default ./gpu_out). Commit what it returns under benchmarks/results/.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh
#
# Budget: about 8 minutes on an H200 (build ~1-2, tests ~2, sanitizer ~1, benchmarks ~3).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
summary="$OUT/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
stage() {  # stage NAME TIMEOUT_S COMMAND...: run, log to $OUT/NAME.log, record status and time
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  note "$name: rc=$rc ($(( $(date +%s) - t0 ))s)"
  return $rc
}

note "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
note "python: $($PY -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")')"
note "nvcc: $(nvcc --version 2>/dev/null | tail -1)"

# 1. Build for this GPU only (sm_90) against the machine's torch; install into python/ampfuse.
stage build 300 bash -c "
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DAMPFUSE_PYTHON=$(command -v "$PY") \
    -DAMPFUSE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DAMPFUSE_BUILD_TESTS=OFF \
    -DCMAKE_INSTALL_PREFIX=$PWD/python/ampfuse &&
  cmake --build build-gpu -j $(nproc) && cmake --install build-gpu" || { note "build failed: see build.log"; exit 1; }
$PY -c 'import sys; sys.path.insert(0, "python"); import ampfuse; print(ampfuse.build_info())' | tee -a "$summary"

# 2. The test suite (CUDA variants included).
stage tests 240 env PYTHONPATH=python $PY -m pytest -q -p no:cacheprovider -rs tests \
  --junitxml="$OUT/tests.xml"
tail -3 "$OUT/tests.log" | tee -a "$summary"

# 3. compute-sanitizer memcheck on a small CUDA subset (refused on some runtimes: recorded).
if command -v compute-sanitizer >/dev/null; then
  stage memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
    env PYTHONPATH=python $PY -m pytest -q -p no:cacheprovider -x tests/test_ops.py tests/test_optim.py \
    -k "cuda and (matches_torch and not 10000 or opcheck or skipped or low_precision_params and bfloat16 and adamw)"
  grep -E "ERROR SUMMARY|passed|failed|not supported" "$OUT/memcheck.log" | tail -3 | tee -a "$summary"
else
  note "memcheck: compute-sanitizer not found"
fi

# 4. GPU benchmarks (JSON + PNG + table).
stage bench 300 env PYTHONPATH=python $PY benchmarks/run.py --device cuda --no-progress --out "$OUT/results"
grep -A40 "^| case" "$OUT/bench.log" | tee -a "$summary" >/dev/null

# 5. A short GPU demo (fp16 weights + masters vs torch AMP).
stage demo 120 env PYTHONPATH=python $PY -m ampfuse.demo --device cuda --steps 60 --no-progress --out "$OUT/demo"
tail -14 "$OUT/demo.log" >>"$summary"
note "done"
