"""Shared test configuration: make the in-tree package importable and define device helpers."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# The framework integration tests (tests/integrations) build their models in code and must never
# reach a hub: set before any of them imports transformers/accelerate (which read these at import).
# (Here and not in a tests/integrations/conftest.py: a second module named `conftest` would shadow
# this one for `from conftest import ...` in the other suites.)
for _var, _value in [("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                     ("TOKENIZERS_PARALLELISM", "false"), ("WANDB_DISABLED", "true")]:
    os.environ.setdefault(_var, _value)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# AMPFUSE_TEST_PACKAGE_DIR: a staged package built for another torch (tools/test_torch.sh).
_PY = os.environ.get("AMPFUSE_TEST_PACKAGE_DIR") or os.path.join(_ROOT, "python")
if _PY not in sys.path:
    sys.path.insert(0, _PY)

import ampfuse  # noqa: E402,F401  (loads the native library once for every test module)

HAS_CUDA = torch.cuda.is_available()

#: True when this run executes CPU tensors through the emulated CUDA kernels
#: (AMPFUSE_CPU_KERNELS=cuda-emulated, `make test` runs every suite once more that way).
EMULATED = os.environ.get("AMPFUSE_CPU_KERNELS") == "cuda-emulated"
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")

#: The emulated CUDA device (ampfuse.testing.cuemu), in the emulated pass of a test build without
#: a GPU: CUDA's registration, guards and host/device copies, with the CUDA kernels emulated
#: (AMPFUSE_TEST_CUEMU=0 leaves it out: the sanitizer pass, which checks the kernels themselves).
HAS_CUEMU = False
if EMULATED and not HAS_CUDA and os.environ.get("AMPFUSE_TEST_CUEMU", "1") != "0":
    import ampfuse.testing.cuemu  # noqa: E402,F401

    HAS_CUEMU = True
requires_cuemu = pytest.mark.skipif(not HAS_CUEMU, reason="the emulated CUDA device runs in the emulated pass")

#: devices to parametrize over: the CUDA tests are collected everywhere, run on a GPU where there
#: is one and on the emulated CUDA device in the emulated pass, and are skipped otherwise
DEVICES = ["cpu", pytest.param("cuemu", marks=requires_cuemu), pytest.param("cuda", marks=requires_cuda)]


def _kernels_line() -> str:
    line = f"ampfuse CPU kernels: {ampfuse.cpu_kernel_info()['kernels']}"
    emu = ampfuse._library.emulator()
    if emu is not None:
        line += (f"; cuemu schedule: {emu.cuemu_schedule().decode()} "
                 "(replay with CUEMU_BLOCK_ORDER, CUEMU_THREAD_ORDER, CUEMU_SEED, CUEMU_WORKERS)")
    return line


def pytest_report_header(config):
    return [_kernels_line()]


def pytest_terminal_summary(terminalreporter):
    # Also at the end, and under -q: which kernels ran, and the emulator's schedule and seed.
    terminalreporter.write_line(_kernels_line())


@pytest.fixture(autouse=True)
def _no_emulator_diagnostics():
    """Under the emulator, a kernel error (divergent barrier, bad warp collective, deadlock) that
    did not already surface as an exception still fails the test that caused it."""
    emu = ampfuse._library.emulator() if EMULATED else None
    if emu is not None:
        emu.cuemu_take_diagnostics()
    yield
    if emu is not None:
        diag = emu.cuemu_take_diagnostics().decode()
        assert diag == "", f"emulated CUDA kernel errors: {diag}"


def pytest_make_parametrize_id(config, val, argname):
    # Readable test ids for dtypes ("bfloat16", not "dtype1"), so that -k can select them.
    if isinstance(val, torch.dtype):
        return str(val).replace("torch.", "")
    return None


def pytest_configure(config):
    # Hypothesis: deterministic, no deadline (CI machines are noisy), no database in the tree.
    try:
        from hypothesis import settings

        settings.register_profile("ampfuse", deadline=None, derandomize=True, database=None)
        settings.load_profile("ampfuse")
    except ImportError:  # pragma: no cover - hypothesis is in requirements-dev.txt
        pass


#: The suites whose tests run longest (a wheel build, the GPU check's dry run, the benchmark smoke
#: run, multi-process jobs), started first: with pytest-xdist handing out whole files in collection
#: order, a long file collected last would leave the other worker idle at the end of the pass.
_LONG_FIRST = ("test_packaging.py", "test_gpu_check.py", "test_bench.py", "test_distributed.py",
               "test_distributed_mesh.py", "test_demo.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        name = os.path.basename(str(item.path))
        return _LONG_FIRST.index(name) if name in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=rank)  # stable: each file keeps its own order


class HostReads(torch.overrides.TorchFunctionMode):
    """Within: records each call that reads a tensor's value on the host (``item``, ``bool``,
    ``float``, ``int``, ``tolist``, ``cpu``, ``numpy``) in ``.reads``, unless ``ignore(tensor)``.
    On a GPU each would be a sync (and an error under CUDA-graph capture)."""

    READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
             torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__index__}

    def __init__(self, ignore=None) -> None:
        super().__init__()
        self.ignore = ignore or (lambda t: False)
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS and args and not self.ignore(args[0]):
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def scaler_counters(scaler):
    """For HostReads' ``ignore``: the scaler's diagnostic counters, which update() reads on a CPU
    (on a GPU: a pinned copy, polled steps later, never during a capture)."""
    return lambda t: t is scaler._stats or getattr(t, "_base", None) is scaler._stats
