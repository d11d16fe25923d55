"""Shared test configuration: make the in-tree package importable and define device helpers."""

from __future__ import annotations

import os
import sys

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PY = os.path.join(_ROOT, "python")
if _PY not in sys.path:
    sys.path.insert(0, _PY)

import ampfuse  # noqa: E402,F401  (loads the native library once for every test module)

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")

#: devices to parametrize over: CUDA tests are collected everywhere and skipped without a GPU
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def pytest_configure(config):
    # Hypothesis: deterministic, no deadline (CI machines are noisy), no database in the tree.
    try:
        from hypothesis import settings

        settings.register_profile("ampfuse", deadline=None, derandomize=True, database=None)
        settings.load_profile("ampfuse")
    except ImportError:  # pragma: no cover - hypothesis is in requirements-dev.txt
        pass
