"""Locating and loading the native library ``libampfuse``.

The library registers the ``torch.ops.ampfuse`` ops when it is loaded; it must be loaded once per
process and must match the torch version it was compiled against.
"""

from __future__ import annotations

import json
import os
import sys
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


def _native() -> Any:
    import ctypes

    load_library()
    lib = ctypes.CDLL(library_path())
    lib.ampfuse_cpu_kernels.restype = ctypes.c_char_p
    lib.ampfuse_cpu_parallel_threads_used.restype = ctypes.c_int
    lib.ampfuse_select_cpu_kernels.restype = ctypes.c_char_p
    lib.ampfuse_select_cpu_kernels.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.ampfuse_simulate_capture.restype = ctypes.c_int
    lib.ampfuse_simulate_capture.argtypes = [ctypes.c_int]
    return lib


def cpu_kernel_info() -> dict[str, Any]:
    """Which kernel table runs CPU tensors and how many threads one parallel pass of the CPU
    kernels used.

    ``kernels`` is the CPU kernel build chosen like torch's own (``DEFAULT``/``AVX2``/``AVX512``,
    honouring ``ATEN_CPU_CAPABILITY``), or ``cuda-emulated`` when ``AMPFUSE_CPU_KERNELS=cuda-emulated``
    runs CPU tensors through the CUDA kernels under the emulator (test builds).
    """
    lib = _native()
    return {
        "kernels": lib.ampfuse_cpu_kernels().decode(),
        "threads_used": int(lib.ampfuse_cpu_parallel_threads_used()),
        "torch_num_threads": torch.get_num_threads(),
    }


def emulator_path() -> str:
    """Where the emulated CUDA kernels (test builds) are looked for: ``$AMPFUSE_CUEMU_LIBRARY`` or
    ``libampfuse_cuemu.so`` next to the native library."""
    return os.environ.get("AMPFUSE_CUEMU_LIBRARY") or os.path.join(_LIB_DIR, "libampfuse_cuemu.so")


def emulator() -> Any:
    """The CUDA emulator's controls (a ``ctypes.CDLL`` of the emulated kernel library: schedule,
    launch counters, kernel diagnostics), or ``None`` when this build has no emulated kernels."""
    import ctypes

    path = emulator_path()
    if not os.path.exists(path):
        return None
    lib = ctypes.CDLL(path)
    lib.cuemu_take_diagnostics.restype = ctypes.c_char_p
    lib.cuemu_schedule.restype = ctypes.c_char_p
    lib.cuemu_configure.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulonglong, ctypes.c_int]
    return lib


def select_cpu_kernels(name: str, num_sms: int = 1) -> None:
    """For tests: run CPU tensors through the kernel table ``name`` from now on (``"native"``, the
    CPU kernels, or ``"cuda-emulated"``, the CUDA kernels under the emulator with ``num_sms``
    emulated multiprocessors). Not thread-safe against ops running concurrently."""
    err = _native().ampfuse_select_cpu_kernels(name.encode(), int(num_sms))
    if err is not None:
        raise RuntimeError(err.decode())


def limit_cuda_sms(limit: int) -> int:
    """For tests: size CUDA grids as if the device had at most ``limit`` multiprocessors (0: no
    limit), so that grids smaller than the chunk count run on a real GPU too. Returns the previous
    limit. Needs a build with the CUDA kernels."""
    import ctypes

    try:
        fn = _native().ampfuse_limit_cuda_sms
    except AttributeError:
        raise RuntimeError("limit_cuda_sms: this build of ampfuse has no CUDA kernels") from None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int]
    return int(fn(int(limit)))


def simulate_capture(on: bool) -> bool:
    """For tests: make every op call behave as under CUDA-graph capture (fresh workspace that the
    kernels zero themselves; metadata tables not uploaded, only found if already resident), so
    that the emulated suite runs those paths. Returns the previous setting."""
    return bool(_native().ampfuse_simulate_capture(1 if on else 0))


_dtensor_ready = False


def dtensor_support() -> None:
    """Registers the DTensor handlers (ampfuse.distributed) once torch.distributed.tensor is in
    use: called before the ops (and the engine calls) that DTensors may reach."""
    global _dtensor_ready
    if not _dtensor_ready and "torch.distributed.tensor" in sys.modules:
        from ampfuse import distributed

        distributed.install()
        _dtensor_ready = True
