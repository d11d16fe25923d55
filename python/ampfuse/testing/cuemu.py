"""The emulated CUDA device, ``cuemu``: CUDA's code paths without a GPU (test builds only).

Importing this module loads ``libampfuse_cuemu_device`` and registers it as torch's PrivateUse1
backend under the name ``cuemu``. Tensors on ``"cuemu"`` hold host memory; torch's operators run
their CPU kernels over that memory, and ampfuse's ops run the CUDA kernel table under the emulator
(``csrc/cuemu``), registered by the same code as the CUDA key, with device guards, streams and
the launch context of a device.

Every operation that would make the host wait for a GPU is counted: a copy to host memory (unless
``non_blocking`` into pinned memory), a copy from host memory (unless ``non_blocking`` from pinned
memory), ``item()``/``bool()``/``float()`` of a tensor, operators whose output size depends on
the data (``nonzero``, ``masked_select``, boolean-mask indexing, ...) and an explicit
synchronize::

    import ampfuse.testing.cuemu as cuemu

    x = torch.ones(3, device="cuemu")
    with cuemu.counting_syncs() as syncs:
        y = (x * 2).sum()
        y.item()
    assert len(syncs) == 1 and "_local_scalar_dense" in syncs[0].what
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

import ampfuse  # noqa: F401  (loads libampfuse first: the device library links it)
from ampfuse import _library

NAME = "cuemu"
_LIB_NAME = "libampfuse_cuemu_device.so"

__all__ = ["NAME", "Sync", "counting_syncs", "device", "is_available", "sync_count", "synchronize"]


def _library_path() -> str:
    return os.path.join(os.path.dirname(_library.library_path()), _LIB_NAME)


def _load() -> ctypes.CDLL:
    path = _library_path()
    if not os.path.exists(path):
        raise ImportError(
            f"ampfuse.testing.cuemu needs a test build of ampfuse (the emulated CUDA device, {path}, "
            "is missing): build with `make build` (AMPFUSE_CUDA_EMULATION=ON)."
        )
    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", NAME):
        raise ImportError(
            f"ampfuse.testing.cuemu: torch's PrivateUse1 backend is already "
            f"'{torch._C._get_privateuse1_backend_name()}' in this process."
        )
    torch.ops.load_library(path)
    lib = ctypes.CDLL(path)
    lib.ampfuse_cuemu_sync_count.restype = ctypes.c_ulonglong
    lib.ampfuse_cuemu_set_sync_hook.argtypes = [ctypes.c_void_p]
    return lib


_lib = _load()

# ---- synchronizations -----------------------------------------------------------------------------


@dataclass
class Sync:
    """One synchronizing operation: what it was, and the Python stack that made it."""

    what: str
    stack: list[traceback.FrameSummary] = field(repr=False)

    def __str__(self) -> str:
        return f"{self.what}\n" + "".join(traceback.format_list(self.stack))


_HOOK_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_recorders: list[list[Sync]] = []
_recorders_lock = threading.Lock()


def _on_sync(what: bytes) -> None:
    stack = traceback.extract_stack()[:-1]
    sync = Sync(what.decode(), stack)
    with _recorders_lock:
        for rec in _recorders:
            rec.append(sync)


_hook = _HOOK_TYPE(_on_sync)  # kept alive for the library's lifetime


def sync_count() -> int:
    """How many synchronizing operations ran on ``cuemu`` in this process so far."""
    return int(_lib.ampfuse_cuemu_sync_count())


@contextlib.contextmanager
def counting_syncs() -> Iterator[list[Sync]]:
    """Record each synchronizing operation made inside the block, with its Python stack.

    Yields the list the records are appended to. Nested and concurrent blocks each get every
    synchronization made while they are open.
    """
    records: list[Sync] = []
    with _recorders_lock:
        _recorders.append(records)
        if len(_recorders) == 1:
            _lib.ampfuse_cuemu_set_sync_hook(ctypes.cast(_hook, ctypes.c_void_p))
    try:
        yield records
    finally:
        with _recorders_lock:
            _recorders.remove(records)
            if not _recorders:
                _lib.ampfuse_cuemu_set_sync_hook(None)


# ---- the device module (torch.cuemu) --------------------------------------------------------------


def is_available() -> bool:
    """Always true once this module is imported."""
    return True


def device_count() -> int:
    """One device, ``cuemu:0``."""
    return 1


def current_device() -> int:
    return 0


def set_device(dev: Any) -> None:
    """Check that ``dev`` is cuemu's one device (an index, ``"cuemu"``, ``"cuemu:0"`` or a
    ``torch.device``; None is the current device)."""
    if dev is None or dev == 0:
        return
    d = torch.device(dev)
    if d.type != NAME or d.index not in (None, 0):
        raise ValueError(f"cuemu has one device, cuemu:0; got {dev!r}")


def synchronize(dev: Any = None) -> None:
    """Wait for the device (counted as a synchronization, as on a GPU)."""
    _lib.ampfuse_cuemu_synchronize()


def manual_seed_all(seed: int) -> None:
    """Nothing to seed: random numbers on cuemu come from the CPU generator, which
    ``torch.manual_seed`` seeds (so cuemu draws what the CPU draws)."""


def get_rng_state(dev: Any = None) -> torch.Tensor:
    """The CPU generator's state (cuemu draws from it)."""
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, dev: Any = None) -> None:
    torch.set_rng_state(state)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


def _is_in_bad_fork() -> bool:
    return False


class device:
    """Context manager selecting the device, as ``torch.cuda.device``: cuemu has one, so it checks
    ``dev`` and changes nothing."""

    def __init__(self, dev: Any) -> None:
        set_device(dev)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _device_module() -> ModuleType:
    m = ModuleType(f"torch.{NAME}")
    for f in (is_available, device_count, current_device, set_device, synchronize, manual_seed_all,
              get_rng_state, set_rng_state, get_amp_supported_dtype, _is_in_bad_fork, device):
        setattr(m, f.__name__, f)
    return m


if torch._C._get_privateuse1_backend_name() != NAME:
    torch.utils.rename_privateuse1_backend(NAME)
    torch._register_device_module(NAME, _device_module())
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
