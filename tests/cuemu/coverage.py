"""Line coverage of the CUDA kernel sources (csrc/cuda/*.cu, *.cuh) under the emulated suites.

Builds the emulated kernel library with gcov instrumentation in its own build directory, runs the
emulated test suites through it (AMPFUSE_CUEMU_LIBRARY), then reports executed / executable lines
per file from gcov. Needs a `make build` first (it uses that build's libampfuse and venv).

    make cuda-coverage            # or: .venv/bin/python tests/cuemu/coverage.py [--build-dir build-cov]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUITES = ["tests/test_cuda_kernels.py", "tests/test_ops.py", "tests/test_optim.py", "tests/test_grad_scaler.py",
          "tests/test_accumulation.py"]


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def gcov_lines(build_dir: str) -> dict[str, tuple[int, int, list[int]]]:
    """{source: (executed, executable, missed line numbers)} for csrc/cuda files."""
    build_dir = os.path.abspath(build_dir)
    objs = glob.glob(os.path.join(build_dir, "CMakeFiles", "ampfuse_cuemu.dir", "**", "*.gcda"), recursive=True)
    out_dir = os.path.join(build_dir, "gcov")
    os.makedirs(out_dir, exist_ok=True)
    for f in glob.glob(os.path.join(out_dir, "*.gcov*")):
        os.remove(f)
    for gcda in objs:
        # Run where the compiler ran: the notes name headers relative to the build directory
        # (../csrc/cuda/*.cuh), and gcov opens them from its working directory. -p keeps the
        # source path in the output name, so files with one name don't collide.
        subprocess.run(["gcov", "-p", "-o", os.path.dirname(gcda), gcda], cwd=build_dir, check=True,
                       stdout=subprocess.DEVNULL)
        for f in glob.glob(os.path.join(build_dir, "*.gcov")):
            os.replace(f, os.path.join(out_dir, os.path.basename(f) + f".{len(os.listdir(out_dir))}"))
    result: dict[str, list] = {}
    for path in glob.glob(os.path.join(out_dir, "*.gcov.*")):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        m = re.match(r"\s*-:\s*0:Source:(.*)", lines[0])
        src = os.path.normpath(os.path.join(build_dir, m.group(1))) if m else ""
        rel = os.path.relpath(src, ROOT) if src.startswith(ROOT) else src
        if not re.match(r"csrc/cuda/.*\.(cu|cuh)$", rel):
            continue
        hit, total, missed = result.setdefault(rel, [set(), set(), None])[0], result[rel][1], None
        for line in lines[1:]:
            parts = line.split(":", 2)
            if len(parts) < 3:
                continue
            count, number = parts[0].strip(), int(parts[1].strip())
            if count == "-":
                continue
            total.add(number)
            if not count.startswith("#") and not count.startswith("="):
                hit.add(number)
    return {k: (len(v[0]), len(v[1]), sorted(v[1] - v[0])) for k, v in sorted(result.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-cov"))
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument("--target", type=float, default=95.0, help="minimum total line coverage (percent)")
    args = ap.parse_args(argv)
    bd = args.build_dir
    run(["cmake", "-S", ROOT, "-B", bd, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Debug", f"-DAMPFUSE_PYTHON={args.python}",
         "-DAMPFUSE_CUDA=OFF", "-DAMPFUSE_CUDA_EMULATION=ON", "-DAMPFUSE_CUEMU_COVERAGE=ON"], stdout=subprocess.DEVNULL)
    run(["cmake", "--build", bd, "--target", "ampfuse_cuemu"])
    for gcda in glob.glob(os.path.join(bd, "**", "*.gcda"), recursive=True):
        os.remove(gcda)
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), AMPFUSE_CPU_KERNELS="cuda-emulated",
               AMPFUSE_CUEMU_LIBRARY=os.path.join(bd, "libampfuse_cuemu.so"), AMPFUSE_REQUIRE_EMULATION="1")
    for order in ("forward", "random"):
        run([args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITES], cwd=ROOT,
            env=dict(env, CUEMU_BLOCK_ORDER=order, CUEMU_THREAD_ORDER=order))
    cov = gcov_lines(bd)
    hit = sum(v[0] for v in cov.values())
    total = sum(v[1] for v in cov.values())
    print("\nline coverage of the CUDA kernel sources under the emulated suites (gcov):")
    for name, (h, t, missed) in cov.items():
        print(f"  {name:36s} {h:4d}/{t:<4d} {100.0 * h / max(t, 1):6.1f}%" + (f"   missed lines: {missed}" if missed else ""))
    pct = 100.0 * hit / max(total, 1)
    print(f"  {'total':36s} {hit:4d}/{total:<4d} {pct:6.1f}%  (target {args.target:.0f}%)")
    return 0 if pct >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
