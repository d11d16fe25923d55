"""`pip install --no-build-isolation .`, the way users install ampfuse into an existing PyTorch
environment: a wheel built by pip from a clean clone of this repository, installed into a
throwaway target, imported from there (not from this checkout), one fused step run, and the
installed CMake package found through ampfuse.cmake_prefix_path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, ".git")) or shutil.which("git") is None,
                    reason="needs a git checkout to clone")
def test_pip_install_into_a_fresh_target(tmp_path):
    src = tmp_path / "src"
    subprocess.run(["git", "clone", "-q", ROOT, str(src)], check=True)
    # Build where a clone's build directory is, so that ccache (keyed on paths relative to the
    # checkout) reuses the objects `make build` compiled.
    env = dict(os.environ, AMPFUSE_BUILD_DIR=str(src / "build"), CCACHE_BASEDIR=str(src))
    env.pop("AMPFUSE_CPU_KERNELS", None)
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", str(dist), str(src)],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheels = list(dist.glob("ampfuse-*.whl"))
    assert len(wheels) == 1, wheels
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheels[0])],
                   check=True)
    probe = textwrap.dedent(f"""
        import os, subprocess, torch, ampfuse
        assert ampfuse.__file__.startswith({str(site)!r}), ampfuse.__file__
        assert os.path.exists(ampfuse.library_path())
        p = torch.randn(64).bfloat16().requires_grad_()
        opt = ampfuse.optim.AdamW([p], lr=1e-2)
        scaler = ampfuse.GradScaler("cpu", init_scale=64.0)
        scaler.scale((p.float() ** 2).sum()).backward()
        before = p.detach().clone()
        scaler.unscale_and_clip_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        assert not torch.equal(before, p) and opt.state[p]["step"].item() == 1
        print(ampfuse.cmake_prefix_path)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AMPFUSE_CPU_KERNELS")}
    env["PYTHONPATH"] = str(site)
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    prefix = r.stdout.strip().splitlines()[-1]
    assert prefix.startswith(str(site))
    # find_package(ampfuse) through ampfuse.cmake_prefix_path (configure only).
    app = tmp_path / "app"
    app.mkdir()
    (app / "CMakeLists.txt").write_text(textwrap.dedent("""
        cmake_minimum_required(VERSION 3.18)
        project(probe LANGUAGES CXX)
        find_package(ampfuse REQUIRED)
        get_target_property(loc ampfuse::ampfuse IMPORTED_LOCATION_RELEASE)
        message(STATUS "ampfuse_DIR=${ampfuse_DIR}")
    """))
    import torch

    cuda_root = _cuda_toolkit_root(tmp_path)
    r = subprocess.run(["cmake", "-S", str(app), "-B", str(app / "build"),
                        f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path};{prefix}",
                        *([f"-DCUDA_TOOLKIT_ROOT_DIR={cuda_root}"] if cuda_root else [])],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"ampfuse_DIR={prefix}/ampfuse" in r.stdout, r.stdout
