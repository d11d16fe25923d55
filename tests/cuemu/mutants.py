"""Mutation check of the emulated CUDA suites: inject one kernel bug at a time, show it is caught.

For each mutant: copy csrc/ to a scratch directory, apply one textual change to a CUDA kernel
source, compile the emulated kernel library from the copy with the exact flags of the main build
(its compile_commands.json), and run the kernel-level suite (tests/test_cuda_kernels.py) and the
emulated op tests through it (AMPFUSE_CUEMU_LIBRARY), under the forward schedule and, if that
passes, the random one. A mutant is caught when a run fails (a wrong result, or a kernel error
the emulator reports). Needs a `make build` first.

    make cuda-mutants             # or: .venv/bin/python tests/cuemu/mutants.py [--only 0,3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (what, file under csrc/cuda, original text (must occur once), mutated text[, "sanitize"]). A mutant
# marked "sanitize" is built with AddressSanitizer + UBSan (the build's ampfuse_cuemu_sanitized
# flags) and run as `make test-sanitize` runs the suites: its bug (an access just past a tensor's
# allocation) changes no result the plain suites compare.
MUTANTS = [
    ("missing __syncthreads in block_reduce (shared partials read before all are written)",
     "multi_tensor_apply.cuh",
     "  if (lane == 0) shared[warp] = v;\n  __syncthreads();\n",
     "  if (lane == 0) shared[warp] = v;\n"),
    ("16-byte path taken for unaligned pointers (wrong alignment test)",
     "multi_tensor_apply.cuh",
     "return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;",
     "return (reinterpret_cast<uintptr_t>(p) & 7u) == 0;"),
    ("wrong chunk -> tensor index (binary search off by one)",
     "multi_tensor_apply.cuh",
     "if (meta.chunk_start[mid] <= c) {",
     "if (meta.chunk_start[mid] < c) {"),
    ("off-by-one tail: chunk end one element short (unscale)",
     "amp_kernels.cu",
     "const int64_t end = min(begin + kChunkSize, meta.numel[t]);\n    bool bad = false;",
     "const int64_t end = min(begin + kChunkSize - 1, meta.numel[t]);\n    bool bad = false;"),
    ("vector path: scalar tail restarts at the chunk start (unscale)",
     "amp_kernels.cu",
     "    begin += nvec * V::kSize;\n",
     ""),
    ("wrong last-block condition: the norm is reduced before the last block published (norm)",
     "amp_kernels.cu",
     "is_last = ticket == static_cast<unsigned int>(meta.total_blocks - 1);",
     "is_last = ticket == static_cast<unsigned int>(meta.total_blocks > 1 ? meta.total_blocks - 2 : 0);"),
    ("norm partials indexed per launch instead of per pass",
     "amp_kernels.cu",
     "__stcg(a.partials + meta.block_offset + blockIdx.x, block_total);",
     "__stcg(a.partials + blockIdx.x, block_total);"),
    ("wrong last-block condition: step counter advanced on the wrong arrival",
     "optim_kernels.cu",
     "if (atomicAdd(counter, 1u) == chunks_of_t - 1) {",
     "if (atomicAdd(counter, 1u) == chunks_of_t) {"),
    ("grid-stride loop skips chunks (optimizer)",
     "optim_kernels.cu",
     "  for (int32_t c = blockIdx.x; c < nchunks; c += gridDim.x) {\n    const int t = find_tensor(meta, c);\n    const int64_t begin = static_cast<int64_t>(c - meta.chunk_start[t]) * kChunkSize;\n    const int64_t end = min(begin + kChunkSize, meta.numel[t]);\n    float* step",
     "  for (int32_t c = blockIdx.x; c < nchunks; c += gridDim.x + 1) {\n    const int t = find_tensor(meta, c);\n    const int64_t begin = static_cast<int64_t>(c - meta.chunk_start[t]) * kChunkSize;\n    const int64_t end = min(begin + kChunkSize, meta.numel[t]);\n    float* step"),
    ("optimizer quad path ignores the master's alignment",
     "optim_kernels.cu",
     "(!M::kTensor || master == nullptr || aligned_quad<MS>(master));",
     "true;"),
    ("the device momentum / beta1 ignored: the step uses the host value",
     "optim_kernels.cu",
     "const typename Kind::Hyper hyper = with_momentum(given, sa.momentum_tensor);",
     "const typename Kind::Hyper hyper = given;"),
    ("skip path removed: a set found_inf still steps",
     "optim_kernels.cu",
     "if (sa.found_inf != nullptr && *sa.found_inf != 0.0f) return;",
     ""),
    ("accumulate: non-finite grads of the vector path not flagged",
     "amp_kernels.cu",
     "        bad |= !isfinite(sum);\n        a[e / 4].v[e % 4] = sum;",
     "        a[e / 4].v[e % 4] = sum;"),
    ("shuffle reduction reads lanes outside the warp",
     "multi_tensor_apply.cuh",
     "  for (int off = 16; off > 0; off >>= 1) v = combine(v, __shfl_down_sync(0xffffffffu, v, off));\n  if (lane == 0)",
     "  for (int off = 32; off > 0; off >>= 1) v = combine(v, __shfl_down_sync(0xffffffffu, v, off));\n  if (lane == 0)"),
    # The hostile emulator's checks (csrc/cuemu): each catches one of these, which passed before.
    ("stale shared memory: 128 threads launched while the block reduction reads 8 warp slots",
     "amp_kernels.cu",
     "AMPFUSE_LAUNCH(grid, kBlockSize, 0, stream, unscale_check_table_kernel<kNorm, Acc>)",
     "AMPFUSE_LAUNCH(grid, kBlockSize / 2, 0, stream, unscale_check_table_kernel<kNorm, Acc>)"),
    ("divergent barrier inside a helper: block_reduce reached from two branches (same source lines)",
     "amp_kernels.cu",
     "if constexpr (kNorm != NormKind::None) block_total = block_reduce<kMax>(acc, shared);",
     "if constexpr (kNorm != NormKind::None) block_total = threadIdx.x < 32 ? block_reduce<kMax>(acc, shared) : block_reduce<!kMax>(acc, shared);"),
    ("fresh workspace not zeroed: the norm pass trusts a capture's new workspace to be zero",
     "amp_kernels.cu",
     "if ((a.norm != NormKind::None || a.overwrite_found_inf) && !ctx.workspace_zeroed) {",
     "if ((a.norm != NormKind::None || a.overwrite_found_inf) && false) {"),
    ("missing release fence before the last-block ticket (norm partials)",
     "amp_kernels.cu",
     "      if (block_bad) __stcg(a.bad, 1u);\n      __threadfence();\n",
     "      if (block_bad) __stcg(a.bad, 1u);\n"),
    ("missing release fence before the step counter's ticket (optimizer)",
     "optim_kernels.cu",
     "  if (threadIdx.x == 0) {\n    __threadfence();\n    unsigned int* counter",
     "  if (threadIdx.x == 0) {\n    unsigned int* counter"),
    ("accumulate: one element past each tensor's end read and written (its last chunk)",
     "amp_kernels.cu",
     "    const int64_t end = min(begin + kChunkSize, meta.numel[t]);\n    float* acc",
     "    const int64_t end = min(begin + kChunkSize, meta.numel[t] + 1);\n    float* acc",
     "sanitize"),
    ("quantize: the block's absmax read before thread 0 published it (no barrier)",
     "quant_kernels.cu",
     "      a.absmax[b] = block_absmax[0];\n    }\n    __syncthreads();\n",
     "      a.absmax[b] = block_absmax[0];\n    }\n"),
    ("8-bit tables: entries read before the block's threads wrote them (no barrier)",
     "multi_tensor_apply.cuh",
     "    tables[k][threadIdx.x] = quant_table_entry_of(formats.f[k], static_cast<int>(threadIdx.x));\n  }\n  __syncthreads();\n",
     "    tables[k][threadIdx.x] = quant_table_entry_of(formats.f[k], static_cast<int>(threadIdx.x));\n  }\n"),
    ("quantize: grid-stride loop skips quantization blocks",
     "quant_kernels.cu",
     "  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {\n    const int64_t i = b * kQuantBlock + threadIdx.x;\n    const float x",
     "  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x + 1) {\n    const int64_t i = b * kQuantBlock + threadIdx.x;\n    const float x"),
    ("quantize: a block holding an inf or a NaN not marked (its absmax stored positive)",
     "quant_kernels.cu",
     "const float m = block_absmax_reduce(x, i < a.numel, partial);",
     "const float m = fabsf(block_absmax_reduce(x, i < a.numel, partial));"),
    ("block absmax: a lane's mark lost in the warp reduction (a plain maximum)",
     "multi_tensor_apply.cuh",
     "[](float a, float b) { return absmax_combine(a, b); }",
     "[](float a, float b) { return fmaxf(a, b); }"),
    ("dequantize: a marked block decoded as an unmarked one (inf and NaN codes read as magnitudes)",
     "quant_kernels.cu",
     "quant_decode(a.codes[i], a.absmax[b], table[0], a.format)",
     "quant_decode(a.codes[i], fabsf(a.absmax[b]), table[0], a.format)"),
    ("quantize: a subnormal absmax stored as it is (decoded values lose bits)",
     "quant_kernels.cu",
     "      block_absmax[0] = quant_block_absmax(m);",
     "      block_absmax[0] = m > 0.0f && m < 0x1p-126f ? m : quant_block_absmax(m);"),
    ("dequantize: one byte past the ragged last block written",
     "quant_kernels.cu",
     "    if (i < a.numel) a.values[i] = quant_decode(",
     "    if (i <= a.numel) a.values[i] = quant_decode(",
     "sanitize"),
    ("8-bit step: the block's new absmax read before thread 0 published it (no barrier)",
     "optim_kernels.cu",
     "          absmax[block] = block_absmax[0];\n        }\n        __syncthreads();\n",
     "          absmax[block] = block_absmax[0];\n        }\n"),
    ("8-bit step: a subnormal absmax stored as it is (decoded values lose bits)",
     "optim_kernels.cu",
     "          block_absmax[0] = quant_block_absmax(mag);",
     "          block_absmax[0] = mag > 0.0f && mag < 0x1p-126f ? mag : quant_block_absmax(mag);"),
    ("8-bit step: a moment block holding an inf or a NaN not marked (its absmax stored positive)",
     "optim_kernels.cu",
     "const float mag = block_absmax_reduce(se[k], live, partial);",
     "const float mag = fabsf(block_absmax_reduce(se[k], live, partial));"),
    ("8-bit step: second moments encoded without their floor (a tiny v stored as 0)",
     "optim_kernels.cu",
     "quant_encode(se[k], block_absmax[0], tables[k], formats.f[k], Kind::nonnegative(k))",
     "quant_encode(se[k], block_absmax[0], tables[k], formats.f[k], false)"),
    ("8-bit step: the lane past a tensor's end read and written",
     "optim_kernels.cu",
     "      const bool live = i < end;",
     "      const bool live = i <= end;",
     "sanitize"),
    ("stochastic rounding: the draw keyed on the element's index in its chunk, not in its tensor",
     "optim_kernels.cu",
     "out.v[e] = M::store(p[e], mq.v[e], key, i + e, pq.v[e]);",
     "out.v[e] = M::store(p[e], mq.v[e], key, 4 * q + e, pq.v[e]);"),
    ("stochastic rounding: the draw keyed on the param's bits after the update, not before",
     "optim_kernels.cu",
     "    param[i] = M::store(p, m, key, i, old);\n    if (M::kTensor && master) master[i] = m;\n#pragma unroll",
     "    param[i] = M::store(p, m, key, i, from_float<T>(p));\n    if (M::kTensor && master) master[i] = m;\n#pragma unroll"),
    ("stochastic rounding: the key taken from the step count after the update",
     "optim_kernels.cu",
     "rounding_key(hyper.rounding_seed, step_before)",
     "rounding_key(hyper.rounding_seed, step_before + 1.0f)"),
    ("8-bit step, stochastic rounding: the draw keyed on the element's index in its quantization block",
     "optim_kernels.cu",
     "        param[i] = M::store(p, m, key, i, old);\n        if (M::kTensor && master) master[i] = m;",
     "        param[i] = M::store(p, m, key, i - b0, old);\n        if (M::kTensor && master) master[i] = m;"),
]

# The short block-quantization suites first: their mutants are caught without the long suites' run.
SUITES = ["tests/test_quantization.py", "tests/test_optim_8bit_state.py", "tests/test_cuda_kernels.py",
          "tests/test_ops.py", "tests/test_optim.py", "tests/test_accumulation.py",
          "tests/test_optim_stochastic_rounding.py"]


def compile_entries(build_dir: str, target: str = "ampfuse_cuemu") -> list[dict]:
    with open(os.path.join(build_dir, "compile_commands.json"), encoding="utf-8") as f:
        entries = json.load(f)
    wanted = [e for e in entries if "/cuemu/" in e["file"] and os.path.basename(e["file"]) != "runtime.cpp"
              and f"CMakeFiles/{target}.dir" in e.get("output", e["command"])]
    if not wanted:
        sys.exit(f"no emulated-kernel entries in {build_dir}/compile_commands.json: run `make build` first")
    return wanted


def cache_value(build_dir: str, key: str) -> str:
    with open(os.path.join(build_dir, "CMakeCache.txt"), encoding="utf-8") as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split("=", 1)[1].strip()
    return ""


def build_mutant(build_dir: str, work: str, entries: list[dict], sanitize: bool = False) -> str:
    """Compile the emulated library from work/csrc with the main build's flags; returns its path."""
    src = os.path.join(ROOT, "csrc")
    objs = []
    for e in entries:
        wrapper_src = open(e["file"], encoding="utf-8").read().replace(src, os.path.join(work, "csrc"))
        wrapper = os.path.join(work, os.path.basename(e["file"]))
        with open(wrapper, "w", encoding="utf-8") as f:
            f.write(wrapper_src)
        obj = os.path.join(work, os.path.basename(e["file"]) + ".o")
        cmd = e["command"].replace(src + "/", os.path.join(work, "csrc") + "/").replace(src + " ", os.path.join(work, "csrc") + " ")
        cmd = re.sub(r"-o \S+", f"-o {obj}", cmd, count=1)
        cmd = cmd.replace(e["file"], wrapper)
        cmd = re.sub(r"^\S*ccache\s+", "", cmd)
        r = subprocess.run(cmd, shell=True, cwd=e["directory"], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"compiling the mutant failed:\n{r.stderr[-3000:]}")
        objs.append(obj)
    if sanitize:  # the sanitized target compiles the runtime itself (with ASan's fiber annotations)
        runtime = os.path.join(build_dir, "CMakeFiles", "ampfuse_cuemu_sanitized.dir", "csrc", "cuemu", "runtime.cpp.o")
        objs = [o for o in objs if not o.endswith("runtime.cpp.o")]
    else:
        runtime = os.path.join(build_dir, "CMakeFiles", "ampfuse_cuemu_runtime.dir", "csrc", "cuemu", "runtime.cpp.o")
    lib = os.path.join(work, "libampfuse_cuemu.so")
    boost = cache_value(build_dir, "AMPFUSE_BOOST_CONTEXT_LIBRARY")
    libs = [boost] if boost and not boost.endswith("NOTFOUND") else []
    flags = ["-fsanitize=address,undefined"] if sanitize else ["-Wl,--no-undefined"]
    subprocess.run(["g++", "-shared", "-Wl,-Bsymbolic", *flags, "-o", lib, *objs, runtime, *libs,
                    "-lpthread", "-ldl"], check=True)
    return lib


