#!/usr/bin/env bash
# The GPU check: one prepared command for a GPU machine (an H200 with no network, its own python3
# with a CUDA build of torch 2.11, Python 3.12; 15 minutes of device time per session, one command
# at most 10 minutes). It confirms on real hardware what the emulated CUDA suites cannot see.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh             # on the GPU machine
#   OUT=/tmp/out bash benchmarks/gpu_check.sh --dry-run   # here, without a GPU: the same stages and
#                                                         # files, planned and collected, not run
#
# Stages, each under its own limit and all under one deadline (DEADLINE_S, default 450 s, so the
# whole script ends well inside 8 minutes):
#   probe     tools and versions (nvcc, compute-sanitizer, pytest-timeout), recorded
#   build     libampfuse for sm_90 only, against the machine's torch (<= 240 s)
#   tests     the CUDA tests only (-k cuda; not the cross-language, benchmark and demo tests)
#   fsdp2     FSDP2 + NCCL on one GPU: ampfuse's DTensor paths, sharded vs unsharded (<= 45 s)
#   memcheck  compute-sanitizer memcheck on the fp16/bf16 + fp32-master paths, with torch's
#             caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1), if the tool is there
#   bench     GPU benchmarks up to 1e8 parameters, data generated on the GPU, the JSON rewritten
#             after every case (a cut-off run still returns what it measured)
# Returns at most 8 files in $OUT: summary.txt, logs.tar.gz (every stage's log and the junit XML),
# the benchmark JSON and its plot. Commit them under benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-$PWD/gpu_out}
PY=${PYTHON:-python3}
DEADLINE_S=${DEADLINE_S:-450}
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOGS=$(mktemp -d)
summary="$OUT/summary.txt"
: >"$summary"
T0=$(date +%s)
note() { echo "$*" | tee -a "$summary"; }
remaining() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }
stage() {  # stage NAME LIMIT_S COMMAND...: run under min(LIMIT_S, time left), log, record rc and time
  local name=$1 limit=$2 left
  shift 2
  left=$(remaining)
  (( limit > left )) && limit=$left
  if (( limit < 10 )); then
    note "$name: skipped (deadline reached)"
    return 124
  fi
  local t=$(date +%s)
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  note "$name: rc=$rc ($(( $(date +%s) - t ))s of at most ${limit}s)"
  return $rc
}
finish() {
  note "total: $(( $(date +%s) - T0 ))s"
  tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
  rm -rf "$LOGS"
  note "files: $(ls "$OUT" | tr '\n' ' ')"
}
trap finish EXIT

# The CUDA tests: -k cuda, without the tests that need this machine's C++ test build or that
# measure (cross-language, benchmark, demo) and the emulator-only kernel suite.
SELECT=(tests -k cuda --ignore=tests/test_cpp_crosslang.py --ignore=tests/test_bench.py
        --ignore=tests/test_demo.py --ignore=tests/test_cuda_kernels.py)
# memcheck: the low-precision param + fp32 master paths of every optimizer and the skip path, the
# unscale kernel, the accumulation kernel.
MEMCHECK_K="cuda and (low_precision_params_with_masters and (adamw or sgd_nesterov) or skipped_steps_change_nothing and bfloat16 or unscale_check_matches_torch and True or accumulate_op_matches_reference)"
MEMCHECK_FILES=(tests/test_optim.py tests/test_ops.py tests/test_accumulation.py)

# ---- probe ----------------------------------------------------------------------------------------
note "mode: $([ $DRY = 1 ] && echo 'dry run (no GPU: stages planned and collected, not run)' || echo 'GPU')"
note "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || true)"
note "python: $($PY -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' 2>&1)"
note "nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo 'not found')"
SANITIZER=$(command -v compute-sanitizer || true)
note "compute-sanitizer: ${SANITIZER:-not found}"
TIMEOUT_ARGS=()
if $PY -c 'import pytest_timeout' 2>/dev/null; then TIMEOUT_ARGS=(-p pytest_timeout --timeout=60); fi
note "pytest-timeout: $([ ${#TIMEOUT_ARGS[@]} -gt 0 ] && echo yes || echo no)"

