#!/usr/bin/env bash
# The GPU check: one prepared command for a GPU machine (an H200 with no network, its own python3
# with a CUDA build of torch 2.11, Python 3.12; 15 minutes of device time per session, one command
# at most 10 minutes). It confirms on real hardware what the emulated CUDA suites cannot see.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh             # on the GPU machine
#   OUT=/tmp/out bash benchmarks/gpu_check.sh --dry-run   # here, without a GPU: every pytest
#                                                         # command line of the real run, with
#                                                         # --collect-only added, and the plans
#   STAGES="tests bench" ...                              # only those stages (default: all)
#
# Stages, in the order of what they can tell (a cut-off run has done the most telling ones), each
# under its own cap; the caps add up to DEADLINE_S - RESERVE_S, so the whole script ends inside
# DEADLINE_S (default 540 s, inside the device's 10-minute command) with the logs archive written
# (it is rewritten after every stage too, so even a run killed from outside returns the logs of
# the stages it finished):
#   probe      tools and versions (nvcc, compute-sanitizer, pytest-timeout), recorded
#   build      libampfuse for sm_90 only, against the machine's torch
#   errors     every case of the bad-input table (tests/test_bad_input.py) on CPU and CUDA tensors:
#              each must raise its message with nothing changed (benchmarks/gpu_error_probe.py;
#              a crash is recorded, rerun alone under gdb for its trace, and the rest goes on)
#   tests      every test with "cuda" in its name, the suites of the kernels that ran least on a
#              GPU first (8-bit/FP8 state, stochastic rounding, schedules), then the kernel-level
#              suite (tests/test_cuda_kernels.py) against the REAL CUDA table
#              (AMPFUSE_KERNEL_TABLE=cuda: every case compared bitwise with the CPU kernels) and
#              the rest (not the cross-language, benchmark and demo tests, which need this
#              repository's C++ test build or measure), one pytest per file
#              (benchmarks/pytest_per_file.py), so a crash costs only its file
#   bench      GPU benchmarks up to 1e8 parameters, the 8-bit, FP8 and stochastic-rounding steps
#              first (bytes moved per param and % of the in-place stream), data generated on the
#              GPU, the JSON rewritten after every case (a cut-off run still returns what it measured)
#   fsdp2      FSDP2 + NCCL on one GPU: ampfuse's DTensor paths, sharded vs unsharded
#   memcheck   compute-sanitizer memcheck on the fp16/bf16 + fp32-master paths, the unscale and the
#              accumulation kernels (torch's caching allocator off: PYTORCH_NO_CUDA_MEMORY_CACHING=1)
#   racecheck  compute-sanitizer racecheck (shared-memory hazards) on the block reductions and the
#   synccheck  last-block tickets; synccheck (barriers); initcheck (reads of uninitialised global
#   initcheck  memory: fresh workspace, norm partials) -- each on a small kernel-level selection
# Returns at most 8 files in $OUT: summary.txt, logs.tar.gz (every stage's log and the junit XML),
# the benchmark JSON and its plot. Commit them under benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-$PWD/gpu_out}
PY=${PYTHON:-python3}
DEADLINE_S=${DEADLINE_S:-540}
RESERVE_S=15  # for the summary and the archive after the last stage
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOGS=$(mktemp -d)
summary="$OUT/summary.txt"
: >"$summary"
T0=$(date +%s)

# Stage caps (seconds). Their sum must not exceed DEADLINE_S - RESERVE_S (checked below). The build
# gets the most: optim_kernels.cu alone, for sm_90 only, took about 90 s of one core on the
# developers' 2-core machine (one nvcc per .cu file, so more cores do not shorten it).
# (On the H200 machine the build took 61 s of 16 cores; initcheck needed more than 25 s.)
declare -A CAP=([build]=100 [errors]=40 [tests]=105 [bench]=120 [fsdp2]=30 [memcheck]=40 [racecheck]=25
                [synccheck]=20 [initcheck]=40)
CAP_SUM=0
for s in "${!CAP[@]}"; do CAP_SUM=$(( CAP_SUM + CAP[$s] )); done
if (( CAP_SUM > DEADLINE_S - RESERVE_S )); then
  # A smaller DEADLINE_S scales every cap down in proportion.
  for s in "${!CAP[@]}"; do CAP[$s]=$(( CAP[$s] * (DEADLINE_S - RESERVE_S) / CAP_SUM )); done
fi

