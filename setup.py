"""Thin driver around CMake (CMakeLists.txt is the single source of truth for the native build).

`pip install --no-build-isolation .` configures and builds libampfuse against the installed torch
and installs it, its headers and its CMake package inside the Python package (ampfuse/lib,
ampfuse/include, ampfuse/share/cmake).

Environment: AMPFUSE_CUDA=auto|ON|OFF, CMAKE_CUDA_ARCHITECTURES (default "80;90"), DEBUG=1,
MAX_JOBS=N, CMAKE_ARGS="extra -D options", AMPFUSE_BUILD_DIR (the CMake build directory; default
inside setuptools' build_temp). ninja and ccache are used when available.
"""

import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


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


setup(
    # A placeholder extension so that setuptools runs build_ext (and builds a platform wheel);
    # CMake produces lib/libampfuse.so inside the package.
    ext_modules=[CMakeExtension("ampfuse._native_build_marker")],
    cmdclass={"build_ext": CMakeBuild},
    package_data={"ampfuse": ["lib/*", "include/ampfuse/*.h", "share/cmake/ampfuse/*.cmake"]},
    zip_safe=False,
)