# ---- build ----------------------------------------------------------------------------------------
if [ $DRY = 1 ]; then
  note "build: dry run uses the existing build in python/ampfuse/lib ($($PY -c 'import sys; sys.path.insert(0, "python"); import ampfuse; print(ampfuse.build_info()["torch_version"])' 2>&1))"
else
  stage build 240 bash -c "
    cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DAMPFUSE_PYTHON=$(command -v "$PY") \
      -DAMPFUSE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DAMPFUSE_BUILD_TESTS=OFF \
      -DCMAKE_INSTALL_PREFIX=$PWD/python/ampfuse &&
    cmake --build build-gpu -j $(nproc) && cmake --install build-gpu" || { note "build failed: see logs.tar.gz"; tail -20 "$LOGS/build.log" >>"$summary"; exit 1; }
  $PY -c 'import sys; sys.path.insert(0, "python"); import ampfuse; print("build:", ampfuse.build_info())' 2>&1 | tee -a "$summary"
fi

# ---- tests ----------------------------------------------------------------------------------------
export PYTHONPATH=python
if [ $DRY = 1 ]; then
  stage tests 60 $PY -m pytest --collect-only -q -p no:cacheprovider "${SELECT[@]}"
  note "tests: $(tail -1 "$LOGS/tests.log")"
else
  stage tests 120 $PY -m pytest -q -p no:cacheprovider -rfE "${TIMEOUT_ARGS[@]}" "${SELECT[@]}" --junitxml="$LOGS/tests.xml"
  note "tests: $(grep -E '(passed|failed|error)' "$LOGS/tests.log" | tail -1)"
  grep -E '^(FAILED|ERROR)' "$LOGS/tests.log" | head -20 >>"$summary"
fi

# ---- fsdp2 ----------------------------------------------------------------------------------------
# FSDP2 + NCCL on one GPU (world size 1 still runs every op through DTensor): sharded vs unsharded.
if [ $DRY = 1 ]; then
  stage fsdp2 30 $PY benchmarks/fsdp2_check.py --dry-run
else
  stage fsdp2 45 $PY -m torch.distributed.run --standalone --nproc_per_node=1 benchmarks/fsdp2_check.py
fi
note "fsdp2: $(grep -E '^\{' "$LOGS/fsdp2.log" | tail -1 | cut -c1-400)"

# ---- memcheck -------------------------------------------------------------------------------------
$PY -m pytest --collect-only -q -p no:cacheprovider "${MEMCHECK_FILES[@]}" -k "$MEMCHECK_K" >"$LOGS/memcheck-selection.log" 2>&1
note "memcheck selection: $(grep -c '::' "$LOGS/memcheck-selection.log") tests ($(grep -c -E 'float16|bfloat16' "$LOGS/memcheck-selection.log") with fp16/bf16 params)"
if [ $DRY = 1 ]; then
  note "memcheck: dry run (collected only)"
elif [ -n "$SANITIZER" ]; then
  stage memcheck 90 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool memcheck --error-exitcode 9 \
    $PY -m pytest -q -p no:cacheprovider -x "${MEMCHECK_FILES[@]}" -k "$MEMCHECK_K"
  grep -E "ERROR SUMMARY|passed|failed|not supported" "$LOGS/memcheck.log" | tail -3 | tee -a "$summary"
else
  note "memcheck: compute-sanitizer not found (recorded, not run)"
fi

# ---- bench ----------------------------------------------------------------------------------------
if [ $DRY = 1 ]; then
  stage bench 60 $PY benchmarks/run.py --device cuda --plan-only --max-params 100000000 --out "$OUT"
else
  stage bench 150 $PY benchmarks/run.py --device cuda --no-progress --max-params 100000000 \
    --deadline-s $(( $(remaining) - 15 )) --out "$OUT"
fi
grep -A40 "^| case" "$LOGS/bench.log" >>"$summary"
note "done"