note() { echo "$*" | tee -a "$summary"; }
remaining() { echo $(( DEADLINE_S - RESERVE_S - ($(date +%s) - T0) )); }
archive() { tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null; }
stage() {  # stage NAME COMMAND...: run under min(CAP[NAME], time left), log, record rc and time
  local name=$1 limit=${CAP[$1]} left
  shift
  if [ -n "${STAGES:-}" ] && [[ " $STAGES " != *" $name "* ]]; then
    note "$name: not selected (STAGES=$STAGES)"
    return 0
  fi
  left=$(remaining)
  # The dry run only collects, but on a loaded 2-core machine a collection can take longer than a
  # GPU stage's cap: at least 60 s each there (its total is still bounded by DEADLINE_S).
  (( DRY == 1 && limit < 60 )) && limit=60
  (( limit > left )) && limit=$left
  if (( limit < 5 )); then
    note "$name: skipped (deadline reached)"
    FAILED+=("$name")
    return 124
  fi
  local t=$(date +%s)
  # -k: a process that ignores SIGTERM is killed 5 s later, so no stage outlives its cap by more.
  timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  note "$name: rc=$rc ($(( $(date +%s) - t ))s of at most ${limit}s)"
  (( rc == 0 )) || FAILED+=("$name")
  archive
  return $rc
}
FAILED=()
finish() {
  local rc=$?
  note "total: $(( $(date +%s) - T0 ))s"
  note "failed stages: ${FAILED[*]:-none}"
  archive
  rm -rf "$LOGS"
  note "files: $(ls "$OUT" | tr '\n' ' ')"
  # Exit status: non-zero when a stage failed (the dry run's test relies on it).
  (( rc == 0 && ${#FAILED[@]} > 0 )) && rc=1
  exit $rc
}
trap finish EXIT

# ---- probe ----------------------------------------------------------------------------------------
note "mode: $([ $DRY = 1 ] && echo 'dry run (no GPU: pytest command lines collected, not run)' || echo 'GPU')"
note "caps: $(for s in build errors tests bench fsdp2 memcheck racecheck synccheck initcheck; do printf '%s=%s ' $s ${CAP[$s]}; done)(sum ${CAP_SUM}s, deadline ${DEADLINE_S}s)"
note "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || true)"
note "python: $($PY -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' 2>&1)"
note "nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo 'not found')"
SANITIZER=$(command -v compute-sanitizer || true)
note "compute-sanitizer: ${SANITIZER:-not found}"
# pytest-timeout registers itself as the plugin "timeout": `-p timeout` (never `-p pytest_timeout`,
# which pytest rejects as a second registration when the plugin is installed).
TIMEOUT_ARGS=()
if $PY -c 'import pytest_timeout' 2>/dev/null; then TIMEOUT_ARGS=(-p timeout --timeout=60); fi
note "pytest-timeout: $([ ${#TIMEOUT_ARGS[@]} -gt 0 ] && echo yes || echo no)"

# ---- the pytest command lines (the dry run collects exactly these) --------------------------------
PYTEST=($PY -m pytest -q -p no:cacheprovider -rfE "${TIMEOUT_ARGS[@]}")
# The suites of the kernels that have run least on a GPU first (8-bit and FP8 state, stochastic
# rounding, the device schedules), then the rest.
FIRST_FILES=(tests/test_optim_8bit_state.py tests/test_quantization.py tests/test_optim_stochastic_rounding.py
             tests/test_lr_scheduler.py)
TEST_FILES=("${FIRST_FILES[@]}")
for f in tests/test_*.py; do
  [[ " ${FIRST_FILES[*]} " == *" $f "* || $f =~ test_(cpp_crosslang|bench|demo)\.py$ ]] || TEST_FILES+=("$f")
done
MEMCHECK=(tests/test_optim.py tests/test_ops.py tests/test_accumulation.py -x
          -k "cuda and (low_precision_params_with_masters and (adamw or sgd_nesterov) or skipped_steps_change_nothing and bfloat16 or unscale_check_matches_torch and True or accumulate_op_matches_reference)")
# Block reductions, last-block tickets, per-tensor step counters, fresh (capture) workspace.
KERNELS_SMALL=(tests/test_cuda_kernels.py -x
               -k "unscale_more_tensors_than_one_launch and 2.0 or optim_tensors_of_many_chunks and 1 or accumulate_more_tensors_than_one_launch and 1-")
run_pytest() {  # run_pytest STAGE [env ...] -- ARGS...: the real run, or its --collect-only twin
  local name=$1
  shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  if [ $DRY = 1 ]; then
    stage "$name" env "${envs[@]}" "${PYTEST[@]}" --collect-only "$@"
  else
    stage "$name" env "${envs[@]}" "${PYTEST[@]}" "$@"
  fi
}
sanitize() {  # sanitize STAGE TOOL ARGS...: compute-sanitizer --tool TOOL over pytest ARGS
  local name=$1 tool=$2
  shift 2
  if [ $DRY = 1 ]; then
    run_pytest "$name" AMPFUSE_KERNEL_TABLE=cuda -- "$@"
  elif [ -n "$SANITIZER" ]; then
    stage "$name" env AMPFUSE_KERNEL_TABLE=cuda PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      "$SANITIZER" --tool "$tool" --error-exitcode 9 "${PYTEST[@]}" "$@"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|not supported" "$LOGS/$name.log" | tail -3 | tee -a "$summary"
  else
    note "$name: compute-sanitizer not found (recorded, not run)"
  fi
}

# ---- build ----------------------------------------------------------------------------------------
if [ $DRY = 1 ]; then
  note "build: dry run uses the existing build in python/ampfuse/lib ($($PY -c 'import sys; sys.path.insert(0, "python"); import ampfuse; print(ampfuse.build_info()["torch_version"])' 2>&1))"
else
  stage build bash -c "
    cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DAMPFUSE_PYTHON=$(command -v "$PY") \
      -DAMPFUSE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DAMPFUSE_BUILD_TESTS=OFF \
      -DCMAKE_INSTALL_PREFIX=$PWD/python/ampfuse &&
    cmake --build build-gpu -j $(nproc) && cmake --install build-gpu" || { note "build failed: see logs.tar.gz"; tail -20 "$LOGS/build.log" >>"$summary"; exit 1; }
  $PY -c 'import sys; sys.path.insert(0, "python"); import ampfuse; print("build:", ampfuse.build_info())' 2>&1 | tee -a "$summary"
fi

# ---- errors ---------------------------------------------------------------------------------------
export PYTHONPATH=python
if [ $DRY = 1 ]; then
  stage errors $PY benchmarks/gpu_error_probe.py --dry-run
else
  stage errors $PY benchmarks/gpu_error_probe.py
fi
note "errors: $(grep -E '^\{' "$LOGS/errors.log" | tail -1 | cut -c1-1500)"

# ---- tests ----------------------------------------------------------------------------------------
COLLECT=()
PER_FILE=(--jobs 4)
[ $DRY = 1 ] && COLLECT=(--collect-only) && PER_FILE=(--one-process)  # the same arguments, parsed once
stage tests env AMPFUSE_KERNEL_TABLE=cuda $PY benchmarks/pytest_per_file.py "${PER_FILE[@]}" "${TEST_FILES[@]}" -- \
  -q -p no:cacheprovider -rfE "${TIMEOUT_ARGS[@]}" -k cuda "${COLLECT[@]}"
if [ $DRY = 1 ]; then
  note "tests: $(grep -E 'tests? collected' "$LOGS/tests.log" | tail -1)"
else
  note "tests: $(grep -E '^per file:' "$LOGS/tests.log" | tail -1)"
  grep -E '^(FAILED|ERROR)' "$LOGS/tests.log" | head -20 >>"$summary"
fi

# ---- bench ----------------------------------------------------------------------------------------
if [ $DRY = 1 ]; then
  stage bench $PY benchmarks/run.py --device cuda --plan-only --max-params 100000000 --out "$OUT"
else
  left=$(remaining)
  stage bench $PY benchmarks/run.py --device cuda --no-progress --max-params 100000000 \
    --deadline-s $(( (CAP[bench] < left ? CAP[bench] : left) - 10 )) --out "$OUT"
fi
grep -A40 "^| case" "$LOGS/bench.log" >>"$summary"
# ---- fsdp2 ----------------------------------------------------------------------------------------
# FSDP2 + NCCL on one GPU (world size 1 still runs every op through DTensor): sharded vs unsharded.
if [ $DRY = 1 ]; then
  stage fsdp2 $PY benchmarks/fsdp2_check.py --dry-run
else
  stage fsdp2 $PY -m torch.distributed.run --standalone --nproc_per_node=1 benchmarks/fsdp2_check.py
fi
note "fsdp2: $(grep -E '^\{' "$LOGS/fsdp2.log" | tail -1 | cut -c1-400)"

# ---- compute-sanitizer ------------------------------------------------------------------------------
sanitize memcheck memcheck "${MEMCHECK[@]}"
[ $DRY = 1 ] && note "memcheck selection: $(grep -c '::' "$LOGS/memcheck.log") tests ($(grep -c -E 'float16|bfloat16' "$LOGS/memcheck.log") with fp16/bf16 params)"
sanitize racecheck racecheck "${KERNELS_SMALL[@]}"
sanitize synccheck synccheck "${KERNELS_SMALL[@]}"
sanitize initcheck initcheck "${KERNELS_SMALL[@]}"
[ $DRY = 1 ] && note "kernel selection (racecheck, synccheck, initcheck): $(grep -c '::' "$LOGS/initcheck.log") tests"

note "done"
