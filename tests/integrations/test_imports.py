"""The integrations import their framework only when used, and say which package is missing."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ampfuse_and_integrations_package_import_no_framework():
    code = ("import sys, ampfuse, ampfuse.integrations\n"
            "heavy = [m for m in ('lightning', 'lightning_fabric', 'accelerate', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("module,framework,package,extra", [
    ("lightning", "lightning.pytorch", "lightning", "lightning"),
    ("fabric", "lightning.fabric", "lightning", "lightning"),
    ("accelerate", "accelerate", "accelerate", "accelerate"),
    ("transformers", "transformers", "transformers", "transformers"),
])
def test_missing_framework_names_the_pip_package(monkeypatch, module, framework, package, extra):
    monkeypatch.setitem(sys.modules, framework, None)  # makes `import framework` raise ImportError
    monkeypatch.delitem(sys.modules, f"ampfuse.integrations.{module}", raising=False)
    with pytest.raises(ImportError, match=rf"needs the '{package}' package.*pip install 'ampfuse\[{extra}\]'"):
        importlib.import_module(f"ampfuse.integrations.{module}")
