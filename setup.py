"""Thin driver around CMake (CMakeLists.txt is the single source of truth for the native build).

`pip install --no-build-isolation .` configures and builds libampfuse against the installed torch
and installs it, its headers and its CMake package inside the Python package (ampfuse/lib,
ampfuse/include, ampfuse/share/cmake).

Environment: AMPFUSE_CUDA=auto|ON|OFF, CMAKE_CUDA_ARCHITECTURES (default "80;90"), DEBUG=1,
MAX_JOBS=N, CMAKE_ARGS="extra -D options", AMPFUSE_BUILD_DIR (the CMake build directory; default
inside setuptools' build_temp). ninja and ccache are used when available.

Version and requirements: the version is python/ampfuse/_version.py's. A wheel holds a library
compiled against one torch release, whose C++ ABI the next release does not keep, so a wheel pins
that release (`torch==2.14.1`). Release wheels (tools/build_wheel.py, AMPFUSE_LOCAL_VERSION=1)
also carry a local version label naming the torch build (`0.1.0+torch2.14cu130`, `+torch2.13cpu`);
a source install leaves it out, because pip refuses a wheel built from an index's sdist whose
version differs from the sdist's. The sdist asks
for the supported range (TORCH_SUPPORTED) and is built against whatever torch is installed. The
library uses no Python C API, so a wheel is tagged py3-none-<platform>: one wheel serves every
Python that torch itself supports.
"""

import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))

#: The torch releases ampfuse supports (README, Compatibility: the versions tested).
TORCH_SUPPORTED = "torch>=2.13"


def _base_version() -> str:
    with open(os.path.join(ROOT, "python", "ampfuse", "_version.py"), encoding="utf-8") as f:
        m = re.search(r'^__version__ = "([0-9]+\.[0-9]+\.[0-9]+)"$', f.read(), re.M)
    if m is None:
        raise RuntimeError("python/ampfuse/_version.py has no __version__ = \"X.Y.Z\" line")
    return m.group(1)


def _building_sdist() -> bool:
    return "sdist" in sys.argv[1:]


def _torch_build() -> tuple[str, str]:
    """(release, label) of the installed torch: ("2.14.1", "torch2.14cu130")."""
    import torch

    release = torch.__version__.split("+", 1)[0]
    major_minor = ".".join(release.split(".")[:2])
    # The torch build the library was compiled (and linked) against, whether or not ampfuse's own
    # CUDA kernels are in it (ampfuse.build_info() says that).
    cuda = torch.version.cuda
    return release, f"torch{major_minor}" + (f"cu{cuda.replace('.', '')}" if cuda else "cpu")


def _version_and_requirements() -> tuple[str, list[str]]:
    version = _base_version()
    if _building_sdist():
        return version, [TORCH_SUPPORTED]
    release, label = _torch_build()
    if os.environ.get("AMPFUSE_LOCAL_VERSION", "0") == "1":
        version += "+" + label
    return version, [f"torch=={release}"]


class PlatformWheel(bdist_wheel):
    """py3-none-<platform>: the native library is loaded by torch, not imported by Python."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        # The package directory the library goes into (the in-place tree for `--inplace`).
        pkg_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        build_dir = os.path.abspath(os.environ.get("AMPFUSE_BUILD_DIR") or os.path.join(self.build_temp, "cmake"))
        os.makedirs(build_dir, exist_ok=True)
        cfg = "Debug" if os.environ.get("DEBUG", "0") == "1" else "Release"
        args = [
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DAMPFUSE_PYTHON={sys.executable}",
            f"-DAMPFUSE_CUDA={os.environ.get('AMPFUSE_CUDA', 'auto')}",
            f"-DCMAKE_INSTALL_PREFIX={pkg_dir}",
        ]
        if os.environ.get("CMAKE_CUDA_ARCHITECTURES"):
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['CMAKE_CUDA_ARCHITECTURES']}")
        if shutil.which("ninja") or _python_ninja():
            args += ["-G", "Ninja"]
        args += os.environ.get("CMAKE_ARGS", "").split()
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "-S", ROOT, "-B", build_dir, *args])
        subprocess.check_call(["cmake", "--build", build_dir, "-j", jobs])
        subprocess.check_call(["cmake", "--install", build_dir])


def _python_ninja() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return True


VERSION, INSTALL_REQUIRES = _version_and_requirements()

setup(
    version=VERSION,
    install_requires=INSTALL_REQUIRES,
    # A placeholder extension so that setuptools runs build_ext (and builds a platform wheel);
    # CMake produces lib/libampfuse.so inside the package.
    ext_modules=[CMakeExtension("ampfuse._native_build_marker")],
    cmdclass={"build_ext": CMakeBuild, "bdist_wheel": PlatformWheel},
    package_data={"ampfuse": ["py.typed", "lib/*", "include/ampfuse/*.h", "share/cmake/ampfuse/*.cmake"]},
    zip_safe=False,
)