def sanitizer_env() -> dict[str, str]:
    """What `make test-sanitize` sets: libasan first in the process (with libstdc++), stop at the
    first report."""
    def lib(name: str) -> str:
        return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()

    return dict(LD_PRELOAD=f"{lib('libasan.so')} {lib('libstdc++.so')}",
                ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
                UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")


def run_suites(lib: str, python: str, order: str, sanitize: bool = False) -> tuple[bool, str]:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), AMPFUSE_CPU_KERNELS="cuda-emulated",
               AMPFUSE_CUEMU_LIBRARY=lib, AMPFUSE_REQUIRE_EMULATION="1", CUEMU_QUIET="1",
               CUEMU_BLOCK_ORDER=order, CUEMU_THREAD_ORDER=order, CUEMU_SEED="7",
               **(sanitizer_env() if sanitize else {}))
    r = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SUITES], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    out = (r.stdout + r.stderr).splitlines()
    first = next((l for l in out if l.startswith("FAILED") or l.startswith("ERROR") or "Fatal Python error" in l
                  or "ERROR: AddressSanitizer" in l or "runtime error:" in l), "")
    if not first and r.returncode:
        first = f"exit status {r.returncode}: " + (out[-1] if out else "")
    return r.returncode != 0, first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument("--only", default="", help="comma-separated mutant indices")
    args = ap.parse_args(argv)
    entries = compile_entries(args.build_dir)
    only = {int(x) for x in args.only.split(",") if x}
    caught = tried = 0
    for k, (what, fname, old, new, *mode) in enumerate(MUTANTS):
        sanitize = mode == ["sanitize"]
        if only and k not in only:
            continue
        tried += 1
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix="ampfuse-mutant-") as work:
            shutil.copytree(os.path.join(ROOT, "csrc"), os.path.join(work, "csrc"))
            path = os.path.join(work, "csrc", "cuda", fname)
            text = open(path, encoding="utf-8").read()
            if text.count(old) != 1:
                print(f"[{k}] {what}: the original text occurs {text.count(old)} times in {fname}; update the mutant")
                return 2
            with open(path, "w", encoding="utf-8") as f:
                f.write(text.replace(old, new))
            if sanitize:
                lib = build_mutant(args.build_dir, work, compile_entries(args.build_dir, "ampfuse_cuemu_sanitized"), True)
            else:
                lib = build_mutant(args.build_dir, work, entries)
            hit, detail = run_suites(lib, args.python, "forward", sanitize)
            schedule = "forward" + (", sanitized" if sanitize else "")
            if not hit:
                hit, detail = run_suites(lib, args.python, "random", sanitize)
                schedule = "random" + (", sanitized" if sanitize else "")
        caught += hit
        verdict = f"CAUGHT ({schedule} schedule)" if hit else "MISSED"
        print(f"[{k}] {verdict:26s} {what}  ({time.time() - t0:.0f}s)\n      {detail[:200]}", flush=True)
    print(f"{caught} of {tried} mutants caught")
    return 0 if caught == tried else 1


if __name__ == "__main__":
    sys.exit(main())
