"""Locating and loading the native library ``libampfuse``.

The library registers the ``torch.ops.ampfuse`` ops when it is loaded; it must be loaded once per
process and must match the torch version it was compiled against.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_LIB_DIR = os.path.join(_PACKAGE_DIR, "lib")
_LIB_NAME = "libampfuse.so"

#: Directory to add to ``CMAKE_PREFIX_PATH`` so that ``find_package(ampfuse)`` finds the CMake
#: package shipped inside the Python package (mirrors ``torch.utils.cmake_prefix_path``).
cmake_prefix_path: str = os.path.join(_PACKAGE_DIR, "share", "cmake")


def library_path() -> str:
    """Path of the native library inside the installed package."""
    return os.path.join(_LIB_DIR, _LIB_NAME)


def build_info() -> dict[str, Any]:
    """What the native library was built with (torch version, CUDA, CPU capabilities)."""
    path = os.path.join(_LIB_DIR, "ampfuse_build.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _torch_release(version: str) -> str:
    return version.split("+", 1)[0]


def _already_loaded() -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw("ampfuse::unscale_check_", "")
    except RuntimeError:
        return False
    return True


def check_build_matches(info: dict[str, Any]) -> None:
    """Raise ImportError if the library described by ``info`` was built for another torch."""
    built, running = info.get("torch_version", "?"), _torch_release(torch.__version__)
    if _torch_release(built) != running:
        raise ImportError(
            f"ampfuse was built against torch {built} but torch {torch.__version__} is installed; "
            "rebuild ampfuse against this torch (`pip install --no-build-isolation --force-reinstall .`)."
        )


def load_library() -> None:
    """Load ``libampfuse`` into this process (a no-op if its ops are already registered)."""
    if _already_loaded():
        return
    path = library_path()
    if not os.path.exists(path):
        raise ImportError(
            f"ampfuse's native library was not found at {path}. Build it with "
            "`pip install --no-build-isolation .` (or `make build` in a source checkout)."
        )
    try:
        info = build_info()
    except (OSError, ValueError) as e:
        raise ImportError(f"ampfuse: cannot read the build description next to {path}: {e}") from e
    check_build_matches(info)
    try:
        torch.ops.load_library(path)
    except OSError as e:
        raise ImportError(f"ampfuse: loading {path} failed: {e}") from e


def cpu_kernel_info() -> dict[str, Any]:
    """Which CPU kernel build runs (``DEFAULT``/``AVX2``/``AVX512``, chosen like torch's own and
    honouring ``ATEN_CPU_CAPABILITY``) and how many threads one parallel pass used."""
    import ctypes

    load_library()
    lib = ctypes.CDLL(library_path())
    lib.ampfuse_cpu_capability.restype = ctypes.c_char_p
    lib.ampfuse_cpu_parallel_threads_used.restype = ctypes.c_int
    return {
        "capability": lib.ampfuse_cpu_capability().decode(),
        "threads_used": int(lib.ampfuse_cpu_parallel_threads_used()),
        "torch_num_threads": torch.get_num_threads(),
    }
