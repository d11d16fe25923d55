"""The release artifacts, as users get them.

`tools/build_wheel.py` (what `make wheel` runs) builds the sdist, then the binary wheel from that
sdist, and tags it with auditwheel. The wheel is checked for its metadata (version, torch pin,
platform tag, nothing of torch's or CUDA's bundled), then installed into a fresh virtualenv whose
PATH holds nothing but python (no gcc, g++, cc, c++, nvcc, cmake, ninja), where it is imported and
runs a fused optimizer step, the scaler and the accumulator on CPU tensors. The virtualenv reaches
the development environment's torch without copying it: `site-packages/torch` and
`site-packages/nvidia` are symlinks to that torch and its CUDA libraries (so the library's RPATH
into site-packages/torch/lib and site-packages/nvidia/cu13/lib is exercised exactly as in a real
install), and a .pth file adds the development site-packages after the virtualenv's own for torch's
pure-Python dependencies. Then, with the compiler back, a C++ application (examples/cpp) is built
against `ampfuse.cmake_prefix_path` of the installed wheel and run.

AMPFUSE_WHEEL=path/to.whl tests that wheel instead of building one (about 20 s when ccache has
the objects, `make build` and an earlier wheel build leave them there).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile

import pytest
import torch

import ampfuse
from ampfuse import _version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_RELEASE = torch.__version__.split("+", 1)[0]
TORCH_LABEL = "torch" + ".".join(TORCH_RELEASE.split(".")[:2]) + (
    "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu")
COMPILERS = ["gcc", "g++", "cc", "c++", "nvcc", "cmake", "ninja", "clang", "ld"]


def _cuda_toolkit_root(tmp_path) -> str:
    """The CUDA toolkit a CUDA build of torch's CMake config needs (nvcc on PATH may be a wrapper
    script, whose own location is not the toolkit's: ask nvcc where it runs from)."""
    if shutil.which("nvcc") is None:
        return ""
    (tmp_path / "probe.cu").write_text("")
    r = subprocess.run(["nvcc", "--dryrun", "-c", str(tmp_path / "probe.cu")], capture_output=True, text=True)
    for line in (r.stdout + r.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return os.path.normpath(line.split("=", 1)[1].strip())
    return ""


def _cmake_package_version(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        m = re.search(r'set\(PACKAGE_VERSION "([^"]+)"\)', f.read())
    assert m is not None, path
    return m.group(1)


def test_one_version_everywhere():
    """python/ampfuse/_version.py is the one place: the package, the native build's description and
    the CMake package installed by `make build` all say the same."""
    v = _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", v)
    assert ampfuse.__version__ == v
    assert ampfuse.build_info()["version"] == v
    cfg = os.path.join(ampfuse.cmake_prefix_path, "ampfuse", "ampfuseConfigVersion.cmake")
    assert _cmake_package_version(cfg) == v
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        assert re.search(rf"^## \[?{re.escape(v)}\]?", f.read(), re.M), "CHANGELOG.md has no section for " + v


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    given = os.environ.get("AMPFUSE_WHEEL")
    if given:
        return given
    out = tmp_path_factory.mktemp("dist")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AMPFUSE_CPU_KERNELS")}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "build_wheel.py"), "--out", str(out)],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (whl,) = out.glob("ampfuse-*.whl")
    (sdist,) = out.glob("ampfuse-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"LICENSE", "python/ampfuse/py.typed"} <= names, sorted(names)[:50]
    return str(whl)


def test_wheel_metadata(wheel):
    v = _version.__version__
    name = os.path.basename(wheel)
    m = re.fullmatch(r"ampfuse-([^-]+)-py3-none-(manylinux_\d+_\d+_x86_64)\.whl", name)
    assert m is not None, name
    assert m.group(1) == f"{v}+{TORCH_LABEL}"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(f"ampfuse-{m.group(1)}.dist-info/METADATA").decode()
        wheel_info = zf.read(f"ampfuse-{m.group(1)}.dist-info/WHEEL").decode()
        info = json.loads(zf.read("ampfuse/lib/ampfuse_build.json"))
        cfg = zf.read("ampfuse/share/cmake/ampfuse/ampfuseConfigVersion.cmake").decode()
    assert f"\nVersion: {v}+{TORCH_LABEL}\n" in meta
    # the license travels with the package, and type checkers read its hints
    assert "\nLicense-Expression: BSD-3-Clause\n" in meta
    assert f"ampfuse-{m.group(1)}.dist-info/licenses/LICENSE" in names, names
    assert "ampfuse/py.typed" in names
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist: torch")]
    assert requires == [f"Requires-Dist: torch=={TORCH_RELEASE}"], requires
    assert f"Tag: py3-none-{m.group(2)}" in wheel_info
    assert "Root-Is-Purelib: false" in wheel_info
    # Only the package: no grafted libraries, no torch, no CUDA runtime, no test-build leftovers.
    assert all(n.startswith(("ampfuse/", f"ampfuse-{m.group(1)}.dist-info/")) for n in names), names
    libs = sorted(os.path.basename(n) for n in names if ".so" in os.path.basename(n))
    assert libs == ["libampfuse.so"], libs
    assert info["version"] == v and info["torch_version"] == TORCH_RELEASE
    assert info["cpu_capabilities"] == ["DEFAULT", "AVX2", "AVX512"]
    if torch.version.cuda and shutil.which("nvcc"):
        assert info["cuda"] is True and info["cuda_architectures"].split(",")[:2] == ["80", "90"], info
    assert f'set(PACKAGE_VERSION "{v}")' in cfg


def _fresh_venv(tmp_path) -> tuple[str, str]:
    """A virtualenv that sees the development torch through symlinks and a .pth file; returns
    (python, site-packages)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # The venv's own setuptools (from ensurepip) is older than torch requires: use the development one.
    subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=True)
    dev_site = sysconfig.get_paths()["purelib"]
    torch_dir = os.path.dirname(torch.__file__)
    os.symlink(torch_dir, os.path.join(site, "torch"))
    if os.path.isdir(os.path.join(dev_site, "nvidia")):
        os.symlink(os.path.join(dev_site, "nvidia"), os.path.join(site, "nvidia"))
    with open(os.path.join(site, "zz-dev-torch-deps.pth"), "w") as f:
        f.write(dev_site + "\n")
    return py, site


def test_wheel_installs_and_runs_without_a_compiler(wheel, tmp_path):
    py, site = _fresh_venv(tmp_path)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # (A wrapper, not a symlink: python finds its virtualenv next to the path it was started as.)
    (bindir / "python").write_text(f'#!/bin/sh\nexec {py} "$@"\n')
    (bindir / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "AMPFUSE_CPU_KERNELS", "CC", "CXX", "CUDACXX", "LD_LIBRARY_PATH")}
    env["PATH"] = str(bindir)
    for tool in COMPILERS:
        assert shutil.which(tool, path=env["PATH"]) is None, tool
    # pip resolves the torch pin against the torch this environment already has; nothing is fetched.
    r = subprocess.run(["python", "-m", "pip", "install", "--no-index", "--no-cache-dir", wheel],
                       env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    probe = textwrap.dedent(f"""
        import os, torch, ampfuse
        assert ampfuse.__file__.startswith({site!r}), ampfuse.__file__
        assert ampfuse.__version__ == {_version.__version__!r}
        torch.manual_seed(0)
        # A fused AdamW step on bf16 weights with fp32 masters, driven by the scaler.
        p = torch.randn(64).bfloat16().requires_grad_()
        opt = ampfuse.optim.AdamW([p], lr=1e-2)
        scaler = ampfuse.GradScaler("cpu", init_scale=64.0)
        scaler.scale((p.float() ** 2).sum()).backward()
        before = p.detach().clone()
        scaler.unscale_and_clip_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        assert not torch.equal(before, p) and opt.state[p]["step"].item() == 1
        # The accumulator: two micro-batches per window, fp32 sums, one step per window.
        model = torch.nn.Linear(8, 4).bfloat16()
        opt2 = ampfuse.optim.SGD(model.parameters(), lr=0.1)
        scaler2 = ampfuse.GradScaler("cpu", init_scale=256.0)
        acc = ampfuse.GradAccumulator(model, opt2, scaler2, steps=2)
        w0 = model.weight.detach().clone()
        for _ in range(4):
            with acc.accumulate():
                acc.backward(model(torch.randn(3, 8).bfloat16()).float().pow(2).mean())
        assert acc.window_ended and not torch.equal(w0, model.weight)
        print(ampfuse.cmake_prefix_path)
        print(ampfuse.library_path())
    """)
    r = subprocess.run(["python", "-c", probe], env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    prefix, lib = r.stdout.strip().splitlines()[-2:]
    assert prefix.startswith(site) and lib.startswith(site)
    # The RPATH leads the dynamic loader to torch's libraries (and CUDA's) inside site-packages.
    ldd = subprocess.run(["ldd", lib], capture_output=True, text=True, check=True).stdout
    assert "not found" not in ldd, ldd
    assert re.search(rf"libtorch_cpu\.so => {re.escape(site)}/ampfuse/lib/\.\./\.\./torch/lib/libtorch_cpu\.so", ldd), ldd
    if "libcudart" in ldd:
        assert re.search(rf"libcudart\.so\.\d+ => {re.escape(site)}/ampfuse/lib/\.\./\.\./nvidia/", ldd), ldd

    # With the compiler back: a C++ application found through ampfuse.cmake_prefix_path, built, run.
    app = tmp_path / "app"
    shutil.copytree(os.path.join(ROOT, "examples", "cpp"), app)
    torch_prefix = os.path.join(site, "torch", "share", "cmake")
    cuda_root = _cuda_toolkit_root(tmp_path)
    cenv = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AMPFUSE_CPU_KERNELS")}
    cenv.setdefault("TORCH_CUDA_ARCH_LIST", "8.0 9.0")
    # ccache keyed on paths relative to this test's directory: a second run reuses the objects.
    cenv["CCACHE_BASEDIR"] = str(tmp_path)
    launcher = shutil.which("ccache")
    r = subprocess.run(["cmake", "-S", str(app), "-B", str(app / "build"), "-DCMAKE_BUILD_TYPE=Release",
                        f"-DCMAKE_PREFIX_PATH={torch_prefix};{prefix}",
                        *([f"-DCMAKE_CXX_COMPILER_LAUNCHER={launcher}"] if launcher else []),
                        *([f"-DCUDA_TOOLKIT_ROOT_DIR={cuda_root}"] if cuda_root else [])],
                       env=cenv, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cache = (app / "build" / "CMakeCache.txt").read_text()
    assert f"ampfuse_DIR:PATH={prefix}/ampfuse" in cache
    r = subprocess.run(["cmake", "--build", str(app / "build"), "-j", os.environ.get("MAX_JOBS", "2")],
                       env=cenv, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    exe = str(app / "build" / "train_mlp")
    r = subprocess.run([exe], env=cenv, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), r.stdout[-2000:] + r.stderr[-2000:]
    ldd = subprocess.run(["ldd", exe], capture_output=True, text=True, check=True).stdout
    assert re.search(rf"libampfuse\.so => {re.escape(site)}/ampfuse/lib/libampfuse\.so", ldd), ldd
